"""Per-engine-step bookkeeping of the KV cache manager: lookup + claim + allocate + register + free.

One step = admit B warm requests of L tokens (their prompt minus the last 128 tokens was served just before,
untimed, so each hits L - 128 and claims its blocks, then allocates blocks up to L) and retire the B requests
admitted in the previous step (commit L tokens: register full blocks + checkpoints, release; free). Ours: ONE
jitted `apply_step` call per step, as in an engine: the retirements are queued on the host (commit / free never
call the device) and applied by the same call that admits the new batch (`add_requests(..., allocate_tokens=...)`)
plus host work (table bookkeeping, packing). `--two_calls` times the old driver (admit, then `flush()` of the
retirements: two calls per step).
Hashing is excluded and reported separately (blake2b of the prompts; an engine hashes as tokens arrive).

Matrix: B x L in {256 x 2k, 64 x 8k, 8 x 32k} (+ 8 x 2k, the only shape that fits a 4k pool), pools of {4k, 65k,
262k} blocks per group (V4-Flash geometry: 128-token full blocks, 32-token swa blocks, 4-block tail). With
`--vllm_src=DIR` vLLM 0.33's own KVCacheManager does the same trace (benchmarks/support/vllm_adapter.py, whose
docstring says how to get vLLM's sources; not a project dependency); without it, or if it does not import, vLLM is
skipped with the reason printed.

`--call_floor`: what one jitted call with both pools donated and one buffer each way costs on this machine (the
floor under any per-step time), then exit.

`--budget`: a different question, hit tokens rather than time. Round-robin chat sessions under a fixed KV byte
budget: total hit tokens with cache v1 checkpoint placement (prompt boundary + end of request) and with cache v2
placement (dense start, re-render, junction; the default). The budget (bytes) is split between the two V4-Flash
pools by `--full_share` and converted to blocks with the groups' bytes per block (`dsv4.caches.group_specs`,
default layout). `--sessions` sessions share a 256-token system prompt; each turn sends the whole history (+ a new
user message of `--user` tokens), the chat template re-renders the last 8 tokens of the previous prompt, and the
answer is `--answer` tokens. Sessions take turns round-robin for `--rounds` rounds; each request is admitted,
prefilled in 512-token chunks, decoded (committed in one go), freed. One row per budget in `--budgets_gib`.

    python -m benchmarks.cache_bench --vllm_src=DIR            # full matrix
    python -m benchmarks.cache_bench --small --vllm_src=DIR    # 4k and 65k pools, 8 x 2k and 8 x 32k
    python -m benchmarks.cache_bench --shapes 256x2048,8x32768 --pools 65536 --vllm_src=DIR
    python -m benchmarks.cache_bench --call_floor --pools 4096,65536,262144
    python -m benchmarks.cache_bench --budget --budgets_gib 0.375,0.5,0.75,1
"""

from __future__ import annotations

import argparse
import copy
import time

import numpy as np

from cache.hashing import ExtraKeys
from cache.manager import KVCacheManager
from dsv4.caches import group_specs
from dsv4.config import v4_flash


def bench(B: int, L: int, pool: int, steps: int, seed: int = 0, profile=None, two_calls: bool = False):
  specs = group_specs(v4_flash())
  m = KVCacheManager(specs, num_blocks={"full": pool, "swa": pool}, enable_events=False)
  rng = np.random.default_rng(seed)
  # each step's batch: B prompts of L tokens; warm = served before without the last 128 tokens
  prompts = [[rng.integers(2, 1000, L).astype(np.int32) for _ in range(B)] for _ in range(steps + 2)]
  t0 = time.perf_counter()
  hashers = {}
  for s, batch in enumerate(prompts):
    for i, p in enumerate(batch):
      hashers[(s, i)] = m._hasher(p, ExtraKeys())
  hash_ms = (time.perf_counter() - t0) / len(prompts) * 1e3
  orig = m._hasher

  ready = {}

  def prepare(s):
    """Fresh copies of batch s's hashers, made untimed (hashing is excluded; commit may extend a hasher)."""
    for i, p in enumerate(prompts[s]):
      h = hashers[(s, i)]
      c = copy.copy(h)
      c.digests, c.blob = list(h.digests), bytearray(h.blob)
      ready[p.ctypes.data] = c

  def cached_hasher(tokens, extra):
    h = ready.pop(tokens.ctypes.data, None) if len(tokens) == L else None
    return orig(tokens, extra) if h is None else h

  def warm(s):
    """Serve batch s's prompts minus the last 128 tokens (fills the cache), untimed, just before step s."""
    m._hasher = orig
    batch = prompts[s]
    ws = [p[:L - 128] for p in batch]
    m.add_requests([(f"w{s}.{i}", w, ExtraKeys()) for i, w in enumerate(ws)])
    for i, w in enumerate(ws):      # chunked prefill: sliding blocks are released as the window moves on
      n = 0
      while n < len(w):
        c = min(2048, len(w) - n)
        assert m.allocate_for(f"w{s}.{i}", c)
        n += c
        m.commit(f"w{s}.{i}", n)
      m.free(f"w{s}.{i}")
    m.flush()
    prepare(s)
    m._hasher = cached_hasher

  times, hits = [], []
  prev = []
  for s, batch in enumerate(prompts):
    warm(s)
    if profile is not None and s >= 2:
      profile.enable()
    t = time.perf_counter()
    calls = m.stats["device_calls"]
    if not two_calls:           # retirements queued on the host, applied by the admitting call (one call per step)
      for rid in prev:
        m.commit(rid, L)
        m.free(rid)
    hs = m.add_requests([(f"r{s}.{i}", p, ExtraKeys()) for i, p in enumerate(batch)],
                        allocate_tokens=[L] * B)
    if two_calls:
      for rid in prev:
        m.commit(rid, L)
        m.free(rid)
      m.flush()   # this step's retirements in a second call
    times.append(time.perf_counter() - t)
    step_calls = m.stats["device_calls"] - calls
    if profile is not None:
      profile.disable()
    hits.append(min(h.num_tokens for h in hs))
    prev = [f"r{s}.{i}" for i in range(B)]
  return {"ms": float(np.median(times[2:]) * 1e3), "hit": min(hits), "hash_ms": hash_ms,
          "calls_per_step": step_calls}


class DeviceProfile:
  """`--device_profile N`: a jax.profiler trace of every timed step (steps 3..); prints the N thunks of the XLA
  CPU program (and runtime events) that take the most time per step, plus their sum. Same enable / disable
  interface as cProfile.Profile, so `bench` treats both alike."""

  def __init__(self):
    import tempfile
    self._tmp = tempfile.mkdtemp(prefix="cache_bench_prof")
    self.dirs = []
    self._on = False

  def enable(self):
    import os
    import jax
    self.dirs.append(os.path.join(self._tmp, str(len(self.dirs))))
    jax.profiler.start_trace(self.dirs[-1])
    self._on = True

  def disable(self):          # bench calls it after every step, profiled or not
    import jax
    if self._on:
      jax.profiler.stop_trace()
      self._on = False

  def report(self, top: int):
    import collections
    import glob
    import os
    import jax
    per, cnt = collections.Counter(), collections.Counter()
    for d in self.dirs:
      path = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]
      for plane in jax.profiler.ProfileData.from_file(path).planes:
        if plane.name != "/host:CPU":
          continue
        for line in plane.lines:
          if line.name.startswith("python"):
            continue
          for ev in line.events:
            k = (line.name[:12], ev.name[:90])
            per[k] += ev.duration_ns / 1e6 / len(self.dirs)
            cnt[k] += 1
    print(f"device profile, ms per step (mean of {len(self.dirs)} timed steps); 'Execute' rows are the whole program "
          "/ the wait for it, the others its thunks:")
    for k, v in per.most_common(top):
      print(f"{v:9.3f} ms {cnt[k] // max(1, len(self.dirs)):5d}/step  {k[0]}  {k[1]}")
    print(f"sum of thunks (excluding Execute rows): {sum(v for k, v in per.items() if 'Execute' not in k[1]):.3f} ms")


def call_floor(pool: int, calls: int = 200) -> dict:
  """What one jitted call costs on this machine before it does any bookkeeping: both V4-Flash pools donated and
  passed through, (a) nothing else, (b) one 16-id scatter per pool; one int32 buffer in, one out (`device_get`), as
  `apply_step_packed` does. Median us per call."""
  import functools

  import jax
  import jax.numpy as jnp

  from cache import pool as P
  specs = group_specs(v4_flash())
  pools = tuple(P.init_pool(pool, g.block_tokens) for g in specs.groups)

  @functools.partial(jax.jit, donate_argnums=0)
  def nothing(pools, buf):
    return pools, buf + 1

  @functools.partial(jax.jit, donate_argnums=0)
  def scatter16(pools, buf):
    return tuple(P._rep(p, ref_N=p.ref_N.at[buf[:16]].add(1)) for p in pools), buf + 1

  out = {}
  buf = np.arange(64, dtype=np.int32)
  for name, fn in (("nothing", nothing), ("scatter16", scatter16)):
    ts = []
    for _ in range(calls):
      t = time.perf_counter()
      pools, r = fn(pools, buf)
      np.asarray(jax.device_get(r))
      ts.append(time.perf_counter() - t)
    out[name] = float(np.median(ts[20:]) * 1e6)
  return out


# ---------------------------------------------------------------- --budget: hit tokens under a fixed byte budget

V1 = dict(dense_start=False, rerender_tokens=0, junction_checkpoints=False)


def budget_run(specs, n_full: int, n_swa: int, sessions: int, rounds: int, answer: int, user: int, v1: bool, seed=0):
  rng = np.random.default_rng(seed)
  m = KVCacheManager(specs, num_full_blocks=n_full, num_swa_blocks=n_swa, enable_events=False, **(V1 if v1 else {}))
  system = rng.integers(2, 1000, 256)
  hist = [system.copy() for _ in range(sessions)]
  total, last_round, computed = 0, 0, 0
  for r in range(rounds):
    for s in range(sessions):
      h = hist[s]
      if r > 0:   # the template re-renders the last 8 tokens of the previous prompt
        h = np.concatenate([h[:-8], rng.integers(2, 1000, 8)])
      prompt = np.concatenate([h, rng.integers(2, 1000, user)])
      rid = f"s{s}.{r}"
      hit = m.add_request(rid, prompt, ExtraKeys()).num_tokens
      n = hit
      while n < len(prompt):
        c = min(512, len(prompt) - n)
        if not m.allocate_for(rid, c):
          raise RuntimeError(f"budget too small: {rid} cannot allocate")
        n += c
        m.commit(rid, n)
      ans = rng.integers(2, 1000, answer)
      m.append_tokens(rid, ans)
      if not m.allocate_for(rid, answer):
        raise RuntimeError(f"budget too small: {rid} cannot allocate its answer")
      m.commit(rid, n + answer)
      m.free(rid)
      hist[s] = np.concatenate([prompt, ans])
      total += hit
      computed += len(prompt) - hit
      if r == rounds - 1:
        last_round += hit
  return total, last_round, computed


def budget_main(a) -> None:
  """`--budget`: one row per budget, v1 vs v2 checkpoint placement (see the module docstring)."""
  specs = group_specs(v4_flash())
  bpb = {g.name: g.bytes_per_block for g in specs.groups}
  print(f"V4-Flash bytes per block: full {bpb['full'] / 2**20:.2f} MiB, swa {bpb['swa'] / 2**20:.2f} MiB; "
        f"{a.sessions} sessions x {a.rounds} rounds, user {a.user} + answer {a.answer} tokens per turn, "
        f"full share {a.full_share}")
  print("| budget GiB | full blocks | swa blocks | v1 total hit tokens | v2 total hit tokens | v1 last round | "
        "v2 last round | v1 computed | v2 computed |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  for gib in [float(x) for x in a.budgets_gib.split(",")]:
    budget = gib * 2**30
    nf = int(budget * a.full_share // bpb["full"])
    ns = int(budget * (1 - a.full_share) // bpb["swa"])
    row = []
    for v1 in (True, False):
      try:
        row.append(budget_run(specs, nf, ns, a.sessions, a.rounds, a.answer, a.user, v1))
      except RuntimeError as e:
        row.append(None)
        print(f"({'v1' if v1 else 'v2'} at {gib} GiB: {e})")
    if None in row:
      continue
    (t1, l1, c1), (t2, l2, c2) = row
    print(f"| {gib:g} | {nf} | {ns} | {t1} | {t2} | {l1} | {l2} | {c1} | {c2} |", flush=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--small", action="store_true")
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--shapes", default="", help="BxL list, e.g. 256x2048,8x32768 (default: the matrix)")
  ap.add_argument("--pools", default="", help="pool blocks per group, e.g. 65536 (default: the matrix)")
  ap.add_argument("--profile", type=int, default=0, help="print the N most expensive functions (cProfile of the "
                  "timed steps of our manager, cumulative time)")
  ap.add_argument("--device_profile", type=int, default=0, help="print the N most expensive XLA thunks per timed "
                  "step (jax.profiler trace of our manager's steps)")
  ap.add_argument("--two_calls", action="store_true", help="time the old driver: admit, then a second device "
                  "call for the retirements")
  ap.add_argument("--vllm_src", default="", help="directory holding vLLM 0.33's unpacked `vllm` package "
                  "(see benchmarks/support/vllm_adapter.py); empty: vLLM is skipped")
  ap.add_argument("--call_floor", action="store_true", help="only print what one jitted call with both pools "
                  "donated and one buffer each way costs here (the floor under any per-step time), then exit")
  bg = ap.add_argument_group("--budget mode: hit tokens of round-robin chat sessions under a fixed KV byte budget, "
                             "cache v1 vs v2 checkpoint placement")
  bg.add_argument("--budget", action="store_true", help="run this mode instead of the per-step matrix")
  bg.add_argument("--budgets_gib", default="1,2,4,8", help="KV byte budgets (GiB), one row each")
  bg.add_argument("--full_share", type=float, default=0.5, help="fraction of the byte budget given to the full pool")
  bg.add_argument("--sessions", type=int, default=8)
  bg.add_argument("--rounds", type=int, default=6)
  bg.add_argument("--answer", type=int, default=150, help="answer tokens per turn")
  bg.add_argument("--user", type=int, default=300, help="new user tokens per turn")
  a = ap.parse_args()
  if a.budget:
    budget_main(a)
    return
  if a.call_floor:
    print("| pool blocks/group | us per call, pools passed through | us per call, + one 16-id scatter per pool |")
    print("| --- | --- | --- |")
    for pool in ([int(x) for x in a.pools.split(",")] if a.pools else [65536]):
      f = call_floor(pool)
      print(f"| {pool} | {f['nothing']:.1f} | {f['scatter16']:.1f} |", flush=True)
    return
  # (8, 2048) is extra: the matrix's other three shapes do not fit a 4k pool, so it is the only 4k-vs-262k comparison
  shapes = [(8, 2048), (8, 32768)] if a.small else [(8, 2048), (256, 2048), (64, 8192), (8, 32768)]
  pools = [4096, 65536] if a.small else [4096, 65536, 262144]
  if a.shapes:
    shapes = [tuple(int(v) for v in x.split("x")) for x in a.shapes.split(",")]
  if a.pools:
    pools = [int(x) for x in a.pools.split(",")]
  vllm_ok = False
  if a.vllm_src:
    try:
      from benchmarks.support import vllm_adapter
      print(f"vLLM KVCacheManager from {vllm_adapter.load(a.vllm_src).__file__}")
      vllm_ok = True
    except Exception as e:  # any import failure: report it, never fail the benchmark
      print(f"vLLM not importable from {a.vllm_src!r} ({type(e).__name__}: {e}); skipped")
  else:
    print("vLLM skipped (no --vllm_src)")
  print("ours = KVCacheManager: commit/free of the previous batch (register + free, queued) + add_requests "
        "(lookup + claim + allocate; with the queued work: one device call per step, two with --two_calls); "
        "hashing excluded (separate column). vLLM = its "
        "KVCacheManager: get_computed_blocks + allocate_slots per request, cache_blocks + free per retired request; "
        "hashing (Request construction) excluded. ms per step, median of steps 3..; hit = smallest hit/request.")
  print("| B | L | pool blocks/group | ours ms/step | ours hit | vLLM ms/step | vLLM hit | vLLM / ours | "
        "our hashing ms/step | our device calls/step |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  res = {}
  for B, L in shapes:
    for pool in pools:
      if 2 * (B * L // 128 + B) > pool:   # two batches are held at once (admitted + retiring)
        print(f"| {B} | {L} | {pool} | pool too small for two batches | | | | | |")
        continue
      prof = None
      if a.profile:
        import cProfile
        prof = cProfile.Profile()
      elif a.device_profile:
        prof = DeviceProfile()
      r = bench(B, L, pool, a.steps, profile=prof, two_calls=a.two_calls)
      if isinstance(prof, DeviceProfile):
        prof.report(a.device_profile)
      elif prof is not None:
        import pstats
        print(f"cProfile {B}x{L} pool {pool} (steps 3..):")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(a.profile)
      res[(B, L, pool)] = r["ms"]
      vm, vh, ratio = "", "", ""
      if vllm_ok:
        v = vllm_adapter.bench(a.vllm_src, B, L, pool, a.steps)
        vm, vh, ratio = f"{v['ms']:.2f}", v["hit"], f"{v['ms'] / r['ms']:.2f}"
      print(f"| {B} | {L} | {pool} | {r['ms']:.2f} | {r['hit']} | {vm} | {vh} | {ratio} | {r['hash_ms']:.1f} | {r['calls_per_step']} |",
            flush=True)
  for B, L in shapes:
    row = [res[(B, L, p)] for p in pools if (B, L, p) in res]
    if len(row) > 1:
      print(f"flatness {B}x{L}: largest / smallest pool = {row[-1] / row[0]:.2f}x")


if __name__ == "__main__":
  main()

"""KV cache bookkeeping per engine step, as the engine pays it, beside vLLM 0.33's KVCacheManager on the same trace.

The trace (one engine step): retire the B requests that ran in the previous step (each computed its last 128 prompt
tokens and sampled one token: `commit(L)`, `append_tokens`, `free`), run the B requests admitted in the previous
step (blocks up to L) and admit B new warm requests of L tokens (their prompt minus its last 128 tokens was served
just before, untimed, so each hits L - 128 and claims its blocks). Per step that is one batch retired, one
allocated, one admitted: vLLM's per-step work.

Ours goes through the engine's calls (`dsv4/engine/engine.py`, `runner.py`), the manager built as the engine builds
it (fixed table rows = max_num_seqs = 3 B: running, admitted, warm-up; width = max_model_len = L,
`set_step_capacity(B x 128, 2 B)`):
  (a) host planning: commit / append_tokens / free of the retiring batch, `allocate_to(rid, L)` and `slot_of` per
      request of the running batch, `queue_admissions` of the new batch, `plan`, and after the step
      `read_results` + `take_admitted` (the new batch's hits);
  (b) the step: the cache's bookkeeping program (`cache.device_state.apply` on the device pools and tables:
      the queued work, then the admissions' search and claim) then a minimal model program (each row's full and swa
      table rows gathered from the device tables as the runner's `_row_tables` does, summed into a [B, 128, 64]
      activation, one 64 x 64 matmul, an argmax per row), dispatched back to back, their two input buffers in one
      `device_put` and their results read back in one `device_get`, as `ModelRunner._call` / `collect` do;
  (c) the same program (same shapes and statics, an admission region of the same shape: one compilation) with an
      all-padding plan (`empty_plan`: nothing registered, freed, allocated or searched) and no host planning.
Reported: marginal bookkeeping per step = (a) + (b) - (c), each step paired with the mean of the two (c) runs made
right after it (interleaved, back to back with the step program; one more (c) runs untimed before the step, after
the untimed warm-up), median over the timed steps; (a), the median of each step's own host time; (b) - (c); vLLM's
step over ours and over (a) alone. The first two steps (compilation) are not timed.
Hashing is excluded on both sides (ours: prompts hashed untimed and handed to the manager; vLLM: Request
construction) and reported separately for ours.

vLLM (`--vllm_src=DIR`, see benchmarks/support/vllm_adapter.py; skipped with the reason when absent): its own
KVCacheManager on the same prompts, its steps interleaved with ours: retire (`cache_blocks` + `free`) then per
admitted request `get_computed_blocks` (the shared-prefix junction stored on the request, as its scheduler does) +
`allocate_slots`. Settings: its 0.33 engine default `prefix_cache_retention_interval=0` (CacheConfig's default,
passed unchanged into KVCacheConfig for every model; `--vllm_retention dense` = None, a tail at every aligned
boundary, what this bench used before), one shared pool of 2 x pool blocks, hashes every 32 tokens, caching on.
Its time is host Python only (nothing reaches a device); ours includes the device work and transfers of our calls.

Matrix: B x L in {256 x 2k, 64 x 8k, 8 x 32k, 8 x 2k} x pools of {4k, 65k, 262k} blocks per group (V4-Flash
geometry: 128-token full blocks, 32-token swa blocks, 4-block tail). A point whose pool cannot hold two batches is
skipped (of these shapes only 8 x 2k fits 4k blocks). Flatness per shape: our marginal at the largest pool over the
smallest pool that fit, within 1.5x or not.

`--call_floor`: what one standalone jitted call with both pools donated and one buffer each way costs here (the
floor under any standalone call: `add_requests`, `flush`, lookups), then exit.

`--budget`: a different question, hit tokens rather than time. Round-robin chat sessions under a fixed KV byte
budget: total hit tokens with cache v1 checkpoint placement (prompt boundary + end of request) and with cache v2
placement (dense start, re-render, junction; the default). The budget (bytes) is split between the two V4-Flash
pools by `--full_share` and converted to blocks with the groups' bytes per block (`dsv4.caches.group_specs`,
default layout). `--sessions` sessions share a 256-token system prompt; each turn sends the whole history (+ a new
user message of `--user` tokens), the chat template re-renders the last 8 tokens of the previous prompt, and the
answer is `--answer` tokens. Sessions take turns round-robin for `--rounds` rounds; each request is admitted,
prefilled in 512-token chunks, decoded (committed in one go), freed. One row per budget in `--budgets_gib`.

    python -m benchmarks.cache_bench --vllm_src=DIR            # full matrix
    python -m benchmarks.cache_bench --small --vllm_src=DIR    # 8 x 2k at 4k and 65k blocks
    python -m benchmarks.cache_bench --shapes 256x2048,8x32768 --pools 65536 --vllm_src=DIR
    python -m benchmarks.cache_bench --call_floor --pools 4096,65536,262144
    python -m benchmarks.cache_bench --budget --budgets_gib 0.375,0.5,0.75,1

Time goes mostly to XLA compiles (about 5 programs per point, 10-15 s each on 2 cores; a point's pool size is part
of every shape): `--small` takes 2-2.5 minutes of CPU, about 1 minute with a warm `--compilation_cache_dir DIR`
(reruns skip the compiles); the full matrix about 15-20 minutes.
"""

from __future__ import annotations

import collections
import copy
import cProfile
import functools
import gc
import glob
import json
import os
import pstats
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.support import vllm_adapter
from benchmarks.support.vllm_adapter import VllmStep
from cache import device_state, pool, step as cache_step, step_queue
from cache.hashing import ExtraKeys
from cache.manager import KVCacheManager
from dsv4.caches import group_specs
from dsv4.config import v4_flash

FLAGS = flags.FLAGS

CHUNK = 128          # tokens each admitted request computes in its step (its prompt past the warm hit)
MODEL_DIM = 64       # the minimal model body's width
VOCAB = 1024
SWA_TAIL = 127       # swa rows before a chunk's start that it reads (V4-Flash window 128)


def _pow2(n: int, lo: int = 8) -> int:
  w = lo
  while w < n:
    w *= 2
  return w


@functools.partial(jax.jit, static_argnames=("names", "rows", "full_w", "swa_w"))
def model_body(tables, model_buf, params, *, names, rows, full_w, swa_w):
  """A minimal model program: each row's tables gathered at its slot as `dsv4.engine.step_program._row_tables` does
  (full from entry 0, swa from its base block), feeding a small body so XLA cannot drop the table work.
  model_buf: slot [R], swa base block [R], chunk tokens [R x CHUNK]. Returns a token per row."""
  R = rows
  slot, base = model_buf[:R], model_buf[R:2 * R]
  tok = model_buf[2 * R:].reshape(R, CHUNK)
  tab = dict(zip(names, tables))
  full = tab["full"][slot, :full_w]                                            # [R, full_w]
  w = tab["swa"].shape[1]
  cols = base[:, None] + jnp.arange(swa_w, dtype=jnp.int32)[None]
  swa = jnp.where(cols < w, tab["swa"][slot[:, None], jnp.minimum(cols, w - 1)], -1)   # [R, swa_w]
  feat = (jnp.sum(jnp.maximum(full, 0), 1) + jnp.sum(jnp.maximum(swa, 0), 1)).astype(jnp.float32) * 1e-6
  x = params["emb"][tok] + feat[:, None, None]                                 # [R, CHUNK, D]
  h = jnp.tanh(x @ params["w"])
  return jnp.argmax(jnp.sum(h, 1), -1).astype(jnp.int32)                      # [R]


def step_program(state, plan, kv_buf, model_buf, params, *, names, rows, full_w, swa_w):
  """The engine's step reduced to what touches the cache, one pass over the cache's device state as
  `ModelRunner._call` makes it: the cache's bookkeeping program (`device_state.apply`: the queued work, which
  writes the device tables), then the model program reading those tables, back to back with no host read between.
  Returns (state, (tokens, the bookkeeping's result counters))."""
  state, kv_res = device_state.apply(state, plan, kv_buf)
  toks = model_body(state.tables, model_buf, params, names=names, rows=rows, full_w=full_w, swa_w=swa_w)
  return state, (toks, kv_res)


class Ours:
  """Our KVCacheManager driven through the engine's calls (module docstring: (a), (b), (c))."""

  def __init__(self, B: int, L: int, pool: int, prompts):
    self.B, self.L = B, L
    specs = group_specs(v4_flash())
    self.m = m = KVCacheManager(specs, num_blocks={"full": pool, "swa": pool}, enable_events=False,
                                num_slots=3 * B, max_tokens=L)
    m.set_step_capacity(B * CHUNK, 2 * B)
    self.empty = None                        # (c)'s plan: all padding, the step's shape (made at the first warm-up)
    self.model_bufs = {}
    start = L - CHUNK
    base = max(0, start - SWA_TAIL) // 32
    full_w = min(m.table_width("full"), _pow2(-(-L // 128)))
    swa_w = min(m.table_width("swa"), _pow2(-(-L // 32) - base))
    self._shape = dict(names=m.groups, rows=B, full_w=full_w, swa_w=swa_w)
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    self.params = {"emb": jax.random.normal(k1, (VOCAB, MODEL_DIM), jnp.float32),
                   "w": jax.random.normal(k2, (MODEL_DIM, MODEL_DIM), jnp.float32) / 8}
    self.base = base
    self.prompts = prompts
    # hashing is excluded: every prompt is hashed once here; the manager gets a fresh copy of its hasher (commit may
    # extend it) through `_hasher`, looked up by the prompt array's address
    t0 = time.perf_counter()
    self._hashers = {}
    for s, batch in enumerate(prompts):
      for i, p in enumerate(batch):
        self._hashers[(s, i)] = m._hasher(p, ExtraKeys())
    self.hash_ms = (time.perf_counter() - t0) / len(prompts) * 1e3
    self._orig = m._hasher
    self._ready = {}
    self.prev, self.rows, self.slots = [], [], np.arange(B, dtype=np.int32)

  def _cached_hasher(self, tokens, extra):
    h = self._ready.pop(tokens.ctypes.data, None) if len(tokens) == self.L else None
    return self._orig(tokens, extra) if h is None else h

  def warm(self, s: int):
    """Serve batch s's prompts minus their last 128 tokens (fills the cache), untimed, just before step s (which
    admits batch s); then prepare step s's hashers and the model input of batch s's rows (untimed: the model input
    is the same for (b) and (c); batch s runs in step s + 1)."""
    m, L, B = self.m, self.L, self.B
    m._hasher = self._orig
    rids = [f"w{s}.{i}" for i in range(B)]
    m.add_requests([(rid, p[:L - CHUNK], ExtraKeys()) for rid, p in zip(rids, self.prompts[s])])
    n = 0
    while n < L - CHUNK:            # chunked prefill, all B together: sliding blocks are released as the window moves
      c = min(2048, L - CHUNK - n)
      for rid in rids:
        if not m.allocate_for(rid, c):
          raise RuntimeError(f"ours: out of blocks in the warm-up at {B} x {L}")
      n += c
      for rid in rids:              # the first commit applies the round's allocations (one call per round)
        m.commit(rid, n)
    for rid in rids:
      m.free(rid)
    m.flush()
    for i, p in enumerate(self.prompts[s]):
      h = self._hashers[(s, i)]
      c = copy.copy(h)
      c.digests, c.blob = list(h.digests), bytearray(h.blob)
      self._ready[p.ctypes.data] = c
    m._hasher = self._cached_hasher
    buf = np.empty(2 * B + B * CHUNK, np.int32)
    buf[B:2 * B] = self.base
    buf[2 * B:] = np.stack([p[L - CHUNK:] for p in self.prompts[s]]).reshape(-1) % VOCAB
    self.model_bufs[s] = buf
    if self.empty is None:          # (c): the step's shape with an admission region of batch s's shape, all padding
      self.empty = m.empty_plan(m.queue.admit_dims(self.prompts[s]))

  def _run(self, plan, slots, s):
    """(b) / (c): the step program's dispatch: model input packed, both buffers in one device_put, one pass over
    the cache's device state, the one result buffer read."""
    m = self.m
    buf = self.model_bufs[s].copy()
    buf[:self.B] = slots
    kv, mb = jax.device_put([plan.buf, buf])
    out = m.device.advance(step_program, plan, kv, mb, self.params, **self._shape)
    toks, kv_res = jax.device_get(out)                       # one device -> host transfer, as `collect` makes
    return np.concatenate([np.asarray(toks), np.asarray(kv_res)])

  def empty_step(self, s: int) -> float:
    """(c): the step program with the empty plan, no host planning. Seconds."""
    t = time.perf_counter()
    self._run(self.empty, self.slots, max(s - 1, 0))
    return time.perf_counter() - t

  def step(self, s: int, profile=None) -> dict:
    """One engine step (a) + (b): retire the rows of the last step (batch s - 2), run batch s - 1 (admitted in the
    last step: blocks up to L), admit batch s (search and claim in this step's program). Seconds per part; hit
    tokens of batch s."""
    m, L, B = self.m, self.L, self.B
    rids = [f"r{s}.{i}" for i in range(B)]
    reqs = [(rid, p, ExtraKeys()) for rid, p in zip(rids, self.prompts[s])]
    if profile is not None:
      profile.enable()
    t0 = time.perf_counter()
    for rid in self.prev:                 # retire (the engine: commit at dispatch, append + free at collect)
      m.commit(rid, L)
      m.append_tokens(rid, [1])
      m.free(rid)
    t1 = time.perf_counter()
    for rid in self.rows:
      if not m.allocate_to(rid, L):
        raise RuntimeError(f"ours: out of blocks at {B} x {L}")
    slots = np.fromiter((m.slot_of(rid) for rid in self.rows), np.int32, B) if self.rows else self.slots
    m.queue_admissions(reqs)              # the step's admissions: they ride its program
    plan = m.plan()
    t3 = time.perf_counter()
    out = self._run(plan, slots, max(s - 1, 0))
    t4 = time.perf_counter()
    m.read_results(plan, out[B:])
    hits = m.take_admitted()
    t5 = time.perf_counter()
    if profile is not None:
      profile.disable()
    if self.rows and plan.statics != self.empty.statics:
      diff = [(k, v, w) for (k, v), (_, w) in zip(plan.statics, self.empty.statics) if v != w]
      raise RuntimeError(f"the step plan's statics differ from the empty plan's ({diff}): (b) and (c) are different "
                         "programs")
    if [r for r, _ in hits] != rids:
      raise RuntimeError("ours: the step's admissions were not resolved by its results")
    self.prev, self.rows, self.slots = self.rows, rids, slots
    return {"total": t5 - t0, "retire": t1 - t0, "plan": (t3 - t1) + (t5 - t4), "host": (t5 - t0) - (t4 - t3),
            "program": t4 - t3,
            "hit": sum(h.num_tokens for _, h in hits), "min_hit": min(h.num_tokens for _, h in hits)}

  def check(self):
    """The device tables agree with the host's counts for every held request (reads the device; untimed)."""
    for rid in self.prev:
      self.m.block_tables(rid)


def make_prompts(B: int, L: int, steps: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  return [[rng.integers(2, 1000, L).astype(np.int32) for _ in range(B)] for _ in range(steps + 2)]


def bench(B: int, L: int, pool: int, steps: int, seed: int = 0, vllm_src: str = "", vllm_retention=0,
          profile=None) -> dict:
  """One matrix point: ours (and vLLM when vllm_src is given) on the same prompts, steps interleaved. Medians of the
  timed steps (the first two are dropped) in ms; hit tokens per step (the batch's sum) and per request (smallest)."""
  prompts = make_prompts(B, L, steps, seed)
  ours = Ours(B, L, pool, prompts)
  v = None
  if vllm_src:
    v = VllmStep(vllm_src, pool, L, retention_interval=vllm_retention)
    vreqs = [[v.request(f"r{s}.{i}", p) for i, p in enumerate(batch)] for s, batch in enumerate(prompts)]  # hashing
  rows, vrows = [], []
  vprev = []
  for s in range(len(prompts)):
    timed = s >= 2
    ours.warm(s)
    if v is not None:
      v.warm(prompts[s], CHUNK, s)
    gc.collect()
    # (c) right after the warm-up runs cold (caches flushed by the warm-up, a bench artifact the engine does not
    # have), so it is run once untimed; the step's (c) is the mean of the two runs right after it, back to back with
    # the step program as an engine's steps are
    ours.empty_step(s)
    r = ours.step(s, profile if timed else None)
    r["empty"] = (ours.empty_step(s) + ours.empty_step(s)) / 2
    r["marginal"] = r["total"] - r["empty"]
    if timed:
      rows.append(r)
    if v is not None:
      t = time.perf_counter()
      for q in vprev:
        v.finish(q, L)
      hs = [v.admit(q, L) for q in vreqs[s]]
      dt = time.perf_counter() - t
      vprev = vreqs[s]
      if timed:
        vrows.append({"total": dt, "hit": sum(hs), "min_hit": min(hs)})
  ours.check()

  def med(rs, k):
    return float(np.median([x[k] for x in rs]) * 1e3)

  out = {k: med(rows, k) for k in ("marginal", "total", "retire", "plan", "host", "program", "empty")}
  out["prog_minus_empty"] = float(np.median([x["program"] - x["empty"] for x in rows]) * 1e3)
  out["hit"] = min(x["hit"] for x in rows)
  out["min_hit"] = min(x["min_hit"] for x in rows)
  out["hash_ms"] = ours.hash_ms
  out["overflows"] = ours.m.stats["step_plan_overflows"]
  if vrows:
    out["vllm"] = {"ms": med(vrows, "total"), "hit": min(x["hit"] for x in vrows),
                   "min_hit": min(x["min_hit"] for x in vrows)}
  return out


class DeviceProfile:
  """`--device_profile N`: a jax.profiler trace of every timed step (steps 3..); prints the N thunks of the XLA
  CPU program (and runtime events) that take the most time per step, plus their sum. Same enable / disable
  interface as cProfile.Profile, so `bench` treats both alike."""

  def __init__(self):
    self._tmp = tempfile.mkdtemp(prefix="cache_bench_prof")
    self.dirs = []
    self._on = False

  def enable(self):
    self.dirs.append(os.path.join(self._tmp, str(len(self.dirs))))
    jax.profiler.start_trace(self.dirs[-1])
    self._on = True

  def disable(self):          # bench calls it after every step, profiled or not
    if self._on:
      jax.profiler.stop_trace()
      self._on = False

  def report(self, top: int):
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


def call_floor(num_blocks: int, calls: int = 200) -> dict:
  """What one jitted call costs on this machine before it does any bookkeeping: both V4-Flash pools donated and
  passed through, (a) nothing else, (b) one 16-id scatter per pool; one int32 buffer in, one out (`device_get`), as
  `device_state.apply` does. Median us per call (num_blocks per pool)."""
  specs = group_specs(v4_flash())
  pools = tuple(pool.init_pool(num_blocks, g.block_tokens) for g in specs.groups)

  @functools.partial(jax.jit, donate_argnums=0)
  def nothing(pools, buf):
    return pools, buf + 1

  @functools.partial(jax.jit, donate_argnums=0)
  def scatter16(pools, buf):
    return tuple(pool._rep(p, ref_N=p.ref_N.at[buf[:16]].add(1)) for p in pools), buf + 1

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


def _load() -> str:
  try:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())
  except OSError:
    return "unknown"


def _retention(arg: str):
  return {"engine": 0, "dense": None}[arg] if arg in ("engine", "dense") else int(arg)


def define_flags(fv: flags.FlagValues = FLAGS) -> None:
  f = dict(flag_values=fv)
  flags.DEFINE_bool("small", False, "8 x 2k at 4k and 65k blocks only", **f)
  flags.DEFINE_integer("steps", 5, "timed steps per point (two more run first, untimed)", **f)
  flags.DEFINE_string("shapes", "", "BxL list, e.g. 256x2048,8x32768 (default: the matrix)", **f)
  flags.DEFINE_string("pools", "", "pool blocks per group, e.g. 65536 (default: the matrix)", **f)
  flags.DEFINE_integer("profile", 0, "print the N most expensive functions (cProfile of our timed steps, (a) + (b), "
                       "cumulative time)", **f)
  flags.DEFINE_integer("device_profile", 0, "print the N most expensive XLA thunks per timed step (jax.profiler "
                       "trace of our steps)", **f)
  flags.DEFINE_string("vllm_src", "", "directory holding vLLM 0.33's unpacked `vllm` package (see "
                      "benchmarks/support/vllm_adapter.py); empty: vLLM is skipped", **f)
  flags.DEFINE_string("vllm_retention", "engine", "vLLM's prefix_cache_retention_interval: engine (its 0.33 engine "
                      "default, 0), dense (None) or a multiple of 128", **f)
  flags.DEFINE_string("compilation_cache_dir", "", "persistent XLA compilation cache (opt-in; '' = off): a rerun of "
                      "the same points skips their compiles, which are most of a point's time", **f)
  flags.DEFINE_string("cache_cpu_options", "", "JSON object of XLA options for the cache's programs on the CPU "
                      "instead of `cache.step.CPU_COMPILER_OPTIONS`, e.g. '{\"xla_backend_optimization_level\": 0}' "
                      "(their compile / runtime trade)", **f)
  flags.DEFINE_integer("free_chunk_max", 0, "entries per chunk of the step program's release loop, at most "
                       "(`cache.step_queue.FREE_CHUNK_MAX`; 0 = its default)", **f)
  flags.DEFINE_bool("call_floor", False, "only print what one standalone jitted call with both pools donated and one "
                    "buffer each way costs here, then exit", **f)
  # --budget mode: hit tokens of round-robin chat sessions under a fixed KV byte budget, cache v1 vs v2 checkpoint
  # placement
  flags.DEFINE_bool("budget", False, "run the budget mode (hit tokens of round-robin chat sessions under a fixed KV "
                    "byte budget) instead of the per-step matrix", **f)
  flags.DEFINE_string("budgets_gib", "1,2,4,8", "--budget: KV byte budgets (GiB), one row each", **f)
  flags.DEFINE_float("full_share", 0.5, "--budget: fraction of the byte budget given to the full pool", **f)
  flags.DEFINE_integer("sessions", 8, "--budget: chat sessions", **f)
  flags.DEFINE_integer("rounds", 6, "--budget: rounds of turns", **f)
  flags.DEFINE_integer("answer", 150, "--budget: answer tokens per turn", **f)
  flags.DEFINE_integer("user", 300, "--budget: new user tokens per turn", **f)


def main(argv, fv: flags.FlagValues = FLAGS):
  del argv
  a = fv
  if a.cache_cpu_options:
    try:
      cache_step.CPU_COMPILER_OPTIONS = dict(json.loads(a.cache_cpu_options))
    except (ValueError, TypeError) as e:
      raise app.UsageError(f"--cache_cpu_options: a JSON object of XLA options ({e})", exitcode=2)
  if a.free_chunk_max < 0:
    raise app.UsageError(f"--free_chunk_max: a positive entry count, or 0 for the default (got "
                         f"{a.free_chunk_max})", exitcode=2)
  if a.free_chunk_max:
    step_queue.FREE_CHUNK_MAX = a.free_chunk_max
  if a.compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(a.compilation_cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
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
  shapes = [(8, 2048)] if a.small else [(256, 2048), (64, 8192), (8, 32768), (8, 2048)]
  pools = [4096, 65536] if a.small else [4096, 65536, 262144]
  if a.shapes:
    shapes = [tuple(int(v) for v in x.split("x")) for x in a.shapes.split(",")]
  if a.pools:
    pools = [int(x) for x in a.pools.split(",")]
  retention = _retention(a.vllm_retention)
  vllm_src = ""
  if a.vllm_src:
    try:
      print(f"vLLM KVCacheManager from {vllm_adapter.load(a.vllm_src).__file__}")
      vllm_src = a.vllm_src
    except Exception as e:  # any import failure: report it, never fail the benchmark
      print(f"vLLM not importable from {a.vllm_src!r} ({type(e).__name__}: {e}); skipped")
  else:
    print("vLLM skipped (no --vllm_src)")
  print(f"load average at start: {_load()} ({os.cpu_count()} CPUs)")
  print("ours: KVCacheManager through the engine's calls, settings: its defaults (retention_interval=0, dense start, "
        "re-render 64, junction checkpoints), events off, table rows 3 B, width L, step capacity B x 128 tokens / 2 B "
        "rows. A step retires batch s - 2, runs batch s - 1 (admitted in the last step) and admits batch s (queued: "
        "search and claim in the step's bookkeeping program, hits read with its results). marginal = (a) host "
        "planning + (b) the step (bookkeeping program incl. the admissions + minimal model body, transfers) - (c) "
        "the same program with an all-padding plan; (b)-(c) = the program's share.")
  if vllm_src:
    print(f"vLLM 0.33: KVCacheManager, prefix_cache_retention_interval={retention!r}"
          f"{' (its engine default)' if retention == 0 else ' (NOT its engine default)'}, one pool of 2 x pool "
          "blocks, hash block 32, retire = cache_blocks + free, admit = get_computed_blocks (junction stored) + "
          "allocate_slots; host Python only.")
  print("ms per step, median of the timed steps; hit tokens per step = the batch's sum (per request: hit / B). "
        "Hashing excluded on both sides.")
  print("| B | L | pool blocks/group | ours marginal ms | host planning ms | (b)-(c) ms | "
        "empty program (c) ms | ours hit tok/step | vLLM ms | vLLM hit tok/step | vLLM / ours | "
        "our hashing ms/step (excluded) | vLLM / our host planning |")
  print("|" + " --- |" * 13)
  res = {}
  for B, L in shapes:
    for pool in pools:
      if 2 * (B * L // 128 + B) > pool:   # two batches are held at once (admitted + retiring)
        print(f"| {B} | {L} | {pool} | pool too small for two batches |" + " |" * 9, flush=True)
        continue
      prof = None
      if a.profile:
        prof = cProfile.Profile()
      elif a.device_profile:
        prof = DeviceProfile()
      r = bench(B, L, pool, a.steps, vllm_src=vllm_src, vllm_retention=retention, profile=prof)
      if isinstance(prof, DeviceProfile):
        prof.report(a.device_profile)
      elif prof is not None:
        print(f"cProfile {B}x{L} pool {pool} (timed steps):")
        pstats.Stats(prof).sort_stats("cumulative").print_stats(a.profile)
      res[(B, L, pool)] = r["marginal"]
      vm = vh = ratio = host_ratio = ""
      if "vllm" in r:
        v = r["vllm"]
        vm, vh, ratio = f"{v['ms']:.2f}", v["hit"], f"{v['ms'] / r['marginal']:.2f}"
        host_ratio = f"{v['ms'] / r['host']:.2f}"
      if r["overflows"]:
        print(f"(note: {r['overflows']} step plans overflowed their fixed widths and ran a call of their own)")
      print(f"| {B} | {L} | {pool} | {r['marginal']:.2f} | {r['host']:.2f}"
            f" | {r['prog_minus_empty']:.2f} | {r['empty']:.2f} | {r['hit']} | {vm} | {vh} | {ratio} | "
            f"{r['hash_ms']:.1f} | {host_ratio} |", flush=True)
      # every point compiles its own programs (the pool size is part of each shape): drop them, or a full matrix
      # holds enough live executables to reach vm.max_map_count and XLA aborts ("Cannot allocate memory")
      jax.clear_caches()
      gc.collect()
  for B, L in shapes:
    row = [(p, res[(B, L, p)]) for p in pools if (B, L, p) in res]
    if len(row) > 1:
      (fewest_blocks, at_fewest), (most_blocks, at_most) = row[0], row[-1]
      f = at_most / at_fewest
      print(f"flatness {B}x{L}: ours at {most_blocks} / {fewest_blocks} blocks = {f:.2f}x "
            f"({'within' if f <= 1.5 else 'NOT within'} 1.5x)")
  print(f"load average at end: {_load()}")


if __name__ == "__main__":
  define_flags()
  app.run(main)

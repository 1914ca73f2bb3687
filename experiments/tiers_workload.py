"""KV tiers workload benchmark (docs/tiers.md). Prints tables, writes <out_dir>/tiers_workload.{csv,json,png} and
<out_dir>/tiers_resume.{csv,json}.

Part A — more sessions than the device holds (long shared documents + agent sessions that go idle and come
back). 8 sessions over 2 shared 1024-token documents, 3 turns each, submitted one at a time round-robin, so every
session comes back after 7 others have run; the device pool holds ~1.5 sessions. Same engine config and workload
with tiers off / L2 (host) / L2+L3 (host, disk) / L2+L3+L4 (host, disk, Redis), host and disk capacities limited
(1/2 and 1 session's worth) so each lower tier has something to add. Cost model on (policy auto).

Part B — one resumed session of 8k and 32k tokens: TTFT of the next turn when its prefix is reloaded from each tier
(host, disk, Redis, Mooncake; device cache dropped) vs recomputed, and the cost model's choice (with the speeds
it measured) against the path that was actually faster.

    python -m experiments.tiers_workload                 # both parts (~10-20 min on 2 CPU cores) -> out/tiers_workload/
    python -m experiments.tiers_workload --parts=a --lengths=8192
    python -m experiments.tiers_workload --refresh_results   # refresh the committed experiments/results/tiers/
    python -m experiments.tiers_workload --replot --refresh_results   # re-draw the committed plot from its table

Output goes to --out_dir (default out/tiers_workload/, untracked); --refresh_results writes the committed
experiments/results/tiers/ instead. --replot re-draws tiers_workload.png from the tiers_workload.json already there.
Other flags: --sessions (part A), --mooncake (part B).

Plot (part A): TTFT percentiles and hit / computed tokens per tier configuration (categories, one bar group each).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from cache.tiers.backends import MooncakeBackend
from cache.tiers.servers import MooncakeServer, RedisServer
from dsv4 import config, model
from dsv4.caches import group_specs
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.tiering_config import TieringConfig
from experiments import plotting

FLAGS = flags.FLAGS
SCRIPT = "tiers_workload"
RESULTS_SUBDIR = "tiers"


def define_flags():
  """The command line (defined when run as a script, so importing `plot` defines no flags)."""
  flags.DEFINE_string("parts", "ab", "a = sessions workload, b = resume TTFT per tier.")
  flags.DEFINE_list("lengths", ["8192", "32768"], "Session lengths of part B.")
  flags.DEFINE_integer("sessions", 8, "Part A sessions.")
  flags.DEFINE_bool("mooncake", True, "Include the Mooncake tier in part B.")
  flags.DEFINE_bool("replot", False, "Re-draw the part A plot from the table already in the output directory.")
  plotting.define_output_flags(SCRIPT, "tables and the plot", RESULTS_SUBDIR)


def _pct(a, q):
  return float(np.percentile(a, q)) if len(a) else float("nan")


def _submit(eng, rid, prompt, max_tokens):
  eng.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
  eng.run()
  r = eng.requests[rid]
  assert r.error is None, r.error
  return r


def part_a(cfg, params, redis_url, tmp):
  ec = EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, chunk_size=256, max_model_len=4096,
                    num_full_blocks=24, num_swa_blocks=64, record_logits=False)
  sp = group_specs(cfg, ec.layout)
  rng = np.random.default_rng(0)
  V = cfg.vocab_size
  docs = [list(rng.integers(2, V, 1024)) for _ in range(2)]
  S, turns, answer, user = FLAGS.sessions, 3, 16, 96
  own = [list(rng.integers(2, V, 128)) for _ in range(S)]
  users = [[list(rng.integers(2, V, user)) for _ in range(turns)] for _ in range(S)]
  sess_tokens = 1024 + 128 + turns * (answer + user)
  sess_bytes = (sess_tokens // 128) * sp.full.bytes_per_block + 3 * sp.swa.need_blocks * sp.swa.bytes_per_block
  configs = [("off", ()), ("L2", ("host",)), ("L2+L3", ("host", "disk")), ("L2+L3+L4", ("host", "disk", "redis"))]
  rows, ttfts = [], {}
  # warm-up: compile both step shapes once (excluded)
  warm = Engine(params, cfg, ec)
  _submit(warm, "w", [int(t) for t in rng.integers(2, V, 300)], 2)
  for name, tiers in configs:
    tc = None
    if tiers:
      disk = os.path.join(tmp, f"disk_{name}")
      caps = (sess_bytes // 2, sess_bytes, 1 << 34)[:len(tiers)]
      tc = TieringConfig(tiers=tiers, disk_dir=disk, store_url=redis_url.replace("/0", f"/{len(rows) + 3}"),
                         capacity_bytes=caps, policy="auto", engine_id=name)
    eng = Engine(params, cfg, dataclasses.replace(ec, tiering=tc))
    if eng.tiering is not None:
      eng.tiering.warmup()
    history = [[] for _ in range(S)]
    resumed_ttft, all_ttft = [], []
    hit = tier_hit = computed = recomputed = 0
    for t in range(turns):
      for s in range(S):
        prompt = (docs[s % 2] + own[s] if t == 0 else history[s]) + users[s][t]
        prompt = [int(x) for x in prompt]
        reuse = (len(history[s]) - 1) // 128 * 128 if t else 0
        t0 = eng.stats["computed_tokens"]
        r = _submit(eng, f"s{s}.t{t}", prompt, answer)
        ttft = r.first_token_time - r.arrival
        all_ttft.append(ttft)
        if t:  # a resumed turn: tokens computed before (aligned) that were not hit were recomputed
          resumed_ttft.append(ttft)
          recomputed += max(0, reuse - r.hit_tokens)
        hit += r.hit_tokens
        computed += eng.stats["computed_tokens"] - t0
        history[s] = r.all_tokens
    if eng.tiering is not None:
      eng.tiering.flush()
      tier_hit = eng.tiering.stats["tier_hit_tokens"]
      per_tier = {t["tier"]: t.get("hit_tokens", 0) for t in eng.tiering.summary()["tiers"]}
      dec = eng.tiering.stats
    else:
      per_tier, dec = {}, {}
    row = {"config": name, "hit_tokens": hit, "tier_hit_tokens": tier_hit, "device_hit_tokens": hit - tier_hit,
           "recomputed_tokens": recomputed, "computed_tokens": computed,
           "ttft_p50_s": _pct(all_ttft, 50), "ttft_p95_s": _pct(all_ttft, 95), "ttft_p99_s": _pct(all_ttft, 99),
           "resumed_ttft_p50_s": _pct(resumed_ttft, 50), "resumed_ttft_p99_s": _pct(resumed_ttft, 99),
           **{f"hit_tokens_{k}": v for k, v in per_tier.items()},
           "l1_copied_records": dec.get("l1_copied_records", 0), "loaded_records": dec.get("loaded_records", 0),
           "chose_load": dec.get("chose_load", 0), "chose_recompute": dec.get("chose_recompute", 0)}
    rows.append(row)
    ttfts[name] = all_ttft
    if eng.tiering is not None:
      eng.tiering.close()
  return rows, ttfts, sess_bytes


def part_b(cfg, params, redis_url, mooncake_url, tmp, lengths):
  rows = []
  for L in lengths:
    ec = EngineConfig(max_num_seqs=1, max_num_batched_tokens=2048, chunk_size=2048, max_model_len=L + 256,
                      num_full_blocks=L // 128 + 8, num_swa_blocks=128, record_logits=False)
    rng = np.random.default_rng(L)
    V = cfg.vocab_size
    p1 = [int(t) for t in rng.integers(2, V, L)]
    url = redis_url.replace("/0", "/9")
    disk = os.path.join(tmp, f"disk_b{L}")
    A = Engine(params, cfg, dataclasses.replace(ec, tiering=TieringConfig(
        tiers=("host", "disk", "redis"), disk_dir=disk, store_url=url, policy="load", engine_id=f"A{L}",
        write_queue=4096)))
    _submit(A, "warm", [int(t) for t in rng.integers(2, V, 300)], 1)   # compile
    A.tiering.warmup()
    t0 = time.perf_counter()
    r1 = _submit(A, "turn1", p1, 1)
    prefill_s = time.perf_counter() - t0
    prefill_tps = A.tiering.cost.prefill_tps
    p2 = r1.all_tokens + [int(t) for t in rng.integers(2, V, 64)]
    A.tiering.drop_device_cache()
    if mooncake_url:
      import redis  # local: the Redis client, needed only with a Mooncake store
      src, mc = redis.Redis.from_url(url), MooncakeBackend(mooncake_url)
      for k in src.scan_iter("dsv4kv:*"):
        mc.put(k.decode(), src.get(k))
      mc.close()
    # recompute: no tiers, cold device
    R0 = Engine(params, cfg, ec)
    _submit(R0, "warm", [int(t) for t in rng.integers(2, V, 300)], 1)
    rr = _submit(R0, "turn2", p2, 1)
    rec_ttft = rr.first_token_time - rr.arrival
    rows.append({"tokens": L, "path": "recompute", "ttft_s": rec_ttft, "hit_tokens": rr.hit_tokens,
                 "turn1_prefill_s": prefill_s, "measured_prefill_tok_s": prefill_tps})
    tiers = [("host", A), ("disk", None), ("redis", None)] + ([("mooncake", None)] if mooncake_url else [])
    for tier, eng in tiers:
      if eng is None:
        eng = Engine(params, cfg, dataclasses.replace(ec, tiering=TieringConfig(
            tiers=(tier,), disk_dir=disk, store_url=mooncake_url if tier == "mooncake" else url, policy="load",
            engine_id=f"{tier}{L}")))
        _submit(eng, "warm", [int(t) for t in rng.integers(2, V, 300)], 1)
        eng.tiering.warmup()
      # one unmeasured resume (first use of the tier client, promotion paths), then the device is dropped again
      _submit(eng, "turn2-warm", p2, 1)
      eng.tiering.drop_device_cache()
      th = [t for t in eng.tiering.store.tiers if t.name == tier][0]
      before = (th.metrics["hit_tokens"], th.metrics["bytes_read"])
      r = _submit(eng, "turn2", p2, 1)
      ttft = r.first_token_time - r.arrival
      d = eng.tiering.decisions[-1]
      cm = eng.tiering.cost
      cm.prefill_tps, cm.prefill_measured = prefill_tps, True         # the prefill rate measured on turn 1
      dec = cm.decide(d["plan"], d["P"] - d["h1"])
      faster = "load" if ttft < rec_ttft else "recompute"
      choice = "load" if dec.load else "recompute"
      rows.append({"tokens": L, "path": f"load:{tier}", "ttft_s": ttft, "hit_tokens": r.hit_tokens,
                   "tier_hit_tokens": th.metrics["hit_tokens"] - before[0],
                   "bytes_read": th.metrics["bytes_read"] - before[1],
                   "est_load_s": dec.load_s, "est_recompute_s": dec.recompute_s, "cost_model_choice": choice,
                   "faster_measured": faster, "choice_correct": choice == faster})
      if eng is not A:
        eng.tiering.close()
    A.tiering.close()
  return rows


def main(argv):
  del argv
  out_dir = plotting.output_dir(RESULTS_SUBDIR)
  if FLAGS.replot:
    print("wrote", plotting.save_figure(plot(plotting.read_table(out_dir, "tiers_workload")[0]), out_dir,
                                        "tiers_workload"))
    return
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  tmp = tempfile.mkdtemp(prefix="dsv4-tiers-bench-")
  redis = RedisServer()
  mc = None
  try:
    if "a" in FLAGS.parts:
      rows, _, sess_bytes = part_a(cfg, params, redis.url, tmp)
      plotting.write_table(rows, out_dir, "tiers_workload", {"model": cfg.name, "session_bytes": sess_bytes})
      _print(rows)
      print("wrote", plotting.save_figure(plot(rows), out_dir, "tiers_workload"))
    if "b" in FLAGS.parts:
      if FLAGS.mooncake:
        mc = MooncakeServer(segment="512MB")
      rows = part_b(cfg, params, redis.url, mc.url if mc else "", tmp, [int(x) for x in FLAGS.lengths])
      plotting.write_table(rows, out_dir, "tiers_resume", {"model": cfg.name})
      _print(rows)
  finally:
    redis.stop()
    if mc:
      mc.stop()
    shutil.rmtree(tmp, ignore_errors=True)


def _print(rows):
  keys = []
  for r in rows:
    keys += [k for k in r if k not in keys]
  print("| " + " | ".join(keys) + " |")
  print("|" + "---|" * len(keys))
  for r in rows:
    print("| " + " | ".join(f"{r.get(k, ''):.4g}" if isinstance(r.get(k), float) else str(r.get(k, ""))
                            for k in keys) + " |")


def plot(rows: list[dict]):
  """Part A: TTFT percentiles and hit / computed tokens per tier configuration (categorical: one group each)."""
  fig, (ttft, toks) = plotting.new_figure(2, width=5.2, height=3.8)
  names = [r["config"] for r in rows]
  x = np.arange(len(names))

  def label(name, values):   # a bar series that is 0 everywhere draws nothing: say so in its legend entry
    return f"{name} (0 in every configuration)" if not any(values) else name

  for i, (q, key) in enumerate([(50, "ttft_p50_s"), (95, "ttft_p95_s"), (99, "ttft_p99_s")]):
    v = [r[key] * 1e3 for r in rows]
    ttft.bar(x + (i - 1) * 0.27, v, 0.27, label=label(f"p{q}", v), color=f"C{i}")
  device, tier, computed = ([r[k] for r in rows] for k in ("device_hit_tokens", "tier_hit_tokens", "computed_tokens"))
  toks.bar(x - 0.2, device, 0.4, label=label("device hit", device), color="C0")
  toks.bar(x - 0.2, tier, 0.4, bottom=device, label=label("tier hit (stacked on device hit)", tier), color="C1",
           hatch="//", edgecolor="white")
  toks.bar(x + 0.2, computed, 0.4, label=label("computed", computed), color="C2")
  for ax in (ttft, toks):
    ax.set_xticks(x, names)
    ax.set_xlabel("tiers (off: device cache only)")
  ttft.set(ylabel="TTFT (ms)", title="TTFT, all turns")
  toks.set(ylabel="tokens", title="hit vs computed tokens")
  plotting.legend_below(ttft, ncol=3)
  plotting.legend_below(toks, ncol=1)
  return fig


if __name__ == "__main__":
  define_flags()
  app.run(main)

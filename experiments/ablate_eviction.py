r"""Eviction-policy ablation: prefix-hit rate vs pool size under memory pressure, per policy (cache/eviction.py).

    python -m experiments.ablate_eviction                        # full -> experiments/results/eviction.{csv,json,png}
    python -m experiments.ablate_eviction --small --out_dir=/tmp/x    # CI

Cache-only, like ablate_retention: hits depend only on tokens and block bookkeeping, so the sweep drives the
KV cache manager directly (the engine's call sequence, fixed synthetic answers) instead of running the model;
no model step is compiled, and every pool size costs only the pool ops' compiles.

Workload (multi-tenant session switching): `tenants` tenants, each with its own system prompt (tenant salt in the
hash, so tenants never share blocks) and `sessions` chat sessions. Each request picks a session with Zipf-like
popularity (so some sessions are hot, others come back after long gaps), appends a user message to its history and
gets an answer; a session whose history would pass `max_len` restarts from its system prompt. Requests are served
one at a time (the pool holds at most one running request; everything else is cache).

Pool sizes: `num_full_blocks` swept, `num_swa_blocks` = `swa_ratio` x that (2 = the EngineConfig defaults 256/512).
Geometry of `--config` (default v4_flash). Hit rate = admission hit tokens / prompt tokens over all requests.
"""

from __future__ import annotations

import os
import time

import numpy as np
from absl import app, flags, logging

from cache.eviction import POLICIES, make_manager
from dsv4 import config as C
from dsv4.caches import group_specs
from experiments import plotting
from experiments.ablate_retention import Spec, cached_blocks, define_common_flags, run_trace, synthetic_answer

FLAGS = flags.FLAGS
define_common_flags()
flags.DEFINE_list("policies", list(POLICIES), "Eviction policies (cache/eviction.py).")
flags.DEFINE_list("full_blocks", ["48", "64", "96", "128", "192", "256", "384", "512"], "num_full_blocks sweep.")
flags.DEFINE_integer("swa_ratio", 2, "num_swa_blocks = swa_ratio * num_full_blocks.")
flags.DEFINE_integer("requests", 240, "Requests in the workload (full run).")


def multi_tenant(vocab: int, *, tenants=4, sessions=4, requests=240, system_len=1024, u_len=(64, 384),
                 a_len=(32, 256), max_len=4096, zipf=1.0, seed=0) -> list[Spec]:
  rng = np.random.default_rng([seed, 3])
  systems = [tuple(int(t) for t in rng.integers(2, vocab, system_len)) for _ in range(tenants)]
  names = [(t, s) for t in range(tenants) for s in range(sessions)]
  w = 1.0 / np.arange(1, len(names) + 1) ** zipf
  w = w[rng.permutation(len(names))]
  w /= w.sum()
  length, epoch, out = {}, {}, []
  for i in range(requests):
    t, s = names[int(rng.choice(len(names), p=w))]
    key = (t, s)
    u = tuple(int(x) for x in rng.integers(2, vocab, int(rng.integers(*u_len))))
    a = int(rng.integers(*a_len))
    if key in length and length[key] + len(u) + a > max_len:
      epoch[key] = epoch.get(key, 0) + 1
      del length[key]
    sess = f"t{t}.s{s}.e{epoch.get(key, 0)}"
    first = key not in length
    new = (systems[t] + u) if first else u
    out.append(Spec(f"r{i}.{sess}", sess, new, a, tenant=f"tenant{t}", kind="first" if first else "turn"))
    length[key] = length.get(key, 0) + len(new) + a
  return out


def run(config_name: str, policies, full_blocks, swa_ratio: int, requests: int, small: bool, out_dir: str,
        seed: int = 0, stem: str = "eviction") -> dict:
  config = C.PRESETS[config_name]()
  answer = synthetic_answer(config.vocab_size, seed)
  kw = dict(tenants=2, sessions=3, requests=requests, system_len=512, max_len=2048) if small else \
      dict(requests=requests)
  trace = multi_tenant(config.vocab_size, seed=seed, **kw)
  rows = []
  for nf in full_blocks:
    for pol in policies:
      t0 = time.time()
      m = make_manager(group_specs(config), pol, num_full_blocks=nf, num_swa_blocks=swa_ratio * nf, enable_events=pol == "fifo")
      res = run_trace(m, trace, answer)
      prompt, hit = sum(r["prompt"] for r in res), sum(r["hit"] for r in res)
      rows.append(dict(policy=pol, num_full_blocks=nf, num_swa_blocks=swa_ratio * nf, requests=len(res),
                       prompt_tokens=prompt, hit_tokens=hit, hit_rate=hit / max(prompt, 1),
                       recomputed_tokens=prompt - hit, zero_hit_requests=sum(r["hit"] == 0 for r in res),
                       swa_blocks_cached_end=cached_blocks(m, "swa"), full_blocks_cached_end=cached_blocks(m, "full"),
                       wall_s=round(time.time() - t0, 2)))
      logging.info("%s", rows[-1])
  meta = dict(config=config_name, small=small, seed=seed, workload=dict(kind="multi_tenant", **kw),
              swa_ratio=swa_ratio,
              note="cache-only: KVCacheManager (lru) / cache.eviction.PolicyCacheManager driven directly with "
                   "synthetic answers; requests served one at a time")
  csv_path, json_path = plotting.write_table(rows, out_dir, stem, meta)

  fig, (ax1, ax2) = plotting.new_figure(2)
  for pol in policies:
    r = [x for x in rows if x["policy"] == pol]
    ax1.plot([x["num_full_blocks"] for x in r], [100 * x["hit_rate"] for x in r], "o-", label=pol)
    ax2.plot([x["num_full_blocks"] for x in r], [x["recomputed_tokens"] / 1e3 for x in r], "o-", label=pol)
  ax1.set(xscale="log", xlabel=f"num_full_blocks (num_swa_blocks = {swa_ratio}x)", ylabel="prefix hit rate (%)",
          title=f"{config_name}: multi-tenant session switching")
  ax2.set(xscale="log", xlabel=f"num_full_blocks (num_swa_blocks = {swa_ratio}x)",
          ylabel="prompt tokens recomputed (k)", title="recompute vs pool size")
  ax1.legend(fontsize=8)
  ax2.legend(fontsize=8)
  png = plotting.save_figure(fig, out_dir, stem)
  print(f"wrote {csv_path} {json_path} {png}")
  return dict(rows=rows, csv=csv_path, json=json_path, png=png)


def main(argv):
  del argv
  full_blocks = [int(x) for x in FLAGS.full_blocks]
  requests = FLAGS.requests
  if FLAGS.small:
    if FLAGS["full_blocks"].using_default_value:
      full_blocks = [24, 48, 192]
    if FLAGS["requests"].using_default_value:
      requests = 30
  run(FLAGS.config, FLAGS.policies, full_blocks, FLAGS.swa_ratio, requests, FLAGS.small, FLAGS.out_dir, FLAGS.seed)


if __name__ == "__main__":
  app.run(main)

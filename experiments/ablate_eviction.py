r"""Eviction-policy ablation: prefix-hit rate vs pool size under memory pressure, per policy (cache/eviction.py).

    python -m experiments.ablate_eviction                  # full -> out/ablate_eviction/eviction.{csv,json,png}
    python -m experiments.ablate_eviction --small --out_dir=/tmp/x    # CI
    python -m experiments.ablate_eviction --refresh_results    # refresh the committed experiments/results/eviction.*
    python -m experiments.ablate_eviction --replot --refresh_results   # re-draw the committed plot from its table

Output goes to --out_dir (default out/ablate_eviction/, untracked); --refresh_results writes the committed
experiments/results/ instead. --replot re-draws eviction.png from the eviction.json already there, without the sweep.

Cache-only, like ablate_retention: hits depend only on tokens and block bookkeeping, so the sweep drives the
KV cache manager directly (the engine's call sequence, fixed synthetic answers) instead of running the model;
no model step is compiled, and every pool size costs only the pool ops' compiles.

Workload (multi-tenant session switching): `tenants` tenants, each with its own system prompt (tenant salt in the
hash, so tenants never share blocks) and `sessions` chat sessions. Each request picks a session with Zipf-like
popularity (so some sessions are hot, others come back after long gaps), appends a user message to its history and
gets an answer; a session whose history would pass `max_len` restarts from its system prompt. Requests are served
one at a time (the pool holds at most one running request; everything else is cache).

Pool sizes: `--full_blocks` (num_full_blocks) swept, num_swa_blocks = `--swa_ratio` x that (2 = the EngineConfig
defaults 256/512). Geometry of `--config` (default v4_flash). Hit rate = admission hit tokens / prompt tokens over
all requests (`--requests` of them, `--seed`); `--policies` picks the policies.

Plot: hit rate per policy against num_full_blocks on a log2 axis, and each policy's hit rate minus lru's (points),
which separates the policies where their hit rates nearly coincide; one colour / marker / line style per policy.
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags, logging

from cache.eviction import POLICIES, make_manager
from dsv4.caches import group_specs
from dsv4.config import PRESETS
from experiments import plotting
from experiments.ablate_retention import Spec, cached_blocks, run_trace, synthetic_answer

FLAGS = flags.FLAGS
SCRIPT = "ablate_eviction"


def define_flags():
  """The command line (defined when run as a script, so importing the workload defines no flags)."""
  flags.DEFINE_bool("small", False, "CI: a few sessions, a few pool sizes.")
  flags.DEFINE_string("config", "v4_flash", "Model config preset whose cache geometry is used.")
  flags.DEFINE_integer("seed", 0, "Workload seed.")
  flags.DEFINE_list("policies", list(POLICIES), "Eviction policies (cache/eviction.py).")
  flags.DEFINE_list("full_blocks", ["48", "64", "96", "128", "192", "256", "384", "512"], "num_full_blocks sweep.")
  flags.DEFINE_integer("swa_ratio", 2, "num_swa_blocks = swa_ratio * num_full_blocks.")
  flags.DEFINE_integer("requests", 240, "Requests in the workload (full run; --small: 30 unless given).")
  flags.DEFINE_bool("replot", False, "Re-draw the plot from the table already in the output directory (no sweep).")
  plotting.define_output_flags(SCRIPT, "eviction.csv/json/png")


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
  config = PRESETS[config_name]()
  answer = synthetic_answer(config.vocab_size, seed)
  kw = dict(tenants=2, sessions=3, requests=requests, system_len=512, max_len=2048) if small else \
      dict(requests=requests)
  trace = multi_tenant(config.vocab_size, seed=seed, **kw)
  rows = []
  for nf in full_blocks:
    for pol in policies:
      t0 = time.time()
      m = make_manager(group_specs(config), pol, num_full_blocks=nf, num_swa_blocks=swa_ratio * nf,
                       enable_events=pol == "fifo")
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

  png = plotting.save_figure(plot(rows, meta), out_dir, stem)
  print(f"wrote {csv_path} {json_path} {png}")
  return dict(rows=rows, csv=csv_path, json=json_path, png=png)


def plot(rows: list[dict], meta: dict):
  """Hit rate per policy vs pool size (log2 axis), and each policy's hit rate minus the reference's (lru)."""
  policies = list(dict.fromkeys(x["policy"] for x in rows))
  sizes = sorted({x["num_full_blocks"] for x in rows})
  ref = "lru" if "lru" in policies else policies[0]
  ref_rate = {x["num_full_blocks"]: x["hit_rate"] for x in rows if x["policy"] == ref}
  fig, (hit, diff) = plotting.new_figure(2, width=5.4)
  n = len(policies)
  for i, pol in enumerate(policies):
    r = sorted((x for x in rows if x["policy"] == pol), key=lambda x: x["num_full_blocks"])
    nf = [x["num_full_blocks"] for x in r]
    st = plotting.series_style(i, n)
    hit.plot(nf, [100 * x["hit_rate"] for x in r], label=pol, **st)
    diff.plot(nf, [100 * (x["hit_rate"] - ref_rate[x["num_full_blocks"]]) for x in r], label=pol, **st)
  ratio = meta.get("swa_ratio", 2)
  for ax in (hit, diff):
    plotting.knob_axis(ax, sizes, f"num_full_blocks (num_swa_blocks = {ratio}x)")
  hit.set(ylabel="prefix hit rate (%)", title=f"{meta.get('config', '')}: multi-tenant session switching")
  diff.set(ylabel=f"hit rate minus {ref}'s (points)", title=f"each policy against {ref}")
  diff.axhline(0, color="gray", lw=0.6, zorder=1)
  plotting.legend_below(hit, ncol=3)
  plotting.legend_below(diff, ncol=3)
  return fig


def main(argv):
  del argv
  full_blocks = [int(x) for x in FLAGS.full_blocks]
  requests = FLAGS.requests
  if FLAGS.small:
    if FLAGS["full_blocks"].using_default_value:
      full_blocks = [24, 48, 192]
    if FLAGS["requests"].using_default_value:
      requests = 30
  out_dir = plotting.output_dir()
  if FLAGS.replot:
    print("wrote", plotting.replot(plot, out_dir, "eviction"))
    return
  run(FLAGS.config, FLAGS.policies, full_blocks, FLAGS.swa_ratio, requests, FLAGS.small, out_dir, FLAGS.seed)


if __name__ == "__main__":
  define_flags()
  app.run(main)

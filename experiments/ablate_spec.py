r"""Speculative decoding ablation: the engine with a model's drafts, k = 0 (off) .. 7 drafts per step, for several
drafting checkpoints side by side.

    python -m experiments.ablate_spec                     # -> out/ablate_spec/spec.{csv,json,png}
    python -m experiments.ablate_spec --checkpoints=v4_motif_mtp --ks=0,1,5   # a subset
    python -m experiments.ablate_spec --small --out_dir=/tmp/x    # CI smoke run
    python -m experiments.ablate_spec --refresh_results   # refresh the committed experiments/results/spec.*
    python -m experiments.ablate_spec --replot --refresh_results   # re-draw the committed plot from its table

Output goes to --out_dir (default out/ablate_spec/, untracked); --refresh_results writes the committed
experiments/results/ instead.

Checkpoints (--checkpoints, names under experiments/checkpoints/ or directories): any whose config has a drafter
(`num_mtp_layers >= 1`: a V4 MTP block from `experiments/train_mtp.py`, or a V4.1 DSpark drafter) and whose
config.json names its task. A checkpoint that is missing, has no drafter or no task is skipped with a logged reason
(kept in the table's meta "skipped"); a k the engine refuses for a checkpoint likewise. Default: the motif models'
drafters (V4's MTP block `v4_motif_mtp` and V4.1's DSpark `v41_motif_dspark`, repetitive text: drafting should pay)
and the retrieval model's MTP block (`v4_retrieval_mtp`).

Greedy workloads of held-out task sequences, per task:
* key-value recall: "task", each sequence up to its query section plus the first query key (the model answers and
  continues the query section); "free", each sequence cut in the middle of its document, continued freely;
* motif: "free", each sequence cut in the middle, continued --free_tokens tokens (the backbone repeats the motif).
For each (checkpoint, workload, k): acceptance by draft depth (share of the rows drafting d or more whose first d
drafts were all accepted), draft acceptance (accepted / proposed), acceptance length (1 + accepted drafts per
verifying row: tokens decided per row and step), engine steps per generated token, generated tokens/s and wall ms
per generated token, and whether the tokens equal those of k = 0 (greedy: they must). Wall time: every k of one
(checkpoint, workload) is compiled first (one untimed run each), then the --repeats timed runs on fresh engines go
round the ks in turn, so every k sees the same box; the median run is reported.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import NamedTuple

from absl import app, flags, logging

from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams
from experiments import plotting
from experiments import tasks
from experiments import train_lib

FLAGS = flags.FLAGS
SCRIPT = "ablate_spec"
_HELD_OUT = 1_000_000          # data seeds no training step used (as experiments/train_mtp.py)
DEFAULT_CHECKPOINTS = ["v4_motif_mtp", "v41_motif_dspark", "v4_retrieval_mtp"]


def define_flags():
  flags.DEFINE_list("checkpoints", DEFAULT_CHECKPOINTS,
                    "Checkpoints with a drafter (names under experiments/checkpoints/ or directories); a missing one "
                    "or one without a drafter is skipped with a logged reason.")
  flags.DEFINE_list("ks", [str(k) for k in range(8)], "Drafts per step (0 = no speculation).")
  flags.DEFINE_integer("requests", 32, "Requests per workload.")
  flags.DEFINE_integer("free_tokens", 48, "Generated tokens per request on the free workloads.")
  flags.DEFINE_integer("max_num_seqs", 8, "Engine rows per step.")
  flags.DEFINE_integer("repeats", 5, "Timed runs per configuration after the compiling one (the median is reported).")
  flags.DEFINE_bool("small", False, "CI: the first checkpoint only, k in {0, 2}, 4 requests, 8 free tokens, "
                    "one timed run.")
  flags.DEFINE_bool("replot", False, "Re-draw the plot from the table already in the output directory (no runs).")
  plotting.define_output_flags(SCRIPT, "spec.csv/json/png")


def workloads(spec, requests: int, free_tokens: int) -> dict:
  """name -> (prompts, max_tokens) for the checkpoint's task."""
  rows = tasks.make_batch(spec, _HELD_OUT, requests)["tokens"]
  free = ([[int(t) for t in r[:spec.seq_len // 2]] for r in rows], free_tokens)
  if isinstance(spec, tasks.KVRecallSpec):
    q0 = spec.seq_len - spec.query_len
    return {"task": ([[int(t) for t in r[:q0 + 2]] for r in rows], spec.query_len - 2), "free": free}
  return {"free": free}


class ServeRun(NamedTuple):
  engine: Engine
  outputs: list          # each request's generated token ids, in request order
  seconds: float         # wall time of the run (compiles excluded when warmed before)


def _serve(params, config, ec: EngineConfig, prompts, max_tokens: int) -> ServeRun:
  eng = Engine(params, config, ec)
  for i, p in enumerate(prompts):
    eng.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
  t0 = time.perf_counter()
  outs = eng.run()
  return ServeRun(eng, [o.output for o in outs], time.perf_counter() - t0)


def _checkpoint_dir(name: str) -> str:
  return name if os.path.isdir(name) else os.path.join(train_lib.CHECKPOINT_ROOT, name)


def load_drafting(name: str):
  """(config, params, task spec) of a checkpoint with a drafter, or a string: why it is skipped."""
  directory = _checkpoint_dir(name)
  if not os.path.isfile(os.path.join(directory, "config.json")):
    return f"no checkpoint at {directory}"
  with open(os.path.join(directory, "config.json")) as f:
    info = json.load(f)
  if info.get("config", {}).get("num_mtp_layers", 0) < 1:
    return "no drafter (num_mtp_layers = 0; train one with experiments/train_mtp.py)"
  if "task" not in info:
    return "config.json names no task (no workload to serve)"
  try:
    config, params, info = train_lib.load_checkpoint_dir(directory)
    spec = train_lib.task_spec_from_info(info)
  except Exception as e:  # noqa: BLE001 - a damaged / incompatible checkpoint is a skip with its reason
    return f"does not load: {type(e).__name__}: {e}"
  return config, params, spec


def _row(checkpoint, config, name, k, prompts, outs, eng, secs, ref):
  s = eng.stats
  gen = sum(len(o) for o in outs)
  drafted, accepted, rows = s.get("spec_draft_tokens", 0), s.get("spec_accepted_tokens", 0), s.get("spec_rows", 0)
  return dict(checkpoint=checkpoint, variant=config.variant, workload=name, k=k, requests=len(prompts),
              generated_tokens=gen, steps=s["steps"], drafted=drafted, accepted=accepted,
              acceptance=round(accepted / max(drafted, 1), 4),
              # 1 + accepted drafts per verifying row: the tokens one row decides per step (1.0 at k = 0)
              acceptance_length=round(1 + accepted / max(rows, 1), 3),
              # share of the rows drafting d or more whose first d drafts were all accepted, d = 1 .. k
              accepted_by_depth="/".join(f"{s[f'spec_accepted_at_{d}'] / max(s[f'spec_drafts_at_{d}'], 1):.3f}"
                                         for d in range(1, k + 1)),
              steps_per_token=round(s["steps"] / max(gen, 1), 4),
              tokens_per_s=round(gen / max(secs, 1e-9), 1),
              ms_per_token=round(1e3 * secs / max(gen, 1), 3),
              same_tokens_as_k0=None if ref is None else outs == ref)


def run_checkpoint(checkpoint: str, config, params, spec, ks, requests: int, free_tokens: int, max_num_seqs: int,
                   repeats: int, skipped: dict) -> list[dict]:
  # A decode step of R rows runs R (1 + k) tokens; the step's row-invariant ops loop over those only.
  base = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, chunk_size=128,
                      max_model_len=spec.seq_len + free_tokens + 16, num_full_blocks=8 * max_num_seqs,
                      num_swa_blocks=32 * max_num_seqs)
  rows = []
  for name, (prompts, max_tokens) in workloads(spec, requests, free_tokens).items():
    ecs, runs = {}, {}
    for k in ks:          # compile every configuration first (an untimed run each) ...
      ec = dataclasses.replace(base, num_speculative_tokens=k)
      try:
        first = _serve(params, config, ec, prompts, max_tokens)
      except (ValueError, NotImplementedError) as e:
        skipped[f"{checkpoint}/{name}/k={k}"] = f"{type(e).__name__}: {e}"
        logging.warning("skipping %s %s k=%d: %s", checkpoint, name, k, e)
        continue
      ecs[k], runs[k] = ec, [first] if repeats == 0 else []
    for _ in range(repeats):   # ... then the timed runs round the ks, so each k sees the same box
      for k, ec in ecs.items():
        runs[k].append(_serve(params, config, ec, prompts, max_tokens))
    ref = runs[0][0].outputs if 0 in runs else None
    wl_rows = []
    for k, rk in runs.items():
      outs = rk[0].outputs
      assert all(r.outputs == outs for r in rk), f"{checkpoint} {name} k={k}: greedy runs differ"
      secs = sorted(r.seconds for r in rk)[len(rk) // 2]                # the median run: a shared box is noisy
      wl_rows.append(_row(checkpoint, config, name, k, prompts, outs, rk[0].engine, secs, None if k == 0 else ref))
      r = wl_rows[-1]
      logging.info("%s %s k=%d acceptance length %.2f by depth %s tokens/s %.0f", checkpoint, name, k,
                   r["acceptance_length"], r["accepted_by_depth"], r["tokens_per_s"])
    k0 = next((r["ms_per_token"] for r in wl_rows if r["k"] == 0), None)
    for r in wl_rows:
      if k0:
        r["speedup_vs_k0"] = round(k0 / r["ms_per_token"], 3)
    rows += wl_rows
  return rows, base


def run(checkpoints, ks, requests: int, free_tokens: int, max_num_seqs: int, out_dir: str, repeats: int = 5) -> dict:
  rows, skipped, names, base = [], {}, {}, None
  for ckpt in checkpoints:
    got = load_drafting(ckpt)
    if isinstance(got, str):
      skipped[ckpt] = got
      logging.warning("skipping checkpoint %s: %s", ckpt, got)
      continue
    config, params, spec = got
    names[ckpt] = config.name
    r, base = run_checkpoint(ckpt, config, params, spec, ks, requests, free_tokens, max_num_seqs, repeats, skipped)
    rows += r
  if not rows:
    raise ValueError(f"ablate_spec: nothing to run ({skipped})")
  engine = {f: getattr(base, f) for f in ("max_num_seqs", "max_num_batched_tokens", "chunk_size", "num_full_blocks",
                                          "num_swa_blocks", "async_scheduling")}
  meta = dict(checkpoints=list(names), config_names=names, skipped=skipped, engine=engine, repeats=repeats,
              requests=requests, free_tokens=free_tokens,
              note="greedy; wall time: the median of the timed runs on fresh engines (round the ks in turn) after "
                   "a compiling one; CPU")
  csv_path, json_path = plotting.write_table(rows, out_dir, "spec", meta)
  png = plotting.save_figure(plot(rows, meta), out_dir, "spec")
  return dict(rows=rows, csv=csv_path, json=json_path, png=png, skipped=skipped)


def plot(rows: list[dict], meta: dict):
  """Acceptance length (left) and generated tokens/s (right) against k, one series per (checkpoint, workload)."""
  series = sorted({(r["checkpoint"], r["workload"]) for r in rows})
  ks = sorted({r["k"] for r in rows})
  fig, (left, right) = plotting.new_figure(2, width=5.2)
  for i, (ckpt, name) in enumerate(series):
    r = sorted((x for x in rows if (x["checkpoint"], x["workload"]) == (ckpt, name)), key=lambda x: x["k"])
    style = plotting.series_style(i, len(series), "-")
    left.plot([x["k"] for x in r], [x["acceptance_length"] for x in r], label=f"{ckpt}: {name}", **style)
    right.plot([x["k"] for x in r], [x["tokens_per_s"] for x in r], label=f"{ckpt}: {name}", **style)
  for ax in (left, right):
    plotting.knob_axis(ax, ks, "drafts per step k")
  left.set(ylabel="acceptance length (tokens / verifying row)", title="greedy drafts accepted")
  right.set(ylabel="generated tokens / s", title="throughput (CPU, steady state)")
  plotting.legend_below(left, ncol=1)
  plotting.legend_below(right, ncol=1)
  return fig


def main(argv):
  del argv
  try:
    ks = [int(k) for k in FLAGS.ks]
  except ValueError:
    raise app.UsageError(f"--ks: integers, got {FLAGS.ks}") from None
  requests, free_tokens, checkpoints = FLAGS.requests, FLAGS.free_tokens, list(FLAGS.checkpoints)
  if FLAGS.small:
    ks, requests, free_tokens, checkpoints = [0, 2], 4, 8, checkpoints[:1]
    FLAGS.repeats = 1
  if any(not 0 <= k <= 8 for k in ks):
    raise app.UsageError(f"--ks: each k in 0..8, got {ks}")
  if not checkpoints:
    raise app.UsageError("--checkpoints: name at least one")
  out_dir = plotting.output_dir()
  if FLAGS.replot:
    print("wrote", plotting.replot(plot, out_dir, "spec"))
    return
  if FLAGS.repeats < 1:
    raise app.UsageError(f"--repeats={FLAGS.repeats}: must be >= 1")
  out = run(checkpoints, ks, requests, free_tokens, FLAGS.max_num_seqs, out_dir, FLAGS.repeats)
  print(f"wrote {out['csv']} {out['json']} {out['png']}")
  for c, why in out["skipped"].items():
    print(f"skipped {c}: {why}")
  print("checkpoint        workload  k  accept.len  by depth                                 steps/tok  tok/s  "
        "ms/tok  speed-up  same")
  for r in out["rows"]:
    print(f"{r['checkpoint']:17s} {r['workload']:8s} {r['k']:2d}  {r['acceptance_length']:10.2f}  "
          f"{r['accepted_by_depth']:40s} {r['steps_per_token']:9.3f}  {r['tokens_per_s']:5.0f}  "
          f"{r['ms_per_token']:6.2f}  {r.get('speedup_vs_k0', float('nan')):8.2f}  {r['same_tokens_as_k0']}")


if __name__ == "__main__":
  define_flags()
  app.run(main)

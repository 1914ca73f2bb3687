r"""Speculative decoding ablation: the engine with the MTP block's drafts, k = 0 (off) .. 4 drafts per step.

    python -m experiments.ablate_spec                     # -> out/ablate_spec/spec.{csv,json,png}
    python -m experiments.ablate_spec --small --out_dir=/tmp/x    # CI smoke run
    python -m experiments.ablate_spec --refresh_results   # refresh the committed experiments/results/spec.*
    python -m experiments.ablate_spec --replot --refresh_results   # re-draw the committed plot from its table

Output goes to --out_dir (default out/ablate_spec/, untracked); --refresh_results writes the committed
experiments/results/ instead.

The checkpoint is the retrieval model with its trained draft block (`experiments/checkpoints/v4_retrieval_mtp`,
made by `experiments/train_mtp.py`). Two greedy workloads of held-out task sequences:
* task: each sequence up to its query section plus the first query key; the model answers and continues the
  query section (the format it was trained on);
* free: each sequence cut in the middle of its document; the model continues the document freely.
For each k: draft acceptance (accepted / proposed), tokens decided per verifying row (1 + accepted), generated
tokens per engine step, and wall time per generated token: the median of --repeats runs on fresh engines of the
same configuration after one that compiled the step programs, so the speed-up over k = 0 is steady-state serving,
not compilation.
Every k must give the tokens of k = 0 (greedy); the table says so per row.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import NamedTuple

from absl import app, flags, logging

from dsv4.engine.engine import Engine, EngineConfig
from dsv4.engine.sampling import SamplingParams
from experiments import plotting
from experiments import tasks
from experiments import train_lib

FLAGS = flags.FLAGS
SCRIPT = "ablate_spec"
_HELD_OUT = 1_000_000          # data seeds no training step used (as experiments/train_mtp.py)


def define_flags():
  flags.DEFINE_string("checkpoint", "v4_retrieval_mtp",
                      "Checkpoint (with an MTP block) under experiments/checkpoints/.")
  flags.DEFINE_list("ks", ["0", "1", "2", "3", "4"], "Drafts per step (0 = no speculation).")
  flags.DEFINE_integer("requests", 32, "Requests per workload.")
  flags.DEFINE_integer("free_tokens", 48, "Generated tokens per request on the free workload.")
  flags.DEFINE_integer("max_num_seqs", 8, "Engine rows per step.")
  flags.DEFINE_integer("repeats", 5, "Timed runs per configuration after the compiling one (the median is reported).")
  flags.DEFINE_bool("small", False, "CI: k in {0, 2}, 4 requests, 8 free tokens.")
  flags.DEFINE_bool("replot", False, "Re-draw the plot from the table already in the output directory (no runs).")
  plotting.define_output_flags(SCRIPT, "spec.csv/json/png")


def workloads(spec: tasks.KVRecallSpec, requests: int, free_tokens: int) -> dict:
  """name -> (prompts, max_tokens)."""
  rows = tasks.make_batch(spec, _HELD_OUT, requests)["tokens"]
  q0 = spec.seq_len - spec.query_len
  return {"task": ([[int(t) for t in r[:q0 + 2]] for r in rows], spec.query_len - 2),
          "free": ([[int(t) for t in r[:spec.seq_len // 2]] for r in rows], free_tokens)}


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


def run(checkpoint: str, ks, requests: int, free_tokens: int, max_num_seqs: int, out_dir: str,
        repeats: int = 5) -> dict:
  config, params, info = train_lib.load_checkpoint_dir(
      checkpoint if os.path.isdir(checkpoint) else os.path.join(train_lib.CHECKPOINT_ROOT, checkpoint))
  if config.num_mtp_layers < 1:
    raise ValueError(f"{checkpoint}: no MTP block (train one with experiments/train_mtp.py)")
  spec = train_lib.task_spec_from_info(info)
  # Fine token buckets (growth 2, 4 steps per interval): a decode step of R rows runs R (1 + k) tokens, and with
  # the default 4x buckets its padding alone (8 -> 32 slots at k = 1..3) would decide the comparison on a CPU,
  # where a step's time follows its padded tokens.
  base = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, chunk_size=128,
                      max_model_len=spec.seq_len + free_tokens + 16, num_full_blocks=8 * max_num_seqs,
                      num_swa_blocks=32 * max_num_seqs, token_bucket_growth=2, token_bucket_steps=4)
  rows = []
  for name, (prompts, max_tokens) in workloads(spec, requests, free_tokens).items():
    ref = None
    for k in ks:
      ec = dataclasses.replace(base, num_speculative_tokens=k)
      _serve(params, config, ec, prompts, max_tokens)                  # compiles this configuration's programs
      runs = [_serve(params, config, ec, prompts, max_tokens) for _ in range(repeats)]
      eng, outs = runs[0].engine, runs[0].outputs
      assert all(r.outputs == outs for r in runs), "greedy runs of one configuration differ"
      secs = sorted(r.seconds for r in runs)[len(runs) // 2]          # the median run: a shared box is noisy
      ref = outs if k == 0 else ref
      s = eng.stats
      gen = sum(len(o) for o in outs)
      rows.append(dict(workload=name, k=k, requests=len(prompts), generated_tokens=gen, steps=s["steps"],
                       drafted=s["spec_draft_tokens"], accepted=s["spec_accepted_tokens"],
                       acceptance=round(s["spec_accepted_tokens"] / max(s["spec_draft_tokens"], 1), 4),
                       tokens_per_row=round(1 + s["spec_accepted_tokens"] / max(s["spec_rows"], 1), 3),
                       # share of the rows drafting d or more whose first d drafts were all accepted, d = 1 .. k
                       accepted_by_depth="/".join(f"{s[f'spec_accepted_at_{d}'] / max(s[f'spec_drafts_at_{d}'], 1):.3f}"
                                                  for d in range(1, k + 1)),
                       tokens_per_step=round(gen / max(s["steps"], 1), 3),
                       ms_per_token=round(1e3 * secs / max(gen, 1), 3),
                       same_tokens_as_k0=None if ref is None else outs == ref))
      logging.info("%s k=%d acceptance=%.3f tokens/step=%.2f ms/token=%.2f", name, k, rows[-1]["acceptance"],
                   rows[-1]["tokens_per_step"], rows[-1]["ms_per_token"])
    k0 = next(r for r in rows if r["workload"] == name and r["k"] == 0)["ms_per_token"] if 0 in ks else None
    for r in rows:
      if r["workload"] == name and k0:
        r["speedup_vs_k0"] = round(k0 / r["ms_per_token"], 3)
  engine = {f: getattr(base, f) for f in ("max_num_seqs", "max_num_batched_tokens", "chunk_size", "max_model_len",
                                          "num_full_blocks", "num_swa_blocks", "token_bucket_growth",
                                          "token_bucket_steps")}
  meta = dict(checkpoint=checkpoint, config_name=config.name, engine=engine,
              repeats=repeats,
              note="greedy; wall time: the median of the timed runs on fresh engines after a compiling one; CPU")
  csv_path, json_path = plotting.write_table(rows, out_dir, "spec", meta)
  png = plotting.save_figure(plot(rows, meta), out_dir, "spec")
  return dict(rows=rows, csv=csv_path, json=json_path, png=png)


def plot(rows: list[dict], meta: dict):
  """Acceptance and tokens per step (left), speed-up over k = 0 (right), against k, one series per workload."""
  names = sorted({r["workload"] for r in rows})
  ks = sorted({r["k"] for r in rows})
  fig, (left, right) = plotting.new_figure(2, width=5.2)
  for i, name in enumerate(names):
    r = sorted((x for x in rows if x["workload"] == name), key=lambda x: x["k"])
    spec_r = [x for x in r if x["k"] > 0]
    left.plot([x["k"] for x in r], [x["tokens_per_row"] for x in r], label=f"{name}: tokens per verifying row",
              **plotting.series_style(i, len(names), "-"))
    left.plot([x["k"] for x in spec_r], [x["acceptance"] for x in spec_r], label=f"{name}: draft acceptance",
              **plotting.series_style(i, len(names), "--", hollow=True))
    right.plot([x["k"] for x in r], [x.get("speedup_vs_k0", float("nan")) for x in r], label=name,
               **plotting.series_style(i, len(names), "-"))
  right.axhline(1.0, color="gray", lw=0.8, zorder=1, label="no speculation")
  for ax in (left, right):
    plotting.knob_axis(ax, ks, "drafts per step k")
  left.set(ylabel="tokens / row, acceptance", title=f"{meta.get('config_name', '')}: MTP drafts")
  right.set(ylabel="generated tokens/s vs k = 0", title="speed-up (CPU, steady state)")
  plotting.legend_below(left, ncol=1)
  plotting.legend_below(right, ncol=1)
  return fig


def main(argv):
  del argv
  try:
    ks = [int(k) for k in FLAGS.ks]
  except ValueError:
    raise app.UsageError(f"--ks: integers, got {FLAGS.ks}") from None
  requests, free_tokens = FLAGS.requests, FLAGS.free_tokens
  if FLAGS.small:
    ks, requests, free_tokens = [0, 2], 4, 8
    FLAGS.repeats = 1
  if any(not 0 <= k <= 8 for k in ks):
    raise app.UsageError(f"--ks: each k in 0..8, got {ks}")
  out_dir = plotting.output_dir()
  if FLAGS.replot:
    print("wrote", plotting.replot(plot, out_dir, "spec"))
    return
  if FLAGS.repeats < 1:
    raise app.UsageError(f"--repeats={FLAGS.repeats}: must be >= 1")
  out = run(FLAGS.checkpoint, ks, requests, free_tokens, FLAGS.max_num_seqs, out_dir, FLAGS.repeats)
  print(f"wrote {out['csv']} {out['json']} {out['png']}")
  print("workload  k  acceptance  tokens/row  tokens/step  ms/token  speed-up  same tokens")
  for r in out["rows"]:
    print(f"{r['workload']:8s} {r['k']:2d}  {r['acceptance']:10.3f}  {r['tokens_per_row']:10.2f}  "
          f"{r['tokens_per_step']:11.2f}  {r['ms_per_token']:8.2f}  {r.get('speedup_vs_k0', float('nan')):8.2f}  "
          f"{r['same_tokens_as_k0']}")


if __name__ == "__main__":
  define_flags()
  app.run(main)

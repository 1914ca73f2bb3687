r"""Exact restore vs bounded replay: resuming a session after its window / compressor state left the device.

    python -m experiments.ablate_resume                      # full run -> out/ablate_resume/resume.{csv,json,png}
    python -m experiments.ablate_resume --refresh_results    # refresh the committed experiments/results/resume.*
    python -m experiments.ablate_resume --small --out_dir=/tmp/x   # CI
    python -m experiments.ablate_resume --replot --refresh_results

For every model (trained task checkpoints, default v4_multikey and v41_multikey; random-weight v4_tiny of the depths in
--random_v4_depths, default 4 layers; with --random_v41 a random 8-layer v41_tiny) and compute
dtype (fp32; bf16 params + bf16 cache), a sequence is resumed at position P either exactly (the window KV and
compressor state a straight run would hold: what this project's SWA checkpoints restore) or by replaying the last R
tokens with only the compressed KV cached (`replay_lib`: the replay-based servers' way), R = 1..4 windows. Measured
against the exact resume in the same dtype:

* logit drift over a greedy continuation (32 tokens after P = 160 for the random models; the trained ones resume at
  16 tokens before the end of their task length): max |delta logit|, mean KL(exact || replay);
* first divergent token: the first continuation step where greedy decoding after the replay emits another token
  than after the exact resume (the continuation is the exact run's own greedy output, teacher-forced);
* task accuracy (trained checkpoints): the answer read after a resume placed 16 tokens before the end;
* cost of the resume: tokens recomputed (R vs 0), bytes read beyond the compressed KV (replay: R token ids;
  restore: the SWA state rows), at this model's size and at V4-Flash size (`replay_lib.swa_state_bytes`,
  FP8 and bf16 cache) with the replay's prefill FLOPs (2 x active params x R), and measured CPU wall time on the
  tiny model (restore: gathering the state blocks; replay: the jitted replay step).

The "bf16 vs fp32 (exact)" rows compare the two exact runs: the precision noise floor the replay error sits on.
"""

from __future__ import annotations

import dataclasses
import os
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import caches
from dsv4.config import v4_flash, v4_tiny, v41_tiny
from experiments import plotting
from experiments import replay_lib
from experiments import tasks
from experiments import train_lib

FLAGS = flags.FLAGS
SCRIPT = "ablate_resume"


def define_flags():
  flags.DEFINE_list("checkpoints", ["v4_multikey", "v41_multikey"], "Trained checkpoints (task accuracy + drift).")
  flags.DEFINE_list("random_v4_depths", ["4"], "Random-weight v4_tiny depths (drift only).")
  flags.DEFINE_bool("random_v41", True, "Also a random-weight v41_tiny (8 layers, no Engram).")
  flags.DEFINE_list("replay_windows", ["1", "2", "3", "4"], "Replay lengths R in windows.")
  flags.DEFINE_list("dtypes", ["fp32", "bf16"], "Compute dtypes.")
  flags.DEFINE_integer("gen_steps", 32, "Greedy continuation length for the drift measurement.")
  flags.DEFINE_integer("batch", 16, "Sequences per measurement.")
  flags.DEFINE_integer("eval_batches", 4, "Task batches for the accuracy.")
  flags.DEFINE_bool("small", False, "CI: one random 2-layer model, fp32, R = 1, 2 windows, batch 2.")
  flags.DEFINE_bool("replot", False, "Re-draw the plot from the table already in the output directory (no sweep).")
  plotting.define_output_flags(SCRIPT, "resume.csv/json/png")


@dataclasses.dataclass(frozen=True)
class Subject:
  name: str
  config: object
  params: object
  spec: object = None      # task spec (trained checkpoints)


def _restore_time(config, layout, cache, P: int, reps: int = 5) -> float:
  """Median seconds to gather the SWA-group blocks a resume at P needs (window rows + state row) out of a cache:
  what an exact restore copies."""
  sb = layout.swa_block_tokens
  blocks = jnp.arange((P - config.attention.window) // sb, (P - 1) // sb + 1)
  g = replay_lib._groups(config, layout)
  arrays = [cache.layers[l][n] for (l, n), grp in g.items() if grp == replay_lib.SWA]
  fn = jax.jit(lambda xs: [jnp.take(x, blocks, axis=0) for x in xs])
  jax.block_until_ready(fn(arrays))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(arrays))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def _replay_time(params, config, layout, tokens_1xT, P: int, R: int, reps: int = 3) -> float:
  """Median seconds of the jitted replay step (one sequence, R tokens) on this machine."""
  p = replay_lib.params_in(params, "bf16" if layout.kv_dtype == jnp.bfloat16 else "fp32")
  empty, swa, full = caches.init_contiguous(config, 1, tokens_1xT.shape[1], layout)
  tok = jnp.asarray(tokens_1xT[:, P - R:P], jnp.int32)
  args = (p, config, layout, empty, tok, jnp.full((1,), P - R, jnp.int32), jnp.asarray(swa), jnp.asarray(full))
  jax.block_until_ready(replay_lib._step(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(replay_lib._step(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def measure(subject: Subject, dtype: str, replays: list[int], P: int, gen_steps: int, batch: int,
            eval_batches: int, seed: int = 0) -> list[dict]:
  config, params = subject.config, subject.params
  W = config.attention.window
  rng = np.random.default_rng(seed)
  if subject.spec is not None:
    # the task's own length, resumed 16 tokens before the end: drift and accuracy share the compiled shapes
    P, gen_steps = subject.spec.seq_len - 16, 16
    prefix = tasks.make_batch(dataclasses.replace(subject.spec, seq_len=P + gen_steps), tasks.EVAL_SEED_BASE + 7,
                              batch)["tokens"][:, :P]
  else:
    prefix = rng.integers(3, config.vocab_size, size=(batch, P)).astype(np.int32)
    prefix[:, 0] = tasks.BOS
  gen = replay_lib.greedy_continuation(params, config, prefix, gen_steps, dtype)
  seq = np.concatenate([prefix, gen[:, :-1]], axis=1)
  out = replay_lib.resume_logits(params, config, seq, P, replays, dtype)
  follow = gen[:, 1:]
  acc = {}
  if subject.spec is not None:   # the answer sits at T - 2; resume 16 tokens before the end
    T = subject.spec.seq_len
    Pt = T - 16
    hits: dict = {}
    n = 0
    for b in tasks.eval_batches(subject.spec, eval_batches, batch):
      o = replay_lib.resume_logits(params, config, b["tokens"], Pt, [r for r in replays if r <= Pt], dtype)
      ans = b["targets"][:, T - 2]
      for key, lg in o.items():
        hits[key] = hits.get(key, 0) + int(np.sum(lg[:, T - 2 - Pt].argmax(-1) == ans))
      n += len(ans)
    acc = {k: v / n for k, v in hits.items()}
  fp8 = caches.CacheLayout(kv_dtype=caches.FP8)
  flash, flash_bf16 = v4_flash(), caches.CacheLayout(kv_dtype=jnp.bfloat16)
  flash_state = dict(fp8=replay_lib.swa_state_bytes(flash, fp8), bf16=replay_lib.swa_state_bytes(flash, flash_bf16))
  flash_active = replay_lib.active_params(flash)
  layout = replay_lib.layout_for(dtype)
  empty, swa, full = caches.init_contiguous(config, 1, P, layout)
  cache_a, _ = replay_lib._step(replay_lib.params_in(params, dtype), config, layout, empty,
                                jnp.asarray(prefix[:1], jnp.int32), jnp.zeros((1,), jnp.int32), jnp.asarray(swa),
                                jnp.asarray(full))
  timed = dtype == "fp32"   # wall times once per model (the bf16 rows would only repeat the compiles)
  t_restore = _restore_time(config, layout, cache_a, P) if timed else float("nan")
  base = dict(model=subject.name, config_name=config.name, layers=config.num_layers, variant=config.variant,
              dtype=dtype, window=W, resume_at=P, gen_steps=gen_steps - 1, batch=batch,
              compressed_bytes=replay_lib.compressed_bytes(config, layout, P))
  rows = [dict(base, method="exact", replay_tokens=0, replay_windows=0.0, max_abs_logit_diff=0.0, mean_kl=0.0,
               argmax_changed=0.0, first_divergence=float(gen_steps - 1), rows_diverged=0.0,
               accuracy=acc.get("exact", float("nan")),
               resume_bytes=replay_lib.swa_state_bytes(config, layout), resume_wall_ms=1e3 * t_restore,
               flash_resume_bytes_fp8=flash_state["fp8"], flash_resume_bytes_bf16=flash_state["bf16"],
               flash_resume_gflop=0.0)]
  for R in replays:
    st = replay_lib.drift_stats(out["exact"], out[R], follow)
    rows.append(dict(base, method="replay", replay_tokens=R, replay_windows=R / W, **st,
                     accuracy=acc.get(R, float("nan")), resume_bytes=4 * R,
                     resume_wall_ms=(1e3 * _replay_time(params, config, layout, seq[:1], P, R) if timed
                                     else float("nan")),
                     flash_resume_bytes_fp8=4 * R * flash.attention.window // W,
                     flash_resume_bytes_bf16=4 * R * flash.attention.window // W,
                     flash_resume_gflop=2 * flash_active * (R * flash.attention.window // W) / 1e9))
    logging.info("%s %s R=%d: %s acc=%s", subject.name, dtype, R, st, acc.get(R))
  return rows


def subjects(checkpoints, random_v4_depths, random_v41: bool) -> list[Subject]:
  out = []
  for name in checkpoints:
    d = name if os.path.isdir(name) else os.path.join(train_lib.CHECKPOINT_ROOT, name)
    config, params, info = train_lib.load_checkpoint_dir(d)
    out.append(Subject(os.path.basename(name.rstrip("/")), config, params, train_lib.task_spec_from_info(info)))
  for L in random_v4_depths:
    cfg = dataclasses.replace(v4_tiny(num_layers=L, vocab_size=64), name=f"v4_tiny_L{L}")
    out.append(Subject(f"random v4_tiny L={L}", cfg, train_lib.init(cfg, 0)))
  if random_v41:
    cfg = v41_tiny(engram=False, vocab_size=64)
    out.append(Subject(f"random v41_tiny L={cfg.num_layers}", cfg, train_lib.init(cfg, 0)))
  return out


def run(subjects_: list[Subject], dtypes, replay_windows, gen_steps: int, batch: int, eval_batches: int,
        out_dir: str, P: int = 160) -> dict:
  rows = []
  for s in subjects_:
    W = s.config.attention.window
    replays = [int(w * W) for w in replay_windows]
    for dtype in dtypes:
      t0 = time.time()
      rows += measure(s, dtype, replays, P, gen_steps, batch, eval_batches)
      logging.info("%s %s done in %.0fs", s.name, dtype, time.time() - t0)
    if "fp32" in dtypes and "bf16" in dtypes:   # the precision floor: bf16 exact vs fp32 exact
      rows.append(_dtype_floor(s, P, gen_steps, batch))
  meta = dict(note="replay rows: drift vs the exact resume in the same dtype; method=bf16_vs_fp32: bf16 exact vs "
                   "fp32 exact (the precision floor). flash_* columns: V4-Flash (window 128) at the same R / W.")
  csv_path, json_path = plotting.write_table(rows, out_dir, "resume", meta)
  png = plotting.save_figure(plot(rows, meta), out_dir, "resume")
  return dict(rows=rows, csv=csv_path, json=json_path, png=png)


def _dtype_floor(s: Subject, P: int, gen_steps: int, batch: int) -> dict:
  rng = np.random.default_rng(0)
  if s.spec is not None:
    P, gen_steps = s.spec.seq_len - 16, 16
    prefix = tasks.make_batch(dataclasses.replace(s.spec, seq_len=P + gen_steps), tasks.EVAL_SEED_BASE + 7,
                              batch)["tokens"][:, :P]
  else:
    prefix = rng.integers(3, s.config.vocab_size, size=(batch, P)).astype(np.int32)
    prefix[:, 0] = tasks.BOS
  gen = replay_lib.greedy_continuation(s.params, s.config, prefix, gen_steps, "fp32")
  seq = np.concatenate([prefix, gen[:, :-1]], axis=1)
  a = replay_lib.resume_logits(s.params, s.config, seq, P, [], "fp32")["exact"]
  b = replay_lib.resume_logits(s.params, s.config, seq, P, [], "bf16")["exact"]
  return dict(model=s.name, config_name=s.config.name, layers=s.config.num_layers, variant=s.config.variant,
              dtype="bf16", method="bf16_vs_fp32", window=s.config.attention.window, resume_at=P,
              replay_tokens=0, replay_windows=0.0, **replay_lib.drift_stats(a, b, gen[:, 1:]))


def plot(rows: list[dict], meta: dict):
  """Drift, first divergent token and task accuracy vs replay length (in windows), one colour per model, solid
  fp32 / dashed bf16; dotted horizontal lines: the bf16-vs-fp32 floor of each model."""
  fig, (drift, first, acc) = plotting.new_figure(3, width=4.8)
  models = list(dict.fromkeys(r["model"] for r in rows))
  wins = sorted({r["replay_windows"] for r in rows if r["method"] == "replay"})
  n = len(models) * 2
  i = 0
  for mi, m in enumerate(models):
    for dtype, ls in (("fp32", "-"), ("bf16", "--")):
      r = sorted((x for x in rows if x["model"] == m and x["dtype"] == dtype and x["method"] == "replay"),
                 key=lambda x: x["replay_windows"])
      if not r:
        continue
      st = plotting.series_style(i, n, ls, hollow=dtype == "bf16")
      st["color"] = f"C{mi % 10}"
      st["markerfacecolor"] = "none" if dtype == "bf16" else st["color"]
      w = [x["replay_windows"] for x in r]
      lab = f"{m} ({dtype})"
      drift.plot(w, [max(x["mean_kl"], 1e-12) for x in r], label=lab, **st)
      first.plot(w, [x["first_divergence"] for x in r], label=lab, **st)
      if not np.isnan(r[0].get("accuracy", float("nan"))):
        acc.plot(w, [x["accuracy"] for x in r], label=lab, **st)
        ex = [x for x in rows if x["model"] == m and x["dtype"] == dtype and x["method"] == "exact"]
        acc.axhline(ex[0]["accuracy"], color=st["color"], ls=":", lw=1.0, label=f"{m} ({dtype}): exact restore")
      i += 1
    fl = [x for x in rows if x["model"] == m and x["method"] == "bf16_vs_fp32"]
    if fl:
      drift.axhline(max(fl[0]["mean_kl"], 1e-12), color=f"C{mi % 10}", ls=":", lw=1.0,
                    label=f"{m}: bf16 vs fp32, both exact")
  for ax in (drift, first, acc):
    plotting.knob_axis(ax, wins, "replayed tokens R (in windows W)")
  drift.set_yscale("log")
  drift.set(ylabel="mean KL(exact || replay) per token (nats)",
            title="logit drift after a bounded replay\n(bit-identical drawn at 1e-12)")
  gs = max(r.get("gen_steps", 31) for r in rows if r["method"] != "bf16_vs_fp32")
  first.set(ylabel="first divergent greedy token (index)", ylim=(-1, gs + 1),
            title="where greedy decoding first differs\n(none: the continuation length, "
                  + " or ".join(str(g) for g in sorted({r.get("gen_steps", gs) for r in rows
                                                          if r["method"] == "replay"})) + ")")
  acc.set(ylabel="task accuracy", ylim=(-0.02, 1.05), title="answer accuracy after the resume")
  for ax in (drift, first, acc):
    if ax.get_legend_handles_labels()[0]:
      plotting.legend_below(ax, ncol=1)
  return fig


def main(argv):
  del argv
  out_dir = plotting.output_dir()
  if FLAGS.replot:
    print("wrote", plotting.replot(plot, out_dir, "resume"))
    return
  if FLAGS.small:
    subs = subjects([], [2], False)
    out = run(subs, ["fp32"], [1, 2], 8, 2, 1, out_dir, P=64)
  else:
    subs = subjects(FLAGS.checkpoints, [int(x) for x in FLAGS.random_v4_depths], FLAGS.random_v41)
    out = run(subs, FLAGS.dtypes, [float(x) for x in FLAGS.replay_windows], FLAGS.gen_steps, FLAGS.batch,
              FLAGS.eval_batches, out_dir)
  print(f"wrote {out['csv']} {out['json']} {out['png']}")
  for r in out["rows"]:
    print(f"{r['model']:24s} {r['dtype']:5s} {r['method']:12s} R={r['replay_tokens']:3d} "
          f"maxdiff={r['max_abs_logit_diff']:.3g} kl={r['mean_kl']:.3g} first={r['first_divergence']:.1f} "
          f"acc={r.get('accuracy', float('nan')):.3f}")


if __name__ == "__main__":
  define_flags()
  app.run(main)

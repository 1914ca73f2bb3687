"""Where the engine's step program spends a CPU step holding few tokens, per top-level XLA thunk, at each token
budget: what of it follows the pools' size, what the budget's width, and what the live tokens.

Builds `benchmarks.step_bench`'s runner (no engine: its own tables) for --config at each of --budgets, puts --batch
decode rows at --context tokens on it (bf16 compute and KV, pools for max_model_len --max_model_len), runs the step
twice to compile and warm, then traces --steps steps with `jax.profiler.trace` and reads the trace back with
`jax.profiler.ProfileData`. Each thunk is matched to its instruction in the compiled step; only the entry
computation's instructions are summed (a loop's thunk holds its body's time), so the groups do not overlap:

* pool-sized: an output with the shape of a KV pool (or the pool flattened to rows, as `caches.write_rows` sees
  it): the KV writes' passes over whole pools;
* budget-wide: an output whose leading dimension is the budget (buffers, their fills and copies, bitcasts);
* sorts: the sampler's and the expert pairs' sorts (the pairs' span the budget, the sampler's the row slots);
* loops: the row-block loops over the live blocks (with everything inside them);
* other: the rest.

Thunks run on XLA's thread pool, so the groups can add up to more than the step's wall time.

    python -m benchmarks.probes.step_profile [--config=wide_moe] [--budgets=64,2048] [--steps=5] [--top=12]
"""

from __future__ import annotations

import collections
import re
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from benchmarks.step_bench import CONFIGS
from benchmarks.support.bare_runner import make_runner, rows_at
from benchmarks.support.timing import thunk_ms
from dsv4 import caches, model

flags.DEFINE_enum("config", "wide_moe", sorted(CONFIGS), "Model config.")
flags.DEFINE_list("budgets", ["64", "2048"], "Token budgets (max_num_batched_tokens) profiled.")
flags.DEFINE_integer("batch", 8, "Decode rows per step.")
flags.DEFINE_integer("context", 1024, "Tokens before each row's decode token.")
flags.DEFINE_integer("max_model_len", 65536, "The runner's max_model_len (sizes its pools).")
flags.DEFINE_integer("max_num_seqs", 64, "Row slots of the runner.")
flags.DEFINE_integer("steps", 5, "Steps traced.")
flags.DEFINE_integer("top", 12, "Thunks listed per budget.")
FLAGS = flags.FLAGS

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\(.*?\)|\S+?)(?:\{[\d,]*\})?\s+([\w\-]+)\(")


def entry_instructions(hlo_text: str) -> dict[str, tuple[str, str]]:
  """The entry computation's instructions: name -> (output shape, opcode)."""
  entry = hlo_text.split("\nENTRY ", 1)[1]
  out = {}
  for line in entry.splitlines()[1:]:
    m = _INSTR.match(line)
    if m:
      out[m.group(1)] = (m.group(2), m.group(3))
  return out


def _dims(shape: str) -> tuple[int, ...]:
  m = re.match(r"\w+\[([\d,]*)\]", shape)
  return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def pool_shapes(cache) -> set[tuple[int, ...]]:
  """The pools' shapes, each also flattened to rows (blocks x rows per block, ...)."""
  out = set()
  for a in jax.tree_util.tree_leaves(cache):
    out.add(tuple(a.shape))
    if a.ndim >= 2:
      out.add((a.shape[0] * a.shape[1], *a.shape[2:]))
  return out


def group(shape: str, op: str, budget: int, pools: set) -> str:
  dims = _dims(shape)
  if op == "while":
    return "loops"
  if dims and dims in pools:
    return "pool-sized"
  if "sort" in op:
    return "sorts"
  if dims and dims[0] == budget:
    return "budget-wide"
  return "other"


def profile(budget: int) -> dict:
  cfg = CONFIGS[FLAGS.config]()
  layout = caches.CacheLayout(kv_dtype=jax.numpy.bfloat16)
  bf16 = model.cast_params(model.init_params(cfg, jax.random.PRNGKey(0)), jax.numpy.bfloat16)
  run = make_runner(cfg, bf16, chunk_size=min(budget, 2048), max_num_batched_tokens=budget,
                    max_model_len=FLAGS.max_model_len, max_num_seqs=FLAGS.max_num_seqs, layout=layout, dtype="bf16")
  rows = rows_at(run, [FLAGS.context] * FLAGS.batch, [1] * FLAGS.batch, np.random.default_rng(0))
  for _ in range(2):
    run.run(rows)
  comp = run.lowered_step(rows).compile()
  index = entry_instructions(comp.as_text())
  d = tempfile.mkdtemp()
  t0 = time.perf_counter()
  with jax.profiler.trace(d):
    for _ in range(FLAGS.steps):
      run.run(rows)
  wall = (time.perf_counter() - t0) / FLAGS.steps
  per = {n: ms for n, ms in thunk_ms(d, FLAGS.steps).items() if n in index}
  pools = pool_shapes(run.cache)
  groups = collections.Counter()
  for n, ms in per.items():
    groups[group(*index[n], budget, pools)] += ms
  top = [(n, ms, *index[n], group(*index[n], budget, pools))
         for n, ms in collections.Counter(per).most_common(FLAGS.top)]
  return {"wall_ms": 1e3 * wall, "groups": groups, "top": top}


def main(argv):
  del argv
  names = ("pool-sized", "budget-wide", "sorts", "loops", "other")
  print(f"{FLAGS.config}: decode batch {FLAGS.batch} at context {FLAGS.context}, max_model_len {FLAGS.max_model_len}, "
        f"{FLAGS.max_num_seqs} row slots, bf16; ms per step ({FLAGS.steps} traced steps, under the profiler)")
  print("| budget | step wall ms | " + " | ".join(names) + " |")
  print("|---" * (len(names) + 2) + "|")
  tops = {}
  for b in (int(x) for x in FLAGS.budgets):
    r = profile(b)
    tops[b] = r["top"]
    print(f"| {b} | {r['wall_ms']:.1f} | " + " | ".join(f"{r['groups'][g]:.2f}" for g in names) + " |")
  for b, top in tops.items():
    print(f"\nbudget {b}: top thunks (ms per step, output shape, opcode, group)")
    for n, ms, shape, op, g in top:
      print(f"  {ms:7.3f}  {n:44s} {shape:26s} {op:12s} {g}")


if __name__ == "__main__":
  app.run(main)

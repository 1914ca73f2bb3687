"""Where a decode step's time goes, per XLA CPU thunk, from JAX's own profiler (no extra packages).

Builds the wide model_vs_hf configuration (V4-Flash attention widths, 4 layers; random weights), prefills
--context tokens into a contiguous cache, traces --profile_steps decode steps with `jax.profiler.trace`, reads the trace
back with `jax.profiler.ProfileData` and sums each thunk's time over the worker threads. Each thunk is matched to
its HLO instruction in the compiled module, which gives its kind (a dot, a fusion holding a dot, a gather, ...),
its output shape and the bytes of its operands; the script prints the top thunks and totals per kind, per step,
beside the step's wall time and XLA's bytes-accessed estimate.

    python -m benchmarks.probes.decode_profile [--profile_steps=3] [--context=256] [--top=15]
"""

from __future__ import annotations

import collections
import json
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.support.configs import wide_config
from benchmarks.support.timing import best_time, thunk_ms, xla_cost
from dsv4 import caches, model

flags.DEFINE_integer("profile_steps", 3, "Decode steps traced.")
flags.DEFINE_integer("context", 256, "Tokens prefilled before the traced decode steps.")
flags.DEFINE_integer("top", 15, "Thunks listed.")
flags.DEFINE_bool("grouped_proj", True, "Also time the grouped output projection (wo_a) at the wide shape in both "
                  "formulations, token-major einsum (before) and group-major (dsv4/layers/attention.py), for 1, 8 "
                  "and --context tokens.")
FLAGS = flags.FLAGS

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\(", re.M)
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def _hlo_index(hlo_text: str) -> dict[str, dict]:
  """instruction name -> {op, shape, has_dot, has_gather} (a fusion looks inside its called computation)."""
  comps, cur = {}, None
  for line in hlo_text.splitlines():
    m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if m and not line.startswith(" "):
      cur = m.group(1)
      comps[cur] = []
    elif cur is not None:
      comps[cur].append(line)
  body_ops = {c: " ".join(lines) for c, lines in comps.items()}
  out = {}
  for m in _INSTR.finditer(hlo_text):
    name, shape, op = m.group(1), m.group(2), m.group(3)
    line_end = hlo_text.find("\n", m.end())
    line = hlo_text[m.start():line_end]
    inner = ""
    c = _CALLS.search(line)
    if c:
      inner = body_ops.get(c.group(1), "")
    text = line + " " + inner
    out[name] = {"op": op, "shape": shape[:80], "has_dot": " dot(" in text or "convolution(" in text,
                 "has_gather": " gather(" in text or "dynamic-slice(" in text}
  return out


def _kind(info: dict | None, name: str) -> str:
  if info is None:
    return "ynn/other" if "ynn" in name or "xnn" in name else "unmatched"
  if info["has_dot"]:
    return "dot"
  if info["has_gather"]:
    return "gather / slice"
  return info["op"]


def _best_ms(f, *args):
  return 1e3 * best_time(lambda: f(*args).block_until_ready(), repeats=7)


def grouped_proj(cfg, T) -> dict:
  """wo_a: [N, G, I] x [G, I, R] -> [N, G, R], as "ngi,gir->ngr" (before) and group-major (now)."""
  a = cfg.attention
  G, I, R = a.o_groups, a.num_heads * a.head_dim // a.o_groups, a.o_lora_rank
  hi = jax.lax.Precision.HIGHEST
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.standard_normal((G, I, R), np.float32))
  token_major = jax.jit(lambda x, w: jnp.einsum("ngi,gir->ngr", x, w, precision=hi))
  group_major = jax.jit(lambda x, w: jnp.einsum("gni,gir->gnr", x.transpose(1, 0, 2), w,
                                                precision=hi).transpose(1, 0, 2))
  out = {}
  for n in (1, 8, T):
    x = jnp.asarray(rng.standard_normal((n, G, I), np.float32))
    tb, ta = _best_ms(token_major, x, w), _best_ms(group_major, x, w)
    out[f"tokens_{n}"] = {"token_major_ms": round(tb, 2), "group_major_ms": round(ta, 2),
                          "speedup": round(tb / ta, 2),
                          "max_abs_diff": float(jnp.max(jnp.abs(token_major(x, w) - group_major(x, w))))}
  return out


def main(argv):
  del argv
  cfg = wide_config()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  T, S = FLAGS.context, FLAGS.profile_steps
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, T + S + 1)), jnp.int32)
  layout = caches.CacheLayout()
  cache, swa, full = caches.init_contiguous(cfg, 1, T + S + 1, layout)
  tabs = (jnp.asarray(swa), jnp.asarray(full))
  idx = caches.BatchIndex(jnp.zeros(1, jnp.int32), jnp.full((1,), T, jnp.int32), *tabs)
  cache, _ = model.forward_jit(params, cfg, tokens[:, :T], cache, idx, layout)

  def step(cache, s):
    i = caches.BatchIndex(jnp.full((1,), T + s, jnp.int32), jnp.ones((1,), jnp.int32), *tabs)
    return model.forward_jit(params, cfg, tokens[:, T + s:T + s + 1], cache, i, layout)

  cache, lg = step(cache, 0)                     # compile + warm
  jax.block_until_ready(lg)
  comp = model.forward_jit.lower(params, cfg, tokens[:, T:T + 1], cache, idx, layout).compile()
  ca = xla_cost(comp)
  index = _hlo_index(comp.as_text())
  d = tempfile.mkdtemp()
  t0 = time.perf_counter()
  with jax.profiler.trace(d):
    for s in range(1, S + 1):
      cache, lg = step(cache, s)
    jax.block_until_ready(lg)
  wall = (time.perf_counter() - t0) / S
  per = thunk_ms(d, S)
  kinds = collections.Counter()
  for n, ms in per.items():
    kinds[_kind(index.get(n), n)] += ms
  busy = sum(per.values())
  res = {"config": cfg.name, "params": model.count_params(params), "wall_ms_per_step": round(1e3 * wall, 2),
         "thunk_ms_per_step": round(busy, 2), "xla_bytes_accessed_per_step": ca.get("bytes accessed"),
         "weight_bytes_fp32": 4 * model.count_params(params),
         "ms_by_kind": {k: round(v, 2) for k, v in kinds.most_common()},
         "unmatched_names": [n for n, _ in collections.Counter({n: ms for n, ms in per.items()
                                                                 if n not in index}).most_common(8)],
         "top_thunks": [{"name": n, "ms": round(ms, 2), **(index.get(n) or {})}
                        for n, ms in per.most_common(FLAGS.top)]}
  if FLAGS.grouped_proj:
    res["grouped_output_projection"] = grouped_proj(cfg, T)
  print(json.dumps(res, indent=1))


if __name__ == "__main__":
  app.run(main)

"""The engine's one step program (`step_body`, jitted as `ragged_step`): all rows of a step on ONE flat token axis
through `model.forward_ragged` (a decode row contributes 1 token, a prefill row its chunk), each row's block tables
gathered on the device at its manager slot, then logits at each row's last token and sampling, in one program. The
plan arrives as one packed int32 buffer (`step_plan`); the outputs come back as a `StepOutput`.

Every mode is this program (the mode is part of its static shape or its static arguments):
* Batch-invariant, always: one shape per engine; the flat axis runs through each layer once, every op
  row-invariant (a token's bits never depend on the other tokens of the call; dsv4/layers/row_invariant.py) and
  looping over the live tokens only, logits at the fixed [rows, ...] shape and sampling in fixed blocks over the
  live rows, so nothing in a token's math depends on what else shares the step or on how its prompt was chunked.
  Cost: the live tokens, the live rows' sampling and the live context.
* Speculative decoding (`RaggedShape.spec` = k): verification and the MTP block's drafts (`speculative_step`).
* A mesh: the same body, run by `ModelRunner` under `jax.shard_map` (pools over `data`) or a plain mesh jit.
* KV precision, kernels (`kernel_cfg`) and the model API (functional or NNX modules) are static arguments.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dsv4 import caches, model
from dsv4.engine.sampling import sample_rows_impl
from dsv4.engine.speculative_step import continue_rows, verify_and_draft
from dsv4.engine.step_plan import RaggedShape, invariant_step_index, live_rows, unpack
from dsv4.layers import row_invariant


class StepOutput(NamedTuple):
  """What one step program returns (a pytree: a None field is an empty subtree, e.g. logits when not recorded).

  cache: the paged cache after the step's KV writes (donated in, returned).
  tables: per group the device block tables [slots, W] (donated in, returned unchanged: they stay with the cache
    manager); None from a mesh step, whose tables were inputs of that call only.
  results: per row, padded to the slots S: the sampled token [S] int32, or with k drafts each row's
    `step_plan.result_width(k)` ints [S, 1 + (k + 1) + k] (new-token count, the new tokens, the next drafts). On a
    mesh with pools over `data`: gathered over `data`, [D, S / D] (or [D, S / D, W]).
  prev_tokens: the same results kept on the device as the next step's `prev_tokens` (a token id -(1 + j) in the
    next plan is row j's entry); None from a mesh step (no async scheduling there).
  logits: [rows, V] float, the logits each row's token was drawn from, when the step records them (with drafts
  [rows, k + 1, V]: one per token a row can decide); else None.
  loop_buffers: the row-block loops' buffers (donated in, returned written: `row_invariant.LoopBuffers`); () where
    the backend carries none (a GPU) and from a mesh step.
  """
  cache: Any
  tables: dict | None
  results: jax.Array
  prev_tokens: jax.Array | None
  logits: jax.Array | None
  loop_buffers: tuple = ()


def _row_tables(tables, p, shape: RaggedShape):
  """Each row's block tables [R, width], gathered from the device tables [slots, W] at its slot: the full table
  from entry 0 (width follows the live context), the swa table from its base block (the window + chunk).

  The step's full table spans max_model_len: it is not copied per row; the device table itself goes to
  the model with each row's slot as its table row (`StepIndex.full_row_R`, `p["full_row"]`), so a lookup reads
  only the blocks it needs and nothing costs the table width."""
  out = {}
  slot = jnp.maximum(p["slot"], 0)
  for g, t in tables.items():
    w = t.shape[1]
    if g != caches.SWA and w == shape.full_width:
      out[g] = t
      p["full_row"] = slot
    elif g == caches.SWA:
      cols = p["swa_base"][:, None] + jnp.arange(shape.swa_width, dtype=jnp.int32)[None]
      out[g] = jnp.where(cols < w, t[slot[:, None], jnp.minimum(cols, w - 1)], -1)
    else:
      out[g] = t[slot, :min(shape.full_width, w)]
      if shape.full_width > w:
        out[g] = jnp.pad(out[g], ((0, 0), (0, shape.full_width - w)), constant_values=-1)
  return out


def step_body(params, cache, tables, prev_tokens, buf, *, config, layout, kernel_cfg, shape: RaggedShape,
              record_logits: bool, model_api: str = "functional", graphdef=None):
  """The engine's one step program (unjitted; `ragged_step` is its one-device jit, `ModelRunner` wraps it for a
  mesh): all rows on one flat token axis (`model.forward_ragged`): a decode row costs one token, a prefill row its
  chunk; the row-invariant ops loop over the live tokens only. Logits at each row's last token, then sampling.

  tables: per group the device block tables [slots, W], as the cache's bookkeeping program left them (it runs
  right before this one on the device, `cache.device_state.apply`; no host read between). prev_tokens [S]: the
  previous step's sampled tokens, which a token id -(1 + j) refers to.

  Returns a `StepOutput`: the cache, the tables, each row's sampled token (or speculative results) padded to S,
  the same again as the next step's prev_tokens, and the rows' logits when record_logits.

  model_api="nnx": params is the `nnx.State` and graphdef (static) the `nnx.GraphDef` of an `nnx_model.Model`
  (`nnx.split`); the step runs that module (`Model.ragged`, its blocks calling their own sub-modules), so a changed
  module is a changed graphdef and compiles its own program.

  The step runs its live tokens through each layer once (`step_plan.invariant_step_index`), then each live row's
  logits (fixed [rows, D] shape) and sample (fixed row blocks, `live_row_samples`): nothing in a token's math depends on what else shares
  the step or on how its prompt was chunked. On the CPU each loop buffer's fill is its own
  (`row_invariant.distinct_fills`)."""
  with row_invariant.distinct_fills():
    return _step_body(params, cache, tables, prev_tokens, buf, config=config, layout=layout, kernel_cfg=kernel_cfg,
                      shape=shape, record_logits=record_logits, model_api=model_api, graphdef=graphdef)


def _step_body(params, cache, tables, prev_tokens, buf, *, config, layout, kernel_cfg, shape: RaggedShape,
               record_logits: bool, model_api: str, graphdef):
  p = unpack(buf, shape)
  if shape.spec:
    p = continue_rows(p, prev_tokens, shape)
  else:
    toks_in = p["tokens"]
    p["tokens"] = jnp.where(toks_in < 0, prev_tokens[jnp.clip(-toks_in - 1, 0, prev_tokens.shape[0] - 1)], toks_in)
  rows = _row_tables(tables, p, shape)
  S = prev_tokens.shape[0]
  if model_api == "nnx":
    from flax import nnx  # local: the default path does not import Flax
    net = nnx.merge(graphdef, params)
    fwd = functools.partial(net.ragged, layout=layout, kernel_cfg=kernel_cfg)
    to_logits = net.logits
  else:
    fwd = functools.partial(model.forward_ragged, params, config, layout=layout, kernel_cfg=kernel_cfg)
    to_logits = functools.partial(model.lm_logits, params)

  def output(cache, results_R, logits_RxV) -> StepOutput:
    """Each row's results padded to the S slots, kept on the device as the next step's prev_tokens too."""
    padded = jnp.zeros((S, *results_R.shape[1:]), jnp.int32).at[:results_R.shape[0]].set(
        results_R.astype(jnp.int32), mode="drop")
    return StepOutput(cache, tables, padded, padded, logits_RxV if record_logits else None)

  if shape.spec:
    if model_api != "functional":
      raise ValueError("speculative decoding runs the functional model (model_api='functional')")
    cache, results_RxW, logits = verify_and_draft(params, config, layout, kernel_cfg, shape, p, rows, cache)
    return output(cache, results_RxW, logits)

  cache, h_NxD = fwd(p["tokens"], cache, invariant_step_index(p, rows))
  tokens_R, logits_RxV = live_row_samples(p, h_NxD, to_logits, record_logits)
  return output(cache, tokens_R, logits_RxV)


def live_row_samples(p, h_NxD, to_logits, record_logits: bool):
  """Each row's logits at its last token, at the fixed [rows, D] shape of this engine (one matmul whose rows do not
  see each other: its shape, not its neighbours, decides the summation order; the LM head read once per step),
  then the sampled tokens in fixed row blocks over the live rows only: the sampler's sort of the vocabulary follows
  the rows the step holds (a decode of 8 rows in an engine of 256 slots sorts 8 rows, not 256). Returns (tokens
  [rows], logits [rows, V] or None); tokens past the live blocks are unspecified (nothing reads them)."""
  live = live_rows(p)
  logits = to_logits(h_NxD[jnp.maximum(p["last"], 0)])
  tokens = row_invariant.map_row_blocks(sample_rows_impl, live, logits, p["temperature"], p["top_k"], p["top_p"],
                                        p["seed"], p["step"])
  return tokens, (logits if record_logits else None)


_STEP_STATICS = ("config", "layout", "kernel_cfg", "shape", "record_logits", "model_api", "graphdef")


def _ragged_step(params, cache, tables, prev_tokens, buf, loop_buffers=(), *, config, layout, kernel_cfg,
                 shape: RaggedShape, record_logits: bool, model_api: str = "functional", graphdef=None):
  # no buffers (a caller that keeps none, or a backend that carries none): each loop makes its own
  with row_invariant.carried_loop_buffers(loop_buffers or None) as carried:
    out = step_body(params, cache, tables, prev_tokens, buf, config=config, layout=layout, kernel_cfg=kernel_cfg,
                    shape=shape, record_logits=record_logits, model_api=model_api, graphdef=graphdef)
  return out._replace(loop_buffers=carried.result())


_ragged_step.__name__ = _ragged_step.__qualname__ = "ragged_step"     # the name compile logs show


@functools.cache
def jitted_ragged_step(compiler_options: tuple):
  """`step_body` jitted for one device (compile logs name it `jit(ragged_step)`, on a mesh too), compiled with
  `compiler_options` (sorted (name, value) pairs; () = XLA's defaults). The cache, the tables and the loop
  buffers (`step_loop_buffer_shapes`) are donated: the `StepOutput` returns them."""
  return jax.jit(_ragged_step, static_argnames=_STEP_STATICS,
                 donate_argnames=("cache", "tables", "loop_buffers"), compiler_options=dict(compiler_options) or None)


def step_loop_buffer_shapes(params, cache, tables, prev_tokens, buf, **statics) -> tuple:
  """The loop buffers `ragged_step` takes at these arguments' shapes and statics (`row_invariant.LoopBuffers`):
  its caller makes them once (zeros) and hands each step the buffers the last one returned; () where the backend
  carries none. Traces the step abstractly once per distinct program (cached)."""
  avals = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                 (params, cache, tables, prev_tokens, buf))
  leaves, tree = jax.tree_util.tree_flatten(avals)
  return _loop_buffer_shapes((tuple(leaves), tree), tuple(sorted(statics.items())), row_invariant.blocking())


@functools.cache
def _loop_buffer_shapes(flat_avals, statics: tuple, blocking: row_invariant.RowBlocking) -> tuple:
  del blocking                          # read by the trace; a key here
  leaves, tree = flat_avals
  args = jax.tree_util.tree_unflatten(tree, leaves)
  return row_invariant.loop_buffer_shapes(functools.partial(step_body, **dict(statics)), *args)


ragged_step = jitted_ragged_step(())   # at XLA's defaults (benchmarks lowering the step for its memory)


# XLA's while-loop invariant code motion hoists a loop body's elementwise work on a loop-invariant operand out of
# the loop, on the whole operand: the row-invariant ops' loops slice their live row blocks out of [budget, ...]
# arrays, so a convert of one block became a convert of the step's whole token budget on every such loop (BUILD_NOTES,
# Invariant step cost). The pass only moves work: the same arithmetic, the same bits.
NO_LOOP_HOISTING = ("xla_disable_hlo_passes", "while-loop-invariant-code-motion")


def step_compiler_options(cpu_opt_level: int, gpu_command_buffers: str = "") -> tuple:
  """The step program's XLA options for the default backend: on the CPU, no while-loop invariant code motion
  (`NO_LOOP_HOISTING`, unless XLA_FLAGS disables passes itself) and LLVM's optimisation level `cpu_opt_level`
  (EngineConfig.cpu_step_opt_level; -1 = XLA's default; a level set in XLA_FLAGS wins: the test suite's, a
  user's). On a GPU: the command types of its CUDA graphs, `gpu_command_buffers`
  (EngineConfig.gpu_step_command_buffers; '' = XLA's default); otherwise XLA's defaults (not measured there)."""
  if jax.default_backend() == "gpu":
    return (("xla_gpu_enable_command_buffer", gpu_command_buffers),) if gpu_command_buffers else ()
  if jax.default_backend() != "cpu":
    return ()
  flags = os.environ.get("XLA_FLAGS", "")
  opts = [] if "xla_disable_hlo_passes" in flags else [NO_LOOP_HOISTING]
  if cpu_opt_level >= 0 and "xla_backend_optimization_level" not in flags:
    opts.append(("xla_backend_optimization_level", int(cpu_opt_level)))
  return tuple(sorted(opts))

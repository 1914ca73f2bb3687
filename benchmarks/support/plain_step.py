"""A plain (not batch-invariant) step program, for benchmarks only: the engine's step with its row-invariant ops
swapped for plain XLA ones while it is traced, at a flat axis padded to a power of two of the live tokens (a
program per size), so its shape follows the step.

What differs from the engine's step, and only that: every per-token segment runs as one call over the whole flat
axis (`row_invariant.map_row_blocks` -> `fn(*xs)`), and the routed experts are the formulation the model used before
it had a grouped one (few pairs: each gathers its expert's weights; more: `lax.ragged_dot` over the pairs sorted by
expert). The attention, indexer and compressor algorithms (fixed key blocks, running top-k, the fold over the live
tokens) are the engine's own, so the comparison prices row invariance, nothing else."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp

from dsv4.engine import step_program
from dsv4.engine.runner import ModelRunner
from dsv4.engine.step_plan import pow2_at_least
from dsv4.layers import attention, compressor, moe, row_invariant

_HI = jax.lax.Precision.HIGHEST


def _whole(fn, live, *xs, block: int = 0, prev=(), carry=None):
  del live, block
  args = (*xs, *jax.tree_util.tree_map(lambda a: jnp.roll(a, 1, axis=0), prev))
  return fn(*args) if carry is None else fn(*args, carry)


def plain_routed_experts(params, x_NxD, ids_NxK, w_NxK, cfg, live=None, kernel_cfg=None):
  """The routed experts as plain XLA: a gather of each pair's expert weights when there are no more pairs than
  experts (decode), else `lax.ragged_dot` over the pairs sorted by expert (its result for a token follows the other
  tokens' expert counts)."""
  del live, kernel_cfg
  N, K = ids_NxK.shape
  if N * K <= cfg.n_routed_experts:
    return moe.routed_experts_reference(params, x_NxD, ids_NxK, w_NxK, cfg)
  flat_ids = ids_NxK.reshape(-1)
  order = jnp.argsort(flat_ids, stable=True)
  token_of = order // K
  xs = x_NxD[token_of]
  sizes = jnp.bincount(flat_ids, length=cfg.n_routed_experts).astype(jnp.int32)
  gate = jax.lax.ragged_dot(xs, params["w1"], sizes, precision=_HI)
  up = jax.lax.ragged_dot(xs, params["w3"], sizes, precision=_HI)
  h = jax.lax.ragged_dot(moe.swiglu(gate, up, cfg.swiglu_limit).astype(x_NxD.dtype), params["w2"], sizes,
                         precision=_HI)
  h = h * w_NxK.reshape(-1)[order][:, None].astype(h.dtype)
  return jnp.zeros_like(x_NxD).at[token_of].add(h.astype(x_NxD.dtype))


def plain_routed_expert_rows(params, x_NxD, ids_NxK, w_NxK, cfg, live=None, kernel_cfg=None, layout=None):
  """`plain_routed_experts` in the form the MoE reads (`row_invariant.RowFn`: its rows as they are). The grouped
  layout's ranks the router's call made go unused (XLA drops them)."""
  del layout
  return row_invariant.RowFn(lambda r: r, (plain_routed_experts(params, x_NxD, ids_NxK, w_NxK, cfg, live,
                                                                kernel_cfg),))


@contextlib.contextmanager
def plain_ops():
  """While active (i.e. while a program is traced), the model's row-invariant ops are plain XLA ones."""
  swaps = [(row_invariant, "map_row_blocks", _whole), (attention, "map_row_blocks", _whole),
           (compressor, "map_row_blocks", _whole), (moe, "routed_expert_rows", plain_routed_expert_rows)]
  saved = [(mod, name, getattr(mod, name)) for mod, name, _ in swaps]
  try:
    for mod, name, fn in swaps:
      setattr(mod, name, fn)
    yield
  finally:
    for mod, name, fn in saved:
      setattr(mod, name, fn)


def _plain_ragged_step(params, cache, tables, prev_tokens, buf, loop_buffers=(), **kw):
  del loop_buffers                      # plain ops: no row-block loops
  return step_program.step_body(params, cache, tables, prev_tokens, buf, **kw)


_plain_ragged_step.__name__ = _plain_ragged_step.__qualname__ = "plain_ragged_step"


def make_plain(run: ModelRunner) -> "PlainRunner":
  """`run` turned into the plain step's runner (its own cache and tables; use `PlainRunner.run`)."""
  return PlainRunner(run)


class PlainRunner:
  """A runner whose step is the plain one: each call pads the flat axis to a power of two (>= 8) of its tokens and
  runs `step_body` traced under `plain_ops`."""

  def __init__(self, run: ModelRunner):
    self.runner = run
    self.base_shape = run.step_shape
    ec = run.engine_config
    opts = step_program.step_compiler_options(ec.cpu_step_opt_level, ec.gpu_step_command_buffers)   # the step's
    jitted = jax.jit(_plain_ragged_step, static_argnames=step_program._STEP_STATICS,
                     donate_argnames=("cache", "tables"), compiler_options=dict(opts) or None)

    def one_device_step(*a, **k):
      with plain_ops():
        return jitted(*a, **k)
    run._one_device_step = one_device_step
    run._step_loop_buffers = lambda *a: ()

  def run(self, rows):
    total = sum(len(r.tokens) for r in rows)
    self.runner.step_shape = dataclasses.replace(self.base_shape, tokens=pow2_at_least(total, 8))
    return self.runner.run(rows)

  @property
  def cache(self):
    return self.runner.cache

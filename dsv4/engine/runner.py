"""Model runner: owns the params and the paged cache pytree, runs one jitted step per scheduler step.

Shapes are bucketed so compilation happens a bounded number of times: the batch axis is always
`max_num_seqs` (idle rows have num_tokens = 0), the token axis is 1 for pure-decode steps and `chunk_size` when any
row prefills, and block tables always span `max_model_len`. So at most two step programs are compiled per engine.

With a `mesh` (dsv4.sharding), the same step runs sharded: params and pools carry the rule shardings, the batch rows
are split over `data`, routed experts run expert-parallel, and the logits come back replicated so every process
(one per host under `jax.distributed`) samples the same tokens. The block pools are one pool for all data shards
(replicated over `data`), not one pool per shard.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import caches, model, sharding
from dsv4.config import ModelConfig
from pallas_kernels import dispatch


def _last_token_step(params, config, layout, kernel_cfg, tokens_BxT, cache, index):
  cache, h_BxTxD, _ = model.forward_aux(params, config, tokens_BxT, cache, index, layout=layout,
                                        kernel_cfg=kernel_cfg, return_hidden=True)
  last = jnp.maximum(index.num_tokens_B - 1, 0)
  h_last = jnp.take_along_axis(h_BxTxD, last[:, None, None], axis=1)[:, 0]
  logits = jnp.dot(h_last, params["lm_head"], precision=jax.lax.Precision.HIGHEST)
  return cache, logits


_step = functools.partial(jax.jit, static_argnames=("config", "layout", "kernel_cfg"),
                          donate_argnames=("cache",))(_last_token_step)


class ModelRunner:

  def __init__(self, params, config: ModelConfig, layout: caches.CacheLayout, *, num_swa_blocks: int,
               num_full_blocks: int, max_num_seqs: int, chunk_size: int, max_model_len: int,
               kernel_cfg: dispatch.KernelConfig = dispatch.KernelConfig(), mesh=None,
               rules: sharding.Rules = sharding.Rules()):
    self.params, self.config, self.layout, self.kernel_cfg = params, config, layout, kernel_cfg
    self.max_num_seqs, self.chunk_size = max_num_seqs, chunk_size
    self.swa_width = caches.blocks_for(max_model_len, layout.swa_block_tokens)
    self.full_width = caches.blocks_for(max_model_len, layout.full_block_tokens)
    self.shapes_run: set[tuple[int, int]] = set()
    self.mesh = mesh
    if mesh is None:
      self.cache = caches.init_cache(config, layout, num_swa_blocks, num_full_blocks)
      return
    self._sharded_step, self.shardings = sharding.jit_forward(
        config, mesh, rules, layout=layout, batch=max_num_seqs, num_swa_blocks=num_swa_blocks,
        num_full_blocks=num_full_blocks, kernel_cfg=kernel_cfg, step_fn=_last_token_step)
    self.params = sharding.put(params, self.shardings["params"])
    # Built straight into its shards (no host copy), so it also works when no process sees the whole mesh.
    self.cache = jax.jit(lambda: caches.init_cache(config, layout, num_swa_blocks, num_full_blocks),
                         out_shardings=self.shardings["cache"])()

  def run(self, rows):
    """rows: list of (token ids to compute, start position, swa table, full table). Returns logits [len(rows), V]
    at each row's last computed token, padded to max_num_seqs rows."""
    B = self.max_num_seqs
    assert 0 < len(rows) <= B
    T = 1 if all(len(r[0]) == 1 for r in rows) else self.chunk_size
    tokens = np.zeros((B, T), np.int32)
    start = np.zeros(B, np.int32)
    num = np.zeros(B, np.int32)
    swa = np.full((B, self.swa_width), -1, np.int32)
    full = np.full((B, self.full_width), -1, np.int32)
    for b, (toks, pos, swa_t, full_t) in enumerate(rows):
      assert len(toks) <= T
      tokens[b, : len(toks)] = toks
      start[b], num[b] = pos, len(toks)
      swa[b, : len(swa_t)] = swa_t
      full[b, : len(full_t)] = full_t
    self.shapes_run.add((B, T))
    if self.mesh is not None:
      sh = self.shardings
      index = sharding.put(caches.BatchIndex(start, num, swa, full), sh["index"])
      self.cache, logits = self._sharded_step(self.params, sharding.put(tokens, sh["tokens"]), self.cache, index)
      return logits.addressable_data(0)  # replicated: this process's copy, a plain one-device array
    index = caches.BatchIndex(jnp.asarray(start), jnp.asarray(num), jnp.asarray(swa), jnp.asarray(full))
    self.cache, logits = _step(self.params, self.config, self.layout, self.kernel_cfg, jnp.asarray(tokens),
                               self.cache, index)
    return logits  # [max_num_seqs, V]: fixed shape, so nothing downstream recompiles per batch size

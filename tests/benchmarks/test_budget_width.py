"""benchmarks.support.budget_width: what the step program writes at its token budget's width, traced (no timing).
The counts guard the step's structure: per-token work stays in the loops over the live tokens, and a kernel's
programs of dead tokens write nothing."""

import pytest

from benchmarks.support.budget_width import budget_bytes
from dsv4 import config


def test_the_tiny_step_keeps_its_per_token_work_in_the_live_loops():
  """v4_tiny on the XLA ops: its loops' buffers span the budget (zero-filled on a CPU, unwritten on a GPU), the rest
  of the program writes little per budget token (4.1 KB when written: integer work, the experts' slot tables; the
  compressors' merges at the budget's width alone were more than the whole of it)."""
  b = budget_bytes(config.v4_tiny(), kernels=False)
  assert b.budget_loops > 0 and b.loop_buffers > 0
  assert b.other_ops < 6_000, b.by_primitive


def test_the_tiny_step_runs_consecutive_per_token_work_in_one_loop():
  """v4_tiny on the XLA ops (window, CSA, HCA, CSA layers): 45 loops with a buffer spanning the budget, 82 with a
  loop per op (before the attention's projection loop made its input, its window ids, the indexer's queries and
  the compressors' opening work, each sublayer's last loop ran the block's mHC work after it, and a CSA layer's
  two compressors folded side by side). On a GPU every such loop costs a host round trip per trip test
  (BUILD_NOTES.md, Engine, Open)."""
  assert budget_bytes(config.v4_tiny(), kernels=False).budget_loops <= 45


@pytest.mark.slow
def test_v4_flash_with_kernels_writes_little_past_its_live_tokens():
  """V4-Flash with its kernels (interpret mode, traced only): 0.10 MB per budget token when written, against
  3.0 MB while the attention kernels wrote their dead tokens' outputs and 0.20 MB while the KV rows were cast at the
  budget's width and the top-k kernel wrote its dead tokens' ids (BUILD_NOTES.md, Step cost at real width)."""
  b = budget_bytes(config.v4_flash(), kernels=True)
  assert b.other_ops < 0.15e6, b.by_primitive
  assert b.budget_loops <= 406          # 788 with a loop per op


def test_the_cpu_step_fills_its_loop_buffers_without_copies():
  """On the CPU a loop buffer is filled, not copied from one shared fill (`row_invariant.distinct_fills`: a copy
  reads a buffer as well as writing one): the compiled v4_tiny step at a 256-token budget, handed no carried
  loop buffers (so it fills its own, as a mesh step does), holds no copy of a budget-wide float array made by a
  fill."""
  import re

  import jax
  import jax.numpy as jnp
  import numpy as np

  from benchmarks.support.bare_runner import make_runner, rows_at
  from dsv4 import caches, model
  cfg = config.v4_tiny()
  params = model.cast_params(model.init_params(cfg, jax.random.PRNGKey(0)), jnp.bfloat16)
  run = make_runner(cfg, params, max_model_len=4096, max_num_seqs=8, chunk_size=256, max_num_batched_tokens=256,
                    layout=caches.CacheLayout(kv_dtype=jnp.bfloat16), dtype="bf16")
  rows = rows_at(run, [100] * 4, [1] * 4, np.random.default_rng(0))
  ec = run.engine_config
  hlo = run._one_device_step.lower(run.params, run.cache, run._tables(), run.prev_tokens,
                                   np.asarray(run._pack_rows(rows, run.step_shape)), config=cfg, layout=ec.layout,
                                   kernel_cfg=ec.kernel, shape=run.step_shape, record_logits=ec.record_logits,
                                   model_api=ec.model_api).compile().as_text()
  # a fill: a budget-wide array from nothing but a constant (a fusion without operands, or a constant's broadcast)
  fills = set(re.findall(r"%(\S+) = \w+\[256[,\]]\S* (?:fusion\(\)|broadcast\(%constant\S*\))", hlo))
  copied = re.findall(r"= (?:f32|bf16|u16)\[256[,\]]\S* copy\(%(\S+)\)", hlo)
  assert fills and not [c for c in copied if c in fills], copied

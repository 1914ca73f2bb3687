"""pallas_kernels.word_pool and the caches that hold narrow float pools as words (the CPU's): a read through a
`WordPool` gives the float pool's bits, every op reads it as it reads the float pool (references and interpret
kernels, bit for bit, on fresh random inputs), and neither a write nor a read in a loop passes over the pool."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dsv4 import caches
from pallas_kernels import dispatch, word_pool

_WORDS = {jnp.dtype(jnp.bfloat16): jnp.uint16, jnp.dtype(jnp.float8_e4m3fn): jnp.uint8}


def _as_words(a):
  return word_pool.WordPool(jax.lax.bitcast_convert_type(a, _WORDS[jnp.dtype(a.dtype)]), a.dtype)


def _words_tree(tree):
  """Every narrow float array of `tree` as a `WordPool`."""
  return jax.tree_util.tree_map(lambda a: _as_words(a) if jnp.dtype(a.dtype) in _WORDS else a, tree)


def _bits(tree):
  return [np.asarray(caches.as_bits(a)) for a in jax.tree_util.tree_leaves(tree)]


def _assert_same_bits(a, b):
  a, b = _bits(a), _bits(b)
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 40), fp8=st.booleans())
def test_reads_see_the_floats(seed, rows, fp8):
  dt = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
  key = jax.random.PRNGKey(seed)
  pool = (jax.random.normal(key, (rows, 3, 8)) * 4).astype(dt)
  wp = _as_words(pool)
  idx = jax.random.randint(jax.random.fold_in(key, 1), (5, 2), 0, rows)
  assert wp.shape == pool.shape and wp.dtype == pool.dtype
  _assert_same_bits(word_pool.take(wp, idx), jnp.take(pool, idx, axis=0))
  _assert_same_bits(wp[idx[:, 0], 1], pool[idx[:, 0], 1])
  _assert_same_bits(wp.floats(), pool)
  _assert_same_bits(wp.reshape(rows * 3, 8).floats(), pool.reshape(rows * 3, 8))


def test_words_must_be_unsigned_of_the_float_width():
  with pytest.raises(ValueError, match="unsigned of 2 bytes"):
    word_pool.WordPool(jnp.zeros((4, 8), jnp.uint8), jnp.bfloat16)


def _attention_inputs(seed, fp8: bool):
  N, H, D, P, W, K = 6, 4, 128, 48, 5, 7
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  q = jax.random.normal(ks[0], (N, H, D), jnp.bfloat16)
  rows = jax.random.normal(ks[1], (2, P, D), jnp.float32)
  if fp8:
    wpool, cpool = (dispatch.quantize_kv_fp8(r, 64) for r in rows)
  else:
    wpool, cpool = rows.astype(jnp.bfloat16)
  widx = jax.random.randint(ks[2], (N, W), -1, P)
  cidx = jax.random.randint(ks[3], (N, K), -1, P)
  sink = jax.random.normal(ks[4], (H,), jnp.float32)
  return q, wpool, widx, cpool, cidx, sink


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_sparse_attention_reads_words_as_floats(backend, fp8):
  q, wpool, widx, cpool, cidx, sink = _attention_inputs(3, fp8)
  cfg = dispatch.KernelConfig(backend=backend)
  run = jax.jit(lambda wp, cp: dispatch.sparse_attention(q, wp, widx, cp, cidx, sink, scale=0.1, cfg=cfg))
  _assert_same_bits(run(_words_tree(wpool), _words_tree(cpool)), run(wpool, cpool))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_hca_attention_reads_words_as_floats(fp8):
  q, wpool, widx, cpool, _, sink = _attention_inputs(4, fp8)
  N, epb = q.shape[0], 8
  table = jnp.asarray(np.random.default_rng(0).permutation(6)[None, :].repeat(N, 0), jnp.int32)
  nv = jnp.arange(N, dtype=jnp.int32) * 7
  wl = jnp.full((N,), widx.shape[1], jnp.int32)
  run = jax.jit(lambda wp, cp: dispatch.hca_attention(q, wp, widx, wl, cp, table, nv, sink, scale=0.1,
                                                      entries_per_block=epb))
  _assert_same_bits(run(_words_tree(wpool), _words_tree(cpool)), run(wpool, cpool))


def test_indexers_read_words_as_floats():
  B, H, C, NB, E, k = 5, 4, 32, 6, 8, 4
  ks = jax.random.split(jax.random.PRNGKey(5), 4)
  q = jax.random.normal(ks[0], (B, H, C), jnp.bfloat16)
  w = jax.random.uniform(ks[1], (B, H), jnp.float32)
  keys = jax.random.normal(ks[2], (NB, E, C), jnp.bfloat16)
  table = jnp.asarray(np.random.default_rng(1).permutation(NB)[None, :].repeat(B, 0), jnp.int32)
  nv = jnp.array([0, 3, 17, 40, 48], jnp.int32)
  paged = jax.jit(lambda kp: dispatch._indexer_paged.indexer_topk_paged(q, w, kp, table, nv, k)[:2])
  _assert_same_bits(paged(_as_words(keys)), paged(keys))
  rows = (table[:, :, None] * E + jnp.arange(E)[None, None, :]).reshape(B, NB * E)
  scores = jax.jit(lambda kp: dispatch.indexer_scores(q[:, None], w[:, None], kp, rows, nv[:, None]))
  flat = keys.reshape(NB * E, C)
  _assert_same_bits(scores(_as_words(flat)), scores(flat))


def _pool_passes(hlo: str, shapes) -> list[str]:
  """The compiled program's converts, bitcast-converts and copies (in any computation, fused ones included) whose
  output has one of `shapes`: the passes over a pool."""
  pats = [re.compile(rf"=\s*\w+\[{','.join(map(str, s))}\][^ ]*\s+(convert|bitcast-convert|copy)\(") for s in shapes]
  return [ln.strip()[:160] for ln in hlo.splitlines() if any(p.search(ln) for p in pats)]


def _write_then_read(kv_dtype):
  """(a layer's window pool of 4,096 blocks, the rows, a jitted step writing 8 rows then reading 8 rows twice in a
  loop, the pool shapes a pass would have)."""
  import dataclasses
  from dsv4 import config
  cfg = config.v4_tiny(num_layers=1)
  cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, head_dim=80, rope_head_dim=16))
  pool = caches.init_cache(cfg, caches.CacheLayout(kv_dtype=kv_dtype), 4096, 8).layers[0]["window_kv"]
  slots = jnp.arange(8, dtype=jnp.int32) * 33
  rows = jax.random.normal(jax.random.PRNGKey(0), (8, cfg.attention.head_dim))

  def step(pool, rows):
    pool = caches.write_rows(pool, slots[None], rows[None])
    flat = caches.flat_pool(pool)
    total = jax.lax.fori_loop(
        0, 2, lambda i, t: t + jnp.sum(caches.gather_flat(flat, slots + i), dtype=jnp.float32), jnp.float32(0))
    return pool, total
  shapes = [s for a in jax.tree_util.tree_leaves(pool) for s in (a.shape, (a.shape[0] * a.shape[1], *a.shape[2:]))]
  return pool, rows, step, shapes


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, caches.FP8], ids=["bf16", "fp8"])
def test_a_write_and_a_looped_read_do_not_pass_over_the_pool(kv_dtype, monkeypatch):
  """A pool of 4,096 blocks held as words: writing 8 rows and reading 8 rows in a loop compile to a scatter in place
  and gathers of those rows; no convert or copy of the pool's shape anywhere. The same check sees the two passes
  per write of the pool held as floats and written through its bits (what the CPU did before), and the words give
  that pool's bits."""
  pool, rows, step, shapes = _write_then_read(kv_dtype)
  assert all(jnp.issubdtype(a.dtype, jnp.unsignedinteger) for a in jax.tree_util.tree_leaves(pool))
  hlo = jax.jit(step, donate_argnums=0).lower(pool, rows).compile().as_text()
  assert not _pool_passes(hlo, shapes)
  got = jax.jit(step)(pool, rows)
  monkeypatch.setattr(caches, "stored_dtype", lambda dtype: dtype)        # pools held as floats
  as_floats, _, step, shapes = _write_then_read(kv_dtype)
  assert _pool_passes(jax.jit(step, donate_argnums=0).lower(as_floats, rows).compile().as_text(), shapes)
  _assert_same_bits(got, jax.jit(step)(as_floats, rows))

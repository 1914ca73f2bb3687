"""dsv4.layers.row_invariant: a row's bits are the same for every live row count and any permutation of the other
rows, on fresh random inputs at small real-shaped widths; the results equal the plain references up to fp32
summation order."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dsv4.layers import row_invariant
from pallas_kernels import dispatch
from pallas_kernels.grouped_dot import GroupedDotTuning
from tests.isolation import run_in_child

N, K_IN, M_OUT = 96, 128, 80
E, D, I, TOPK = 12, 64, 32, 3
_HI = jax.lax.Precision.HIGHEST


@jax.jit
def _rows_dot(x, w, live):
  return row_invariant.rows_dot(x, w, live, block=16, precision=_HI, preferred_element_type=jnp.float32)


def _expert_weights(key, dtype):
  k1, k2, k3 = jax.random.split(key, 3)
  return (jax.random.normal(k1, (E, D, I), dtype) / 8, jax.random.normal(k2, (E, D, I), dtype) / 8,
          jax.random.normal(k3, (E, I, D), dtype) / 6)


def _expert_fn(w1, w3, w2):
  def f(e, xb):
    g = jnp.dot(xb, w1[e], precision=_HI, preferred_element_type=jnp.float32)
    u = jnp.dot(xb, w3[e], precision=_HI, preferred_element_type=jnp.float32)
    return jnp.dot((jax.nn.silu(g) * u).astype(xb.dtype), w2[e], precision=_HI, preferred_element_type=jnp.float32)
  return f


@jax.jit
def _grouped(x, ids, wts, w1, w3, w2, live):
  return row_invariant.grouped_experts(x, ids, wts, _expert_fn(w1, w3, w2), E, live, block=4)


def _routes(rng, n):
  ids = np.stack([rng.permutation(E)[:TOPK] for _ in range(n)]).astype(np.int32)
  return jnp.asarray(ids), jnp.asarray(rng.uniform(0.1, 1.0, (n, TOPK)).astype(np.float32))


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), live=st.integers(1, N), place=st.integers(0, N - 1),
       bf16=st.booleans())
def test_rows_dot_row_bits_ignore_row_count_and_neighbours(seed, live, place, bf16):
  dt = jnp.bfloat16 if bf16 else jnp.float32
  kx, kw = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(kx, (N, K_IN), dt)
  w = jax.random.normal(kw, (K_IN, M_OUT), dt)
  alone = np.asarray(_rows_dot(jnp.zeros_like(x).at[0].set(x[0]), w, 1))[0]
  place = place % live
  rng = np.random.default_rng(seed)
  others = np.asarray(x)[1:][rng.permutation(N - 1)]
  mixed = np.insert(others, place, np.asarray(x)[0], axis=0)
  got = np.asarray(_rows_dot(jnp.asarray(mixed), w, live))
  np.testing.assert_array_equal(got[place], alone)
  assert not np.any(got[-(-live // 16) * 16:])          # dead blocks: the CPU's unfilled buffer is zeros
  ref = np.asarray(row_invariant.rows_dot_reference(jnp.asarray(mixed[:live]), w, precision=_HI,
                                                    preferred_element_type=jnp.float32))
  np.testing.assert_allclose(got[:live], ref, rtol=2e-5, atol=2e-4)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), live=st.integers(1, N), place=st.integers(0, N - 1))
def test_grouped_experts_row_bits_ignore_batch(seed, live, place):
  rng = np.random.default_rng(seed)
  kx, kw = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(kx, (N, D), jnp.float32)
  w1, w3, w2 = _expert_weights(kw, jnp.float32)
  ids, wts = _routes(rng, N)
  alone = np.asarray(_grouped(x, ids, wts, w1, w3, w2, 1))[0]
  place = place % live
  perm = np.insert(1 + rng.permutation(N - 1), place, 0)    # token 0 at `place`, the others shuffled
  got = np.asarray(_grouped(x[perm], ids[perm], wts[perm], w1, w3, w2, live))
  np.testing.assert_array_equal(got[place], alone)
  blocks_end = -(-live // row_invariant.blocking().rows) * row_invariant.blocking().rows
  assert not np.any(got[live:blocks_end])       # dead tokens of the live blocks: zeros (past them: unspecified)

  def all_pairs(ids_P, x_PxD):
    g = jnp.einsum("pd,pdi->pi", x_PxD, w1[ids_P], precision=_HI)
    u = jnp.einsum("pd,pdi->pi", x_PxD, w3[ids_P], precision=_HI)
    return jnp.einsum("pi,pid->pd", jax.nn.silu(g) * u, w2[ids_P], precision=_HI)
  ref = np.asarray(row_invariant.grouped_experts_reference(x[perm][:live], ids[perm][:live], wts[perm][:live],
                                                           all_pairs))
  np.testing.assert_allclose(got[:live], ref, rtol=2e-5, atol=2e-5)


# The grouped expert kernel in interpret mode, with tiles that divide the small expert shapes (D 64, I 32).
KERNELS = dispatch.KernelConfig("interpret", grouped_dot_tuning=GroupedDotTuning(block_cols=16, block_k=16))


@jax.jit
def _grouped_kernel(x, ids, wts, w1, w3, w2, live):
  return row_invariant.grouped_experts_kernel(x, ids, wts, w1, w3, w2, lambda g, u: jax.nn.silu(g) * u, live,
                                              KERNELS)


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), live=st.integers(1, N), place=st.integers(0, N - 1),
       bf16=st.booleans())
def test_grouped_experts_kernel_row_bits_ignore_batch(seed, live, place, bf16):
  """The grouped expert kernel's layout: a token's bits are the same alone and among any other tokens at any live
  count, dead tokens are zeros, and the result is the loop's up to fp32 summation order."""
  dt = jnp.bfloat16 if bf16 else jnp.float32
  rng = np.random.default_rng(seed)
  kx, kw = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(kx, (N, D), dt)
  w1, w3, w2 = _expert_weights(kw, dt)
  ids, wts = _routes(rng, N)
  alone = np.asarray(_grouped_kernel(x, ids, wts, w1, w3, w2, 1))[0]
  place = place % live
  perm = np.insert(1 + rng.permutation(N - 1), place, 0)
  got = np.asarray(_grouped_kernel(x[perm], ids[perm], wts[perm], w1, w3, w2, live))
  np.testing.assert_array_equal(got[place], alone)
  assert not np.any(got[live:])
  loop = np.asarray(_grouped(x[perm].astype(jnp.float32), ids[perm], wts[perm], *(w.astype(jnp.float32)
                                                                                  for w in (w1, w3, w2)), live))
  tol = 3e-2 if bf16 else 2e-5
  np.testing.assert_allclose(got[:live].astype(np.float32), loop[:live], rtol=tol, atol=tol)


def test_grouped_experts_runs_only_live_blocks():
  """The loop's trip count is the live blocks: each expert's live pairs rounded up to whole blocks."""
  rng = np.random.default_rng(0)
  ids, _ = _routes(rng, N)
  for live in (1, 7, N):
    _, sizes, first_block, _ = row_invariant.expert_blocks(ids, E, live, block=4)
    counts = np.bincount(np.asarray(ids[:live]).reshape(-1), minlength=E)
    np.testing.assert_array_equal(np.asarray(sizes), counts)
    assert int(first_block[E]) == int(np.sum(-(-counts // 4)))


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 70), k=st.integers(1, 4), experts=st.integers(1, 9),
       live_frac=st.floats(0, 1), block=st.integers(1, 5), rows=st.integers(1, 40))
def test_expert_layout_is_a_stable_sort_of_the_live_pairs(seed, n, k, experts, live_frac, block, rows):
  """The layout loops (a counting sort over the live token blocks) against a pure-numpy stable argsort of the live
  pairs by expert, for any token block (`blocking().rows`), with ids of `experts` (no pair) mixed in."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, experts + 1, (n, k)).astype(np.int32)
  live = int(round(live_frac * n))
  flat = np.where(np.repeat(np.arange(n) < live, k), ids.reshape(-1), experts)
  want = np.argsort(flat, kind="stable")[:int(np.sum(flat < experts))]
  sizes_want = np.bincount(flat, minlength=experts + 1)[:experts]
  with mock.patch.object(row_invariant, "blocking", lambda: row_invariant.RowBlocking(rows=rows)):
    order, sizes, first_block, first_pair = row_invariant.expert_blocks(jnp.asarray(ids), experts, live,
                                                                        block=block)
  np.testing.assert_array_equal(np.asarray(sizes), sizes_want)
  np.testing.assert_array_equal(np.asarray(order)[:len(want)], want)
  np.testing.assert_array_equal(np.asarray(first_pair), np.cumsum(sizes_want) - sizes_want)
  np.testing.assert_array_equal(np.asarray(first_block), np.concatenate([[0], np.cumsum(-(-sizes_want // block))]))


def test_map_row_blocks_bad_blocking():
  with pytest.raises(ValueError, match="at least one row"):
    row_invariant.RowBlocking(rows=0)


@pytest.mark.parametrize("backend_blocks,ntok,widths", [("cpu", 29, (32, 64)), ("cpu", 40, (64, 96)),
                                                         ("gpu", 150, (256, 384))],
                         ids=["cpu_blocks", "cpu_blocks_two_live", "gpu_blocks"])
def test_forward_bits_ignore_the_flat_width(backend_blocks, ntok, widths, request, monkeypatch):
  """The model on one row's live tokens at two flat widths (the step budgets of two engines): the same hidden
  states and the same cache contents, bit for bit (every per-token op runs in fixed row blocks). With the CPU's
  blocks (32 rows: widths 32 and 64) and with a GPU's (128 rows: two live blocks at widths 256 and 384, whole
  blocks as an engine's step has them). In a child process at XLA's default optimisation level, like the engine's
  bitwise checks: the claim is about the code users run."""
  if run_in_child(request, default_xla_opt=True):
    return
  from dsv4 import caches, config, model
  blocks = {"cpu": row_invariant.CPU_BLOCKING, "gpu": row_invariant.GPU_BLOCKING}[backend_blocks]
  monkeypatch.setattr(row_invariant, "blocking", lambda: blocks)
  cfg = config.v4_tiny(num_layers=3)          # one layer of each kind: window, CSA, HCA
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  lay = caches.CacheLayout()
  R = 4

  def run(n):
    toks = np.zeros(n, np.int32)
    toks[:ntok] = np.arange(2, 2 + ntok)
    row = np.full(n, -1, np.int32)
    row[:ntok] = 0
    pos = np.zeros(n, np.int32)
    pos[:ntok] = np.arange(ntok)
    num = np.zeros(R, np.int32)
    num[0] = ntok
    swa = np.full((R, 8), -1, np.int32)
    swa[0, :ntok // 32 + 1] = np.arange(ntok // 32 + 1)       # 32-token swa blocks, 128-token full blocks
    full = np.full((R, 4), -1, np.int32)
    full[0, :ntok // 128 + 1] = np.arange(ntok // 128 + 1)
    step = caches.StepIndex(jnp.asarray(row), jnp.asarray(pos), jnp.zeros(R, jnp.int32), jnp.asarray(num),
                            {caches.SWA: jnp.asarray(swa), caches.FULL: jnp.asarray(full)},
                            swa_base_R=jnp.zeros(R, jnp.int32), live_tokens=jnp.int32(ntok), invariant=True)
    cache, h = jax.jit(lambda c, t, s: model.forward_ragged(params, cfg, t, c, s, layout=lay))(
        caches.init_cache(cfg, lay, 16, 8), jnp.asarray(toks), step)
    return cache, np.asarray(h)[:ntok]

  (c_narrow, h_narrow), (c_wide, h_wide) = run(widths[0]), run(widths[1])
  np.testing.assert_array_equal(h_narrow, h_wide)
  for a, b in zip(c_narrow.layers, c_wide.layers):
    for k in a:
      np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


def _forward_bits(layout, n=64, ntok=20, kernel_cfg=dispatch.KernelConfig()):
  """The bf16 model (one layer of each kind; head_dim - RoPE = 64, so FP8 KV fits) on one row's `ntok` tokens at a
  flat width of `n` (the CPU's blocks: a live row block and a dead one): (every cache array as bits, the live
  tokens' hidden states as bits)."""
  import dataclasses
  from dsv4 import caches, config, model
  cfg = config.v4_tiny(num_layers=3)
  cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, head_dim=80, rope_head_dim=16))
  params = model.cast_params(model.init_params(cfg, jax.random.PRNGKey(1)), jnp.bfloat16)
  tokens = jnp.asarray(np.r_[np.arange(3, 3 + ntok), np.zeros(n - ntok)].astype(np.int32))
  row = jnp.asarray(np.r_[np.zeros(ntok), -np.ones(n - ntok)].astype(np.int32))
  pos = jnp.asarray(np.r_[np.arange(ntok), np.zeros(n - ntok)].astype(np.int32))
  step = caches.StepIndex(row, pos, jnp.zeros(2, jnp.int32), jnp.asarray([ntok, 0], jnp.int32),
                          {caches.SWA: jnp.asarray([list(range(6)), [-1] * 6], jnp.int32),
                           caches.FULL: jnp.asarray([[0, 1], [-1, -1]], jnp.int32)},
                          swa_base_R=jnp.zeros(2, jnp.int32), live_tokens=jnp.int32(ntok), invariant=True)
  cache, h = jax.jit(lambda c: model.forward_ragged(params, cfg, tokens, c, step, layout=layout,
                                                     kernel_cfg=kernel_cfg))(caches.init_cache(cfg, layout, 8, 6))
  return [np.asarray(caches.as_bits(a)) for a in jax.tree_util.tree_leaves(cache)], np.asarray(h)[:ntok].view(np.uint16)


def _assert_same(a, b):
  (pools_a, h_a), (pools_b, h_b) = a, b
  np.testing.assert_array_equal(h_a, h_b)
  for x, y in zip(pools_a, pools_b):
    np.testing.assert_array_equal(x, y)


def _garbage(shape, dtype):
  """A loop buffer as a GPU may leave it: NaN floats, all-ones integers (instead of the CPU's zeros)."""
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.full(shape, jnp.nan, dtype)
  return jnp.full(shape, -1 if jnp.issubdtype(dtype, jnp.signedinteger) else 1, dtype)


def test_in_place_updates_and_unwritten_buffers_keep_the_bits(monkeypatch):
  """The two things a GPU does differently from the CPU, on the CPU, bit for bit:
  * 16-bit pools and loop outputs: the CPU updates them through their bit patterns (`caches.updates_through_bits`),
    a GPU in place (the bf16 model with FP8 KV: e4m3 and UE8M0 record parts, bf16 RoPE channels and index keys);
  * a row-block loop's buffer is `jax.lax.empty`: zeros on the CPU, unwritten on a GPU; filled with NaN instead,
    the dead rows (20 live tokens of 64) reach no live token.
  Hidden states and every pool compared."""
  from dsv4 import caches
  assert caches.updates_through_bits(jnp.bfloat16) and caches.updates_through_bits(jnp.float8_e4m3fn)
  lay = caches.CacheLayout(kv_dtype=caches.FP8)
  as_on_the_cpu = _forward_bits(lay)
  with monkeypatch.context() as m:
    m.setattr(caches, "updates_through_bits", lambda dtype: False)
    m.setattr(row_invariant, "_unfilled", _garbage)
    _assert_same(as_on_the_cpu, _forward_bits(lay))


@pytest.mark.parametrize("backend_blocks", ["cpu", "gpu"])
def test_dead_rows_of_loop_buffers_reach_no_live_row_on_the_kernels(backend_blocks, monkeypatch):
  """The Pallas kernels (interpret mode) run over every token of the flat axis: with the loop buffers filled with
  NaN and all-ones integers instead of zeros, a kernel's program of a token past the live ones finds nothing to
  read and writes nothing a live token reads: the live tokens' hidden states and every pool keep their bits. With
  the CPU's row blocks (64 tokens, 20 live) and a GPU's (128 rows: 256 tokens, 150 live: two live blocks, the
  second partly)."""
  from dsv4 import caches
  n, ntok = (64, 20) if backend_blocks == "cpu" else (256, 150)
  if backend_blocks == "gpu":
    monkeypatch.setattr(row_invariant, "blocking", lambda: row_invariant.GPU_BLOCKING)
  lay = caches.CacheLayout(kv_dtype=jnp.bfloat16)
  kcfg = dispatch.KernelConfig(backend="interpret", grouped_dot_tuning=GroupedDotTuning(block_cols=16, block_k=16))
  zeros = _forward_bits(lay, n, ntok, kernel_cfg=kcfg)
  with monkeypatch.context() as m:
    m.setattr(row_invariant, "_unfilled", _garbage)
    _assert_same(zeros, _forward_bits(lay, n, ntok, kernel_cfg=kcfg))


@jax.jit
def _then(x, w, g, live):
  """A projection's loop with a tail (an RMS norm scaled by another array's rows) run in it."""
  tail = row_invariant.RowFn(lambda y, gb: (y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6)
                                            * gb).astype(x.dtype), (g,))
  return row_invariant.map_row_blocks_then(lambda xb: jnp.dot(xb, w, precision=_HI), tail, live, x, block=16)


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), live=st.integers(1, N), place=st.integers(0, N - 1))
def test_a_tail_in_its_sublayers_loop_keeps_row_bits(seed, live, place):
  """`map_row_blocks_then`: the tail's work on fn's rows inside fn's loop (bf16): a row's bits ignore the live count
  and the other rows, and the values are those of the two steps one after the other."""
  kx, kw, kg = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(kx, (N, K_IN), jnp.bfloat16)
  w = jax.random.normal(kw, (K_IN, M_OUT), jnp.bfloat16)
  g = jax.random.normal(kg, (N, M_OUT), jnp.bfloat16)
  alone = np.asarray(_then(jnp.zeros_like(x).at[0].set(x[0]), w, jnp.zeros_like(g).at[0].set(g[0]), 1))[0]
  place = place % live
  perm = np.random.default_rng(seed).permutation(N - 1) + 1
  order = np.insert(perm, place, 0)
  got = np.asarray(_then(x[order], w, g[order], live))
  np.testing.assert_array_equal(got[place], alone)
  y = jnp.dot(x[order][:live], w, precision=_HI)
  ref = (y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6) * g[order][:live]).astype(x.dtype)
  np.testing.assert_allclose(np.asarray(got[:live], np.float32), np.asarray(ref, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_attention_queries_run_in_their_own_blocks(variant, monkeypatch):
  """The attention's XLA paths over the pools (sparse window + top-k, HCA, V4.1's candidate scoring) take their
  queries in blocks of `RowBlocking.attention_rows`, not the projections' rows: at decode every query in a live
  block reads its whole context, so on the CPU a step of 20 live tokens in 64 computes attention for 24 queries
  (three 8-query blocks), not 32. Traced (no compile) at V4's three layer kinds and V4.1's eight. (A GPU's blocks
  are the projections' 128 rows: its kernels take the live bound instead.)"""
  from dsv4 import caches, config, model
  blocks = row_invariant.CPU_BLOCKING
  assert (blocks.rows, blocks.attention_rows) == (32, 8)
  assert row_invariant.GPU_BLOCKING.attention_rows == row_invariant.GPU_BLOCKING.rows == 128
  monkeypatch.setattr(row_invariant, "blocking", lambda: blocks)
  seen = {}
  for name in ("sparse_attention", "hca_attention", "indexer_topk_candidates"):
    def record(q, *a, _name=name, _fn=getattr(dispatch, name), **kw):
      seen.setdefault(_name, set()).add(q.shape[0])
      return _fn(q, *a, **kw)
    monkeypatch.setattr(dispatch, name, record)
  cfg = config.v4_tiny(num_layers=3) if variant == "v4" else config.v41_tiny()
  params = model.abstract_params(cfg)
  n, ntok = 64, 20
  step = caches.StepIndex(jnp.asarray(np.r_[np.zeros(ntok), -np.ones(n - ntok)].astype(np.int32)),
                          jnp.asarray(np.r_[np.arange(ntok), np.zeros(n - ntok)].astype(np.int32)),
                          jnp.zeros(2, jnp.int32), jnp.asarray([ntok, 0], jnp.int32),
                          {caches.SWA: jnp.asarray([list(range(6)), [-1] * 6], jnp.int32),
                           caches.FULL: jnp.asarray([[0, 1], [-1, -1]], jnp.int32)},
                          swa_base_R=jnp.zeros(2, jnp.int32), live_tokens=jnp.int32(ntok), invariant=True)
  cache = caches.init_cache(cfg, caches.CacheLayout(), 8, 6)
  jax.eval_shape(lambda p, c, t: model.forward_ragged(p, cfg, t, c, step), params, cache, jnp.zeros(n, jnp.int32))
  want = {"v4": {"sparse_attention", "hca_attention"}, "v41": {"sparse_attention", "indexer_topk_candidates"}}
  assert want[variant] <= set(seen), seen
  assert all(sizes == {blocks.attention_rows} for sizes in seen.values()), seen

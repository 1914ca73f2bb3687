"""The HCA kernel of the invariant step (interpret mode) against its reference and the sparse MLA reference, and the
batch invariance of every kernel the invariant step runs: a row's bits do not depend on its neighbours, their
lengths or its place in the call (HCA, sparse MLA, the fused indexer top-k, whose ties keep the lower entry id like
the paged XLA indexer's). The engine-level check (tiny V4, interpret kernels, invariant step) is in the slow tier."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels import hca_attention as hk
from pallas_kernels import indexer_paged as ixp
from pallas_kernels import indexer_topk as it
from pallas_kernels import sparse_attention as sa
from tests.pallas_kernels.jaxpr_shapes import per_query_table_shapes

N, H, D, ROPE, W, E, F = 8, 4, 128, 64, 16, 2, 104  # 208 table entries: nv spans 0, < 64, 64 and several blocks
P = 96                                             # window pool rows
Q = 3 * F * E                                      # compressed pool rows (table blocks up to Q / E)
NV = [0, 5, 64, 199, 130, 1, 64 + 17, 0]           # row 0 and 7: padding (no window row, nothing visible)
WL = [0, 16, 7, 16, 1, 3, 16, 0]
TUNE = hk.HcaAttentionTuning(block_k=16)


def _pools(rng, fmt):
  wp = rng.standard_normal((P, D)).astype(np.float32)
  cp = rng.standard_normal((Q, D)).astype(np.float32)
  if fmt == "fp32":
    return jnp.asarray(wp), jnp.asarray(cp)
  if fmt == "bf16":
    return jnp.asarray(wp, jnp.bfloat16), jnp.asarray(cp, jnp.bfloat16)
  wp, cp = sa.quantize_kv_fp8(jnp.asarray(wp), ROPE), sa.quantize_kv_fp8(jnp.asarray(cp), ROPE)
  if fmt == "fp8_paged":
    return sa.record_to_paged(wp, 16), sa.record_to_paged(cp, 16)
  return wp, cp


def make_case(seed, fmt, nv=NV, wl=WL):
  rng = np.random.default_rng(seed)
  n = len(nv)
  qdt = jnp.float32 if fmt == "fp32" else jnp.bfloat16
  q = rng.standard_normal((n, H, D)).astype(np.float32) * 0.5
  wp, cp = _pools(rng, fmt)
  wi = rng.integers(0, P, (n, W))
  wi[rng.random((n, W)) < 0.1] = -1
  wi[rng.random((n, W)) < 0.05] = P + 3  # out of range: invalid like -1
  table = rng.permutation(Q // E)[:F][None, :].repeat(n, 0)
  for r in range(n):
    table[r] = rng.permutation(Q // E)[:F]
  table[rng.random((n, F)) < 0.1] = -1  # unallocated blocks: their entries are invisible
  wl_a, nv_a = np.asarray(wl), np.asarray(nv)
  wi[wl_a == 0] = -1
  sink = rng.standard_normal(H).astype(np.float32)
  return (jnp.asarray(q, qdt), wp, jnp.asarray(wi, jnp.int32), jnp.asarray(wl_a, jnp.int32), cp,
          jnp.asarray(table, jnp.int32), jnp.asarray(nv_a, jnp.int32), jnp.asarray(sink))


STATIC = dict(scale=D ** -0.5, entries_per_block=E)


def kernel(args):
  return hk.hca_attention_pallas(*args, **STATIC, interpret=True, tuning=TUNE)


def _sparse_view(args):
  """The same call as sparse MLA: the compressed id row lists every visible entry's pool row in order."""
  q, wp, wi, wl, cp, table, nv, sink = args
  ids = jnp.broadcast_to(jnp.arange(F * E, dtype=jnp.int32)[None, :], (q.shape[0], F * E))
  rows = hk.entry_pool_rows(table, ids, nv, E)
  return sa.sparse_attention_reference(q, wp, wi, cp, rows, sink, scale=STATIC["scale"], window_len_N=wl,
                                       comp_len_N=nv)[0]


TOL = {"fp32": 1e-5, "bf16": 2e-2, "fp8": 2e-2, "fp8_paged": 2e-2}


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8"])
def test_kernel_matches_reference(fmt):
  """Fresh inputs, three seeds, one compile: nv = 0, < 64, exactly 64, several blocks, unallocated blocks, ids out
  of range; padding rows give exactly 0. The reference agrees with sparse MLA over the same entries."""
  for seed in range(3):
    args = make_case(seed, fmt)
    got = np.asarray(kernel(args), np.float32)
    want = np.asarray(hk.hca_attention_reference(*args, **STATIC), np.float32)
    other = np.asarray(_sparse_view(args), np.float32)
    tol = TOL[fmt]
    assert np.isfinite(got).all()
    err = np.abs(got - want) / (tol + tol * np.abs(want))
    assert err.max() <= 1.0, (seed, float(np.abs(got - want).max()))
    np.testing.assert_allclose(want, other, atol=max(tol, 1e-5), rtol=max(tol, 1e-5))
    assert (got[0] == 0).all() and (got[7] == 0).all()   # padding rows
    assert np.abs(got[3]).max() > 1e-3                     # a live row really attends


@pytest.mark.slow
def test_kernel_matches_reference_fp8_paged():
  args = make_case(5, "fp8_paged")
  got = np.asarray(kernel(args), np.float32)
  want = np.asarray(hk.hca_attention_reference(*args, **STATIC), np.float32)
  np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fmt", ["fp32", "fp8"])
def test_model_hca_call_is_the_reference_on_per_token_tables(fmt):
  """The model's HCA call on the step context (the engine's table with each token's row, its visible count;
  `attention.attention_layer_shared`, no kernel selected) is the op's XLA reference on a per-token copy of the
  table, bit for bit: the model's XLA path is that reference."""
  from dsv4.layers import attention
  from dsv4.layers.compressor import StepContext
  ratio, R = 4, 3
  rng = np.random.default_rng(2)
  args = make_case(2, fmt)
  q, wp, wi, wl, cp, _, _, sink = args
  wi = jnp.where(wi < P, wi, -1)  # the model's window ids are in the pool (the XLA function only masks -1)
  table_RxF = jnp.asarray(np.stack([rng.permutation(Q // E)[:F] for _ in range(R)]), jnp.int32)
  row = jnp.asarray([0, 1, 2, 1, 0, 2, 2, 0], jnp.int32)
  valid = jnp.asarray([False, True, True, True, True, True, True, False])
  pos = jnp.where(valid, jnp.asarray([0, 19, 255, 832, 3, 300, 416, 0], jnp.int32), 0)
  zeros = jnp.zeros((N,), bool)
  ctx = StepContext(row_N=row, valid_N=valid, pos_N=pos, first_N=zeros, last_N=zeros,
                    swa_table_RxS=jnp.zeros((R, 1), jnp.int32), full_table_RxF=table_RxF, full_row_N=row,
                    swa_base_R=jnp.zeros((R,), jnp.int32), swa_block_tokens=16, full_block_tokens=E * ratio,
                    invariant=True)
  nv = attention.num_visible(ctx, ratio)
  want = dispatch.hca_attention(q, wp, wi, wl, cp, ctx.full_table_RxF, nv, sink, **STATIC,
                                table_rows_N=ctx.full_row_N, cfg=dispatch.KernelConfig("xla"))
  assert int(nv.max()) > 2 * hk.DENSE_BLOCK_ENTRIES
  got = hk.hca_attention_reference(q, wp, wi, wl, cp, table_RxF[row], nv, sink, **STATIC)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_dispatch_routes_hca_attention():
  """"hca_attention" is a registered op: interpret -> the kernel, xla / auto on the CPU -> the reference."""
  args = make_case(1, "fp32")
  assert dispatch.uses_kernel(dispatch.KernelConfig("interpret"), "hca_attention", *args, **STATIC)
  assert not dispatch.uses_kernel(dispatch.KernelConfig(), "hca_attention", *args, **STATIC)
  got = dispatch.hca_attention(*args, **STATIC, cfg=dispatch.KernelConfig("interpret", hca_tuning=TUNE))
  want = dispatch.hca_attention(*args, **STATIC, cfg=dispatch.KernelConfig("xla"))
  np.testing.assert_array_equal(np.asarray(want), np.asarray(hk.hca_attention_reference(*args, **STATIC)))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
  # the validation check `auto` runs on a GPU: its small case and error measure, on the CPU with interpret
  check = dispatch._CHECKS["hca_attention"]
  small = check.small_case(dispatch.HcaArgs(*args), dict(STATIC), None)
  inputs = check.random_inputs(small.args, dict(STATIC), jax.random.PRNGKey(0))
  got = dispatch._RUN["hca_attention"](dispatch._KERNELS["hca_attention"], inputs, dict(STATIC),
                                       dict(interpret=True, tuning=small.tuning))
  assert check.err_over_tol(got, check.reference(inputs, dict(STATIC)), inputs, dict(STATIC)) <= 1.0


# ---- batch invariance: the target row alone among padding rows vs among live rows of other lengths ----------------


def _place(args_target, args_others, pos):
  """Row 0 of `args_target` placed at `pos` in the batch of `args_others` (pools shared: the target's)."""
  q, wp, wi, wl, cp, table, nv, sink = args_others
  tq, _, twi, twl, _, ttable, tnv, _ = args_target
  put = lambda a, t: a.at[pos].set(t[0])
  return (put(q, tq), args_target[1], put(wi, twi), put(wl, twl), args_target[4], put(table, ttable), put(nv, tnv),
          args_target[7])


def _padding(args):
  q, wp, wi, wl, cp, table, nv, sink = args
  return (q, wp, jnp.full_like(wi, -1), jnp.zeros_like(wl), cp, table, jnp.zeros_like(nv), sink)


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_hca_row_bits_do_not_depend_on_neighbours(fmt):
  target = make_case(11, fmt, nv=[199] * N, wl=[16] * N)
  others = make_case(11, fmt, nv=[207, 3, 64, 0, 150, 1, 90, 208], wl=[16, 2, 16, 0, 9, 16, 5, 16])
  alone = np.asarray(kernel(_place(target, _padding(others), 0))[0])
  for pos in (3, 6):
    batched = np.asarray(kernel(_place(target, others, pos))[pos])
    np.testing.assert_array_equal(batched, alone)


def test_sparse_row_bits_do_not_depend_on_neighbours():
  """The sparse MLA kernel at the invariant step's fixed N (its split count depends on N and the id widths only)."""
  rng = np.random.default_rng(3)
  K = 48
  q = jnp.asarray(rng.standard_normal((N, H, D)) * 0.3, jnp.bfloat16)
  wp = jnp.asarray(rng.standard_normal((P, D)), jnp.bfloat16)
  cp = jnp.asarray(rng.standard_normal((Q, D)), jnp.bfloat16)
  wi = jnp.asarray(rng.integers(0, P, (N, W)), jnp.int32)
  ci = jnp.asarray(rng.integers(0, Q, (N, K)), jnp.int32)
  sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
  wl = jnp.asarray([16, 3, 16, 0, 9, 16, 5, 1], jnp.int32)
  cl = jnp.asarray([40, 48, 2, 0, 17, 33, 48, 9], jnp.int32)
  run = lambda *a: np.asarray(sa.sparse_attention_pallas(*a, scale=D ** -0.5, interpret=True)[0])
  tq, twi, tci = q[2], wi[2], ci[2]
  alone = run(q.at[0].set(tq), wp, jnp.full_like(wi, -1).at[0].set(twi), cp, jnp.full_like(ci, -1).at[0].set(tci),
              sink, jnp.zeros_like(wl).at[0].set(16), jnp.zeros_like(cl).at[0].set(40))[0]
  for pos in (2, 5):
    batched = run(q.at[pos].set(tq), wp, wi.at[pos].set(twi), cp, ci.at[pos].set(tci), sink, wl.at[pos].set(16),
                  cl.at[pos].set(40))[pos]
    np.testing.assert_array_equal(batched, alone)


def _indexer_case(rng, n, M, HI=4, C=32, distinct=4):
  """Entries map to `distinct` pool rows (entry e -> row e % distinct): every score is tied with M / distinct
  others, so the cut at k falls inside a tie and only the tie rule decides the picks."""
  q = jnp.asarray(rng.standard_normal((n, 1, HI, C)), jnp.bfloat16)
  w = jnp.asarray(rng.uniform(0.1, 1.0, (n, 1, HI)), jnp.float32)
  pool = jnp.asarray(rng.standard_normal((distinct, C)), jnp.bfloat16)
  rows = jnp.asarray(np.arange(M)[None, :].repeat(n, 0) % distinct, jnp.int32)
  return q, w, pool, rows


@pytest.mark.parametrize("chunk", [64, 16], ids=["one_chunk", "chunks_merged"])
def test_indexer_topk_ties_keep_lower_entry_and_rows_are_invariant(chunk):
  """The fused top-k kernel (the invariant step's indexer with kernels on): under exact ties its set is the paged
  XLA indexer's (ties keep the lower entry id), with one on-chip chunk and with chunks merged by XLA; and a row's
  ids (values and order) do not depend on its neighbours' visible counts or its place."""
  rng = np.random.default_rng(4)
  M, k = 64, 8
  q, w, pool, rows = _indexer_case(rng, N, M)
  tun = it.IndexerTopkTuning(block_m=16, select_chunk=chunk)
  run = lambda q, nv: np.asarray(it.indexer_topk_pallas(q, w, pool, rows, nv[:, None], k=k, interpret=True,
                                                        tuning=tun))[:, 0]
  nv = jnp.asarray([64, 5, 0, 40, 64, 17, 33, 9], jnp.int32)
  got = run(q, nv)
  # the paged XLA indexer of the invariant step: one block of M entries, table [0]
  want, _, _ = ixp.indexer_topk_paged(q[:, 0], w[:, 0], pool[rows[0]][None], jnp.zeros((N, 1), jnp.int32), nv, k,
                                      chunk_entries=chunk)
  want = np.asarray(want)
  for r in range(N):
    assert set(got[r][got[r] >= 0]) == set(want[r][want[r] >= 0]), r
  # the tie rule itself: row 0 sees all 64 entries; the picks are the lowest ids among its best row's entries
  s = [float(np.sum(np.maximum(np.asarray(q[0, 0], np.float32) @ np.asarray(pool[d], np.float32), 0)
                    * np.asarray(w[0, 0]))) for d in range(4)]
  best = int(np.argmax(s))
  assert sorted(got[0]) == [best + 4 * i for i in range(k)]
  # invariance: row 3 alone among padding (nv 0) at position 0, and among other live rows at position 6
  tq = q[3]
  alone = run(q.at[0].set(tq), jnp.zeros_like(nv).at[0].set(40))[0]
  batched = run(q.at[6].set(tq), nv.at[6].set(40))[6]
  np.testing.assert_array_equal(batched, alone)
  np.testing.assert_array_equal(got[3], alone)


# ---- engine: the invariant step with interpret kernels (HCA through the kernel) -----------------------------------


@pytest.mark.slow   # ~1-2 min on 2 cores: three engines with interpret-mode kernels
def test_invariant_engine_hca_kernel_tokens_and_bits(monkeypatch):
  """Tiny V4 with one layer of each kind (window, CSA, HCA) in the invariant step: interpret kernels give the XLA
  engine's greedy tokens (logits close), the HCA layer really runs the kernel, and with kernels a request's logits
  alone are bitwise its logits batched with others."""
  from dsv4 import config, model
  from dsv4.engine.api import generate
  from dsv4.engine.config import EngineConfig
  from dsv4.engine.engine import Engine
  from dsv4.engine.sampling import SamplingParams

  cfg = config.v4_tiny(num_layers=3)
  assert any(p.dense_compressed for p in cfg.layer_plan())
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  ec = EngineConfig(max_num_seqs=3, max_num_batched_tokens=16, chunk_size=8, max_model_len=128, num_full_blocks=8,
                    num_swa_blocks=32, record_logits=True)
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(2, cfg.vocab_size, n)] for n in (70, 21, 9)]
  sp = SamplingParams(max_tokens=3, ignore_eos=True)
  calls = {"n": 0}
  fn = dispatch._KERNELS["hca_attention"]

  def counted(*a, **k):
    calls["n"] += 1
    return fn(*a, **k)

  monkeypatch.setitem(dispatch._KERNELS, "hca_attention", counted)

  def run(backend, ps):
    eng = Engine(params, cfg, dataclasses.replace(ec, kernel=dispatch.KernelConfig(backend)))
    outs = generate(params, cfg, ps, sp, engine=eng)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [list(o.output) for o in outs], [np.stack(o.token_logits) for o in outs]

  xla_toks, xla_logits = run("xla", prompts)
  assert calls["n"] == 0
  toks, logits = run("interpret", prompts)
  assert calls["n"] > 0
  assert toks == xla_toks
  for g, w in zip(logits, xla_logits):
    np.testing.assert_allclose(g, w, atol=2e-3 * max(1.0, np.abs(w).max()), rtol=2e-3)
  alone_toks, alone_logits = run("interpret", prompts[:1])
  assert alone_toks[0] == toks[0]
  np.testing.assert_array_equal(alone_logits[0], logits[0])


# ---- the table as the engine keeps it: [S slots, F], each query naming its row ------------------------------------


ROWS = [4, 0, 9, 0, 2, 11, 7, 3]   # 12 table rows for 8 queries; queries 1 and 3 share row 0


def _slot_table_case(seed, fmt):
  """make_case's queries, their table rows spread into a 12-row table at ROWS (queries 1 and 3 on the same row, so
  query 3 takes query 1's table), the other rows filled with unrelated blocks; query 0 and 7 are padding (nv 0)."""
  args = make_case(seed, fmt)
  table_NxF = np.asarray(args[5])
  rng = np.random.default_rng(seed + 100)
  table_SxF = rng.integers(-1, Q // E, (12, F)).astype(np.int32)
  for n, r in enumerate(ROWS):
    if n != 3:
      table_SxF[r] = table_NxF[n]
  rows = jnp.asarray(ROWS, jnp.int32)
  return args, jnp.asarray(table_SxF), rows


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_kernel_reads_rows_of_a_wider_table(fmt):
  """Table [S, F] with S > N and table_rows_N (two queries on one row, padding queries): the kernel equals the
  reference on the same form, and both equal their per-query [N, F] copy form bit for bit."""
  args, table_SxF, rows = _slot_table_case(3, fmt)
  slot_args = args[:5] + (table_SxF,) + args[6:] + (rows,)
  copy_args = args[:5] + (table_SxF[rows],) + args[6:]
  got = np.asarray(kernel(slot_args), np.float32)
  want = np.asarray(hk.hca_attention_reference(*slot_args, **STATIC), np.float32)
  np.testing.assert_array_equal(got, np.asarray(kernel(copy_args), np.float32))
  np.testing.assert_array_equal(want, np.asarray(hk.hca_attention_reference(*copy_args, **STATIC), np.float32))
  tol = TOL[fmt]
  np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
  assert (got[0] == 0).all() and (got[7] == 0).all()
  # through the dispatcher (interpret and XLA), rows as a keyword
  cfg = dispatch.KernelConfig("interpret", hca_tuning=TUNE)
  np.testing.assert_array_equal(
      np.asarray(dispatch.hca_attention(*slot_args[:8], **STATIC, cfg=cfg, table_rows_N=rows), np.float32), got)
  np.testing.assert_array_equal(np.asarray(dispatch.hca_attention(
      *slot_args[:8], **STATIC, cfg=dispatch.KernelConfig("xla"), table_rows_N=rows), np.float32), want)


def test_kernel_path_builds_no_per_query_table():
  """The dispatcher's kernel path with a 4096-column table of 80 rows and 64 queries: no intermediate has both a
  64 and a 4096 dimension (the old path built the [N, F] gather and its power-of-two pad)."""
  n, f, s = 64, 4096, 80
  spec = jax.ShapeDtypeStruct
  args = (spec((n, H, D), jnp.bfloat16), spec((P, D), jnp.bfloat16), spec((n, W), jnp.int32), spec((n,), jnp.int32),
          spec((1000, D), jnp.bfloat16), spec((s, f), jnp.int32), spec((n,), jnp.int32), spec((H,), jnp.float32))
  cfg = dispatch.KernelConfig("interpret", hca_tuning=TUNE)
  fn = lambda *a: dispatch.hca_attention(*a[:8], **STATIC, cfg=cfg, table_rows_N=a[8])
  assert per_query_table_shapes(fn, *args, spec((n,), jnp.int32), n=n, widths=(f,)) == []
  # the check can fail: the per-query copy the model used to pass
  copy = lambda *a: dispatch.hca_attention(*a[:5], a[5][a[8]], *a[6:8], **STATIC, cfg=cfg)
  assert per_query_table_shapes(copy, *args, spec((n,), jnp.int32), n=n, widths=(f,))


@pytest.mark.parametrize("live", [0, 3, N])
def test_live_bound_keeps_the_live_queries_bits(live):
  """With `live`, the programs of queries at or past it return without writing (the engine's dead tokens); the
  queries below it give the same bits as with every query live (one compiled program for both, as in the sparse
  kernel's test)."""
  args = make_case(11, "bf16")
  run = lambda n: np.asarray(hk.hca_attention_pallas(*args, None, jnp.int32(n), **STATIC, interpret=True,
                                                     tuning=TUNE)).view(np.uint16)
  full, got = run(N), run(live)
  np.testing.assert_array_equal(got[:live], full[:live])

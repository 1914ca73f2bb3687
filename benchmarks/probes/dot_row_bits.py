"""Which formulations keep a row's bits whatever the other rows of the call are? (Why the invariant step's ops
are row-invariant: docs/engine.md, the invariant step; the ops: dsv4/layers/row_invariant.py.)

    python -m benchmarks.probes.dot_row_bits                       # the formulations below, on this backend
    python -m benchmarks.probes.dot_row_bits --v4_flash [--small]  # the model's per-token ops at V4-Flash widths

Prints one line per formulation and dtype: the row counts (or batch mixes) at which row 0 has other bits than
alone / at its first place, "[]" = invariant at every case tried. The cases:
* dot by row count: `x[:m] @ W` for m rows (XLA picks its blocking from the shape: not invariant);
* dot by place: the same row at every place of a fixed 16-row and 200-row call (one shape: invariant);
* rows_dot: fixed row blocks in a loop over the live blocks (dynamic trip count), m live rows of 1..N, the other
  rows permuted;
* batched einsum with the token axis as a batch dimension (attention's per-token products) by row count;
* row reductions (RMSNorm, softmax, top-k) and transcendentals (exp, log1p) by row count and by place;
* the routed experts: `lax.ragged_dot` (its result for a token moves with the other tokens' expert counts) and
  the grouped block formulation `grouped_experts`, by batch mix (random other tokens, other counts).

`--v4_flash` asks the question the GPU's step depends on: can each per-token op run ONCE over a width that follows
the live rows (a few static widths) instead of in fixed 32-row blocks? Only if every row-local op the model runs
per token keeps a row's bits at any row count and place. The cases (`v4_flash`, the real `dsv4/layers` functions
with random parameters shaped like V4-Flash's, D = 4096): elementwise maths (the experts' clamped SwiGLU, exp),
`norms.rms_norm` at 4096 (bf16) and 16384 (fp32, mHC's flattened streams), softmax over 64 and 1024 columns, top-k,
mHC with 4 streams (`hc_coefficients` with its mixing dot and Sinkhorn, `collapse`, `expand`), the router
(`moe.route`, 256 experts, top-6, with its logits dot), RoPE on 64 heads of 512, and the row-invariant matmul
`dispatch.row_dot` ("pallas" on a GPU, "interpret" elsewhere) beside `jnp.dot` (the XLA dot it replaces) at
4096 x 4096. Row 0 is compared alone against itself at 2, 7, 64, 256 and 2048 rows, and at three places of 2048
rows against its first place there (the other rows shuffled). The last line is the verdict (`verdict`): the
row-local ops and row_dot must all keep a row's bits; the XLA dots (and the ops built around one: the mHC
coefficients, the router) are shown beside them, as they would move onto row_dot. `--small` (CPU): D = 256, up to
64 rows. The GPU suite runs the same cases (item `a.row_bits`).

Every check is a function returning rows (dicts: op, dtype, what varied, the counts / places tried and those where
row 0 differs, `invariant`); `main` prints them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import config as dsv4_config
from dsv4.layers import mhc, moe, norms, rope, row_invariant
from pallas_kernels import dispatch

ROW_COUNTS = (2, 3, 7, 8, 16, 33, 64, 128, 512)
SMALL_ROW_COUNTS = (2, 3, 7, 8, 16, 33, 64)
FLASH_ROWS = (1, 2, 7, 64, 256, 2048)
FLASH_ROWS_SMALL = (1, 2, 7, 64)


def result(op: str, dtype, varied: str, tried, differs, **extra) -> dict:
  """One row: `op` in `dtype`, row 0 against itself alone as `varied` takes the values `tried`; `differs`: those at
  which its bits change."""
  return dict(op=op, dtype=dtype if isinstance(dtype, str) else jnp.dtype(dtype).name, varied=varied,
              tried=list(tried), differs=list(differs), invariant=not differs, **extra)


def _keys(seed: int):
  return jax.random.split(jax.random.PRNGKey(seed), 5)


def _row0_differs(f, x, counts=ROW_COUNTS):
  alone = np.asarray(f(x[:1]))[0]
  return [m for m in counts if not np.array_equal(np.asarray(f(x[:m]))[0], alone)]


def _by_place(f, x, rows):
  at0 = np.asarray(f(x[100:100 + rows].at[0].set(x[0])))[0]
  return [p for p in range(rows) if not np.array_equal(np.asarray(f(x[100:100 + rows].at[p].set(x[0])))[p], at0)]


# ------------------------------------------------------------------------------------------------ the formulations


def dots(dt, small: bool = False, seed: int = 0) -> list[dict]:
  keys = _keys(seed)
  counts = SMALL_ROW_COUNTS if small else ROW_COUNTS
  w = jax.random.normal(keys[0], (256, 1024)).astype(dt)
  x = jax.random.normal(keys[1], (512, 256)).astype(dt)
  dot = jax.jit(lambda x: jnp.dot(x, w, preferred_element_type=jnp.float32))
  rows = [result("dot", dt, "by row count", counts, _row0_differs(dot, x, counts)),
          result("dot", dt, "by place in 16 rows", range(16), _by_place(dot, x, 16))]
  if not small:
    rows.append(result("dot", dt, "by place in 200 rows", range(200), _by_place(dot, x, 200)))
  # rows_dot over a fixed 256-row buffer: row 0 with live counts 1..256 and the other rows shuffled
  rd = jax.jit(lambda x, live: row_invariant.rows_dot(x, w, live, preferred_element_type=jnp.float32))
  buf = x[:256]
  alone = np.asarray(rd(buf.at[1:].set(0), 1))[0]
  rng = np.random.default_rng(0)
  lives = (1, 2, 3, 7, 31, 32, 33, 64) if small else (1, 2, 3, 7, 31, 32, 33, 64, 100, 256)
  bad = []
  for m in lives:
    shuffled = buf.at[1:].set(buf[1:][rng.permutation(255)])
    if not np.array_equal(np.asarray(rd(shuffled, m))[0], alone):
      bad.append(m)
  places = (1, 5, 31, 32, 77, 255)
  moved = [p for p in places if not np.array_equal(np.asarray(rd(buf.at[p].set(buf[0]), 256))[p], alone)]
  return rows + [result("rows_dot", dt, "by live count", lives, bad),
                 result("rows_dot", dt, "by place", places, moved)]


def batched_einsum(dt, small: bool = False, seed: int = 0) -> list[dict]:
  keys = _keys(seed)
  counts = SMALL_ROW_COUNTS if small else ROW_COUNTS
  q = jax.random.normal(keys[0], (512, 8, 64)).astype(dt)
  k = jax.random.normal(keys[1], (512, 96, 64)).astype(dt)
  f = jax.jit(lambda qk: jnp.einsum("nhd,nkd->nhk", qk[0], qk[1], preferred_element_type=jnp.float32))
  alone = np.asarray(f((q[:1], k[:1])))[0]
  bad = [m for m in counts if not np.array_equal(np.asarray(f((q[:m], k[:m])))[0], alone)]
  return [result("einsum nhd,nkd->nhk (tokens as batch)", dt, "by row count", counts, bad)]


def reductions(small: bool = False, seed: int = 0) -> list[dict]:
  keys = _keys(seed)
  counts = SMALL_ROW_COUNTS if small else ROW_COUNTS
  x = jax.random.normal(keys[0], (512, 1024), jnp.float32) * 3
  ops = {"rms_norm": lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6),
         "softmax": lambda x: jax.nn.softmax(x, axis=-1),
         "top_k": lambda x: jax.lax.top_k(x, 8)[0],
         "exp": jnp.exp, "log1p": lambda x: jnp.log1p(jnp.abs(x))}
  rows = []
  for name, f in ops.items():
    f = jax.jit(f)
    rows += [result(name, jnp.float32, "by row count", counts, _row0_differs(f, x, counts)),
             result(name, jnp.float32, "by place in 64 rows", range(64), _by_place(f, x, 64))]
  return rows


def experts(small: bool = False, seed: int = 0) -> list[dict]:
  keys = _keys(seed)
  E, D, I, K, N = 16, 128, 64, 4, 256
  w1 = jax.random.normal(keys[0], (E, D, I), jnp.float32) / 11
  w2 = jax.random.normal(keys[1], (E, I, D), jnp.float32) / 8
  x = jax.random.normal(keys[2], (N, D), jnp.float32)
  ids = jnp.stack([jax.random.permutation(k, E)[:K] for k in jax.random.split(keys[3], N)])
  wts = jax.random.uniform(keys[4], (N, K))

  def ragged(x, ids, wts):
    order = jnp.argsort(ids.reshape(-1), stable=True)
    sizes = jnp.bincount(ids.reshape(-1), length=E).astype(jnp.int32)
    h = jax.lax.ragged_dot(x[order // K], w1, sizes, precision=jax.lax.Precision.HIGHEST)
    h = jax.lax.ragged_dot(jax.nn.silu(h), w2, sizes, precision=jax.lax.Precision.HIGHEST)
    return jnp.zeros_like(x).at[order // K].add(h * wts.reshape(-1)[order][:, None])

  def expert_fn(e, xb):
    return jnp.dot(jax.nn.silu(jnp.dot(xb, w1[e], precision=jax.lax.Precision.HIGHEST)), w2[e],
                   precision=jax.lax.Precision.HIGHEST)

  def grouped(x, ids, wts, live):
    return row_invariant.grouped_experts(x, ids, wts, expert_fn, E, live)

  forms = {"ragged_dot": jax.jit(lambda x, i, w, live: ragged(x[:live], i[:live], w[:live]), static_argnums=3),
           "grouped_experts": jax.jit(grouped)}
  mixes = (2, 5, 17, 64) if small else (2, 5, 17, 64, 256)
  rng = np.random.default_rng(1)
  rows = []
  for name, f in forms.items():
    alone = np.asarray(f(x, ids, wts, 1))[0]
    bad = []
    for m in mixes:
      perm = np.concatenate([[0], 1 + rng.permutation(N - 1)])
      if not np.array_equal(np.asarray(f(x[perm], ids[perm], wts[perm], m))[0], alone):
        bad.append(m)
    rows.append(result(name, jnp.float32, "token 0 by batch mix (tokens, others shuffled)", mixes, bad))
  return rows


# ------------------------------------------------------------------------------------------------ V4-Flash widths


@dataclasses.dataclass(frozen=True)
class Case:
  """One per-token op at one width: `fn(params, *rows)` with every `rows` array [N, ...] (row i of each belongs to
  token i) returning a pytree of [N, ...] outputs. role: "row-local" (maths the step would run as XLA ops at a
  width that follows the live rows: it must keep a row's bits), "kernel" (row_dot, which the matmuls would run on:
  it must too), "xla dot" (an XLA dot the model runs today, which row_dot would replace: moving a row's bits is what
  the kernel is for) or "composite" (row-local maths around an XLA dot: moves with its dot, or not)."""
  name: str
  op: str
  dtype: str
  width: str
  fn: Callable
  params: tuple
  rows: tuple
  role: str = "row-local"


@dataclasses.dataclass(frozen=True)
class Widths:
  D: int = 4096            # hidden
  streams: int = 4         # mHC hc_mult
  inter: int = 2048        # routed expert intermediate
  experts: int = 256
  top_k: int = 6
  heads: int = 64
  head_dim: int = 512
  n_max: int = 2048

  @classmethod
  def small(cls):
    return cls(D=256, inter=128, heads=4, head_dim=128, n_max=max(FLASH_ROWS_SMALL))


def _widths(small: bool) -> Widths:
  return Widths.small() if small else Widths()


def _normal(key, shape, dtype=jnp.float32, scale=1.0):
  return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def elementwise_cases(small: bool, seed: int = 0) -> list[Case]:
  w = _widths(small)
  k = jax.random.split(jax.random.PRNGKey(seed), 3)
  limit = dsv4_config.MoEConfig().swiglu_limit
  gate, up = _normal(k[0], (w.n_max, w.inter), jnp.bfloat16, 4), _normal(k[1], (w.n_max, w.inter), jnp.bfloat16, 4)
  return [Case("swiglu", "moe.swiglu", "bfloat16", f"[{w.inter}] x 2", lambda p, g, u: moe.swiglu(g, u, limit), (),
               (gate, up)),
          Case("exp", "jnp.exp", "float32", f"[{w.D}]", lambda p, x: jnp.exp(x), (),
               (_normal(k[2], (w.n_max, w.D), jnp.float32, 3),))]


def reduction_cases(small: bool, seed: int = 0) -> list[Case]:
  """RMSNorm at the hidden width (bf16, the attention / FFN norms) and at the flattened mHC streams (fp32), row
  softmax at 64 and 1024 columns, top-k of 6 in 256."""
  w = _widths(small)
  k = jax.random.split(jax.random.PRNGKey(seed + 1), 7)
  eps = dsv4_config.v4_flash().rms_norm_eps
  flat = w.streams * w.D
  rms = lambda p, x: norms.rms_norm(x, p[0], eps)
  out = [Case(f"rms_norm.{w.D}", "norms.rms_norm", "bfloat16", f"[{w.D}]", rms,
              (1.0 + _normal(k[0], (w.D,), jnp.float32, 0.1),), (_normal(k[1], (w.n_max, w.D), jnp.bfloat16, 2),)),
         Case(f"rms_norm.{flat}", "norms.rms_norm", "float32", f"[{flat}]", rms,
              (1.0 + _normal(k[2], (flat,), jnp.float32, 0.1),), (_normal(k[3], (w.n_max, flat), jnp.float32, 2),))]
  for cols, kk in ((64, k[4]), (1024, k[5])):
    out.append(Case(f"softmax.{cols}", "jax.nn.softmax", "float32", f"[{cols}]",
                    lambda p, x: jax.nn.softmax(x, axis=-1), (), (_normal(kk, (w.n_max, cols), jnp.float32, 3),)))
  out.append(Case("top_k", "jax.lax.top_k", "float32", f"[{w.experts}] k={w.top_k}",
                  lambda p, x: jax.lax.top_k(x, w.top_k), (), (_normal(k[6], (w.n_max, w.experts)),)))
  return out


def mhc_cases(small: bool, seed: int = 0) -> list[Case]:
  """mHC with 4 streams of D: the coefficients (`hc_coefficients`: unweighted RMSNorm of the flattened streams, the
  [4D] x [4D, 24] fp32 mixing dot, sigmoids, Sinkhorn), the mixing dot and Sinkhorn alone (to tell which moves a
  row, if one does), `collapse` and `expand`; parameters shaped like V4-Flash's `hc_attn` (0.1-scaled normals, as
  `model.init_params` draws them)."""
  w = _widths(small)
  n, cfg, eps = w.streams, dsv4_config.MHCConfig(hc_mult=w.streams), dsv4_config.v4_flash().rms_norm_eps
  rows = (2 + n) * n
  k = jax.random.split(jax.random.PRNGKey(seed + 2), 9)
  p = {"fn": _normal(k[0], (n * w.D, rows), scale=0.1), "base": _normal(k[1], (rows,), scale=0.1),
       "scale": _normal(k[2], (3,), scale=0.1)}
  X = _normal(k[3], (w.n_max, n, w.D), jnp.bfloat16)
  flat = norms.unweighted_rms_norm(X.reshape(w.n_max, -1).astype(jnp.float32), eps)

  def coefficients(p, X):
    pre, post, comb = mhc.hc_coefficients(p[0], X[None], cfg, eps)
    return pre[0], post[0], comb[0]

  pre = jax.nn.sigmoid(_normal(k[4], (w.n_max, n))) + cfg.eps
  post = 2.0 * jax.nn.sigmoid(_normal(k[5], (w.n_max, n)))
  comb = mhc.sinkhorn(_normal(k[6], (w.n_max, n, n)), cfg)
  y = _normal(k[7], (w.n_max, w.D), jnp.bfloat16)
  streams = f"[{n}, {w.D}]"
  return [
      Case("mhc.hc_coefficients", "mhc.hc_coefficients", "bfloat16 -> float32", streams, coefficients, (p,), (X,),
           role="composite"),
      Case("mhc.mix_dot", "jnp.dot HIGHEST (mHC mixing)", "float32", f"[{n * w.D}] x [{n * w.D}, {rows}]",
           lambda p, f: jnp.dot(f, p[0]["fn"], precision=jax.lax.Precision.HIGHEST), (p,), (flat,), role="xla dot"),
      Case("mhc.sinkhorn", "mhc.sinkhorn", "float32", f"[{n}, {n}]", lambda p, l: mhc.sinkhorn(l, cfg), (),
           (_normal(k[8], (w.n_max, n, n)),)),
      Case("mhc.collapse", "mhc.collapse", "bfloat16", streams, lambda p, a, X: mhc.collapse(a[None], X[None])[0],
           (), (pre, X)),
      Case("mhc.expand", "mhc.expand", "bfloat16", streams,
           lambda p, y, X, b, c: mhc.expand(y[None], X[None], b[None], c[None])[0], (), (y, X, post, comb)),
  ]


def router_cases(small: bool, seed: int = 0) -> list[Case]:
  """The router (`moe.route`, score-routed: sqrt-softplus scores of an fp32 [D] x [D, 256] dot, bias-corrected
  top-6, normalised weights), and its logits dot alone."""
  w = _widths(small)
  cfg = dsv4_config.MoEConfig(n_routed_experts=w.experts, num_experts_per_tok=w.top_k)
  k = jax.random.split(jax.random.PRNGKey(seed + 3), 3)
  p = {"gate": _normal(k[0], (w.D, w.experts), scale=w.D ** -0.5), "bias": _normal(k[1], (w.experts,), scale=0.1)}
  x = _normal(k[2], (w.n_max, w.D), jnp.bfloat16)
  return [Case("moe.route", "moe.route", "bfloat16 -> float32", f"[{w.D}] -> {w.experts} experts top-{w.top_k}",
               lambda p, x: moe.route(p[0], x, None, cfg, False), (p,), (x,), role="composite"),
          Case("moe.router_dot", "jnp.dot HIGHEST (router logits)", "float32", f"[{w.D}] x [{w.D}, {w.experts}]",
               lambda p, x: jnp.dot(x.astype(jnp.float32), p[0]["gate"], precision=jax.lax.Precision.HIGHEST),
               (p,), (x,), role="xla dot")]


def rope_cases(small: bool, seed: int = 0) -> list[Case]:
  """RoPE (`rope.apply_rope`, the compressed layers' YaRN table) on a token's queries: heads x head_dim, the
  trailing 64 channels rotated by the token's own position."""
  w = _widths(small)
  attn = dsv4_config.AttentionConfig()
  inv_freq = rope.inv_freq_for(attn, "compress")
  k = jax.random.split(jax.random.PRNGKey(seed + 4), 2)
  q = _normal(k[0], (w.n_max, w.heads, w.head_dim), jnp.bfloat16)
  pos = jax.random.randint(k[1], (w.n_max,), 0, 65536, jnp.int32)
  return [Case("rope", "rope.apply_rope", "bfloat16", f"[{w.heads}, {w.head_dim}] (rope {attn.rope_head_dim})",
               lambda p, q, pos: rope.apply_rope(q, pos[:, None], inv_freq), (), (q, pos))]


def matmul_cases(small: bool, seed: int = 0, backend: str | None = None) -> list[Case]:
  """The row-invariant matmul `dispatch.row_dot` (its Pallas kernel; backend None: "pallas" on a GPU, "interpret"
  elsewhere; the default tuning, whose blocks divide D) and the XLA dot it replaces, a bf16 [D] x [D, D]
  projection."""
  w = _widths(small)
  k = jax.random.split(jax.random.PRNGKey(seed + 5), 2)
  W = _normal(k[0], (w.D, w.D), jnp.bfloat16, w.D ** -0.5)
  x = _normal(k[1], (w.n_max, w.D), jnp.bfloat16)
  backend = backend or ("pallas" if jax.default_backend() == "gpu" else "interpret")
  kcfg = dispatch.KernelConfig(backend=backend, row_dot_tuning=dispatch.RowDotTuning())
  shape = f"[{w.D}] x [{w.D}, {w.D}]"
  return [Case("row_dot", f"dispatch.row_dot ({backend})", "bfloat16", shape,
               lambda p, x: dispatch.row_dot(x, p[0], cfg=kcfg), (W,), (x,), role="kernel"),
          Case("jnp.dot", "jnp.dot (fp32 accumulation)", "bfloat16", shape,
               lambda p, x: jnp.dot(x, p[0], preferred_element_type=jnp.float32).astype(x.dtype), (W,), (x,),
               role="xla dot")]


FLASH_GROUPS = (elementwise_cases, reduction_cases, mhc_cases, router_cases, rope_cases, matmul_cases)


def _row_bytes(out, i: int) -> tuple:
  return tuple(np.asarray(leaf[i]).tobytes() for leaf in jax.tree.leaves(out))


def _places(n_max: int) -> tuple:
  return tuple(sorted({1, n_max // 2 + 1, n_max - 1}))


def measure(cases: list[Case], counts=FLASH_ROWS, seed: int = 0, threads: int = 1) -> list[dict]:
  """Two rows per case: row 0 against itself alone at each row count in `counts` (> 1), and at three places of the
  largest row count against its place 0 there (the other rows shuffled each time). Every (case, count) program is
  compiled first, `threads` at a time. A case that fails to compile or run gives rows with `error` (invariant
  None)."""
  n_max = max(counts)
  places = _places(n_max)

  def compile_one(case: Case, n: int):
    rows = tuple(jax.ShapeDtypeStruct((n, *a.shape[1:]), a.dtype) for a in case.rows)
    return jax.jit(case.fn).lower(case.params, *rows).compile()

  with concurrent.futures.ThreadPoolExecutor(max(threads, 1)) as pool:
    futures = {(c.name, n): pool.submit(compile_one, c, n) for c in cases for n in sorted({1, *counts})}
    out = []
    for case in cases:
      tag = dict(case=case.name, width=case.width, role=case.role)
      try:
        run = lambda n, rows: futures[(case.name, n)].result()(case.params, *rows)
        alone = _row_bytes(run(1, tuple(a[:1] for a in case.rows)), 0)
        tried = [n for n in counts if n > 1]
        differs = [n for n in tried if _row_bytes(run(n, tuple(a[:n] for a in case.rows)), 0) != alone]
        rng = np.random.default_rng(seed)

        def at_place(p):         # row 0 at place p of n_max rows, the others shuffled
          order = np.insert(1 + rng.permutation(n_max - 1), p, 0)
          return _row_bytes(run(n_max, tuple(a[:n_max][order] for a in case.rows)), p)

        first = at_place(0)
        moved = [p for p in places if at_place(p) != first]
        out += [result(case.op, case.dtype, "by row count", tried, differs, **tag),
                result(case.op, case.dtype, f"by place in {n_max} rows", places, moved, **tag)]
      except Exception as e:  # noqa: BLE001 - a case that does not compile or run is its rows' error
        err = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300]
        out += [dict(op=case.op, dtype=case.dtype, varied=v, tried=[], differs=[], invariant=None, error=err, **tag)
                for v in ("by row count", f"by place in {n_max} rows")]
  return out


def v4_flash(small: bool = False, seed: int = 0, threads: int = 1, groups=FLASH_GROUPS) -> list[dict]:
  """The model's per-token ops at V4-Flash widths (small: D = 256, up to 64 rows), by row count and by place."""
  cases = [c for g in groups for c in g(small, seed)]
  return measure(cases, FLASH_ROWS_SMALL if small else FLASH_ROWS, seed, threads)


def verdict(rows: list[dict]) -> dict:
  """What the rows decide: whether every row-local op and row_dot keep a row's bits at any row count and place (then
  the step may run each per-token op once over a width that follows the live rows, every matmul on row_dot, instead
  of in fixed row blocks), and which do not."""
  def cases(roles, invariant):
    return sorted({r["case"] for r in rows if r.get("role") in roles and r["invariant"] is invariant})

  bad, failed = cases(("row-local", "kernel"), False), cases(("row-local", "kernel"), None)
  ok = not bad and not failed
  dots, composites = cases(("xla dot",), False), cases(("composite",), False)
  if ok:
    decision = ("the per-token ops can run once over a width that follows the live rows, every matmul on row_dot "
                "(the model's XLA dots included)")
  elif bad:
    decision = f"keep fixed row blocks: {', '.join(bad)} change a row's bits with the row count or its place"
  else:
    decision = f"undecided: {', '.join(failed)} did not run"
  return dict(per_token_ops_invariant=ok, not_invariant=bad, did_not_run=failed, xla_dots_not_invariant=dots,
              composites_not_invariant=composites, decision=decision)


# ------------------------------------------------------------------------------------------------ main


def _print(rows: list[dict]) -> None:
  """One line per (dtype, op): each thing varied and where row 0 differs."""
  lines: dict[tuple, list[str]] = {}
  for r in rows:
    shown = r["differs"] if len(r["differs"]) <= 12 else r["differs"][:12] + [f"+{len(r['differs']) - 12} more"]
    cell = f"{r['varied']} {shown}" if "error" not in r else f"{r['varied']} error: {r['error']}"
    key = (r["dtype"], r["op"], r.get("width"))
    lines.setdefault(key, []).append(cell)
  for (dtype, op, width), cells in lines.items():
    at = f" {width}" if width else ""
    print(f"{dtype} {op}{at}: {'; '.join(cells)}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--v4_flash", action="store_true", help="the model's per-token ops at V4-Flash widths")
  ap.add_argument("--small", action="store_true", help="with --v4_flash: D = 256, up to 64 rows (CPU)")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  if args.v4_flash:
    rows = v4_flash(args.small, args.seed)
    _print(rows)
    print(verdict(rows)["decision"])
    return
  for dt in (jnp.bfloat16, jnp.float32):
    _print(dots(dt, seed=args.seed))
    _print(batched_einsum(dt, seed=args.seed))
  _print(reductions(seed=args.seed))
  _print(experts(seed=args.seed))


if __name__ == "__main__":
  main()

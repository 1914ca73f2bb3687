"""Kernels for the dispatch validation tests, importable by name (the validation child imports them): the real
kernels in interpret mode (a CPU stand-in for the compiled ones), a wrong one, a nondeterministic one, a raising one, a hanging one and one
that kills its process (a GPU fault's stand-in). Calls in this process are counted in CALLS."""

import os
import time

from pallas_kernels import grouped_dot as gd
from pallas_kernels import indexer as ix
from pallas_kernels import indexer_topk as it
from pallas_kernels import row_dot as rd
from pallas_kernels import sparse_attention as sa

CALLS: dict[str, int] = {}


def _count(op):
  CALLS[op] = CALLS.get(op, 0) + 1


def sparse(*a, interpret=False, **k):
  _count("sparse_attention")
  return sa.sparse_attention_kernel(*a, interpret=True, **k)


def scores(*a, interpret=False, **k):
  _count("indexer_scores")
  return ix.KERNELS["indexer_scores"](*a, interpret=True, **k)


def topk(*a, interpret=False, **k):
  _count("indexer_topk")
  return it.KERNELS["indexer_topk"](*a, interpret=True, **k)


def row_dot(*a, interpret=False, **k):
  _count("row_dot")
  return rd.row_dot(*a, interpret=True, **k)


def grouped_dot(*a, interpret=False, **k):
  _count("grouped_dot")
  return gd.grouped_dot(*a, interpret=True, **k)


def wrong_sparse(*a, interpret=False, **k):
  _count("sparse_attention")
  out, lse = sa.sparse_attention_kernel(*a, interpret=True, **k)
  return out * 1.5, lse


def nondeterministic_sparse(*a, interpret=False, **k):
  """Within tolerance every time, but one element one ulp up on every other call (a race's stand-in)."""
  import jax.numpy as jnp
  _count("sparse_attention")
  out, lse = sa.sparse_attention_kernel(*a, interpret=True, **k)
  if CALLS["sparse_attention"] % 2:
    i = (0,) * out.ndim
    out = out.at[i].set(jnp.nextafter(out[i], jnp.asarray(jnp.inf, out.dtype)))
  return out, lse


def raising_topk(*a, **k):
  _count("indexer_topk")
  raise RuntimeError("lowering failed")


def hanging_sparse(*a, **k):
  _count("sparse_attention")
  time.sleep(3600)


def crashing_sparse(*a, **k):
  _count("sparse_attention")
  os.abort()

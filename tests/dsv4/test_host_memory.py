"""The CPU step's scratch stays mapped between steps (`dsv4.engine.host_memory`): once set, a block above glibc's
default mmap threshold, freed and asked for again, reuses the pages it had (no fault per page), from the main thread
and from a worker thread (XLA's CPU runtime allocates a step's temp buffer on its own threads)."""

import ctypes
import resource
import threading

import jax
import pytest

from dsv4 import config, model
from dsv4.engine import host_memory

MIB = 1 << 20


def _faults_of_second_block(libc, nbytes):
  """Minor faults taken while a block of `nbytes` is allocated, written, freed, then allocated and written again:
  those of the second round only."""
  libc.malloc.restype = ctypes.c_void_p
  libc.free.argtypes = [ctypes.c_void_p]
  out = {}

  def rounds():
    p = libc.malloc(ctypes.c_size_t(nbytes))
    ctypes.memset(p, 1, nbytes)
    libc.free(ctypes.c_void_p(p))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(ctypes.c_size_t(nbytes))
    ctypes.memset(p, 2, nbytes)
    out["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    libc.free(ctypes.c_void_p(p))
  return rounds, out


@pytest.mark.parametrize("where,nbytes", [("main thread", 96 * MIB), ("worker thread", 48 * MIB)])
def test_large_blocks_reuse_their_pages(where, nbytes):
  libc = host_memory.glibc()
  if libc is None:
    pytest.skip("needs glibc (its mallopt)")
  assert host_memory.keep_scratch_mapped()
  rounds, out = _faults_of_second_block(libc, nbytes)
  if where == "main thread":
    rounds()
  else:
    t = threading.Thread(target=rounds)
    t.start()
    t.join()
  pages = nbytes // 4096
  assert out["faults"] < pages // 10, (where, out["faults"], pages)   # fresh pages would fault once each


def test_a_cpu_runner_sets_it():
  if host_memory.glibc() is None:
    pytest.skip("needs glibc (its mallopt)")
  from benchmarks.support.bare_runner import make_runner
  host_memory._state.clear()      # as in a fresh process (setting it again changes nothing)
  assert not host_memory.applied()
  cfg = config.v4_tiny()
  make_runner(cfg, model.init_params(cfg, jax.random.PRNGKey(0)), max_model_len=1024, max_num_seqs=2,
              max_num_batched_tokens=64)
  assert host_memory.applied()

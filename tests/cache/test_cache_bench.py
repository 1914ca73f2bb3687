"""Smoke test of `benchmarks/cache_bench.py` at tiny sizes: the engine-path driver runs the trace it claims (every
admission hits L - 128, the device tables agree with the host's counts, no step plan overflows its fixed widths),
the empty plan of the (c) runs changes nothing, and the command line prints its table (vLLM skipped). One test, so
the command line reuses the driver's compiled programs (about 20 s on 2 cores: slow tier)."""

import jax
import numpy as np
from absl import flags

from benchmarks import cache_bench

B, L, POOL = 2, 512, 128


def test_cache_bench_tiny(capsys):
  prompts = cache_bench.make_prompts(B, L, 2)
  o = cache_bench.Ours(B, L, POOL, prompts)
  for s in range(len(prompts)):
    o.warm(s)
    m = o.m
    free = {g: m.num_free_blocks(g) for g in m.groups}
    tabs = {g: np.asarray(t) for g, t in jax.device_get(m.device_tables).items()}
    o.empty_step(s)
    assert {g: m.num_free_blocks(g) for g in m.groups} == free
    for g, t in jax.device_get(m.device_tables).items():
      np.testing.assert_array_equal(np.asarray(t), tabs[g])
    r = o.step(s)
    assert r["min_hit"] == L - cache_bench.CHUNK and r["hit"] == B * (L - cache_bench.CHUNK)
    assert r["program"] > 0 and r["plan"] > 0
  o.check()                     # device tables == host counts for the requests still held
  assert m.stats["step_plan_overflows"] == 0
  # the command line, same sizes (same compiled programs)
  fv = flags.FlagValues()
  cache_bench.define_flags(fv)
  fv(["cache_bench", "--shapes", f"{B}x{L}", "--pools", f"{POOL}", "--steps", "1"])
  cache_bench.main([], fv)
  out = capsys.readouterr().out
  assert "vLLM skipped (no --vllm_src)" in out
  row = next(line for line in out.splitlines() if line.startswith(f"| {B} | {L} | {POOL} |"))
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert float(cells[3]) == float(cells[3])          # a number (the marginal ms; its sign is noise at this size)
  assert int(cells[7]) == B * (L - cache_bench.CHUNK)         # ours hit tokens per step

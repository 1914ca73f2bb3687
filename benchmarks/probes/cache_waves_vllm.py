"""Cold concurrent waves under vLLM 0.33's own KVCacheManager: the hits it gives the sessions of
`tests/cache/test_scenarios.py::test_cold_concurrent_wave_never_fewer_than_vllm` (benchmark only; vLLM setup as in
`benchmarks/support/vllm_adapter.py`).

Three waves of three sessions that share only a 256-token system prompt; each wave's requests are admitted in one
step (lookup + allocate of the first 512-token chunk each), then prefilled in 512-token chunks and freed. Prints
the (hit tokens, junction) vLLM reports per request and wave:

    python -m benchmarks.probes.cache_waves_vllm --vllm_src=/tmp/vllm_dl/src
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.support.vllm_adapter import VllmStep


def waves(src: str, num_waves: int = 3, per_wave: int = 3, system_len: int = 256, chunk: int = 512):
  v = VllmStep(src, 4096, 4096)
  m = v.m
  rng = np.random.default_rng(11)
  system = rng.integers(2, 1000, system_len)
  out = []
  for w in range(num_waves):
    prompts = [np.concatenate([system, rng.integers(2, 1000, 300 + 41 * i + 7 * w)]) for i in range(per_wave)]
    reqs = [v.request(f"w{w}.{i}", p) for i, p in enumerate(prompts)]
    hits, done = [], []
    for r in reqs:                                  # one step: every request of the wave is admitted
      blocks, hit, junction = m.get_computed_blocks(r)
      hits.append((hit, junction))
      c = min(chunk, r.num_tokens - hit)
      assert m.allocate_slots(r, c, hit, blocks) is not None
      r.num_computed_tokens = hit + c
      done.append(hit + c)
    while any(k < r.num_tokens for k, r in zip(done, reqs)):
      for i, r in enumerate(reqs):
        if done[i] < r.num_tokens:
          c = min(chunk, r.num_tokens - done[i])
          assert m.allocate_slots(r, c) is not None
          done[i] += c
          r.num_computed_tokens = done[i]
    for r in reqs:
      m.free(r)
    out.append(hits)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--vllm_src", required=True, help="directory holding vLLM 0.33's unpacked `vllm` package")
  args = ap.parse_args()
  for w, hits in enumerate(waves(args.vllm_src)):
    print(f"wave {w}: hit tokens {[h for h, _ in hits]}  (hit, junction) {hits}")


if __name__ == "__main__":
  main()

"""vLLM 0.33's own `KVCacheManager` doing the per-step work of `benchmarks.cache_bench` (benchmark only; the probe
`benchmarks.probes.cache_waves_vllm` drives it too). `cache_bench` interleaves its steps with ours.

vLLM is NOT a project dependency. Get its pure-Python sources once, outside the repo:

    pip download vllm==0.33.0 --no-deps -d /tmp/vllm_dl
    mkdir -p /tmp/vllm_dl/src && cd /tmp/vllm_dl/src && unzip -q ../vllm-0.33.0-*.whl '*.py'
    pip install partial_json_parser llguidance   # the two imports of vllm.v1.request this box lacked

and pass `--vllm_src=/tmp/vllm_dl/src` to `python -m benchmarks.cache_bench`. Nothing is stubbed: the real
`vllm.v1.core.kv_cache_manager` (with its block pool, coordinator, single-type managers and hashing) runs; the
module path is printed and the hits it reports are printed beside ours.

Settings: `prefix_cache_retention_interval` defaults to 0, what vLLM 0.33's engine passes (CacheConfig's default,
copied unchanged into KVCacheConfig by vllm/v1/core/kv_cache_planning.py for every model: replay boundary and pinned
shared-prefix junctions only); None (dense) must be asked for.

Geometry (V4-Flash, like ours): a full-attention group of 128-token blocks and a sliding-window group of 32-token
blocks (window 128), hashes every 32 tokens; one shared block pool of `2 * pool` blocks (we have one pool of
`pool` blocks per group).
"""

from __future__ import annotations

import importlib
import sys


def load(src: str):
  """Import vLLM's KVCacheManager from `src` (a directory holding the unpacked `vllm` package)."""
  if src and src not in sys.path:
    sys.path.insert(0, src)
  kcm = importlib.import_module("vllm.v1.core.kv_cache_manager")
  return kcm


class VllmStep:
  """Admit B warm requests of L tokens per step and retire the previous step's B, through vLLM's manager."""

  def __init__(self, src: str, pool: int, max_len: int, retention_interval: int | None = 0):
    """`retention_interval` is vLLM's prefix_cache_retention_interval for the sliding group: 0 (vLLM 0.33's engine
    default, CacheConfig: replay boundary + pinned junctions only), None (dense: a tail at every aligned boundary;
    what this adapter passed before it took the setting) or a multiple of 128."""
    import torch  # local: vLLM and its torch come from --vllm_src, only when a comparison asks
    load(src)
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            SlidingWindowSpec)
    from vllm.v1.request import Request
    self._Request, self._SP = Request, SamplingParams
    init_none_hash(sha256)
    self.hasher = get_request_block_hasher(32, sha256)
    full = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(block_size=32, num_kv_heads=4, head_size=64, dtype=torch.bfloat16, sliding_window=128)
    cfg = KVCacheConfig(num_blocks=2 * pool, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["full.0"], full), KVCacheGroupSpec(["swa.0"], swa)],
                        hash_block_size=32, cache_hit_alignment_tokens=128,
                        prefix_cache_retention_interval=retention_interval)
    self.retention_interval = retention_interval
    self.m = KVCacheManager(cfg, max_model_len=max_len + 256, scheduler_block_size=128, hash_block_size=32,
                            enable_caching=True)
    self.module = sys.modules[KVCacheManager.__module__].__file__

  def request(self, rid: str, tokens) -> object:
    sp = self._SP(max_tokens=1)
    return self._Request(rid, [int(t) for t in tokens], sp, None, block_hasher=self.hasher)

  def admit(self, req, num_tokens: int) -> int:
    """Lookup + claim + allocate up to `num_tokens`; returns the hit. The shared-prefix junction the lookup reports
    is stored on the request (vLLM pins it), as its scheduler does."""
    blocks, hit, junction = self.m.get_computed_blocks(req)
    req.shared_prefix_boundary = junction
    got = self.m.allocate_slots(req, num_tokens - hit, hit, blocks)
    if got is None:
      raise RuntimeError("vLLM: out of blocks")
    req.num_computed_tokens = hit
    return hit

  def finish(self, req, num_tokens: int) -> None:
    """The request computed `num_tokens` (its blocks get cached), then it is freed."""
    req.num_computed_tokens = num_tokens
    self.m.cache_blocks(req, num_tokens)
    self.m.free(req)

  def serve_chunked(self, req, chunk: int = 2048) -> None:
    """Warm-up: prefill a new request in chunks (sliding-window blocks behind the window are released)."""
    blocks, hit, req.shared_prefix_boundary = self.m.get_computed_blocks(req)
    n = hit
    first = True
    while n < req.num_tokens:
      c = min(chunk, req.num_tokens - n)
      got = self.m.allocate_slots(req, c, hit if first else 0, blocks if first else None)
      if got is None:
        raise RuntimeError("vLLM: out of blocks in warm-up")
      first = False
      n += c
      req.num_computed_tokens = n
    self.m.cache_blocks(req, n)
    self.m.free(req)

  def warm(self, prompts, cut: int, step: int, chunk: int = 2048) -> None:
    """Untimed, before a `cache_bench` step: serve each prompt minus its last `cut` tokens, chunked (as
    `cache_bench.Ours.warm` does)."""
    for i, p in enumerate(prompts):
      self.serve_chunked(self.request(f"w{step}.{i}", p[:len(p) - cut]), chunk)

"""Traces of `tests/cache/test_scenarios.py` under vLLM 0.33's own KVCacheManager: the hits it gives (benchmark only;
vLLM setup as in `benchmarks/support/vllm_adapter.py`). Requests are driven as vLLM's scheduler does: lookup, the
reported shared-prefix junction stored on the request (`shared_prefix_boundary`, which vLLM pins), allocation of
512-token chunks, free.

`--trace waves` (default): three waves of three sessions that share only a 256-token system prompt; each wave's
requests are admitted in one step (lookup + allocate of the first chunk each), then prefilled and freed.

`--trace fanout`: one warm-up session caches a 256-token system prompt, then 4 requests over one 1536-token document
with their own questions (`--q0` + 37 i tokens), one after the other. Our KVCacheManager (its defaults) runs the
same trace beside vLLM and both hit lists are printed.

`--retention`: vLLM's prefix_cache_retention_interval: `engine` (default: 0, what vLLM 0.33's CacheConfig sets for
every model, DeepSeek-V4 included), `dense` (None: a tail at every aligned boundary) or a multiple of 128.

    python -m benchmarks.probes.cache_waves_vllm --vllm_src=/tmp/vllm_dl/src --trace fanout --q0 200
"""

from __future__ import annotations


import numpy as np
from absl import app, flags

from benchmarks.support.vllm_adapter import VllmStep
from cache.manager import KVCacheManager
from dsv4.caches import group_specs
from dsv4.config import v4_flash

FLAGS = flags.FLAGS

OURS_SETTINGS = "KVCacheManager defaults (retention_interval=0, dense_start, rerender_tokens=64, junction checkpoints)"


def _retention(arg: str) -> int | None:
  return {"engine": 0, "dense": None}[arg] if arg in ("engine", "dense") else int(arg)


def _admit(v, rid, prompt, chunk):
  """Lookup (junction kept on the request, as vLLM's scheduler does) + the first chunk's allocation."""
  r = v.request(rid, prompt)
  blocks, hit, junction = v.m.get_computed_blocks(r)
  r.shared_prefix_boundary = junction
  assert v.m.allocate_slots(r, min(chunk, r.num_tokens - hit), hit, blocks) is not None
  r.num_computed_tokens = min(r.num_tokens, hit + chunk)
  return r, hit, junction


def _prefill_rest(v, r, chunk):
  while r.num_computed_tokens < r.num_tokens:
    c = min(chunk, r.num_tokens - r.num_computed_tokens)
    assert v.m.allocate_slots(r, c) is not None
    r.num_computed_tokens += c


def waves(src: str, retention: int | None = 0, num_waves: int = 3, per_wave: int = 3, system_len: int = 256,
          chunk: int = 512):
  v = VllmStep(src, 4096, 4096, retention)
  rng = np.random.default_rng(11)
  system = rng.integers(2, 1000, system_len)
  out = []
  for w in range(num_waves):
    prompts = [np.concatenate([system, rng.integers(2, 1000, 300 + 41 * i + 7 * w)]) for i in range(per_wave)]
    adm = [_admit(v, f"w{w}.{i}", p, chunk) for i, p in enumerate(prompts)]   # one step: the whole wave
    for r, _, _ in adm:
      _prefill_rest(v, r, chunk)
    for r, _, _ in adm:
      v.m.free(r)
    out.append([(h, j) for _, h, j in adm])
  return out


def fanout_prompts(q0: int, docs: int = 4):
  """The trace of test_scenarios.py::test_fanout_over_one_document_hits_the_document (same seeds)."""
  rng = np.random.default_rng(q0)
  system, doc = rng.integers(2, 1000, 256), rng.integers(2, 1000, 1536)
  out = [np.concatenate([system, rng.integers(2, 1000, 700)])]
  return out + [np.concatenate([system, doc, rng.integers(2, 1000, q0 + 37 * i)]) for i in range(docs)]


def fanout_vllm(src: str, prompts, retention: int | None = 0, chunk: int = 512):
  v = VllmStep(src, 4096, 4096, retention)
  out = []
  for i, p in enumerate(prompts):
    r, hit, junction = _admit(v, f"f{i}", p, chunk)
    _prefill_rest(v, r, chunk)
    v.m.free(r)
    out.append((hit, junction))
  return out


def fanout_ours(prompts, chunk: int = 512):
  m = KVCacheManager(group_specs(v4_flash()), num_full_blocks=128, num_swa_blocks=128)
  out = []
  for i, p in enumerate(prompts):
    n = hit = m.add_request(f"f{i}", p).num_tokens
    while n < len(p):
      c = min(chunk, len(p) - n)
      assert m.allocate_for(f"f{i}", c)
      n += c
      m.commit(f"f{i}", n)
    m.free(f"f{i}")
    out.append(hit)
  return out


def define_flags():
  flags.DEFINE_string("vllm_src", None, "directory holding vLLM 0.33's unpacked `vllm` package")
  flags.mark_flag_as_required("vllm_src")
  flags.DEFINE_enum("trace", "waves", ["waves", "fanout"], "the cold concurrent waves, or the fan-out over one "
                    "document")
  flags.DEFINE_string("retention", "engine", "vLLM prefix_cache_retention_interval: engine (0), dense (None) or a "
                      "multiple of 128")
  flags.DEFINE_integer("q0", 200, "fanout: question lengths q0 + 37 i")


def main(argv):
  del argv
  args = FLAGS
  ret = _retention(args.retention)
  print(f"vLLM 0.33 KVCacheManager: prefix_cache_retention_interval={ret} ({args.retention}); V4-Flash geometry "
        f"(full 128-token blocks, swa 32-token blocks, window 128, hit alignment 128), 8192 blocks, junction pinned")
  if args.trace == "waves":
    for w, hits in enumerate(waves(args.vllm_src, ret)):
      print(f"wave {w}: hit tokens {[h for h, _ in hits]}  (hit, junction) {hits}")
    return
  prompts = fanout_prompts(args.q0)
  vl = fanout_vllm(args.vllm_src, prompts, ret)
  ours = fanout_ours(prompts)
  print(f"fanout: warm-up (256 system + 700), then 4 x (256 system + 1536 document + {args.q0} + 37 i question); "
        f"prompt lengths {[len(p) for p in prompts]}")
  print(f"vLLM hit tokens {[h for h, _ in vl]}  (hit, junction) {vl}")
  print(f"ours hit tokens {ours}  ({OURS_SETTINGS}; pools 128 / 128)")


if __name__ == "__main__":
  define_flags()
  app.run(main)

"""EngineConfig: everything one engine is configured with, frozen and validated in one place.

The runner, the scheduler and the main job (`experiments/serve.py`, whose flags are built from these fields) all take
this one object whole."""

from __future__ import annotations

import dataclasses

import numpy as np

from dsv4 import caches
from pallas_kernels import dispatch


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  max_num_seqs: int = 8                 # rows per step
  max_num_batched_tokens: int = 512     # token budget per step
  chunk_size: int = 64                  # longest prefill chunk of one request per step
  max_model_len: int = 2048
  num_full_blocks: int = 256
  num_swa_blocks: int = 512
  enable_prefix_caching: bool = True
  retention_interval: int = 0
  model_id: str = "dsv4"
  record_logits: bool = False           # keep each sampled position's logits (tests, analysis)
  layout: caches.CacheLayout = caches.CacheLayout()
  kernel: dispatch.KernelConfig = dispatch.KernelConfig()
  # A request's logits are bitwise the same whatever shares its step and however its prompt is chunked (every
  # token runs one fixed-shape program; slower, see runner.py).
  batch_invariant: bool = False
  # Smallest block-table width (tokens) of a step; tables grow in powers of two with the live context up to
  # max_model_len, so a step's attention cost follows its context, not the configured limit.
  min_table_tokens: int = 4096
  # Token buckets of the flat step axis grow 8, 8g, 8g^2, ... (g = 2 or 4): 4 compiles half as many step programs
  # (a compile of the whole model each; they dominate short jobs on CPU) for up to 4x padding of a step's tokens.
  token_bucket_growth: int = 4
  # Buckets per growth interval (1..8): 4 with growth 2 pads a step to within 1.25x of its tokens (256, 320, 384,
  # ...) so a chunk plus many decodes costs about its real tokens, for more compiled programs. 1 = powers only.
  token_bucket_steps: int = 1
  # Compute dtype of params / activations: "fp32" (bit for bit today's) or "bf16" (fp32 norms, softmaxes, logits;
  # model.cast_params). The KV pools' dtype is layout.kv_dtype (fp32, bf16 or caches.FP8).
  dtype: str = "fp32"
  tiering: object = None                # dsv4.engine.tiering.TieringConfig: KV tiers below the device (None = off)
  # "functional" (dsv4.model, the default) or "nnx" (the Flax modules of dsv4.nnx_model, on one device)
  model_api: str = "functional"
  # Bucket fill: a ragged step runs padded to its token bucket (8 * g^k), so a step that spills a few tokens past a
  # bucket pays for the next one (up to g x the work). When deferring at most this fraction of the step's prefill
  # tokens to the next step keeps it in the smaller bucket, the last prefill chunks are trimmed. 0 = off.
  bucket_fill: float = 0.25
  # In-batch shared-prefix deferral: a waiting request that shares at least one resume boundary of prefix with a
  # running request that has not yet computed that part waits until the leader commits past the boundary, then hits
  # it instead of computing the same KV alongside it (a cold wave of siblings sharing a system prompt). False =
  # admit in arrival order regardless (the behaviour before).
  defer_shared_prefix: bool = True
  # Async scheduling: step N+1 is planned and sent before step N's tokens are read; N's sampled tokens feed N+1 on
  # the device, stop conditions are seen one step late (a request that stopped may run one more step, whose
  # token is dropped). Same tokens as the synchronous engine. It applies on one device without tiers or batch
  # invariance; there (a mesh: the managers' own calls; tiers: they read block ids; batch invariance: several
  # calls per step) each step is read before the next is planned (`Engine.async_active` says which).
  async_scheduling: bool = True
  # Speculative decoding with the model's MTP block (ModelConfig.num_mtp_layers >= 1): each decode row carries the
  # k drafts the block proposed last step; one step verifies them (greedy: the tokens without drafts; sampled:
  # rejection sampling, the same distribution), keeps the accepted prefix plus one decided token, and drafts k
  # more. 0 = off. With async scheduling the next step is planned before this one is read: its row is filled on
  # the device from this step's results and shifted by the number of drafts accepted. One device, the functional
  # model, no batch invariance or recorded logits (refused at construction).
  num_speculative_tokens: int = 0

  def validate(self):
    for name in ("max_num_seqs", "max_num_batched_tokens", "chunk_size", "max_model_len", "num_full_blocks",
                 "num_swa_blocks", "min_table_tokens"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise ValueError(f"EngineConfig.{name}: an integer >= 1, got {v!r}")
    if not isinstance(self.retention_interval, (int, np.integer)) or self.retention_interval < 0:
      raise ValueError(f"EngineConfig.retention_interval: an integer >= 0 (0 = off), got {self.retention_interval!r}")
    if self.dtype not in ("fp32", "bf16"):
      raise ValueError(f"EngineConfig.dtype: 'fp32' or 'bf16', got {self.dtype!r}")
    if self.model_api not in ("functional", "nnx"):
      raise ValueError(f"EngineConfig.model_api: 'functional' or 'nnx', got {self.model_api!r}")
    if self.token_bucket_growth not in (2, 4):
      raise ValueError(f"EngineConfig.token_bucket_growth: 2 or 4, got {self.token_bucket_growth}")
    if not 1 <= self.token_bucket_steps <= 8:
      raise ValueError(f"EngineConfig.token_bucket_steps: 1..8, got {self.token_bucket_steps}")
    if not isinstance(self.async_scheduling, bool):
      raise ValueError(f"EngineConfig.async_scheduling: True or False, got {self.async_scheduling!r}")
    k = self.num_speculative_tokens
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 0 <= k <= 8:
      raise ValueError(f"EngineConfig.num_speculative_tokens: an integer in 0..8 (0 = off), got {k!r}")
    if k and min(self.chunk_size, self.max_num_batched_tokens) < 1 + k:
      raise ValueError(f"EngineConfig.num_speculative_tokens={k}: a decode row is 1 + k tokens; chunk_size and "
                       f"max_num_batched_tokens must be >= {1 + k}")
    if k:
      for name, bad in (("batch_invariant", self.batch_invariant), ("record_logits", self.record_logits),
                        ("model_api='nnx'", self.model_api != "functional")):
        if bad:
          raise ValueError(f"EngineConfig: num_speculative_tokens > 0 with {name} is not supported (the speculative "
                           f"step is the functional model's, one verified row per request)")
    if not 0.0 <= self.bucket_fill < 1.0:
      raise ValueError(f"EngineConfig.bucket_fill: a fraction in [0, 1), got {self.bucket_fill}")
    if self.tiering is not None:
      self.tiering.validate()           # before anything is built: a bad tier setting fails at once

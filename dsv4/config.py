"""Frozen model configuration, presets, and the derived per-layer plan.

One `ModelConfig` describes both DeepSeek-V4 (sliding window + CSA ratio 4 + HCA) and DeepSeek-V4.1 (CSA2 with
full / reindex / reuse layers). The variant is a field, not a fork: every layer's behaviour is derived into a
`LayerPlan` by `ModelConfig.layer_plan()`, and the model code reads only the plan.

Architecture: docs/model.md (presets and their shapes, the per-layer plan).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

Variant = Literal["v4", "v41"]
# swa: window only. csa: V4 ratio-4 overlapping compressor + Lightning indexer. hca: V4 dense over compressed.
# full / reindex / reuse: V4.1 CSA2 roles (docs/model.md, per-layer plan).
LayerKind = Literal["swa", "csa", "hca", "full", "reindex", "reuse"]


class ConfigError(ValueError):
  """An invalid configuration; the message names the field and says why."""


def _require(cond: bool, field: str, why: str) -> None:
  if not cond:
    raise ConfigError(f"{field}: {why}")


@dataclasses.dataclass(frozen=True)
class YarnConfig:
  """Frequency-only YaRN (attention_factor fixed to 1; docs/model.md, RoPE)."""
  factor: float = 16.0
  original_max_position_embeddings: int = 65536
  beta_fast: float = 32.0
  beta_slow: float = 1.0


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  num_heads: int = 64
  head_dim: int = 512
  rope_head_dim: int = 64
  q_lora_rank: int = 1024
  o_groups: int = 8
  o_lora_rank: int = 1024
  window: int = 128
  rope_theta: float = 10000.0
  compress_rope_theta: float = 160000.0
  yarn: YarnConfig = YarnConfig()


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
  num_heads: int = 64
  head_dim: int = 128
  topk: int = 512
  # V4.1 hierarchical candidates (docs/model.md, Lightning indexer); unused by V4.
  candidate_block_size: int = 8
  candidate_topk_blocks: int = 2048


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  n_routed_experts: int = 256
  n_shared_experts: int = 1
  num_experts_per_tok: int = 6
  intermediate_size: int = 2048
  routed_scaling_factor: float = 1.5
  swiglu_limit: float = 10.0
  num_hash_layers: int = 3  # layers [0, num_hash_layers) route by token id (tid2eid)


@dataclasses.dataclass(frozen=True)
class MHCConfig:
  hc_mult: int = 4
  sinkhorn_iters: int = 20
  eps: float = 1e-6


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
  """V4.1's draft model (docs/model.md, DSpark; NeMo `deepseek_v41/dspark.py`): `ModelConfig.num_mtp_layers`
  window-only stages, stored as `mtp.K.*`, that draft `block_size` tokens in one pass. Stage 0 projects the target's
  features (the mean over mHC streams of the input of each layer in `target_layer_ids`, concatenated) to the hidden
  size; every stage attends to that projection over the window before the anchor and to its own block (bidirectional).
  The last stage adds a rank-`markov_rank` token-transition bias (from the previous token) to the LM head's logits."""
  block_size: int = 5                        # drafts per pass: the anchor + block_size - 1 noise inputs
  target_layer_ids: tuple[int, ...] = ()     # backbone layers whose input streams feed the draft
  markov_rank: int = 256
  noise_token_id: int = 128799               # the input id of the block's positions after the anchor
  n_routed_experts: int = 128
  num_experts_per_tok: int = 3


@dataclasses.dataclass(frozen=True)
class EngramConfig:
  """V4.1 Engram (docs/model.md; NeMo `deepseek_v41/engram.py`): hashed n-gram memory added to the streams before
  the layers in `layer_ids`. Empty `layer_ids` switches it off."""
  layer_ids: tuple[int, ...] = ()
  num_embeddings: tuple[int, ...] = ()   # table rows per Engram layer (>= sum of its hash primes)
  max_ngram_size: int = 4                # n-grams of size 2..max over the current and previous max-1 tokens
  vocab_size: int = 16000000             # hash primes start above this
  n_heads: int = 8                       # hash heads per n-gram size
  head_dim: int = 256
  pad_token_id: int = 2
  compressed_vocab_size: int = 99092     # size of the normalised-token vocabulary (sets the hash multipliers)

  @property
  def hash_heads(self) -> int:
    return (self.max_ngram_size - 1) * self.n_heads


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """Everything the model needs to know about one layer, derived from the config."""
  index: int
  kind: LayerKind
  ratio: int                    # 0 for window-only layers
  rope: Literal["main", "compress"]
  overlap: bool                 # V4 CSA overlapping compressor (width 2m, stride m)
  has_compressor: bool          # owns a compressor (and thus compressed KV in the cache)
  has_index_keys: bool          # owns index keys in the cache (V4 CSA: own indexer compressor; V4.1 full: wk)
  has_index_query: bool         # computes its own top-k
  dense_compressed: bool        # attends to all visible compressed entries (V4 HCA)
  kv_source: int                # layer whose compressed KV this layer reads (-1: none)
  index_source: int             # layer whose top-k this layer uses (-1: none / own)
  candidate_source: bool        # V4.1: publishes candidate blocks
  uses_candidates: bool         # V4.1: restricts its top-k to the candidate blocks
  hash_moe: bool
  q_head_norm: bool             # weightless per-head RMSNorm on q (V4 only)
  engram: bool = False          # V4.1: Engram memory added to the streams before this layer


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A DeepSeek-V4 / V4.1 text backbone. Build presets with the functions below."""
  name: str
  variant: Variant
  vocab_size: int
  hidden_size: int
  num_layers: int
  compress_ratios: tuple[int, ...]
  attention: AttentionConfig = AttentionConfig()
  indexer: IndexerConfig = IndexerConfig()
  moe: MoEConfig = MoEConfig()
  mhc: MHCConfig = MHCConfig()
  rms_norm_eps: float = 1e-6
  max_position_embeddings: int = 1048576
  # V4.1 CSA2 roles (docs/model.md, per-layer plan); empty for V4.
  kv_source_layer_ids: tuple[int, ...] = ()
  index_source_layer_ids: tuple[int, ...] = ()
  candidate_source_layer_id: int = -1
  engram: EngramConfig = EngramConfig()
  bos_token_id: int = 0
  eos_token_id: int = 1
  # Read from a checkpoint's config (dsv4.loading.config_json): V4 per-layer attention kinds ("swa" / "csa" /
  # "hca"; empty = derived from the ratio: 0 window, 4 CSA, else HCA) and the hash-routed MoE layers (None = the
  # first `moe.num_hash_layers`). Real configs name both explicitly, so nothing is inferred from the ratio then.
  layer_kinds: tuple[str, ...] = ()
  hash_layer_ids: tuple[int, ...] | None = None
  # V4.1 as NeMo ships it: quantize-dequantize the cache (FP8 window KV, NVFP4 compressed KV, MXFP4 index q/k;
  # dsv4/layers/cache_quant.py). Off = exact float cache.
  quantized_cache: bool = False
  # Draft blocks (`num_nextn_predict_layers`, stored as `mtp.K.*`). V4: multi-token prediction blocks (one in
  # V4-Flash): each fuses the backbone's last stream with the next token's embedding and runs one window-only block
  # (docs/model.md, MTP). V4.1: the stages of the DSpark block drafter (three in V4.1-Flash), shaped by `dspark`.
  num_mtp_layers: int = 0
  dspark: DSparkConfig = DSparkConfig()

  def __post_init__(self):
    a, ix, moe = self.attention, self.indexer, self.moe
    _require(self.variant in ("v4", "v41"), "variant", f"must be 'v4' or 'v41', got {self.variant!r}")
    for f in ("vocab_size", "hidden_size", "num_layers"):
      _require(getattr(self, f) > 0, f, "must be positive")
    _require(len(self.compress_ratios) == self.num_layers, "compress_ratios",
             f"needs one entry per layer ({self.num_layers}), got {len(self.compress_ratios)}")
    _require(a.head_dim % 2 == 0 and 0 < a.rope_head_dim <= a.head_dim and a.rope_head_dim % 2 == 0,
             "attention.rope_head_dim", "must be even and within (0, head_dim]")
    _require(a.num_heads % a.o_groups == 0, "attention.o_groups",
             f"num_heads ({a.num_heads}) must be divisible by o_groups ({a.o_groups})")
    _require(a.window > 0, "attention.window", "must be positive")
    _require(ix.head_dim >= a.rope_head_dim, "indexer.head_dim",
             f"must be >= attention.rope_head_dim ({a.rope_head_dim}): index keys carry the RoPE part")
    _require(ix.topk > 0 and ix.num_heads > 0, "indexer", "topk and num_heads must be positive")
    _require(0 < moe.num_experts_per_tok <= moe.n_routed_experts, "moe.num_experts_per_tok",
             f"must be in [1, n_routed_experts={moe.n_routed_experts}]")
    _require(self.mhc.hc_mult >= 1 and self.mhc.sinkhorn_iters >= 1, "mhc", "hc_mult and sinkhorn_iters >= 1")
    if self.variant == "v4":
      for i, r in enumerate(self.compress_ratios):
        _require(r == 0 or r > 1, f"compress_ratios[{i}]", f"V4 ratios are 0 (window) or > 1, got {r}")
      _require(not self.kv_source_layer_ids and not self.index_source_layer_ids
               and self.candidate_source_layer_id < 0, "kv_source_layer_ids",
               "CSA2 source lists are V4.1-only; leave them empty for variant 'v4'")
      _require(0 <= moe.num_hash_layers <= self.num_layers, "moe.num_hash_layers", "must be in [0, num_layers]")
      if self.layer_kinds:
        _require(len(self.layer_kinds) == self.num_layers, "layer_kinds",
                 f"needs one entry per layer ({self.num_layers}), got {len(self.layer_kinds)}")
        for i, (k, r) in enumerate(zip(self.layer_kinds, self.compress_ratios)):
          _require(k in ("swa", "csa", "hca"), f"layer_kinds[{i}]", f"V4 kinds are swa/csa/hca, got {k!r}")
          _require((k == "swa") == (r == 0), f"layer_kinds[{i}]", f"kind {k!r} does not fit compress ratio {r}")
      if self.hash_layer_ids is not None:
        ids = self.hash_layer_ids
        _require(list(ids) == sorted(set(ids)) and all(0 <= i < self.num_layers for i in ids), "hash_layer_ids",
                 "must be strictly increasing existing layer ids")
        _require(len(ids) == moe.num_hash_layers, "moe.num_hash_layers", f"must equal len(hash_layer_ids)={len(ids)}")
      _require(not self.quantized_cache, "quantized_cache", "the quantized cache mode is V4.1-only")
      _require(self.num_mtp_layers >= 0, "num_mtp_layers", "must be >= 0")
      if moe.num_hash_layers:
        _require(moe.num_experts_per_tok <= moe.n_routed_experts, "moe.num_hash_layers", "tid2eid width")
    else:
      self._validate_v41()
      _require(self.num_mtp_layers >= 0, "num_mtp_layers", "must be >= 0")
      if self.num_mtp_layers:
        self._validate_dspark()
    self.layer_plan()  # surfaces any remaining schedule error at construction

  def _validate_dspark(self):
    ds = self.dspark
    ids = ds.target_layer_ids
    _require(bool(ids) and list(ids) == sorted(set(ids)) and all(0 <= i < self.num_layers for i in ids),
             "dspark.target_layer_ids", f"need strictly increasing backbone layer ids in [0, {self.num_layers}), "
             f"got {ids!r}")
    _require(ds.block_size >= 1, "dspark.block_size", "must be >= 1")
    _require(ds.markov_rank >= 1, "dspark.markov_rank", "must be >= 1")
    _require(0 <= ds.noise_token_id < self.vocab_size, "dspark.noise_token_id", "must be a token id")
    _require(0 < ds.num_experts_per_tok <= ds.n_routed_experts, "dspark.num_experts_per_tok",
             f"must be in [1, dspark.n_routed_experts={ds.n_routed_experts}]")

  def _validate_v41(self):
    _require(self.moe.num_hash_layers == 0 and not self.hash_layer_ids, "moe.num_hash_layers",
             "V4.1 has no hash routing; set it to 0")
    _require(not self.layer_kinds, "layer_kinds", "V4.1 roles come from the source-layer lists; leave it empty")
    ratios = self.compress_ratios
    for i, r in enumerate(ratios):
      _require(r in (0, 1, 2), f"compress_ratios[{i}]", f"V4.1 ratios are 0, 1 or 2, got {r}")
    for name in ("kv_source_layer_ids", "index_source_layer_ids"):
      ids = getattr(self, name)
      _require(list(ids) == sorted(set(ids)), name, "must be strictly increasing")
      for i in ids:
        _require(0 <= i < self.num_layers and ratios[i] > 0, name,
                 f"layer {i} must exist and be compressed (ratio > 0)")
    _require(set(self.kv_source_layer_ids) <= set(self.index_source_layer_ids), "index_source_layer_ids",
             "every KV-source layer also publishes a top-k, so it must be listed as an index source")
    for i, r in enumerate(ratios):
      if r == 0:
        continue
      srcs = [s for s in self.kv_source_layer_ids if s <= i]
      _require(bool(srcs), "kv_source_layer_ids", f"compressed layer {i} has no KV source at or below it")
      _require(ratios[srcs[-1]] == r, "compress_ratios",
               f"layer {i} has ratio {r} but its latest KV source (layer {srcs[-1]}) has ratio {ratios[srcs[-1]]}")
    c = self.candidate_source_layer_id
    if c >= 0:
      _require(c in self.kv_source_layer_ids, "candidate_source_layer_id", f"layer {c} must be a KV source")
      _require(self.indexer.candidate_block_size > 0 and self.indexer.candidate_topk_blocks > 0, "indexer",
               "candidate_block_size and candidate_topk_blocks must be positive")
    e = self.engram
    if e.layer_ids:
      _require(list(e.layer_ids) == sorted(set(e.layer_ids)) and all(0 <= i < self.num_layers for i in e.layer_ids),
               "engram.layer_ids", "must be strictly increasing existing layer ids")
      _require(len(e.num_embeddings) == len(e.layer_ids), "engram.num_embeddings", "one row count per Engram layer")
      _require(e.max_ngram_size >= 2 and e.n_heads >= 1 and e.vocab_size >= 2, "engram",
               "needs max_ngram_size >= 2, n_heads >= 1, vocab_size >= 2")
      _require(0 <= e.pad_token_id < self.vocab_size, "engram.pad_token_id", "must be a token id")

  @property
  def single_pass_mhc(self) -> bool:
    """V4.1: each sublayer collapses the streams with the previous sublayer's `pre`; no `hc_head` (docs/model.md)."""
    return self.variant == "v41"

  @property
  def num_kv_rows_window(self) -> int:
    return self.attention.window

  @functools.cache
  def layer_plan(self) -> tuple[LayerPlan, ...]:
    plans = []
    for i, r in enumerate(self.compress_ratios):
      if self.variant == "v4":
        kind = self.layer_kinds[i] if self.layer_kinds else ("swa" if r == 0 else ("csa" if r == 4 else "hca"))
        hash_ids = range(self.moe.num_hash_layers) if self.hash_layer_ids is None else self.hash_layer_ids
        plans.append(LayerPlan(
            index=i, kind=kind, ratio=r, rope="main" if r == 0 else "compress", overlap=kind == "csa",
            has_compressor=r > 0, has_index_keys=kind == "csa", has_index_query=kind == "csa",
            dense_compressed=kind == "hca", kv_source=i if r > 0 else -1, index_source=-1,
            candidate_source=False, uses_candidates=False, hash_moe=i in hash_ids,
            q_head_norm=True))
        continue
      eng = i in self.engram.layer_ids
      if r == 0:
        plans.append(LayerPlan(i, "swa", 0, "main", False, False, False, False, False, -1, -1, False, False,
                               False, False, engram=eng))
        continue
      kv_src = [s for s in self.kv_source_layer_ids if s <= i][-1]
      idx_srcs = [s for s in self.index_source_layer_ids if s <= i and self.compress_ratios[s] == r]
      idx_src = idx_srcs[-1] if idx_srcs and idx_srcs[-1] >= kv_src else kv_src
      is_full = i in self.kv_source_layer_ids
      is_reindex = (not is_full) and i in self.index_source_layer_ids
      kind = "full" if is_full else ("reindex" if is_reindex else "reuse")
      cand = self.candidate_source_layer_id
      plans.append(LayerPlan(
          index=i, kind=kind, ratio=r, rope="compress", overlap=False, has_compressor=is_full,
          has_index_keys=is_full, has_index_query=is_full or is_reindex, dense_compressed=False,
          kv_source=kv_src, index_source=i if (is_full or is_reindex) else idx_src,
          candidate_source=i == cand, uses_candidates=is_reindex and 0 <= cand < i and kv_src == cand,
          hash_moe=False, q_head_norm=False, engram=eng))
    return tuple(plans)

  @functools.cache
  def mtp_plans(self) -> tuple[LayerPlan, ...]:
    """The draft blocks' plans (V4 MTP blocks, V4.1 DSpark stages): window-only attention (main RoPE, no
    compressor), learned MoE routing; their cache layers follow the backbone's (index num_layers + depth)."""
    return tuple(LayerPlan(
        index=self.num_layers + d, kind="swa", ratio=0, rope="main", overlap=False, has_compressor=False,
        has_index_keys=False, has_index_query=False, dense_compressed=False, kv_source=-1, index_source=-1,
        candidate_source=False, uses_candidates=False, hash_moe=False, q_head_norm=self.variant == "v4")
        for d in range(self.num_mtp_layers))

  @property
  def dspark_moe(self) -> MoEConfig:
    """The DSpark stages' MoE: the backbone's expert shapes with the draft's own expert count and top-k."""
    return dataclasses.replace(self.moe, n_routed_experts=self.dspark.n_routed_experts,
                               num_experts_per_tok=self.dspark.num_experts_per_tok, num_hash_layers=0)

  def cache_plans(self) -> tuple[LayerPlan, ...]:
    """Every layer that owns cache arrays: the backbone, then the MTP blocks."""
    return self.layer_plan() + self.mtp_plans()

  # Derived sizes used by the cache layout.
  def compressor_width(self, plan: LayerPlan) -> int:
    """Width of one compressor row (kv or score) per token: 2*d for overlapping CSA, d otherwise."""
    return (2 if plan.overlap else 1) * self.attention.head_dim

  def index_compressor_width(self, plan: LayerPlan) -> int:
    return (2 if plan.overlap else 1) * self.indexer.head_dim

  def compressor_state_tokens(self, plan: LayerPlan) -> int:
    """Token rows a compressor may still need at any resume point (open window + overlapped previous one)."""
    if not plan.has_compressor or plan.ratio <= 1:
      return 0
    return (2 if plan.overlap else 1) * plan.ratio

  @property
  def full_block_alignment(self) -> int:
    """Smallest token count that is a whole number of entries for every compressed layer."""
    ratios = [r for r in self.compress_ratios if r > 0]
    return functools.reduce(math.lcm, ratios, 1)


# ----------------------------------------------------------------------------------------------------------
# Presets. Schedules come from rules, not literals.

def v4_schedule(num_layers: int, num_window_layers: int = 2, csa_ratio: int = 4, hca_ratio: int = 128,
                last_is_csa: bool = True) -> tuple[int, ...]:
  """V4-Flash rule: `num_window_layers` window-only layers, then CSA/HCA alternating, starting with CSA."""
  out = []
  for i in range(num_layers):
    if i < num_window_layers:
      out.append(0)
    else:
      out.append(csa_ratio if (i - num_window_layers) % 2 == 0 else hca_ratio)
  return tuple(out)


def v41_schedule(num_layers: int, num_window_layers: int, num_ratio2_layers: int) -> tuple[int, ...]:
  """V4.1-Flash rule: window-only layers, then ratio-2 layers, then ratio-1 layers."""
  return tuple(0 if i < num_window_layers else (2 if i < num_window_layers + num_ratio2_layers else 1)
               for i in range(num_layers))


def v4_flash() -> ModelConfig:
  """The official DeepSeek-V4-Flash text backbone (docs/model.md, Presets), without the MTP block."""
  return ModelConfig(name="v4_flash", variant="v4", vocab_size=129280, hidden_size=4096, num_layers=43,
                     compress_ratios=v4_schedule(43))


def v41_flash(engram: bool = True, dspark: bool = False) -> ModelConfig:
  """DeepSeek-V4.1-Flash text backbone (docs/model.md, Presets), without vision. Engram on layers 1 and 14 (NeMo
  defaults: 384006168 / 384016682 table rows of 256); `engram=False` drops it. `dspark=True` adds the released
  three-stage DSpark drafter (NeMo's defaults: block 5, features of layers 37-39, 128 experts, top-3, rank 256)."""
  return ModelConfig(
      name="v41_flash", variant="v41", vocab_size=129280, hidden_size=5120, num_layers=40,
      compress_ratios=v41_schedule(40, 2, 18),
      attention=AttentionConfig(q_lora_rank=1280),
      indexer=IndexerConfig(num_heads=32),
      moe=MoEConfig(n_routed_experts=384, intermediate_size=2304, num_hash_layers=0),
      rms_norm_eps=1e-20,
      kv_source_layer_ids=(2, 8, 14, 20), index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
      candidate_source_layer_id=20,
      engram=EngramConfig(layer_ids=(1, 14), num_embeddings=(384006168, 384016682)) if engram else EngramConfig(),
      num_mtp_layers=3 if dspark else 0,
      dspark=DSparkConfig(target_layer_ids=(37, 38, 39)) if dspark else DSparkConfig())


def v41_tiny(engram: bool = True, vocab_size: int = 128) -> ModelConfig:
  """CPU-sized V4.1 keeping every mechanism: window-only, ratio-2 full / reuse / dense reindex, ratio-1 full +
  candidate source, reuse, candidate-restricted reindex, reuse after it, Engram on a window layer and on a ratio-1
  reuse layer. 4 candidate blocks of 8 entries, so sequences beyond 32 tokens drop candidate blocks."""
  ratios = (0, 2, 2, 2, 1, 1, 1, 1)
  eng = EngramConfig(layer_ids=(1, 5), num_embeddings=(1100, 1800), max_ngram_size=4, vocab_size=60, n_heads=4,
                     head_dim=16, pad_token_id=2, compressed_vocab_size=_tiny_compressed_vocab(vocab_size))
  return ModelConfig(
      name="v41_tiny", variant="v41", vocab_size=vocab_size, hidden_size=64, num_layers=len(ratios),
      compress_ratios=ratios,
      attention=AttentionConfig(num_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=32, o_groups=2,
                                o_lora_rank=16, window=16),
      indexer=IndexerConfig(num_heads=8, head_dim=32, topk=16, candidate_block_size=8, candidate_topk_blocks=4),
      moe=MoEConfig(n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, intermediate_size=32,
                    num_hash_layers=0),
      rms_norm_eps=1e-20, kv_source_layer_ids=(1, 4), index_source_layer_ids=(1, 3, 4, 6),
      candidate_source_layer_id=4, engram=eng if engram else EngramConfig())


def _tiny_compressed_vocab(vocab_size: int) -> int:
  """Normalised vocabulary of tests/dsv4/v41_oracle.tiny_tokenizer: 5 specials (' ' and '\\n' merge) + the
  distinct lower-cased words."""
  n = vocab_size - 5
  return 4 + len({("abcdefghijklmnopqrstuvwxyz"[i % 26] * (1 + i // 52)) for i in range(n)})


def v4_tiny(num_layers: int = 4, window: int = 16, hca_ratio: int = 16, vocab_size: int = 512,
            index_topk: int = 8) -> ModelConfig:
  """CPU-sized V4 keeping every mechanism: window, CSA m=4 (overlap + indexer), HCA (small ratio),
  hash-routed and learned MoE, mHC. At the defaults it equals the tiny transformers oracle config
  (tests/dsv4/oracle_util.py; docs/references.md)."""
  return ModelConfig(
      name="v4_tiny", variant="v4", vocab_size=vocab_size, hidden_size=64, num_layers=num_layers,
      compress_ratios=v4_schedule(num_layers, num_window_layers=1, hca_ratio=hca_ratio),
      attention=AttentionConfig(num_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=32, o_groups=2,
                                o_lora_rank=16, window=window),
      indexer=IndexerConfig(num_heads=8, head_dim=32, topk=index_topk),
      moe=MoEConfig(n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, intermediate_size=32,
                    num_hash_layers=1),
      max_position_embeddings=1048576)


def v4_flash_layers(num_layers: int = 4, vocab_size: int = 1024) -> ModelConfig:
  """V4-Flash's attention at its real widths in a few layers (random weights: no checkpoint of this shape exists):
  hidden 4096, 64 heads x 512 (64 RoPE), q_lora 1024, 8 x 1024 output groups, window 128, indexer 64 x 128 top-512,
  V4-Flash's layer rule (two window layers, then CSA m=4 / HCA m=128 alternating). What is small is what the
  attention kernels never see: the vocabulary and the MoE (4 experts of 512, top-2, one hash-routed layer). Named
  `v4_flash_layers:N` (`get_preset`), e.g. `--model=random --preset=v4_flash_layers:4`."""
  _require(num_layers >= 1, "num_layers", f"v4_flash_layers: at least 1 layer, got {num_layers}")
  return ModelConfig(
      name=f"v4_flash_layers{num_layers}", variant="v4", vocab_size=vocab_size, hidden_size=4096,
      num_layers=num_layers, compress_ratios=v4_schedule(num_layers),
      moe=MoEConfig(n_routed_experts=4, num_experts_per_tok=2, intermediate_size=512, num_hash_layers=1))


PRESETS = {"v4_flash": v4_flash, "v41_flash": v41_flash, "v4_tiny": v4_tiny, "v41_tiny": v41_tiny,
           "v4_flash_layers": v4_flash_layers}


def get_preset(name: str) -> ModelConfig:
  """A preset by name; `name:N` passes N as the preset's first argument (`v4_flash_layers:4`: four layers)."""
  base, _, arg = name.partition(":")
  if base not in PRESETS:
    raise ConfigError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))} (v4_flash_layers:N for N "
                      "layers)")
  if not arg:
    return PRESETS[base]()
  if base != "v4_flash_layers" or not arg.isdigit():
    raise ConfigError(f"preset {name!r}: only v4_flash_layers takes an argument, a layer count (v4_flash_layers:4)")
  return PRESETS[base](int(arg))

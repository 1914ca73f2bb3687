"""`ModelConfig` from a checkpoint's `config.json`.

    cfg = load_config("ckpt_dir")                 # or load_config("ckpt_dir/config.json")
    cfg, info = read_config("ckpt_dir")           # info: format, fp8 block, expert dtype, eos ids, ...
    d = config_to_dict(cfg)                       # the inverse (exports, tests)

A directory without config.json is read from its text_config.json (a NeMo Automodel export of the text backbone).
NeMo-format configs turn `ModelConfig.quantized_cache` on unless `quantized_cache=False` (NeMo always fake-quantizes
its cache, so its checkpoints reproduce NeMo by default).

Four spellings are read, told apart by their keys:

* **transformers** `DeepseekV4Config` (`model_type` "deepseek_v4"): `layer_types` + `compress_rates`,
  `mlp_layer_types`, `rope_parameters` {main, compress}, `partial_rotary_factor`. Fields it omits take the
  transformers 5.23 defaults (the V4-Flash values), except the layer schedule: without `layer_types` or
  `compress_ratios` transformers silently builds the V4-*Pro* schedule, so that is refused here.
* **original** DeepSeek-V4 `config.json`: the same model type with the legacy keys transformers folds in
  (`compress_ratios` incl. the MTP entry, `num_hash_layers`, `rope_scaling`, `qk_rope_head_dim`, `expert_dtype`,
  `quantization_config`). Both go through one reader, which applies the same folding.
* **inference** `ModelArgs` JSON of the official `inference/` code (`dim`, `n_layers`, `n_heads`, `window_size`,
  `moe_inter_dim`, `n_activated_experts`, `route_scale`, `rope_factor`, ...). Its model-shape fields have toy
  defaults in the code, so every one of them is required here.
* **NeMo** V4.1 (`model_type` "deepseek_v41" with a `text_config`, or "deepseek_v41_text"): NeMo Automodel 0.7.0
  `DeepseekV41TextConfig` defaults for omitted fields (the released Flash values); vision fields are read and
  ignored (not part of the text backbone). The DSpark draft (`num_nextn_predict_layers` stages, `dspark_*` keys;
  docs/model.md, DSpark) is declared, not built: `info.mtp_layers` and `info.dspark` say what the file describes,
  the config has no draft (`num_mtp_layers` 0) until `with_draft` / `load_pretrained(mtp=True)` opts in.

Every key is consumed: it sets a field, is checked against the only value this implementation supports (e.g.
`scoring_func` must be "sqrtsoftplus", `num_key_value_heads` 1), or is on a list of keys with no effect on
inference (training knobs, metadata). Anything else raises `ConfigError` naming the key (`strict=False` turns
unknown keys into a list in `info.ignored`). Layer kinds, ratios and hash layers come from the config, never from
"ratio == 4" or "the first layers".
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

from dsv4.config import (AttentionConfig, ConfigError, DSparkConfig, EngramConfig, IndexerConfig, MHCConfig,
                         ModelConfig, MoEConfig, YarnConfig)

CONFIG_FILE = "config.json"
TEXT_CONFIG_FILE = "text_config.json"  # NeMo Automodel text-only exports

# Keys with no effect on an inference forward pass (training, serialization, framework metadata).
_NO_EFFECT = {
    "architectures", "transformers_version", "dtype", "torch_dtype", "model_type", "initializer_range", "use_cache",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "attention_dropout", "auto_map",
    "_name_or_path", "keys_to_ignore_at_inference", "pad_token_id", "aux_loss_alpha",
    "seq_aux", "ep_size", "output_attentions", "output_hidden_states", "return_dict", "chunk_size_feed_forward",
    "id2label", "label2id", "problem_type", "tokenizer_class", "is_encoder_decoder", "generation_config",
    # runtime knobs of the official inference code
    "max_batch_size", "max_seq_len", "scale_dtype",
}


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
  """What config.json says beyond the model shape."""
  format: str                             # "transformers" | "original" | "inference" | "nemo"
  fp8_block: int | None = None            # quantization_config.weight_block_size edge (None: not stated)
  expert_dtype: str | None = None         # "fp4" / "fp8" / None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None
  ignored: tuple[str, ...] = ()           # unknown keys tolerated with strict=False
  mtp_layers: int = 0                     # MTP blocks the file declares (num_nextn_predict_layers / n_mtp_layers)
  dspark: DSparkConfig | None = None      # V4.1: the DSpark draft the file declares (None: none declared)
  draft_ratios: tuple[int, ...] = ()      # V4.1: compress_ratios' entries after the backbone (the draft's: all 0)


class _Reader:
  """Hands out keys of one JSON object; remembers which were consumed so the rest can be refused by name."""

  def __init__(self, d: dict, where: str):
    if not isinstance(d, dict):
      raise ConfigError(f"{where}: expected a JSON object, got {type(d).__name__}")
    self.d, self.where, self.used = d, where, set()

  def has(self, k):
    return k in self.d and self.d[k] is not None

  def raw(self, k, default=None):
    self.used.add(k)
    v = self.d.get(k)
    return default if v is None else v

  def int(self, k, default=None, *, min_value: int | None = 1):
    if not self.has(k) and default is None:
      raise ConfigError(f"{self.where}: field {k!r} is required (no default for this config format)")
    v = self.raw(k, default)
    if isinstance(v, float) and v.is_integer():
      v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
      raise ConfigError(f"{self.where}: field {k!r} must be an integer, got {v!r}")
    if min_value is not None and v < min_value:
      raise ConfigError(f"{self.where}: field {k!r} must be >= {min_value}, got {v}")
    return v

  def float(self, k, default=None, *, positive=True):
    if not self.has(k) and default is None:
      raise ConfigError(f"{self.where}: field {k!r} is required (no default for this config format)")
    v = self.raw(k, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or (positive and v <= 0):
      raise ConfigError(f"{self.where}: field {k!r} must be a finite{' positive' if positive else ''} number, "
                        f"got {v!r}")
    return float(v)

  def ints(self, k, default=None, *, min_value=0):
    if not self.has(k) and default is None:
      raise ConfigError(f"{self.where}: field {k!r} is required (no default for this config format)")
    v = self.raw(k, default)
    if not isinstance(v, (list, tuple)) or any(not isinstance(x, int) or isinstance(x, bool) or x < min_value
                                               for x in v):
      raise ConfigError(f"{self.where}: field {k!r} must be a list of integers >= {min_value}, got {v!r}")
    return tuple(v)

  def expect(self, k, supported, default=None):
    """A key whose only supported value(s) are `supported`; absent = fine."""
    if not self.has(k):
      self.used.add(k)
      return default
    v = self.raw(k)
    ok = v in supported if isinstance(supported, (tuple, list, set)) else v == supported
    if not ok:
      raise ConfigError(f"{self.where}: field {k!r} = {v!r} is not supported (this implementation needs "
                        f"{supported!r})")
    return v

  def finish(self, strict: bool, extra_ok=()) -> tuple[str, ...]:
    rest = sorted(k for k in self.d if k not in self.used and k not in _NO_EFFECT and k not in extra_ok)
    if rest and strict:
      raise ConfigError(f"{self.where}: field {rest[0]!r} is not understood by this reader ({len(rest)} unknown: "
                        f"{rest[:6]}); refusing rather than guessing (strict=False ignores them)")
    return tuple(rest)


def _eos(r: _Reader, default=1) -> tuple[int, ...]:
  v = r.raw("eos_token_id", default)
  ids = (v,) if isinstance(v, int) and not isinstance(v, bool) else tuple(v) if isinstance(v, list) else None
  if not ids or any(not isinstance(x, int) or x < 0 for x in ids):
    raise ConfigError(f"{r.where}: field 'eos_token_id' must be a token id or a list of them, got {v!r}")
  return ids


def _yarn_from(d: dict, where: str, field: str) -> YarnConfig:
  """YaRN block (rope_scaling / rope_parameters.compress). rope_type 'default' = no scaling (factor 1)."""
  r = _Reader(d, f"{where}: {field}")
  kind_a, kind_b = r.raw("rope_type", None), r.raw("type", None)
  if kind_a and kind_b and kind_a != kind_b:
    raise ConfigError(f"{where}: fields '{field}.rope_type' ({kind_a!r}) and '{field}.type' ({kind_b!r}) disagree")
  kind = kind_a or kind_b or "default"
  r.raw("rope_theta")
  r.raw("partial_rotary_factor")  # cross-checked by the caller
  if kind == "default":
    r.finish(True)
    return YarnConfig(factor=1.0)
  if kind != "yarn":
    raise ConfigError(f"{where}: field '{field}.rope_type' = {kind!r} is not supported (yarn or default)")
  y = YarnConfig(factor=r.float("factor", 16.0),
                 original_max_position_embeddings=r.int("original_max_position_embeddings", 65536),
                 beta_fast=r.float("beta_fast", 32.0), beta_slow=r.float("beta_slow", 1.0))
  # V4 applies no YaRN attention scaling: only 1.0 (transformers' forced value) is accepted.
  r.expect("attention_factor", (1, 1.0))
  r.expect("mscale", (1, 1.0))
  r.expect("mscale_all_dim", (0, 0.0, 1, 1.0))
  r.finish(True)
  return y


def _quant_info(r: _Reader) -> tuple[int | None, str | None]:
  q = r.raw("quantization_config", None)
  expert = r.raw("expert_dtype", None)
  block = None
  if q is not None:
    qr = _Reader(q, f"{r.where}: quantization_config")
    qr.expect("quant_method", ("fp8", "fp4", "mxfp4"))
    qr.expect("fmt", ("e4m3",))
    qr.expect("activation_scheme", ("dynamic",))
    qr.expect("scale_fmt", ("ue8m0",))
    wb = qr.raw("weight_block_size", None)
    if wb is not None:
      if not (isinstance(wb, list) and len(wb) == 2 and wb[0] == wb[1] and isinstance(wb[0], int) and wb[0] > 0):
        raise ConfigError(f"{r.where}: field 'quantization_config.weight_block_size' must be a square [b, b], "
                          f"got {wb!r}")
      block = wb[0]
    expert = qr.raw("expert_dtype", expert)
    qr.raw("modules_to_not_convert")
    qr.finish(False)  # tolerate exporter-specific extras: they do not change the stored tensors we validate
  if expert is not None and expert not in ("fp4", "fp8", "bf16"):
    raise ConfigError(f"{r.where}: field 'expert_dtype' = {expert!r} is not supported (fp4, fp8 or bf16)")
  return block, expert


_HF_KIND = {"sliding_attention": "swa", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}


def _v4_transformers(r: _Reader, name: str, strict: bool) -> tuple[ModelConfig, CheckpointInfo]:
  n = r.int("num_hidden_layers", 43)
  fmt = "original" if (r.has("compress_ratios") and not r.has("layer_types")) or r.has("num_hash_layers") \
      else "transformers"
  # --- layer schedule: explicit layer_types > legacy compress_ratios; never the silent V4-Pro default
  rates = dict(r.raw("compress_rates", None) or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
  if r.has("compress_rate_csa"):
    rates["compressed_sparse_attention"] = r.int("compress_rate_csa")
  if r.has("compress_rate_hca"):
    rates["heavily_compressed_attention"] = r.int("compress_rate_hca")
  for k, v in rates.items():
    if k not in _HF_KIND or k == "sliding_attention" or not isinstance(v, int) or v < 2:
      raise ConfigError(f"{r.where}: field 'compress_rates' entry {k!r}: {v!r} (needs CSA/HCA types with rate >= 2)")
  if r.has("layer_types"):
    types = r.raw("layer_types")
    if not isinstance(types, list) or len(types) < n:
      raise ConfigError(f"{r.where}: field 'layer_types' must list at least num_hidden_layers={n} types, got {types!r}")
    bad = [t for t in types if t not in _HF_KIND]
    if bad:
      raise ConfigError(f"{r.where}: field 'layer_types' has unknown types {bad[:3]} (known: {sorted(_HF_KIND)})")
    kinds = tuple(_HF_KIND[t] for t in types[:n])
    ratios = tuple(0 if k == "swa" else rates[t] for k, t in zip(kinds, types[:n]))
    r.raw("compress_ratios")  # the legacy list loses to layer_types (as in transformers)
  elif r.has("compress_ratios"):
    cr = r.ints("compress_ratios")
    if len(cr) < n:
      raise ConfigError(f"{r.where}: field 'compress_ratios' has {len(cr)} entries, fewer than num_hidden_layers={n}")
    ratios = cr[:n]  # extra entries belong to the MTP block
    by_rate = {v: k for k, v in rates.items()}
    kinds = []
    for i, x in enumerate(ratios):
      if x == 0:
        kinds.append("swa")
      elif x in by_rate:
        kinds.append(_HF_KIND[by_rate[x]])
      else:
        raise ConfigError(f"{r.where}: field 'compress_ratios[{i}]' = {x} is neither 0 nor a CSA/HCA rate {rates}")
    kinds = tuple(kinds)
  else:
    raise ConfigError(f"{r.where}: neither 'layer_types' nor 'compress_ratios' is given; transformers would "
                      f"silently use the V4-Pro schedule, so the layer schedule must be stated")
  # --- hash-routed layers
  if r.has("mlp_layer_types"):
    mt = r.raw("mlp_layer_types")
    if not isinstance(mt, list) or len(mt) < n or any(t not in ("hash_moe", "moe") for t in mt):
      raise ConfigError(f"{r.where}: field 'mlp_layer_types' must list 'hash_moe'/'moe' per layer, got {mt!r}")
    hash_ids = tuple(i for i, t in enumerate(mt[:n]) if t == "hash_moe")
    r.raw("num_hash_layers")
  else:
    hash_ids = tuple(range(min(n, r.int("num_hash_layers", 3, min_value=0))))
  # --- attention / rope
  head_dim = r.int("head_dim", 512)
  if r.has("partial_rotary_factor"):
    prf = r.float("partial_rotary_factor")
    rope_dim = int(round(head_dim * prf))
    if r.has("qk_rope_head_dim") and r.int("qk_rope_head_dim") != rope_dim:
      raise ConfigError(f"{r.where}: field 'qk_rope_head_dim' = {r.d['qk_rope_head_dim']} disagrees with "
                        f"partial_rotary_factor * head_dim = {rope_dim}")
  else:
    rope_dim = r.int("qk_rope_head_dim", 64)
  if r.has("qk_nope_head_dim") and r.int("qk_nope_head_dim") != head_dim - rope_dim:
    raise ConfigError(f"{r.where}: field 'qk_nope_head_dim' must be head_dim - qk_rope_head_dim = "
                      f"{head_dim - rope_dim}")
  if r.has("v_head_dim") and r.int("v_head_dim") != head_dim:
    raise ConfigError(f"{r.where}: field 'v_head_dim' must equal head_dim ({head_dim}): K = V in V4")
  rope_theta = r.float("rope_theta", 10000.0)
  compress_theta = r.float("compress_rope_theta", 160000.0)
  rp = r.raw("rope_parameters", None)
  rs = r.raw("rope_scaling", None)
  if isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
    main, comp = rp["main"], rp["compress"]
    if set(rp) - {"main", "compress"}:
      raise ConfigError(f"{r.where}: field 'rope_parameters' has keys {sorted(set(rp) - {'main', 'compress'})} "
                        f"besides main/compress")
    if (main.get("rope_type") or main.get("type") or "default") != "default":
      raise ConfigError(f"{r.where}: field 'rope_parameters.main.rope_type' must be 'default' (window layers "
                        f"use plain RoPE)")
    for label, d, theta in (("main", main, rope_theta), ("compress", comp, compress_theta)):
      if "rope_theta" in d and float(d["rope_theta"]) != theta:
        raise ConfigError(f"{r.where}: field 'rope_parameters.{label}.rope_theta' = {d['rope_theta']} disagrees "
                          f"with the top-level value {theta}")
      if "partial_rotary_factor" in d and int(round(head_dim * float(d["partial_rotary_factor"]))) != rope_dim:
        raise ConfigError(f"{r.where}: field 'rope_parameters.{label}.partial_rotary_factor' disagrees with "
                          f"the rope head dim {rope_dim}")
    yarn = _yarn_from(comp, r.where, "rope_parameters.compress")
  else:
    flat = rp if isinstance(rp, dict) else rs
    yarn = _yarn_from(flat, r.where, "rope_parameters" if rp else "rope_scaling") if flat else YarnConfig()
  fp8_block, expert = _quant_info(r)
  r.expect("num_key_value_heads", (1,))
  r.expect("scoring_func", ("sqrtsoftplus",))
  r.expect("norm_topk_prob", (True,))
  r.expect("topk_method", ("noaux_tc",))
  r.expect("hidden_act", ("silu",))
  r.expect("tie_word_embeddings", (False,))
  r.expect("attention_bias", (False,))
  r.expect("mlp_bias", (False,))
  r.expect("n_group", (1,))
  r.expect("topk_group", (1,))
  eos = _eos(r)
  cfg = ModelConfig(
      name=name, variant="v4", vocab_size=r.int("vocab_size", 129280), hidden_size=r.int("hidden_size", 4096),
      num_layers=n, compress_ratios=ratios,
      attention=AttentionConfig(num_heads=r.int("num_attention_heads", 64), head_dim=head_dim, rope_head_dim=rope_dim,
                                q_lora_rank=r.int("q_lora_rank", 1024), o_groups=r.int("o_groups", 8),
                                o_lora_rank=r.int("o_lora_rank", 1024), window=r.int("sliding_window", 128),
                                rope_theta=rope_theta, compress_rope_theta=compress_theta, yarn=yarn),
      indexer=IndexerConfig(num_heads=r.int("index_n_heads", 64), head_dim=r.int("index_head_dim", 128),
                            topk=r.int("index_topk", 512)),
      moe=MoEConfig(n_routed_experts=r.int("n_routed_experts", 256), n_shared_experts=r.int("n_shared_experts", 1),
                    num_experts_per_tok=r.int("num_experts_per_tok", 6),
                    intermediate_size=r.int("moe_intermediate_size", 2048),
                    routed_scaling_factor=r.float("routed_scaling_factor", 1.5),
                    swiglu_limit=r.float("swiglu_limit", 10.0), num_hash_layers=len(hash_ids)),
      mhc=MHCConfig(hc_mult=r.int("hc_mult", 4), sinkhorn_iters=r.int("hc_sinkhorn_iters", 20),
                    eps=r.float("hc_eps", 1e-6)),
      rms_norm_eps=r.float("rms_norm_eps", 1e-6), max_position_embeddings=r.int("max_position_embeddings", 1048576),
      bos_token_id=r.int("bos_token_id", 0, min_value=0), eos_token_id=eos[0], layer_kinds=kinds,
      hash_layer_ids=hash_ids)
  pad = r.raw("pad_token_id", None)
  mtp = r.int("num_nextn_predict_layers", 0, min_value=0)
  ignored = r.finish(strict)
  return cfg, CheckpointInfo(fmt, fp8_block, expert, eos, pad, ignored, mtp)


def _v4_inference(r: _Reader, name: str, strict: bool) -> tuple[ModelConfig, CheckpointInfo]:
  """Official `inference/` ModelArgs JSON: short names, every shape field required."""
  n = r.int("n_layers")
  cr = r.ints("compress_ratios")
  if len(cr) < n:
    raise ConfigError(f"{r.where}: field 'compress_ratios' has {len(cr)} entries, fewer than n_layers={n}")
  ratios = cr[:n]
  # The inference code decides CSA by its indexer (built when ratio == 4); the file names no other kind.
  kinds = tuple("swa" if x == 0 else ("csa" if x == 4 else "hca") for x in ratios)
  r.expect("score_func", ("sqrtsoftplus",))
  r.expect("dtype", ("fp8", "bf16"))
  r.expect("scale_fmt", ("ue8m0", None))
  expert = r.raw("expert_dtype", None)
  n_hash = r.int("n_hash_layers", min_value=0)
  orig_len = r.int("original_seq_len", min_value=0)
  factor = r.float("rope_factor")
  yarn = YarnConfig(factor=factor if orig_len else 1.0, original_max_position_embeddings=orig_len or 65536,
                    beta_fast=r.float("beta_fast"), beta_slow=r.float("beta_slow"))
  cfg = ModelConfig(
      name=name, variant="v4", vocab_size=r.int("vocab_size"), hidden_size=r.int("dim"), num_layers=n,
      compress_ratios=ratios,
      attention=AttentionConfig(num_heads=r.int("n_heads"), head_dim=r.int("head_dim"),
                                rope_head_dim=r.int("rope_head_dim"), q_lora_rank=r.int("q_lora_rank"),
                                o_groups=r.int("o_groups"), o_lora_rank=r.int("o_lora_rank"),
                                window=r.int("window_size"), rope_theta=r.float("rope_theta"),
                                compress_rope_theta=r.float("compress_rope_theta"), yarn=yarn),
      indexer=IndexerConfig(num_heads=r.int("index_n_heads"), head_dim=r.int("index_head_dim"),
                            topk=r.int("index_topk")),
      moe=MoEConfig(n_routed_experts=r.int("n_routed_experts"), n_shared_experts=r.int("n_shared_experts"),
                    num_experts_per_tok=r.int("n_activated_experts"), intermediate_size=r.int("moe_inter_dim"),
                    routed_scaling_factor=r.float("route_scale"), swiglu_limit=r.float("swiglu_limit"),
                    num_hash_layers=min(n, n_hash)),
      mhc=MHCConfig(hc_mult=r.int("hc_mult"), sinkhorn_iters=r.int("hc_sinkhorn_iters"), eps=r.float("hc_eps")),
      rms_norm_eps=r.float("norm_eps"), layer_kinds=kinds, hash_layer_ids=tuple(range(min(n, n_hash))))
  mtp = r.int("n_mtp_layers", 0, min_value=0)
  ignored = r.finish(strict)
  return cfg, CheckpointInfo("inference", 128, expert, (cfg.eos_token_id,), None, ignored, mtp)


# NeMo Automodel 0.7.0 DeepseekV41TextConfig defaults (the released V4.1-Flash text configuration).
_NEMO_LAYERS = 40


def _v41_nemo(r: _Reader, top: _Reader | None, name: str, strict: bool) -> tuple[ModelConfig, CheckpointInfo]:
  n = r.int("num_hidden_layers", _NEMO_LAYERS)
  cr = r.ints("compress_ratios", (0, 0) + (2,) * 18 + (1,) * 20 + (0,) * 3)
  if len(cr) < n:
    raise ConfigError(f"{r.where}: field 'compress_ratios' has {len(cr)} entries, fewer than num_hidden_layers={n}")
  ratios = cr[:n]  # trailing entries are DSpark draft layers

  def layer_ids(k, default):
    ids = r.ints(k, default)
    if list(ids) != sorted(set(ids)):
      raise ConfigError(f"{r.where}: field {k!r} must be strictly increasing, got {list(ids)}")
    return tuple(i for i in ids if i < n)  # NeMo keeps the full schedule when num_hidden_layers is reduced

  kv_src = layer_ids("kv_source_layer_ids", (2, 8, 14, 20))
  idx_src = layer_ids("index_source_layer_ids", (2, 8, 14, 20, 24, 28, 32, 36))
  cand = r.int("candidate_source_layer_id", 20, min_value=-1)
  if cand >= n:
    cand = -1
  eng_ids_all = r.ints("engram_layer_ids", (1, 14))
  eng_rows_all = r.ints("engram_num_embeddings", (384006168, 384016682) if eng_ids_all else (), min_value=1)
  if len(eng_rows_all) != len(eng_ids_all):
    raise ConfigError(f"{r.where}: field 'engram_num_embeddings' needs one row count per engram_layer_ids entry")
  keep = [j for j, i in enumerate(eng_ids_all) if i < n]
  rope_dim = r.int("qk_rope_head_dim", 64)
  head_dim = r.int("head_dim", 512)
  rs = r.raw("rope_scaling", None)
  rp = r.raw("rope_parameters", None)  # transformers 5 serialises NeMo's rope_scaling as rope_parameters
  keys = ("rope_type", "type", "factor", "beta_fast", "beta_slow", "original_max_position_embeddings",
          "attention_factor", "mscale", "mscale_all_dim")
  yarn_rp = _yarn_from({k: v for k, v in rp.items() if k in keys}, r.where, "rope_parameters") \
      if isinstance(rp, dict) else None
  yarn = _yarn_from(rs, r.where, "rope_scaling") if rs else (yarn_rp or YarnConfig())
  if yarn_rp is not None and yarn_rp != yarn:
    raise ConfigError(f"{r.where}: field 'rope_parameters' disagrees with 'rope_scaling'")
  fp8_block, expert = _quant_info(top or r)
  for rr in filter(None, (r, top)):
    rr.expect("num_key_value_heads", (1,))
    rr.expect("scoring_func", ("sqrtsoftplus",))
    rr.expect("norm_topk_prob", (True,))
    rr.expect("topk_method", ("noaux_tc",))
    rr.expect("hidden_act", ("silu",))
    rr.expect("tie_word_embeddings", (False,))
    rr.expect("attention_bias", (False,))
  src = top or r
  eos = _eos(src)
  bos = src.int("bos_token_id", 0, min_value=0)
  pad = src.raw("pad_token_id", 2)
  vocab = r.int("vocab_size", 129280)
  eng = EngramConfig()
  if keep:
    eng = EngramConfig(layer_ids=tuple(eng_ids_all[j] for j in keep),
                       num_embeddings=tuple(eng_rows_all[j] for j in keep),
                       max_ngram_size=r.int("engram_max_ngram_size", 4),
                       vocab_size=r.int("engram_vocab_size", 16000000),
                       n_heads=r.int("engram_n_heads", 8), head_dim=r.int("engram_head_dim", 256),
                       pad_token_id=r.int("engram_pad_token_id", 2, min_value=0),
                       compressed_vocab_size=r.int("engram_compressed_vocab_size", 99092))
  else:
    for k in ("engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim",
              "engram_pad_token_id", "engram_compressed_vocab_size"):
      r.raw(k)
  cfg = ModelConfig(
      name=name, variant="v41", vocab_size=vocab, hidden_size=r.int("hidden_size", 5120), num_layers=n,
      compress_ratios=ratios,
      attention=AttentionConfig(num_heads=r.int("num_attention_heads", 64), head_dim=head_dim, rope_head_dim=rope_dim,
                                q_lora_rank=r.int("q_lora_rank", 1280), o_groups=r.int("o_groups", 8),
                                o_lora_rank=r.int("o_lora_rank", 1024), window=r.int("sliding_window", 128),
                                rope_theta=r.float("rope_theta", 10000.0),
                                compress_rope_theta=r.float("compress_rope_theta", 160000.0), yarn=yarn),
      indexer=IndexerConfig(num_heads=r.int("index_n_heads", 32), head_dim=r.int("index_head_dim", 128),
                            topk=r.int("index_topk", 512), candidate_block_size=r.int("candidate_block_size", 8),
                            candidate_topk_blocks=r.int("candidate_topk_blocks", 2048)),
      moe=MoEConfig(n_routed_experts=r.int("n_routed_experts", 384), n_shared_experts=r.int("n_shared_experts", 1),
                    num_experts_per_tok=r.int("num_experts_per_tok", 6),
                    intermediate_size=r.int("moe_intermediate_size", 2304),
                    routed_scaling_factor=r.float("routed_scaling_factor", 1.5),
                    swiglu_limit=r.float("swiglu_limit", 10.0), num_hash_layers=0),
      mhc=MHCConfig(hc_mult=r.int("hc_mult", 4), sinkhorn_iters=r.int("hc_sinkhorn_iters", 20),
                    eps=r.float("hc_eps", 1e-6)),
      rms_norm_eps=r.float("rms_norm_eps", 1e-20), max_position_embeddings=r.int("max_position_embeddings", 1048576),
      kv_source_layer_ids=kv_src, index_source_layer_ids=idx_src, candidate_source_layer_id=cand, engram=eng,
      bos_token_id=bos, eos_token_id=eos[0])
  stages, dspark = _dspark_from(r, top, n)
  if top is not None:
    top.raw("text_config")
    top.raw("vision_config")  # the vision encoder is not part of the text backbone
    top.raw("image_token_id")
    ignored = top.finish(strict)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id", "dtype"):
      r.raw(k)
  else:
    ignored = ()
  ignored += r.finish(strict)
  return cfg, CheckpointInfo("nemo", fp8_block or 32, expert, eos, pad, ignored, stages, dspark,
                             tuple(cr[n:n + stages]))


def _dspark_from(r: _Reader, top: _Reader | None, n: int) -> tuple[int, DSparkConfig | None]:
  """The declared DSpark draft (NeMo `DeepseekV41TextConfig` defaults: three stages, block 5, noise token 128799,
  features of layers 37-39, rank 256, 128 experts, top-3): (stages, DSparkConfig), or (0, None) without one. Its
  values are checked when a config with the draft is built (`with_draft`), not here: a backbone-only load never
  needs them (NeMo keeps the released target ids when num_hidden_layers is reduced)."""
  stages = r.int("num_nextn_predict_layers", 3, min_value=0)
  if top is not None and top.has("num_nextn_predict_layers") and top.int("num_nextn_predict_layers", min_value=0) \
      != stages:
    raise ConfigError(f"{r.where}: field 'num_nextn_predict_layers' disagrees with the top-level value")
  ds = DSparkConfig(block_size=r.int("dspark_block_size", 5, min_value=0),
                    noise_token_id=r.int("dspark_noise_token_id", 128799, min_value=0),
                    target_layer_ids=r.ints("dspark_target_layer_ids", (37, 38, 39)),
                    markov_rank=r.int("dspark_markov_rank", 256, min_value=0),
                    n_routed_experts=r.int("dspark_n_routed_experts", 128, min_value=0),
                    num_experts_per_tok=r.int("dspark_num_experts_per_tok", 3, min_value=0))
  return (stages, ds) if stages else (0, None)


def with_draft(cfg: ModelConfig, info: CheckpointInfo, stages: int | None = None) -> ModelConfig:
  """`cfg` with the draft its config.json declares: V4 `stages` MTP blocks (default: all declared), V4.1 the whole
  DSpark draft (all declared stages: stage 0 projects the features and the last holds the heads, so a part of it
  is no draft). ConfigError when nothing is declared or the DSpark fields do not fit the backbone."""
  n = info.mtp_layers if stages is None else stages
  if not info.mtp_layers:
    raise ConfigError("the config declares no draft layers (num_nextn_predict_layers)")
  if cfg.variant == "v4":
    return dataclasses.replace(cfg, num_mtp_layers=n)
  if n != info.mtp_layers or info.dspark is None:
    raise ConfigError(f"num_nextn_predict_layers: a V4.1 DSpark draft loads whole ({info.mtp_layers} stages), "
                      f"not {n}")
  if any(info.draft_ratios):   # (a reduced num_hidden_layers keeps NeMo's full schedule: then these are backbone's)
    raise ConfigError(f"compress_ratios: the DSpark draft layers' entries are {list(info.draft_ratios)}; they are "
                      f"window-only (0)")
  return dataclasses.replace(cfg, num_mtp_layers=n, dspark=info.dspark)


def _parse(d: dict, name: str, strict: bool, where: str) -> tuple[ModelConfig, CheckpointInfo]:
  r = _Reader(d, where)
  mt = d.get("model_type")
  try:
    if mt == "deepseek_v41":
      tc = d.get("text_config") or {}
      return _v41_nemo(_Reader(tc, f"{where}: text_config"), r, name, strict)
    if mt == "deepseek_v41_text":
      return _v41_nemo(r, None, name, strict)
    if mt in ("deepseek_v4", None) and "dim" in d and "n_layers" in d:
      return _v4_inference(r, name, strict)
    if mt == "deepseek_v4":
      return _v4_transformers(r, name, strict)
  except ConfigError as e:
    if str(e).startswith(where):
      raise
    raise ConfigError(f"{where}: {e}") from e  # ModelConfig's own validation, with the file named
  raise ConfigError(f"{where}: field 'model_type' = {mt!r} is not a DeepSeek-V4 / V4.1 config (expected "
                    f"'deepseek_v4', 'deepseek_v41' or 'deepseek_v41_text', or inference ModelArgs keys dim/n_layers)")


def config_from_dict(d: dict, *, name: str = "checkpoint", strict: bool = True, where: str = CONFIG_FILE,
                     quantized_cache: bool | None = None) -> tuple[ModelConfig, CheckpointInfo]:
  """Parse one config.json object (any of the four formats) into (ModelConfig, CheckpointInfo).

  quantized_cache: the NeMo-style fake-quantized cache (ModelConfig.quantized_cache). None = the checkpoint's
  default: on for NeMo-format (V4.1) configs, since NeMo always quantize-dequantizes its cache and a NeMo
  checkpoint should reproduce NeMo; off otherwise. True on a V4 config is a ConfigError (V4.1-only)."""
  cfg, info = _parse(d, name, strict, where)
  q = info.format == "nemo" if quantized_cache is None else bool(quantized_cache)
  if q != cfg.quantized_cache:
    try:
      cfg = dataclasses.replace(cfg, quantized_cache=q)
    except ConfigError as e:
      raise ConfigError(f"{where}: {e}") from e
  return cfg, info


def config_path(path: str) -> str:
  """The config file of a checkpoint directory: config.json, else text_config.json (a NeMo Automodel export may
  hold only the text backbone's config); a file path is returned as is."""
  if not os.path.isdir(path):
    return path
  for fn in (CONFIG_FILE, TEXT_CONFIG_FILE):
    if os.path.isfile(os.path.join(path, fn)):
      return os.path.join(path, fn)
  return os.path.join(path, CONFIG_FILE)


def read_config(path: str, *, strict: bool = True, name: str | None = None,
                quantized_cache: bool | None = None) -> tuple[ModelConfig, CheckpointInfo]:
  """config.json (or a NeMo export's text_config.json) of a checkpoint directory, or the file itself ->
  (ModelConfig, CheckpointInfo). quantized_cache: see `config_from_dict` (None = the checkpoint's default)."""
  fp = config_path(path)
  if not os.path.isfile(fp):
    also = f" (nor {TEXT_CONFIG_FILE})" if os.path.isdir(path) else ""
    raise ConfigError(f"{fp}: no such config file{also}")
  try:
    with open(fp) as f:
      d = json.load(f)
  except (OSError, UnicodeDecodeError, ValueError) as e:
    raise ConfigError(f"{fp}: malformed JSON ({e})") from e
  if os.path.basename(fp) == TEXT_CONFIG_FILE and isinstance(d, dict) and "model_type" not in d:
    d = {"model_type": "deepseek_v41_text", **d}  # the file name says what it is: NeMo's V4.1 text config
  base = os.path.basename(os.path.dirname(os.path.abspath(fp))) or "checkpoint"
  return config_from_dict(d, name=name or base, strict=strict, where=fp, quantized_cache=quantized_cache)


def load_config(path: str, *, strict: bool = True, name: str | None = None,
                quantized_cache: bool | None = None) -> ModelConfig:
  return read_config(path, strict=strict, name=name, quantized_cache=quantized_cache)[0]


# ----------------------------------------------------------------------------------------------------------
# Writing (exports and tests): the inverse of the readers above.

_KIND_HF = {v: k for k, v in _HF_KIND.items()}


def _yarn_dict(y: YarnConfig) -> dict:
  if y.factor == 1.0:
    return {"rope_type": "default"}
  return {"rope_type": "yarn", "factor": y.factor,
          "original_max_position_embeddings": y.original_max_position_embeddings, "beta_fast": y.beta_fast,
          "beta_slow": y.beta_slow}


def _dspark_dict(cfg: ModelConfig) -> dict:
  """V4.1's draft fields: the DSpark stages when the config has them, else an explicit 0 (NeMo's default is 3)."""
  if not cfg.num_mtp_layers:
    return dict(num_nextn_predict_layers=0)
  ds = cfg.dspark
  return dict(num_nextn_predict_layers=cfg.num_mtp_layers, dspark_block_size=ds.block_size,
              dspark_noise_token_id=ds.noise_token_id, dspark_target_layer_ids=list(ds.target_layer_ids),
              dspark_markov_rank=ds.markov_rank, dspark_n_routed_experts=ds.n_routed_experts,
              dspark_num_experts_per_tok=ds.num_experts_per_tok)


def config_to_dict(cfg: ModelConfig, *, dtype: str = "bfloat16") -> dict:
  """A config.json object that `config_from_dict` reads back as `cfg`: V4 in transformers' DeepseekV4Config
  format, V4.1 as NeMo's DeepseekV41TextConfig ("deepseek_v41_text"). `dtype`: the stored weights' dtype, recorded
  as transformers does ("float32" / "bfloat16"). Raises ConfigError for what the format cannot say (a V4 schedule
  with two CSA or two HCA rates: transformers has one rate per kind; V4.1 quantized_cache, which NeMo implies)."""
  a, ix, mo, mhc = cfg.attention, cfg.indexer, cfg.moe, cfg.mhc
  common = dict(
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
      num_attention_heads=a.num_heads, num_key_value_heads=1, head_dim=a.head_dim, q_lora_rank=a.q_lora_rank,
      o_groups=a.o_groups, o_lora_rank=a.o_lora_rank, sliding_window=a.window, rope_theta=a.rope_theta,
      compress_rope_theta=a.compress_rope_theta, index_n_heads=ix.num_heads, index_head_dim=ix.head_dim,
      index_topk=ix.topk, n_routed_experts=mo.n_routed_experts, n_shared_experts=mo.n_shared_experts,
      num_experts_per_tok=mo.num_experts_per_tok, moe_intermediate_size=mo.intermediate_size,
      routed_scaling_factor=mo.routed_scaling_factor, swiglu_limit=mo.swiglu_limit, hc_mult=mhc.hc_mult,
      hc_sinkhorn_iters=mhc.sinkhorn_iters, hc_eps=mhc.eps, rms_norm_eps=cfg.rms_norm_eps,
      max_position_embeddings=cfg.max_position_embeddings, bos_token_id=cfg.bos_token_id,
      eos_token_id=cfg.eos_token_id, scoring_func="sqrtsoftplus", norm_topk_prob=True, hidden_act="silu",
      tie_word_embeddings=False, attention_bias=False, dtype=dtype)
  if cfg.variant == "v41":
    if cfg.quantized_cache:
      raise ConfigError("quantized_cache: a NeMo V4.1 config always implies the quantized cache; it is not written")
    e = cfg.engram
    return dict(
        model_type="deepseek_v41_text", architectures=["DeepseekV41ForCausalLM"], **common,
        qk_rope_head_dim=a.rope_head_dim, rope_scaling=_yarn_dict(a.yarn),
        compress_ratios=list(cfg.compress_ratios) + [0] * cfg.num_mtp_layers,   # NeMo lists the draft layers too
        kv_source_layer_ids=list(cfg.kv_source_layer_ids), index_source_layer_ids=list(cfg.index_source_layer_ids),
        candidate_source_layer_id=cfg.candidate_source_layer_id, candidate_block_size=ix.candidate_block_size,
        candidate_topk_blocks=ix.candidate_topk_blocks, engram_layer_ids=list(e.layer_ids),
        engram_num_embeddings=list(e.num_embeddings), engram_max_ngram_size=e.max_ngram_size,
        engram_vocab_size=e.vocab_size, engram_n_heads=e.n_heads, engram_head_dim=e.head_dim,
        engram_pad_token_id=e.pad_token_id, engram_compressed_vocab_size=e.compressed_vocab_size,
        **_dspark_dict(cfg))
  plans = cfg.layer_plan()
  rates: dict[str, int] = {}
  for p in plans:
    if p.kind != "swa":
      t = _KIND_HF[p.kind]
      if rates.setdefault(t, p.ratio) != p.ratio:
        raise ConfigError(f"compress_ratios: {p.kind} layers with rates {rates[t]} and {p.ratio}; transformers' "
                          f"config has one rate per layer kind")
  rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **rates}
  prf = a.rope_head_dim / a.head_dim
  return dict(
      model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], **common,
      partial_rotary_factor=prf, qk_rope_head_dim=a.rope_head_dim, layer_types=[_KIND_HF[p.kind] for p in plans],
      compress_rates=rates, mlp_layer_types=["hash_moe" if p.hash_moe else "moe" for p in plans],
      rope_parameters={"main": {"rope_type": "default", "rope_theta": a.rope_theta, "partial_rotary_factor": prf},
                       "compress": {**_yarn_dict(a.yarn), "rope_theta": a.compress_rope_theta,
                                    "partial_rotary_factor": prf}},
      mlp_bias=False, num_nextn_predict_layers=cfg.num_mtp_layers)

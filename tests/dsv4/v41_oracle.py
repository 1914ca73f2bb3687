"""NeMo Automodel 0.7.0 `deepseek_v41` as a CPU oracle (docs/references.md, V4.1).

    python tests/dsv4/v41_oracle.py        # fetch the wheel into .oracle/ (what CI runs before pytest)

The wheel is pure Python; it is *not* pip-installed (that would pull CUDA packages and downgrade transformers):
`pip download --no-deps nemo-automodel==0.7.0` into `<repo>/.oracle/`, unzip, and put the directory on sys.path.
Only `pillow` is needed on top of the test dependencies (the model module imports it).

Fake quantization: the reference applies quantize-dequantize to the window KV (fp8), compressed KV (nvfp4), index
queries and keys (mxfp4). The JAX model computes in plain fp32, so `build()` switches these boundaries off by
replacing `attention.quantize_cache` with the identity (BUILD_NOTES.md, Model). The model is cast to fp32 with
`.float()` (its dtype helper otherwise leaves most tensors bf16).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORACLE_DIR = os.path.join(REPO, ".oracle")
WHEEL = "nemo-automodel==0.7.0"


def ensure_nemo() -> str | None:
  """Directory holding the unzipped wheel (downloading it if needed), or None if it cannot be obtained."""
  os.makedirs(ORACLE_DIR, exist_ok=True)
  gi = os.path.join(ORACLE_DIR, ".gitignore")
  if not os.path.exists(gi):
    with open(gi, "w") as f:
      f.write("*\n")
  target = os.path.join(ORACLE_DIR, "nemo")
  if os.path.exists(os.path.join(target, "nemo_automodel", "components", "models", "deepseek_v41", "model.py")):
    return target
  wheels = glob.glob(os.path.join(ORACLE_DIR, "nemo_automodel-0.7.0-*.whl"))
  if not wheels:
    try:
      subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", ORACLE_DIR, WHEEL],
                     check=True, timeout=600)
    except Exception:  # noqa: BLE001 - no network / no pip: the caller skips with a message
      return None
    wheels = glob.glob(os.path.join(ORACLE_DIR, "nemo_automodel-0.7.0-*.whl"))
    if not wheels:
      return None
  with zipfile.ZipFile(wheels[0]) as z:
    z.extractall(target)
  return target


# ----------------------------------------------------------------------------------------------------------
# Tiny config shared by the JAX side (dsv4.config.v41_tiny) and the reference.

def nemo_text_kwargs(cfg) -> dict:
  a, ix, mo, e = cfg.attention, cfg.indexer, cfg.moe, cfg.engram
  y = a.yarn
  return dict(
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, moe_intermediate_size=mo.intermediate_size,
      num_hidden_layers=cfg.num_layers, num_attention_heads=a.num_heads, head_dim=a.head_dim,
      qk_rope_head_dim=a.rope_head_dim, q_lora_rank=a.q_lora_rank, o_lora_rank=a.o_lora_rank, o_groups=a.o_groups,
      swiglu_limit=mo.swiglu_limit, rms_norm_eps=cfg.rms_norm_eps, rope_theta=a.rope_theta,
      rope_scaling={"type": "yarn", "factor": y.factor, "original_max_position_embeddings":
                    y.original_max_position_embeddings, "beta_fast": y.beta_fast, "beta_slow": y.beta_slow},
      n_routed_experts=mo.n_routed_experts, n_shared_experts=mo.n_shared_experts,
      num_experts_per_tok=mo.num_experts_per_tok, routed_scaling_factor=mo.routed_scaling_factor,
      sliding_window=a.window, compress_ratios=list(cfg.compress_ratios) + [0] * cfg.num_mtp_layers,
      compress_rope_theta=a.compress_rope_theta,
      kv_source_layer_ids=list(cfg.kv_source_layer_ids), index_source_layer_ids=list(cfg.index_source_layer_ids),
      index_n_heads=ix.num_heads, index_head_dim=ix.head_dim, index_topk=ix.topk,
      candidate_source_layer_id=cfg.candidate_source_layer_id, candidate_topk_blocks=ix.candidate_topk_blocks,
      candidate_block_size=ix.candidate_block_size, hc_mult=cfg.mhc.hc_mult, hc_sinkhorn_iters=cfg.mhc.sinkhorn_iters,
      hc_eps=cfg.mhc.eps, engram_layer_ids=list(e.layer_ids), engram_num_embeddings=list(e.num_embeddings),
      engram_max_ngram_size=e.max_ngram_size, engram_vocab_size=e.vocab_size, engram_n_heads=e.n_heads,
      engram_head_dim=e.head_dim, engram_pad_token_id=e.pad_token_id,
      engram_compressed_vocab_size=e.compressed_vocab_size, dtype="float32", **_dspark_kwargs(cfg))


def _dspark_kwargs(cfg) -> dict:
  """The DSpark fields (`nemo_text_kwargs` also lists the draft layers in NeMo's schedule: ratio 0 each)."""
  if not cfg.num_mtp_layers:
    return dict(num_nextn_predict_layers=0, dspark_noise_token_id=0)
  ds = cfg.dspark
  return dict(num_nextn_predict_layers=cfg.num_mtp_layers, dspark_block_size=ds.block_size,
              dspark_noise_token_id=ds.noise_token_id, dspark_target_layer_ids=list(ds.target_layer_ids),
              dspark_markov_rank=ds.markov_rank, dspark_n_routed_experts=ds.n_routed_experts,
              dspark_num_experts_per_tok=ds.num_experts_per_tok)


def tiny_tokenizer(vocab_size: int):
  """A word-level fast tokenizer whose Engram normalisation merges case / accent variants (so the compressed
  vocabulary is smaller than the raw one and the token map is not the identity)."""
  from tokenizers import Tokenizer, models
  from transformers import PreTrainedTokenizerFast
  letters = "abcdefghijklmnopqrstuvwxyz"
  words = ["<s>", "</s>", "<pad>", " ", "\n"]
  i = 0
  while len(words) < vocab_size:
    w = letters[i % 26] * (1 + i // 52)
    words.append(w if (i // 26) % 2 == 0 else w.upper())
    i += 1
  vocab = {w: j for j, w in enumerate(words[:vocab_size])}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
  return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def build(cfg, seed: int = 0, *, fake_quant: bool = False):
  """(model, tokenizer): the fp32 NeMo reference for `cfg` with random weights (constants randomised too)."""
  path = ensure_nemo()
  if path is None:
    raise RuntimeError("nemo-automodel 0.7.0 wheel unavailable")
  if path not in sys.path:
    sys.path.insert(0, path)
  import torch
  from nemo_automodel.components.models.common import BackendConfig
  from nemo_automodel.components.models.deepseek_v41 import attention
  from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
  from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
  if not fake_quant:
    attention.quantize_cache = lambda values, **kw: values
  torch.manual_seed(seed)
  text = nemo_text_kwargs(cfg)
  tokenizer = tiny_tokenizer(cfg.vocab_size) if cfg.engram.layer_ids else None
  if tokenizer is not None:
    from nemo_automodel.components.models.deepseek_v41.engram import _compressed_token_map
    _, n = _compressed_token_map(tokenizer)
    assert n == cfg.engram.compressed_vocab_size, (n, cfg.engram.compressed_vocab_size)
  config = DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0})
  backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch",
                          dispatcher="torch", enable_hf_state_dict_adapter=False, rope_fusion=False)
  model = DeepseekV41ForCausalLM(config, backend=backend, tokenizer=tokenizer).float().eval()
  _randomize(model, torch.Generator().manual_seed(seed + 1))
  return model, tokenizer


def _randomize(model, g, skip=()):
  """Random weights around each parameter's init (constants randomised too), as `build` does."""
  import torch
  with torch.no_grad():
    for name, p in model.named_parameters():
      if not p.dtype.is_floating_point or name.startswith(skip):
        continue
      if p.ndim >= 2:
        p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5))
      else:  # norms, sinks, hc base/scale, biases: perturb around their init
        base = 1.0 if name.endswith(("norm.weight", "scale")) else 0.0
        p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():
      if name.endswith(("e_score_correction_bias", "bias_vl")):
        b.copy_(0.1 * torch.randn(b.shape, generator=g))


def build_dspark(cfg, target, seed: int = 0, *, num_anchors: int = 1):
  """NeMo's V4.1 DSpark draft (`DeepseekV41DSparkModel`: the `mtp` stages plus a frozen copy of the target's
  embedding and LM head) for `cfg` (num_mtp_layers stages, `cfg.dspark`), fp32, random weights. Its attention
  FP8-rounds the KV whatever `build` did to the backbone's (dspark.py imports `quantize_cache` itself)."""
  import torch
  from nemo_automodel.components.models.common import BackendConfig
  from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig
  from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel
  text = DeepseekV41TextConfig(**nemo_text_kwargs(cfg))
  backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch",
                          dispatcher="torch", enable_hf_state_dict_adapter=False, rope_fusion=False)
  torch.manual_seed(seed)
  draft = DeepseekV41DSparkModel(text, backend, num_anchors=num_anchors, enable_confidence_head=True).float().eval()
  _randomize(draft, torch.Generator().manual_seed(seed + 1), skip=("embed_tokens.", "lm_head."))
  draft.initialize_embeddings_and_head(embed_tokens=target.model.embed_tokens, lm_head=target.lm_head)
  return draft


def state_dict_np(model) -> dict:
  import torch
  out = {}
  for k, v in model.state_dict().items():
    if v.dtype.is_floating_point:
      out[k] = v.detach().to(torch.float32).numpy().copy()
    else:
      out[k] = v.detach().numpy().copy()
  return out


def logits(model, tokens_BxT):
  import torch
  with torch.no_grad():
    return model(torch.as_tensor(tokens_BxT, dtype=torch.long)).logits.float().numpy()


if __name__ == "__main__":
  p = ensure_nemo()
  print(p if p else "nemo-automodel 0.7.0 wheel unavailable")
  sys.exit(0 if p else 1)

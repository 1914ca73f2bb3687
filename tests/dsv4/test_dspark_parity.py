"""V4.1 DSpark draft parity with NeMo Automodel 0.7.0 `deepseek_v41/dspark.py` on CPU (docs/references.md, V4.1).

A tiny V4.1 target (no Engram) with a three-stage DSpark draft, fp32, random weights: NeMo's target
(`DeepseekV41ForCausalLM`) and draft (`DeepseekV41DSparkModel`) are built by tests/dsv4/v41_oracle.py, their state
dicts (backbone NeMo names, draft in NeMo's native `mtp.K.*` names) go through one safetensors file and the
project's loader. Compared:

* on identical given features (random, unit scale) and chosen anchors (no, partial and full window context),
  NeMo's backbone forward (noise embeddings, positions and mask from its own `create_noise_embed`,
  `build_position_ids`, `build_attention_mask`) against `dsv4.dspark`: the final-normed hidden states, the Markov
  transition logits, the full draft logits (`compute_logits(normalized) + transition` against `train_logits` and
  `draft_logits`) and the confidence logits. NeMo's DSpark attention always FP8-rounds its KV (block 32), so the JAX
  side runs with `quantized_cache=True` (measured without it: rel err 0.4; with it about 1e-6);
* the released / NeMo names and the quantized layout against NeMo's `DeepseekV41DSparkStateDictAdapter`;
* slow tier: the target features (the mean over mHC streams of each target layer's input after Engram, NeMo's
  `get_dspark_target_feature_modules` hooks + `_collapse_hc_streams`) against `forward_ragged_aux(dspark_taps=True)`
  on `v41_tiny` with Engram on two of the target layers; the backbone runs without cache quantization on both sides
  (`v41_oracle.build` switches NeMo's off).
"""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import caches, config, dspark, model
from dsv4.config import DSparkConfig
from dsv4.loading import safetensors_file
from dsv4.loading.safetensors_io import load_checkpoint

sys.path.insert(0, os.path.dirname(__file__))
import v41_oracle  # noqa: E402

CFG = dataclasses.replace(
    config.v41_tiny(engram=False), num_mtp_layers=3, quantized_cache=True,
    dspark=DSparkConfig(block_size=5, target_layer_ids=(5, 6, 7), markov_rank=8, noise_token_id=3, n_routed_experts=4,
                        num_experts_per_tok=2))
B, S = 2, 40
# anchor 0 (no context: own block + sink only), inside the first window (partial context), past it (full window of
# 16), and the last anchor with a full block of labels (anchor + block < S)
ANCHORS = np.array([[0, 9, 22], [5, 17, 34]])


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
  if v41_oracle.ensure_nemo() is None:
    pytest.skip("nemo-automodel 0.7.0 wheel could not be downloaded (pip download --no-deps nemo-automodel==0.7.0)")
  ref, _ = v41_oracle.build(CFG, seed=0)
  draft = v41_oracle.build_dspark(CFG, ref, seed=11)
  tensors = v41_oracle.state_dict_np(ref)
  tensors.update({k: v for k, v in v41_oracle.state_dict_np(draft).items() if k.startswith("mtp.")})
  path = str(tmp_path_factory.mktemp("nemo_dspark") / "model.safetensors")
  safetensors_file.write_file(tensors, path)
  params = load_checkpoint(path, CFG)
  tokens = np.random.default_rng(5).integers(0, CFG.vocab_size, (B, S))
  return ref, draft, params, tokens


def _nemo_features(ref, tokens, layer_ids=CFG.dspark.target_layer_ids):
  """NeMo's DSpark target features [B, S, L * D]: the attention hyper-connection's input of each target layer,
  averaged over streams (`HFDSparkTargetModel._collapse_hc_streams`)."""
  import torch
  captured = {}
  mods = ref.get_dspark_target_feature_modules(list(layer_ids))
  hooks = [m.register_forward_pre_hook(lambda m, args, i=i: captured.__setitem__(i, args[0].detach().clone()))
           for i, m in enumerate(mods)]
  try:
    with torch.no_grad():
      ref(torch.as_tensor(tokens, dtype=torch.long))
  finally:
    for h in hooks:
      h.remove()
  return torch.cat([captured[i].mean(dim=2) for i in range(len(mods))], dim=-1).float().numpy()


def _jax_features(params, cfg, tokens):
  b, s = tokens.shape
  cache, swa, full = caches.init_contiguous(cfg, b, s)
  idx = caches.BatchIndex(jnp.zeros(b, jnp.int32), jnp.full((b,), s, jnp.int32), jnp.asarray(swa), jnp.asarray(full))
  step = caches.step_index_from_batch(idx, s)

  def run(p, t):
    _, _, auxes = model.forward_ragged_aux(p, cfg, t.reshape(b * s), cache, step, dspark_taps=True)
    assert all(("stream_mean" in a) == (i in cfg.dspark.target_layer_ids) for i, a in enumerate(auxes))
    return dspark.features([auxes[i]["stream_mean"] for i in cfg.dspark.target_layer_ids])

  return np.asarray(jax.jit(run)(params, jnp.asarray(tokens))).reshape(b, s, -1)


@pytest.mark.slow   # a second NeMo target and the 8-layer backbone's compile: ~40 s on 2 cores
def test_target_features_match_nemo(tmp_path):
  """The features after Engram: v41_tiny has Engram on layers 1 and 5, both among the target layers here (plus the
  last layer, 7). Both backbones run without cache quantization (`v41_oracle.build` switches NeMo's off)."""
  from dsv4.layers import engram
  if v41_oracle.ensure_nemo() is None:
    pytest.skip("nemo-automodel 0.7.0 wheel could not be downloaded (pip download --no-deps nemo-automodel==0.7.0)")
  cfg = dataclasses.replace(config.v41_tiny(), dspark=dataclasses.replace(CFG.dspark, target_layer_ids=(1, 5, 7)))
  assert set(cfg.engram.layer_ids) <= set(cfg.dspark.target_layer_ids)
  ref, tokenizer = v41_oracle.build(cfg, seed=3)
  path = str(tmp_path / "model.safetensors")
  safetensors_file.write_file(v41_oracle.state_dict_np(ref), path)
  params = load_checkpoint(path, cfg)
  params["engram_token_map"] = jnp.asarray(engram.compressed_token_map(tokenizer)[0])
  tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (B, S))
  want, got = _nemo_features(ref, tokens, cfg.dspark.target_layer_ids), _jax_features(params, cfg, tokens)
  assert want.shape == (B, S, 3 * cfg.hidden_size)
  err = np.max(np.abs(got - want)) / np.max(np.abs(want))
  print(f"\nDSpark features (after Engram): max rel err {err:.2e}")
  assert err <= 2e-5   # measured 2.9e-6 without Engram


def _nemo_draft(draft, tokens, feats):
  """NeMo's backbone forward at ANCHORS, assembled like `DeepseekV41DSparkModel.forward` with its own helpers."""
  import torch
  from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkBackbone
  from nemo_automodel.components.speculative.dspark.common import create_noise_embed
  ds = CFG.dspark
  ids, anchors = torch.as_tensor(tokens, dtype=torch.long), torch.as_tensor(ANCHORS, dtype=torch.long)
  keep = torch.ones(anchors.shape, dtype=torch.bool)
  labels = anchors.unsqueeze(-1) + torch.arange(1, ds.block_size + 1).view(1, 1, -1)
  target_ids = torch.gather(ids.unsqueeze(1).expand(-1, anchors.shape[1], -1), 2, labels)
  prev = torch.cat((torch.gather(ids, 1, anchors).unsqueeze(-1), target_ids[:, :, :-1]), dim=-1).reshape(B, -1)
  with torch.no_grad():
    noise = create_noise_embed(draft.embed_tokens, ids, anchors, keep, mask_token_id=ds.noise_token_id,
                               block_size=ds.block_size)
    out = DeepseekV41DSparkBackbone.forward(
        draft, noise, torch.as_tensor(feats), position_ids=draft.build_position_ids(anchors, S),
        attention_mask=draft.build_attention_mask(anchors, keep, S, noise.dtype), previous_token_ids=prev)
    logits = draft.compute_logits(out.normalized_hidden_states) + out.transition_logits.float()
  shape = (B, anchors.shape[1], ds.block_size)
  return dict(hidden=out.normalized_hidden_states.numpy().reshape(*shape, -1),
              transition=out.transition_logits.numpy().reshape(*shape, -1),
              logits=logits.numpy().reshape(*shape, -1), confidence=out.confidence_pred.numpy().reshape(shape),
              prev=prev.numpy().reshape(shape))


# CPU compile without LLVM's expensive passes: about half the compile time of this one-off program (same fp32 math)
_QUICK_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _jax_draft(params, tokens, feats, prev):
  """dsv4.dspark on the same inputs: `train_logits` for the logits, its steps spelled out for the hidden states."""
  A, W = ANCHORS.shape[1], CFG.attention.window
  anchors = jnp.asarray(ANCHORS)

  def run(p, t, f, prev_):
    kvs = dspark.context_kv(p, CFG, f.reshape(B * S, -1), jnp.tile(jnp.arange(S), B))
    cpos = anchors[..., None] - W + jnp.arange(W)
    take = lambda kv: jnp.take_along_axis(kv.reshape(B, S, 1, -1), jnp.clip(cpos, 0, S - 1).reshape(B, A * W, 1, 1),
                                          axis=1).reshape(B * A, W, -1)
    anchor_tok = jnp.take_along_axis(t, anchors, axis=1).reshape(B * A)
    h = dspark.draft_hidden(p, CFG, [take(kv) for kv in kvs], (cpos >= 0).reshape(B * A, W), anchor_tok,
                            anchors.reshape(B * A)).reshape(B, A, CFG.dspark.block_size, -1)
    return dict(hidden=h, transition=dspark.markov(p, prev_)[0], confidence=dspark.confidence(p, h, prev_),
                logits=dspark.train_logits(p, CFG, t, f, anchors),
                slot_logits=dspark.draft_logits(p, h, prev_))

  args = (params, jnp.asarray(tokens), jnp.asarray(feats), jnp.asarray(prev))
  out = jax.jit(run).lower(*args).compile(_QUICK_COMPILE)(*args)
  return {k: np.asarray(v) for k, v in out.items()}


def _rel(got, want):
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def test_draft_matches_nemo_on_given_features(oracle):
  _, draft, params, tokens = oracle
  # given features (the target's own are compared in the slow test): unit-scale like the residual streams
  feats = np.random.default_rng(6).standard_normal((B, S, len(CFG.dspark.target_layer_ids) * CFG.hidden_size))
  feats = feats.astype(np.float32)
  want = _nemo_draft(draft, tokens, feats)
  got = _jax_draft(params, tokens, feats, want["prev"])
  errs = {k: _rel(got[k], want[k]) for k in ("hidden", "transition", "logits", "confidence")}
  errs["slot_logits"] = _rel(got["slot_logits"], want["logits"])
  print("\nDSpark draft vs NeMo, max rel err: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
  assert errs["transition"] <= 1e-6   # one rank-8 matmul (measured 0)
  for k in ("hidden", "logits", "slot_logits", "confidence"):
    assert errs[k] <= 1e-5, (k, errs)   # measured 0.8e-6 .. 1.1e-6
  # the argmax drafts agree where the reference's top-2 margin is not a near-tie
  top2 = np.sort(want["logits"], axis=-1)[..., -2:]
  clear = (top2[..., 1] - top2[..., 0]) > 1e-3 * np.max(np.abs(want["logits"]))
  np.testing.assert_array_equal(np.argmax(got["logits"], -1)[clear], np.argmax(want["logits"], -1)[clear])


def test_released_names_match_nemos_draft_adapter(oracle):
  """The loader's original (released) spelling of the draft is exactly what NeMo's
  `DeepseekV41DSparkStateDictAdapter` exports from its native draft (names, shapes, values), its NeMo spelling is
  what the adapter imports from the released names, and the writers' FP8 / FP4 tensors have the shapes and dtypes
  of the adapter's quantized load targets (the released on-disk layout)."""
  import ml_dtypes
  import torch
  from dsv4.loading import names, safetensors_write
  from dsv4.loading.safetensors_write import Quant
  _, draft, params, _ = oracle
  adapter = draft.state_dict_adapter
  np_params = jax.tree_util.tree_map(np.asarray, params)
  ours = {k: v for k, v in names.params_to_original(np_params, CFG).items() if k.startswith("mtp.")}
  native = {k: v for k, v in draft.state_dict().items() if k.startswith("mtp.")}
  released = {k: v.numpy() for k, v in adapter.to_hf(dict(native)).items()}
  assert sorted(released) == sorted(ours)
  for k, v in ours.items():
    np.testing.assert_array_equal(released[k], v, err_msg=k)
  imported = adapter.from_hf({k: torch.as_tensor(v) for k, v in ours.items()})
  nemo = {k: v for k, v in names.original_to_nemo(names.params_to_original(np_params, CFG), CFG).items()
          if k.startswith("mtp.")}
  assert sorted(imported) == sorted(nemo) == sorted(native)
  for k, v in nemo.items():
    np.testing.assert_array_equal(imported[k].numpy(), v, err_msg=k)
  targets = adapter.to_hf(dict(native), quantization=True, for_checkpoint_load=True)
  written = safetensors_write._quantize_dict(ours, CFG, Quant(fp8_block=32), "original")
  dt = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn, torch.int8: np.int8,
        torch.float8_e8m0fnu: ml_dtypes.float8_e8m0fnu, torch.float32: np.float32}
  assert sorted(targets) == sorted(written)
  for k, v in targets.items():
    assert (tuple(v.shape), dt[v.dtype]) == (written[k].shape, written[k].dtype), k


def test_nemo_config_declares_the_same_draft(oracle):
  """NeMo's own V4.1 config for this model (`DeepseekV41Config(...).to_dict()`, DSpark fields included) reads back
  as the backbone plus a declared draft that `with_draft` turns into exactly CFG."""
  import json
  from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
  from dsv4.loading.config_json import with_draft
  from dsv4.loading.config_json import config_from_dict
  nested = json.loads(json.dumps(DeepseekV41Config(text_config=v41_oracle.nemo_text_kwargs(CFG)).to_dict()))
  cfg, info = config_from_dict(nested)
  assert cfg.num_mtp_layers == 0 and info.mtp_layers == 3 and info.dspark == CFG.dspark
  assert with_draft(cfg, info) == dataclasses.replace(CFG, name=cfg.name)

"""MTP blocks (V4 `num_nextn_predict_layers`, `mtp.D.*`): the functional block against NeMo Automodel 0.7.0's
`deepseek_v4` MTP (random weights written in the original checkpoint naming by NeMo's own state-dict adapter and
read back by the project's loader), the NNX module against the function, chunked against whole-sequence runs (the
block's own window KV in the cache), and the loader's naming rules (NeMo's names are its model's state_dict; the
HF writers' layer N + K form reads through NeMo's adapter like the original names)."""

import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import caches, model, nnx_model
from dsv4.config import ConfigError, v4_tiny, v41_tiny
from dsv4.loading import safetensors_file, safetensors_write
from dsv4.loading.names import nemo_specs
from dsv4.loading.safetensors_io import load_checkpoint

sys.path.insert(0, os.path.dirname(__file__))
import v41_oracle  # noqa: E402

CFG = dataclasses.replace(v4_tiny(num_layers=2), num_mtp_layers=1)     # window + CSA backbone: short compiles


@functools.partial(jax.jit, static_argnames=("cfg",))
def _step(params, cfg, toks_BxT, nxt_BxT, cache, start):
  B, T = toks_BxT.shape
  swa, full = caches.contiguous_tables(B, 64, caches.CacheLayout())
  idx = caches.BatchIndex(jnp.full(B, start, jnp.int32), jnp.full((B,), T, jnp.int32), jnp.asarray(swa),
                          jnp.asarray(full))
  step = caches.step_index_from_batch(idx, T)
  cache, h, _, X = model.forward_ragged_aux(params, cfg, toks_BxT.reshape(-1), cache, step, return_stream=True)
  cache, _, hm = model.mtp_forward(params, cfg, 0, X, nxt_BxT.reshape(-1), cache, step)
  return cache, X, model.lm_logits(params, h).reshape(B, T, -1), model.lm_logits(params, hm).reshape(B, T, -1)


def _run(params, cfg, toks_BxT, nxt_BxT, cache, start):
  """Backbone then MTP block 0 over one chunk per row starting at `start`: (cache, backbone logits, MTP logits)."""
  cache, _, b, m = _step(params, cfg, jnp.asarray(toks_BxT), jnp.asarray(nxt_BxT), cache, jnp.int32(start))
  return cache, np.asarray(b), np.asarray(m)


def _next(toks):
  return np.concatenate([toks[:, 1:], np.zeros((toks.shape[0], 1), toks.dtype)], 1)


@pytest.fixture(scope="module")
def nemo(tmp_path_factory):
  where = v41_oracle.ensure_nemo()
  if where is None:
    pytest.skip("nemo-automodel 0.7.0 wheel could not be downloaded (pip download --no-deps nemo-automodel==0.7.0)")
  if where not in sys.path:
    sys.path.insert(0, where)
  import torch
  from nemo_automodel.components.models.common import BackendConfig
  from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config
  from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM
  from nemo_automodel.components.models.deepseek_v4.state_dict_adapter import DeepSeekV4StateDictAdapter
  a, ix, mo, y = CFG.attention, CFG.indexer, CFG.moe, CFG.attention.yarn
  config = DeepseekV4Config(
      vocab_size=CFG.vocab_size, hidden_size=CFG.hidden_size, moe_intermediate_size=mo.intermediate_size,
      num_hidden_layers=CFG.num_layers, num_attention_heads=a.num_heads, head_dim=a.head_dim,
      qk_rope_head_dim=a.rope_head_dim, q_lora_rank=a.q_lora_rank, o_lora_rank=a.o_lora_rank, o_groups=a.o_groups,
      n_routed_experts=mo.n_routed_experts, n_shared_experts=mo.n_shared_experts,
      num_experts_per_tok=mo.num_experts_per_tok, routed_scaling_factor=mo.routed_scaling_factor,
      swiglu_limit=mo.swiglu_limit, rope_theta=a.rope_theta,
      rope_scaling={"type": "yarn", "factor": y.factor, "original_max_position_embeddings":
                    y.original_max_position_embeddings, "beta_fast": y.beta_fast, "beta_slow": y.beta_slow},
      compress_rope_theta=a.compress_rope_theta, compress_ratios=list(CFG.compress_ratios), sliding_window=a.window,
      num_hash_layers=mo.num_hash_layers, hc_mult=CFG.mhc.hc_mult, hc_sinkhorn_iters=CFG.mhc.sinkhorn_iters,
      hc_eps=CFG.mhc.eps, index_head_dim=ix.head_dim, index_n_heads=ix.num_heads, index_topk=ix.topk,
      num_nextn_predict_layers=CFG.num_mtp_layers, rms_norm_eps=CFG.rms_norm_eps, dtype="float32")
  backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch",
                          enable_hf_state_dict_adapter=False, rope_fusion=False)
  torch.manual_seed(0)
  ref = DeepseekV4ForCausalLM(config, backend=backend).float().eval()
  g = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for name, p in ref.named_parameters():
      if p.dtype.is_floating_point:
        base = 1.0 if name.endswith(("norm.weight", "scale")) else 0.0
        p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 if p.ndim >= 2
                else base + 0.1 * torch.randn(p.shape, generator=g))
    for name, b in ref.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(0.1 * torch.randn(b.shape, generator=g))
  original = DeepSeekV4StateDictAdapter(config, ref.model.moe_config, backend).to_hf(ref.state_dict())
  assert "mtp.0.e_proj.weight" in original and "mtp.0.hc_head_fn" in original
  path = str(tmp_path_factory.mktemp("nemo_v4_mtp") / "model.safetensors")
  safetensors_file.write_file({k: v.detach().numpy().copy() for k, v in original.items()}, path)
  return ref, path, DeepSeekV4StateDictAdapter(config, ref.model.moe_config, backend)


def test_mtp_logits_match_nemo(nemo):
  """The same backbone stream into both MTP blocks (NeMo's training-time path: embedding of the token at t + 1,
  window causal mask); positions whose next token exists are compared. The backbone is compared too."""
  import torch
  from nemo_automodel.components.models.deepseek_v4.model import build_causal_padding_mask
  ref, path, _ = nemo
  params = load_checkpoint(path, CFG)
  B, T = 2, 36
  toks = np.random.default_rng(3).integers(0, CFG.vocab_size, (B, T))
  _, X, backbone, got = _step(params, CFG, jnp.asarray(toks), jnp.asarray(_next(toks)),
                              caches.init_contiguous(CFG, B, 64)[0], jnp.int32(0))
  backbone, got = np.asarray(backbone), np.asarray(got)
  with torch.no_grad():
    mask = build_causal_padding_mask(None, seq_len=T, dtype=torch.float32, device="cpu", batch_size=B,
                                     sliding_window=CFG.attention.window)
    hd = ref.mtp(hidden_states=torch.as_tensor(np.array(X).reshape(B, T, CFG.mhc.hc_mult, -1)),
                 input_ids=torch.as_tensor(toks), embed_fn=ref.model.embed_tokens,
                 position_ids=torch.arange(T).unsqueeze(0).expand(B, -1), attention_mask=mask)
    want = ref.lm_head(hd[0]).float().numpy()
    want_backbone = ref(torch.as_tensor(toks)).logits.float().numpy()
  err_backbone = np.max(np.abs(backbone - want_backbone)) / np.max(np.abs(want_backbone))
  err = np.max(np.abs(got[:, :-1] - want[:, :-1])) / np.max(np.abs(want))
  print(f"\nMTP parity with NeMo deepseek_v4: max rel err backbone {err_backbone:.1e}, MTP block {err:.1e}")
  assert err_backbone <= 1e-5 and err <= 1e-5, (err_backbone, err)


def test_nemo_naming_is_nemos_state_dict(nemo, tmp_path):
  """The "nemo" naming of a V4 model with MTP is NeMo's `deepseek_v4` model state_dict: the same names and shapes
  (backbone and `mtp.layers.0.*`), and NeMo's own tensors saved under them load to what its adapter's original
  names give."""
  ref, path, _ = nemo
  sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
  specs = nemo_specs(CFG)
  assert {k: v.shape for k, v in sd.items()} == {k: s.shape for k, s in specs.items()}
  assert any(k.startswith("mtp.layers.0.mlp.experts.") for k in specs)
  assert all(s.integer == np.issubdtype(sd[k].dtype, np.integer) for k, s in specs.items())
  safetensors_file.write_file(sd, str(tmp_path / "model.safetensors"))
  got, want = load_checkpoint(str(tmp_path), CFG, as_jax=False), load_checkpoint(path, CFG, as_jax=False)
  for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(x, y)


def _torch(x):
  import ml_dtypes
  import torch
  for np_dt, t_dt in ((ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn), (ml_dtypes.float8_e8m0fnu, torch.float8_e8m0fnu)):
    if x.dtype == np_dt:
      return torch.from_numpy(np.ascontiguousarray(x).view(np.uint8)).view(t_dt)
  return torch.from_numpy(np.ascontiguousarray(x))


@pytest.mark.parametrize("quant", [None, safetensors_write.Quant(fp8_block=128)], ids=["plain", "fp8_fp4"])
def test_hf_layer_form_reads_through_nemos_adapter(nemo, tmp_path, quant):
  """What the HF writers store for the block (layer N + K in DeepSeek's spelling, `.scale` companions) goes through
  NeMo's `from_hf` to the same `mtp.layers.0.*` tensors as the original names, after NeMo's own dequantization and
  expert stacking."""
  _, path, adapter = nemo
  params = load_checkpoint(path, CFG, as_jax=False)
  out = {}
  for naming in ("original", "hf"):
    safetensors_write.save_checkpoint(params, CFG, str(tmp_path / naming), naming=naming, quant=quant)
    entries = safetensors_file.read_entries(str(tmp_path / naming))
    t = {k: _torch(safetensors_file.read_tensor(e)) for k, e in entries.items()}
    out[naming] = {k: v for k, v in adapter.from_hf(t).items() if k.startswith("mtp.")}
  assert "model.layers.2.attn.wq_a.weight" in t and "layers.2.e_proj.weight" in t
  assert sorted(out["hf"]) == sorted(out["original"]) and "mtp.layers.0.mlp.experts.gate_and_up_projs" in out["hf"]
  for k, v in out["original"].items():
    np.testing.assert_array_equal(out["hf"][k].numpy(), v.numpy(), err_msg=k)


def test_chunked_and_nnx_equal_the_whole_sequence():
  """Prefill in two chunks (the MTP block reads its own window KV of the first chunk back from the cache) gives
  the whole run's MTP logits; the NNX module gives the function's, bit for bit."""
  params = model.init_params(CFG, jax.random.PRNGKey(0))
  B, T, cut = 2, 36, 18
  toks = np.random.default_rng(5).integers(0, CFG.vocab_size, (B, T + 1))
  nxt, toks = toks[:, 1:], toks[:, :T]
  cache, _, _ = caches.init_contiguous(CFG, B, 64)
  _, whole_b, whole_m = _run(params, CFG, toks, nxt, cache, 0)
  cache, _, _ = caches.init_contiguous(CFG, B, 64)
  cache, b1, m1 = _run(params, CFG, toks[:, :cut], nxt[:, :cut], cache, 0)
  cache, b2, m2 = _run(params, CFG, toks[:, cut:], nxt[:, cut:], cache, cut)
  scale = np.max(np.abs(whole_m))
  assert np.max(np.abs(np.concatenate([m1, m2], 1) - whole_m)) / scale <= 1e-5
  assert np.max(np.abs(np.concatenate([b1, b2], 1) - whole_b)) / np.max(np.abs(whole_b)) <= 1e-5
  # the window really matters: a fresh cache for the second chunk changes the MTP logits
  _, _, cold = _run(params, CFG, toks[:, cut:], nxt[:, cut:], caches.init_contiguous(CFG, B, 64)[0], cut)
  assert np.max(np.abs(cold - m2)) / scale > 1e-3

  net = nnx_model.Model(CFG, params)
  swa, full = caches.contiguous_tables(B, 64, caches.CacheLayout())
  idx = caches.BatchIndex(jnp.zeros(B, jnp.int32), jnp.full((B,), T, jnp.int32), jnp.asarray(swa), jnp.asarray(full))
  step = caches.step_index_from_batch(idx, T)
  X = jax.random.normal(jax.random.PRNGKey(1), (1, B * T, CFG.mhc.hc_mult, CFG.hidden_size))
  cache = caches.init_contiguous(CFG, B, 64)[0]
  c1, x1, h1 = model.mtp_forward(params, CFG, 0, X, jnp.asarray(nxt.reshape(-1)), cache, step)
  c2, x2, h2 = net.mtp[0](net.embed[...], X, jnp.asarray(nxt.reshape(-1)), cache, step)
  np.testing.assert_array_equal(np.asarray(h1), np.asarray(h2))
  np.testing.assert_array_equal(np.asarray(x1), np.asarray(x2))
  assert jax.tree_util.tree_structure(nnx_model.params_of(net)) == jax.tree_util.tree_structure(params)


def test_loader_names_and_refusals(tmp_path):
  params = model.init_params(CFG, jax.random.PRNGKey(2))
  safetensors_write.save_original_safetensors(params, CFG, str(tmp_path / "ck"))
  names = safetensors_file.read_entries(str(tmp_path / "ck"))
  assert {"mtp.0.e_proj.weight", "mtp.0.hnorm.weight", "mtp.0.hc_head_fn", "mtp.0.attn.wq_a.weight",
          "mtp.0.ffn.experts.7.w2.weight", "mtp.0.hc_attn_fn"} <= set(names)
  back = load_checkpoint(str(tmp_path / "ck"), CFG, as_jax=False)
  for x, y in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(back)):
    np.testing.assert_array_equal(np.asarray(x), y)
  # a config without MTP ignores the block (as transformers does); one that wants it and finds none says so
  base = dataclasses.replace(CFG, num_mtp_layers=0)
  plain = load_checkpoint(str(tmp_path / "ck"), base, as_jax=False)
  assert "mtp" not in plain
  safetensors_write.save_original_safetensors(model.init_params(base, jax.random.PRNGKey(2)), base, str(tmp_path / "no"))
  with pytest.raises(safetensors_file.CheckpointError, match="mtp.0"):
    load_checkpoint(str(tmp_path / "no"), CFG)
  # V4.1's draft stages are DSpark's: they need its target layers
  with pytest.raises(ConfigError, match="dspark.target_layer_ids"):
    dataclasses.replace(v41_tiny(), num_mtp_layers=1)
  # the block's window KV is one more layer of the sliding-window group
  specs = [s for s in caches.cache_array_specs(CFG, caches.CacheLayout()) if s.layer == CFG.num_layers]
  assert [s.name for s in specs] == ["window_kv"]

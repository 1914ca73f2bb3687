"""Full V4-Flash size without weights: parameter count and per-layer cache shapes (docs/model.md, Presets;
docs/kv_cache.md, The cache pytree)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import caches, config, model


def test_v4_flash_parameter_count():
  n = model.count_params(model.abstract_params(config.v4_flash()))
  assert round(n / 1e9, 2) == 284.33, n
  # with the MTP block V4-Flash ships (num_nextn_predict_layers = 1): one layer's worth plus e/h_proj and norms
  mtp = model.abstract_params(dataclasses.replace(config.v4_flash(), num_mtp_layers=1))["mtp"]
  assert round(model.count_params(mtp) / 1e9, 2) == 6.61


def test_v4_flash_layer_plan():
  plan = config.v4_flash().layer_plan()
  kinds = [p.kind for p in plan]
  assert kinds[:2] == ["swa", "swa"] and kinds.count("csa") == 21 and kinds.count("hca") == 20
  assert [p.index for p in plan if p.hash_moe] == [0, 1, 2]
  assert all(p.rope == ("main" if p.kind == "swa" else "compress") for p in plan)


def test_v4_flash_cache_shapes_after_a_prefill():
  """eval_shape of a real forward at Flash size: per-layer pools hold L/m compressed entries and index keys."""
  cfg, layout = config.v4_flash(), caches.CacheLayout()
  L = 512
  swa, full = caches.contiguous_tables(1, L, layout)
  cache = jax.eval_shape(lambda: caches.init_cache(cfg, layout, swa.size, full.size))
  index = caches.BatchIndex(jnp.zeros(1, jnp.int32), jnp.full((1,), L, jnp.int32), jnp.asarray(swa),
                            jnp.asarray(full))
  tokens = jax.ShapeDtypeStruct((1, L), jnp.int32)
  new_cache, logits = jax.eval_shape(lambda p, t, c: model.forward(p, cfg, t, c, index),
                                     model.abstract_params(cfg), tokens, cache)
  assert logits.shape == (1, L, 129280)
  for plan, layer in zip(cfg.layer_plan(), new_cache.layers):
    assert layer["window_kv"].shape == (L // 32, 32, 512)
    if plan.kind == "swa":
      assert set(layer) == {"window_kv"}
    if plan.kind == "csa":  # floor(L/4) entries of 512 and index keys of 128; one running-pool row per swa block
      assert np.prod(layer["comp_kv"].shape[:2]) == L // 4 and layer["comp_kv"].shape[-1] == 512
      assert np.prod(layer["index_keys"].shape[:2]) == L // 4 and layer["index_keys"].shape[-1] == 128
      assert layer["comp_state"].shape == (L // 32, 1, 4 * 512) and layer["index_state"].shape == (L // 32, 1, 4 * 128)
    if plan.kind == "hca":
      assert np.prod(layer["comp_kv"].shape[:2]) == L // 128 and layer["comp_state"].shape == (L // 32, 1, 2 * 512)
      assert "index_keys" not in layer
  assert caches.state_tail_tokens(cfg) == 127


@pytest.mark.parametrize("field,kwargs,msg", [
    ("compress_ratios", dict(compress_ratios=(0, 4)), "one entry per layer"),
    ("o_groups", dict(attention=config.AttentionConfig(num_heads=6, o_groups=4)), "divisible"),
    ("indexer.head_dim", dict(indexer=config.IndexerConfig(head_dim=8)), "RoPE part"),
    ("num_experts_per_tok", dict(moe=config.MoEConfig(n_routed_experts=4, num_experts_per_tok=6)), "n_routed_experts"),
])
def test_invalid_config_names_the_field(field, kwargs, msg):
  base = dict(name="bad", variant="v4", vocab_size=64, hidden_size=32, num_layers=3, compress_ratios=(0, 4, 16))
  base.update(kwargs)
  with pytest.raises(config.ConfigError, match=msg) as e:
    config.ModelConfig(**base)
  assert field.split(".")[-1] in str(e.value)


@pytest.mark.parametrize("tokens,msg", [
    (np.zeros((4,), np.int32), "expected shape"),
    (np.zeros((1, 4), np.float32), "integer"),
    (np.array([[1, 2, 600]]), "out of range"),
    (np.array([[-1, 2]]), "out of range"),
])
def test_forward_full_rejects_bad_tokens_before_jax(tokens, msg):
  cfg = config.v4_tiny()
  with pytest.raises(ValueError, match=msg):
    model.forward_full({}, cfg, tokens)

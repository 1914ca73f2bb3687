"""Parity with transformers 5.23.0 `DeepseekV4ForCausalLM` (torch CPU, fp32) on the tiny config of
docs/references.md, V4 (= dsv4.config.v4_tiny()): window, CSA (m=4, top-8 of up to 75 entries, 8 indexer heads),
HCA (m=16, 18 entries), hash MoE and learned MoE. The reference writes its weights with safetensors.torch; we read
them with dsv4.loading.load_checkpoint. 300 tokens cross the window, need top-k selection and fill several HCA
entries. Tolerance: max|ours - HF| <= 1e-4 * max|HF| on the logits, full forward and cached path.
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import caches, config, model
from dsv4.loading import names, quant
from dsv4.loading.safetensors_io import load_checkpoint
from tests.dsv4 import oracle_util

T = 300
REL_TOL = 1e-4
TIE_MARGIN = 1e-6  # relative gap required between the k-th and (k+1)-th visible index score
CHUNKS = (150, 101)  # then 49 one-token decode steps


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
  t0 = time.time()
  import torch
  hf = oracle_util.build_oracle(seed=0)
  d = str(tmp_path_factory.mktemp("hf_tiny"))
  oracle_util.save_oracle_weights(hf, d)
  cfg = config.v4_tiny()
  params = load_checkpoint(d, cfg)
  tokens = np.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, T)), np.int32)

  # HF full forward, recording the indexer's top-k per CSA layer
  picks = {}
  hooks = []
  for i, layer in enumerate(hf.model.layers):
    comp = layer.self_attn.compressor
    if comp is not None and hasattr(comp, "indexer"):
      hooks.append(comp.indexer.register_forward_hook(
          lambda mod, args, out, i=i: picks.__setitem__(i, out.detach().numpy().copy())))
  ref = oracle_util.hf_logits(hf, tokens)
  for h in hooks:
    h.remove()
  print(f"\n[oracle] build + save + load + HF forward: {time.time() - t0:.1f}s")
  return dict(torch=torch, hf=hf, cfg=cfg, params=params, tokens=tokens, ref=ref, hf_topk=picks, dir=d)


def _rel_err(got, ref):
  return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def test_config_matches_v4_tiny(oracle):
  assert oracle_util.config_mismatches(oracle["hf"].config, oracle["cfg"]) == []


def test_generated_names_equal_hf_state_dict(oracle):
  sd = oracle["hf"].state_dict()
  specs = names.hf_specs(oracle["cfg"])
  assert set(specs) == set(sd)
  for name, s in specs.items():
    assert tuple(sd[name].shape) == s.shape, name


def test_fp4_and_fp8_dequant_match_transformers(oracle):
  """Our FP4 nibble order and block dequant against transformers' own Fp8Dequantize (finegrained_fp8.py)."""
  torch = oracle["torch"]
  from transformers.integrations.finegrained_fp8 import Fp8Dequantize
  deq = Fp8Dequantize(hf_quantizer=None)
  rng = np.random.default_rng(5)
  w = rng.standard_normal((2, 64, 128)).astype(np.float32)
  packed, scale = quant.quantize_fp4(w)
  theirs = deq._dequantize_one(torch.from_numpy(packed), torch.from_numpy(scale.view(np.uint8)),
                               output_dtype=torch.float32).numpy()
  np.testing.assert_array_equal(quant.dequant_fp4(packed, scale), theirs)
  w = rng.standard_normal((256, 384)).astype(np.float32)
  q, s = quant.quantize_fp8_block(w, 128)
  theirs = deq._dequantize_one(torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn),
                               torch.from_numpy(s.view(np.uint8)), output_dtype=torch.float32).numpy()
  np.testing.assert_array_equal(quant.dequant_fp8_block(q, s, 128), theirs)


def _full(oracle):
  if "full" not in oracle:
    cfg, params, tokens = oracle["cfg"], oracle["params"], oracle["tokens"]
    cache, swa, full = caches.init_contiguous(cfg, 1, T)
    idx = caches.BatchIndex(jnp.zeros(1, jnp.int32), jnp.full(1, T, jnp.int32), jnp.asarray(swa), jnp.asarray(full))
    fwd = jax.jit(functools.partial(model.forward_aux, collect_aux=True), static_argnames=("config",))
    _, logits, aux = fwd(params, cfg, jnp.asarray(tokens), cache, idx)
    oracle["full"] = (np.asarray(logits), aux)
  return oracle["full"]


def test_no_topk_ties_and_same_selection_as_hf(oracle):
  """At every query with more than k visible entries, the k-th and (k+1)-th index scores must differ, so the
  selection (and this test) cannot depend on tie-breaking; the selected sets must equal HF's."""
  cfg = oracle["cfg"]
  k = cfg.indexer.topk
  _, aux = _full(oracle)
  checked = 0
  for plan, a in zip(cfg.layer_plan(), aux):
    if plan.kind != "csa":
      continue
    s = np.asarray(a["index_scores"])[0]  # [T, M]
    vis = (np.arange(T) + 1) // plan.ratio
    rows = np.nonzero(vis > k)[0]
    gaps = []
    for t in rows:
      v = np.sort(s[t, : vis[t]])[::-1]
      gaps.append((v[k - 1] - v[k]) / max(abs(v[k - 1]), 1e-12))
      assert gaps[-1] > TIE_MARGIN, f"layer {plan.index} query {t}: k-th/(k+1)-th index scores tie ({v[k-1]}, {v[k]})"
    print(f"\n[ties] layer {plan.index}: {len(rows)} queries with > {k} visible entries, "
          f"min relative gap {min(gaps):.2e}")
    checked += len(rows)
    ours = np.asarray(a["topk_ids"])[0]
    theirs = oracle["hf_topk"][plan.index][0]
    for t in range(T):
      assert set(ours[t][ours[t] >= 0].tolist()) == set(theirs[t][theirs[t] >= 0].tolist()), (plan.index, t)
  assert checked > 400  # both CSA layers, most of the 300 queries


def test_full_forward_matches_hf(oracle):
  logits, _ = _full(oracle)
  ref = oracle["ref"]
  err = _rel_err(logits, ref)
  print(f"\n[parity] full forward T={T}: max|diff| = {np.max(np.abs(logits - ref)):.3e}, max|ref| = "
        f"{np.max(np.abs(ref)):.3f}, relative {err:.3e}")
  assert err <= REL_TOL


def test_cached_path_matches_hf(oracle):
  """Chunked prefill (150, 101) into a paged cache, then token-by-token decode of the last 49, vs HF full."""
  cfg, params, tokens, ref = oracle["cfg"], oracle["params"], oracle["tokens"], oracle["ref"]
  layout = caches.CacheLayout()
  cache, swa, full = caches.init_contiguous(cfg, 1, T, layout)
  out = np.zeros_like(ref)
  pos = 0
  steps = list(CHUNKS) + [1] * (T - sum(CHUNKS))
  for n in steps:
    width = max(CHUNKS) if n > 1 else 1  # the 101-token chunk rides in a 150-wide step (padding, one compile less)
    chunk = np.zeros((1, width), np.int32)
    chunk[:, :n] = tokens[:, pos:pos + n]
    idx = caches.BatchIndex(jnp.full(1, pos, jnp.int32), jnp.full(1, n, jnp.int32), jnp.asarray(swa),
                            jnp.asarray(full))
    cache, logits = model.forward_jit(params, cfg, jnp.asarray(chunk), cache, idx, layout)
    out[:, pos:pos + n] = np.asarray(logits)[:, :n]
    pos += n
  seg = {"prefill 0-150": slice(0, 150), "prefill 150-251": slice(150, 251), "decode 251-300": slice(251, 300)}
  errs = {k: float(np.max(np.abs(out[:, s] - ref[:, s]))) for k, s in seg.items()}
  err = _rel_err(out, ref)
  print(f"\n[parity] cached path: per segment max|diff| {errs}; relative {err:.3e}")
  assert err <= REL_TOL

"""Checkpoint tensor names <-> the project's parameter tree.

Three spellings are involved:

* **param paths**: the project's tree (`dsv4.model.param_shapes`), which already uses the original checkpoint's
  short names (wq_a, wkv, wo_a, ...) with kernels stored [in, out];
* **original names**: the official DeepSeek-V4 checkpoint (`layers.N.attn.wq_a.weight`, `layers.N.attn.attn_sink`,
  `layers.N.hc_attn_fn`, `layers.N.ffn.experts.E.w1.weight`, `embed.weight`, `head.weight`, `hc_head_fn`, ...),
  torch layout [out, in], routed experts one tensor per expert;
* **HF names**: transformers `deepseek_v4` (`model.layers.N.self_attn.q_a_proj.weight`,
  `model.layers.N.mlp.experts.gate_up_proj` [E, 2I, D], ...).

Nothing here is a literal list of names. `original_specs(config)` walks `param_shapes(config)` (itself derived
from the config's layer plan) and spells each leaf the original way, with its stored shape and the transform to and
from the param layout. HF names are obtained from original names by the checkpoint -> HF renames
(the regex list of transformers' `conversion_mapping.py`, key "deepseek_v4", reproduced in `_RENAMES`), plus the
per-expert stacking `gate_up_proj = stack_E(concat(w1_E, w3_E))`, `down_proj = stack_E(w2_E)`.
`tests/dsv4/test_hf_parity.py` checks that the generated HF names and shapes equal the real HF module's
state_dict for the tiny oracle config.

V4.1 has no transformers implementation; its original names (`attn.indexer.{wq_b, weights_proj, wk,
k_norm}`, no `ape`) are generated the same way and its "HF" names are the same renames applied to them (an
extrapolation, not checked against any reference).

Draft blocks (`mtp.K.*`: V4 MTP blocks, V4.1 DSpark stages) are spelled like layer K in every naming, plus their own
parts (V4: e_proj, h_proj, enorm, hnorm, norm; DSpark: main_proj, main_norm on stage 0, norm, markov_head.{embed,
head}, confidence_head.proj on the last). transformers implements neither, so HF-named directories keep them in the
original spelling: `hf_specs` expects `mtp.K.*` as DeepSeek ships it; the HF writers put a V4 block where NeMo's
adapter also reads it, as layer N + K (`hf_mtp_export_names`), and leave DSpark stages at `mtp.K.*` (where NeMo's
`DeepseekV41DSparkStateDictAdapter` reads them). NeMo's names wrap the renamed layer-K names in `mtp.layers.K.*`
(V4) or `mtp.K.*` (V4.1 DSpark: its draft model's own state_dict, `_dspark_native_key`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import numpy as np

from dsv4.config import ModelConfig
from dsv4.model import is_param_spec, param_shapes

Path = tuple  # e.g. ("layers", 3, "attn", "wq_a")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """One stored tensor (original spelling) and how it maps onto a param leaf.

  expert: for routed experts, the expert index this tensor holds (the param leaf is [E, ...]); else None.
  to_param / from_param: stored layout <-> param layout (of the leaf, or of its expert slice).
  """
  name: str
  path: Path
  shape: tuple[int, ...]       # stored (dequantized) shape
  integer: bool                # integer tensor (tid2eid); everything else is floating point
  expert: int | None
  to_param: Callable[[np.ndarray], np.ndarray]
  from_param: Callable[[np.ndarray], np.ndarray]


def _ident(x):
  return x


def _t2(x):
  return np.swapaxes(x, -1, -2)


def _leaf_original(path: Path, shape: tuple, kind: str, dtype) -> list[TensorSpec]:
  """Original checkpoint spelling of one param leaf."""
  integer = np.issubdtype(np.dtype(dtype), np.integer)
  if path[0] in ("layers", "mtp"):   # MTP blocks: `mtp.D.*`, spelled like a layer (DeepSeek's MTPBlock is a Block)
    n, rest = path[1], path[2:]
    pre = f"{path[0]}.{n}."
  else:
    rest, pre = path, ""
  head, last = rest[:-1], rest[-1]

  def one(name, stored_shape, to_param=_ident, from_param=_ident):
    return [TensorSpec(name, path, tuple(stored_shape), integer, None, to_param, from_param)]

  if path[0] == "mtp" and not head and last in ("e_proj", "h_proj", "enorm", "hnorm", "norm", "main_proj",
                                                 "main_norm"):
    if last in ("e_proj", "h_proj", "main_proj"):   # V4 MTP fusion, V4.1 DSpark feature projection: [out, in]
      return one(f"{pre}{last}.weight", shape[::-1], _t2, _t2)
    return one(f"{pre}{last}.weight", shape)
  if path[0] == "mtp" and head == ("markov_head",):  # DSpark: embed [V, r] as stored, head Linear(r, V) [out, in]
    if last == "embed":
      return one(f"{pre}markov_head.embed.weight", shape)
    return one(f"{pre}markov_head.head.weight", shape[::-1], _t2, _t2)
  if path[0] == "mtp" and head == ("confidence_head",):  # DSpark: Linear(D + r, 1), stored [1, D + r]
    return one(f"{pre}confidence_head.proj.weight", shape[::-1], _t2, _t2)

  # mHC: flat names hc_attn_fn / hc_ffn_fn / hc_head_fn, fn stored [rows, n*D]
  if head and head[0] in ("hc_attn", "hc_ffn", "hc_head"):
    name = f"{pre}{head[0]}_{last}"
    if last == "fn":
      return one(name, shape[::-1], _t2, _t2)
    return one(name, shape)
  if rest == ("embed",):
    return one("embed.weight", shape)
  if rest == ("lm_head",):
    return one("head.weight", shape[::-1], _t2, _t2)
  if rest == ("norm",) or rest in (("attn_norm",), ("ffn_norm",)):
    return one(f"{pre}{last}.weight", shape)

  mod = pre + ".".join(str(p) for p in head)
  if head == ("attn",) and last == "sink":
    return one(f"{mod}.attn_sink", shape)
  if last == "ape":
    return one(f"{mod}.ape", shape)
  if head == ("engram",):  # V4.1 Engram: embed [rows, head_dim] as stored; q/k_weight [hc, D] as stored
    if last == "embed":
      return one(f"{mod}.embed.weight", shape)
    if last in ("q_weight", "k_weight"):
      return one(f"{mod}.{last}", shape)
  if head == ("ffn",) and last in ("bias", "tid2eid", "bias_vl"):
    return one(f"{mod}.gate.{last}", shape)
  if head == ("ffn", "shared"):
    return one(f"{pre}ffn.shared_experts.{last}.weight", shape[::-1], _t2, _t2)
  if head == ("ffn", "experts"):
    E = shape[0]
    return [TensorSpec(f"{pre}ffn.experts.{e}.{last}.weight", path, tuple(shape[:0:-1]), False, e, _t2, _t2)
            for e in range(E)]
  if last == "wo_a":  # param [G, H*d/G, o_lora] <-> stored [G*o_lora, H*d/G] (rows g*o_lora.. belong to group g)
    G, k, r = shape
    return one(f"{mod}.wo_a.weight", (G * r, k),
               lambda x, G=G, k=k, r=r: np.swapaxes(x.reshape(G, r, k), 1, 2),
               lambda x, G=G, k=k, r=r: np.swapaxes(x, 1, 2).reshape(G * r, k))
  if len(shape) == 1:  # norms (q_norm, kv_norm, compressor norm, k_norm)
    return one(f"{mod}.{last}.weight", shape)
  if kind == "dense" and len(shape) == 2:
    return one(f"{mod}.{last}.weight", shape[::-1], _t2, _t2)
  raise NotImplementedError(f"no checkpoint spelling for param {'/'.join(map(str, path))} {shape} {kind}")


def _walk(tree, path=()):
  if is_param_spec(tree):
    yield path, tree
  elif isinstance(tree, dict):
    for k, v in tree.items():
      yield from _walk(v, path + (k,))
  else:
    for i, v in enumerate(tree):
      yield from _walk(v, path + (i,))


def original_specs(config: ModelConfig) -> list[TensorSpec]:
  """Every tensor of an original-format checkpoint for `config`, in param-tree order."""
  out = []
  for path, spec in _walk(param_shapes(config)):
    if spec.init in _DERIVED_KINDS:
      continue
    out += _leaf_original(path, spec.shape, spec.init, spec.dtype)
  return out


# Param leaves that are not checkpoint tensors (the Engram token map comes from the tokenizer).
_DERIVED_KINDS = ("token_map",)


def fill_derived(params, config: ModelConfig):
  """Sets the derived (non-checkpoint) leaves to their defaults: the Engram token map to the identity."""
  if "engram_token_map" in params and params["engram_token_map"] is None:
    params["engram_token_map"] = np.arange(config.vocab_size, dtype=np.int32)
  return params


# ----------------------------------------------------------------------------------------------------------
# Original -> HF renames (transformers 5.23.0 conversion_mapping.py "deepseek_v4"), applied in order.

_RENAMES: tuple[tuple[str, str], ...] = (
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"),
    (r"^hc_head_base", "hc_head.hc_base"),
    (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"),
    (r"\.hc_attn_base", ".attn_hc.base"),
    (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"),
    (r"\.hc_ffn_base", ".ffn_hc.base"),
    (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")


def original_to_hf_name(name: str) -> str:
  """HF name of a non-expert original tensor (the renames of `_RENAMES`, then the `model.` prefix)."""
  for pat, rep in _RENAMES:
    name = re.sub(pat, rep, name)
  return name if name.startswith("lm_head.") else "model." + name


def expert_target(name: str) -> tuple[str, int, str] | None:
  """For `layers.N.ffn.experts.E.wK.weight`: (HF stacked name, E, wK); else None."""
  m = _EXPERT_RE.match(name)
  if not m:
    return None
  n, e, w = int(m.group(1)), int(m.group(2)), m.group(3)
  stacked = "gate_up_proj" if w in ("w1", "w3") else "down_proj"
  return f"model.layers.{n}.mlp.experts.{stacked}", e, w


@dataclasses.dataclass(frozen=True)
class HFSpec:
  """One HF tensor: its stored shape and the param leaves it feeds."""
  name: str
  shape: tuple[int, ...]
  integer: bool
  sources: tuple[TensorSpec, ...]   # the original tensors it is made of (1, or E per-expert tensors)

  @property
  def stacked(self) -> bool:
    """Routed experts stacked into one tensor (else it is exactly one original tensor)."""
    return self.sources[0].expert is not None and self.sources[0].name != self.name


def hf_specs(config: ModelConfig) -> dict[str, HFSpec]:
  """HF name -> spec, derived from `original_specs` by the renames and the expert stacking."""
  out: dict[str, list] = {}
  for s in original_specs(config):
    if s.path[0] == "mtp":  # transformers has no MTP: HF directories keep DeepSeek's spelling for it
      key = s.name
    else:
      tgt = expert_target(s.name)
      key = tgt[0] if tgt else original_to_hf_name(s.name)
    out.setdefault(key, []).append(s)
  specs = {}
  for name, srcs in out.items():
    if srcs[0].expert is None or srcs[0].name == name:
      shape = srcs[0].shape
    else:  # stacked experts: gate_up [E, 2I, D] from w1, w3 [I, D]; down [E, D, I] from w2 [D, I]
      E = 1 + max(s.expert for s in srcs)
      r, c = srcs[0].shape
      shape = (E, 2 * r, c) if name.endswith("gate_up_proj") else (E, r, c)
    specs[name] = HFSpec(name, tuple(shape), srcs[0].integer, tuple(srcs))
  return specs


def stack_experts(hf_name: str, per_expert: dict[tuple[int, str], np.ndarray], E: int) -> np.ndarray:
  """Original per-expert tensors -> one HF tensor (gate rows first, then up)."""
  if hf_name.endswith("gate_up_proj"):
    return np.stack([np.concatenate([per_expert[(e, "w1")], per_expert[(e, "w3")]], axis=0) for e in range(E)])
  return np.stack([per_expert[(e, "w2")] for e in range(E)])


def unstack_experts(hf_name: str, x: np.ndarray) -> dict[tuple[int, str], np.ndarray]:
  if hf_name.endswith("gate_up_proj"):
    I = x.shape[1] // 2
    return {**{(e, "w1"): x[e, :I] for e in range(x.shape[0])}, **{(e, "w3"): x[e, I:] for e in range(x.shape[0])}}
  return {(e, "w2"): x[e] for e in range(x.shape[0])}


def _set(tree, path, value):
  for p in path[:-1]:
    tree = tree[p]
  tree[path[-1]] = value


def _get(tree, path):
  for p in path:
    tree = tree[p]
  return tree


def empty_tree(config: ModelConfig):
  """The param tree structure with None leaves."""
  def build(t):
    if is_param_spec(t):
      return None
    if isinstance(t, dict):
      return {k: build(v) for k, v in t.items()}
    return [build(v) for v in t]
  return build(param_shapes(config))


def original_to_params(tensors: dict[str, np.ndarray], config: ModelConfig) -> dict:
  """Validated original-named tensors (float32 / integer) -> param tree of numpy arrays."""
  params = empty_tree(config)
  experts: dict[Path, list] = {}
  for s in original_specs(config):
    x = s.to_param(tensors[s.name])
    if s.expert is None:
      _set(params, s.path, x)
    else:
      experts.setdefault(s.path, []).append((s.expert, x))
  for path, xs in experts.items():
    _set(params, path, np.stack([x for _, x in sorted(xs, key=lambda t: t[0])]))
  return fill_derived(params, config)


def params_to_original(params, config: ModelConfig) -> dict[str, np.ndarray]:
  out = {}
  for s in original_specs(config):
    leaf = np.asarray(_get(params, s.path))
    out[s.name] = np.ascontiguousarray(s.from_param(leaf if s.expert is None else leaf[s.expert]))
  return out


def hf_to_original(tensors: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
  """HF-named tensors -> original-named tensors (unstacks experts)."""
  out = {}
  for name, spec in hf_specs(config).items():
    out.update(hf_tensor_to_original(name, tensors[name], spec))
  return out


def hf_mtp_export_names(config: ModelConfig) -> dict[str, str]:
  """`mtp.K.*` -> the name the HF writers give it: layer N + K in the original spelling, the form NeMo's adapter
  reads next to HF names (intermediate exports): what a backbone layer also has under `model.layers.{N+K}.`, the
  MTP-only parts (e_proj, h_proj, enorm, hnorm, norm, hc_head_*) under unprefixed `layers.{N+K}.`."""
  if config.variant != "v4":   # V4.1 DSpark stages stay `mtp.K.*`, where NeMo's draft adapter reads them
    return {}
  shapes = param_shapes(config)
  layer_parts = {k for layer in shapes["layers"] for k in layer}
  out = {}
  for s in original_specs(config):
    if s.path[0] == "mtp":
      pre = "model." if s.path[2] in layer_parts else ""
      out[s.name] = f"{pre}layers.{config.num_layers + s.path[1]}." + s.name.split(".", 2)[2]
  return out


def original_to_hf(tensors: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
  """Original-named tensors -> the tensors the HF writers store (experts stacked, MTP as layers N + K)."""
  out = {}
  mtp = hf_mtp_export_names(config)
  for name, spec in hf_specs(config).items():
    if not spec.stacked:
      out[mtp.get(name, name)] = tensors[spec.sources[0].name]
    else:
      per = {(s.expert, s.name.split(".")[-2]): tensors[s.name] for s in spec.sources}
      out[name] = stack_experts(name, per, spec.shape[0])
  return out


# ----------------------------------------------------------------------------------------------------------
# NeMo Automodel names: the model's own state_dict, the names its state-dict adapter converts the original ones
# into. Both variants stack the routed experts as `gate_and_up_projs` [E, D, 2I] = stack_E(concat(w1, w3).T) and
# `down_projs` [E, I, D] = stack_E(w2.T) (transposed relative to HF).
#
# `deepseek_v41` (`_native_key`): `model.` prefix, `attn_sink` -> `sinks_param.weight`, `hc_attn_fn` ->
# `attn_hc.fn`, shared experts w1/w3/w2 -> gate/up/down_proj, gate bias -> `e_score_correction_bias`.

def _nemo_v41_name(name: str) -> str:
  if name.startswith("embed."):
    return "model.embed_tokens." + name.removeprefix("embed.")
  if name.startswith("head."):
    return "lm_head." + name.removeprefix("head.")
  if name.endswith(".attn.attn_sink"):
    name = name.removesuffix(".attn_sink") + ".sinks_param.weight"
  m = re.fullmatch(r"layers\.(\d+)\.hc_(attn|ffn)_(fn|base|scale)", name)
  if m:
    return f"model.layers.{m[1]}.{m[2]}_hc.{m[3]}"
  name = re.sub(r"(\.ffn\.shared_experts)\.w1\.", r"\1.gate_proj.", name)
  name = re.sub(r"(\.ffn\.shared_experts)\.w3\.", r"\1.up_proj.", name)
  name = re.sub(r"(\.ffn\.shared_experts)\.w2\.", r"\1.down_proj.", name)
  if name.endswith(".ffn.gate.bias"):
    name = name.removesuffix(".bias") + ".e_score_correction_bias"
  return "model." + name


# `deepseek_v4` (its adapter's `_HF_TO_INTERNAL_RENAMES`, first match wins): the layer part after `layers.N.` is
# renamed, then prefixed `model.layers.N.`; a part no rule names (an MTP block's e_proj, h_proj, enorm, hnorm, norm)
# keeps its name and its `layers.N.` prefix.
_NEMO_V4_TOP = (
    (r"^embed\.", "model.embed_tokens."),
    (r"^norm\.", "model.norm."),
    (r"^head\.", "lm_head."),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
)
_NEMO_V4_LAYER = (
    (r"^attn_norm\.", "input_layernorm."),
    (r"^ffn_norm\.", "post_attention_layernorm."),
    (r"^attn\.attn_sink$", "self_attn.sinks_param.weight"),
    # the indexer (with its own nested compressor on disk) lives under the compressor in NeMo
    (r"^attn\.indexer\.compressor\.norm\.", "self_attn.compressor.indexer.kv_norm."),
    (r"^attn\.indexer\.compressor\.ape$", "self_attn.compressor.indexer.ape_param.weight"),
    (r"^attn\.indexer\.(compressor\.)?", "self_attn.compressor.indexer."),
    (r"^attn\.compressor\.norm\.", "self_attn.compressor.kv_norm."),
    (r"^attn\.compressor\.ape$", "self_attn.compressor.ape_param.weight"),
    (r"^attn\.", "self_attn."),
    (r"^ffn\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"^ffn\.shared_experts\.w1\.", "mlp.shared_experts.gate_proj."),
    (r"^ffn\.shared_experts\.w3\.", "mlp.shared_experts.up_proj."),
    (r"^ffn\.shared_experts\.w2\.", "mlp.shared_experts.down_proj."),
    (r"^ffn\.", "mlp."),
    (r"^hc_(attn|ffn)_(fn|base|scale)$", r"\1_hc.\2"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
)


def _nemo_v4_name(name: str) -> str:
  m = re.match(r"layers\.(\d+)\.", name)
  rules, rest, pre = (_NEMO_V4_LAYER, name[m.end():], f"model.layers.{m[1]}.") if m else (_NEMO_V4_TOP, name, "")
  for pat, rep in rules:
    new, n = re.subn(pat, rep, rest)
    if n:
      return pre + new
  return name


def original_to_nemo_name(name: str, variant: str) -> str:
  m = re.match(r"mtp\.(\d+)\.", name)
  if m:  # NeMo renames draft block K as layer K, then moves it under `mtp.layers.K.` (V4) / `mtp.K.` (V4.1 DSpark)
    inner = original_to_nemo_name(f"layers.{m[1]}." + name[m.end():], variant)
    if variant == "v4":
      return "mtp." + inner.removeprefix("model.")
    return "mtp." + inner.removeprefix("model.layers.")   # `_dspark_native_key`
  return _nemo_v4_name(name) if variant == "v4" else _nemo_v41_name(name)


_ANY_EXPERT_RE = re.compile(r"^((?:layers|mtp)\.\d+)\.ffn\.experts\.\d+\.(w[123])\.weight$")


def nemo_specs(config: ModelConfig) -> dict[str, HFSpec]:
  """NeMo name -> spec (stored shape, sources), derived from `original_specs` (V4: `deepseek_v4`'s names, V4.1:
  `deepseek_v41`'s)."""
  out: dict[str, list] = {}
  for s in original_specs(config):
    m = _ANY_EXPERT_RE.match(s.name)
    if m:  # the stacked tensor is named like a parameter of the layer's `ffn.experts`
      stacked = "down_projs" if m[2] == "w2" else "gate_and_up_projs"
      key = original_to_nemo_name(f"{m[1]}.ffn.experts.{stacked}", config.variant)
    else:
      key = original_to_nemo_name(s.name, config.variant)
    out.setdefault(key, []).append(s)
  specs = {}
  for name, srcs in out.items():
    if srcs[0].expert is None:
      shape = srcs[0].shape
    else:
      E = 1 + max(s.expert for s in srcs)
      r, c = srcs[0].shape  # w1/w3 [I, D], w2 [D, I]
      shape = (E, c, 2 * r) if name.endswith("gate_and_up_projs") else (E, c, r)
    specs[name] = HFSpec(name, tuple(shape), srcs[0].integer, tuple(srcs))
  return specs


def nemo_to_original(tensors: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
  out = {}
  for name, spec in nemo_specs(config).items():
    out.update((k, np.ascontiguousarray(v)) for k, v in nemo_tensor_to_original(name, tensors[name], spec))
  return out


def nemo_tensor_to_original(name: str, x: np.ndarray, spec: HFSpec) -> list[tuple[str, np.ndarray]]:
  """One NeMo-named tensor -> its original-named tensors (unstacks and transposes routed experts)."""
  if not spec.stacked:
    return [(spec.sources[0].name, x)]
  I = x.shape[2] // 2 if name.endswith("gate_and_up_projs") else None
  out = []
  for s in spec.sources:
    w, e = s.name.split(".")[-2], s.expert
    part = x[e, :, :I] if w == "w1" else (x[e, :, I:] if w == "w3" else x[e])
    out.append((s.name, part.T))
  return out


def hf_tensor_to_original(name: str, x: np.ndarray, spec: HFSpec) -> list[tuple[str, np.ndarray]]:
  """One HF-named tensor -> its original-named tensors (unstacks routed experts)."""
  if not spec.stacked:
    return [(spec.sources[0].name, x)]
  parts = unstack_experts(name, x)
  return [(s.name, parts[(s.expert, s.name.split(".")[-2])]) for s in spec.sources]


# ----------------------------------------------------------------------------------------------------------
# transformers `save_pretrained` names: transformers reverses its load-time renames when saving, and for
# DeepSeek-V4 only some of them come back: the result is the original name with a `model.` prefix, except
# `head.weight` (no prefix), `model.embed_tokens.weight` and `model.hc_head.hc_{fn,base,scale}`. Routed experts
# come back per expert (`model.layers.N.ffn.experts.E.w1.weight`), the KV norm as `model.layers.N.attn.norm.weight`.
# (Observed with transformers 5.23.0 `DeepseekV4ForCausalLM.save_pretrained`; tests/dsv4/test_loading_namings.py.)

_SAVED_HC_HEAD = re.compile(r"^hc_head\.hc_(fn|base|scale)$")
# transformers' `.norm.` -> `.kv_norm.` rename is not invertible: reversed, the attention's own KV norm
# (original `attn.kv_norm`) comes back as `attn.norm`.
_SAVED_KV_NORM = re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$")
_ORIG_KV_NORM = re.compile(r"^(layers\.\d+\.attn)\.kv_norm\.weight$")


def saved_to_original_name(name: str) -> str:
  n = name.removeprefix("model.")
  if n == "embed_tokens.weight":
    return "embed.weight"
  if n == "lm_head.weight":
    return "head.weight"
  m = _SAVED_HC_HEAD.match(n)
  if m:
    return f"hc_head_{m.group(1)}"
  return _SAVED_KV_NORM.sub(r"\1.kv_norm.weight", n)


def original_to_saved_name(name: str) -> str:
  if name.startswith("head."):
    return name
  if name == "embed.weight":
    return "model.embed_tokens.weight"
  if name.startswith("hc_head_"):
    return "model.hc_head.hc_" + name.removeprefix("hc_head_")
  return "model." + _ORIG_KV_NORM.sub(r"\1.norm.weight", name)


def original_to_nemo(tensors: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
  out = {}
  for name, spec in nemo_specs(config).items():
    if not spec.stacked:
      out[name] = tensors[spec.sources[0].name]
      continue
    E = spec.shape[0]
    per = {(s.expert, s.name.split(".")[-2]): tensors[s.name] for s in spec.sources}
    if name.endswith("gate_and_up_projs"):
      out[name] = np.stack([np.concatenate([per[(e, "w1")], per[(e, "w3")]], 0).T for e in range(E)])
    else:
      out[name] = np.stack([per[(e, "w2")].T for e in range(E)])
  return out

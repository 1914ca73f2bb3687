"""How a stored checkpoint spells its tensors: which naming it uses (original, HF, save_pretrained, NeMo), where its
MTP blocks are, and which tensor is the scale of which weight. Works on tensor names only (no data is read).

MTP blocks load in every naming (V4.1's DSpark stages too, always as `mtp.K.*`: NeMo's draft adapter reads them
there and nothing stores them as layers). transformers drops them, so HF-named directories carry them in DeepSeek's own
spelling, either as `mtp.K.*` (a hub directory) or as layer N + K (`model.layers.{N+K}.attn.*` and
`layers.{N+K}.e_proj.weight`, ...; what NeMo's adapter also reads and what the HF writers write); such a layer is
recognised by its `e_proj` and renamed to `mtp.K.*` before anything else. Blocks beyond the config's
`num_mtp_layers` are ignored (all of them by default).
"""

from __future__ import annotations

import re

from dsv4.config import ModelConfig
from dsv4.loading.safetensors_file import CheckpointError, Entry, read_entries

NAMINGS = ("original", "hf", "saved", "nemo")

_MTP_RE = re.compile(r"^(model\.)?mtp\.(layers\.)?(\d+)?")
_LEGACY_MTP_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.e_proj\.weight$")  # only an MTP block has an e_proj
_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def native_mtp(entries: dict, num_layers: int | None) -> dict:
  """Renames the tensors of MTP blocks stored as layer N + K (any layer that has an e_proj) to `mtp.K.*`, the
  spelling the rest of the loader knows; num_layers None drops them instead. Entries keep their stored names."""
  mtp_layers = {int(m.group(1)) for n in entries if (m := _LEGACY_MTP_RE.match(n))}
  if not mtp_layers:
    return entries
  out = {}
  for name, e in entries.items():
    m = _LAYER_RE.match(name)
    key = name
    if m is not None and int(m.group(1)) in mtp_layers:
      if num_layers is None:
        continue
      k = int(m.group(1)) - num_layers
      if k < 0:
        raise CheckpointError(f"tensor {name!r}: an MTP block's tensor at layer {m.group(1)}, but the config has "
                              f"{num_layers} backbone layers (MTP block K is stored as layer {num_layers} + K)")
      key = f"mtp.{k}.{name[m.end():]}"
    if key in out:
      raise CheckpointError(f"tensors {out[key].name!r} and {name!r} are both MTP tensor {key!r}")
    out[key] = e
  return out


def beyond_config_mtp(name: str, config: ModelConfig | None) -> bool:
  """MTP / draft tensors beyond the config's MTP blocks (all of them when it has none, as HF drops them)."""
  m = _MTP_RE.match(name)
  if m is None:
    return False
  n = config.num_mtp_layers if config is not None else 0
  return m.group(3) is None or int(m.group(3)) >= n


def stored_mtp_blocks(path: str, num_layers: int) -> int:
  """How many MTP blocks (0, 1, ... with none missing) the checkpoint at `path` stores, in any naming: `mtp.K.*`,
  NeMo's `mtp.layers.K.*`, or layer num_layers + K. A block counts when its e_proj is there. A V4.1 DSpark draft
  (stage 0 has a `main_proj`; `mtp.K.*` in every naming) counts its stages with an `attn.wq_a`."""
  names = native_mtp(read_entries(path), num_layers)
  have = {int(m.group(1)) for n in names if (m := re.match(r"^(?:model\.)?mtp\.(?:layers\.)?(\d+)\.e_proj\.", n))}
  if any(re.match(r"^(?:model\.)?mtp\.0\.main_proj\.", n) for n in names):
    have = {int(m.group(1)) for n in names if (m := re.match(r"^(?:model\.)?mtp\.(\d+)\.attn\.wq_a\.", n))}
  k = 0
  while k in have:
    k += 1
  return k


# model.hc_head.* is common to both save_pretrained and converted HF names
_SAVED_RE = re.compile(r"^model\.(layers\.\d+\.(attn\.|ffn\.|attn_norm\.|ffn_norm\.|hc_attn_|hc_ffn_))")


def detect_naming(tensor_names) -> str:
  """'nemo' | 'saved' (transformers save_pretrained) | 'hf' (transformers-converted) | 'original'."""
  tensor_names = list(native_mtp(dict.fromkeys(tensor_names), None))  # MTP stored as layers: original spelling
  if any(n.endswith((".sinks_param.weight", ".experts.gate_and_up_projs")) for n in tensor_names):
    return "nemo"  # NeMo Automodel's model (model.layers.N.{attn,self_attn}.sinks_param.weight, attn_hc.fn, ...)
  if any(_SAVED_RE.match(n) for n in tensor_names):
    # original module names under `model.` (+ `head.weight`): what transformers' save_pretrained writes
    hf_only = [n for n in tensor_names if re.search(r"\.(self_attn|mlp)\.", n)]
    if hf_only:
      raise CheckpointError(f"checkpoint mixes transformers save_pretrained names (model.layers.N.attn.*) and "
                            f"converted HF names (e.g. {hf_only[0]!r})")
    return "saved"
  hf = any(n.startswith(("model.", "lm_head.")) for n in tensor_names)
  orig = any(n.startswith(("layers.", "embed.", "head.", "hc_head_")) for n in tensor_names)
  if hf and orig:
    raise CheckpointError("checkpoint mixes HF names (model.*, lm_head.*) and original names (layers.*, embed.*)")
  if not (hf or orig):
    raise CheckpointError(f"cannot tell the naming: no model.*/lm_head.* (HF) nor layers.*/embed.* (original) "
                          f"tensor among {sorted(tensor_names)[:5]}")
  return "hf" if hf else "original"


def scale_pairs(entries: dict[str, Entry], naming: str) -> dict[str, str]:
  """weight name -> scale name."""
  pairs = {}
  for s in entries:
    # MTP tensors keep DeepSeek's spelling in every naming but NeMo's, so their `.scale` companions too
    if (naming == "original" or s.startswith("mtp.")) and s.endswith(".scale"):
      w = s[: -len(".scale")] + ".weight"
    elif naming == "original" and s.endswith(".weight_scale_inv"):  # save_pretrained of an FP8-quantized model
      w = s[: -len("_scale_inv")]
    elif naming in ("hf", "nemo") and s.endswith(".weight_scale_inv"):
      w = s[: -len("_scale_inv")]
    elif naming in ("hf", "nemo") and s.endswith("_scale_inv"):
      w = s[: -len("_scale_inv")]
    else:
      continue
    if w in entries:
      pairs[w] = s
  return pairs

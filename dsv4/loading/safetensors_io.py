"""Load DeepSeek-V4 safetensors checkpoints (original, HF, save_pretrained or NeMo naming, plain or FP8/FP4-
quantized) into the param tree.

    params = load_checkpoint("ckpt_dir_or_file", config)        # numpy float32 / int32 leaves
    # the writers, in safetensors_write:
    save_hf_safetensors(params, config, "out_dir", shard_bytes=..., quant=Quant(fp8_block=128, fp4_experts=True))
    save_original_safetensors(params, config, "out_dir", quant=...)

The parts: `safetensors_file` (the container: headers, tensor reads, file / sharded-directory writes),
`checkpoint_naming` (which naming a checkpoint uses, its MTP blocks, scale companions), `safetensors_write` (the
writers and their quantization), this module (loading, dequantization, validation, the load dtype).

Quantized tensors are recognised by dtype and by a scale companion:
* original naming: `<module>.weight` + `<module>.scale`;
* HF naming: `<module>.weight` + `<module>.weight_scale_inv`, `<param>` + `<param>_scale_inv` (transformers'
  fine-grained FP8 quantizer, e.g. `mlp.experts.gate_up_proj_scale_inv`).
F8_E4M3 weights are block-dequantized (block edge `fp8_block`, default 128 for V4, 32 for V4.1); I8/U8 weights with
a scale are FP4 e2m1 packed (see `quant.py` for the nibble order). Every tensor is then checked against the names
and shapes generated from the config (`names.py`); anything missing, unexpected, of the wrong shape or of the wrong
dtype raises `CheckpointError` naming the tensor, with expected vs found. MTP blocks load in every naming (see
`checkpoint_naming`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np

from dsv4.config import ModelConfig
from dsv4.loading import names, weights_digest
from dsv4.loading.checkpoint_naming import beyond_config_mtp, detect_naming, native_mtp, scale_pairs
from dsv4.loading.quant import FP4_GROUP, FP8_BLOCK, QuantError, dequant_fp4, dequant_fp8_block
from dsv4.loading.safetensors_file import FLOAT_DTYPES, CheckpointError, Entry, read_entries, read_tensor

_SCALE_DTYPES = {"F8_E8M0", "U8", "F32", "BF16", "F16"}


class _Expected(NamedTuple):
  """What the config says one stored tensor must be (after dequantization)."""
  shape: tuple[int, ...]
  integer: bool


def _dequant(e: Entry, scale: Entry | None, fp8_block: int, native: bool = False) -> np.ndarray:
  """Read one tensor; dequantize FP8 / FP4 when it has a scale. Returns float32 or integer arrays; with `native`,
  plain float tensors come back in their stored dtype as a view of the mapped file (the caller casts / copies)."""
  where = f"tensor {e.name!r} (in {e.file})"
  if scale is None:
    if e.dtype in ("F8_E4M3", "F8_E5M2"):
      raise CheckpointError(f"{where}: dtype {e.dtype} needs a block-scale tensor, none found")
    if native and e.dtype in FLOAT_DTYPES:
      return read_tensor(e, copy=False)
    a = read_tensor(e)
    return a.astype(np.float32) if e.dtype in FLOAT_DTYPES else a
  if scale.dtype not in _SCALE_DTYPES:
    raise CheckpointError(f"tensor {scale.name!r} (scale of {e.name!r}): dtype {scale.dtype}, expected one of "
                          f"{sorted(_SCALE_DTYPES)}")
  try:
    if e.dtype == "F8_E4M3":
      sc = read_tensor(scale)
      if len(e.shape) == 2 and tuple(sc.shape) == (e.shape[0], math.ceil(e.shape[1] / fp8_block)) \
          and e.shape[0] > fp8_block:
        # V4.1 Engram tables: per-row / 32-column scales
        return dequant_fp8_block(read_tensor(e), sc, (1, fp8_block))
      return dequant_fp8_block(read_tensor(e), sc, fp8_block)
    if e.dtype in ("I8", "U8"):
      return dequant_fp4(read_tensor(e), read_tensor(scale))
  except QuantError as ex:
    raise CheckpointError(f"{where} with scale {scale.name!r}: {ex}") from ex
  if e.dtype in FLOAT_DTYPES:
    raise CheckpointError(f"{where}: dtype {e.dtype} has a scale tensor {scale.name!r}, but only F8_E4M3 (FP8) or "
                          f"I8/U8 (packed FP4) weights are scaled")
  raise CheckpointError(f"{where}: dtype {e.dtype} cannot be dequantized (expected F8_E4M3 or packed-FP4 I8/U8)")


def _check(name: str, x: np.ndarray, want_shape, integer: bool, e: Entry, hf_name: str | None = None):
  alias = f" (HF {hf_name!r})" if hf_name and hf_name != name else ""
  where = f"tensor {name!r}{alias} in {e.file}"
  if integer and not np.issubdtype(x.dtype, np.integer):
    raise CheckpointError(f"{where}: dtype {e.dtype}, expected an integer dtype (I64/I32)")
  if not integer and not (np.issubdtype(x.dtype, np.floating) or x.dtype == ml_dtypes.bfloat16):
    raise CheckpointError(f"{where}: dtype {e.dtype}, expected a floating dtype (F32/BF16/F16, or F8_E4M3 / packed "
                          f"FP4 with a scale)")
  if tuple(x.shape) != tuple(want_shape):
    q = " after dequantization" if e.dtype in ("F8_E4M3", "I8", "U8") and not integer else ""
    raise CheckpointError(f"{where}: shape {list(x.shape)}{q}, expected {list(want_shape)}")


class _TreeBuilder:
  """Collects original-named tensors one at a time into the param tree, casting each to the target dtype as it
  arrives; a leaf is handed to `put` (e.g. jax.device_put) as soon as it is complete, so the host holds at most
  the tensors being converted plus the routed-expert leaves still being filled."""

  def __init__(self, config: ModelConfig, dtype, put, stack=None):
    # stack: joins per-expert device arrays on the device (None: experts are assembled in a host buffer)
    self.config, self.dtype, self.put, self.stack = config, np.dtype(dtype), put, stack
    self.specs = {s.name: s for s in names.original_specs(config)}
    self.params = names.empty_tree(config)
    self.left: dict = {}
    for sp in self.specs.values():
      self.left[sp.path] = self.left.get(sp.path, 0) + 1
    self.count = dict(self.left)  # routed-expert leaves: number of experts
    self.bufs: dict = {}
    self.qbufs: dict = {}
    self.hashers: dict = {}   # routed-expert leaf path -> LeafHasher (experts hashed as they arrive)

  def add(self, name: str, x: np.ndarray):
    sp = self.specs[name]
    xp = sp.to_param(x)
    if sp.integer:
      E = self.config.moe.n_routed_experts
      if xp.size and (xp.min() < 0 or xp.max() >= E):
        raise CheckpointError(f"tensor {name!r}: expert ids must lie in [0, {E}), found [{xp.min()}, {xp.max()}]")
      xp = xp.astype(np.int32)
    self.left[sp.path] -= 1
    if sp.path in self.qbufs:
      raise CheckpointError(f"tensor {name!r}: mixes FP4-kept and dense experts in one leaf")
    if sp.expert is None:
      # one fresh C-ordered host copy in the target dtype (never the mapped file itself), hashed while in hand
      leaf = np.ascontiguousarray(xp if sp.integer else np.array(xp, dtype=self.dtype, order="C"))
      self._set_leaf(sp.path, self.put(leaf), weights_digest.leaf_digest(leaf))
      return
    hasher = self.hashers.get(sp.path)
    if hasher is None:
      hasher = self.hashers[sp.path] = weights_digest.LeafHasher(self.dtype, (self.count[sp.path], *xp.shape))
    if self.stack is not None:  # one expert on the device at a time; stacked there when all have arrived
      part = self.bufs.setdefault(sp.path, {})
      piece = np.array(xp, dtype=self.dtype, order="C")
      hasher.add(sp.expert, piece)
      part[sp.expert] = self.put(piece)
      if self.left[sp.path] == 0:
        part = self.bufs.pop(sp.path)
        self._set_leaf(sp.path, self.stack([part[e] for e in range(self.count[sp.path])]),
                       self.hashers.pop(sp.path).hexdigest())
      return
    buf = self.bufs.get(sp.path)
    if buf is None:
      buf = self.bufs[sp.path] = np.empty((self.count[sp.path], *xp.shape), self.dtype)
    buf[sp.expert] = xp
    hasher.add(sp.expert, buf[sp.expert])
    if self.left[sp.path] == 0:
      self._set_leaf(sp.path, self.put(self.bufs.pop(sp.path)), self.hashers.pop(sp.path).hexdigest())

  def _set_leaf(self, path, leaf, digest: str) -> None:
    """Place a finished leaf; its digest (every byte, computed from the host copy that was in hand anyway) is
    remembered, so the KV tiers' weights fingerprint never re-reads the model."""
    names._set(self.params, path, leaf)
    weights_digest.remember(leaf, digest)

  def add_fp4(self, name: str, packed: np.ndarray, scale: np.ndarray):
    """A routed expert kept in FP4 (stored layout [out, in/2] + e8m0 scale [out, in/32]); see layers/expert_quant."""
    sp = self.specs[name]
    if sp.expert is None or sp.path in self.bufs:
      raise CheckpointError(f"tensor {name!r}: only routed experts can stay FP4, and all experts of a leaf must")
    q = self.qbufs.get(sp.path)
    if q is None:
      n = self.count[sp.path]
      q = self.qbufs[sp.path] = {"fp4": np.empty((n, *packed.shape), np.uint8),
                                 "scale": np.empty((n, *scale.shape), np.uint8)}
    q["fp4"][sp.expert], q["scale"][sp.expert] = packed, scale
    self.left[sp.path] -= 1
    if self.left[sp.path] == 0:
      q = self.qbufs.pop(sp.path)
      names._set(self.params, sp.path, {k: self.put(v) for k, v in q.items()})
      for k, v in q.items():
        weights_digest.remember(names._get(self.params, sp.path)[k], weights_digest.leaf_digest(v))

  def finish(self):
    todo = [p for p, n in self.left.items() if n]
    if todo:
      raise CheckpointError(f"param {'/'.join(map(str, todo[0]))}: not every tensor feeding it was loaded")
    return names.fill_derived(self.params, self.config)


def _fp4_bytes(e: Entry, scale: Entry, want_shape, where_name: str):
  """Packed FP4 weight and e8m0 scale as uint8 arrays, shapes checked against the dequantized `want_shape`."""
  R, C = want_shape[-2:]
  lead = tuple(want_shape[:-2])
  packed, sc = read_tensor(e).view(np.uint8), read_tensor(scale)
  if scale.dtype == "F8_E8M0":
    sc = sc.view(np.uint8)
  elif scale.dtype != "U8":
    raise CheckpointError(f"tensor {where_name!r}: keep_quantized needs e8m0 scales, found {scale.dtype} in "
                          f"{scale.name!r}")
  if tuple(packed.shape) != (*lead, R, C // 2) or tuple(sc.shape) != (*lead, R, C // FP4_GROUP):
    raise CheckpointError(f"tensor {where_name!r} (in {e.file}): packed FP4 shape {list(packed.shape)} / scale "
                          f"{list(sc.shape)} do not fit {list(want_shape)}")
  return packed, sc


# ----------------------------------------------------------------------------------------------------------
# Load dtype

_DTYPE_NAMES = {"fp32": np.float32, "float32": np.float32, "bf16": ml_dtypes.bfloat16, "bfloat16": ml_dtypes.bfloat16}


def resolve_dtype(dtype, path_or_entries=None) -> np.dtype:
  """The float dtype a load casts to: "auto" (the checkpoint's own, see `storage_dtype`; needs the checkpoint),
  float32 or bfloat16 (as a dtype or "fp32" / "float32" / "bf16" / "bfloat16"). Anything else is a ValueError: the
  model computes in fp32 or bf16 only."""
  if isinstance(dtype, str):
    if dtype == "auto":
      if path_or_entries is None:
        raise ValueError("dtype='auto' needs the checkpoint to read its storage dtype from")
      return storage_dtype(path_or_entries)
    if dtype not in _DTYPE_NAMES:
      raise ValueError(f"dtype must be 'auto', float32 or bfloat16 (or {sorted(_DTYPE_NAMES)}), got {dtype!r}")
    dtype = _DTYPE_NAMES[dtype]
  try:
    dt = np.dtype(dtype)
  except TypeError as e:
    raise ValueError(f"dtype must be 'auto', float32 or bfloat16, got {dtype!r}") from e
  if dt not in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)):
    raise ValueError(f"dtype must be 'auto', float32 or bfloat16, got {dt}")
  return dt


def storage_dtype(path_or_entries) -> np.dtype:
  """The float dtype a checkpoint stores its weights in, i.e. what dtype="auto" loads into.

  Counted over the plain float tensors (F32 / BF16 / F16 / F64) the loader reads, by element count; FP8 / FP4
  weights and their scale tensors are left out (the scales are F32 or E8M0 whatever the model's dtype):
  * BF16 holds the most elements -> bfloat16 (the released checkpoints: BF16 embeddings / norms / head, a few F32
    tensors such as router biases, FP8 / FP4 projections);
  * F32 (or F16 / F64, which the model does not compute in; float32 holds F16 exactly) -> float32;
  * no plain float tensor at all (everything quantized) -> bfloat16.
  Quantized tensors therefore dequantize into the dtype of the checkpoint's non-quantized float tensors."""
  entries = path_or_entries if isinstance(path_or_entries, dict) else read_entries(path_or_entries)
  entries = {k: v for k, v in native_mtp(entries, None).items() if not beyond_config_mtp(k, None)}
  if not entries:
    return np.dtype(ml_dtypes.bfloat16)
  naming = detect_naming(entries)
  scales = set(scale_pairs(entries, "original" if naming == "saved" else naming).values())
  counts: dict[str, int] = {}
  for k, e in entries.items():
    if k not in scales and e.dtype in FLOAT_DTYPES:
      counts[e.dtype] = counts.get(e.dtype, 0) + math.prod(e.shape)
  if not counts or max(counts, key=lambda d: (counts[d], d == "BF16")) == "BF16":
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(np.float32)


def load_checkpoint(path: str, config: ModelConfig, *, fp8_block: int | None = None, as_jax: bool = True,
                    strict: bool = True, dtype=np.float32, device=None, keep_quantized: bool = False):
  """Load a safetensors checkpoint (file, directory, or sharded directory with an index) into a param tree.

  Detects the naming (original, transformers-converted HF, transformers save_pretrained, NeMo; MTP blocks in each,
  see the module docstring; blocks beyond `config.num_mtp_layers` are ignored), dequantizes FP8
  (block `fp8_block`, default 128 for V4 and 32 for V4.1) and FP4 tensors, validates every tensor against the
  config. strict=False tolerates unexpected tensors (still validates the expected ones). Floating leaves are cast
  to `dtype` (float32 default; `ml_dtypes.bfloat16`; "auto" = the checkpoint's own, see `storage_dtype`). Shards
  are streamed: all headers are validated first, then tensors are read shard by shard, one at a time, and each
  finished leaf goes to the device (`device`: a jax Device / Sharding, default device when None) before the next
  is read. Returns jax arrays (as_jax) or numpy arrays. keep_quantized: FP4 routed experts stay packed with their
  e8m0 scales ({"fp4", "scale"} leaves, dequantized inside the MoE step: dsv4/layers/expert_quant.py).
  """
  fp8_block = fp8_block or FP8_BLOCK[config.variant]
  entries = native_mtp(read_entries(path), config.num_layers)
  entries = {k: v for k, v in entries.items() if not beyond_config_mtp(k, config)}
  if isinstance(dtype, str):
    dtype = resolve_dtype(dtype, entries)
  naming = detect_naming(entries)
  if naming == "saved":  # key by original name; each entry keeps its stored name for messages
    renamed = {}
    for k, e in entries.items():
      o = names.saved_to_original_name(k)
      if o in renamed:
        raise CheckpointError(f"tensors {renamed[o].name!r} and {k!r} both map to original name {o!r}")
      renamed[o] = e
    entries, naming = renamed, "original"
  pairs = scale_pairs(entries, naming)
  scale_names = set(pairs.values())

  orig_specs = names.original_specs(config)
  if naming == "original":
    specs = None
    expected = {s.name: _Expected(s.shape, s.integer) for s in orig_specs}
    hf_of = {s.name: (names.expert_target(s.name) or (names.original_to_hf_name(s.name),))[0] for s in orig_specs
             if s.path[0] != "mtp"}  # MTP blocks have no HF name
  else:
    specs = names.nemo_specs(config) if naming == "nemo" else names.hf_specs(config)
    expected = {n: _Expected(s.shape, s.integer) for n, s in specs.items()}
    hf_of = {n: n for n in specs} if naming == "hf" else {}
  stored = {k: e.name for k, e in entries.items()}

  present = set(entries) - scale_names
  missing = sorted(set(expected) - present)
  if missing:
    hint = ""
    if missing[0] + "_scale_inv" in entries or missing[0].removesuffix(".weight") + ".scale" in entries:
      hint = " (its scale tensor is present)"
    raise CheckpointError(f"tensor {missing[0]!r}{hint} is missing from {path} ({len(missing)} expected tensors "
                          f"missing{': ' + ', '.join(missing[1:4]) if len(missing) > 1 else ''})")
  unexpected = sorted(present - set(expected))
  if unexpected and strict:
    u = entries[unexpected[0]]
    raise CheckpointError(f"tensor {u.name!r} (in {u.file}) is not a {naming}-named tensor of config "
                          f"{config.name!r} ({len(unexpected)} unexpected)")
  # Shapes are checked from the headers before any data is read (a bad shard fails in seconds, not after
  # reading the ones before it); dequantized shapes are checked again after reading.
  for name, (shape, integer) in expected.items():
    e = entries[name]
    if not pairs.get(name) and tuple(e.shape) != tuple(shape):
      _check(stored[name], np.empty(e.shape, np.int32 if integer else np.float32), shape, integer, e, hf_of.get(name))

  if as_jax:
    put = (lambda x: jax.device_put(x, device)) if device is not None else jax.numpy.asarray
    stack = lambda xs: put(jax.numpy.stack(xs))  # noqa: E731
  else:
    put, stack = (lambda x: x), None
  builder = _TreeBuilder(config, dtype, put, stack)
  by_file: dict[str, list[str]] = {}
  for name in expected:
    by_file.setdefault(entries[name].file, []).append(name)
  for fp in sorted(by_file):
    for name in by_file[fp]:  # param-tree order within a shard
      e = entries[name]
      sc = entries.get(pairs.get(name, ""), None)
      # original-named: the tensor itself (also an HF directory's MTP tensors); else a renamed / stacked one
      orig = name if specs is None or specs[name].sources[0].name == name else None
      is_expert = (names._ANY_EXPERT_RE.match(name) is not None) if orig else specs[name].stacked   # MTP's too
      if keep_quantized and is_expert and sc is not None and e.dtype in ("I8", "U8"):
        packed, scale = _fp4_bytes(e, sc, expected[name].shape, stored[name])
        if orig:
          builder.add_fp4(name, packed, scale)
        else:  # stacked HF tensor: split rows per expert exactly like the dense tensor
          parts_p, parts_s = names.unstack_experts(name, packed), names.unstack_experts(name, scale)
          for s_ in specs[name].sources:
            key = (s_.expert, s_.name.split(".")[-2])
            builder.add_fp4(s_.name, parts_p[key], parts_s[key])
        continue
      x = _dequant(e, sc, fp8_block, native=True)
      _check(stored[name], x, expected[name].shape, expected[name].integer, e, hf_of.get(name))
      if orig:
        builder.add(name, x)
      else:
        split = names.nemo_tensor_to_original if naming == "nemo" else names.hf_tensor_to_original
        for oname, xo in split(name, x, specs[name]):
          builder.add(oname, xo)
      del x
  return builder.finish()

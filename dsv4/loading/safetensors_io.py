"""Read and write DeepSeek-V4 safetensors checkpoints (original, HF, save_pretrained or NeMo naming, plain or
FP8/FP4-quantized).

    params = load_checkpoint("ckpt_dir_or_file", config)        # numpy float32 / int32 leaves
    save_hf_safetensors(params, config, "out_dir", shard_bytes=..., quant=Quant(fp8_block=128, fp4_experts=True))
    save_original_safetensors(params, config, "out_dir", quant=...)

The safetensors container is parsed here (8-byte little-endian header length, JSON header, raw little-endian
data) rather than through the `safetensors` package: its numpy backend has no FP8/E8M0 dtypes, and parsing it
ourselves lets every failure (truncated file, garbage header, offsets out of range) name the file and tensor.

Quantized tensors are recognised by dtype and by a scale companion:
* original naming: `<module>.weight` + `<module>.scale`;
* HF naming: `<module>.weight` + `<module>.weight_scale_inv`, `<param>` + `<param>_scale_inv` (transformers'
  fine-grained FP8 quantizer, e.g. `mlp.experts.gate_up_proj_scale_inv`).
F8_E4M3 weights are block-dequantized (block edge `fp8_block`, default 128 for V4, 32 for V4.1); I8/U8 weights with
a scale are FP4 e2m1 packed (see `quant.py` for the nibble order). Every tensor is then checked against the names
and shapes generated from the config (`names.py`); anything missing, unexpected, of the wrong shape or of the wrong
dtype raises `CheckpointError` naming the tensor, with expected vs found.

MTP blocks load in every naming. transformers drops them, so HF-named directories carry them in DeepSeek's own
spelling, either as `mtp.K.*` (a hub directory) or as layer N + K (`model.layers.{N+K}.attn.*` and
`layers.{N+K}.e_proj.weight`, ...; what NeMo's adapter also reads and what the HF writers write); such a layer is
recognised by its `e_proj` and renamed to `mtp.K.*` before anything else. Blocks beyond the config's
`num_mtp_layers` are ignored (all of them by default).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct

import ml_dtypes
import numpy as np

from dsv4.config import ModelConfig
from dsv4.loading import names as N
from dsv4.loading import quant as Q
from dsv4.loading import weights_digest as WD

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_FLOAT_PLAIN = {"F64", "F32", "F16", "BF16"}
_INTEGER = {"I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8"}
_SCALE_DTYPES = {"F8_E8M0", "U8", "F32", "BF16", "F16"}
_MAX_HEADER = 100 * 2 ** 20


class CheckpointError(ValueError):
  """A checkpoint that does not fit the config. The message names the tensor (and file) and says what was
  expected and what was found."""


# ----------------------------------------------------------------------------------------------------------
# Container

@dataclasses.dataclass(frozen=True)
class _Entry:
  file: str
  name: str
  dtype: str
  shape: tuple[int, ...]
  start: int   # absolute byte offset in the file
  nbytes: int


def read_header(path: str) -> dict[str, _Entry]:
  """Parse and validate a safetensors header; returns name -> entry (no tensor data is read)."""
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      raw = f.read(8)
      if len(raw) < 8:
        raise CheckpointError(f"{path}: not a safetensors file (only {size} bytes, no header length)")
      (hlen,) = struct.unpack("<Q", raw)
      if hlen == 0 or hlen > _MAX_HEADER or 8 + hlen > size:
        raise CheckpointError(f"{path}: not a safetensors file or truncated (header length {hlen}, file size {size})")
      header = f.read(hlen)
  except OSError as e:
    raise CheckpointError(f"{path}: cannot read ({e})") from e
  try:
    meta = json.loads(header.decode("utf-8"))
    if not isinstance(meta, dict):
      raise ValueError("header is not a JSON object")
  except (UnicodeDecodeError, ValueError) as e:
    raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
  base, data_len = 8 + hlen, size - 8 - hlen
  out = {}
  for name, info in meta.items():
    if name == "__metadata__":
      continue
    try:
      dtype, shape, (b, e) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
    except (KeyError, TypeError, ValueError) as ex:
      raise CheckpointError(f"{path}: tensor {name!r}: malformed header entry {info!r}") from ex
    if dtype not in _DTYPES:
      raise CheckpointError(f"{path}: tensor {name!r}: unsupported dtype {dtype!r}")
    need = math.prod(shape) * _DTYPES[dtype].itemsize
    if not (0 <= b <= e) or e - b != need:
      raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {[b, e]} do not match dtype {dtype} and shape "
                            f"{list(shape)} ({need} bytes)")
    if e > data_len:
      raise CheckpointError(f"{path}: tensor {name!r}: data ends at byte {e} but the file holds only {data_len} "
                            f"data bytes (truncated file)")
    out[name] = _Entry(path, name, dtype, shape, base + b, need)
  return out


def _read(entry: _Entry, copy: bool = True) -> np.ndarray:
  """The tensor's data; copy=False returns a read-only view of the memory-mapped file (no host buffer)."""
  dt = _DTYPES[entry.dtype]
  if entry.nbytes == 0:
    return np.zeros(entry.shape, dt)
  arr = np.memmap(entry.file, dtype=np.uint8, mode="r", offset=entry.start, shape=(entry.nbytes,))
  if not copy:
    return arr.view(dt).reshape(entry.shape)
  return np.array(arr).view(dt).reshape(entry.shape)  # copies: the result owns its memory


def write_file(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str] | None = None) -> None:
  """Write one safetensors file (names sorted, 8-byte aligned header)."""
  header, off, arrays = {}, 0, []
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  for name in sorted(tensors):
    a = np.ascontiguousarray(tensors[name])
    if a.dtype not in _NAMES:
      raise CheckpointError(f"tensor {name!r}: dtype {a.dtype} cannot be stored in safetensors")
    header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
    off += a.nbytes
    arrays.append(a)
  h = json.dumps(header, separators=(",", ":")).encode()
  h += b" " * (-len(h) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(h)))
    f.write(h)
    for a in arrays:
      f.write(a.tobytes())


def _resolve_files(path: str) -> tuple[list[str], dict[str, str] | None]:
  """-> (files, weight_map or None)."""
  if os.path.isfile(path):
    return [path], None
  if not os.path.isdir(path):
    raise CheckpointError(f"{path}: no such checkpoint file or directory")
  idx = os.path.join(path, INDEX_FILE)
  if os.path.exists(idx):
    try:
      with open(idx) as f:
        wmap = json.load(f)["weight_map"]
      if not isinstance(wmap, dict):
        raise ValueError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise CheckpointError(f"{idx}: unreadable index file ({e!r})") from e
    files = sorted(set(wmap.values()))
    for fn in files:
      if not os.path.isfile(os.path.join(path, fn)):
        missing = sorted(k for k, v in wmap.items() if v == fn)[:3]
        raise CheckpointError(f"{idx}: shard {fn!r} (holding e.g. {missing}) does not exist")
    return [os.path.join(path, f) for f in files], {k: os.path.join(path, v) for k, v in wmap.items()}
  single = os.path.join(path, SINGLE_FILE)
  if os.path.isfile(single):
    return [single], None
  files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
  if not files:
    raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX_FILE}")
  return files, None


def read_entries(path: str) -> dict[str, _Entry]:
  """All tensor entries of a file or (sharded) directory, cross-checked against the index when there is one."""
  files, wmap = _resolve_files(path)
  entries: dict[str, _Entry] = {}
  for fp in files:
    for name, e in read_header(fp).items():
      if name in entries:
        raise CheckpointError(f"tensor {name!r} appears in two files: {entries[name].file} and {fp}")
      entries[name] = e
  if wmap is not None:
    for name, fp in wmap.items():
      if name not in entries or os.path.abspath(entries[name].file) != os.path.abspath(fp):
        where = "missing from every shard" if name not in entries else f"found in {entries[name].file}"
        raise CheckpointError(f"tensor {name!r}: the index maps it to {fp} but it is {where}")
    extra = sorted(set(entries) - set(wmap))
    if extra:
      raise CheckpointError(f"tensor {extra[0]!r} (in {entries[extra[0]].file}) is not listed in the index "
                            f"({len(extra)} such tensors)")
  return entries


# ----------------------------------------------------------------------------------------------------------
# Loading

_MTP_RE = re.compile(r"^(model\.)?mtp\.(layers\.)?(\d+)?")
_LEGACY_MTP_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.e_proj\.weight$")  # only an MTP block has an e_proj
_LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def _native_mtp(entries: dict, num_layers: int | None) -> dict:
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


def _ignored(name: str, config: ModelConfig | None) -> bool:
  """MTP / draft tensors beyond the config's MTP blocks (all of them when it has none, as HF drops them)."""
  m = _MTP_RE.match(name)
  if m is None:
    return False
  n = config.num_mtp_layers if config is not None else 0
  return m.group(3) is None or int(m.group(3)) >= n


def stored_mtp_blocks(path: str, num_layers: int) -> int:
  """How many MTP blocks (0, 1, ... with none missing) the checkpoint at `path` stores, in any naming: `mtp.K.*`,
  NeMo's `mtp.layers.K.*`, or layer num_layers + K. A block counts when its e_proj is there."""
  names = _native_mtp(read_entries(path), num_layers)
  have = {int(m.group(1)) for n in names if (m := re.match(r"^(?:model\.)?mtp\.(?:layers\.)?(\d+)\.e_proj\.", n))}
  k = 0
  while k in have:
    k += 1
  return k


_SAVED_RE = re.compile(r"^model\.(layers\.\d+\.(attn\.|ffn\.|attn_norm\.|ffn_norm\.|hc_attn_|hc_ffn_))")  # model.hc_head.* is common to both


def detect_naming(tensor_names) -> str:
  """'nemo' | 'saved' (transformers save_pretrained) | 'hf' (transformers-converted) | 'original'."""
  tensor_names = list(_native_mtp(dict.fromkeys(tensor_names), None))  # MTP stored as layers: original spelling
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


def _scale_pairs(entries: dict[str, _Entry], naming: str) -> dict[str, str]:
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


def _dequant(e: _Entry, scale: _Entry | None, fp8_block: int, native: bool = False) -> np.ndarray:
  """Read one tensor; dequantize FP8 / FP4 when it has a scale. Returns float32 or integer arrays; with `native`,
  plain float tensors come back in their stored dtype as a view of the mapped file (the caller casts / copies)."""
  where = f"tensor {e.name!r} (in {e.file})"
  if scale is None:
    if e.dtype in ("F8_E4M3", "F8_E5M2"):
      raise CheckpointError(f"{where}: dtype {e.dtype} needs a block-scale tensor, none found")
    if native and e.dtype in _FLOAT_PLAIN:
      return _read(e, copy=False)
    a = _read(e)
    return a.astype(np.float32) if e.dtype in _FLOAT_PLAIN else a
  if scale.dtype not in _SCALE_DTYPES:
    raise CheckpointError(f"tensor {scale.name!r} (scale of {e.name!r}): dtype {scale.dtype}, expected one of "
                          f"{sorted(_SCALE_DTYPES)}")
  try:
    if e.dtype == "F8_E4M3":
      sc = _read(scale)
      if len(e.shape) == 2 and tuple(sc.shape) == (e.shape[0], math.ceil(e.shape[1] / fp8_block)) \
          and e.shape[0] > fp8_block:
        # V4.1 Engram tables: per-row / 32-column scales
        return Q.dequant_fp8_block(_read(e), sc, (1, fp8_block))
      return Q.dequant_fp8_block(_read(e), sc, fp8_block)
    if e.dtype in ("I8", "U8"):
      return Q.dequant_fp4(_read(e), _read(scale))
  except Q.QuantError as ex:
    raise CheckpointError(f"{where} with scale {scale.name!r}: {ex}") from ex
  if e.dtype in _FLOAT_PLAIN:
    raise CheckpointError(f"{where}: dtype {e.dtype} has a scale tensor {scale.name!r}, but only F8_E4M3 (FP8) or "
                          f"I8/U8 (packed FP4) weights are scaled")
  raise CheckpointError(f"{where}: dtype {e.dtype} cannot be dequantized (expected F8_E4M3 or packed-FP4 I8/U8)")


def _check(name: str, x: np.ndarray, want_shape, integer: bool, e: _Entry, hf_name: str | None = None):
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
    self.specs = {s.name: s for s in N.original_specs(config)}
    self.params = N.empty_tree(config)
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
      self._set_leaf(sp.path, self.put(leaf), WD.leaf_digest(leaf))
      return
    hasher = self.hashers.get(sp.path)
    if hasher is None:
      hasher = self.hashers[sp.path] = WD.LeafHasher(self.dtype, (self.count[sp.path], *xp.shape))
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
    N._set(self.params, path, leaf)
    WD.remember(leaf, digest)

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
      N._set(self.params, sp.path, {k: self.put(v) for k, v in q.items()})
      for k, v in q.items():
        WD.remember(N._get(self.params, sp.path)[k], WD.leaf_digest(v))

  def finish(self):
    todo = [p for p, n in self.left.items() if n]
    if todo:
      raise CheckpointError(f"param {'/'.join(map(str, todo[0]))}: not every tensor feeding it was loaded")
    return N.fill_derived(self.params, self.config)


def _fp4_bytes(e: _Entry, scale: _Entry, want_shape, where_name: str):
  """Packed FP4 weight and e8m0 scale as uint8 arrays, shapes checked against the dequantized `want_shape`."""
  R, C = want_shape[-2:]
  lead = tuple(want_shape[:-2])
  packed, sc = _read(e).view(np.uint8), _read(scale)
  if scale.dtype == "F8_E8M0":
    sc = sc.view(np.uint8)
  elif scale.dtype != "U8":
    raise CheckpointError(f"tensor {where_name!r}: keep_quantized needs e8m0 scales, found {scale.dtype} in "
                          f"{scale.name!r}")
  if tuple(packed.shape) != (*lead, R, C // 2) or tuple(sc.shape) != (*lead, R, C // Q.FP4_GROUP):
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
  entries = {k: v for k, v in _native_mtp(entries, None).items() if not _ignored(k, None)}
  if not entries:
    return np.dtype(ml_dtypes.bfloat16)
  naming = detect_naming(entries)
  scales = set(_scale_pairs(entries, "original" if naming == "saved" else naming).values())
  counts: dict[str, int] = {}
  for k, e in entries.items():
    if k not in scales and e.dtype in _FLOAT_PLAIN:
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
  fp8_block = fp8_block or Q.FP8_BLOCK[config.variant]
  entries = _native_mtp(read_entries(path), config.num_layers)
  entries = {k: v for k, v in entries.items() if not _ignored(k, config)}
  if isinstance(dtype, str):
    dtype = resolve_dtype(dtype, entries)
  naming = detect_naming(entries)
  if naming == "saved":  # key by original name; each entry keeps its stored name for messages
    renamed = {}
    for k, e in entries.items():
      o = N.saved_to_original_name(k)
      if o in renamed:
        raise CheckpointError(f"tensors {renamed[o].name!r} and {k!r} both map to original name {o!r}")
      renamed[o] = e
    entries, naming = renamed, "original"
  pairs = _scale_pairs(entries, naming)
  scale_names = set(pairs.values())

  orig_specs = N.original_specs(config)
  if naming == "original":
    specs = None
    expected = {s.name: (s.shape, s.integer) for s in orig_specs}
    hf_of = {s.name: (N.expert_target(s.name) or (N.original_to_hf_name(s.name),))[0] for s in orig_specs
             if s.path[0] != "mtp"}  # MTP blocks have no HF name
  else:
    specs = N.nemo_specs(config) if naming == "nemo" else N.hf_specs(config)
    expected = {n: (s.shape, s.integer) for n, s in specs.items()}
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
    import jax
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
      is_expert = (N._ANY_EXPERT_RE.match(name) is not None) if orig else specs[name].stacked   # MTP's too
      if keep_quantized and is_expert and sc is not None and e.dtype in ("I8", "U8"):
        packed, scale = _fp4_bytes(e, sc, expected[name][0], stored[name])
        if orig:
          builder.add_fp4(name, packed, scale)
        else:  # stacked HF tensor: split rows per expert exactly like the dense tensor
          parts_p, parts_s = N.unstack_experts(name, packed), N.unstack_experts(name, scale)
          for s_ in specs[name].sources:
            key = (s_.expert, s_.name.split(".")[-2])
            builder.add_fp4(s_.name, parts_p[key], parts_s[key])
        continue
      x = _dequant(e, sc, fp8_block, native=True)
      _check(stored[name], x, expected[name][0], expected[name][1], e, hf_of.get(name))
      if orig:
        builder.add(name, x)
      else:
        split = N.nemo_tensor_to_original if naming == "nemo" else N.hf_tensor_to_original
        for oname, xo in split(name, x, specs[name]):
          builder.add(oname, xo)
      del x
  return builder.finish()


# ----------------------------------------------------------------------------------------------------------
# Writing

@dataclasses.dataclass(frozen=True)
class Quant:
  """How the writers quantize (for round-trip tests and small exports).

  fp8_block: FP8 e4m3 + e8m0 block scales for the dense projections (None: keep float).
  fp4_experts: FP4 e2m1 + per-row/32-column e8m0 scales for the routed experts.
  """
  fp8_block: int | None = 128
  fp4_experts: bool = True


# Dense projections that ship FP8 in the released checkpoints: attention q/kv/o, the indexer query, shared experts.
# Compressor / indexer-compressor wkv, wgate, weights_proj, the router, norms, mHC, embed and head stay float. An
# MTP block is quantized like a layer, plus its e_proj / h_proj (NeMo's adapter expects scales for them).
_FP8_ORIG = re.compile(r"^(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                       r"|ffn\.shared_experts\.w[123]|engram\.wkv|e_proj|h_proj)\.weight$")
_FP8_ROWS_ORIG = re.compile(r"^layers\.\d+\.engram\.embed\.weight$")  # V4.1 Engram table: per-row/32-col scales
_FP4_ORIG = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")


def _quantize_dict(tensors: dict[str, np.ndarray], config: ModelConfig, quant: Quant | None, naming: str):
  if quant is None:
    return tensors
  out = {}
  to_orig = {}
  if naming == "hf":
    for s in N.original_specs(config):
      to_orig[(N.expert_target(s.name) or (N.original_to_hf_name(s.name),))[0]] = s.name
    to_orig.update({v: k for k, v in N.hf_mtp_export_names(config).items()})
  for name, x in tensors.items():
    orig = to_orig.get(name, name)
    dot_scale = naming == "original" or orig.startswith("mtp.")  # DeepSeek's spelling, DeepSeek's scale names
    if quant.fp8_block and (_FP8_ORIG.match(orig) or _FP8_ROWS_ORIG.match(orig)):
      q, s = Q.quantize_fp8_block(x, quant.fp8_block if _FP8_ORIG.match(orig) else (1, quant.fp8_block))
      out[name] = q
      out[name[: -len(".weight")] + (".scale" if dot_scale else ".weight_scale_inv")] = s
    elif quant.fp4_experts and (_FP4_ORIG.match(orig) or (naming == "hf" and re.search(r"\.mlp\.experts\.", name))):
      q, s = Q.quantize_fp4(x)
      out[name] = q
      out[name[: -len(".weight")] + ".scale" if dot_scale else name + "_scale_inv"] = s
    else:
      out[name] = x
  return out


def _write_dir(tensors: dict[str, np.ndarray], path: str, shard_bytes: int | None, fmt: str) -> list[str]:
  os.makedirs(path, exist_ok=True)
  if not shard_bytes:
    write_file(tensors, os.path.join(path, SINGLE_FILE), {"format": fmt})
    return [os.path.join(path, SINGLE_FILE)]
  shards, cur, cur_bytes = [], {}, 0
  for name in sorted(tensors):
    nb = np.asarray(tensors[name]).nbytes
    if cur and cur_bytes + nb > shard_bytes:
      shards.append(cur)
      cur, cur_bytes = {}, 0
    cur[name] = tensors[name]
    cur_bytes += nb
  if cur:
    shards.append(cur)
  wmap, files = {}, []
  for i, shard in enumerate(shards):
    fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    write_file(shard, os.path.join(path, fn), {"format": fmt})
    files.append(os.path.join(path, fn))
    wmap.update({k: fn for k in shard})
  total = sum(np.asarray(t).nbytes for t in tensors.values())
  with open(os.path.join(path, INDEX_FILE), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}, f, indent=1)
  return files


def _np_params(params):
  import jax
  return jax.tree_util.tree_map(lambda x: np.asarray(x), params)


def hf_state_dict(params, config: ModelConfig) -> dict[str, np.ndarray]:
  """HF-named numpy tensors (float32, tid2eid int64 as in transformers)."""
  t = N.original_to_hf(N.params_to_original(_np_params(params), config), config)
  return {k: (v.astype(np.int64) if np.issubdtype(v.dtype, np.integer) else v.astype(np.float32)) for k, v in t.items()}


def save_hf_safetensors(params, config: ModelConfig, path: str, *, shard_bytes: int | None = None,
                        quant: Quant | None = None) -> list[str]:
  """Write params with HF names into directory `path` (one file, or shards + index when shard_bytes is set)."""
  t = _quantize_dict(hf_state_dict(params, config), config, quant, "hf")
  return _write_dir(t, path, shard_bytes, "pt")


def save_original_safetensors(params, config: ModelConfig, path: str, *, shard_bytes: int | None = None,
                              quant: Quant | None = None) -> list[str]:
  """Write params with the original checkpoint names (per-expert tensors, `.scale` companions)."""
  t = N.params_to_original(_np_params(params), config)
  t = {k: (v.astype(np.int32) if np.issubdtype(v.dtype, np.integer) else v.astype(np.float32)) for k, v in t.items()}
  return _write_dir(_quantize_dict(t, config, quant, "original"), path, shard_bytes, "pt")


NAMINGS = ("original", "hf", "saved", "nemo")


def save_checkpoint(params, config: ModelConfig, path: str, *, naming: str = "original",
                    shard_bytes: int | None = None, quant: Quant | None = None, dtype=np.float32) -> list[str]:
  """Write params in any naming the loader reads: "original", "hf" (transformers-converted; MTP blocks as layers
  N + K in DeepSeek's spelling), "saved" (transformers save_pretrained) or "nemo" (NeMo Automodel's model
  state_dict, `deepseek_v4` / `deepseek_v41`; quant must be None). Floating tensors are stored as `dtype`
  (float32, or ml_dtypes.bfloat16 like the released checkpoints)."""
  if naming not in NAMINGS:
    raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")
  t = N.params_to_original(_np_params(params), config)
  t = {k: (v.astype(np.int32) if np.issubdtype(v.dtype, np.integer) else v.astype(dtype)) for k, v in t.items()}
  if naming == "hf":
    t = {k: (v.astype(np.int64) if np.issubdtype(v.dtype, np.integer) else v) for k, v in
         N.original_to_hf(t, config).items()}
    return _write_dir(_quantize_dict(t, config, quant, "hf"), path, shard_bytes, "pt")
  if naming == "nemo":
    if quant is not None:
      raise ValueError("save_checkpoint: quantized NeMo checkpoints are not written (NeMo stores them dequantized)")
    return _write_dir(N.original_to_nemo(t, config), path, shard_bytes, "pt")
  t = _quantize_dict(t, config, quant, "original")
  if naming == "saved":
    t = {N.original_to_saved_name(k): v for k, v in t.items()}
  return _write_dir(t, path, shard_bytes, "pt")

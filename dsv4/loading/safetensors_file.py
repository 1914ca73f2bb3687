"""The safetensors container: parse and validate headers, read tensors (memory-mapped), write files and sharded
directories with an index. No model knowledge: names and shapes are checked by `safetensors_io.load_checkpoint`.

The container is parsed here (8-byte little-endian header length, JSON header, raw little-endian data) rather than
through the `safetensors` package: its numpy backend has no FP8/E8M0 dtypes, and parsing it ourselves lets every
failure (truncated file, garbage header, offsets out of range) name the file and tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct

import ml_dtypes
import numpy as np

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
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}   # plain (unscaled) float tensors
_MAX_HEADER = 100 * 2 ** 20


class CheckpointError(ValueError):
  """A checkpoint that does not fit the config. The message names the tensor (and file) and says what was
  expected and what was found."""


@dataclasses.dataclass(frozen=True)
class Entry:
  """Where one tensor lies in a safetensors file (read with `read_tensor`)."""
  file: str
  name: str
  dtype: str
  shape: tuple[int, ...]
  start: int   # absolute byte offset in the file
  nbytes: int


def read_header(path: str) -> dict[str, Entry]:
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
    out[name] = Entry(path, name, dtype, shape, base + b, need)
  return out


def read_tensor(entry: Entry, copy: bool = True) -> np.ndarray:
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


def read_entries(path: str) -> dict[str, Entry]:
  """All tensor entries of a file or (sharded) directory, cross-checked against the index when there is one."""
  files, wmap = _resolve_files(path)
  entries: dict[str, Entry] = {}
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


def write_dir(tensors: dict[str, np.ndarray], path: str, shard_bytes: int | None, fmt: str) -> list[str]:
  """Write `tensors` into directory `path`: one model.safetensors, or (shard_bytes set) shards of at most about
  shard_bytes each plus the index file. Returns the files written."""
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

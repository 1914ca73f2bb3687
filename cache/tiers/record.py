"""One record = one cache block's arrays (every layer) with a header that says exactly what it is.

Byte layout (little-endian):

    b"DSV4KVR1" | u32 header_len | header (UTF-8 JSON) | payload (arrays, raw, in header order) | 16 B checksum

checksum = blake2b-128 over everything before it, so a truncated record, a flipped bit anywhere, or a record cut
and spliced from two writes is rejected. The header carries the format version, the full fingerprint (model digest,
tokenizer / chat template id, layout fingerprint, tenant, adapter), the kind (group name), the block's chained
128-bit digest and its parent, the token span and the block's own token ids, and the array manifest.

A record is *addressed* by `record_key(fingerprint, kind, digest)`: the fingerprint is part of the key, so another
model / layout / tenant never even looks up the same key. The key may be truncated (`key_bits`, tests only) to
force collisions; `decode` therefore checks every header field against what the reader expects, and a key
collision can never hand another tenant's or prefix's rows to a request.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct

import ml_dtypes
import numpy as np

MAGIC = b"DSV4KVR1"
FORMAT_VERSION = 1
CHECKSUM_BYTES = 16


class RecordError(ValueError):
  """A record that must not be used (corrupt, truncated, or not what the reader asked for)."""


def dtype_str(dtype) -> str:
  """The manifest's name of an array dtype: numpy's own string for numpy types ("<f4", "<i4", "|u1"), the type's
  name for ml_dtypes types ("bfloat16", "float8_e4m3fn"), whose numpy string ("<V2", "<V1") would read back as
  raw void bytes."""
  dt = np.dtype(dtype)
  if dt.kind == "V":
    if not hasattr(ml_dtypes, dt.name):
      raise ValueError(f"record: no manifest name for dtype {dt!r}")
    return dt.name
  return dt.str


def np_dtype(name: str) -> np.dtype:
  """The numpy dtype a manifest entry names (`dtype_str`'s inverse); a raw void type is refused."""
  dt = np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)
  if dt.kind == "V" and not hasattr(ml_dtypes, dt.name):
    raise ValueError(f"record: manifest dtype {name!r} is raw bytes, not a number type")
  return dt


@dataclasses.dataclass(frozen=True)
class Fingerprint:
  """Everything besides the tokens that decides whether a stored block may be reused."""
  model: str            # model digest (weights identity)
  tokenizer: str        # tokenizer / chat template id
  layout: str           # cache layout fingerprint: block sizes, dtypes, array shapes, record format
  tenant: str = ""      # tenant / security domain
  adapter: str = ""     # LoRA / adapter id

  def blob(self) -> bytes:
    out = b""
    for v in (self.model, self.tokenizer, self.layout, self.tenant, self.adapter):
      b = v.encode("utf-8")
      out += len(b).to_bytes(4, "little") + b
    return out


@dataclasses.dataclass(frozen=True)
class ArrayEntry:
  name: str             # e.g. "L3/window_kv"
  dtype: str            # `dtype_str`: numpy's string ("<f4", "|u1") or an ml_dtypes name ("bfloat16", "float8_e4m3fn")
  shape: tuple[int, ...]

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * np_dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class RecordHeader:
  fingerprint: Fingerprint
  kind: str             # cache group of the block ("full" or "swa")
  digest: bytes         # chained digest naming the prefix [0, start + num_tokens)
  parent: bytes         # chained digest of the prefix before the block
  start: int            # first token position of the block
  tokens: tuple[int, ...]
  arrays: tuple[ArrayEntry, ...]
  version: int = FORMAT_VERSION

  @property
  def payload_bytes(self) -> int:
    return sum(a.nbytes for a in self.arrays)


def record_key(fp: Fingerprint, kind: str, digest: bytes, key_bits: int = 128) -> str:
  h = hashlib.blake2b(b"dsv4/tier/1", digest_size=16)
  h.update(fp.blob())
  h.update(kind.encode() + b"\0")
  h.update(digest)
  k = int.from_bytes(h.digest(), "big")
  if key_bits < 128:
    k &= (1 << key_bits) - 1
  return f"dsv4kv:{k:032x}"


def _header_json(h: RecordHeader) -> bytes:
  d = {"version": h.version, "fingerprint": dataclasses.asdict(h.fingerprint), "kind": h.kind,
       "digest": h.digest.hex(), "parent": h.parent.hex(), "start": h.start, "tokens": list(h.tokens),
       "arrays": [[a.name, a.dtype, list(a.shape)] for a in h.arrays]}
  return json.dumps(d, separators=(",", ":"), sort_keys=True).encode()


def encode(header: RecordHeader, arrays: list[np.ndarray]) -> bytes:
  if len(arrays) != len(header.arrays):
    raise ValueError(f"encode: {len(arrays)} arrays for a manifest of {len(header.arrays)}")
  parts = []
  for a, e in zip(arrays, header.arrays):
    dt = np_dtype(e.dtype)
    if np.asarray(a).dtype != dt:     # raw bytes are stored as they are: never a silent conversion
      raise ValueError(f"encode: array {e.name} is {np.asarray(a).dtype}, manifest says {e.dtype}")
    a = np.ascontiguousarray(a)
    if a.shape != e.shape:
      raise ValueError(f"encode: array {e.name} has shape {a.shape}, manifest says {e.shape}")
    parts.append(a.tobytes())
  hj = _header_json(header)
  body = MAGIC + struct.pack("<I", len(hj)) + hj + b"".join(parts)
  return body + hashlib.blake2b(body, digest_size=CHECKSUM_BYTES).digest()


def _parse_header(d: dict) -> RecordHeader:
  return RecordHeader(Fingerprint(**d["fingerprint"]), d["kind"], bytes.fromhex(d["digest"]),
                      bytes.fromhex(d["parent"]), int(d["start"]), tuple(int(t) for t in d["tokens"]),
                      tuple(ArrayEntry(n, dt, tuple(int(s) for s in sh)) for n, dt, sh in d["arrays"]),
                      int(d["version"]))


def peek_header(data: bytes) -> RecordHeader:
  """The header of a record after the integrity check (checksum over the whole record)."""
  if len(data) < len(MAGIC) + 4 + CHECKSUM_BYTES:
    raise RecordError(f"truncated record ({len(data)} bytes)")
  if data[:len(MAGIC)] != MAGIC:
    raise RecordError("not a dsv4 KV record (bad magic)")
  body, check = data[:-CHECKSUM_BYTES], data[-CHECKSUM_BYTES:]
  if hashlib.blake2b(body, digest_size=CHECKSUM_BYTES).digest() != check:
    raise RecordError("checksum mismatch (truncated or corrupted record)")
  (hl,) = struct.unpack_from("<I", data, len(MAGIC))
  off = len(MAGIC) + 4
  if off + hl > len(body):
    raise RecordError("header length past the end of the record")
  try:
    h = _parse_header(json.loads(body[off:off + hl]))
    for a in h.arrays:
      np_dtype(a.dtype)
  except (ValueError, KeyError, TypeError) as e:
    raise RecordError(f"unreadable header ({e})") from e
  if h.version != FORMAT_VERSION:
    raise RecordError(f"record format version {h.version}, reader wants {FORMAT_VERSION}")
  if off + hl + h.payload_bytes != len(body):
    raise RecordError(f"payload is {len(body) - off - hl} bytes, manifest says {h.payload_bytes}")
  return h


@dataclasses.dataclass(frozen=True)
class Expect:
  """What the reader asked for; every field must match the stored header."""
  fingerprint: Fingerprint
  kind: str
  digest: bytes
  parent: bytes
  start: int
  tokens: tuple[int, ...]
  arrays: tuple[ArrayEntry, ...]


def decode(data: bytes, expect: Expect) -> list[np.ndarray]:
  """Arrays of a record, or RecordError saying why it must not be used."""
  h = peek_header(data)
  if h.fingerprint != expect.fingerprint:
    diff = [f.name for f in dataclasses.fields(Fingerprint)
            if getattr(h.fingerprint, f.name) != getattr(expect.fingerprint, f.name)]
    raise RecordError(f"fingerprint mismatch in {diff}")
  for name in ("kind", "digest", "parent", "start", "tokens", "arrays"):
    if getattr(h, name) != getattr(expect, name):
      raise RecordError(f"header field {name!r} differs from the request's")
  out, off = [], len(MAGIC) + 4 + struct.unpack_from("<I", data, len(MAGIC))[0]
  for e in h.arrays:
    out.append(np.frombuffer(data, dtype=np_dtype(e.dtype), count=int(np.prod(e.shape, dtype=np.int64)),
                             offset=off).reshape(e.shape))
    off += e.nbytes
  return out

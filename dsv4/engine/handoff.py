"""A request's whole attention state as records, for handing a prefilled request from one engine to another.

A prefill engine ran a prompt of L tokens and sampled the first token; the receiver resumes at L exactly, computing
nothing of the prompt. The state a resume at L reads has two parts:

* **aligned**, up to P = the last multiple of `align_tokens` at or before L: every full-history block before P
  (compressed KV and indexer keys of every layer) and the sliding-window tail of P (window rows, the compressors'
  state rows, V4.1's Engram token ids). It is exactly what a tier reload at P reads, and it travels as the same
  records: the receiver puts them into its first tier, where the admission's load path (`Tiering.on_admit`) finds
  them (and they stay reusable there like any demoted block).
* **tail**, [P, L): the blocks of every group from P on up to L, the last of each group usually partially filled:
  the window rows, the compressor state row of each swa block (the running pool's pending rows after L - 1), the
  compressed entries and index keys completed so far in the partial full block, Engram token ids, and the MTP
  block's window layer when the model has one (every array of a group travels: the record manifest is the group's).
  The receiver keeps these rows in memory (`Tiering.handed_tails`) and, once the admission has reached P, writes them
  into blocks the request owns (`KVCacheManager.extend_for_import`) and commits L: the complete ones are registered as
  after a step, a partial last block stays the request's own until a later step completes it.

`export_state` reads both parts straight from the finishing request's own block tables (called while it still holds
its blocks, before they are freed). A complete block's record is named by its chained digest as in the tiers; a
partial block by a digest over the chain before it and its own tokens (`_partial_digest`). `import_state` checks
every record against what the receiving engine expects for the same tokens and tenant (checksum, fingerprint,
digest, parent, tokens, manifest) and only if ALL of them pass stores anything: a receiver never admits a request
on part of a state."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from cache.hashing import DIGEST_BYTES
from cache.tiers import record
from dsv4 import caches
from dsv4.engine.tiering import HandedTail, _Ident


class HandoffError(RuntimeError):
  """The state cannot be exported or is not what the receiver expects (the caller falls back)."""


@dataclasses.dataclass(frozen=True)
class StatePlan:
  point: int                      # L: tokens the state covers (every known token but the last)
  aligned_point: int              # P: the part a tier reload at an aligned point covers
  keys: tuple[str, ...]           # record keys: the aligned part (full blocks, then the window tail), then the tail
  num_aligned: int                # how many of `keys` are the aligned part
  payload_bytes: int              # array bytes of all records (what benchmarks.sizing computes for the state)


def resume_points(engine, num_tokens: int) -> tuple[int, int]:
  """(L, P) for `num_tokens` known tokens: the state covers L = num_tokens - 1 (the last token is always computed),
  of which the aligned part covers P."""
  a = engine.managers[0].specs.align_tokens
  L = num_tokens - 1
  return L, L // a * a


def _partial_digest(h, tokens, end: int) -> bytes:
  """Names the prefix [0, end) when `end` is not a multiple of the hash unit: the chained digest of the complete
  units before it (which covers the extra keys) and the remaining tokens. Never a device key: a partial block is
  never cached."""
  G = h.hash_tokens
  u = end // G
  rest = np.asarray(tokens[u * G:end], "<i4").tobytes()
  return hashlib.blake2b(b"dsv4/kv/partial" + h.parent(u) + rest, digest_size=DIGEST_BYTES).digest()


def _partial_ident(t, h, fp, tokens, group: str, j: int, end: int) -> _Ident:
  bt = t.groups[group].block_tokens
  d = _partial_digest(h, tokens, end)
  return _Ident(group, record.record_key(fp, group, d, t.tc.key_bits), fp, d, h.parent(j * bt // h.hash_tokens), j * bt,
                tuple(int(x) for x in tokens[j * bt:end]))


def _idents(engine, tokens, extra):
  """(L, P, aligned identities, tail identities) of the state for `tokens` (prompt + first token)."""
  t = engine.tiering
  if t is None:
    raise HandoffError("state handoff needs the engine's tier glue (EngineConfig.tiering, tiers may be empty)")
  L, P = resume_points(engine, len(tokens))
  h, fp = t._hasher(extra, tokens), t._fingerprint(extra)
  aligned = []
  if P > 0:
    nfull, swa = t._required(0, P, len(tokens))
    if caches.FULL in t.groups:
      aligned += [t._ident_of(h, fp, tokens, caches.FULL, j) for j in range(nfull)]
    aligned += [t._ident_of(h, fp, tokens, caches.SWA, j) for j in sorted(swa)]
  tail = []
  for g in (caches.FULL, caches.SWA):
    if g not in t.groups:
      continue
    bt = t.groups[g].block_tokens
    for j in range(P // bt, -(-L // bt)):
      tail.append(t._ident_of(h, fp, tokens, g, j) if (j + 1) * bt <= L else _partial_ident(t, h, fp, tokens, g, j, L))
  return L, P, aligned, tail


def _plan(t, L, P, aligned, tail) -> StatePlan:
  ids = aligned + tail
  return StatePlan(L, P, tuple(i.key for i in ids), len(aligned),
                   sum(sum(a.nbytes for a in t.manifest[i.group]) for i in ids))


def plan(engine, tokens, extra) -> StatePlan:
  return _plan(engine.tiering, *_idents(engine, tokens, extra))


def export_state(engine, req, extra) -> tuple[StatePlan, list[bytes]]:
  """Records of the whole state of a request that has just finished its prompt (prompt + first token known, the
  prompt computed), read from the blocks it still holds: call it before the engine frees them (`Engine.on_finish`).
  HandoffError if the request does not hold every block of its state."""
  t = engine.tiering
  tokens = req.all_tokens
  L, P, aligned, tail = _idents(engine, tokens, extra)
  if req.num_computed != L:
    raise HandoffError(f"the request computed {req.num_computed} tokens, its state covers {L}")
  tabs = engine.managers[req.shard].block_tables(req.rid)
  ids = aligned + tail
  out: list[bytes | None] = [None] * len(ids)
  for g in {i.group for i in ids}:
    bt = t.groups[g].block_tokens
    which = [n for n, i in enumerate(ids) if i.group == g]
    blocks = [int(tabs[g][ids[n].start // bt]) if ids[n].start // bt < len(tabs[g]) else -1 for n in which]
    if min(blocks) < 0:
      n = which[blocks.index(min(blocks))]
      raise HandoffError(f"the request no longer holds its {g} block at {ids[n].start}")
    rows = t._read(g, [(req.shard, b) for b in blocks])
    for k, n in enumerate(which):
      i = ids[n]
      hdr = record.RecordHeader(i.fp, g, i.digest, i.parent, i.start, i.tokens, t.manifest[g])
      out[n] = record.encode(hdr, [r[k] for r in rows])
  return _plan(t, L, P, aligned, tail), out


def import_state(engine, request_id: str, tokens, extra, records: list[bytes]) -> StatePlan:
  """Verify every record against the receiver's own expectation for these tokens, then put the aligned part into
  its first tier and keep the tail for `request_id`'s admission. HandoffError (nothing stored) if any record is
  missing, extra, corrupt or foreign."""
  t = engine.tiering
  L, P, aligned, tail = _idents(engine, tokens, extra)
  ids = aligned + tail
  if len(records) != len(ids):
    raise HandoffError(f"incomplete state: {len(records)} records, the state at {L} has {len(ids)}")
  if aligned and not t.store.tiers:
    raise HandoffError("the receiving engine has no tier to hold the state (TieringConfig.tiers is empty)")
  arrays = []
  for i, data in zip(ids, records):
    try:
      arrays.append(record.decode(data, record.Expect(i.fp, i.group, i.digest, i.parent, i.start, i.tokens,
                                                      t.manifest[i.group])))
    except record.RecordError as e:
      raise HandoffError(f"state record {i.group}@{i.start} rejected: {e}") from None
  if aligned:
    first = t.store.tiers[0]
    for i, data in zip(aligned, records):
      if not first.put(i.key, data, i.fp.tenant):
        raise HandoffError(f"the receiver's {first.name} tier refused a state record (capacity or quota)")
  if tail:
    rows: dict[str, dict[int, list[np.ndarray]]] = {}
    for i, a in zip(tail, arrays[len(aligned):]):
      rows.setdefault(i.group, {})[i.start // t.groups[i.group].block_tokens] = [np.array(x) for x in a]
    t.handed_tails[request_id] = HandedTail(P, L, tuple(int(x) for x in tokens[:L]), rows)
  return _plan(t, L, P, aligned, tail)

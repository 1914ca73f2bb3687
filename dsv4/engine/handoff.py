"""A request's whole attention state as records, for handing a prefilled request from one engine to another.

The state a resume at an aligned point P reads is exactly what a tier reload at P reads: every full-history block
before P (compressed KV and indexer keys of every layer) and the sliding-window tail of P (window rows, the
compressors' pending state rows, V4.1's Engram token ids). `export_state` encodes those blocks, read straight off
the device after the prefill engine finished the request (its blocks are then registered in the device prefix
cache), as the same fingerprinted, checksummed records the tiers store (`cache.tiers.record`). `import_state`
checks every record against what the receiving engine expects for the same tokens and tenant (checksum,
fingerprint, digest, parent, tokens, manifest) and, only if ALL of them pass, puts them into that engine's first
tier, where the admission's load path (`Tiering.on_admit`) finds them. It is all or nothing: a receiver never
admits a request on part of a state.

P is the last aligned point before the request's final known token, so the unaligned prompt tail (fewer than
`align_tokens` tokens) is computed by the receiver, as after any prefix hit; nothing before P is."""

from __future__ import annotations

import dataclasses

from cache.tiers import record as R
from dsv4 import caches


class HandoffError(RuntimeError):
  """The state cannot be exported or is not what the receiver expects (the caller falls back)."""


@dataclasses.dataclass(frozen=True)
class StatePlan:
  point: int                      # P: tokens the state covers
  keys: tuple[str, ...]           # record keys, full blocks first, then the window tail
  payload_bytes: int              # array bytes of all records (what benchmarks.sizing computes for the state)


def resume_point(engine, num_tokens: int) -> int:
  """The aligned point a state for `num_tokens` known tokens covers (the last token is always computed)."""
  a = engine.managers[0].specs.align_tokens
  return (num_tokens - 1) // a * a


def _idents(engine, tokens, extra):
  t = engine.tiering
  if t is None:
    raise HandoffError("state handoff needs the engine's tier glue (EngineConfig.tiering, tiers may be empty)")
  P = resume_point(engine, len(tokens))
  if P <= 0:
    return P, []
  h, fp = t._hasher(extra, tokens), t._fingerprint(extra)
  nfull, swa = t._required(0, P, len(tokens))
  ids = [t._ident_of(h, fp, tokens, caches.FULL, j) for j in range(nfull)] if caches.FULL in t.groups else []
  ids += [t._ident_of(h, fp, tokens, caches.SWA, j) for j in sorted(swa or ())]
  return P, ids


def plan(engine, tokens, extra) -> StatePlan:
  t = engine.tiering
  P, ids = _idents(engine, tokens, extra)
  return StatePlan(P, tuple(i.key for i in ids), sum(sum(a.nbytes for a in t.manifest[i.group]) for i in ids))


def export_state(engine, tokens, extra) -> tuple[StatePlan, list[bytes]]:
  """Records of the state at `resume_point` of `tokens`, read from the device cache (call right after the request
  finished, before another step can evict its blocks). HandoffError if a block is no longer resident."""
  t = engine.tiering
  P, ids = _idents(engine, tokens, extra)
  t._process_events()
  locs = [t._resident_by_key.get(i.key) for i in ids]
  missing = [i for i, loc in zip(ids, locs) if loc is None]
  if missing:
    raise HandoffError(f"{len(missing)} of {len(ids)} state blocks are not resident on the device "
                       f"(first: {missing[0].group} block at {missing[0].start})")
  out: list[bytes | None] = [None] * len(ids)
  for g in {i.group for i in ids}:
    which = [n for n, i in enumerate(ids) if i.group == g]
    rows = t._read(g, [(locs[n][0], locs[n][2]) for n in which])
    for k, n in enumerate(which):
      i = ids[n]
      hdr = R.RecordHeader(i.fp, g, i.digest, i.parent, i.start, i.tokens, t.manifest[g])
      out[n] = R.encode(hdr, [r[k] for r in rows])
  return plan(engine, tokens, extra), out


def import_state(engine, tokens, extra, records: list[bytes]) -> StatePlan:
  """Verify every record against the receiver's own expectation for these tokens, then put them into its first
  tier. HandoffError (nothing stored) if any record is missing, extra, corrupt or foreign."""
  t = engine.tiering
  P, ids = _idents(engine, tokens, extra)
  if len(records) != len(ids):
    raise HandoffError(f"incomplete state: {len(records)} records, the state at {P} has {len(ids)}")
  if not t.store.tiers:
    raise HandoffError("the receiving engine has no tier to hold the state (TieringConfig.tiers is empty)")
  for i, data in zip(ids, records):
    try:
      R.decode(data, R.Expect(i.fp, i.group, i.digest, i.parent, i.start, i.tokens, t.manifest[i.group]))
    except R.RecordError as e:
      raise HandoffError(f"state record {i.group}@{i.start} rejected: {e}") from None
  first = t.store.tiers[0]
  for i, data in zip(ids, records):
    if not first.put(i.key, data, i.fp.tenant):
      raise HandoffError(f"the receiver's {first.name} tier refused a state record (capacity or quota)")
  return plan(engine, tokens, extra)

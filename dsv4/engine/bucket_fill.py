"""Bucket fill (EngineConfig.bucket_fill): a ragged step runs padded to its token bucket (8 * g^k), so a step that
spills a few tokens past a bucket pays for the next one (up to g x the work). When deferring at most a fraction of
the step's prefill tokens to the next step keeps it in the smaller bucket, the step's last prefill chunks are
trimmed."""

from __future__ import annotations

from dsv4.engine.request import Request


def trim_to_bucket(scheduled: list[tuple[Request, int]], buckets: list[int] | None,
                   fraction: float) -> list[tuple[Request, int]]:
  """The step `scheduled` ((request, tokens) rows) with its last prefill chunks trimmed so its tokens fit the next
  smaller of `buckets`, when that defers at most `fraction` of its prefill tokens; else `scheduled` unchanged.
  Decode rows (and rows verifying drafts) are never trimmed and a trimmed chunk keeps >= 1 token. Safe after
  allocation: a request's blocks cover positions up to what was allocated, the next step continues from
  num_computed, and commit releases window blocks by computed tokens only. buckets None: the step's shape does not
  follow its token count (nothing to gain)."""
  if fraction <= 0 or not scheduled or buckets is None:
    return scheduled
  total = sum(n for _, n in scheduled)
  smaller = [b for b in buckets if b < total]
  if not smaller:
    return scheduled
  excess = total - smaller[-1]
  prefill = sum(n for r, n in scheduled if n > 1 and not r.step_drafts)
  trimmable = sum(n - 1 for r, n in scheduled if n > 1 and not r.step_drafts)
  if excess > min(trimmable, int(fraction * prefill)):
    return scheduled
  out = list(scheduled)
  for i in range(len(out) - 1, -1, -1):
    req, n = out[i]
    if excess == 0:
      break
    if n > 1 and not req.step_drafts:        # a row verifying drafts is a decode row: never trimmed
      cut = min(excess, n - 1)
      out[i] = (req, n - cut)
      excess -= cut
  return out

"""Checkpoint policy for sliding-window groups: which tails of blocks are kept (hashed) and which are released.

A checkpoint at boundary P (a multiple of the resume alignment) is, in every sliding group, the `need_blocks`
blocks right before P, registered under their chained hashes. They hold what a resume at P reads (window rows,
pending compressor rows), so nothing is replayed.

Where checkpoints are taken (BUILD_NOTES.md, Cache bookkeeping, "Checkpoint placement" has the memory cost):
* **dense start**: at align * 2^k (128, 256, 512, ...) inside the prompt, so sessions that share only a system
  prompt (or any prefix) hit a boundary at least half as long as the shared part, and the very first follower of
  the very first session already hits a power-of-two system prompt completely (vLLM 0.33 misses it). A request
  that hit takes only the points past its full-history run (`dense_points`): the part nobody computed before it
  (a document after a cached system prompt). Any later request sharing S tokens of that part then hits > S / 2,
  so its junction at S lies within twice its hit and is pinned: the one after hits all S. Powers of two rather than
  every N tokens: O(log) per request, and a conversation turn's new part rarely contains one (no extra checkpoint
  per turn under a fixed budget);
* the **prompt boundary** floor((prompt_len - 1) / align) * align: the largest hit an identical prompt can get
  (merged into the re-render boundary when that one lies one alignment before it: `merge_prompt_boundary`);
* the **re-render boundary** floor((prompt_len - 1 - rerender_tokens) / align) * align: chat templates re-render
  the last tokens of the previous prompt, so the next turn diverges just before the prompt end; this keeps the
  largest aligned boundary before such a divergence (up to `rerender_tokens` tokens re-rendered);
* the **junction**: where a request's full-history run ends inside another cached prefix (the prefix search
  reports it), i.e. the point where this request leaves a prefix someone else already computed; a later request
  sharing that prefix hits all of it (vLLM 0.33 pins this junction too);
* the **end of the request**, floor(num_computed / align) * align: where the next turn of a conversation resumes;
* every `retention_interval` tokens when it is > 0 (a multiple of align): the research knob.

Every other block of a sliding group is transient: never hashed, released as soon as it falls behind both the
group's tail at the current position and the tail of the latest aligned boundary (so the end-of-request
checkpoint is still possible whenever the request stops). Released transient blocks go to the head of the free
queue; released checkpoint blocks keep their identity and go to the tail.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
  align_tokens: int
  block_tokens: int         # this sliding group's block size
  tail_tokens: int          # rows before a resume point the next step reads
  retention_interval: int = 0
  dense_start: bool = True
  rerender_tokens: int = 64
  merge_prompt_boundary: bool = True   # drop the prompt boundary when the re-render boundary is one alignment before

  def __post_init__(self):
    if self.retention_interval < 0 or self.retention_interval % self.align_tokens:
      raise ValueError(f"retention_interval: {self.retention_interval} must be >= 0 and a multiple of the resume "
                       f"alignment ({self.align_tokens})")
    if self.rerender_tokens < 0:
      raise ValueError(f"rerender_tokens: {self.rerender_tokens} must be >= 0")

  @property
  def need_blocks(self) -> int:
    return -(-self.tail_tokens // self.block_tokens)

  def floor_align(self, n: int) -> int:
    return max(n, 0) // self.align_tokens * self.align_tokens

  def prompt_boundary(self, prompt_len: int) -> int:
    return self.floor_align(max(prompt_len - 1, 0))

  def planned(self, prompt_len: int, dense: bool = True) -> set[int]:
    """Boundaries fixed at admission (besides retention multiples, junctions and the end of the request).
    `dense=False` leaves out the dense-start schedule (the manager does for a request that hit a cached prefix and
    passes its `dense_points` past the run as extras instead)."""
    out = self._prompt_points(prompt_len)
    return out | set(self.dense_points(prompt_len)) if dense else out

  def dense_points(self, prompt_len: int, after: int = 0) -> tuple[int, ...]:
    """The dense-start schedule align * 2^k in (after, top], top = the largest prompt / re-render boundary kept
    (past it the prompt boundary and the end of the request take over)."""
    if not self.dense_start:
      return ()
    top = max(self._prompt_points(prompt_len))
    out, p = [], self.align_tokens
    while p <= top:
      if p > after:
        out.append(p)
      p *= 2
    return tuple(out)

  def _prompt_points(self, prompt_len: int) -> set[int]:
    pb = self.prompt_boundary(prompt_len)
    out = {pb}
    if self.rerender_tokens:
      rr = self.floor_align(prompt_len - 1 - self.rerender_tokens)
      out.add(rr)
      if 0 < rr < pb and self.merge_prompt_boundary:
        # one checkpoint instead of two within one alignment: the re-render boundary serves both a next turn that
        # re-renders and an identical prompt (at most `align` more tokens recomputed). Under a fixed budget two
        # per prompt made round-robin sessions evict each other's useful checkpoint (BUILD_NOTES.md, Cache
        # bookkeeping).
        out.discard(pb)
    return out

  def plan(self, prompt_len: int, extra: tuple[int, ...] = (), dense: bool = True) -> tuple[int, ...]:
    """The positive boundaries fixed at admission plus `extra`, sorted (a request's plan never changes: the
    manager computes it once and `select`s each step's part)."""
    return tuple(sorted(p for p in self.planned(prompt_len, dense) | set(extra) if p > 0))

  def select(self, plan: tuple[int, ...], lo: int, hi: int) -> list[int]:
    """Boundaries P of `plan` (and retention multiples) with lo < P <= hi."""
    out = [p for p in plan if lo < p <= hi]
    if self.retention_interval:
      r = self.retention_interval
      out = sorted(set(out).union(range((lo // r + 1) * r, hi + 1, r)))
      out = [p for p in out if p > 0]
    return out

  def boundaries(self, lo: int, hi: int, prompt_len: int, extra: tuple[int, ...] = (), dense: bool = True) -> list[int]:
    """Checkpoint boundaries P with lo < P <= hi (tokens computed before / after a step), excluding 0."""
    return self.select(self.plan(prompt_len, extra, dense), lo, hi)

  def tail_blocks(self, boundary: int) -> range:
    e = boundary // self.block_tokens
    return range(max(0, e - self.need_blocks), e)

  def releasable_blocks(self, num_computed: int) -> int:
    """Leading blocks no longer needed: behind the tail at num_computed and behind the latest aligned
    boundary's tail (a future checkpoint never needs them: every later boundary is at least one alignment on)."""
    keep_from = min(num_computed - self.tail_tokens,
                    self.floor_align(num_computed) - self.need_blocks * self.block_tokens)
    return max(0, keep_from // self.block_tokens)

  def peak_blocks(self, prompt_len: int, total_tokens: int, extra_tokens: int = 0, lag: int = 0,
                  cap: int | None = None) -> int:
    """The most blocks of this group a request holds when it computes positions [0, total_tokens) one row of one
    position at a time: the row at p holds the blocks up to p + 1 + extra_tokens (capped at cap) from
    `releasable_blocks(commit)` on, its commit standing at p, or p - lag past the prompt (a decode row planned
    before the previous step's token is read). The least any schedule needs: every position is computed in some
    row, and a longer row or a later commit only holds more. A hit or a reload starts a request inside this
    schedule (at an aligned point, holding the tail there), so it needs no more either.
    Past one alignment (and the tail) the count repeats every `align_tokens`: the positions looked at are a few
    periods after 0 and after the prompt."""
    span = 2 * self.align_tokens + self.need_blocks * self.block_tokens + lag + 1
    cap = total_tokens + extra_tokens if cap is None else cap
    best = 0
    for lo in (0, prompt_len):
      for p in range(lo, min(total_tokens, lo + span)):
        end = min(p + 1 + extra_tokens, cap)
        commit = p - lag if p > prompt_len else p
        best = max(best, -(-end // self.block_tokens) - self.releasable_blocks(max(commit, 0)))
    return best

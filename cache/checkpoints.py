"""SWA checkpoint policy: which window-sized tails of swa blocks are kept (hashed) and which are released.

A checkpoint at boundary P (a multiple of the resume alignment) is the `need_blocks` swa blocks right before P,
registered under their chained hashes. They hold the window rows *and* the raw compressor projections, so the
compressor state at P is restored with them (no replay, nothing else to store).

Checkpoints are taken at
* the prompt boundary floor((prompt_len - 1) / align) * align: the largest hit an identical prompt can get
  (the last prompt token is always recomputed);
* the end of the request, floor(num_computed / align) * align: where the next turn of a conversation resumes;
* every `retention_interval` tokens when it is > 0 (a multiple of align).

Every other swa block is transient: it is never hashed, and it is released (one reference dropped) as soon as it
falls behind both the window of the current position and the tail of the latest aligned boundary (kept so that
the end-of-request checkpoint is still possible whenever the request stops). Released transient blocks go to the
head of the free queue; released checkpoint blocks keep their identity and go to the tail.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
  align_tokens: int
  block_tokens: int         # swa block size
  tail_tokens: int          # rows before a resume point the next step reads (state_tail_tokens)
  retention_interval: int = 0

  def __post_init__(self):
    if self.retention_interval < 0 or self.retention_interval % self.align_tokens:
      raise ValueError(f"retention_interval: {self.retention_interval} must be >= 0 and a multiple of the resume "
                       f"alignment ({self.align_tokens})")

  @property
  def need_blocks(self) -> int:
    return -(-self.tail_tokens // self.block_tokens)

  def floor_align(self, n: int) -> int:
    return n // self.align_tokens * self.align_tokens

  def prompt_boundary(self, prompt_len: int) -> int:
    return self.floor_align(max(prompt_len - 1, 0))

  def boundaries(self, lo: int, hi: int, prompt_len: int) -> list[int]:
    """Checkpoint boundaries P with lo < P <= hi (tokens computed before / after a step), excluding 0."""
    out = set()
    pb = self.prompt_boundary(prompt_len)
    if lo < pb <= hi:
      out.add(pb)
    if self.retention_interval:
      r = self.retention_interval
      out.update(range((lo // r + 1) * r, hi + 1, r))
    return sorted(p for p in out if p > 0)

  def tail_blocks(self, boundary: int) -> range:
    e = boundary // self.block_tokens
    return range(max(0, e - self.need_blocks), e)

  def releasable_blocks(self, num_computed: int) -> int:
    """Leading swa blocks no longer needed: behind the window at num_computed and behind the latest aligned
    boundary's tail (a future checkpoint never needs them: every later boundary is at least one alignment on)."""
    keep_from = min(num_computed - self.tail_tokens,
                    self.floor_align(num_computed) - self.need_blocks * self.block_tokens)
    return max(0, keep_from // self.block_tokens)

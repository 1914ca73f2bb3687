"""A request's life inside the engine: tokens, progress, timing, outcome."""

from __future__ import annotations

import dataclasses
import enum
import json

import numpy as np

from cache.hashing import ExtraKeys
from dsv4.engine.sampling import SamplingParams


class Status(enum.Enum):
  WAITING = "waiting"
  RUNNING = "running"
  FINISHED = "finished"
  REJECTED = "rejected"


@dataclasses.dataclass
class Request:
  rid: str
  prompt: list[int]
  params: SamplingParams
  extra_keys: ExtraKeys = ExtraKeys()
  arrival: float = 0.0
  output: list[int] = dataclasses.field(default_factory=list)
  status: Status = Status.WAITING
  error: str | None = None
  finish_reason: str | None = None
  num_computed: int = 0            # leading tokens whose KV is in the cache
  hit_tokens: int = 0              # prefix-hit tokens at the first admission (device + tiers)
  tier_hit_tokens: int = 0         # of hit_tokens, those loaded from the KV tiers below the device
  readmit_hit_tokens: int = 0      # prefix-hit tokens at re-admissions after preemption
  computed_tokens: int = 0         # tokens run through the model (all admissions)
  recomputed_tokens: int = 0       # tokens computed again after a preemption
  max_computed: int = 0            # furthest position ever computed (to count recomputation)
  num_preemptions: int = 0
  first_token_time: float | None = None
  last_token_time: float | None = None
  token_logits: list[np.ndarray] | None = None
  slot: int = -1                   # its row of its cache manager's device block tables while running
  admitting: bool = False          # its prefix search and claim went with a step; the hit is not read yet
  fresh: bool = False              # admitted (hit read), no chunk scheduled yet: out of blocks, it is given back
  inflight: int = 0                # sampled tokens sent to the device and not read yet (async scheduling): 0 or 1
  sample_row: int = -1             # its row in the step that samples that token (the next step reads it there)
  index: int = 0                   # order of arrival at the engine
  uid: str = ""                    # unique to this request over the engine's life (an id may be reused later)
  shard: int = 0                   # data shard whose pool and manager hold its blocks (engine on a mesh)
  drafts: list[int] = dataclasses.field(default_factory=list)  # the MTP block's proposals for the next positions
  step_drafts: int = 0             # drafts its row verifies in the step being planned / run
  inflight_drafts: int = 0         # drafts verified by its unread step (async): that step may add 1 + this many
  # prompt + output, maintained incrementally (append_output) so a step never rebuilds it
  tokens: list[int] = dataclasses.field(default_factory=list)

  def __post_init__(self):
    self.tokens = list(self.prompt) + list(self.output)

  def append_output(self, tok: int) -> None:
    self.output.append(tok)
    self.tokens.append(tok)

  @property
  def all_tokens(self) -> list[int]:
    """A copy of prompt + output (callers may keep it)."""
    return list(self.tokens)

  @property
  def num_pending(self) -> int:
    return len(self.tokens) + self.inflight - self.num_computed

  def cache_salt(self, prefix_caching: bool) -> ExtraKeys:
    """With prefix caching off, every admission gets keys nobody else (not even itself later, nor a later request
    that reuses its id on the same engine) can match."""
    if prefix_caching:
      return self.extra_keys
    # Its own field, JSON-encoded: no request id or adapter string can reproduce another admission's salt.
    return dataclasses.replace(self.extra_keys,
                               private=json.dumps(["nocache", self.rid, self.uid, self.num_preemptions]))


@dataclasses.dataclass(frozen=True)
class RequestOutput:
  rid: str
  prompt: list[int]
  output: list[int]
  finish_reason: str | None
  error: str | None
  hit_tokens: int
  computed_tokens: int
  recomputed_tokens: int
  num_preemptions: int
  ttft_s: float | None
  tpot_s: float | None
  tier_hit_tokens: int = 0         # of hit_tokens, loaded from the KV tiers (last: positional callers keep working)
  token_logits: tuple | None = None  # each sampled position's logits (EngineConfig.record_logits)

  @property
  def device_hit_tokens(self) -> int:
    """Of hit_tokens, those found in the device cache (prefix caching proper)."""
    return self.hit_tokens - self.tier_hit_tokens

  @staticmethod
  def of(r: Request) -> "RequestOutput":
    ttft = None if r.first_token_time is None else r.first_token_time - r.arrival
    tpot = None
    if r.first_token_time is not None and len(r.output) > 1:
      tpot = (r.last_token_time - r.first_token_time) / (len(r.output) - 1)
    return RequestOutput(r.rid, list(r.prompt), list(r.output), r.finish_reason, r.error, r.hit_tokens,
                         r.computed_tokens, r.recomputed_tokens, r.num_preemptions, ttft, tpot, r.tier_hit_tokens,
                         None if r.token_logits is None else tuple(r.token_logits))

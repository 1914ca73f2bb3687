"""The engine's step dispatch: a scheduled step turned into the runner's rows and sent (`dispatch`: each row's chunk
as a slice of its request's tokens, a token still on the device as a reference to the previous step's sample, its
drafts; what is known committed at once), and a sent step's results read back (`collect`: sampled tokens appended,
accepted drafts verified, stop and length checks, the rest committed). The token ids of a step go one way: request
-> `Row.tokens` -> the runner's packed plan -> the step program -> sampled ids -> `Request.output` and the cache
manager's `append_tokens`."""

from __future__ import annotations

from cache.manager import KVCacheManager
from dsv4.config import ModelConfig
from dsv4.engine.request import Request, Status
from dsv4.engine.request_book import RequestBook
from dsv4.engine.runner import ModelRunner, Row


class StepDispatch:

  def __init__(self, config: ModelConfig, runner: ModelRunner, book: RequestBook, managers: list[KVCacheManager],
               stats, *, spec: int, record_logits: bool):
    self.config, self.runner, self.book, self.managers, self.stats = config, runner, book, managers, stats
    self.spec, self.record_logits = spec, record_logits

  def dispatch(self, scheduled):
    rows = []
    for i, (req, n) in enumerate(scheduled):
      start = req.num_computed
      nd = req.step_drafts
      known = req.tokens[start:start + n - nd]
      prev_row, drafts = -1, req.drafts[:nd]
      if len(known) < n - nd:           # the last token is the one sampled by the previous step, on the device
        if self.spec:                   # ... and so are the drafts; the device fills the row and shifts it
          known, prev_row, drafts = known + [0], req.sample_row, [0] * nd
        else:
          known = known + [-1 - req.sample_row]
      nxt = -1
      if self.spec and start + n < len(req.tokens):   # stops mid-prompt: the MTP block's input after its last token
        nxt = req.tokens[start + n]
      rows.append(Row(req.slot, known + drafts, start, req.params, len(req.output) + req.inflight, req.shard,
                      num_drafts=nd, next_token=nxt, prev_row=prev_row))
    handle = self.runner.dispatch(rows)
    for i, (req, n) in enumerate(scheduled):
      start = req.num_computed
      recomputed = max(0, min(start + n, req.max_computed) - start)
      req.recomputed_tokens += recomputed
      req.computed_tokens += n
      self.stats["computed_tokens"] += n
      self.stats["recomputed_tokens"] += recomputed
      # drafts are final only once verified (`_collect` advances past the accepted ones)
      req.num_computed = start + n - req.step_drafts
      req.max_computed = max(req.max_computed, req.num_computed)
      # commit now what is known (a prompt chunk; a decode row up to its input token, still on the device): the
      # registrations go into the next program, after this one has written the KV
      self.managers[req.shard].commit(req.rid, min(req.num_computed, len(req.tokens)))
    rows = []
    for i, (req, n) in enumerate(scheduled):
      samples = req.num_computed >= len(req.tokens) + req.inflight    # its last token ran: its sample is wanted
      if samples:
        req.inflight += 1
        req.sample_row = i
        req.inflight_drafts = req.step_drafts
      rows.append((req, req.num_computed, req.num_preemptions, samples, req.step_drafts))
    return handle, rows

  def collect(self, sent) -> list[Request]:
    handle, rows = sent
    sampled, logits = self.runner.collect(handle)
    done, now = [], None
    for i, (req, end, preemptions, samples, num_drafts) in enumerate(rows):
      live = req.status is Status.RUNNING and req.num_preemptions == preemptions
      if live and min(end, len(req.tokens)) > self.managers[req.shard].num_committed(req.rid):
        self.managers[req.shard].commit(req.rid, min(end, len(req.tokens)))
      if not samples or req.status in (Status.FINISHED, Status.REJECTED):
        continue                      # mid-prompt chunk (its sample is not wanted), or it already ended
      if self.spec:
        if self._take_verified(req, sampled[i], live, num_drafts, None if logits is None else logits[i]):
          done.append(req)
        continue
      tok = int(sampled[i])
      req.inflight -= 1
      req.append_output(tok)
      if live:
        self.managers[req.shard].append_tokens(req.rid, [tok])
      if self.record_logits:
        req.token_logits = (req.token_logits or []) + [logits[i]]
      now = self.book.clock() if now is None else now
      if req.first_token_time is None:
        req.first_token_time = now
      req.last_token_time = now
      if self._stops(req, tok):
        done.append(req)
    return done

  def _take_verified(self, req: Request, res, live: bool, num_drafts: int, logits_JxV=None) -> bool:
    """A speculative row's results (runner.RaggedShape.out_width): the accepted drafts and the decided token
    join the output one by one (a stop ends it there; later ones are dropped), each with its logits when recorded
    (logits_JxV[j]: the distribution new token j was verified or drawn from), the positions of the accepted drafts
    become computed and committed, and the new drafts are kept for the next step. True if it finished."""
    k = self.spec
    n_new = int(res[0])
    new, drafts = [int(t) for t in res[1:1 + n_new]], [int(t) for t in res[2 + k:2 + 2 * k]]
    req.inflight -= 1
    accepted = n_new - 1
    self.stats["spec_rows"] += num_drafts > 0
    self.stats["spec_draft_tokens"] += num_drafts
    self.stats["spec_accepted_tokens"] += accepted
    for d in range(1, num_drafts + 1):   # by depth: draft d is accepted only with drafts 1 .. d - 1
      self.stats[f"spec_drafts_at_{d}"] += 1
      self.stats[f"spec_accepted_at_{d}"] += d <= accepted
    if live:
      req.num_computed += accepted
      req.max_computed = max(req.max_computed, req.num_computed)
    now = self.book.clock()
    for j, tok in enumerate(new):
      req.append_output(tok)
      if live:
        self.managers[req.shard].append_tokens(req.rid, [tok])
      if logits_JxV is not None:
        req.token_logits = (req.token_logits or []) + [logits_JxV[j]]
      if req.first_token_time is None:
        req.first_token_time = now
      req.last_token_time = now
      if self._stops(req, tok):
        return True
    if live:
      self.managers[req.shard].commit(req.rid, min(req.num_computed, len(req.tokens)))
      req.drafts = drafts
    return False

  def _stops(self, req: Request, tok: int) -> bool:
    """Finishes req if tok (just appended) is a stop token or its last; True if it finished."""
    p = req.params
    reason = None
    if tok in p.stop_token_ids or (not p.ignore_eos and tok == self.config.eos_token_id):
      reason = "stop"
    elif len(req.output) >= p.max_tokens:
      reason = "length"
    if reason is None:
      return False
    if req.status is Status.RUNNING:
      self.book.finish(req, reason)
    else:                             # preempted while its token was in flight: it ends in the queue
      self.book.end_in_queue(req, reason)
    return True

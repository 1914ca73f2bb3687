"""Async scheduling composed with speculative decoding: the four rules of the design (docs/engine.md, "Drafts under
async scheduling: four rules"), checked on the exact block tables, free counts and KV positions of one request.

Step N + 1 is planned and sent while step N (which verifies q drafts) is unread. The rules:
1. optimistic reservation: N + 1's blocks cover its 1 + k' positions from the frontier N reaches when ALL its q
   drafts are accepted, plus the k - 1 positions the drafter's recursion writes past N + 1's own frontier;
2. device-side correction: N + 1 writes its KV at the positions of N's real acceptance (the host planned them as if
   none were accepted; `speculative_step.continue_rows` shifts them on the device);
3. unused blocks: a block reserved for the optimistic frontier and not used stays in the request's table (it is not
   freed) and the request grows into it later with the same block id;
4. max length: a request whose in-flight step reaches max_tokens even with every draft rejected is not scheduled
   again; it finishes when that step is read and no token past max_tokens is emitted.

Acceptance is forced exactly: an oracle rewrites the drafts a step proposes (inside the step program, so the async
path's device-side drafts are forced too) to the request's greedy continuation (computed by a first run) for the
first `right` drafts and to a wrong token after that: right = k accepts every draft, right = 0 rejects every one,
0 < right < k accepts that many. The oracle wraps `step_program.verify_and_draft` and reads its table from an extra
entry of the params pytree (so no program traced without the oracle is ever reused for it, nor the other way round).

KV positions are observed by poisoning: before each step, every KV row of the request at or past its true frontier
(the backbone's layer 0 window and the drafter's own window layer, both in the sliding-window group) is set to a
sentinel; after the step, the rows that no longer hold it are exactly the positions the step wrote. Nothing reads a
row past the frontier before writing it, so the poison leaves the tokens greedy. The probe reads tables and free
counts through the manager's public calls, which apply its queue first (one extra bookkeeping call, same result).

`drafter` is the model fixture (V4 with an MTP block now; a V4.1 drafter is meant to join its params).
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import caches, config, model
from dsv4.engine import step_program
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.request import Status
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.step_plan import result_width

K = 3                 # drafts per step
CROSS = 128           # a full block and 4 swa blocks: the first step planned behind drafts reserves up to CROSS + 1
M = 12                # max_tokens of the reservation traces (reject-all then writes position 128 and beyond)
SENTINEL = 7777.0
_ORACLE = "_test_draft_oracle"
EC = EngineConfig(max_num_seqs=2, max_num_batched_tokens=128, chunk_size=128, max_model_len=256, num_full_blocks=8,
                  num_swa_blocks=32, num_speculative_tokens=K)
TABLE_LEN = M + 2 * K + 2


@dataclasses.dataclass(frozen=True)
class Drafter:
  """A model with a drafter, and what the rules need to know about it. The oracle wraps `step_program.<step_fn>`,
  which must be called inside the step program with `params`, `config`, `shape` and the unpacked plan `p` (after
  `continue_rows`) and return (cache, results [rows, step_plan.result_width(k)], logits)."""
  name: str
  config: config.ModelConfig
  params: dict
  recursive: bool = True              # V4 MTP: k - 1 runs on its own output, past the frontier; DSpark: one pass
  step_fn: str = "verify_and_draft"

  @property
  def draft_layers(self) -> tuple[int, ...]:
    """The cache layers the drafter writes (its own window KV, after the backbone's; the sliding-window group)."""
    return tuple(p.index for p in self.config.mtp_plans())

  def past_frontier(self, k: int) -> int:
    """Positions the drafter writes past a row's last accepted position (V4 MTP: its k - 1 recursive runs; DSpark
    none: its stages' context KV is written by the verification pass at the row's own positions)."""
    return k - 1 if self.recursive else 0

  def prompt_len(self, k: int) -> int:
    """The prompt that puts the end of the third step's reservation (the first planned behind drafts: the prefill,
    then a row of 1 + k, then this one) at CROSS + 1 = P + 2 + 2k + lookahead, one block past what it would be
    without the unread step's k drafts (- k) or without the recursion's lookahead (- (k - 1)): both terms show in
    the table lengths, and an all-accepting row writes its last positions into that block."""
    return CROSS + 1 - 2 - 2 * k - self.past_frontier(k)


def _v4_mtp() -> Drafter:
  cfg = dataclasses.replace(config.v4_tiny(num_layers=2), num_mtp_layers=1)     # window + CSA layers, one MTP block
  return Drafter("v4_mtp", cfg, model.init_params(cfg, jax.random.PRNGKey(11)))


def _v41_dspark() -> Drafter:
  cfg = dataclasses.replace(
      config.v41_tiny(engram=False), num_mtp_layers=3,
      dspark=config.DSparkConfig(block_size=5, target_layer_ids=(5, 6, 7), markov_rank=8, noise_token_id=3,
                                 n_routed_experts=4, num_experts_per_tok=2))
  return Drafter("v41_dspark", cfg, model.init_params(cfg, jax.random.PRNGKey(0)), recursive=False)


# a drafter's step program is one more compile: V4's MTP runs in the default tier, V4.1's DSpark in the slow tier
DRAFTERS = {"v4_mtp": _v4_mtp, "v41_dspark": _v41_dspark}


def _oracle_wrapper(real):
  """The drafter's step function with each row's next drafts replaced from params[_ORACLE]: table[slot, i] = the
  request's output token i; the first `right` drafts are the true continuation, the rest the true token + 1 (so
  never accepted by the greedy verifier)."""
  sig = inspect.signature(real)

  def wrapped(*args, **kwargs):
    out = real(*args, **kwargs)
    a = sig.bind(*args, **kwargs).arguments
    params = a["params"]
    if not isinstance(params, dict) or _ORACLE not in params:
      return out
    cache, res, logits = out
    k, table, right = a["shape"].spec, params[_ORACLE]["table"], params[_ORACLE]["right"]
    assert res.shape[1] == result_width(k)
    p = a["p"]
    # row r decided output tokens step .. step + accepted (res[r, 0] = accepted + 1); its drafts propose the next k
    idx = p["step"][:, None] + res[:, :1] + jnp.arange(k)[None]
    true = table[jnp.clip(p["slot"], 0, table.shape[0] - 1)[:, None], jnp.clip(idx, 0, table.shape[1] - 1)]
    forced = jnp.where(jnp.arange(k)[None] < right, true, (true + 1) % a["config"].vocab_size)
    return cache, res.at[:, 2 + k:2 + 2 * k].set(forced.astype(res.dtype)), logits

  return wrapped


@pytest.fixture(scope="module", params=["v4_mtp", pytest.param("v41_dspark", marks=pytest.mark.slow)])
def drafter(request):
  d = DRAFTERS[request.param]()
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(step_program, d.step_fn, _oracle_wrapper(getattr(step_program, d.step_fn)))
    yield d


def _with_oracle(params, table, right):
  return dict(params, **{_ORACLE: {"table": jnp.asarray(table, jnp.int32), "right": jnp.asarray(right, jnp.int32)}})


@pytest.fixture(scope="module")
def greedy(drafter):
  return _greedy(drafter)


def _greedy(drafter):
  """(prompt, its greedy continuation of TABLE_LEN tokens). The verifier is exact, so any drafts give it."""
  n = drafter.prompt_len(K)
  prompt = list(np.random.default_rng(0).integers(4, drafter.config.vocab_size, size=n))    # no special ids
  params = _with_oracle(drafter.params, np.zeros((EC.max_num_seqs, TABLE_LEN)), 0)
  eng = Engine(params, drafter.config, EC)
  eng.add_request("r", prompt, SamplingParams(max_tokens=TABLE_LEN, ignore_eos=True))
  (out,) = eng.run()
  assert len(out.output) == TABLE_LEN
  return prompt, out.output


# ---------------------------------------------------------------------------------------------- the probe
@dataclasses.dataclass
class StepRecord:
  """One dispatched step of the request, as the probe saw it."""
  host_start: int                     # the row's first position as the host planned it
  n: int                              # tokens in the row
  drafts: int                         # drafts it verifies
  continues: bool                     # planned while the previous step was unread (prev_row >= 0)
  outputs_at_plan: int                # outputs read when it was planned
  start: int = -1                     # its true first position (the device's)
  want_end: int = -1                  # rule 1: positions [0, want_end) its reservation must cover
  tables: dict = None                 # per group the block ids after its allocation (-1: released / none)
  free: dict = None                   # per group the pool's free blocks then
  poisoned_from: int = -1             # positions >= this held the sentinel when it ran
  accepted: int = -1                  # drafts it accepted (read from its results on the device)
  written: dict = None                # per cache layer: positions >= poisoned_from it wrote


class Probe:
  """Wraps the runner's dispatch of a one-request engine: before each step it reads what the previous step wrote
  and accepted, records the tables and free counts after this step's allocation, and poisons every KV row at or
  past the true frontier."""

  def __init__(self, eng: Engine, rid: str, drafter: Drafter):
    self.eng, self.rid, self.layers = eng, rid, (0,) + drafter.draft_layers
    self.past_frontier = drafter.past_frontier(eng.spec)
    self.steps: list[StepRecord] = []
    self.reads: list[tuple[int, dict, dict]] = []      # (index of the last step sent, tables, free) after a read
    self.sb = eng.ec.layout.swa_block_tokens
    self._real = eng.runner.dispatch
    eng.runner.dispatch = self._dispatch

  def _kv(self, layer):
    return self.eng.runner.cache.layers[layer]["window_kv"]

  def _slots(self, table, positions):
    blocks = np.array([table[x // self.sb] if x // self.sb < len(table) else -1 for x in positions], np.int64)
    return blocks, np.asarray(positions) % self.sb

  def _read_previous(self):
    """The previous step has run: what it accepted and which poisoned rows it wrote; returns its true frontier."""
    s = self.steps[-1]
    s.accepted = int(np.asarray(jax.device_get(self.eng.runner.prev_tokens))[0, 0]) - 1
    s.written = {}
    hi = len(s.tables[caches.SWA]) * self.sb
    pos = np.arange(s.poisoned_from, hi) if s.poisoned_from >= 0 else np.arange(0)
    blocks, offs = self._slots(s.tables[caches.SWA], pos)
    for layer in self.layers:
      kv = np.asarray(jax.device_get(self._kv(layer)))
      rows = kv[np.maximum(blocks, 0), offs]
      changed = (blocks >= 0) & ~np.all(rows == SENTINEL, axis=-1)
      s.written[layer] = pos[changed].tolist()
    return s.start + s.n - 1 - s.drafts + s.accepted

  def after_read(self):
    """After an engine step (step N read, N + 1 unread): the tables and free counts, paired with the last step."""
    m = self.eng.cache_manager
    tables = {g: np.asarray(t) for g, t in m.block_tables(self.rid).tables.items()}
    self.reads.append((len(self.steps) - 1, tables, {g: m.num_free_blocks(g) for g in m.groups}))

  def finish(self):
    """Reads the last step (call once the engine has no work left)."""
    if self.steps and self.steps[-1].written is None:
      self._read_previous()

  def _dispatch(self, rows):
    assert len(rows) == 1, "the probe follows a one-request engine"
    (row,) = rows
    req = self.eng.requests[self.rid]
    rec = StepRecord(row.start, len(row.tokens), row.num_drafts, row.prev_row >= 0, len(req.output))
    if self.steps:
      frontier = self._read_previous()
      prev = self.steps[-1]
      rec.start = frontier + 1
      # rule 1: planned while the previous step is unread, it reserves as if that step accepted all its drafts
      optimistic = rec.start + (prev.drafts - prev.accepted) if rec.continues else rec.start
    else:
      frontier, rec.start, optimistic = row.start - 1, row.start, row.start
    rec.want_end = min(optimistic + rec.n + self.past_frontier, self.eng.ec.max_model_len)
    m = self.eng.cache_manager
    rec.tables = {g: np.asarray(t) for g, t in m.block_tables(self.rid).tables.items()}    # flushes the queue
    rec.free = {g: m.num_free_blocks(g) for g in m.groups}
    # poison every row of the request at or past its true frontier + 1 (nothing reads them before writing them)
    rec.poisoned_from = frontier + 1
    pos = np.arange(rec.poisoned_from, len(rec.tables[caches.SWA]) * self.sb)
    blocks, offs = self._slots(rec.tables[caches.SWA], pos)
    blocks, offs = blocks[blocks >= 0], offs[blocks >= 0]
    layers = list(self.eng.runner.cache.layers)
    for layer in self.layers:          # on the host: a few hundred KB, and no program to compile per step
      kv = np.array(jax.device_get(layers[layer]["window_kv"]))
      kv[blocks, offs] = SENTINEL
      layers[layer] = dict(layers[layer], window_kv=jax.device_put(kv))
    self.eng.runner.cache = caches.ModelCache(tuple(layers))
    self.steps.append(rec)
    return self._real(rows)


def _trace(drafter, greedy, right, max_tokens=M):
  prompt, want = greedy
  eng = Engine(_with_oracle(drafter.params, [want] * EC.max_num_seqs, right), drafter.config, EC)
  assert eng.async_active
  eng.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
  probe = Probe(eng, "r", drafter)
  calls = []               # per engine step: (outputs read before it, the request was running, it had a row in it)
  while eng.has_work():
    req, n = eng.requests["r"], len(probe.steps)
    before, running = len(req.output), req.status is Status.RUNNING
    eng.step()
    calls.append((before, running, len(probe.steps) > n))
    if req.status is Status.RUNNING:
      probe.after_read()
  probe.finish()
  out = eng.requests["r"]
  return eng, probe, out, calls


@pytest.fixture(scope="module")
def traces(drafter, greedy):
  """Traces by acceptance pattern (right = k: accept-all, 1: partial, 0: reject-all), each run once per module."""
  done = {}

  def get(right):
    if right not in done:
      done[right] = _trace(drafter, greedy, right)
    return done[right]
  return get


PATTERNS = [pytest.param(K, id="accept_all"), pytest.param(1, id="partial"), pytest.param(0, id="reject_all")]


def _blocks_for(end, bt):
  return -(-end // bt)


@pytest.mark.parametrize("right", PATTERNS)
def test_forced_acceptance_keeps_the_greedy_tokens(traces, greedy, right):
  """The oracle gives exactly the acceptance asked for (read from each step's results on the device), every step
  after the prefill verifies drafts and continues an unread step, and the tokens are the greedy ones."""
  _, probe, out, _ = traces(right)
  assert out.output == greedy[1][:M] and out.finish_reason == "length"
  assert [s.accepted for s in probe.steps] == [min(right, s.drafts) for s in probe.steps]
  assert all(s.drafts > 0 for s in probe.steps[1:-2]) and all(s.continues for s in probe.steps[1:])


def _bts(eng):
  layout = eng.ec.layout
  return {caches.FULL: layout.full_block_tokens, caches.SWA: layout.swa_block_tokens}


@pytest.mark.parametrize("right", PATTERNS)
def test_optimistic_reservation(traces, right):
  """Rule 1: after the allocation of step N + 1 (planned while N, verifying q drafts, is unread), the request's
  tables have exactly the entries covering [0, end) in every group, end = the frontier N reaches if all q drafts
  are accepted + N + 1's 1 + k' positions + the k - 1 positions the drafter's recursion writes past them (the
  prefill: its prompt + k - 1). Both groups: the full-history group (128-token blocks) and the sliding-window
  group (32-token blocks: the backbone's window and the drafter's window layer). Tables never shrink."""
  eng, probe, _, _ = traces(right)
  have = {g: 0 for g in _bts(eng)}
  for i, s in enumerate(probe.steps):
    for g, bt in _bts(eng).items():
      have[g] = max(have[g], _blocks_for(s.want_end, bt))
      assert len(s.tables[g]) == have[g], (g, i, s)
      assert s.tables[g][-1] >= 0, (g, i)
  third = probe.steps[2]                # the first step planned behind drafts: the one whose reservation crosses 128
  assert third.want_end == CROSS + 1
  assert {g: len(t) for g, t in third.tables.items()} == {caches.FULL: 2, caches.SWA: 5}


@pytest.mark.parametrize("right", PATTERNS)
def test_device_writes_at_the_real_acceptance(traces, right):
  """Rule 2: the host plans a continuing row as if the unread step accepted nothing; the device writes it where
  that step's real acceptance puts it. Backbone (layer 0 window): exactly the row's positions [start, start + k'];
  the drafter's window layer: the row's positions and its recursion's, through frontier + k - 1. Each of those
  positions has a block of the request (the reservation covered it), so no write was dropped."""
  _, probe, _, _ = traces(right)
  shifted = 0
  for i, s in enumerate(probe.steps[1:], 1):
    prev = probe.steps[i - 1]
    assert s.host_start == s.start - prev.accepted, (i, s)
    shifted += s.host_start != s.start
    frontier = s.start + s.n - 1 - s.drafts + s.accepted
    want = {0: range(s.start, s.start + s.n)}
    for layer in probe.layers[1:]:
      want[layer] = range(s.start, max(s.start + s.n, frontier + 1 + probe.past_frontier))
    for layer, positions in want.items():
      swa = s.tables[caches.SWA]
      assert all(x // probe.sb < len(swa) and swa[x // probe.sb] >= 0 for x in positions), (i, layer, s)
      assert s.written[layer] == [x for x in positions if x >= s.poisoned_from], (i, layer, s)
  assert (shifted > 0) == (right > 0)


@pytest.mark.parametrize("right", PATTERNS)
def test_unused_blocks_stay_and_are_grown_into(traces, right):
  """Rule 3: a block reserved for the optimistic frontier that its step did not write stays in the request's table
  with the same id (tables never shrink, an entry never changes its block, and the pool's free count is the pool
  less what the request holds: the block is not given back) until a later step writes into it. Everything returns
  to the pool when the request ends."""
  eng, probe, _, _ = traces(right)
  m = eng.cache_manager
  grown_into = {g: 0 for g in _bts(eng)}
  for i, s in enumerate(probe.steps):
    for g, bt in _bts(eng).items():
      ids = s.tables[g]
      assert s.free[g] == m.num_blocks[g] - (ids >= 0).sum(), (g, i)   # one request: the pool less what it holds
      for later in probe.steps[i + 1:]:
        t = later.tables[g]
        assert len(t) >= len(ids)
        both = (ids >= 0) & (t[:len(ids)] >= 0)
        assert np.array_equal(t[:len(ids)][both], ids[both]), (g, i)    # a held entry keeps its block
      # entries past everything this step wrote (and the frontier it started from): reserved optimistically
      last = max([s.start - 1] + [x for w in s.written.values() for x in w])
      for e in range(_blocks_for(last + 1, bt), len(ids)):
        later_writes = [x for later in probe.steps[i + 1:] for x in later.written[0] if x // bt == e]
        grown_into[g] += bool(later_writes)
  for i, tables, free in probe.reads:     # after a read (the correction known on the host): nothing given back
    for g in _bts(eng):
      ids, sent = tables[g], probe.steps[i].tables[g]
      held = np.flatnonzero(ids >= 0)
      assert len(ids) == len(sent) and held.size and held[-1] == len(ids) - 1 and held.size == len(ids) - held[0]
      assert np.array_equal(ids[held], sent[held]), (g, i)
      assert free[g] == m.num_blocks[g] - held.size, (g, i)
  if right < K:      # some step did not reach its optimistic frontier: its extra blocks were used later
    assert grown_into[caches.FULL] > 0 and grown_into[caches.SWA] > 0, grown_into
  assert {g: m.num_free_blocks(g) for g in m.groups} == {caches.FULL: EC.num_full_blocks,
                                                         caches.SWA: EC.num_swa_blocks}


@pytest.mark.parametrize("right", PATTERNS)
def test_max_tokens_is_never_passed(drafter, greedy, right):
  """Rule 4: while step N is unread, the request is planned for N + 1 only if its outputs read so far + the one
  token N surely adds stay below max_tokens, with only as many drafts as can still be needed when all of N's drafts
  are rejected. Once N alone reaches max_tokens it is not scheduled, finishes when N is read, and ends with
  exactly max_tokens tokens (a step sent before an all-accepting one was read is dropped). max_tokens = 6 makes the
  rule decide for every acceptance pattern."""
  max_tokens = 6
  eng, probe, out, calls = _trace(drafter, greedy, right, max_tokens)
  assert out.output == greedy[1][:max_tokens] and out.finish_reason == "length"
  for before, running, scheduled in calls[1:]:
    assert scheduled == (running and before + 1 < max_tokens), calls
  held_back = [i for i, (before, running, scheduled) in enumerate(calls) if running and not scheduled]
  assert held_back == [len(calls) - 1], calls          # held back once: the step that reads N and finishes it
  for s in probe.steps[1:]:
    assert s.drafts == min(K, max(0, max_tokens - s.outputs_at_plan - 2)), s
  assert {g: eng.cache_manager.num_free_blocks(g) for g in eng.cache_manager.groups} == {
      caches.FULL: EC.num_full_blocks, caches.SWA: EC.num_swa_blocks}

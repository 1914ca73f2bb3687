"""Admissions queued into the step program (`queue_admissions`: search + claim ride the next `plan`, hits
read with the step's results, possibly a step late) leave exactly the device state (pools and block tables) and
give exactly the hits of the same admissions made by the manager's own standalone call (`add_requests`) at the same
point of the queue. Random traces with shared prefixes, allocations, commits with checkpoints, frees, and
admissions withdrawn before they are sent or while they are in flight."""

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cache.api_types import CacheError
from cache.hashing import ExtraKeys
from tests.cache.test_step_plan import advance, check, commit_and_finish, make, program, run_step, same_state, two_managers


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.booleans())
def test_queued_admissions_match_the_standalone_call(d, late):
  rng, fused, plain, prefixes = two_managers(d)
  live, waiting, pending = {}, {}, []        # waiting: queued on fused, admitted on plain, hit not read on fused
  for step in range(d.draw(st.integers(3, 9))):
    # hits read since the last step: the same as the standalone call's
    for rid, h in fused.take_admitted():
      toks, plain_hit = waiting.pop(rid)
      assert h.num_tokens == plain_hit, rid
      live[rid] = [toks, h.num_tokens]
    advance(d, live, fused, plain)
    new = []
    for k in range(d.draw(st.integers(0, 2))):
      if len(live) + len(waiting) + len(new) >= 4:
        break
      toks = np.concatenate([prefixes[d.draw(st.integers(0, 1))][:d.draw(st.integers(0, 48))],
                             rng.integers(2, 60, d.draw(st.integers(1, 60)))])
      new.append((f"r{step}.{k}", toks))
    fused.queue_admissions([(rid, t, ExtraKeys()) for rid, t in new])
    if new and d.draw(st.booleans()):  # withdrawn before it is sent: as if never admitted (the last one, so that
      rid, _ = new.pop()               # both managers hand out the same table rows afterwards)
      assert fused.is_admitting(rid)
      fused.free(rid)
      assert not fused.is_admitting(rid)
    assert fused.admissions_pending == len(new)
    run_step(fused, late, pending)     # the queue, then the admissions, in one step program
    for (rid, t), h in zip(new, plain.add_requests([(rid, t, ExtraKeys()) for rid, t in new])):
      waiting[rid] = (t, h.num_tokens)
    plain.flush()
    if not late:
      check(fused, plain, live)
    commit_and_finish(d, live, (fused, plain))
  if pending:
    pm, pp, pr = pending.pop()
    pm.read_results(pp, np.asarray(pr))
  for rid, h in fused.take_admitted():
    assert h.num_tokens == waiting.pop(rid)[1]
  assert not waiting
  run_step(fused, False, [])
  plain.flush()
  same_state(fused, plain)


def test_an_admission_withdrawn_in_flight_is_released_when_its_result_arrives():
  prompt = np.arange(2, 100, dtype=np.int32)
  fused, plain = make(40), make(40)
  for m in (fused, plain):            # something to hit: a request computes the prompt and ends
    m.add_requests([("a", prompt, ExtraKeys())])
    m.allocate_to("a", len(prompt))
    m.flush()
    m.commit("a", len(prompt))
    m.free("a")
    m.flush()
  fused.queue_admissions([("b", prompt, ExtraKeys())])
  plan = fused.plan()
  res = fused.device.advance(program, plan.buf, plan.statics)
  fused.free("b")                     # in flight: nothing known on the host yet
  assert fused.is_admitting("b")
  with pytest.raises(CacheError):
    fused.commit("b", 1)
  fused.read_results(plan, np.asarray(res))
  assert not fused.is_admitting("b") and fused.take_admitted() == []
  hit = plain.add_requests([("b", prompt, ExtraKeys())])[0]
  assert hit.num_tokens > 0           # the claim really happened before the release
  plain.free("b")
  for m in (fused, plain):
    m.flush()
  same_state(fused, plain)
  assert fused.num_free_blocks("full") == plain.num_free_blocks("full") == 40


def test_queued_admissions_need_no_call_of_their_own():
  """The admission rides the step program: no device call besides it, and the hit is there once it is read."""
  m = make(40)
  prompt = np.arange(2, 100, dtype=np.int32)
  m.add_requests([("a", prompt, ExtraKeys())])
  m.allocate_to("a", len(prompt))
  m.flush()
  m.commit("a", len(prompt))
  m.free("a")
  calls = m.stats["device_calls"]
  m.queue_admissions([("b", prompt, ExtraKeys()), ("c", prompt[:40], ExtraKeys())])
  with pytest.raises(CacheError):
    m.queue_admissions([("b", prompt, ExtraKeys())])     # its id is taken while it is being admitted
  run_step(m, False, [])
  assert m.stats["device_calls"] == calls
  got = dict(m.take_admitted())
  assert got["b"].num_tokens == 96 and got["c"].num_tokens == 32
  assert m.num_committed("b") == 96
  assert jax.device_get(m.device_tables["full"])[m.slot_of("b")][:6].min() >= 0

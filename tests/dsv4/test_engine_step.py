"""The engine's step: equals `forward_full` on random mixes of prefill chunks and decodes (prefix hits resuming from
SWA checkpoints, released window blocks, preemption), makes one host->device and one device->host transfer per
step, compiles one step program, and gives bitwise-identical logits whatever shares the step and however the
prompt is chunked."""

import dataclasses

import jax
import numpy as np
import pytest

from dsv4 import config, model
from dsv4.engine import workloads
from dsv4.engine.api import generate, run_workload
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.runner import Row
from dsv4.engine.sampling import SamplingParams
from tests.isolation import run_in_child

BASE = EngineConfig(max_num_seqs=4, max_num_batched_tokens=96, chunk_size=32, max_model_len=1024,
                    num_full_blocks=48, num_swa_blocks=160, record_logits=True)
# 10 swa blocks: with in-batch shared-prefix deferral (the default) the sessions' followers wait for the leader's
# system prompt, so 14 blocks no longer run out; 10 preempt 5 times on this trace (V4 and V4.1).
TINY_POOL = dataclasses.replace(BASE, num_full_blocks=4, num_swa_blocks=10)


@pytest.fixture(scope="module", params=["v4", "v41"])
def tiny(request):
  cfg = config.v4_tiny() if request.param == "v4" else config.v41_tiny()
  return cfg, model.init_params(cfg, jax.random.PRNGKey(0))


def _reference_logits(cfg, params, reqs, T=512):
  """forward_full over each request's prompt + output (one padded batch, one compile): the logits that should
  have produced output token i sit at position len(prompt) - 1 + i."""
  toks = np.zeros((len(reqs), T), np.int32)
  for b, r in enumerate(reqs):
    seq = r.prompt + r.output[:-1]
    assert len(seq) <= T
    toks[b, :len(seq)] = seq
  _, logits = model.forward_full(params, cfg, toks)
  return np.asarray(logits)


def _assert_matches_forward_full(cfg, params, eng, rids):
  reqs = [eng.requests[r] for r in rids]
  ref = _reference_logits(cfg, params, reqs)
  for b, r in enumerate(reqs):
    assert r.error is None, r.error
    got = np.stack(r.token_logits)
    want = ref[b, len(r.prompt) - 1: len(r.prompt) - 1 + len(r.output)]
    err = np.max(np.abs(got - want)) / max(1.0, np.max(np.abs(want)))
    assert err <= 1e-5, (r.rid, err)


def test_engine_equals_forward_full(tiny):
  """Chat sessions (shared system prompt: later turns resume from SWA checkpoints; prompts longer than the window
  release blocks behind it), chunked prefill mixed with decodes, caching on and a tiny pool that preempts."""
  cfg, params = tiny
  wl = workloads.chat(cfg.vocab_size, sessions=3, turns=2, system_len=140, seed=3)
  for ec in (BASE, TINY_POOL):
    eng = Engine(params, cfg, ec)
    rep = run_workload(eng, wl)
    s = rep.summary()
    if ec is BASE:
      assert s["prefix_hit_tokens"] > 0
    else:
      assert s["preemptions"] > 0
    _assert_matches_forward_full(cfg, params, eng, [o.rid for o in rep.outputs])


def test_one_transfer_each_way_per_step(monkeypatch):
  """Inside the runner nothing moves between host and device implicitly (transfer guard): sending a step makes
  exactly one device_put call (the packed plan and the cache bookkeeping) and reading it one device_get call (the
  sampled tokens and the cache's counters)."""
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  eng = Engine(params, cfg, BASE)
  calls = {"put": 0, "get": 0}
  put, get = jax.device_put, jax.device_get

  def counting_put(*a, **k):
    calls["put"] += 1
    return put(*a, **k)

  def counting_get(*a, **k):
    calls["get"] += 1
    return get(*a, **k)

  dispatch, collect = eng.runner.dispatch, eng.runner.collect
  per_step = []

  def guarded(fn, kind):
    def run(x):
      before = dict(calls)
      with jax.transfer_guard("disallow"):
        out = fn(x)
      per_step.append((kind, calls["put"] - before["put"], calls["get"] - before["get"],
                       len(x) if kind == "send" else 0))
      return out
    return run

  monkeypatch.setattr(jax, "device_put", counting_put)
  monkeypatch.setattr(jax, "device_get", counting_get)
  monkeypatch.setattr(eng.runner, "dispatch", guarded(dispatch, "send"))
  monkeypatch.setattr(eng.runner, "collect", guarded(collect, "read"))
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(2, cfg.vocab_size, n)] for n in (70, 5, 40, 130)]
  outs = generate(params, cfg, prompts, SamplingParams(max_tokens=6, ignore_eos=True), engine=eng)
  assert all(o.error is None and len(o.output) == 6 for o in outs)
  sends = [(p, g, n) for k, p, g, n in per_step if k == "send"]
  reads = [(p, g) for k, p, g, _ in per_step if k == "read"]
  assert sends and all(p == 1 and g == 0 for p, g, _ in sends), sends
  assert len(reads) == len(sends) and all(p == 0 and g == 1 for p, g in reads), reads
  assert any(n > 1 for _, _, n in sends), "some step must batch several rows"


def test_host_bytes_per_step_do_not_grow_with_context():
  """A decode step moves the same bytes between host and device at 64k context as at 2k: block tables never
  leave the device (blocks are allocated by count; the KV content does not matter for what moves)."""
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  ec = dataclasses.replace(BASE, max_model_len=70_000, num_full_blocks=1200, num_swa_blocks=64, max_num_seqs=4)
  eng = Engine(params, cfg, ec)
  mgr, runner = eng.cache_manager, eng.runner
  moved = {}
  for ctx in (2048, 65536):
    rid = f"r{ctx}"
    mgr.add_request(rid, (np.arange(ctx + 1) + ctx) % 400 + 2)
    for end in list(range(1024, ctx, 1024)) + [ctx]:      # window blocks are released behind it as it goes
      assert mgr.allocate_to(rid, end)
      mgr.commit(rid, end)
    assert mgr.allocate_to(rid, ctx + 1)
    row = Row(mgr.slot_of(rid), [7], ctx, SamplingParams(), 0)
    runner.run([row])                      # compiles this width
    before = dict(runner.stats)
    runner.run([row])
    moved[ctx] = (runner.stats["host_bytes_in"] - before["host_bytes_in"],
                  runner.stats["host_bytes_out"] - before["host_bytes_out"])
    mgr.free(rid)
  assert moved[65536] == moved[2048], moved


def test_compilation_is_bounded_and_counted():
  """The step is one program per engine, whatever the workload. A second engine with the same shapes compiles no
  step program at all and runs the same program; the report counts what really compiled."""
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  wl = workloads.random_prompts(cfg.vocab_size, requests=6, prompt_len=(20, 150), seed=4)
  first = Engine(params, cfg, BASE)
  run_workload(first, wl)
  rep = first.compile_report()
  assert rep["step_programs"] == {"ragged_step": 1}, rep
  assert rep["compilations_by_function"].get("jit(ragged_step)", 0) <= 1, rep
  second = Engine(params, cfg, BASE)
  run_workload(second, wl)
  rep2 = second.compile_report()
  assert rep2["compilations_by_function"].get("jit(ragged_step)", 0) == 0, rep2
  assert rep2["step_programs"] == rep["step_programs"]


def test_compile_counts_belong_to_their_engine():
  """An engine's report holds what its own work compiled, not what the caller or another engine compiled in the
  same process meanwhile."""
  cfg = dataclasses.replace(config.v4_tiny(), name="v4_tiny_compile_owner")   # programs no other test has built here
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  a, b = Engine(params, cfg, BASE), Engine(params, cfg, dataclasses.replace(BASE, max_num_batched_tokens=40))
  a.add_request("a0", list(range(2, 40)), SamplingParams(max_tokens=2, ignore_eos=True))
  a.step()
  before = a.compile_report()
  built = lambda rep: rep["compilations"] + rep["persistent_cache_hits"]   # noqa: E731 (the suite shares a disk cache)
  assert built(before) >= 1, before                   # the engine's first step built programs of its own

  @jax.jit
  def stranger(x):
    return x * 3 + 1

  stranger(jax.numpy.arange(7))                        # the caller compiles between the engine's steps
  b.add_request("b0", list(range(2, 90)), SamplingParams(max_tokens=2, ignore_eos=True))
  while b.has_work():                                  # another engine compiles its own (other-sized) programs
    b.step()
  after = a.compile_report()
  assert after["compilations_by_function"] == before["compilations_by_function"], (before, after)
  assert "jit(stranger)" not in b.compile_report()["compilations_by_function"]
  assert built(b.compile_report()) >= 1


def _invariant_runs(cfg, params, prompts, sp, ec):
  """Each prompt alone, all batched, a different chunk size, and a tiny pool that preempts: token logits."""
  runs = {}
  alone = []
  for p in prompts:
    eng = Engine(params, cfg, ec)
    (o,) = generate(params, cfg, [p], sp, engine=eng)
    alone.append((o.output, np.stack(o.token_logits)))
  runs["alone"] = alone
  for name, e in (("batched", ec), ("chunk8", dataclasses.replace(ec, chunk_size=8, max_num_batched_tokens=24)),
                  ("preempted", dataclasses.replace(ec, num_full_blocks=3, num_swa_blocks=8))):
    eng = Engine(params, cfg, e)
    outs = generate(params, cfg, prompts, sp, engine=eng)
    runs[name] = [(o.output, np.stack(o.token_logits)) for o in outs]
    if name == "preempted":
      assert eng.stats["preemptions"] > 0
  return runs


def test_batch_invariant_alone_equals_batched():
  """The default tier's batch-invariance check (the full one, every variant and a preempting pool at XLA's default
  level, is in the slow tier): V4, greedy, two short prompts, each alone vs both in one engine: bitwise-equal token
  logits. In the suite's process (its fast-compile level): the mechanism, not the code generator, is under test."""
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  ec = dataclasses.replace(BASE, max_model_len=128, num_full_blocks=8, num_swa_blocks=24,
                           max_num_batched_tokens=48)
  rng = np.random.default_rng(11)
  prompts = [[int(t) for t in rng.integers(2, cfg.vocab_size, n)] for n in (21, 9)]
  sp = SamplingParams(max_tokens=2, ignore_eos=True)
  alone = []
  for p in prompts:
    eng = Engine(params, cfg, ec)
    (o,) = generate(params, cfg, [p], sp, engine=eng)
    alone.append((o.output, np.stack(o.token_logits)))
  eng = Engine(params, cfg, ec)
  outs = generate(params, cfg, prompts, sp, engine=eng)
  for (tok_a, log_a), o in zip(alone, outs):
    assert tok_a == o.output
    assert np.array_equal(log_a.view(np.uint32), np.stack(o.token_logits).view(np.uint32))


def test_batch_invariant_mode_is_bitwise(tiny, request):
  """V4 greedy, V4.1 sampled (each variant's run covers alone / batched / chunk 8 / preempted). Runs in a child
  process at XLA's default optimisation level: the claim depends on the code XLA generates, so it is checked on the
  code users run, not the suite's fast-compile level."""
  if run_in_child(request, default_xla_opt=True):
    return
  cfg, params = tiny
  temperature = 0.0 if cfg.variant == "v4" else 0.9
  ec = dataclasses.replace(BASE, max_model_len=384, num_full_blocks=16, num_swa_blocks=48,
                           max_num_batched_tokens=64)
  rng = np.random.default_rng(7)
  prompts = [[int(t) for t in rng.integers(2, cfg.vocab_size, n)] for n in (70, 33, 140)]
  sp = SamplingParams(max_tokens=4, temperature=temperature, top_k=20, seed=3, ignore_eos=True)
  runs = _invariant_runs(cfg, params, prompts, sp, ec)
  ref = runs.pop("alone")
  for name, outs in runs.items():
    for (tok_a, log_a), (tok_b, log_b) in zip(ref, outs):
      assert tok_a == tok_b, name
      assert np.array_equal(log_a.view(np.uint32), log_b.view(np.uint32)), name


def test_carried_loop_buffers_never_change_a_logit(monkeypatch):
  """On the CPU the step's row-block loops write into buffers the engine hands from one step to the next
  (`row_invariant.LoopBuffers`), so a step fills nothing across its token budget; rows past a step's live blocks
  keep what earlier steps (other requests) left there. Those rows filled with NaN before every step give the same
  bits (bf16: the narrow buffers are carried as words). And the program hands every buffer back written in place:
  its entry computation copies no float array spanning the budget."""
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  ec = dataclasses.replace(TINY_POOL, dtype="bf16")
  wl = workloads.chat(cfg.vocab_size, sessions=3, turns=2, system_len=140, seed=3)

  def poison(bufs):
    """The buffers' every row NaN (bf16 carried as its word 0x7FC0)."""
    return tuple(jax.device_put([np.full(b.shape, 0x7FC0, b.dtype) if b.dtype == np.uint16
                                 else np.full(b.shape, np.nan, b.dtype) for b in bufs]))

  def run(poisoned: bool):
    eng = Engine(params, cfg, ec)
    runner = eng.runner
    if poisoned:
      real = runner._step_loop_buffers
      monkeypatch.setattr(runner, "_step_loop_buffers", lambda *a: poison(real(*a)))
    rep = run_workload(eng, wl)
    assert rep.summary()["preemptions"] > 0
    return eng, [np.stack(eng.requests[o.rid].token_logits) for o in rep.outputs]

  eng, carried = run(poisoned=False)
  assert eng.runner._loop_buffers, "the CPU engine carries its loop buffers"
  budget = eng.runner.step_shape.tokens
  entry = eng.runner.lowered_step().compile().as_text().split("\nENTRY ", 1)[1]
  wide = [f"{t}[{budget}," for t in ("f32", "u16", "bf16")] + [f"{t}[{budget}]" for t in ("f32", "u16", "bf16")]
  copies = [ln.strip()[:120] for ln in entry.splitlines() if " copy(" in ln and any(w in ln for w in wide)]
  assert not copies, copies
  _, nan_filled = run(poisoned=True)
  for a, b in zip(carried, nan_filled, strict=True):
    np.testing.assert_array_equal(a, b)

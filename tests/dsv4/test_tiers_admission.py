"""A request that fits is never refused, with KV tiers under a tight pool.

The admission's rule (`Scheduler.blocks_alone`, docs/tiers.md): a request whose blocks, run alone, fit every group's
pool is admitted, waits or is preempted, whatever it hits on the device or reloads from a tier; one that does not
is refused at admission, before anything is searched or loaded, with the same message with tiers or without.

Property: random traces (the invariance traces of tests/dsv4/test_invariance_props.py: documents shared between
requests, waves, chunk sizes, greedy and seeded sampling, async on / off) through one engine with KV tiers (host and
disk; Redis and Mooncake where their servers start) under a pool in which every request fits alone, with the device
cache dropped between some waves (everything is then found in the tiers, several admissions of one step reloading
at once) and some of the records damaged (the reload stops short, the request recomputes), then the same trace
through a second engine reading the first one's records from the shared tiers (disk, the store): no request is
refused, and every one's tokens and logits are bitwise those of the request alone on a fresh engine without tiers.

Reuse: one engine serving many batches whose request ids repeat (a notebook's "r0", "r1", ...), prefix caching on
and off, preemptions, tiers: every request's counters and bits equal those of a fresh engine (caching off: a fresh
engine per batch; caching on: one engine fed the same batches under ids that never repeat)."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from dsv4 import sharding
from dsv4.engine.engine import Engine
from dsv4.engine.request import Request, RequestOutput
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.scheduler import TOO_SMALL
from dsv4.engine.tiering_config import TieringConfig
from tests.dsv4.test_invariance_props import MESH, MESH_POOL, TIGHT, _Alone, _batched, _mesh_child, _model, traces
from tests.dsv4.test_tiers_reload import mooncake_server, redis_server  # noqa: F401  (fixtures)
from tests.isolation import run_in_child
from tests.store_servers import require_server

SP = SamplingParams(max_tokens=3, ignore_eos=True)
# The tightest pool every request of these traces fits alone in (Scheduler.blocks_alone: 3 full blocks, at most 5 swa
# blocks for a synchronous engine, which an engine with tiers is): admissions wait, preempt and, alone, shorten their
# rows. Alone runs (no tiers: async, one more swa block past an aligned boundary) use TIGHT's roomier swa pool.
SNUG = dataclasses.replace(TIGHT, num_swa_blocks=5)


def _tiers(kind: str, tmp: str, url: str = "") -> TieringConfig:
  tiers = {"local": ("host", "disk"), "redis": ("host", "disk", "redis"), "mooncake": ("host", "mooncake")}[kind]
  return TieringConfig(tiers=tiers, disk_dir=tmp, store_url=url, policy="load", write_queue=0)


def _damage(eng: Engine, rng: np.random.Generator, fraction: float) -> int:
  """Flip one byte in the middle of that fraction of every tier's records (as written by this engine). Returns how
  many were damaged."""
  eng.tiering.store.drain()
  n = 0
  for tier in eng.tiering.store.tiers:
    keys = sorted(tier._index)
    for k in [k for k in keys if rng.random() < fraction]:
      (data,) = tier.backend.get_many([k])
      if data is None:
        continue
      b = bytearray(data)
      b[len(b) // 2] ^= 0x20
      tier.backend.put(k, bytes(b))
      n += 1
  return n


def _fits_alone(eng: Engine, prompt, sp) -> bool:
  return eng.scheduler.fits_alone(Request("probe", list(prompt), sp))


@st.composite
def tier_traces(draw, vocab: int):
  """The invariance traces with tiers (tight pool, prefix caching on, three waves), plus: the device cache dropped
  before each later wave or not, the fraction of records damaged then, its seed."""
  reqs, run = draw(traces(vocab, with_tiers=True))
  run.update(drops=tuple(draw(st.booleans()) for _ in range(run["waves"] - 1)),
             damage=draw(st.sampled_from([0.0, 0.0, 0.2, 0.5])), damage_seed=draw(st.integers(0, 99)))
  return reqs, run


def _field_trace(vocab: int):
  """The field reports' shape: documents read, the device cache dropped, then resends whose prefixes are all in the
  tiers, admitted in one step: their reloads together fill the pool, so the first one's first chunk finds no block
  (the old admission refused it as too big to run alone). Then again with damaged records, then a wave that
  preempts and reloads after the preemption."""
  rng = np.random.default_rng(11)
  a = [int(t) for t in rng.integers(2, vocab, 300)]
  b = [int(t) for t in rng.integers(2, vocab, 200)]
  c = [int(t) for t in rng.integers(2, vocab, 330)]
  g = SamplingParams(max_tokens=3, ignore_eos=True)
  s = SamplingParams(max_tokens=4, temperature=0.8, top_k=16, seed=3, ignore_eos=True)
  reqs = [(a, g), (b, g), (a + [5], g), (b + [9], s), (a + [7, 7], g), (c, g), (b + [9, 4], s), (c[:250] + [3], g)]
  run = dict(chunk_size=16, enable_prefix_caching=True, async_scheduling=False, tight=True, waves=4, drafts=0,
             tiers=True, drops=(True, True, False), damage=0.3, damage_seed=1)
  return reqs, run


def _lone_trace(vocab: int):
  """One request alone, its rows of 48 tokens misaligned with the 128-token alignment: the row at 240 would hold 6
  swa blocks, the snug pool has 5, so it runs a shorter row there (then a resend reloads it after a drop)."""
  doc = [int(t) for t in np.random.default_rng(12).integers(2, vocab, 300)]
  g = SamplingParams(max_tokens=3, ignore_eos=True)
  run = dict(chunk_size=48, enable_prefix_caching=True, async_scheduling=False, tight=True, waves=2, drafts=0,
             tiers=True, drops=(True,), damage=0.0, damage_seed=0)
  return [(doc, g), (doc + [4], g)], run


def _drop_and_damage(run, rng):
  """before_wave for `_batched`: before a later wave whose drop flag is set, the engine runs dry, that fraction of
  the records is damaged and the device cache dropped (its blocks demoted first)."""
  def before_wave(eng: Engine, w: int) -> None:
    if run["drops"][w - 1]:
      while eng.has_work():
        eng.step()
      eng.tiering.drop_device_cache()
      _damage(eng, rng, run["damage"])
  return before_wave


def _check_never_refused(kind: str, examples: int, tmp_path, url: str = "", variant="v4", kv="bf16", mesh=None):
  """Alone = a fresh engine without tiers (on the same mesh)."""
  cfg, params, layout = _model(variant, kv)
  alone = _Alone(cfg, params, dataclasses.replace(TIGHT if mesh is None else MESH_POOL, layout=layout), mesh)
  pool = dataclasses.replace(SNUG if mesh is None else MESH_POOL, layout=layout)
  seen = {"shortened_rows": 0, "tier_hits": 0, "second_tier_hits": 0, "preemptions": 0, "rejected_records": 0, "examples": 0}

  @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
  @given(tier_traces(cfg.vocab_size))
  @example(_field_trace(cfg.vocab_size))
  @example(_lone_trace(cfg.vocab_size))
  def prop(trace):
    reqs, run = trace
    n = seen["examples"]
    seen["examples"] += 1
    tc = _tiers(kind, str(tmp_path / f"disk{n}"), url)
    if kind != "local":           # a store shared by the examples: each its own engine id and model digest
      tc = dataclasses.replace(tc, engine_id=f"e{n}", model_digest=f"admission-{n}")
    ec = dataclasses.replace(pool, chunk_size=run["chunk_size"], enable_prefix_caching=True,
                             async_scheduling=run["async_scheduling"], tiering=tc)
    eng, outs = _batched(cfg, params, ec, reqs, run["waves"], mesh,
                         _drop_and_damage(run, np.random.default_rng(run["damage_seed"])))
    assert all(_fits_alone(eng, p, sp) for p, sp in reqs)     # the pool serves every request alone
    eng.tiering.store.drain()
    # a second engine on the shared tiers (disk, the store) serves the trace again from the first one's records
    ec2 = dataclasses.replace(ec, tiering=dataclasses.replace(tc, tiers=tc.tiers[1:], engine_id=f"second{n}"))
    eng2, outs2 = _batched(cfg, params, ec2, reqs, run["waves"], mesh,
                           _drop_and_damage(run, np.random.default_rng(run["damage_seed"] + 1)))
    for e in (eng, eng2):
      seen["shortened_rows"] += e.stats["shortened_rows"]
      seen["tier_hits"] += e.tiering.stats["tier_hit_tokens"]
      seen["preemptions"] += e.stats["preemptions"]
      seen["rejected_records"] += e.tiering.stats["rejected_records"]
    for (prompt, sp), r, r2 in zip(reqs, outs, outs2):
      want_tokens, want_logits, _ = alone(prompt, sp)
      for x in (r, r2):
        assert x.error is None, (x.error, run, len(prompt), x.hit_tokens, x.tier_hit_tokens)
        assert x.output == want_tokens, (run, len(prompt))
        got = np.stack(x.token_logits)
        assert np.array_equal(got.view(np.uint32), want_logits.view(np.uint32)), (run, len(prompt))
    seen["second_tier_hits"] += eng2.tiering.stats["tier_hit_tokens"]
    eng.tiering.close()
    eng2.tiering.close()

  prop()
  assert seen["tier_hits"] > 0 and seen["second_tier_hits"] > 0 and seen["rejected_records"] > 0, seen
  assert seen["shortened_rows"] > 0 or mesh is not None, seen
  assert seen["preemptions"] > 0 or mesh is not None, seen     # (two rows per data shard on the mesh)
  return seen


@pytest.mark.parametrize("kind", ["local", "redis", "mooncake"])
def test_a_request_that_fits_is_never_refused(kind, tmp_path, request):
  """Host + disk; host + disk + Redis (the default tier's row: every tier kind but Mooncake in one engine, the second
  engine reading disk and Redis); host + Mooncake where its server starts. V4, bf16 compute and KV, the field
  trace, the lone trace and one drawn trace."""
  url = ""
  if kind == "mooncake":
    require_server("mooncake")
    if run_in_child(request):        # Mooncake's client never loads into a pytest worker (tests/isolation.py)
      return
  if kind != "local":
    url = request.getfixturevalue(f"{kind}_server").url
  _check_never_refused(kind, 1, tmp_path, url)


@pytest.mark.parametrize("variant,kv", [("v4", "bf16"), ("v4", "fp8"), ("v41", "bf16"), ("v41", "fp8")])
def test_a_request_that_fits_is_never_refused_every_variant(variant, kv, tmp_path):
  """More draws, V4 and V4.1 (its quantized cache: FP8 KV), bf16 and FP8 KV, host + disk."""
  _check_never_refused("local", 8, tmp_path, variant=variant, kv=kv)


def test_a_request_that_fits_is_never_refused_on_a_mesh(request, monkeypatch, tmp_path):
  """The fixed mesh (2, 2, 2), pools over data (each data shard its own tight pool, the refusal rule per shard),
  host + disk, V4 bf16; alone on the same mesh without tiers."""
  if _mesh_child(request, monkeypatch):
    return
  _check_never_refused("local", 3, tmp_path, mesh=sharding.make_mesh(MESH))


def test_too_big_alone_is_refused_at_admission_with_or_without_tiers(tmp_path):
  """A request whose blocks exceed the pool even alone is refused at admission, before any search, claim or load
  (no step runs for it), with one message whether the engine has tiers or not."""
  cfg, params, layout = _model("v4", "bf16")
  rng = np.random.default_rng(5)
  doc = [int(t) for t in rng.integers(2, cfg.vocab_size, 300)]
  small = dataclasses.replace(TIGHT, layout=layout, num_swa_blocks=4)       # crossing 256 alone takes 5
  errors = []
  for tc in (None, _tiers("local", str(tmp_path / "d"))):
    eng = Engine(params, cfg, dataclasses.replace(small, tiering=tc))
    assert not _fits_alone(eng, doc, SP) and _fits_alone(eng, doc[:100], SP)
    long = eng.add_request("long", doc, SP)
    assert eng.scheduler.blocks_alone(long) == {"full": 3, "swa": 5}
    eng.step()
    assert long.error == TOO_SMALL and long.computed_tokens == 0 and not eng.has_work()
    assert eng.cache_manager.stats["queried_tokens"] == 0          # never searched, claimed or loaded
    errors.append(long.error)
  assert errors[0] == errors[1]


# ------------------------------------------------------------------------------------------------ reuse

def _batches(vocab: int):
  """Batches of three requests with the ids r0, r1, r2 every time; documents shared across batches (hits, reloads
  after a drop), long enough that three at once preempt in the tight pool."""
  rng = np.random.default_rng(21)
  docs = [[int(t) for t in rng.integers(2, vocab, int(rng.integers(140, 300)))] for _ in range(3)]
  out = []
  for b in range(4):
    batch = []
    for i in range(3):
      d = docs[(b + i) % 3]
      tail = [int(t) for t in rng.integers(2, vocab, int(rng.integers(1, 40)))]
      sp = SamplingParams(max_tokens=3, temperature=0.8 if i == 1 else 0.0, top_k=16, seed=b, ignore_eos=True)
      batch.append((d[:int(rng.integers(120, len(d) + 1))] + tail, sp))
    out.append(batch)
  return out


def _serve(eng: Engine, batch, ids) -> list[RequestOutput]:
  for rid, (prompt, sp) in zip(ids, batch):
    eng.add_request(rid, prompt, sp)
  while eng.has_work():
    eng.step()
  return eng.take_outputs(ids)


def _same(a: RequestOutput, b: RequestOutput, what):
  fields = ("output", "finish_reason", "error", "hit_tokens", "tier_hit_tokens", "computed_tokens",
            "recomputed_tokens", "num_preemptions")
  assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}, what
  assert np.array_equal(np.stack(a.token_logits).view(np.uint32), np.stack(b.token_logits).view(np.uint32)), what


@pytest.mark.parametrize("caching", [False, True])
def test_an_engine_reused_with_repeating_ids_equals_a_fresh_one(caching, tmp_path):
  """One engine (tight pool, host + disk tiers, device cache dropped between some batches) serves four batches
  whose ids are r0, r1, r2 each time. Caching off: each batch's counters and bits equal a fresh engine's (no hit,
  ever: a request never matches blocks an earlier request of its id left). Caching on: they equal an engine fed the
  same batches under ids that never repeat (hits and reloads included, so nothing kept under an id leaks into the
  next request that has it)."""
  cfg, params, layout = _model("v4", "bf16")
  ec = dataclasses.replace(SNUG, layout=layout, chunk_size=32, enable_prefix_caching=caching)

  def engine(name):
    return Engine(params, cfg, dataclasses.replace(ec, tiering=_tiers("local", str(tmp_path / name))))

  reused = engine("reused")
  other = engine("unique") if caching else None
  seen = {"preemptions": 0, "hits": 0}
  for b, batch in enumerate(_batches(cfg.vocab_size)):
    if b == 2:                                    # everything the batches before left is in the tiers now
      reused.tiering.drop_device_cache()
      if other is not None:
        other.tiering.drop_device_cache()
    ids = ["r0", "r1", "r2"]
    got = _serve(reused, batch, ids)
    if caching:
      want = _serve(other, batch, [f"b{b}.{i}" for i in range(3)])
    else:
      fresh = engine(f"fresh{b}")
      want = _serve(fresh, batch, ids)
      fresh.tiering.close()
    for g, w in zip(got, want):
      assert g.error is None, g.error
      if not caching:
        assert g.hit_tokens == 0
      _same(g, w, (b, g.rid))
      seen["preemptions"] += g.num_preemptions
      seen["hits"] += g.hit_tokens
  assert seen["preemptions"] > 0, seen
  assert (seen["hits"] > 0) == caching, seen

"""A replica: one engine behind a small message interface, run as a Ray actor (`ray.remote(Replica)`) or, in
tests, as a plain object.

A background thread steps the engine whenever it has work; `submit` / `poll` only touch queues under a lock, so the
router never waits for a step. Roles:

* combined: prefill and decode of a request here.
* prefill: runs the prompt and samples the first token (max_tokens = 1); the request's whole state is read off its
  blocks as it finishes (`Engine.on_finish`, before they are freed) and handed to a decode replica
  (`dsv4.engine.handoff`) over its transfer endpoint, into the slot the router reserved.
* decode: `receive` verifies a handed-off state (all or nothing): the aligned part into its host tier, the tail past
  it kept for the admission; then it admits the request with prompt + first token. The admission loads the aligned
  part and writes the tail into the request's own blocks: it resumes where the prefill replica stopped and computes
  no prompt token.

The engine's KV events are teed (the tier glue consumes them too) into the global directory (`DirectoryFeed`)."""

from __future__ import annotations

import dataclasses
import threading
import time
import traceback
from typing import NamedTuple

import jax

from cache.events import EventLog
from cache.hashing import ExtraKeys
from cache.tiers.directory import RedisDirectory
from dsv4.engine import handoff
from dsv4.engine.engine import Engine
from dsv4.engine.request import Status
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.tiering_config import TieringConfig
from dsv4.serving import directory
from dsv4.serving.transfer import TransferEndpoint, TransferError

ROLES = ("combined", "prefill", "decode")


class TransferTarget(NamedTuple):
  """Where a prefill replica sends a request's state: the decode replica's transfer endpoint and the address of
  the slot reserved there."""
  endpoint: str
  address: int


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
  index: int
  role: str = "combined"
  engine_config: object = None            # dsv4.engine.engine.EngineConfig (its `tiering` set by the replica)
  tiers: tuple[str, ...] = ()             # KV tiers below the device ("host", "redis")
  demote: str = "evict"                   # evict (L2) | store (write-through to a shared L3)
  store_url: str = ""
  directory_url: str = ""                 # Redis of the global directory ("" = none)
  tier_policy: str = "auto"
  host_capacity_bytes: int = 1 << 30
  model_digest: str = ""                  # same weights on every replica: computed once by the caller

  def validate(self):
    if self.role not in ROLES:
      raise ValueError(f"ReplicaSpec.role: one of {', '.join(ROLES)}, got {self.role!r}")
    if self.role == "decode" and "host" not in self.tiers:
      raise ValueError("ReplicaSpec: a decode replica receives handed-off state into a host tier; add 'host'")


class _Tee(EventLog):
  """The manager's event log, with a copy of every event kept for the directory feed."""

  def __init__(self, inner: EventLog):
    super().__init__(inner.enabled)
    self._events = inner._events
    self.side: list = []

  def emit(self, ev) -> None:
    super().emit(ev)
    if self.enabled:
      self.side.append(ev)

  def take_side(self) -> list:
    out, self.side = self.side, []
    return out


class Replica:

  def __init__(self, loader, transfer_slots: int = 0, slot_bytes: int = 0, compile_cache_dir: str = ""):
    """loader: () -> (config, params), run here (a Ray actor loads its own weights). transfer_slots > 0: open a
    Mooncake transfer endpoint (prefill / decode roles)."""
    if compile_cache_dir:       # replicas share compiled programs through the persistent cache
      jax.config.update("jax_compilation_cache_dir", compile_cache_dir)
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
      jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    self.config, self.params = loader()
    self.transfer = None
    if transfer_slots:
      self.transfer = TransferEndpoint(transfer_slots, slot_bytes)
    self._lock = threading.RLock()
    self._stop = False
    self.engine = None
    self.spec = None
    self._thread = threading.Thread(target=self._loop, daemon=True, name="replica-steps")
    self._thread.start()

  # ------------------------------------------------------------------------------------------ setup
  def endpoint(self) -> str:
    return self.transfer.endpoint if self.transfer else ""

  def slot_address(self, slot: int) -> int:
    return self.transfer.slot_address(slot)

  def configure(self, spec: ReplicaSpec) -> dict:
    """(Re)build the engine for a role and tiers: an empty device cache, fresh tiers and counters."""
    spec.validate()
    with self._lock:
      self._close_engine()
      tc = TieringConfig(tiers=spec.tiers, store_url=spec.store_url, demote=spec.demote, policy=spec.tier_policy,
                         capacity_bytes=tuple(spec.host_capacity_bytes if t == "host" else 1 << 30
                                              for t in spec.tiers),
                         engine_id=f"r{spec.index}", model_digest=spec.model_digest, write_queue=0)
      self.engine = Engine(self.params, self.config, dataclasses.replace(spec.engine_config, tiering=tc))
      self.engine.clock = time.time          # one clock for every process on the host: TTFT across replicas
      if self.engine.tiering.unavailable():
        raise RuntimeError(f"replica {spec.index}: tiers down at start: {self.engine.tiering.unavailable()}")
      self.engine.tiering.warmup()
      self._tees = []
      for m in self.engine.managers:
        m.queue.events = _Tee(m.events)       # the queue emits into its log as results are read
        self._tees.append(m.events)
      self.spec = spec
      mgr = self.engine.managers[0]
      self.space = directory.KeySpace(mgr.model_id, mgr.specs.fingerprint, mgr.specs.hash_tokens,
                                      mgr.specs.full.block_tokens, mgr.key_bits)
      self.feed = None
      if spec.directory_url:
        import redis  # local: the Redis client, needed only where a directory is configured
        client = redis.Redis.from_url(spec.directory_url, socket_timeout=0.5, socket_connect_timeout=0.5)
        shared = next((t for t in spec.tiers if t in ("redis", "mooncake")), "")
        self.feed = directory.DirectoryFeed(RedisDirectory(client), spec.index, self.space,
                                            mgr.specs.full.bytes_per_block,
                                            host_tier="host" in spec.tiers and spec.demote == "evict",
                                            shared_store=shared if spec.demote == "store" else "")
        self.feed.restarted()                 # an empty engine: whatever the directory says we held is stale
      self._pending: dict[str, dict] = {}     # rid -> what to do when it finishes (prefill: where to send)
      self._exports: dict[str, tuple] = {}    # rid -> (plan, records, seconds) or the HandoffError, until sent
      if spec.role == "prefill":
        self.engine.on_finish = self._capture_state
      self._times: dict[str, list[float]] = {}
      self._done: list[dict] = []
      self.counters = {"exports": 0, "export_failures": 0, "imports": 0, "import_failures": 0,
                       "transfer_bytes": 0, "transfer_payload_bytes": 0}
      return {"space": dataclasses.asdict(self.space), "model_digest": self.engine.tiering.model_digest,
              "prefill_tokens_per_s": self.engine.tiering.cost.prefill_tps}

  def _close_engine(self):
    if self.engine is not None and self.engine.tiering is not None:
      self.engine.tiering.close()
    self.engine = None

  # ------------------------------------------------------------------------------------------ requests
  def submit(self, rid: str, prompt, max_tokens: int, tenant: str, arrival: float, send_to=None) -> None:
    """send_to (prefill role): the `TransferTarget` of the decode replica's reserved slot."""
    with self._lock:
      if self.spec.role == "prefill":
        max_tokens = 1
      self._pending[rid] = {"send_to": send_to, "tenant": tenant}
      self._times[rid] = []
      self.engine.add_request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                              ExtraKeys(tenant=tenant), arrival=arrival)

  def receive(self, rid: str, tokens, max_tokens: int, tenant: str, arrival: float, slot: int,
              lengths: list[int]) -> dict:
    """Decode role: read the handed-off state from `slot`, verify all of it, then admit prompt + first token for
    the remaining tokens. On any failure nothing is stored and the request is NOT admitted (the caller falls back)."""
    with self._lock:
      t0 = time.time()
      try:
        blob = self.transfer.receive(slot, sum(lengths))
        recs, off = [], 0
        for n in lengths:
          recs.append(blob[off:off + n])
          off += n
        plan = handoff.import_state(self.engine, rid, list(tokens), ExtraKeys(tenant=tenant), recs)
      except (handoff.HandoffError, TransferError) as e:
        self.counters["import_failures"] += 1
        return {"ok": False, "error": str(e)}
      self.counters["imports"] += 1
      self._pending[rid] = {"send_to": None, "tenant": tenant, "expect_hit": plan.point}
      self._times[rid] = []
      self.engine.add_request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                              ExtraKeys(tenant=tenant), arrival=arrival)
      return {"ok": True, "point": plan.point, "verify_s": time.time() - t0}

  def poll(self) -> dict:
    """Finished requests since the last poll, and the load as this replica sees it."""
    with self._lock:
      self._sweep_rejected()
      done, self._done = self._done, []
      e = self.engine
      held = list(e.waiting) + e.admitting + e.running
      queued = sum(len(r.tokens) - r.num_computed for r in held if r.num_computed < len(r.prompt))
      return {"done": done, "queued_prefill_tokens": queued, "running": len(held)}

  def stats(self) -> dict:
    with self._lock:
      t = self.engine.tiering
      return {"engine": dict(self.engine.stats), "tiering": {k: v for k, v in t.stats.items()},
              "tiers": t.store.summary(), "counters": dict(self.counters),
              "feed": dict(self.feed.stats) if self.feed else {},
              "transfer": dict(self.transfer.stats) if self.transfer else {},
              "prefill_tokens_per_s": t.cost.prefill_tps}

  def stop_transfer(self) -> None:
    """Fault injection: this replica's transfer backend goes down."""
    with self._lock:
      if self.transfer:
        self.transfer.stop()

  def shutdown(self) -> None:
    self._stop = True
    self._thread.join(timeout=5)
    with self._lock:
      self._close_engine()

  # ------------------------------------------------------------------------------------------ the step loop
  def _loop(self):
    while not self._stop:
      busy = False
      with self._lock:
        if self.engine is not None and self.engine.has_work():
          busy = True
          try:
            self._step()
          except Exception:  # noqa: BLE001 - announced on every poll, never swallowed
            self._done.append({"rid": None, "error": "replica step failed: " + traceback.format_exc(limit=3)})
            self._stop = True
      if not busy:
        time.sleep(0.002)

  def _step(self):
    e = self.engine
    done = e.step()
    now = time.time()
    for r in list(e.running) + done:
      ts = self._times.get(r.rid)
      if ts is not None:
        ts.extend([now] * (len(r.output) - len(ts)))
    for r in done:
      self._finished(r)
    if self.feed is not None:
      for tee in self._tees:
        self.feed.consume(tee.take_side())
    else:
      for tee in self._tees:
        tee.take_side()
    e.forget([r.rid for r in done])
    self._sweep_rejected()

  def _sweep_rejected(self):
    """Requests the engine refused (at the door or while scheduling) are reported like finished ones."""
    bad = [r for rid in list(self._pending) if (r := self.engine.requests.get(rid)) is not None
           and r.status is Status.REJECTED]
    for r in bad:
      self._finished(r)
    self.engine.forget([r.rid for r in bad])

  def _capture_state(self, r):
    """Engine.on_finish of a prefill replica: the state of a request to hand off, read while it holds its blocks."""
    info = self._pending.get(r.rid)
    if info is None or info.get("send_to") is None:
      return
    t0 = time.time()
    try:
      plan, recs = handoff.export_state(self.engine, r, ExtraKeys(tenant=info["tenant"]))
      self._exports[r.rid] = (plan, recs, time.time() - t0)
    except handoff.HandoffError as e:
      self._exports[r.rid] = e

  def _finished(self, r):
    info = self._pending.pop(r.rid, {})
    out = {"rid": r.rid, "output": list(r.output), "error": r.error, "arrival": r.arrival,
           "first_token_time": r.first_token_time, "token_times": self._times.pop(r.rid, []),
           "hit_tokens": r.hit_tokens, "tier_hit_tokens": r.tier_hit_tokens, "computed_tokens": r.computed_tokens,
           "recomputed_tokens": r.recomputed_tokens, "prompt_len": len(r.prompt), "replica": self.spec.index}
    if "expect_hit" in info:
      out["state_point"] = info["expect_hit"]
      out["reprefilled"] = r.hit_tokens < info["expect_hit"]     # must never happen after a good transfer
      # prompt tokens this replica ran itself: each output token computes exactly one new position (without
      # speculative decoding, whose verified drafts count as computed too) and recomputation after a preemption is
      # counted apart, so this is 0 when the handed state was adopted whole
      out["prompt_tokens_computed"] = r.computed_tokens - r.recomputed_tokens - len(r.output)
      self.engine.tiering.handed_tails.pop(r.rid, None)
    send_to = info.get("send_to")
    if send_to is not None and r.error is None:
      t0 = time.time()
      try:
        got = self._exports.pop(r.rid, None)
        if got is None:
          raise handoff.HandoffError("the request's state was not read before its blocks were freed")
        if isinstance(got, Exception):
          raise got
        plan, recs, export_s = got
        t0 -= export_s
        blob = b"".join(recs)
        self.transfer.send(send_to.endpoint, send_to.address, blob)
        self.counters["exports"] += 1
        self.counters["transfer_bytes"] += len(blob)
        self.counters["transfer_payload_bytes"] += plan.payload_bytes
        out["transfer"] = {"ok": True, "lengths": [len(x) for x in recs], "bytes": len(blob),
                           "payload_bytes": plan.payload_bytes, "point": plan.point, "seconds": time.time() - t0}
      except (handoff.HandoffError, TransferError) as err:
        self.counters["export_failures"] += 1
        out["transfer"] = {"ok": False, "error": str(err), "seconds": time.time() - t0}
    self._done.append(out)

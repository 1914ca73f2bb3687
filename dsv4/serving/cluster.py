"""The cluster: N replica actors on Ray, a router, the global directory in Redis, and the driver loop that plays a
workload's sessions against them (arrivals on a wall clock, follow-up turns after their previous turn finished).

Configurations (the matrix, `MATRIX`): Combined + round robin, Combined + KV-aware, and three P/D splits (half the
replicas prefill, half decode) with no shared cache, with an L2 host tier on the prefill replicas, and with an L3
store (Redis) the prefill replicas write through to and can all load from. Every configuration gets the same
trace, arrival pattern and SLO. Faults (`Fault`) are injected at wall-clock offsets of a phase: a replica actor
killed (its requests are re-routed and restarted from their prompt), a replica restarted empty, a transfer backend
stopped, the directory's Redis stopped."""

from __future__ import annotations

import dataclasses
import heapq
import time

import numpy as np

from cache.tiers.cost import CostModel
from cache.tiers.directory import RedisDirectory
from cache.tiers.servers import RedisServer
from dsv4 import caches
from dsv4.loading.weights_digest import params_digest
from dsv4.serving import directory
from dsv4.serving import workloads
from dsv4.serving.cost import RouteCostModel, RouteCosts
from dsv4.serving.replica import Replica, ReplicaSpec, TransferTarget
from dsv4.serving.router import KVAware, Load, RoundRobin


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
  name: str
  pd: bool = False                        # prefill / decode split (first half prefill, second half decode)
  router: str = "kv_aware"                # round_robin | kv_aware
  prefill_tiers: tuple[str, ...] = ()     # tiers of the replicas that compute prompts
  demote: str = "evict"                   # evict (L2 demotion) | store (write-through to the shared store)


MATRIX = (
    ClusterConfig("combined+rr", router="round_robin"),
    ClusterConfig("combined+kv"),
    ClusterConfig("pd", pd=True),
    ClusterConfig("pd+L2", pd=True, prefill_tiers=("host",)),
    ClusterConfig("pd+L3", pd=True, prefill_tiers=("host", "redis"), demote="store"),
)


@dataclasses.dataclass(frozen=True)
class Fault:
  """At `at_s` seconds into a phase. A kill waits past at_s until the replica holds a request (or nothing is left to
  arrive): an idle replica's death re-routes nothing, and whether it is idle at a fixed instant depends on the box."""
  at_s: float
  action: str            # kill | restart | transfer_down | redis_down
  replica: int = 0


@dataclasses.dataclass(frozen=True)
class SLO:
  ttft_s: float = 3.0
  tpot_s: float = 0.25


def state_slot_bytes(specs, max_model_len: int) -> int:
  """A transfer slot: the largest state (every full block of max_model_len, a window tail and the swa blocks of
  the last alignment) plus headers."""
  nswa = specs.swa.need_blocks + specs.align_tokens // specs.swa.block_tokens
  full = specs.full.bytes_per_block * (max_model_len // specs.full.block_tokens + 1)
  swa = specs.swa.bytes_per_block * nswa
  n = max_model_len // specs.full.block_tokens + 1 + nswa
  return full + swa + n * 16384


class _Slots:
  def __init__(self, n: int):
    self.free = list(range(n))

  def take(self):
    return self.free.pop(0) if self.free else None

  def give(self, s):
    if s is not None:
      self.free.append(s)


class Cluster:

  def __init__(self, loader, engine_config, num_replicas: int = 4, ray_address: str = "", num_cpus: int = 4,
               compile_cache_dir: str = "", transfer_slots: int = 16, progress=None):
    import ray  # local: Ray is heavy to import and only a running cluster needs it
    self.ray = ray
    self.loader, self.ec, self.n = loader, engine_config, num_replicas
    self.compile_cache_dir = compile_cache_dir
    self.config, self.params = loader()
    self.specs = caches.group_specs(self.config, engine_config.layout)
    self.slot_bytes = state_slot_bytes(self.specs, engine_config.max_model_len)
    self.transfer_slots = transfer_slots
    self.redis = RedisServer()
    self.directory_url = self.redis.url                     # db 0: the prefix directory
    self.store_url = self.redis.url[:-1] + "1"              # db 1: the L3 record store
    self._own_ray = not ray.is_initialized()
    if self._own_ray:
      ray.init(address=ray_address or None, num_cpus=None if ray_address else num_cpus,
               include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    self.model_digest = params_digest(self.params)
    self.actor_cls = ray.remote(Replica)
    self.handles: list = [None] * num_replicas
    self._progress = progress
    # the first replica compiles (filling the persistent cache), the others then load those programs
    self._start(0)
    self._warm([0])
    for i in range(1, num_replicas):
      self._start(i)
    self._warm(list(range(1, num_replicas)))
    self.endpoints = ray.get([h.endpoint.remote() for h in self.handles])
    self.slot_addr = [ray.get([h.slot_address.remote(s) for s in range(transfer_slots)]) for h in self.handles]

  def _start(self, i: int):
    self.handles[i] = self.actor_cls.options(num_cpus=0, max_concurrency=4).remote(
        self.loader, self.transfer_slots, self.slot_bytes, self.compile_cache_dir)

  def _warm(self, idx):
    """Compile the step programs a short request and a batch of them use (kept out of every measurement)."""
    ray = self.ray
    ray.get([self.handles[i].configure.remote(ReplicaSpec(i, "combined", self.ec, model_digest=self.model_digest))
             for i in idx])
    rng = np.random.default_rng(123)
    for i in idx:
      for j, n in enumerate((300, 40, 140, 20)):
        self.handles[i].submit.remote(f"warm{j}", [int(x) for x in rng.integers(2, self.config.vocab_size, n)],
                                      4, "warm", time.time())
    left = {i: 4 for i in idx}
    while any(left.values()):
      for i in idx:
        if left[i]:
          left[i] -= len(ray.get(self.handles[i].poll.remote())["done"])
      time.sleep(0.05)

  # ------------------------------------------------------------------------------------------ configurations
  def _specs(self, cfg: ClusterConfig) -> list[ReplicaSpec]:
    out = []
    for i in range(self.n):
      if not cfg.pd:
        out.append(ReplicaSpec(i, "combined", self.ec, directory_url=self.directory_url,
                               model_digest=self.model_digest))
      elif i < self.n // 2:
        out.append(ReplicaSpec(i, "prefill", self.ec, tiers=cfg.prefill_tiers, demote=cfg.demote,
                               store_url=self.store_url if "redis" in cfg.prefill_tiers else "",
                               directory_url=self.directory_url, model_digest=self.model_digest,
                               host_capacity_bytes=8 * self.specs.full.bytes_per_block * 4))
      else:
        out.append(ReplicaSpec(i, "decode", self.ec, tiers=("host",), tier_policy="load",
                               directory_url=self.directory_url, model_digest=self.model_digest))
    return out

  def configure(self, cfg: ClusterConfig):
    import redis  # local: the Redis client, needed only where a cluster runs
    for db in (self.directory_url, self.store_url):
      redis.Redis.from_url(db).flushdb()
    self.cfg = cfg
    self.rspecs = self._specs(cfg)
    infos = self.ray.get([h.configure.remote(s) for h, s in zip(self.handles, self.rspecs)])
    self.space = directory.KeySpace(**infos[0]["space"])
    client = redis.Redis.from_url(self.directory_url, socket_timeout=0.5, socket_connect_timeout=0.5)
    self.prefixes = directory.PrefixDirectory(RedisDirectory(client), self.space)
    speeds = CostModel(prefill_tokens_per_s=infos[0]["prefill_tokens_per_s"])
    speeds.calibrate("host", 1e-4, 2e9)
    speeds.calibrate("redis", 1e-3, 2e8)
    per_token = (self.specs.full.bytes_per_block / self.specs.full.block_tokens)
    model = RouteCostModel(speeds, RouteCosts(bytes_per_token=per_token))
    front = list(range(self.n // 2)) if cfg.pd else list(range(self.n))
    if cfg.router == "round_robin":
      self.router = RoundRobin(front)
    else:
      self.router = KVAware(front, self.prefixes, model, shared_store="redis" if "redis" in cfg.prefill_tiers else "",
                            host_tiers="host" in cfg.prefill_tiers and cfg.demote == "evict")
    self.decode_pool = list(range(self.n // 2, self.n)) if cfg.pd else []
    self.slots = {d: _Slots(self.transfer_slots) for d in self.decode_pool}

  # ------------------------------------------------------------------------------------------ one phase
  def run(self, sessions: list[workloads.Session], faults: tuple[Fault, ...] = ()) -> dict:
    """Play the sessions; returns {"requests": [...], "stats": {...}}."""
    ray = self.ray
    t0 = time.time()
    arrivals = [(s.start_s, n, s.sid, 0) for n, s in enumerate(sessions)]
    heapq.heapify(arrivals)
    by_sid = {s.sid: s for s in sessions}
    answers: dict[str, list[list[int]]] = {s.sid: [] for s in sessions}
    out: dict[str, dict] = {}
    live: dict[str, dict] = {}              # rid -> what the driver knows about a request in flight
    alive = set(range(self.n))
    loads = {i: Load() for i in range(self.n)}
    counters = {"fallbacks": 0, "rerouted": 0, "transfer_failures": 0, "receive_failures": 0, "reprefilled": 0,
                "killed": 0, "restarted": 0}
    pending_faults = sorted(faults, key=lambda f: f.at_s)
    seq = len(arrivals)
    total = sum(len(s.turns) for s in sessions)

    def submit(rid, prefer=None):
      info = live[rid]
      s = by_sid[info["sid"]]
      prompt = info["prompt"]
      if info.get("fallback"):               # Combined on a live replica: the whole request there
        pool = [r for r in (self.decode_pool or list(range(self.n))) if r in alive] or sorted(alive)
        r = min(pool, key=lambda i: (loads[i].running, i)) if prefer is None else prefer
        info.update(replica=r, stage="combined")
        self.handles[r].submit.remote(rid, prompt, s.max_tokens, s.tenant, info["arrival"])
        return
      est = self.router.route(prompt, s.tenant, loads, alive)
      r = est.replica
      info.update(replica=r, predicted_reuse=est.reuse_tokens)
      send_to = None
      if self.cfg.pd:
        dpool = [d for d in self.decode_pool if d in alive]
        d = min(dpool, key=lambda i: (loads[i].running, i)) if dpool else None
        slot = self.slots[d].take() if d is not None else None
        if slot is None:                    # no decode replica or slot: this one runs Combined (counted)
          info["fallback"] = True
          counters["fallbacks"] += 1
          return submit(rid)
        info.update(decode=d, slot=slot, stage="prefill")
        send_to = TransferTarget(self.endpoints[d], self.slot_addr[d][slot])
      else:
        info["stage"] = "combined"
      self.handles[r].submit.remote(rid, prompt, s.max_tokens, s.tenant, info["arrival"], send_to)

    def finish(rid, res_out, first_time, times, hit, extra):
      info = live.pop(rid)
      if info.get("slot") is not None:
        self.slots[info["decode"]].give(info["slot"])
      rec = {"rid": rid, "sid": info["sid"], "turn": info["turn"], "group": by_sid[info["sid"]].group,
             "prompt_len": len(info["prompt"]), "output": res_out, "arrival": info["arrival"],
             "first_token_time": first_time, "token_times": times, "hit_tokens": hit,
             "fallback": bool(info.get("fallback")), "rerouted": bool(info.get("rerouted")), **extra}
      out[rid] = rec
      answers[info["sid"]].append(res_out)
      s = by_sid[info["sid"]]
      if info["turn"] + 1 < len(s.turns):
        nonlocal seq
        heapq.heappush(arrivals, (time.time() - t0 + s.think_s, seq, s.sid, info["turn"] + 1))
        seq += 1
      if self._progress:
        self._progress(1)

    def holds(info, i):
      """Whether replica i holds the live request (what its death re-routes)."""
      st = info["stage"]
      return (st in ("prefill", "combined") and info.get("replica") == i) or (st == "decode" and info["decode"] == i)

    def _due(f):
      if f.action != "kill" or not (arrivals or live):
        return True
      return any(holds(info, f.replica) for info in live.values())

    def lost(i):
      """Replica i is gone: forget its directory entries, re-route everything it held."""
      alive.discard(i)
      counters["killed"] += 1
      try:
        directory.drop_replica(self.prefixes.dir, i)
      except Exception:  # noqa: BLE001
        pass
      for rid, info in list(live.items()):
        st = info["stage"]
        if holds(info, i):
          counters["rerouted"] += 1
          info["rerouted"] = True
          if info.get("slot") is not None:
            self.slots[info["decode"]].give(info["slot"])
            info["slot"] = None
          info.pop("first", None)
          if st == "decode" or (self.cfg.pd and not any(r in alive for r in self.router.pool)):
            info["fallback"] = True          # the prefilled state died with its decode replica: run Combined
          submit(rid)
        elif st == "prefill" and info.get("decode") == i:   # its decode target died: Combined once prefilled
          info["fallback"] = True

    while arrivals or live or pending_faults:
      now = time.time() - t0
      while pending_faults and pending_faults[0].at_s <= now and _due(pending_faults[0]):
        self._fault(pending_faults.pop(0), alive, counters)
      while arrivals and arrivals[0][0] <= now:
        _, _, sid, k = heapq.heappop(arrivals)
        s = by_sid[sid]
        rid = f"{sid}.t{k}"
        live[rid] = {"sid": sid, "turn": k, "prompt": s.prompt(k, answers[sid]), "arrival": t0 + max(now, 0.0)}
        submit(rid)
      polls = {i: self.handles[i].poll.remote() for i in sorted(alive)}
      for i, ref in polls.items():
        try:
          p = ray.get(ref, timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
          lost(i)
          continue
        loads[i] = Load(p["queued_prefill_tokens"], p["running"])
        for res in p["done"]:
          rid = res["rid"]
          if rid is None:
            raise RuntimeError(f"replica {i}: {res['error']}")
          info = live.get(rid)
          if info is None or info.get("replica") != i and info.get("decode") != i:
            continue                        # a late answer from before a re-route
          if res["error"]:
            raise RuntimeError(f"request {rid} refused by replica {i}: {res['error']}")
          if info["stage"] == "prefill":
            tr = res.get("transfer", {"ok": False, "error": "no transfer"})
            info["first"] = res
            d = info["decode"]
            if tr["ok"] and not info.get("fallback") and d in alive:
              s = by_sid[info["sid"]]
              try:
                got = ray.get(self.handles[d].receive.remote(
                    rid, info["prompt"] + res["output"], s.max_tokens - 1, s.tenant, info["arrival"],
                    info["slot"], tr["lengths"]), timeout=30)
              except ray.exceptions.RayActorError:
                got = {"ok": False, "error": "decode replica died"}
              if got["ok"]:
                info.update(stage="decode", transfer=tr, replica=i)
                continue
              counters["receive_failures"] += 1
            elif not tr["ok"]:
              counters["transfer_failures"] += 1
            counters["fallbacks"] += 1
            self.slots[d].give(info.pop("slot"))
            info["fallback"] = True
            submit(rid)
          elif info["stage"] == "decode" and i == info["decode"]:
            first = info["first"]
            counters["reprefilled"] += int(res.get("reprefilled", False))
            tr = info["transfer"]
            finish(rid, first["output"] + res["output"], first["first_token_time"],
                   first["token_times"] + res["token_times"], first["hit_tokens"],
                   {"transfer_bytes": tr["bytes"], "transfer_payload_bytes": tr["payload_bytes"],
                    "transfer_s": tr["seconds"], "state_point": tr["point"], "prefill_replica": first["replica"],
                    "decode_replica": i, "decode_hit_tokens": res["hit_tokens"],
                    "decode_prompt_tokens_computed": res["prompt_tokens_computed"],
                    "recomputed_tokens": first["recomputed_tokens"] + res["recomputed_tokens"]})
          else:
            finish(rid, res["output"], res["first_token_time"], res["token_times"], res["hit_tokens"],
                   {"replica": i, "recomputed_tokens": res["recomputed_tokens"]})
      if len(out) == total and not pending_faults:
        break
      time.sleep(0.01)
    stats = {"wall_s": time.time() - t0, **counters, "router": dict(self.router.stats),
             "replicas": {i: self.ray.get(self.handles[i].stats.remote()) for i in sorted(alive)}}
    return {"requests": [out[k] for k in sorted(out)], "stats": stats}

  def _fault(self, f: Fault, alive: set, counters: dict):
    ray = self.ray
    if f.action == "kill":
      ray.kill(self.handles[f.replica], no_restart=True)
    elif f.action == "restart":             # a fresh, empty replica under the same index
      self._start(f.replica)
      ray.get(self.handles[f.replica].configure.remote(self.rspecs[f.replica]))
      self.endpoints[f.replica] = ray.get(self.handles[f.replica].endpoint.remote())
      self.slot_addr[f.replica] = ray.get([self.handles[f.replica].slot_address.remote(s)
                                           for s in range(self.transfer_slots)])
      alive.add(f.replica)
      counters["restarted"] += 1
    elif f.action == "transfer_down":
      ray.get(self.handles[f.replica].stop_transfer.remote())
    elif f.action == "redis_down":
      self.redis.stop()
    else:
      raise ValueError(f"unknown fault {f.action!r}")

  def shutdown(self):
    for h in self.handles:
      try:
        self.ray.get(h.shutdown.remote(), timeout=10)
      except Exception:  # noqa: BLE001 - a killed replica has nothing to shut down
        pass
      try:
        self.ray.kill(h)
      except Exception:  # noqa: BLE001
        pass
    if self._own_ray:
      self.ray.shutdown()
    self.redis.stop()

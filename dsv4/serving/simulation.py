"""A discrete-event model of the cluster matrix at node scale: the same router (`router.KVAware` /
`RoundRobin`), cost model, directory (`DirectoryFeed` / `PrefixDirectory` over a local directory) and workload
generator as the real cluster, with engines replaced by timing constants. Every number it produces is a PREDICTION
from the constants below, not a measurement.

Each replica is a prefill server (first come, first served; a prefill of n new tokens takes n / prefill rate,
slowed by the decode work it shares the GPUs with) plus a decode batch (a token every `decode step` seconds). Its
device prefix cache is an LRU of full-history blocks sized from the HBM left for KV; evicted blocks go to an L2 host
LRU when the configuration has one; an L3 store holds every block any prefill replica wrote through. Reuse is
the longest prefix of the request's real chained block hashes found in one place, read at that place's speed
(HBM: free, host: PCIe, L3 / P/D transfer: RDMA), and taken only when the cost model says it beats recomputing."""

from __future__ import annotations

import collections
import dataclasses
import heapq

import jax.numpy as jnp
import numpy as np

from cache.events import BlockRemoved, BlockStored
from cache.tiers.cost import CostModel
from cache.tiers.directory import LocalDirectory
from dsv4 import caches, config
from dsv4.serving import directory
from dsv4.serving import workloads
from dsv4.serving.cluster import MATRIX, ClusterConfig
from dsv4.serving.cost import DEVICE, RouteCostModel, RouteCosts
from dsv4.serving.router import KVAware, Load, RoundRobin


@dataclasses.dataclass(frozen=True)
class NodeConstants:
  """One 8 x H200 node cut into replicas. Sources: H200 HBM 141 GB at 4.8 TB/s; PCIe Gen5 x16 (~64 GB/s peak,
  50 GB/s assumed); 400 Gb/s RDMA NICs (50 GB/s); prefill and decode throughput per node from the published
  DeepSeek-V3 / R1 inference figures on 8 x H800 (73.7k input tokens/s prefill, 14.8k output tokens/s decode per
  node), kept as they are for V4-Flash (an assumption: V4-Flash activates fewer parameters per token)."""
  replicas: int = 4                         # 2 GPUs each
  node_prefill_tokens_per_s: float = 73_700.0
  node_decode_tokens_per_s: float = 14_800.0
  decode_batch: int = 64                    # requests decoding at once per replica
  kv_hbm_bytes: float = 2 * 30e9            # HBM left for KV per replica (2 GPUs, after weights and activations)
  host_bytes: float = 2 * 200e9             # L2 host memory per replica
  pcie_bytes_per_s: float = 50e9
  rdma_bytes_per_s: float = 50e9
  rdma_latency_s: float = 20e-6
  directory_lookup_s: float = 200e-6

  @property
  def prefill_tokens_per_s(self) -> float:
    return self.node_prefill_tokens_per_s / self.replicas

  @property
  def decode_step_s(self) -> float:
    return self.decode_batch / (self.node_decode_tokens_per_s / self.replicas)


def node_sizes() -> workloads.WorkloadSizes:
  """The CPU matrix's workload, at the lengths a served model sees (system prompts, documents of thousands)."""
  return workloads.WorkloadSizes(chat_sessions=64, chat_tenants=4, chat_system=4096, chat_turns=4, chat_user=256,
                                 agent_sessions=32, agent_base=8192, agent_turns=4, agent_tool=1024, rag_docs=16,
                                 rag_doc=8192, rag_requests=128, rag_question=128, control_requests=64,
                                 control_prompt=4096, spacing_s=0.05, max_tokens=256)


class _Replica:
  def __init__(self, cap_blocks, host_blocks):
    self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()
    self.host: collections.OrderedDict[int, None] = collections.OrderedDict()
    self.cap, self.host_cap = cap_blocks, host_blocks
    self.free_at = 0.0
    self.decoding: list[float] = []        # end times of requests decoding here

  def running(self, now):
    self.decoding = [t for t in self.decoding if t > now]
    return len(self.decoding)


def handed_state_bytes(specs, prompt_len: int) -> int:
  """Payload of a P/D transfer for a prompt of prompt_len tokens: every full block up to its end (the last one
  partially filled), the window tail of the aligned point before it and the swa blocks from there on (the count
  `benchmarks.sizing.handoff_state_bytes` makes, which the slow matrix test checks against real transfers)."""
  L, sb = prompt_len, specs.swa.block_tokens
  P = L // specs.align_tokens * specs.align_tokens
  swa = min(specs.swa.need_blocks, P // sb) + -(-L // sb) - P // sb
  return -(-L // specs.full.block_tokens) * specs.full.bytes_per_block + swa * specs.swa.bytes_per_block


def simulate(cfg: ClusterConfig, sessions: list[workloads.Session], block_bytes: int, state_bytes,
             nc: NodeConstants = NodeConstants(), block_tokens: int = 128) -> list[dict]:
  """Per request: ttft, e2e, hit tokens, transfer bytes (all predicted). state_bytes(prompt_len): the bytes a P/D
  transfer carries."""
  space = directory.KeySpace("sim", "sim", block_tokens, block_tokens)
  dirx = LocalDirectory()
  n = nc.replicas
  reps = [_Replica(int(nc.kv_hbm_bytes // block_bytes), int(nc.host_bytes // block_bytes)) for _ in range(n)]
  front = list(range(n // 2)) if cfg.pd else list(range(n))
  back = list(range(n // 2, n)) if cfg.pd else []
  l2 = "host" in cfg.prefill_tiers and cfg.demote == "evict"
  l3 = "redis" in cfg.prefill_tiers
  feeds = [directory.DirectoryFeed(dirx, i, space, block_bytes, ttl_s=None, host_tier=l2,
                                   shared_store="redis" if l3 else "") for i in range(n)]
  speeds = CostModel(prefill_tokens_per_s=nc.prefill_tokens_per_s)
  speeds.calibrate("host", 1e-5, nc.pcie_bytes_per_s)
  speeds.calibrate("redis", nc.rdma_latency_s, nc.rdma_bytes_per_s)
  model = RouteCostModel(speeds, RouteCosts(lookup_s=nc.directory_lookup_s, bytes_per_token=block_bytes / block_tokens,
                                            decode_s_per_running=nc.decode_step_s / nc.decode_batch))
  router = (RoundRobin(front) if cfg.router == "round_robin" else
            KVAware(front, directory.PrefixDirectory(dirx, space), model, shared_store="redis" if l3 else "", host_tiers=l2))
  l3_blocks: set[int] = set()
  by_sid = {s.sid: s for s in sessions}
  answers = {s.sid: [] for s in sessions}
  heap = [(s.start_s, i, s.sid, 0) for i, s in enumerate(sessions)]
  heapq.heapify(heap)
  seq, out = len(heap), []
  while heap:
    now, _, sid, k = heapq.heappop(heap)
    s = by_sid[sid]
    prompt = s.prompt(k, answers[sid])
    loads = {i: Load(int(max(reps[i].free_at - now, 0) * nc.prefill_tokens_per_s), reps[i].running(now))
             for i in range(n)}
    r = router.route(prompt, s.tenant, loads).replica
    rep = reps[r]
    hashes = space.block_hashes(prompt[:-1], s.tenant)
    # what is really there: the longest run on the device, in its host tier, or in the L3 store
    def run(have):
      m = 0
      while m < len(hashes) and hashes[m] in have:
        m += 1
      return m * block_tokens
    places = [(DEVICE, run(rep.lru))] + ([("host", run(rep.host))] if l2 else []) + \
        ([("redis", run(l3_blocks))] if l3 else [])
    best_t, reuse = speeds.recompute_seconds(len(prompt)), 0
    for place, tok in places:
      t = model.read_seconds(place, tok) + speeds.recompute_seconds(len(prompt) - tok)
      if tok and t < best_t:
        best_t, reuse = t, tok
    slow = 1.0 + rep.running(now) / nc.decode_batch
    start = max(now, rep.free_at)
    first = start + best_t * slow
    rep.free_at = first
    # the prompt's blocks are now on the device (LRU; evictions demote to host with L2, all written through with L3)
    evs = []
    for h in space.block_hashes(prompt, s.tenant):
      if h in rep.lru:
        rep.lru.move_to_end(h)
        continue
      rep.lru[h] = None
      evs.append(BlockStored(h, None, "full", s.tenant, 0, block_tokens))
      if l3:
        l3_blocks.add(h)
      while len(rep.lru) > rep.cap:
        old, _ = rep.lru.popitem(last=False)
        evs.append(BlockRemoved(old, "full", s.tenant, 0))
        if l2:
          rep.host[old] = None
          while len(rep.host) > rep.host_cap:
            rep.host.popitem(last=False)
    feeds[r].consume(evs)
    xfer = 0
    dec = rep
    if cfg.pd:
      d = min(back, key=lambda i: (reps[i].running(first), i))
      dec = reps[d]
      xfer = state_bytes(len(prompt))
      first += nc.rdma_latency_s + xfer / nc.rdma_bytes_per_s      # decode starts once the state arrived
    step = nc.decode_step_s * (1.0 + dec.running(first) / nc.decode_batch) / 2
    end = first + (s.max_tokens - 1) * step
    dec.decoding.append(end)
    answers[sid].append([2 + (len(prompt) + j) % 60 for j in range(8)])    # stand-in answer tokens
    out.append({"rid": f"{sid}.t{k}", "group": s.group, "ttft_s": first - now, "e2e_s": end - now,
                "tpot_s": step, "hit_tokens": reuse, "prompt_len": len(prompt), "transfer_bytes": xfer})
    if k + 1 < len(s.turns):
      heapq.heappush(heap, (end + s.think_s, seq, sid, k + 1))
      seq += 1
  return out


def predict_matrix(model_preset: str = "v4_flash", groups=workloads.GROUPS, nc: NodeConstants = NodeConstants(),
                   sizes: workloads.WorkloadSizes | None = None) -> list[dict]:
  """The five configurations x the groups at node scale (bf16 KV records of the named preset)."""
  cfg = config.get_preset(model_preset)
  specs = caches.group_specs(cfg, caches.CacheLayout(kv_dtype=jnp.bfloat16))
  sizes = sizes or node_sizes()
  rows = []
  for c in MATRIX:
    for g in groups:
      reqs = simulate(c, workloads.build(g, cfg.vocab_size, sizes), specs.full.bytes_per_block,
                      lambda L: handed_state_bytes(specs, L), nc)
      ttft = [r["ttft_s"] for r in reqs]
      rows.append({"config": c.name, "group": g, "requests": len(reqs), "predicted": True,
                   "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
                   "e2e_p50_s": float(np.percentile([r["e2e_s"] for r in reqs], 50)),
                   "hit_tokens": int(sum(r["hit_tokens"] for r in reqs)),
                   "prompt_tokens": int(sum(r["prompt_len"] for r in reqs)),
                   "transfer_bytes_mean": float(np.mean([r["transfer_bytes"] for r in reqs]))})
  return rows

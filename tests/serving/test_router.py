"""The router's pure parts: the cost model (load vs recompute, queueing), the prefix directory fed from KV events
(consistency after a replica restart, TTL, a dead server), tenant isolation across replicas. Plain Python: no engine,
no Ray."""

import time

import pytest

from cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from cache.tiers.cost import CostModel
from cache.tiers.directory import LocalDirectory, RedisDirectory
from cache.tiers.servers import RedisServer
from dsv4.serving import directory
from dsv4.serving.cost import DEVICE, Candidate, RouteCostModel, RouteCosts, Source
from dsv4.serving.router import KVAware, Load, RoundRobin
from tests.store_servers import require_server

SPACE = directory.KeySpace(model_id="m", layout="lay", hash_tokens=32, block_tokens=128)
PROMPT = list(range(2, 2 + 600))          # 4 complete blocks


def _speeds(prefill_tps=2000.0, shared_bytes_per_s=1e9, latency_s=1e-3):
  cm = CostModel(prefill_tokens_per_s=prefill_tps)
  cm.calibrate("redis", latency_s, shared_bytes_per_s)
  cm.calibrate("host", 1e-5, 1e10)
  return cm


def _stored(replica_feed, tokens, tenant):
  evs = [BlockStored(h, None, "full", tenant, i, 128) for i, h in enumerate(SPACE.block_hashes(tokens, tenant))]
  replica_feed.consume(evs)
  return evs


def test_cost_model_picks_recompute_when_the_read_is_slow():
  fast, slow = RouteCostModel(_speeds(shared_bytes_per_s=1e9)), RouteCostModel(_speeds(shared_bytes_per_s=1e3))
  c = Candidate(0, (Source("redis", 512),))
  assert fast.estimate(c, 600).reuse_tokens == 512 and fast.estimate(c, 600).place == "redis"
  e = slow.estimate(c, 600)             # 512 tokens x 256 B at 1 kB/s: minutes, vs 0.26 s of prefill
  assert e.reuse_tokens == 0 and e.place == "" and e.read_s == 0.0
  # a device hit costs no read: always taken
  assert slow.estimate(Candidate(0, (Source(DEVICE, 512),)), 600).reuse_tokens == 512
  # the read's budget is the re-prefill it replaces
  assert fast.estimate(c, 600).load_budget_s == pytest.approx(512 / 2000.0)


def test_cost_model_weighs_queueing_and_decode_pressure():
  m = RouteCostModel(_speeds(), RouteCosts(decode_s_per_running=0.01))
  hot = Candidate(0, (Source(DEVICE, 512),), queued_prefill_tokens=4000)   # 2 s of queue
  idle = Candidate(1)
  assert m.choose([hot, idle], 600).replica == 1
  assert m.choose([Candidate(0, (Source(DEVICE, 512),)), idle], 600).replica == 0
  busy = Candidate(0, (Source(DEVICE, 512),), running=100)                  # 1 s of decode pressure
  assert m.choose([busy, idle], 600).replica == 1
  with pytest.raises(ValueError, match="no candidate"):
    m.choose([], 600)


def _kv_router(dirx, pool=(0, 1, 2, 3), **kw):
  return KVAware(list(pool), directory.PrefixDirectory(dirx, SPACE), RouteCostModel(_speeds()), **kw)


def test_kv_aware_routes_to_the_prefix_holder_and_round_robin_cycles():
  dirx = LocalDirectory()
  _stored(directory.DirectoryFeed(dirx, 2, SPACE, 1000), PROMPT, "t1")
  r = _kv_router(dirx)
  e = r.route(PROMPT + [5], "t1", {})
  assert e.replica == 2 and e.reuse_tokens == 512 and e.place == DEVICE
  rr = RoundRobin([0, 1, 2, 3])
  assert [rr.route(PROMPT, "t1", {}).replica for _ in range(5)] == [0, 1, 2, 3, 0]
  assert [rr.route(PROMPT, "t1", {}, alive={1, 3}).replica for _ in range(2)] == [3, 1]


def _directories():
  require_server("redis")
  srv = RedisServer()
  import redis
  return srv, [LocalDirectory(), RedisDirectory(redis.Redis.from_url(srv.url))]


def test_directory_consistent_after_replica_restart():
  srv, dirs = _directories()
  try:
    for dirx in dirs:
      feed0 = directory.DirectoryFeed(dirx, 0, SPACE, 1000, host_tier=True)
      feed1 = directory.DirectoryFeed(dirx, 1, SPACE, 1000)
      evs = _stored(feed0, PROMPT, "t1")
      _stored(feed1, PROMPT[:300], "t1")
      pd = directory.PrefixDirectory(dirx, SPACE)
      assert pd.matched(PROMPT, "t1") == {directory.l1(0): 512, directory.l1(1): 256}
      # the device evicts the last block: demoted to the host tier, the L1 run shortens
      feed0.consume([BlockRemoved(evs[-1].block_hash, "full", "t1", 3)])
      m = pd.matched(PROMPT, "t1")
      # host holds only block 3: no run
      assert m[directory.l1(0)] == 384 and m[directory.l1(1)] == 256 and directory.host(0) not in m
      # replica 0 restarts empty: everything it held is dropped; replica 1's entries stay
      assert feed0.restarted() > 0
      assert pd.matched(PROMPT, "t1") == {directory.l1(1): 256}
      # a full device reset (AllBlocksCleared) drops that replica's L1 locations too
      feed1.consume([AllBlocksCleared()])
      assert pd.matched(PROMPT, "t1") == {}
      # a router over the restarted directory no longer predicts a hit on replica 0
      e = _kv_router(dirx).route(PROMPT, "t1", {})
      assert e.reuse_tokens == 0
  finally:
    srv.stop()


def test_directory_entries_expire():
  dirx = LocalDirectory()
  _stored(directory.DirectoryFeed(dirx, 0, SPACE, 1000, ttl_s=0.05), PROMPT, "t1")
  pd = directory.PrefixDirectory(dirx, SPACE)
  assert pd.matched(PROMPT, "t1") == {directory.l1(0): 512}
  time.sleep(0.1)
  assert pd.matched(PROMPT, "t1") == {}


def test_tenants_never_share_across_replicas_unless_public():
  dirx = LocalDirectory()
  _stored(directory.DirectoryFeed(dirx, 0, SPACE, 1000), PROMPT, "alice")
  _stored(directory.DirectoryFeed(dirx, 1, SPACE, 1000), PROMPT, "")         # a public prefix ("" = public domain)
  pd = directory.PrefixDirectory(dirx, SPACE)
  assert pd.matched(PROMPT, "alice") == {directory.l1(0): 512}
  assert pd.matched(PROMPT, "bob") == {}                              # same tokens, another tenant: nothing
  assert pd.matched(PROMPT, "") == {directory.l1(1): 512}
  # the keys differ per tenant, and a forged entry under bob's key labelled alice is ignored too
  assert set(SPACE.block_keys(PROMPT, "alice")).isdisjoint(SPACE.block_keys(PROMPT, "bob"))
  for k in SPACE.block_keys(PROMPT, "bob"):
    dirx.publish(k, directory.l1(2), "alice", 1000, None, SPACE.fingerprint)
  assert pd.matched(PROMPT, "bob") == {}
  # another model's entries are ignored
  other = directory.KeySpace("other", "lay", 32, 128)
  for k in SPACE.block_keys(PROMPT, "carol"):
    dirx.publish(k, directory.l1(3), "carol", 1000, None, other.fingerprint)
  assert pd.matched(PROMPT, "carol") == {}
  r = _kv_router(dirx)
  assert r.route(PROMPT, "bob", {}).reuse_tokens == 0
  assert r.route(PROMPT, "alice", {}).replica == 0


class _DeadDirectory:
  def lookup_many(self, keys):
    raise ConnectionError("redis down")


def test_directory_down_routes_on_load_only():
  r = KVAware([0, 1, 2], directory.PrefixDirectory(_DeadDirectory(), SPACE), RouteCostModel(_speeds()))
  loads = {0: Load(4000, 2), 1: Load(0, 0), 2: Load(100, 1)}
  assert r.route(PROMPT, "t1", loads).replica == 1
  assert r.stats["directory_errors"] == 1 and r.stats["load_only_routes"] == 1
  assert r.route(PROMPT, "t1", loads, alive={0, 2}).replica == 2
  with pytest.raises(RuntimeError, match="no live replica"):
    r.route(PROMPT, "t1", loads, alive=set())
  # the feed side: a dead directory is counted, never raised
  feed = directory.DirectoryFeed(_DeadDirectory(), 0, SPACE, 1000)
  feed.consume([AllBlocksCleared()])
  assert feed.stats["errors"] == 1

"""KVCacheManager: the host-side facade the engine calls. Owns one block pool per cache group (jitted, donated
array state), the requests' block tables and hashes, SWA checkpoints, and the KV event stream.

Lifecycle of a request (all token counts are absolute positions in the request):

    mgr = KVCacheManager(config, num_full_blocks=..., num_swa_blocks=..., retention_interval=0)
    hit = mgr.add_request("r1", prompt_ids, ExtraKeys(tenant="t"))   # lookup + claim; hit.num_tokens to skip
    tables = mgr.allocate_for("r1", n)         # BlockTables covering positions [0, num_computed + n), or
                                               # OutOfBlocks (nothing changed: the scheduler waits or preempts)
    ... model step writes KV for the chunk ...
    mgr.commit("r1", num_computed)             # register full blocks + SWA checkpoints, release swa rows behind
                                               # the window
    mgr.append_tokens("r1", [sampled])         # outputs, so later blocks can be hashed
    mgr.free("r1")                             # end-of-request checkpoint, then release everything (tail first)
    mgr.take_events()                          # BlockStored / BlockRemoved / AllBlocksCleared

Public API:
    KVCacheManager(config, layout=CacheLayout(), *, num_full_blocks, num_swa_blocks, retention_interval=0,
                   model_id="", key_bits=64, max_probe=16, enable_events=True, legacy_dense_swa=False)
    lookup(token_ids, extra_keys=ExtraKeys()) -> PrefixHit            (pure)
    lookup_batch([(token_ids, extra_keys), ...]) -> list[PrefixHit]   (pure, one jitted call)
    add_request(request_id, prompt_token_ids, extra_keys=ExtraKeys()) -> PrefixHit
    allocate_for(request_id, num_new_tokens) -> BlockTables | OutOfBlocks
    append_tokens(request_id, token_ids) -> None
    commit(request_id, num_computed_tokens) -> None
    free(request_id) -> None
    block_tables(request_id) -> BlockTables
    take_events() -> list[KVEvent]
    reset_prefix_cache() -> bool
    num_free_blocks(group) -> int ; usage(group) -> float ; is_cached(group, token_ids, extra_keys, block) -> bool

Errors: unknown / duplicate request ids, commits beyond allocated or known tokens, and negative counts raise
`CacheError`; running out of blocks is a return value (`OutOfBlocks`), never an exception or a silent failure.
`legacy_dense_swa=True` reproduces vLLM <= 0.22 (every swa block hashed, every freed block appended) for the
session-switch regression test only.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from dsv4.caches import FULL, SWA, CacheLayout
from dsv4.config import ModelConfig

from cache import pool as P
from cache.checkpoints import CheckpointPolicy
from cache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventLog, KVEvent
from cache.hashing import ExtraKeys, RequestHasher, device_key, digest_words, key_int
from cache.prefix import find_hits, group_searches
from cache.specs import FULL_HISTORY, cache_specs


class CacheError(ValueError):
  """Bad use of the manager (unknown request, inconsistent counts)."""


@dataclasses.dataclass(frozen=True)
class PrefixHit:
  num_tokens: int                      # tokens to skip (aligned; 0 = miss)
  block_ids: dict[str, np.ndarray]     # per group, the table prefix for [0, num_tokens); swa: -1 before the tail


@dataclasses.dataclass(frozen=True)
class BlockTables:
  full: np.ndarray                     # block ids, one per full_block_tokens of the request so far
  swa: np.ndarray                      # block ids, one per swa_block_tokens; -1 where released / not needed


@dataclasses.dataclass(frozen=True)
class OutOfBlocks:
  group: str
  needed: int
  free: int

  def __bool__(self):                  # `if not mgr.allocate_for(...)` reads naturally
    return False


@dataclasses.dataclass
class _Request:
  rid: str
  tokens: list[int]
  hasher: RequestHasher
  tenant: str
  prompt_len: int
  num_computed: int
  tables: dict[str, list[int]]
  num_registered: dict[str, int]       # leading blocks of the group already offered to the cache
  swa_released: int = 0                # leading swa blocks already released


_WIDTH = 256   # most ids per jitted pool call; callers chunk longer lists


def _bucket(n: int) -> int:
  """Id-array width for n entries: two widths only, so each pool op compiles at most twice per group."""
  return 16 if n <= 16 else _WIDTH


def _units_bucket(n: int) -> int:
  """Hash units per request in a search: powers of 4 from 64 (2048 tokens at 32-token units)."""
  u = 64
  while u < n:
    u *= 4
  return u


class KVCacheManager:

  def __init__(self, config: ModelConfig, layout: CacheLayout = CacheLayout(), *, num_full_blocks: int,
               num_swa_blocks: int, retention_interval: int = 0, model_id: str = "", key_bits: int = 64,
               max_probe: int = P.DEFAULT_MAX_PROBE, enable_events: bool = True, legacy_dense_swa: bool = False):
    self.specs = cache_specs(config, layout)
    self.groups = tuple(g.name for g in self.specs.groups)
    self._searches = group_searches(self.specs)
    swa = self.specs.swa
    self.policy = CheckpointPolicy(self.specs.align_tokens, swa.block_tokens, swa.tail_tokens, retention_interval)
    sizes = {FULL: num_full_blocks, SWA: num_swa_blocks}
    self.pools = {g.name: P.init_pool(sizes[g.name], g.block_tokens, max_probe) for g in self.specs.groups}
    self.model_id, self.key_bits = model_id, key_bits
    self.legacy = legacy_dense_swa
    self.events = EventLog(enable_events)
    self._requests: dict[str, _Request] = {}
    # (group, block id) -> (key, tenant) of cached blocks, only to label BlockRemoved events.
    self._identity: dict[tuple[str, int], tuple[int, str]] = {}
    self.stats = {"table_full": 0, "duplicate": 0, "queried_tokens": 0, "hit_tokens": 0}

  # ------------------------------------------------------------------------------------------------ lookup
  def _hasher(self, tokens: np.ndarray, extra: ExtraKeys) -> RequestHasher:
    h = RequestHasher(dataclasses.replace(extra, model=extra.model or self.model_id,
                                          layout=self.specs.fingerprint), self.specs.hash_tokens, self.key_bits)
    h.update(tokens)
    return h

  def lookup(self, token_ids, extra_keys: ExtraKeys = ExtraKeys()) -> PrefixHit:
    return self.lookup_batch([(token_ids, extra_keys)])[0]

  def lookup_batch(self, requests) -> list[PrefixHit]:
    toks = [np.asarray(t, np.int32) for t, _ in requests]
    hashers = [self._hasher(t, e) for t, (_, e) in zip(toks, requests)]
    return self._search(toks, hashers)

  def _search(self, toks, hashers) -> list[PrefixHit]:
    g = self.specs.hash_tokens
    b = 1 << max(0, len(toks) - 1).bit_length()
    u = _units_bucket(max(len(t) // g for t in toks))
    u = -(-u // (self.specs.align_tokens // g)) * (self.specs.align_tokens // g)
    key = np.zeros((b, u, 2), np.int32)
    par = np.zeros((b, u, 4), np.int32)
    tok = np.zeros((b, u, g), np.int32)
    max_len = np.zeros(b, np.int32)
    for i, (t, h) in enumerate(zip(toks, hashers)):
      key[i], par[i] = h.arrays(u)
      nu = len(t) // g
      tok[i, :nu] = t[:nu * g].reshape(nu, g)
      max_len[i] = max(len(t) - 1, 0)
    pools = tuple(self.pools[n] for n in self.groups)
    hit, ids = find_hits(pools, jnp.asarray(key), jnp.asarray(par), jnp.asarray(tok), jnp.asarray(max_len),
                         groups=self._searches, align_tokens=self.specs.align_tokens, hash_tokens=g)
    hit, ids = np.asarray(hit), [np.asarray(x) for x in ids]
    out = []
    for i, t in enumerate(toks):
      n = int(hit[i])
      blocks = {}
      for name, gid in zip(self.groups, ids):
        bt = self.specs.group(name).block_tokens
        blocks[name] = gid[i, :n // bt].copy()
      out.append(PrefixHit(n, blocks))
      self.stats["queried_tokens"] += len(t)
      self.stats["hit_tokens"] += n
    return out

  # ------------------------------------------------------------------------------------------- requests
  def _req(self, rid: str) -> _Request:
    if rid not in self._requests:
      raise CacheError(f"unknown request {rid!r}")
    return self._requests[rid]

  def add_request(self, request_id: str, prompt_token_ids, extra_keys: ExtraKeys = ExtraKeys()) -> PrefixHit:
    """Look up the prompt and claim the hit blocks (every group before any allocation)."""
    if request_id in self._requests:
      raise CacheError(f"request {request_id!r} already exists")
    toks = np.asarray(prompt_token_ids, np.int32)
    if toks.ndim != 1 or len(toks) == 0:
      raise CacheError("add_request: prompt_token_ids must be a non-empty 1-D sequence")
    hasher = self._hasher(toks, extra_keys)
    hit = self._search([toks], [hasher])[0]
    for name in self.groups:
      ids = hit.block_ids[name]
      for chunk in self._chunks([int(x) for x in ids if x >= 0]):
        self.pools[name], ok = P.touch(self.pools[name], chunk)
        if not bool(ok):
          raise RuntimeError(f"touch refused hit blocks of group {name}: {ids}")
    tables = {name: [int(x) for x in hit.block_ids[name]] for name in self.groups}
    n = hit.num_tokens
    self._requests[request_id] = _Request(
        request_id, toks.tolist(), hasher, extra_keys.tenant, len(toks), n, tables,
        {name: len(tables[name]) for name in self.groups},
        swa_released=max(0, n // self.specs.swa.block_tokens - self.policy.need_blocks))
    return hit

  def append_tokens(self, request_id: str, token_ids) -> None:
    r = self._req(request_id)
    r.tokens.extend(int(t) for t in np.atleast_1d(np.asarray(token_ids, np.int64)))

  def allocate_for(self, request_id: str, num_new_tokens: int) -> BlockTables | OutOfBlocks:
    """Blocks for positions up to num_computed + num_new_tokens in every group, all or nothing."""
    r = self._req(request_id)
    if num_new_tokens < 0:
      raise CacheError(f"allocate_for: num_new_tokens must be >= 0, got {num_new_tokens}")
    total = r.num_computed + num_new_tokens
    need = {}
    for name in self.groups:
      bt = self.specs.group(name).block_tokens
      need[name] = max(0, -(-total // bt) - len(r.tables[name]))
      free = int(self.pools[name].num_free)
      if need[name] > free:
        return OutOfBlocks(name, need[name], free)
    for name in self.groups:
      left = need[name]
      while left:
        m = min(left, _WIDTH)
        self.pools[name], ids, ev, ok = P.allocate(self.pools[name], m, max_n=_bucket(m))
        if not bool(ok):
          raise RuntimeError(f"allocate of {m} blocks failed in group {name} after the free check")
        ids, ev = np.asarray(ids)[:m], np.asarray(ev)[:m]
        for b, e in zip(ids, ev):
          if e:
            k, tenant = self._identity.pop((name, int(b)))
            self.events.emit(BlockRemoved(k, name, tenant, int(b)))
        r.tables[name].extend(int(b) for b in ids)
        left -= m
    return self.block_tables(request_id)

  def block_tables(self, request_id: str) -> BlockTables:
    r = self._req(request_id)
    return BlockTables(np.asarray(r.tables.get(FULL, []), np.int32), np.asarray(r.tables[SWA], np.int32))

  # ------------------------------------------------------------------------------------------ register
  def _register(self, r: _Request, name: str, block_idx: list[int]) -> None:
    """Offer blocks (by table index) of a group to the cache under the request's hashes."""
    bt = self.specs.group(name).block_tokens
    upb = bt // self.specs.hash_tokens
    h = r.hasher
    entries = [(j, r.tables[name][j]) for j in block_idx if r.tables[name][j] >= 0]
    for lo in range(0, len(entries), _WIDTH):
      part = entries[lo:lo + _WIDTH]
      m = _bucket(len(part))
      ids = np.full(m, -1, np.int32)
      key = np.zeros((m, 2), np.int32)
      par = np.zeros((m, 4), np.int32)
      tok = np.zeros((m, bt), np.int32)
      for i, (j, b) in enumerate(part):
        ids[i] = b
        key[i] = device_key(h.digests[(j + 1) * upb - 1], self.key_bits)
        par[i] = digest_words(h.parent(j * upb))
        tok[i] = r.tokens[j * bt:(j + 1) * bt]
      self.pools[name], status = P.register(self.pools[name], jnp.asarray(ids), jnp.asarray(key),
                                            jnp.asarray(par), jnp.asarray(tok))
      for i, ((j, b), s) in enumerate(zip(part, np.asarray(status))):
        if s == P.STORED:
          k = key_int(key[i])
          parent = key_int(device_key(h.digests[j * upb - 1], self.key_bits)) if j else None
          self._identity[(name, b)] = (k, r.tenant)
          self.events.emit(BlockStored(k, parent, name, r.tenant, b, bt))
        elif s == P.DUPLICATE:
          self.stats["duplicate"] += 1
        elif s == P.TABLE_FULL:
          self.stats["table_full"] += 1
        elif s == P.INVALID:
          raise RuntimeError(f"register refused block {b} of group {name} (request {r.rid}, index {j})")

  def _checkpoint(self, r: _Request, boundary: int) -> None:
    idx = list(self.policy.tail_blocks(boundary))
    if idx and all(r.tables[SWA][j] >= 0 for j in idx):
      self._register(r, SWA, idx)

  def commit(self, request_id: str, num_computed_tokens: int) -> None:
    """The model has written KV for positions [0, num_computed_tokens): cache what is reusable, release what the
    request no longer reads."""
    r = self._req(request_id)
    n = num_computed_tokens
    if n < r.num_computed:
      raise CacheError(f"commit: num_computed_tokens went backwards ({r.num_computed} -> {n})")
    if n > len(r.tokens):
      raise CacheError(f"commit: {n} computed tokens but only {len(r.tokens)} tokens known (append_tokens first)")
    for name in self.groups:
      bt = self.specs.group(name).block_tokens
      if -(-n // bt) > len(r.tables[name]):
        raise CacheError(f"commit: {n} tokens exceed the blocks allocated in group {name}")
    r.hasher.update(np.asarray(r.tokens[:n], np.int32))
    prev, r.num_computed = r.num_computed, n
    for name in self.groups:
      bt = self.specs.group(name).block_tokens
      if self.specs.group(name).kind == FULL_HISTORY or self.legacy:
        self._register(r, name, list(range(r.num_registered[name], n // bt)))
        r.num_registered[name] = max(r.num_registered[name], n // bt)
    if not self.legacy:
      for p in self.policy.boundaries(prev, n, r.prompt_len):
        self._checkpoint(r, p)
    self._release_swa(r, self.policy.releasable_blocks(n))

  def _release_swa(self, r: _Request, upto: int) -> None:
    tab = r.tables[SWA]
    ids = [tab[j] for j in range(upto - 1, r.swa_released - 1, -1) if tab[j] >= 0]  # newest-out first
    for j in range(r.swa_released, upto):
      tab[j] = -1
    r.swa_released = max(r.swa_released, upto)
    self._free_ids(SWA, ids)

  def _free_ids(self, name: str, ids: list[int]) -> None:
    for chunk in self._chunks(ids):
      self.pools[name], ok = P.free(self.pools[name], chunk, prepend_uncached=not self.legacy)
      if not bool(ok):
        raise RuntimeError(f"free refused blocks of group {name}: {ids}")

  @staticmethod
  def _chunks(ids: list[int], width: int = _WIDTH):
    for lo in range(0, len(ids), width):
      part = ids[lo:lo + width]
      m = _bucket(len(part))
      yield jnp.asarray(part + [-1] * (m - len(part)), jnp.int32)

  def free(self, request_id: str) -> None:
    """End of request: checkpoint the swa tail where the next turn resumes, then release every block, tail
    first (a chain's last blocks become evictable before its head)."""
    r = self._req(request_id)
    if not self.legacy:
      self._checkpoint(r, self.policy.floor_align(r.num_computed))
    for name in self.groups:
      self._free_ids(name, [b for b in reversed(r.tables[name]) if b >= 0])
    del self._requests[request_id]

  # ------------------------------------------------------------------- tiers (issue 12): externally loaded prefix
  def extend_for_load(self, request_id: str, num_tokens: int, swa_blocks) -> BlockTables | OutOfBlocks:
    """Blocks to receive a prefix [num_computed, num_tokens) loaded from a lower tier: every full block up to
    num_tokens, but swa blocks only at the given indices (the checkpoint tails the resume reads; -1 elsewhere, as
    after a device hit). All or nothing. The caller writes the rows, then `commit(request_id, num_tokens)`."""
    r = self._req(request_id)
    if num_tokens % self.specs.align_tokens or num_tokens <= r.num_computed or num_tokens > len(r.tokens) - 1:
      raise CacheError(f"extend_for_load: {num_tokens} must be aligned, > {r.num_computed} and < {len(r.tokens)}")
    new = {}
    for name in self.groups:
      bt = self.specs.group(name).block_tokens
      lo, hi = len(r.tables[name]), num_tokens // bt
      new[name] = [j for j in range(lo, hi) if name != SWA or j in set(swa_blocks)]
      if len(new[name]) > int(self.pools[name].num_free):
        return OutOfBlocks(name, len(new[name]), int(self.pools[name].num_free))
    for name in self.groups:
      bt = self.specs.group(name).block_tokens
      m = len(new[name])
      ids = []
      for lo in range(0, m, _WIDTH):
        k = min(_WIDTH, m - lo)
        self.pools[name], got, ev, ok = P.allocate(self.pools[name], k, max_n=_bucket(k))
        if not bool(ok):
          raise RuntimeError(f"allocate of {k} blocks failed in group {name} after the free check")
        got, ev = np.asarray(got)[:k], np.asarray(ev)[:k]
        for b, e in zip(got, ev):
          if e:
            key, tenant = self._identity.pop((name, int(b)))
            self.events.emit(BlockRemoved(key, name, tenant, int(b)))
        ids += [int(b) for b in got]
      where = dict(zip(new[name], ids))
      r.tables[name].extend(where.get(j, -1) for j in range(len(r.tables[name]), num_tokens // bt))
    return self.block_tables(request_id)

  # -------------------------------------------------------------------------------------------- misc
  def take_events(self) -> list[KVEvent]:
    return self.events.take()

  def reset_prefix_cache(self) -> bool:
    """Drop every cached identity; refused (False) while any request holds blocks."""
    if self._requests:
      return False
    for name in self.groups:
      self.pools[name], ok = P.reset(self.pools[name])
      assert bool(ok)
    self._identity.clear()
    self.events.emit(AllBlocksCleared())
    return True

  def num_free_blocks(self, group: str) -> int:
    return int(self.pools[group].num_free)

  def usage(self, group: str) -> float:
    """Fraction of blocks held by requests (cached-but-free blocks count as free, as in vLLM)."""
    p = self.pools[group]
    return 1.0 - int(p.num_free) / p.num_blocks

  def is_cached(self, group: str, token_ids, extra_keys: ExtraKeys, block: int) -> bool:
    """Whether block `block` of `group` for this token prefix is findable (tests, debugging)."""
    toks = np.asarray(token_ids, np.int32)
    h = self._hasher(toks, extra_keys)
    bt = self.specs.group(group).block_tokens
    upb = bt // self.specs.hash_tokens
    if len(h.digests) < (block + 1) * upb:
      return False
    key = device_key(h.digests[(block + 1) * upb - 1], self.key_bits)[None]
    par = digest_words(h.parent(block * upb))[None]
    tok = toks[block * bt:(block + 1) * bt][None]
    return int(P.lookup(self.pools[group], jnp.asarray(key), jnp.asarray(par), jnp.asarray(tok))[0]) >= 0

"""A paged block pool as a pytree of arrays, with pure jitted operations (state donated in, new state out).

One pool per cache group: the model's swa arrays and full arrays have different block shapes, so a block id
indexes exactly one group's arrays (NOTES.md, "pool layout"). The hash table is per pool, so its key is
(block hash, group) with the group implicit.

State (N blocks, S = table slots, a power of two >= 2N):
* ``ref_N``: holders per block. Invariant: a block is in the free queue  <=>  ref == 0.
* ``next_P`` / ``prev_P`` (P = N + 1): the free queue as an intrusive doubly linked circular list threaded
  through the blocks; index N is the sentinel (next[N] = head = evicted first, prev[N] = tail). O(1) removal
  from the middle when a cached free block is claimed by a hit.
* ``num_free``: length of the free queue.
* ``cached_N``, ``key_Nx2``, ``parent_Nx4``, ``tokens_NxT``, ``slot_N``: a block's cached identity: truncated
  hash key, the full 128-bit digest of its parent prefix, its tokens (T = block tokens), and the table slot that
  points at it. A hit compares key, parent and tokens, so key collisions never alias prefixes.
* ``table_S``: open addressing, linear probing at most `max_probe` slots from `key.lo & (S-1)`; entries are a
  block id, EMPTY or TOMB (a removed entry; lookups probe past it, inserts reuse it).

Eviction is lazy (as in vLLM): a freed cached block keeps its identity in the free queue and is findable until
`allocate` actually hands it out; only then is the identity dropped (and reported so the host emits
BlockRemoved). `free` appends cached blocks at the tail (LRU; callers pass a request's blocks tail-first) and
prepends uncached ones at the head, so transient blocks (partial blocks, SWA rows that left the window and are
not checkpoints) are reused before any cached block: the fix for the A -> B -> A session-switch bug.

Every operation validates its input and reports failure instead of corrupting state: `ok` false means the state
came back unchanged.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from cache.hashing import DIGEST_WORDS

EMPTY = -1
TOMB = -2
DEFAULT_MAX_PROBE = 16

# register() status per entry
SKIPPED = 0       # id -1 (padding)
STORED = 1        # identity recorded and findable
ALREADY = 2       # the block already carries exactly this identity (e.g. it came from a hit)
DUPLICATE = 3     # another block already holds this exact content; this one stays uncached
TABLE_FULL = 4    # no free slot within max_probe; the block stays uncached (correct, just not reusable)
INVALID = -1      # bad id, block not held, or held under a different identity


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["ref_N", "next_P", "prev_P", "num_free", "cached_N", "key_Nx2", "parent_Nx4",
                                "tokens_NxT", "slot_N", "table_S"],
                   meta_fields=["max_probe"])
@dataclasses.dataclass
class PoolState:
  ref_N: jax.Array
  next_P: jax.Array
  prev_P: jax.Array
  num_free: jax.Array
  cached_N: jax.Array
  key_Nx2: jax.Array
  parent_Nx4: jax.Array
  tokens_NxT: jax.Array
  slot_N: jax.Array
  table_S: jax.Array
  max_probe: int = DEFAULT_MAX_PROBE

  @property
  def num_blocks(self) -> int:
    return self.ref_N.shape[0]

  @property
  def block_tokens(self) -> int:
    return self.tokens_NxT.shape[1]


def table_slots(num_blocks: int) -> int:
  return max(8, 1 << (2 * num_blocks - 1).bit_length())


def init_pool(num_blocks: int, block_tokens: int, max_probe: int = DEFAULT_MAX_PROBE) -> PoolState:
  if num_blocks <= 0 or block_tokens <= 0:
    raise ValueError(f"init_pool: num_blocks ({num_blocks}) and block_tokens ({block_tokens}) must be positive")
  n = num_blocks
  ids = np.arange(n + 1, dtype=np.int32)
  return PoolState(
      ref_N=jnp.zeros(n, jnp.int32),
      next_P=jnp.asarray((ids + 1) % (n + 1)),    # sentinel -> 0 -> 1 -> ... -> n-1 -> sentinel
      prev_P=jnp.asarray((ids - 1) % (n + 1)),
      num_free=jnp.asarray(n, jnp.int32),
      cached_N=jnp.zeros(n, bool),
      key_Nx2=jnp.zeros((n, 2), jnp.int32),
      parent_Nx4=jnp.zeros((n, DIGEST_WORDS), jnp.int32),
      tokens_NxT=jnp.zeros((n, block_tokens), jnp.int32),
      slot_N=jnp.full(n, -1, jnp.int32),
      table_S=jnp.full(table_slots(n), EMPTY, jnp.int32),
      max_probe=max_probe)


# ---------------------------------------------------------------------------------------------------------
# Free-queue primitives (b is a block id; the sentinel is N).

def _unlink(st: PoolState, b) -> PoolState:
  p, nx = st.prev_P[b], st.next_P[b]
  return dataclasses.replace(st, next_P=st.next_P.at[p].set(nx), prev_P=st.prev_P.at[nx].set(p),
                             num_free=st.num_free - 1)


def _append(st: PoolState, b) -> PoolState:
  s = st.num_blocks
  t = st.prev_P[s]
  nxt = st.next_P.at[t].set(b).at[b].set(s)
  prv = st.prev_P.at[b].set(t).at[s].set(b)
  return dataclasses.replace(st, next_P=nxt, prev_P=prv, num_free=st.num_free + 1)


def _prepend(st: PoolState, b) -> PoolState:
  s = st.num_blocks
  h = st.next_P[s]
  nxt = st.next_P.at[s].set(b).at[b].set(h)
  prv = st.prev_P.at[h].set(b).at[b].set(s)
  return dataclasses.replace(st, next_P=nxt, prev_P=prv, num_free=st.num_free + 1)


def _drop_identity(st: PoolState, b) -> PoolState:
  """Forget block b's cached identity (table entry -> tombstone). Caller checks cached_N[b]."""
  return dataclasses.replace(st, table_S=st.table_S.at[st.slot_N[b]].set(TOMB),
                             cached_N=st.cached_N.at[b].set(False), slot_N=st.slot_N.at[b].set(-1),
                             key_Nx2=st.key_Nx2.at[b].set(0))


# ---------------------------------------------------------------------------------------------------------
# Hash table probing.

def _matches(st: PoolState, b, key2, parent4, tokens_T):
  return (jnp.all(st.key_Nx2[b] == key2) & jnp.all(st.parent_Nx4[b] == parent4)
          & jnp.all(st.tokens_NxT[b] == tokens_T))


def _find(st: PoolState, key2, parent4, tokens_T):
  """Block holding exactly this identity, or -1. Probes until a match, an EMPTY slot or max_probe slots."""
  mask = st.table_S.shape[0] - 1
  home = jnp.bitwise_and(key2[1], mask)

  def cond(c):
    i, found = c
    return (i < st.max_probe) & (found < 0) & (st.table_S[(home + i) & mask] != EMPTY)

  def body(c):
    i, _ = c
    e = st.table_S[(home + i) & mask]
    hit = (e >= 0) & _matches(st, jnp.maximum(e, 0), key2, parent4, tokens_T)
    return i + 1, jnp.where(hit, e, -1)

  return jax.lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(-1)))[1]


def _insert_scan(st: PoolState, key2, parent4, tokens_T):
  """(block already holding this identity or -1, first reusable slot within max_probe or -1)."""
  mask = st.table_S.shape[0] - 1
  home = jnp.bitwise_and(key2[1], mask)

  def cond(c):
    i, dup, free, seen_empty = c
    return (i < st.max_probe) & (dup < 0) & ~seen_empty

  def body(c):
    i, dup, free, seen_empty = c
    s = (home + i) & mask
    e = st.table_S[s]
    free = jnp.where((free < 0) & (e < 0), s, free)
    dup = jnp.where((e >= 0) & _matches(st, jnp.maximum(e, 0), key2, parent4, tokens_T), e, -1)
    return i + 1, dup, free, e == EMPTY

  _, dup, free, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(-1), jnp.int32(-1), False))
  return dup, free


# ---------------------------------------------------------------------------------------------------------
# Operations. Ids arrays are fixed-size with -1 padding so each op compiles once per (pool, size) shape.

def _ids_valid(st: PoolState, ids_M):
  return jnp.all((ids_M >= -1) & (ids_M < st.num_blocks))


@functools.partial(jax.jit, static_argnames=("max_n",), donate_argnums=0)
def allocate(st: PoolState, n, *, max_n: int):
  """Pop n blocks from the head of the free queue (ref = 1), dropping each one's cached identity.

  Returns (state, ids_M, evicted_M, ok): ids padded with -1; evicted_M[i] says ids[i] lost a cached identity
  (the host emits BlockRemoved). ok is false, and nothing changes, if n < 0, n > max_n or n > num_free.
  """
  n = jnp.asarray(n, jnp.int32)
  ok = (n >= 0) & (n <= max_n) & (n <= st.num_free)
  n_eff = jnp.where(ok, n, 0)
  ids = jnp.full(max_n, -1, jnp.int32)
  ev = jnp.zeros(max_n, bool)

  def body(c):
    i, s, ids, ev = c
    b = s.next_P[s.num_blocks]
    s = _unlink(s, b)
    was = s.cached_N[b]
    s = jax.lax.cond(was, _drop_identity, lambda s, b: s, s, b)
    s = dataclasses.replace(s, ref_N=s.ref_N.at[b].set(1))
    return i + 1, s, ids.at[i].set(b), ev.at[i].set(was)

  _, st, ids, ev = jax.lax.while_loop(lambda c: c[0] < n_eff, body, (jnp.int32(0), st, ids, ev))
  return st, ids, ev, ok


@functools.partial(jax.jit, donate_argnums=0)
def touch(st: PoolState, ids_M):
  """Claim blocks (prefix hit): a free one leaves the free queue; ref += 1. -1 entries are skipped."""
  ok = _ids_valid(st, ids_M)

  def body(i, s):
    b = ids_M[i]
    bb = jnp.maximum(b, 0)

    def claim(s):
      s = jax.lax.cond(s.ref_N[bb] == 0, _unlink, lambda s, b: s, s, bb)
      return dataclasses.replace(s, ref_N=s.ref_N.at[bb].add(1))

    return jax.lax.cond(ok & (b >= 0), claim, lambda s: s, s)

  return jax.lax.fori_loop(0, ids_M.shape[0], body, st), ok


@functools.partial(jax.jit, static_argnames=("prepend_uncached",), donate_argnums=0)
def free(st: PoolState, ids_M, *, prepend_uncached: bool = True):
  """Release one reference per listed block, given in eviction order (a request's tail blocks first).

  Blocks reaching ref 0: cached ones are appended to the free-queue tail in list order (kept longest, LRU);
  uncached ones are put at the head in list order (reused first). `prepend_uncached=False` is the legacy
  (vLLM <= 0.22) behaviour, kept only so tests can show the session-switch bug. ok false (state unchanged) if an
  id is out of range or a block would drop below ref 0.
  """
  valid = ids_M >= 0
  dec_N = jnp.zeros_like(st.ref_N).at[jnp.where(valid, ids_M, st.num_blocks)].add(1, mode="drop")
  ok = _ids_valid(st, ids_M) & jnp.all(dec_N <= st.ref_N)
  m = ids_M.shape[0]

  def dec(i, c):
    s, zero = c
    b = ids_M[i]
    bb = jnp.maximum(b, 0)
    act = ok & (b >= 0)
    s = dataclasses.replace(s, ref_N=s.ref_N.at[bb].add(jnp.where(act, -1, 0)))
    hit0 = act & (s.ref_N[bb] == 0)
    to_tail = hit0 & (s.cached_N[bb] | (not prepend_uncached))
    s = jax.lax.cond(to_tail, _append, lambda s, b: s, s, bb)
    return s, zero.at[i].set(hit0 & ~to_tail)

  st, zero = jax.lax.fori_loop(0, m, dec, (st, jnp.zeros(m, bool)))

  def pre(j, s):  # reverse walk so the first listed uncached block ends up at the very head
    i = m - 1 - j
    return jax.lax.cond(zero[i], _prepend, lambda s, b: s, s, jnp.maximum(ids_M[i], 0))

  return jax.lax.fori_loop(0, m, pre, st), ok


@functools.partial(jax.jit, donate_argnums=0)
def register(st: PoolState, ids_M, key_Mx2, parent_Mx4, tokens_MxT):
  """Record the cached identity of held, full blocks. Returns (state, status_M) with the codes above."""

  def body(i, c):
    s, status = c
    b = ids_M[i]
    bb = jnp.clip(b, 0, s.num_blocks - 1)
    key2, par4, tok = key_Mx2[i], parent_Mx4[i], tokens_MxT[i]
    in_range = (b >= 0) & (b < s.num_blocks)
    held = in_range & (s.ref_N[bb] > 0)
    same = s.cached_N[bb] & _matches(s, bb, key2, par4, tok)
    dup, slot = _insert_scan(s, key2, par4, tok)
    fresh = held & ~s.cached_N[bb]
    code = jnp.where(b == -1, SKIPPED, jnp.where(
        ~held, INVALID, jnp.where(s.cached_N[bb], jnp.where(same, ALREADY, INVALID), jnp.where(
            dup >= 0, DUPLICATE, jnp.where(slot >= 0, STORED, TABLE_FULL)))))
    store = fresh & (dup < 0) & (slot >= 0)

    def do_store(s):
      return dataclasses.replace(
          s, table_S=s.table_S.at[slot].set(bb), cached_N=s.cached_N.at[bb].set(True),
          slot_N=s.slot_N.at[bb].set(slot), key_Nx2=s.key_Nx2.at[bb].set(key2),
          parent_Nx4=s.parent_Nx4.at[bb].set(par4), tokens_NxT=s.tokens_NxT.at[bb].set(tok))

    s = jax.lax.cond(store, do_store, lambda s: s, s)
    return s, status.at[i].set(code)

  return jax.lax.fori_loop(0, ids_M.shape[0], body, (st, jnp.zeros(ids_M.shape[0], jnp.int32)))


def lookup_blocks(st: PoolState, key_Mx2, parent_Mx4, tokens_MxT):
  """Block id holding each exact identity, or -1 (traceable; used inside the prefix search)."""
  return jax.vmap(lambda k, p, t: _find(st, k, p, t))(key_Mx2, parent_Mx4, tokens_MxT)


lookup = jax.jit(lookup_blocks)


@functools.partial(jax.jit, donate_argnums=0)
def evict(st: PoolState, ids_M):
  """Drop the cached identity of free blocks (an external eviction). Held or uncached ids are ignored."""

  def body(i, c):
    s, ev = c
    b = ids_M[i]
    bb = jnp.clip(b, 0, s.num_blocks - 1)
    act = (b >= 0) & (b < s.num_blocks) & (s.ref_N[bb] == 0) & s.cached_N[bb]
    return jax.lax.cond(act, _drop_identity, lambda s, b: s, s, bb), ev.at[i].set(act)

  return jax.lax.fori_loop(0, ids_M.shape[0], body, (st, jnp.zeros(ids_M.shape[0], bool)))


@functools.partial(jax.jit, donate_argnums=0)
def reset(st: PoolState):
  """Clear every cached identity and restore the free queue to id order; refused (ok false) while any block is
  held."""
  ok = jnp.all(st.ref_N == 0)
  fresh = init_pool(st.num_blocks, st.block_tokens, st.max_probe)
  return jax.tree.map(lambda a, b: jnp.where(ok, a, b), fresh, st), ok


# ---------------------------------------------------------------------------------------------------------
# Host-side views (tests, debugging).

def free_queue(st: PoolState) -> list[int]:
  """The free queue head (evicted first) to tail, walked on the host."""
  nxt = np.asarray(st.next_P)
  out, b = [], int(nxt[st.num_blocks])
  while b != st.num_blocks and len(out) <= st.num_blocks:
    out.append(b)
    b = int(nxt[b])
  return out

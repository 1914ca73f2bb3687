"""A paged block pool as a pytree of arrays, with pure jitted operations whose cost follows the blocks touched.

One pool per cache group (a block id indexes exactly one group's arrays). The hash table is per pool, so its key
is (block hash, group) with the group implicit.

Free blocks form one logical queue, head (reused first) to tail, made of two parts:
* a **stack** of free blocks put at the head (`free(..., prepend_uncached=True)` of blocks without a cached
  identity, and every block at start in id order): `stack_N[:stack_top]`, top = head. Allocation pops a slice.
* a **ring** of blocks appended at the tail (cached blocks, in release order = LRU): `ring_R`, absolute positions
  [ring_head, ring_tail); position order is release order, so the oldest release is evicted first.
Both use lazy deletion: block b's live entry is the one at `pos_N[b]` while `loc_N[b]` says where it is; a hit that
claims a free block just sets `loc_N[b] = LOC_HELD`, leaving a stale entry behind. Allocation skips stale ring entries
as it walks from the head (each is skipped once); stale stack entries (only from claiming a stack block, which the
manager never does: stack blocks have no identity) and a full ring trigger an O(N) compaction, rare and amortised.
So allocate / free / touch / register / lookup / evict cost O(ids in the call x probe length), independent of N
(the one exception is the amortised compaction).

Other state (N blocks, S = table slots, a power of two >= 2N):
* ``ref_N``: holders per block. Invariant: a block is free (loc != LOC_HELD)  <=>  ref == 0.
* ``cached_N``, ``key_Nx2``, ``parent_Nx4``, ``tokens_NxT``, ``slot_N``: a block's cached identity (truncated key,
  128-bit parent digest, its tokens, its table slot). A hit compares key, parent and tokens, so key collisions
  never alias prefixes.
* ``table_S``: open addressing, linear probing at most `max_probe` slots from `key.lo & (S-1)`; entries are a
  block id, EMPTY or TOMB (removed; lookups probe past it, inserts reuse it).
* ``claim_S``: scratch for batched insertion (all BIG between calls; see `_register_core`).
* ``mark_N``: scratch for duplicate ids inside one call's id list (all BIG between calls; `_first_last`).

Eviction is lazy (as in vLLM): a freed cached block keeps its identity and stays findable until `allocate` hands
it out; only then is its identity dropped (reported so the host emits BlockRemoved).

Every operation validates its input and reports failure instead of corrupting state: `ok` false means the state
came back unchanged. Batched `register` has exactly the semantics of registering its entries one after another
(the plain reference does that), see `_register_core`.
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
BIG = np.iinfo(np.int32).max

LOC_HELD, LOC_STACK, LOC_RING = 0, 1, 2
_RING_REBASE = 1 << 30     # rebase ring positions (a compaction) before int32 overflows

# register() status per entry
SKIPPED = 0       # id -1 (padding)
STORED = 1        # identity recorded and findable
ALREADY = 2       # the block already carries exactly this identity (e.g. it came from a hit)
DUPLICATE = 3     # another block already holds this exact content; this one stays uncached
TABLE_FULL = 4    # no free slot within max_probe; the block stays uncached (correct, just not reusable)
INVALID = -1      # bad id, block not held, or held under a different identity

_FIELDS = ["ref_N", "loc_N", "pos_N", "stack_N", "stack_top", "stack_stale", "ring_R", "ring_head", "ring_tail",
           "num_free", "cached_N", "key_Nx2", "parent_Nx4", "tokens_NxT", "slot_N", "table_S", "claim_S", "mark_N"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=_FIELDS, meta_fields=["max_probe"])
@dataclasses.dataclass
class PoolState:
  ref_N: jax.Array
  loc_N: jax.Array
  pos_N: jax.Array
  stack_N: jax.Array
  stack_top: jax.Array
  stack_stale: jax.Array
  ring_R: jax.Array
  ring_head: jax.Array
  ring_tail: jax.Array
  num_free: jax.Array
  cached_N: jax.Array
  key_Nx2: jax.Array
  parent_Nx4: jax.Array
  tokens_NxT: jax.Array
  slot_N: jax.Array
  table_S: jax.Array
  claim_S: jax.Array
  mark_N: jax.Array
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
  ids = np.arange(n, dtype=np.int32)
  s = table_slots(n)
  # Built on the host and put in one transfer: a jnp.zeros / jnp.full per field would compile one tiny program per
  # distinct shape (a dozen for a two-group manager) before the first step.
  host = dict(
      ref_N=np.zeros(n, np.int32), loc_N=np.full(n, LOC_STACK, np.int32),
      pos_N=n - 1 - ids,                           # block 0 on top of the stack: handed out first
      stack_N=ids[::-1].copy(), stack_top=np.int32(n), stack_stale=np.int32(0),
      ring_R=np.zeros(2 * n, np.int32), ring_head=np.int32(0), ring_tail=np.int32(0), num_free=np.int32(n),
      cached_N=np.zeros(n, bool), key_Nx2=np.zeros((n, 2), np.int32),
      parent_Nx4=np.zeros((n, DIGEST_WORDS), np.int32), tokens_NxT=np.zeros((n, block_tokens), np.int32),
      slot_N=np.full(n, -1, np.int32), table_S=np.full(s, EMPTY, np.int32),
      claim_S=np.full(s, BIG, np.int32), mark_N=np.full(n, BIG, np.int32))
  return PoolState(**jax.device_put(host), max_probe=max_probe)


def _rep(st, **kw) -> PoolState:
  return dataclasses.replace(st, **kw)


def _drop(idx, ok, size):
  """Scatter index that is dropped (out of bounds) where not ok."""
  return jnp.where(ok, idx, size)


# ---------------------------------------------------------------------------------------------------------
# Duplicates inside one id list, found by scatter into the scratch `mark_N` (O(M), no sort, never O(N)).
# mark_N is BIG for every block between calls; each helper writes only the entries' blocks and sets them back.

def _first_last(st: PoolState, ids_M, valid_M, last: bool = False):
  """(state, flag_M): whether each valid entry is the first (last=False) or the last occurrence of its id among
  the valid entries. Scatter-min of the entry index (of M-1-index for `last`), gathered back."""
  nb, m = st.num_blocks, ids_M.shape[0]
  i = jnp.arange(m, dtype=jnp.int32)
  v = (m - 1 - i) if last else i
  tgt = _drop(ids_M, valid_M, nb)
  mark = st.mark_N.at[tgt].min(v, mode="drop")
  g = mark[jnp.clip(ids_M, 0, nb - 1)]
  mark = mark.at[_after(tgt, nb, g)].set(BIG, mode="drop")
  return _rep(st, mark_N=mark), valid_M & (g == v)


def _prev_same(st: PoolState, ids_M, valid_M):
  """(state, prev_M): index of the previous valid entry with the same id, -1 if none. Each round peels off the
  first remaining occurrence of every id (scatter-min), so rounds = the largest multiplicity (1 without repeats)."""
  nb, m = st.num_blocks, ids_M.shape[0]
  i = jnp.arange(m, dtype=jnp.int32)
  safe = jnp.clip(ids_M, 0, nb - 1)

  def cond(c):
    return jnp.any(c[1])

  def body(c):
    mark, rem, win, prev = c
    tgt = _drop(ids_M, rem, nb)
    mark = mark.at[tgt].min(i, mode="drop")
    g = mark[safe]
    first = rem & (g == i)
    prev = jnp.where(first, win, prev)       # win: the previous round's winner for this id
    win = jnp.where(rem, g, win)
    mark = mark.at[_after(tgt, nb, g)].set(BIG, mode="drop")
    return mark, rem & ~first, win, prev

  neg = jnp.full(m, -1, jnp.int32)
  mark, _, _, prev = jax.lax.while_loop(cond, body, (st.mark_N, valid_M, neg, neg))
  return _rep(st, mark_N=mark), prev


# ---------------------------------------------------------------------------------------------------------
# Compactions (rare; O(N) each, amortised over >= N cheap operations).

def _compact_ring(st: PoolState) -> PoolState:
  r = st.ring_R.shape[0]
  p = st.ring_head + jnp.arange(r, dtype=jnp.int32)
  b = st.ring_R[p % r]
  live = (p < st.ring_tail) & (st.loc_N[b] == LOC_RING) & (st.pos_N[b] == p)
  rank = jnp.cumsum(live, dtype=jnp.int32) - 1
  # written in place (entries past the new tail are never live), so both branches of `_maybe` alias the input
  ring = st.ring_R.at[_drop(rank, live, r)].set(b, mode="drop")
  pos = st.pos_N.at[_drop(b, live, st.num_blocks)].set(rank, mode="drop")
  n_live = jnp.sum(live, dtype=jnp.int32)
  return dict(ring_R=ring, pos_N=pos, ring_head=jnp.int32(0), ring_tail=n_live)


def _compact_stack(st: PoolState) -> PoolState:
  n = st.num_blocks
  i = jnp.arange(n, dtype=jnp.int32)
  b = st.stack_N
  live = (i < st.stack_top) & (st.loc_N[b] == LOC_STACK) & (st.pos_N[b] == i)
  rank = jnp.cumsum(live, dtype=jnp.int32) - 1
  # gather the live entries into a temporary first, then write them back into stack_N in place (a scatter whose
  # updates were the array itself would make XLA copy it, in the skip branch too)
  src = jnp.zeros_like(b).at[_drop(rank, live, n)].set(i, mode="drop")
  vals = b[src]
  n_live = jnp.sum(live, dtype=jnp.int32)
  keep = jnp.where(i < n_live, i, n)
  stack = st.stack_N.at[_after(keep, n, vals)].set(vals, mode="drop")
  pos = st.pos_N.at[_drop(vals, i < n_live, n)].set(i, mode="drop")
  return dict(stack_N=stack, pos_N=pos, stack_top=n_live, stack_stale=jnp.int32(0))


def _maybe(pred, fn, st):
  """Run a compaction when pred. Only the fields it changes go through the cond (unchanged fields passed through
  a cond are copied by XLA), and the compactions write in place, so the skip branch costs nothing."""
  keys = sorted(jax.eval_shape(fn, st))
  out = jax.lax.cond(pred, lambda s: tuple(fn(s)[k] for k in keys), lambda s: tuple(getattr(s, k) for k in keys), st)
  return _rep(st, **dict(zip(keys, out)))


_NEVER = np.iinfo(np.int32).min   # no state array ever holds this value


def _after(idx, size, *gathered):
  """`idx` (scatter indices) made data-dependent on values gathered from the array it scatters into.

  XLA updates a donated array in place only if every read of it provably happens before the write; without a data
  dependency it inserts a whole-array copy (measured: one pool-sized copy per such array per call). The condition
  is always true (`_NEVER` is never stored), so the indices are unchanged."""
  c = jnp.bool_(True)
  for g in gathered:
    c &= jnp.all(g != _NEVER)
  return jnp.where(c, idx, size)


# ---------------------------------------------------------------------------------------------------------
# Identity matching and table probing, vectorised over entries and probe positions.

def _window(st: PoolState, key_Mx2):
  mask = st.table_S.shape[0] - 1
  home_M = jnp.bitwise_and(key_Mx2[:, 1], mask)
  slots_MxP = (home_M[:, None] + jnp.arange(st.max_probe, dtype=jnp.int32)[None]) & mask
  return home_M, slots_MxP


def _first_true(x_MxP):
  """Index of the first true per row, or P if none."""
  p = x_MxP.shape[1]
  return jnp.where(jnp.any(x_MxP, 1), jnp.argmax(x_MxP, 1), p).astype(jnp.int32)


def _first_match(st: PoolState, e_MxP, cand_MxP, key_Mx2, parent_Mx4, tokens_MxT, extra=None):
  """First probe position whose entry holds exactly (key, parent, tokens), or P.

  Entries e >= N name entries of `extra` = (key, parent, tokens) arrays (insertions of the running batch).
  Keys (2 words) are compared everywhere; parent and tokens only for the single key candidate per row unless
  some row has several (forced key collisions in tests), when a full compare runs instead."""
  n = st.num_blocks
  p = e_MxP.shape[1]

  def ident(field_N, field_X, e):
    own = field_N[jnp.clip(e, 0, n - 1)]
    if extra is None:
      return own
    other = field_X[jnp.clip(e - n, 0, field_X.shape[0] - 1)]
    sel = (e >= n).reshape(e.shape + (1,) * (own.ndim - e.ndim))
    return jnp.where(sel, other, own)

  ek, ep, et = (None, None, None) if extra is None else extra
  # candidates by key only (2 words per probe slot); parent and tokens are compared for the single candidate per
  # row, unless some row has several key matches (forced key collisions in tests): then a full compare runs
  kc = cand_MxP & (e_MxP >= 0) & jnp.all(ident(st.key_Nx2, ek, e_MxP) == key_Mx2[:, None], -1)

  def fast(_):
    j = _first_true(kc)
    e = jnp.take_along_axis(e_MxP, jnp.minimum(j, p - 1)[:, None], 1)[:, 0]
    ok = ((j < p) & jnp.all(ident(st.parent_Nx4, ep, e) == parent_Mx4, -1)
          & jnp.all(ident(st.tokens_NxT, et, e) == tokens_MxT, -1))
    return jnp.where(ok, j, p).astype(jnp.int32)

  def slow(_):
    full = (kc & jnp.all(ident(st.parent_Nx4, ep, e_MxP) == parent_Mx4[:, None], -1)
            & jnp.all(ident(st.tokens_NxT, et, e_MxP) == tokens_MxT[:, None], -1))
    return _first_true(full)

  return jax.lax.cond(jnp.any(jnp.sum(kc, 1) > 1), slow, fast, None)


def lookup_blocks(st: PoolState, key_Mx2, parent_Mx4, tokens_MxT):
  """Block id holding each exact identity, or -1 (traceable). Probes until a match, an EMPTY slot or max_probe."""
  _, slots = _window(st, key_Mx2)
  e = st.table_S[slots]
  p = e.shape[1]
  before_empty = jnp.arange(p, dtype=jnp.int32)[None] < _first_true(e == EMPTY)[:, None]   # no cumsum
  j = _first_match(st, e, before_empty, key_Mx2, parent_Mx4, tokens_MxT)
  return jnp.where(j < p, jnp.take_along_axis(e, jnp.minimum(j, p - 1)[:, None], 1)[:, 0], -1)


lookup = jax.jit(lookup_blocks)


# ---------------------------------------------------------------------------------------------------------
# Core operations (traceable; composed by the jitted single ops below and by apply_step).

def _allocate_core(st: PoolState, n, max_n: int):
  n = jnp.asarray(n, jnp.int32)
  ok = (n >= 0) & (n <= max_n) & (n <= st.num_free)
  n = jnp.where(ok, n, 0)
  st = _maybe(st.stack_stale > 0, _compact_stack, st)
  i = jnp.arange(max_n, dtype=jnp.int32)
  s = jnp.minimum(n, st.stack_top)
  from_stack = st.stack_N[jnp.clip(st.stack_top - 1 - i, 0, st.num_blocks - 1)]
  r_need = n - s
  r = st.ring_R.shape[0]

  def cond(c):
    return c[1] < r_need

  def body(c):
    head, got, ids = c
    p = head + i
    b = st.ring_R[p % r]
    live = (p < st.ring_tail) & (st.loc_N[b] == LOC_RING) & (st.pos_N[b] == p)
    rank = jnp.cumsum(live, dtype=jnp.int32) - 1
    take = live & (rank < r_need - got)
    ids = ids.at[_drop(s + got + rank, take, max_n)].set(b, mode="drop")
    n_take = jnp.sum(take, dtype=jnp.int32)
    last = jnp.max(jnp.where(take, i, -1))
    head = jnp.where(got + n_take >= r_need, head + last + 1, jnp.minimum(head + max_n, st.ring_tail))
    return head, got + n_take, ids

  ids0 = jnp.where(i < s, from_stack, -1)
  head, _, ids = jax.lax.while_loop(cond, body, (st.ring_head, jnp.int32(0), ids0))
  take = i < n
  ids = jnp.where(take, ids, -1)
  safe = jnp.maximum(ids, 0)
  ev = take & st.cached_N[safe]
  nb, ns = st.num_blocks, st.table_S.shape[0]
  slot = st.slot_N[safe]
  st = _rep(st,
            table_S=st.table_S.at[_drop(slot, ev, ns)].set(TOMB, mode="drop"),
            cached_N=st.cached_N.at[_drop(ids, ev, nb)].set(False, mode="drop"),
            slot_N=st.slot_N.at[_after(_drop(ids, ev, nb), nb, slot)].set(-1, mode="drop"),
            key_Nx2=st.key_Nx2.at[_drop(ids, ev, nb)].set(0, mode="drop"),
            ref_N=st.ref_N.at[_drop(ids, take, nb)].set(1, mode="drop"),
            loc_N=st.loc_N.at[_drop(ids, take, nb)].set(LOC_HELD, mode="drop"),
            stack_top=st.stack_top - s, ring_head=head, num_free=st.num_free - n)
  return st, ids, ev, ok


def _ids_valid(st: PoolState, ids_M):
  return jnp.all((ids_M >= -1) & (ids_M < st.num_blocks))


def _touch_core(st: PoolState, ids_M):
  ok = _ids_valid(st, ids_M)
  act = ok & (ids_M >= 0)
  st, first = _first_last(st, ids_M, act)
  safe = jnp.maximum(ids_M, 0)
  ref_M, loc_M = st.ref_N[safe], st.loc_N[safe]
  was_free = first & (ref_M == 0)
  nb = st.num_blocks
  st = _rep(st,
            stack_stale=st.stack_stale + jnp.sum(was_free & (loc_M == LOC_STACK), dtype=jnp.int32),
            loc_N=st.loc_N.at[_after(_drop(ids_M, was_free, nb), nb, loc_M)].set(LOC_HELD, mode="drop"),
            num_free=st.num_free - jnp.sum(was_free, dtype=jnp.int32),
            ref_N=st.ref_N.at[_after(_drop(ids_M, act, nb), nb, ref_M)].add(1, mode="drop"))
  return st, ok


def _free_core(st: PoolState, ids_M, prepend_uncached: bool):
  nb = st.num_blocks
  in_range = _ids_valid(st, ids_M)
  valid = (ids_M >= 0) & (ids_M < nb)
  safe = jnp.clip(ids_M, 0, nb - 1)
  st, last = _first_last(st, ids_M, valid, last=True)
  # one reference per entry; a block listed more often than it is held ends below 0 (count <= ref without
  # counting): then the call is refused and the decrements are undone (scatter, never an O(N) select)
  ref = st.ref_N.at[_drop(ids_M, valid, nb)].add(-1, mode="drop")
  after = ref[safe]
  ok = in_range & jnp.all(~valid | (after >= 0))
  ref = ref.at[_after(_drop(ids_M, valid & ~ok, nb), nb, after)].add(1, mode="drop")
  act = valid & ok
  zero = act & last & (after == 0)
  to_tail = zero & (st.cached_N[safe] | (not prepend_uncached))
  to_head = zero & ~to_tail
  n_tail = jnp.sum(to_tail, dtype=jnp.int32)
  n_head = jnp.sum(to_head, dtype=jnp.int32)
  st = _rep(st, ref_N=ref)
  r = st.ring_R.shape[0]
  st = _maybe((st.ring_tail + n_tail - st.ring_head > r) | (st.ring_tail > _RING_REBASE), _compact_ring, st)
  st = _maybe(st.stack_top + n_head > nb, _compact_stack, st)
  p = st.ring_tail + jnp.cumsum(to_tail, dtype=jnp.int32) - 1
  # the first listed block must end on top of the stack (the very head): push in reverse list order
  q = st.stack_top + n_head - jnp.cumsum(to_head, dtype=jnp.int32)
  pos = st.pos_N.at[_drop(ids_M, to_tail, nb)].set(p, mode="drop").at[_drop(ids_M, to_head, nb)].set(q, mode="drop")
  # the compactions above read loc_N: its writes must come after them
  loc = st.loc_N.at[_after(_drop(ids_M, to_tail, nb), nb, p, q)].set(LOC_RING, mode="drop").at[
      _drop(ids_M, to_head, nb)].set(LOC_STACK, mode="drop")
  st = _rep(st, pos_N=pos, loc_N=loc,
            ring_R=st.ring_R.at[_drop(p % r, to_tail, r)].set(ids_M, mode="drop"),
            stack_N=st.stack_N.at[_drop(q, to_head, nb)].set(ids_M, mode="drop"),
            ring_tail=st.ring_tail + n_tail, stack_top=st.stack_top + n_head,
            num_free=st.num_free + n_tail + n_head)
  return st, ok


def _register_core(st: PoolState, ids_M, key_Mx2, parent_Mx4, tokens_MxT):
  """Batched insertion with exactly the result of inserting the entries one after another.

  Rounds: every unresolved entry scans its probe window against the current table; an entry is resolved in a
  round unless a lower-index unresolved entry could change what it sees: one whose probe window overlaps its own
  (found through `claim_S`: each unresolved entry writes its index into its window slots with scatter-min) or one
  for the same block. The lowest unresolved entry always resolves, so rounds <= M; with random keys there are
  only a few. Insertions of the running batch enter the table as N + entry index until the end."""
  nb, ns, m = st.num_blocks, st.table_S.shape[0], ids_M.shape[0]
  p = st.max_probe
  b = ids_M
  in_range = (b >= 0) & (b < nb)
  bb = jnp.clip(b, 0, nb - 1)
  held = in_range & (st.ref_N[bb] > 0)
  st, prev = _prev_same(st, ids_M, in_range)
  _, slots = _window(st, key_Mx2)
  idx = jnp.arange(m, dtype=jnp.int32)
  code0 = jnp.where(b == -1, SKIPPED, INVALID)
  same_block_ident = (jnp.all(st.key_Nx2[bb] == key_Mx2, -1) & jnp.all(st.parent_Nx4[bb] == parent_Mx4, -1)
                      & jnp.all(st.tokens_NxT[bb] == tokens_MxT, -1))
  prevc = jnp.maximum(prev, 0)

  def cond(c):
    return jnp.any(c[2])

  def body(c):
    table, claim, pending, code, slot_of, owner = c
    # who may resolve this round
    claim = claim.at[jnp.where(pending[:, None], slots, ns)].min(
        jnp.broadcast_to(idx[:, None], slots.shape), mode="drop")
    lowest = jnp.min(claim[slots], 1)
    lower_overlap = lowest < idx
    claim = claim.at[_after(jnp.where(pending[:, None], slots, ns), ns, lowest)].set(BIG, mode="drop")
    prev_pending = (prev >= 0) & pending[prevc]
    ready = pending & ~lower_overlap & ~prev_pending
    # the block's identity now: from before the call, or stored by an earlier entry for the same block
    cached_before = st.cached_N[bb]
    own = jnp.where(prev >= 0, owner[prevc], -1)
    ownc = jnp.maximum(own, 0)
    same_owner_ident = (jnp.all(key_Mx2[ownc] == key_Mx2, -1) & jnp.all(parent_Mx4[ownc] == parent_Mx4, -1)
                        & jnp.all(tokens_MxT[ownc] == tokens_MxT, -1))
    cached_now = cached_before | (own >= 0)
    same = jnp.where(cached_before, same_block_ident, same_owner_ident)
    e = table[slots]
    upto_empty = jnp.arange(p, dtype=jnp.int32)[None] <= _first_true(e == EMPTY)[:, None]   # stops after it
    j_dup = _first_match(st, e, upto_empty, key_Mx2, parent_Mx4, tokens_MxT, (key_Mx2, parent_Mx4, tokens_MxT))
    j_free = _first_true(upto_empty & (e < 0))
    free_slot = jnp.take_along_axis(slots, jnp.minimum(j_free, p - 1)[:, None], 1)[:, 0]
    new_code = jnp.where(cached_now, jnp.where(same, ALREADY, INVALID),
                         jnp.where(j_dup < p, DUPLICATE, jnp.where(j_free < p, STORED, TABLE_FULL)))
    store = ready & (new_code == STORED)
    table = table.at[_drop(free_slot, store, ns)].set(nb + idx, mode="drop")
    code = jnp.where(ready, new_code, code)
    slot_of = jnp.where(store, free_slot, slot_of)
    owner = jnp.where(ready, jnp.where(store, idx, own), owner)
    return table, claim, pending & ~ready, code, slot_of, owner

  table, claim, _, code, slot_of, _ = jax.lax.while_loop(
      cond, body, (st.table_S, st.claim_S, held, code0, jnp.full(m, -1, jnp.int32), jnp.full(m, -1, jnp.int32)))
  store = code == STORED
  table = table.at[_drop(slot_of, store, ns)].set(b, mode="drop")
  tgt = _drop(b, store, nb)
  st = _rep(st, table_S=table, claim_S=claim,
            cached_N=st.cached_N.at[tgt].set(True, mode="drop"), slot_N=st.slot_N.at[tgt].set(slot_of, mode="drop"),
            key_Nx2=st.key_Nx2.at[tgt].set(key_Mx2, mode="drop"),
            parent_Nx4=st.parent_Nx4.at[tgt].set(parent_Mx4, mode="drop"),
            tokens_NxT=st.tokens_NxT.at[tgt].set(tokens_MxT, mode="drop"))
  return st, code


REGISTER_CHUNK_MIN = 32   # `_register_chunks`: entries per chunk at least ...
REGISTER_CHUNKS = 4       # ... and at most this many chunks per call


def _register_chunks(st: PoolState, ids_M, key_Mx2, parent_Mx4, tokens_MxT, min_chunk: int = REGISTER_CHUNK_MIN,
                     chunks: int = REGISTER_CHUNKS):
  """`_register_core` chunk after chunk (ceil(M / chunks) entries, at least min_chunk), only up to the last entry
  that is not padding (-1): exactly the batch's result, since a batch has the semantics of its entries one after
  another. Each insertion round costs O(chunk x probes) instead of O(M x probes), so the cost follows the live
  entries: a step's fixed widths are mostly padding (8 x 2k admission: 32 of 176 live)."""
  m = ids_M.shape[0]
  c = max(min_chunk, -(-m // chunks))
  if m <= c:
    return _register_core(st, ids_M, key_Mx2, parent_Mx4, tokens_MxT)
  pad = -m % c
  if pad:
    ids_M = jnp.pad(ids_M, (0, pad), constant_values=-1)
    key_Mx2, parent_Mx4, tokens_MxT = (jnp.pad(x, ((0, pad), (0, 0))) for x in (key_Mx2, parent_Mx4, tokens_MxT))
  i = jnp.arange(m + pad, dtype=jnp.int32)
  n = (jnp.max(jnp.where(ids_M != -1, i, -1)) + c) // c        # chunks up to the last non-padding entry

  def body(carry):
    k, st, code = carry
    sl = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=k * c, slice_size=c)
    st, ck = _register_core(st, sl(ids_M), sl(key_Mx2), sl(parent_Mx4), sl(tokens_MxT))
    return k + 1, st, jax.lax.dynamic_update_slice_in_dim(code, ck.astype(jnp.int32), k * c, 0)

  code = jnp.full(m + pad, SKIPPED, jnp.int32)
  _, st, code = jax.lax.while_loop(lambda carry: carry[0] < n, body, (jnp.int32(0), st, code))
  return st, code[:m]


def _evict_core(st: PoolState, ids_M):
  nb, ns = st.num_blocks, st.table_S.shape[0]
  valid = (ids_M >= 0) & (ids_M < nb)
  st, first = _first_last(st, ids_M, valid)
  safe = jnp.clip(ids_M, 0, nb - 1)
  act = first & (st.ref_N[safe] == 0) & st.cached_N[safe]
  tgt = _drop(ids_M, act, nb)
  slot = st.slot_N[safe]
  st = _rep(st, table_S=st.table_S.at[_drop(slot, act, ns)].set(TOMB, mode="drop"),
            cached_N=st.cached_N.at[tgt].set(False, mode="drop"),
            slot_N=st.slot_N.at[_after(tgt, nb, slot)].set(-1, mode="drop"),
            key_Nx2=st.key_Nx2.at[tgt].set(0, mode="drop"))
  return st, act


# ---------------------------------------------------------------------------------------------------------
# Single jitted operations (state donated). Id arrays are fixed width with -1 padding.

@functools.partial(jax.jit, static_argnames=("max_n",), donate_argnums=0)
def allocate(st: PoolState, n, *, max_n: int):
  """Take n blocks from the head of the free queue (ref = 1), dropping each one's cached identity.

  Returns (state, ids_M, evicted_M, ok): ids padded with -1; evicted_M[i] says ids[i] lost a cached identity
  (the host emits BlockRemoved). ok is false, and nothing changes, if n < 0, n > max_n or n > num_free.
  """
  return _allocate_core(st, n, max_n)


@functools.partial(jax.jit, donate_argnums=0)
def touch(st: PoolState, ids_M):
  """Claim blocks (prefix hit): a free one leaves the free queue; ref += 1. -1 entries are skipped."""
  return _touch_core(st, ids_M)


@functools.partial(jax.jit, static_argnames=("prepend_uncached",), donate_argnums=0)
def free(st: PoolState, ids_M, *, prepend_uncached: bool = True):
  """Release one reference per listed block, given in eviction order (a request's tail blocks first).

  Blocks reaching ref 0: cached ones are appended to the tail in list order (kept longest, LRU); uncached ones
  are put at the head in list order (reused first). `prepend_uncached=False` is the legacy (vLLM <= 0.22)
  behaviour. ok false (state unchanged) if an id is out of range or a block would drop below ref 0.
  """
  return _free_core(st, ids_M, prepend_uncached)


@functools.partial(jax.jit, donate_argnums=0)
def register(st: PoolState, ids_M, key_Mx2, parent_Mx4, tokens_MxT):
  """Record the cached identity of held, full blocks. Returns (state, status_M) with the codes above."""
  return _register_chunks(st, ids_M, key_Mx2, parent_Mx4, tokens_MxT)


@functools.partial(jax.jit, donate_argnums=0)
def evict(st: PoolState, ids_M):
  """Drop the cached identity of free blocks (an external eviction). Held or uncached ids are ignored; a freed
  block keeps its place in the free queue."""
  return _evict_core(st, ids_M)


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
  """The free queue head (reused first) to tail: live stack entries top-down, then live ring entries."""
  loc, pos = np.asarray(st.loc_N), np.asarray(st.pos_N)
  stack, top = np.asarray(st.stack_N), int(st.stack_top)
  out = [int(stack[i]) for i in range(top - 1, -1, -1) if loc[stack[i]] == LOC_STACK and pos[stack[i]] == i]
  ring, r = np.asarray(st.ring_R), st.ring_R.shape[0]
  for p in range(int(st.ring_head), int(st.ring_tail)):
    b = int(ring[p % r])
    if loc[b] == LOC_RING and pos[b] == p:
      out.append(b)
  return out

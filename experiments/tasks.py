"""Deterministic long-range retrieval tasks for training / evaluating the compressed (sparse) attention path.

Key-value recall ("kv_recall"):

    [BOS] filler ... k1 v1 ... filler ... k2 v2 ... filler ...  [SEP] q1 a1 q2 a2 ... qQ aQ

* `num_pairs` distinct (key, value) token pairs are written in the first part of the sequence, one pair in each of
  `num_pairs` equal segments of the "store" region, at a random offset inside its segment (so pairs are >= 8
  tokens apart and each pair lies inside one overlapping CSA entry of 8 tokens);
* the last `2 * num_queries + 1` tokens are a SEP marker and `num_queries` distinct keys from the stored pairs,
  each followed by its value (teacher forcing); the loss / accuracy is the prediction of the value at each query
  key position;
* everything between the store region and the query section is random filler, and the store region ends at least
  `min_gap` tokens before the SEP, so with `min_gap >= window` no stored pair is visible to the sliding window of any
  query: the answer is only reachable through the compressed entries.

Counting ("count", `CountSpec`): one answer needs *several* far-away compressed entries at once:

    [BOS] filler .. K .. filler .. d .. filler .. K .. filler (>= min_gap tokens) [SEP] K c

* the store region is cut into `max_count` (= C) equal slots; a key token K (drawn per sequence) is written into
  c of them (c uniform in 1..C), at a random offset such that any two key tokens are >= 8 tokens apart, so every
  occurrence lies in its own pair of (overlapping, 8-token) CSA entries and no entry holds two;
* with `distractors`, each of the other C - c slots holds a different key token (so every slot has "a key" and
  the model must match the asked one, not detect keys);
* the query section is SEP, K, then the count token `count_lo + c - 1` (teacher forcing); loss / accuracy is the
  prediction at the K position (one answer per sequence; chance = 1/C);
* `src_pos[b, t, :]` lists the positions of all c occurrences (-1 padded): what the attention supervision and the
  indexer hit rate use. With top-k < c the CSA layer can read at most k of the c occurrences.

Multi-key aggregation ("multikey", `MultiKeySpec`): the number of far-away entries one answer needs is a knob m:

    [BOS] filler .. s1 .. filler .. s2 .. ... .. sm .. filler (>= min_gap tokens) [SEP] K a

* the store region is cut into m equal slots; each slot holds one key token, either the asked key K (token key_lo,
  fixed) or a distinct distractor key; c of the m slots hold K (c uniform in 0..m);
* the answer is the *fraction* c / m on a fixed grid: token `count_lo + round(levels * c / m)` (levels = 16, so the
  same read-out serves every m and m = 16 needs every slot to be read exactly);
* m is drawn per sequence from `ms`, so one trained model is evaluated at m = 1, 4, 16 by fixing `ms=(m,)`;
  a slot's key lies in two overlapping CSA entries (one V4.1 ratio-2 entry), so the answer needs ~2m (m) entries
  and a top-k below that must lose information. Chance = 1 / (m + 1) (uniform c).

Repeated motifs ("motif", `MotifSpec`): language modelling where the continuation is mostly predictable from the
last few tokens (repetitive text / code), a task where speculative drafting should pay:

    [BOS] a b c a b c a b c a b x a b c | d e f g d e f g d e f g ...

* a sequence is a run of segments; each segment repeats a motif of p distinct tokens (p uniform in p_lo..p_hi, all
  <= 8 so two periods sit inside the 16-token window) for reps_lo..reps_hi full periods, then switches to a fresh
  motif (the switch point is unpredictable, so the first period of every new segment is noise to any model);
* `chain`: a motif is p consecutive tokens of one fixed cycle over the motif tokens (the same for every sequence), so
  inside a period the next token is the current one's fixed successor (learned like a bigram table) and only the
  wrap from the motif's last token back to its first needs the context (an induction / look-back of one period);
  without `chain` the p tokens are random and every prediction needs the look-back. A 2-layer model of
  `train_lib.retrieval_config` stayed on the bag-of-recent-tokens plateau (accuracy ~0.3) for 460 steps without it;
* each token after its segment's first period is replaced by a random motif-range token with probability
  `sub_prob` (a typo: the text goes on with the motif, so the token after a substitution is still predictable by
  a model that looks back a whole period rather than matching the last token only);
* loss / accuracy on every position after the sequence's first motif period (mask); `pred_mask` marks the
  positions whose target is predictable (a repeat: inside a segment after its first period, not a substitution),
  the ceiling of a perfect model's accuracy is their share of the mask;
* no far-away retrieval: the compressed path is not needed (no `src_pos` sources; attention supervision off).

Every batch is a pure function of (task spec, seed): `make_batch(spec, seed, batch)`; evaluation uses seeds from a
range disjoint from the training seeds (`EVAL_SEED_BASE`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

BOS, SEP = 0, 2
EVAL_SEED_BASE = 1_000_000_000  # training seeds are step numbers (< 1e9); eval seeds start here


@dataclasses.dataclass(frozen=True)
class KVRecallSpec:
  seq_len: int = 256
  num_pairs: int = 8
  num_queries: int = 8
  min_gap: int = 32          # tokens between the end of the store region and SEP (>= window: pairs out of window)
  store_frac: float = 1.0    # fraction of [1, seq_len - query section - min_gap) used as the store region
  filler_lo: int = 3         # token ranges (inclusive lo, exclusive hi)
  filler_hi: int = 8
  key_lo: int = 8
  key_hi: int = 40
  value_lo: int = 40
  value_hi: int = 64

  @property
  def vocab_size(self) -> int:
    return self.value_hi

  @property
  def num_values(self) -> int:
    return self.value_hi - self.value_lo

  @property
  def query_len(self) -> int:
    return 2 * self.num_queries + 1

  @property
  def store_end(self) -> int:
    return 1 + int((self.seq_len - self.query_len - self.min_gap - 1) * self.store_frac)

  def validate(self):
    seg = (self.store_end - 1) // self.num_pairs
    if seg < 8:
      raise ValueError(f"KVRecallSpec: store region too short for {self.num_pairs} pairs 8 tokens apart "
                       f"(segment {seg}); raise seq_len or lower num_pairs/min_gap")
    if self.num_queries > self.num_pairs:
      raise ValueError("KVRecallSpec: num_queries must be <= num_pairs (queries ask distinct stored keys)")
    if self.key_hi - self.key_lo < self.num_pairs:
      raise ValueError("KVRecallSpec: need at least num_pairs distinct keys")


@dataclasses.dataclass(frozen=True)
class CountSpec:
  kind: str = "count"
  seq_len: int = 128
  max_count: int = 8         # C: counts are uniform in 1..C, one slot per possible occurrence
  min_gap: int = 32          # tokens between the end of the store region and SEP
  distractors: bool = True   # fill the unused slots with other key tokens
  fixed_key: bool = False    # the counted key is always token key_lo (else drawn per sequence)
  sup_all_slots: bool = False  # src_pos lists every filled slot (key + distractors), not only the key
  mode: str = "count"        # "count": answer c; "majority": two keys A=key_lo, B=key_lo+1 fill an odd number
                             # N of slots (N uniform odd in 3..C), answer count_lo + (n_B > n_A)
  filler_lo: int = 3
  filler_hi: int = 8
  key_lo: int = 8
  key_hi: int = 40
  count_lo: int = 40         # answer token for count c is count_lo + c - 1

  @property
  def vocab_size(self) -> int:
    return 64

  @property
  def num_values(self) -> int:
    return 2 if self.mode == "majority" else self.max_count

  @property
  def query_len(self) -> int:
    return 3

  @property
  def store_end(self) -> int:
    return 1 + (self.seq_len - self.query_len - self.min_gap - 1)

  def validate(self):
    seg = (self.store_end - 1) // self.max_count
    if seg < 8:
      raise ValueError(f"CountSpec: store region too short for {self.max_count} slots 8 tokens apart "
                       f"(slot {seg}); raise seq_len or lower max_count/min_gap")
    if self.key_hi - self.key_lo < self.max_count or self.count_lo + self.max_count > self.vocab_size:
      raise ValueError("CountSpec: token ranges too small")


def make_count_batch(spec: CountSpec, seed: int, batch: int):
  """Returns dict(tokens, targets, mask [B,T], src_pos [B,T,C] int32 (occurrence positions at the answer
  position, -1 padded), count [B])."""
  spec.validate()
  rng = np.random.default_rng(np.uint64(seed) + np.uint64(0x5BD1E995))
  T, C = spec.seq_len, spec.max_count
  tokens = rng.integers(spec.filler_lo, spec.filler_hi, size=(batch, T)).astype(np.int32)
  tokens[:, 0] = BOS
  targets = np.zeros((batch, T), np.int32)
  mask = np.zeros((batch, T), np.float32)
  src_pos = np.full((batch, T, C), -1, np.int32)
  count = np.zeros((batch,), np.int32)
  seg = (spec.store_end - 1) // C
  t = T - 2
  for b in range(batch):
    if spec.mode == "majority":
      keys = np.concatenate([[spec.key_lo, spec.key_lo + 1],
                             rng.choice(np.arange(spec.key_lo + 2, spec.key_hi), size=C, replace=False)])
      n = int(rng.choice(np.arange(3, C + 1, 2)))
      n_a = int(rng.integers(0, n + 1))
      slot_tok = [keys[0]] * n_a + [keys[1]] * (n - n_a)
      answer, c, q = spec.count_lo + int(n - n_a > n_a), n - n_a, 1
    else:
      keys = rng.choice(np.arange(spec.key_lo, spec.key_hi), size=C, replace=False)  # keys[0] = asked key
      if spec.fixed_key:
        keys = np.concatenate([[spec.key_lo], rng.choice(np.arange(spec.key_lo + 1, spec.key_hi), size=C - 1,
                                                         replace=False)])
      c = int(rng.integers(1, C + 1))
      n, slot_tok = c, [keys[0]] * c
      answer, q = spec.count_lo + c - 1, keys[0]
    slots = rng.permutation(C)
    pos = [1 + int(s) * seg + int(rng.integers(0, seg - 7)) for s in slots]
    filled = []
    for j in range(C):
      if j < n:
        tokens[b, pos[j]] = slot_tok[j]
        filled.append(pos[j])
      elif spec.distractors:
        tokens[b, pos[j]] = keys[j] if spec.mode == "count" else keys[2 + j]
        if spec.sup_all_slots:
          filled.append(pos[j])
    src = sorted(filled) if spec.sup_all_slots or spec.mode == "majority" else sorted(pos[:c])
    src_pos[b, t, :len(src)] = src
    tokens[b, T - 3], tokens[b, t], tokens[b, T - 1] = SEP, q, answer
    targets[b, t] = answer
    mask[b, t] = 1.0
    count[b] = c
  return dict(tokens=tokens, targets=targets, mask=mask, src_pos=src_pos, count=count)


@dataclasses.dataclass(frozen=True)
class MultiKeySpec:
  kind: str = "multikey"
  seq_len: int = 192
  ms: tuple = (1, 2, 4, 8, 16)   # slots per sequence (= entries an answer needs, x2 for overlapping CSA)
  min_gap: int = 32
  levels: int = 16               # answer grid: count_lo + round(levels * c / m)
  filler_lo: int = 3
  filler_hi: int = 8
  key_lo: int = 8                # the asked key (always this token)
  key_hi: int = 40
  count_lo: int = 40

  @property
  def vocab_size(self) -> int:
    return 64

  @property
  def num_values(self) -> int:
    # chance of a uniform guess among the answers possible for the largest m (c uniform in 0..m)
    return max(self.ms) + 1

  @property
  def query_len(self) -> int:
    return 3

  @property
  def store_end(self) -> int:
    return 1 + (self.seq_len - self.query_len - self.min_gap - 1)

  def validate(self):
    seg = (self.store_end - 1) // max(self.ms)
    if seg < 8:
      raise ValueError(f"MultiKeySpec: store region too short for {max(self.ms)} slots 8 tokens apart "
                       f"(slot {seg}); raise seq_len or lower ms/min_gap")
    if self.key_hi - self.key_lo <= max(self.ms) or self.count_lo + self.levels >= self.vocab_size:
      raise ValueError("MultiKeySpec: token ranges too small")
    if any(self.levels % m for m in self.ms):
      raise ValueError("MultiKeySpec: every m must divide levels (exact answer grid)")


def make_multikey_batch(spec: MultiKeySpec, seed: int, batch: int):
  """Returns dict(tokens, targets, mask [B,T], src_pos [B,T,M] (all m slot positions at the answer position,
  -1 padded; M = levels, the same for every m, so one compiled evaluation serves all m), count [B] (c), m [B])."""
  spec.validate()
  rng = np.random.default_rng(np.uint64(seed) + np.uint64(0x2545F491))
  T, M = spec.seq_len, spec.levels
  tokens = rng.integers(spec.filler_lo, spec.filler_hi, size=(batch, T)).astype(np.int32)
  tokens[:, 0] = BOS
  targets = np.zeros((batch, T), np.int32)
  mask = np.zeros((batch, T), np.float32)
  src_pos = np.full((batch, T, M), -1, np.int32)
  count = np.zeros((batch,), np.int32)
  ms = np.zeros((batch,), np.int32)
  t = T - 2
  for b in range(batch):
    m = int(rng.choice(spec.ms))
    seg = (spec.store_end - 1) // m
    c = int(rng.integers(0, m + 1))
    distract = rng.choice(np.arange(spec.key_lo + 1, spec.key_hi), size=m, replace=False)
    is_key = rng.permutation(np.arange(m) < c)
    pos = [1 + j * seg + int(rng.integers(0, seg - 7)) for j in range(m)]
    for j in range(m):
      tokens[b, pos[j]] = spec.key_lo if is_key[j] else distract[j]
    src_pos[b, t, :m] = pos
    answer = spec.count_lo + (spec.levels * c) // m
    tokens[b, T - 3], tokens[b, t], tokens[b, T - 1] = SEP, spec.key_lo, answer
    targets[b, t] = answer
    mask[b, t] = 1.0
    count[b], ms[b] = c, m
  return dict(tokens=tokens, targets=targets, mask=mask, src_pos=src_pos, count=count, m=ms)


@dataclasses.dataclass(frozen=True)
class MotifSpec:
  kind: str = "motif"
  seq_len: int = 128
  p_lo: int = 2              # motif length uniform in p_lo..p_hi (inclusive); p_hi <= window / 2
  p_hi: int = 8
  reps_lo: int = 3           # full periods per segment, uniform in reps_lo..reps_hi (inclusive)
  reps_hi: int = 10
  sub_prob: float = 0.03     # per-token substitution probability after a segment's first period
  tok_lo: int = 3            # motif tokens (inclusive lo, exclusive hi): 61 of the 64
  tok_hi: int = 64
  chain: bool = False        # motifs are runs of one fixed cycle over the motif tokens (a vocabulary with a fixed
                             # successor: token -> succ(token) inside a motif, so only the wrap back to the motif's
                             # first token needs the context); False: p distinct random tokens
  chain_seed: int = 0        # the fixed cycle (a permutation of the motif tokens), the same for every sequence

  @property
  def vocab_size(self) -> int:
    return 64

  @property
  def num_values(self) -> int:
    return self.tok_hi - self.tok_lo

  def validate(self):
    if not 1 <= self.p_lo <= self.p_hi or self.tok_hi - self.tok_lo < self.p_hi or self.tok_hi > self.vocab_size:
      raise ValueError("MotifSpec: need 1 <= p_lo <= p_hi <= number of motif tokens, tok_hi <= 64")
    if not 1 <= self.reps_lo <= self.reps_hi:
      raise ValueError("MotifSpec: need 1 <= reps_lo <= reps_hi")
    if not 0.0 <= self.sub_prob < 1.0:
      raise ValueError("MotifSpec: sub_prob in [0, 1)")
    if self.seq_len < 2 + self.p_hi * (self.reps_lo + 1):
      raise ValueError(f"MotifSpec: seq_len {self.seq_len} too short for a segment of {self.reps_lo} periods of "
                       f"{self.p_hi} plus one")


def motif_cycle(spec: MotifSpec) -> np.ndarray:
  """The fixed cycle of `chain` motifs: the motif tokens in one random order (seeded by chain_seed)."""
  return np.random.default_rng(np.uint64(spec.chain_seed) + np.uint64(0x165667B1)).permutation(
      np.arange(spec.tok_lo, spec.tok_hi)).astype(np.int32)


def make_motif_batch(spec: MotifSpec, seed: int, batch: int):
  """Returns dict(tokens, targets, mask [B,T], pred_mask [B,T] (target predictable: a repeat, no substitution),
  src_pos [B,T] (-1: no far sources), period [B,T] (the motif length of the segment target t+1 is in))."""
  spec.validate()
  rng = np.random.default_rng(np.uint64(seed) + np.uint64(0x27D4EB2F))
  T = spec.seq_len
  cycle = motif_cycle(spec)
  tokens = np.zeros((batch, T), np.int32)
  repeat = np.zeros((batch, T), bool)          # token is a repeat of its motif (segment position >= p)
  period = np.zeros((batch, T), np.int32)
  mask = np.zeros((batch, T), np.float32)
  for b in range(batch):
    t, first = 1, None
    while t < T:
      p = int(rng.integers(spec.p_lo, spec.p_hi + 1))
      if spec.chain:
        start = int(rng.integers(0, len(cycle)))
        motif = cycle[(start + np.arange(p)) % len(cycle)]
      else:
        motif = rng.choice(np.arange(spec.tok_lo, spec.tok_hi), size=p, replace=False)
      n = p * int(rng.integers(spec.reps_lo, spec.reps_hi + 1))
      m = min(n, T - t)
      tokens[b, t:t + m] = np.resize(motif, m)
      repeat[b, t + p:t + m] = True
      period[b, t:t + m] = p
      first = t + p if first is None else first
      t += m
    sub = repeat[b] & (rng.random(T) < spec.sub_prob)
    tokens[b, sub] = rng.integers(spec.tok_lo, spec.tok_hi, size=int(sub.sum()))
    repeat[b, sub] = False
    mask[b, first - 1:T - 1] = 1.0            # targets: every token after the first motif period
  targets = np.zeros((batch, T), np.int32)
  targets[:, :-1] = tokens[:, 1:]
  pred_mask = np.zeros((batch, T), np.float32)
  pred_mask[:, :-1] = repeat[:, 1:] * mask[:, :-1]
  per = np.zeros((batch, T), np.int32)
  per[:, :-1] = period[:, 1:]
  return dict(tokens=tokens, targets=targets, mask=mask, pred_mask=pred_mask, src_pos=np.full((batch, T), -1, np.int32),
              period=per)


def spec_from_dict(d: dict):
  """Task spec from its `dataclasses.asdict` (checkpoint config.json "task"); no "kind" = key-value recall."""
  d = dict(d)
  if d.get("kind") == "count":
    return CountSpec(**d)
  if d.get("kind") == "multikey":
    d["ms"] = tuple(d["ms"])
    return MultiKeySpec(**d)
  if d.get("kind") == "motif":
    return MotifSpec(**d)
  d.pop("kind", None)
  return KVRecallSpec(**d)


def make_batch(spec, seed: int, batch: int):
  if isinstance(spec, CountSpec):
    return make_count_batch(spec, seed, batch)
  if isinstance(spec, MultiKeySpec):
    return make_multikey_batch(spec, seed, batch)
  if isinstance(spec, MotifSpec):
    return make_motif_batch(spec, seed, batch)
  return make_kv_batch(spec, seed, batch)


def make_kv_batch(spec: KVRecallSpec, seed: int, batch: int):
  """Returns dict(tokens [B,T] int32, targets [B,T] int32, mask [B,T] float32, pair_pos [B,P] int32,
  src_pos [B,T] int32).

  targets[b, t] is the token expected after position t (the value) where mask is 1, else 0; src_pos[b, t] is the
  position of that value token in the store region (-1 where mask is 0)."""
  spec.validate()
  rng = np.random.default_rng(np.uint64(seed) + np.uint64(0x9E3779B9))
  T, P, Q = spec.seq_len, spec.num_pairs, spec.num_queries
  tokens = rng.integers(spec.filler_lo, spec.filler_hi, size=(batch, T)).astype(np.int32)
  tokens[:, 0] = BOS
  targets = np.zeros((batch, T), np.int32)
  mask = np.zeros((batch, T), np.float32)
  pair_pos = np.zeros((batch, P), np.int32)
  src_pos = np.full((batch, T), -1, np.int32)
  seg = (spec.store_end - 1) // P
  q0 = T - spec.query_len
  for b in range(batch):
    keys = rng.choice(np.arange(spec.key_lo, spec.key_hi), size=P, replace=False)
    vals = rng.integers(spec.value_lo, spec.value_hi, size=P)
    for i in range(P):
      pos = 1 + i * seg + int(rng.integers(0, seg - 1))
      tokens[b, pos], tokens[b, pos + 1] = keys[i], vals[i]
      pair_pos[b, i] = pos
    tokens[b, q0] = SEP
    asked = rng.choice(P, size=Q, replace=False)
    for j, i in enumerate(asked):
      t = q0 + 1 + 2 * j
      tokens[b, t], tokens[b, t + 1] = keys[i], vals[i]
      targets[b, t] = vals[i]
      mask[b, t] = 1.0
      src_pos[b, t] = pair_pos[b, i] + 1
  return dict(tokens=tokens, targets=targets, mask=mask, pair_pos=pair_pos, src_pos=src_pos)


def eval_batches(spec, num_batches: int, batch: int, seed_offset: int = 0):
  for i in range(num_batches):
    yield make_batch(spec, EVAL_SEED_BASE + seed_offset + i, batch)

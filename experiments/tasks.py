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


def make_batch(spec: KVRecallSpec, seed: int, batch: int):
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


def eval_batches(spec: KVRecallSpec, num_batches: int, batch: int, seed_offset: int = 0):
  for i in range(num_batches):
    yield make_batch(spec, EVAL_SEED_BASE + seed_offset + i, batch)

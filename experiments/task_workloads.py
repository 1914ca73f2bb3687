"""Serving workloads in a trained model's own task format (experiments/tasks.py), so every answer can be graded.

Recall sessions (key-value recall models, `v4_retrieval`, `v41_retrieval`): a few long documents, each the store
region of a `tasks.make_kv_batch` sequence (BOS 0, filler 3-7, key 8-39 + value 40-63 pairs, then >= min_gap filler
tokens). Several sessions read the same document and ask it questions turn by turn, exactly in the training format
of the query section:

    turn 1: <document> SEP k1   -> expects v1
    turn 2:               k2   -> expects v2      (its prompt = turn 1's prompt + turn 1's answer + k2)
    ...

so prefix reuse happens naturally: a later turn resumes its own session (the previous turn's cached prompt and
answer), and a session that opens on a document another session already read reuses that document.
Sessions that share a document start one wave apart, so the first reader has finished before the next arrives.
Each document also has a revised version (same first 128 tokens, new rest): its readers share a prefix with the
original's that ends far from any turn end, which only a retention checkpoint lets them reuse.

Count sessions (`v4_count`): one question per document ([BOS] filler .. K .. [SEP] K -> count token), each
document asked by several sessions in successive waves; documents keep the trained length (128 tokens), which is
shorter than one 128-token full-attention block, so this workload shows grading, not prefix reuse.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dsv4.engine.sampling import SamplingParams
from dsv4.engine.workloads import Turn, Workload
from experiments import tasks

# Answers are one token: the model was trained to predict the value right after a key (greedy, no EOS in the task).
_ANSWER = SamplingParams(max_tokens=1, ignore_eos=True)


def _pairs(tokens, pair_pos, lo: int, hi: int):
  """(key, value) pairs of a make_kv_batch row whose key and value both lie in [lo, hi)."""
  return [(int(tokens[p]), int(tokens[p + 1])) for p in pair_pos if lo <= p and p + 1 < hi]


def recall_sessions(spec: tasks.KVRecallSpec, *, documents: int = 2, revisions: int = 1, sessions_per_doc: int = 3,
                    turns: int = 4, doc_len: int = 256, shared_len: int = 128, seed: int = 0) -> Workload:
  """Sessions of `turns` recall questions over `documents` documents of doc_len tokens, `sessions_per_doc` sessions
  per document. Each document also has `revisions` revised versions that keep its first `shared_len` tokens and
  replace the rest (their sessions start one wave later): a revision shares a prefix with its original that ends far
  from any turn end, which only a retention checkpoint (`--retention_interval=128`) lets it reuse."""
  # Same store geometry as training (pairs, gap), stretched to doc_len (held-out accuracy at 256 tokens: 0.998 V4,
  # 0.94 V4.1).
  doc_spec = dataclasses.replace(spec, seq_len=doc_len + spec.query_len)
  rows = tasks.make_kv_batch(doc_spec, tasks.EVAL_SEED_BASE + 7_000_000 + seed, documents * (1 + revisions))
  rng = np.random.default_rng(seed)
  q0 = doc_spec.seq_len - doc_spec.query_len          # the document ends where the query section would start
  docs = []                                           # (name, tokens, [(key, value)], first wave)
  for d in range(documents):
    toks, pos = rows["tokens"][d], rows["pair_pos"][d]
    docs.append((f"doc{d}", toks[:q0], _pairs(toks, pos, 0, q0), 0))
    for r in range(revisions):
      j = documents + d * revisions + r
      new, new_pos = rows["tokens"][j].copy(), rows["pair_pos"][j]
      kept = _pairs(toks, pos, 0, shared_len)
      added = _pairs(new, new_pos, shared_len, q0)
      # a revised pair must not reuse a key of the kept part (the question would be ambiguous): give it a free key
      used = {k for k, _ in kept} | {k for k, _ in added}
      free = iter(sorted(set(range(spec.key_lo, spec.key_hi)) - used))
      kept_keys = {k for k, _ in kept}
      for p in new_pos:
        if p >= shared_len and int(new[p]) in kept_keys:
          new[p] = next(free)
      new[:shared_len] = toks[:shared_len]
      docs.append((f"doc{d}.rev{r + 1}", new[:q0], kept + _pairs(new, new_pos, shared_len, q0), 1))
  waves: list[list[Turn]] = [[] for _ in range(1 + sessions_per_doc + turns - 1)]
  for name, doc_toks, pairs, first in docs:
    doc = tuple(int(t) for t in doc_toks)
    for s in range(sessions_per_doc):
      for t, i in enumerate(rng.permutation(len(pairs))[:turns]):
        k, v = pairs[i]
        new_tokens = (doc + (tasks.SEP,) if t == 0 else ()) + (k,)
        waves[first + s + t].append(Turn(f"{name}.s{s}", new_tokens, _ANSWER, expected=(v,)))
  return Workload("recall", tuple(tuple(w) for w in waves if w))


def count_sessions(spec: tasks.CountSpec, *, documents: int = 4, asks: int = 2, seed: int = 0) -> Workload:
  """`documents` counting questions at the trained length, each asked by `asks` sessions in successive waves."""
  batch = tasks.make_count_batch(spec, tasks.EVAL_SEED_BASE + 7_000_000 + seed, documents)
  T = spec.seq_len
  waves = []
  for a in range(asks):
    wave = []
    for d in range(documents):
      prompt = tuple(int(t) for t in batch["tokens"][d, :T - 1])      # ... SEP K; the answer is tokens[T-1]
      wave.append(Turn(f"doc{d}.s{a}", prompt, _ANSWER, expected=(int(batch["tokens"][d, T - 1]),)))
    waves.append(tuple(wave))
  return Workload("count", tuple(waves))


def for_task(spec, seed: int = 0) -> Workload:
  """The graded workload for a checkpoint's task (`train_lib.task_spec_from_info(info)`)."""
  if isinstance(spec, tasks.CountSpec):
    return count_sessions(spec, seed=seed)
  return recall_sessions(spec, seed=seed)

"""Serving workloads in a trained model's own task format (experiments/tasks.py), so every answer can be graded.

Recall sessions (key-value recall models, `v4_retrieval`, `v41_retrieval`): a few long documents, each the store
region of a `tasks.make_kv_batch` sequence (BOS 0, filler 3-7, key 8-39 + value 40-63 pairs, then >= min_gap filler
tokens). Several sessions read the same document and ask it questions turn by turn, exactly in the training format
of the query section:

    turn 1: <document> SEP k1   -> expects v1
    turn 2:               k2   -> expects v2      (its prompt = turn 1's prompt + turn 1's answer + k2)
    ...

so prefix reuse happens naturally: a later turn resumes its own session (the previous turn's cached prompt and
answer), and a session that opens on a document another session already read can reuse that document (with
`--retention_interval=128`, which keeps SWA checkpoints inside the document; at 0 only turn ends are kept).
Sessions that share a document start one wave apart, so the first reader has finished before the next arrives.

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


def recall_sessions(spec: tasks.KVRecallSpec, *, documents: int = 4, sessions_per_doc: int = 3, turns: int = 4,
                    doc_len: int = 256, seed: int = 0) -> Workload:
  """`documents` x `sessions_per_doc` sessions of `turns` recall questions over documents of ~doc_len tokens."""
  if turns > spec.num_pairs:
    raise ValueError(f"recall_sessions: {turns} turns but only {spec.num_pairs} stored pairs per document")
  # Same store geometry as training (pairs, gap), stretched to doc_len: evaluated in training at 256 and 512.
  doc_spec = dataclasses.replace(spec, seq_len=doc_len + spec.query_len)
  batch = tasks.make_kv_batch(doc_spec, tasks.EVAL_SEED_BASE + 7_000_000 + seed, documents)
  rng = np.random.default_rng(seed)
  q0 = doc_spec.seq_len - doc_spec.query_len          # the document ends where the query section would start
  waves: list[list[Turn]] = [[] for _ in range(sessions_per_doc + turns - 1)]
  for d in range(documents):
    doc = tuple(int(t) for t in batch["tokens"][d, :q0])
    pos = batch["pair_pos"][d]
    keys, vals = batch["tokens"][d, pos], batch["tokens"][d, pos + 1]
    for s in range(sessions_per_doc):
      asked = rng.permutation(spec.num_pairs)[:turns]
      for t, i in enumerate(asked):
        new = (doc + (tasks.SEP,) if t == 0 else ()) + (int(keys[i]),)
        waves[s + t].append(Turn(f"doc{d}.s{s}", new, _ANSWER, expected=(int(vals[i]),)))
  return Workload("recall", tuple(tuple(w) for w in waves))


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

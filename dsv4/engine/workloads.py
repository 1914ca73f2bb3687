"""Deterministic (seeded) workloads made of sessions and waves.

A workload is a list of waves; a wave is a list of turns submitted together once the previous wave has finished.
A turn appends new user tokens to its session's history (previous prompt + previous answer), which is what makes
later turns prefix hits. A turn may carry the answer it expects (`expected`): the report then grades each output
(`experiments/task_workloads.py` builds graded workloads in a trained model's own task format). Kinds here
(synthetic random tokens, nothing to grade):
  chat      multi-turn chat sessions sharing one system prompt
  agentic   sessions whose turns append long tool outputs and short instructions
  switch    session switching A -> A -> B -> A (the session-switch prefix-cache regression; docs/kv_cache.md)
  random    independent random prompts, no reuse
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dsv4.engine.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Turn:
  session: str
  new_tokens: tuple[int, ...]
  params: SamplingParams
  rid: str = ""           # request id; default "<session>.t<wave>"
  expected: tuple[int, ...] | None = None   # the answer's leading tokens, if the workload knows it (graded)
  tenant: str = ""        # cache salt: turns of different tenants never share cached blocks


@dataclasses.dataclass(frozen=True)
class Workload:
  name: str
  waves: tuple[tuple[Turn, ...], ...]

  @property
  def num_requests(self) -> int:
    return sum(len(w) for w in self.waves)


def _toks(rng, n, vocab, low=2):
  return tuple(int(t) for t in rng.integers(low, vocab, int(n)))


def chat(vocab: int, *, sessions=4, turns=3, system_len=160, user_len=(16, 48), answer_len=(8, 24), seed=0):
  rng = np.random.default_rng(seed)
  system = _toks(rng, system_len, vocab)
  waves = []
  for t in range(turns):
    wave = []
    for s in range(sessions):
      new = (system if t == 0 else ()) + _toks(rng, rng.integers(*user_len), vocab)
      wave.append(Turn(f"chat{s}", new, SamplingParams(max_tokens=int(rng.integers(*answer_len)), ignore_eos=True)))
    waves.append(tuple(wave))
  return Workload("chat", tuple(waves))


def agentic(vocab: int, *, sessions=3, steps=3, task_len=96, tool_len=(64, 160), answer_len=(8, 16), seed=1):
  rng = np.random.default_rng(seed)
  waves = []
  for t in range(steps):
    wave = []
    for s in range(sessions):
      new = _toks(rng, task_len, vocab) if t == 0 else _toks(rng, rng.integers(*tool_len), vocab)
      wave.append(Turn(f"agent{s}", new, SamplingParams(max_tokens=int(rng.integers(*answer_len)), ignore_eos=True)))
    waves.append(tuple(wave))
  return Workload("agentic", tuple(waves))


def switch(vocab: int, *, prompt_len=300, user_len=24, answer_len=16, seed=2):
  rng = np.random.default_rng(seed)
  sp = SamplingParams(max_tokens=answer_len, ignore_eos=True)
  order = [("A", prompt_len), ("A", user_len), ("B", prompt_len), ("A", user_len)]
  return Workload("switch", tuple((Turn(s, _toks(rng, n, vocab), sp),) for s, n in order))


def random_prompts(vocab: int, *, requests=8, prompt_len=(32, 200), answer_len=(8, 24), seed=3):
  rng = np.random.default_rng(seed)
  wave = tuple(Turn(f"rand{i}", _toks(rng, rng.integers(*prompt_len), vocab),
                    SamplingParams(max_tokens=int(rng.integers(*answer_len)), ignore_eos=True))
               for i in range(requests))
  return Workload("random", (wave,))


KINDS = {"chat": chat, "agentic": agentic, "switch": switch, "random": random_prompts}


def make(kind: str, vocab: int, seed: int = 0, **kw) -> Workload:
  if kind not in KINDS:
    raise ValueError(f"workload: unknown kind {kind!r}; known: {sorted(KINDS)}")
  return KINDS[kind](vocab, seed=seed, **kw)

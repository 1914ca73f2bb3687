"""The four workload groups of the cluster matrix, as sessions whose next prompt depends on earlier outputs.

* chat:    multi-turn chat; every session of a tenant opens with that tenant's long system prompt; each turn
           appends the user's message to the whole history (prompts + answers).
* agent:   agent loops; each turn appends a tool result, and the agent re-renders its last turn (a marker token
           before the last answer), so reuse stops where the re-rendered turn starts.
* rag:     single questions over a pool of shared documents (public: every tenant may reuse them).
* control: unrelated random prompts (no reuse).

Token ids are drawn from [2, vocab) with fixed seeds, so every configuration sees the same trace."""

from __future__ import annotations

import dataclasses

import numpy as np

GROUPS = ("chat", "agent", "rag", "control")
RERENDER = 1            # the marker token of a re-rendered agent turn


@dataclasses.dataclass(frozen=True)
class Session:
  sid: str
  group: str
  tenant: str            # "" = public
  start_s: float         # arrival of the first turn (seconds after the phase starts)
  base: tuple[int, ...]  # system prompt / tool definitions / document
  turns: tuple[tuple[int, ...], ...]    # the new tokens of each turn (user message, tool result, question)
  think_s: float = 0.05  # a turn arrives this long after the previous one finished
  max_tokens: int = 8

  def prompt(self, k: int, outputs: list[list[int]]) -> list[int]:
    """Turn k's prompt given the answers of turns < k."""
    toks = list(self.base)
    for i in range(k):
      answer = outputs[i]
      if self.group == "agent" and i == k - 1:
        answer = [RERENDER] + list(answer)
      toks += list(self.turns[i]) + list(answer)
    return toks + list(self.turns[k])


@dataclasses.dataclass(frozen=True)
class WorkloadSizes:
  chat_sessions: int = 8
  chat_tenants: int = 2
  chat_system: int = 256
  chat_turns: int = 3
  chat_user: int = 40
  agent_sessions: int = 4
  agent_base: int = 192
  agent_turns: int = 3
  agent_tool: int = 48
  rag_docs: int = 3
  rag_doc: int = 320
  rag_requests: int = 12
  rag_question: int = 24
  control_requests: int = 10
  control_prompt: int = 300
  spacing_s: float = 0.25     # between session starts
  max_tokens: int = 8


def build(group: str, vocab: int, sizes: WorkloadSizes = WorkloadSizes(), seed: int = 0) -> list[Session]:
  if group not in GROUPS:
    raise ValueError(f"workload group: one of {', '.join(GROUPS)}, got {group!r}")
  rng = np.random.default_rng([seed, GROUPS.index(group)])

  def toks(n):
    return tuple(int(x) for x in rng.integers(2, vocab, n))

  s, out = sizes, []
  if group == "chat":
    systems = [toks(s.chat_system) for _ in range(s.chat_tenants)]
    for i in range(s.chat_sessions):
      t = i % s.chat_tenants
      out.append(Session(f"chat{i}", group, f"tenant{t}", i * s.spacing_s, systems[t],
                         tuple(toks(s.chat_user) for _ in range(s.chat_turns)), max_tokens=s.max_tokens))
  elif group == "agent":
    for i in range(s.agent_sessions):
      out.append(Session(f"agent{i}", group, f"agent{i}", i * s.spacing_s, toks(s.agent_base),
                         tuple(toks(s.agent_tool) for _ in range(s.agent_turns)), max_tokens=s.max_tokens))
  elif group == "rag":
    docs = [toks(s.rag_doc) for _ in range(s.rag_docs)]
    for i in range(s.rag_requests):
      d = int(rng.integers(0, s.rag_docs))
      out.append(Session(f"rag{i}", group, "", i * s.spacing_s, docs[d], (toks(s.rag_question),),
                         max_tokens=s.max_tokens))
  else:
    for i in range(s.control_requests):
      out.append(Session(f"ctl{i}", group, f"user{i}", i * s.spacing_s, toks(s.control_prompt), ((),),
                         max_tokens=s.max_tokens))
  return out

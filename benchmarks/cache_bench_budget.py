"""Round-robin chat sessions under a fixed KV byte budget: total hit tokens with cache v1 checkpoint placement
(prompt boundary + end of request) and with cache v2 placement (dense start, re-render, junction; the default).

The budget (bytes) is split between the two V4-Flash pools by `--full_share` and converted to blocks with the
groups' bytes per block (`dsv4.caches.group_specs`, default layout). S sessions share a 256-token system prompt;
each turn sends the whole history (+ a new user message), the chat template re-renders the last 8 tokens of the
previous prompt, and the answer is `answer` tokens. Sessions take turns round-robin for R rounds; each request is
admitted, prefilled in 512-token chunks, decoded (committed in one go), freed. Prints one row per budget.

    python -m benchmarks.cache_bench_budget
"""

from __future__ import annotations

import argparse

import numpy as np

from cache.hashing import ExtraKeys
from cache.manager import KVCacheManager
from dsv4.caches import group_specs
from dsv4.config import v4_flash

V1 = dict(dense_start=False, rerender_tokens=0, junction_checkpoints=False)


def run(specs, n_full: int, n_swa: int, sessions: int, rounds: int, answer: int, user: int, v1: bool, seed=0):
  rng = np.random.default_rng(seed)
  m = KVCacheManager(specs, num_full_blocks=n_full, num_swa_blocks=n_swa, enable_events=False, **(V1 if v1 else {}))
  sys = rng.integers(2, 1000, 256)
  hist = [sys.copy() for _ in range(sessions)]
  total, last_round, computed = 0, 0, 0
  for r in range(rounds):
    for s in range(sessions):
      h = hist[s]
      if r > 0:   # the template re-renders the last 8 tokens of the previous prompt
        h = np.concatenate([h[:-8], rng.integers(2, 1000, 8)])
      prompt = np.concatenate([h, rng.integers(2, 1000, user)])
      rid = f"s{s}.{r}"
      hit = m.add_request(rid, prompt, ExtraKeys()).num_tokens
      n = hit
      while n < len(prompt):
        c = min(512, len(prompt) - n)
        if not m.allocate_for(rid, c):
          raise RuntimeError(f"budget too small: {rid} cannot allocate")
        n += c
        m.commit(rid, n)
      ans = rng.integers(2, 1000, answer)
      m.append_tokens(rid, ans)
      if not m.allocate_for(rid, answer):
        raise RuntimeError(f"budget too small: {rid} cannot allocate its answer")
      m.commit(rid, n + answer)
      m.free(rid)
      hist[s] = np.concatenate([prompt, ans])
      total += hit
      computed += len(prompt) - hit
      if r == rounds - 1:
        last_round += hit
  return total, last_round, computed


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--sessions", type=int, default=8)
  ap.add_argument("--rounds", type=int, default=6)
  ap.add_argument("--answer", type=int, default=150)
  ap.add_argument("--user", type=int, default=300)
  ap.add_argument("--full_share", type=float, default=0.5, help="fraction of the byte budget given to the full pool")
  ap.add_argument("--budgets_gib", default="1,2,4,8")
  a = ap.parse_args()
  specs = group_specs(v4_flash())
  bpb = {g.name: g.bytes_per_block for g in specs.groups}
  print(f"V4-Flash bytes per block: full {bpb['full'] / 2**20:.2f} MiB, swa {bpb['swa'] / 2**20:.2f} MiB; "
        f"{a.sessions} sessions x {a.rounds} rounds, user {a.user} + answer {a.answer} tokens per turn, "
        f"full share {a.full_share}")
  print("| budget GiB | full blocks | swa blocks | v1 total hit tokens | v2 total hit tokens | v1 last round | "
        "v2 last round | v1 computed | v2 computed |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  for gib in [float(x) for x in a.budgets_gib.split(",")]:
    budget = gib * 2**30
    nf = int(budget * a.full_share // bpb["full"])
    ns = int(budget * (1 - a.full_share) // bpb["swa"])
    row = []
    for v1 in (True, False):
      try:
        row.append(run(specs, nf, ns, a.sessions, a.rounds, a.answer, a.user, v1))
      except RuntimeError as e:
        row.append(None)
        print(f"({'v1' if v1 else 'v2'} at {gib} GiB: {e})")
    if None in row:
      continue
    (t1, l1, c1), (t2, l2, c2) = row
    print(f"| {gib:g} | {nf} | {ns} | {t1} | {t2} | {l1} | {l2} | {c1} | {c2} |", flush=True)


if __name__ == "__main__":
  main()

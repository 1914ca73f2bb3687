"""Per-configuration metrics of a cluster run: latency percentiles, goodput at the SLO, prefix-hit tokens, P/D
transfer, recompute, fallbacks, tier traffic."""

from __future__ import annotations

import numpy as np


def _pct(xs, q):
  return float(np.percentile(xs, q)) if len(xs) else float("nan")


def summarize(run: dict, slo) -> dict:
  reqs, st = run["requests"], run["stats"]
  ttft = [r["first_token_time"] - r["arrival"] for r in reqs]
  e2e = [r["token_times"][-1] - r["arrival"] for r in reqs if r["token_times"]]
  tpot = [(r["token_times"][-1] - r["token_times"][0]) / (len(r["token_times"]) - 1)
          for r in reqs if len(r["token_times"]) > 1]
  itl = [b - a for r in reqs for a, b in zip(r["token_times"], r["token_times"][1:])]
  good = 0
  for r, t in zip(reqs, ttft):
    tt = r["token_times"]
    tp = (tt[-1] - tt[0]) / (len(tt) - 1) if len(tt) > 1 else 0.0
    good += int(t <= slo.ttft_s and tp <= slo.tpot_s)
  tb = [r["transfer_bytes"] for r in reqs if "transfer_bytes" in r]
  ts = [r["transfer_s"] for r in reqs if "transfer_s" in r]
  reps = st.get("replicas", {}).values()
  tier = lambda k: int(sum(v["tiering"].get(k, 0) for v in reps))   # noqa: E731
  out = {"requests": len(reqs), "wall_s": st["wall_s"]}
  for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
    for q in (50, 95, 99):
      out[f"{name}_p{q}_s"] = _pct(xs, q)
  out.update({
      "goodput_rps": good / max(st["wall_s"], 1e-9), "slo_attained": good / max(len(reqs), 1),
      "hit_tokens": int(sum(r["hit_tokens"] for r in reqs)),
      "prompt_tokens": int(sum(r["prompt_len"] for r in reqs)),
      "transfers": len(tb), "transfer_bytes_mean": float(np.mean(tb)) if tb else 0.0,
      "transfer_s_p50": _pct(ts, 50), "transfer_failures": st["transfer_failures"] + st["receive_failures"],
      "fallbacks": st["fallbacks"], "reprefilled": st["reprefilled"], "rerouted": st["rerouted"],
      "recomputed_tokens": int(sum(r.get("recomputed_tokens", 0) for r in reqs)),
      "decode_prompt_tokens": int(sum(r.get("decode_prompt_tokens_computed", 0) for r in reqs)),
      "tier_chose_recompute": tier("chose_recompute"), "demotions": tier("demoted_blocks"),
      "promotions": tier("loaded_records"), "tier_hit_tokens": tier("tier_hit_tokens"),
      "directory_errors": st["router"].get("directory_errors", 0)})
  return out

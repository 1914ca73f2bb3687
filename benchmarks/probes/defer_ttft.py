"""Cost of in-batch shared-prefix deferral (EngineConfig.defer_shared_prefix) on a cold wave: sessions that share
only a system prompt, all queued before the first step. Prints per request: prefix hit, the step of its admission
and of its first token (time-to-first-token in engine steps, counted from step 1), tokens computed; with deferral on
and off, on the same trace and config (tiny V4 model, CPU).

    python -m benchmarks.probes.defer_ttft [--sessions 3 --system_len 256 --user_len 300 --chunk 64 --budget 192]
"""

from __future__ import annotations

import dataclasses

import jax
from absl import app, flags

from dsv4 import config
from dsv4 import model
from dsv4.engine import workloads
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine

FLAGS = flags.FLAGS


def run(params, cfg, ec, wl):
  eng = Engine(params, cfg, ec)
  eng.clock = lambda: eng.stats["steps"] + 1        # first_token_time = the (1-based) step that sampled it
  for t in wl.waves[0]:
    eng.add_request(t.session, list(t.new_tokens), t.params, arrival=0)
  admitted = {}
  while eng.has_work():
    eng.step()
    for r in eng.running:
      admitted.setdefault(r.rid, eng.stats["steps"])
  return eng, admitted


def define_flags():
  flags.DEFINE_integer("sessions", 3, "sessions in the cold wave")
  flags.DEFINE_integer("system_len", 256, "shared system-prompt tokens")
  flags.DEFINE_integer("user_len", 300, "own user tokens per session (about)")
  flags.DEFINE_integer("chunk", 64, "prefill chunk (EngineConfig.chunk_size)")
  flags.DEFINE_integer("budget", 192, "token budget per step (EngineConfig.max_num_batched_tokens)")
  flags.DEFINE_integer("seed", 4, "workload seed")


def main(argv):
  del argv
  a = FLAGS
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  wl = workloads.chat(cfg.vocab_size, sessions=a.sessions, turns=1, system_len=a.system_len,
                      user_len=(a.user_len, a.user_len + 41), answer_len=(4, 6), seed=a.seed)
  ec = EngineConfig(max_num_seqs=max(4, a.sessions), max_num_batched_tokens=a.budget, chunk_size=a.chunk,
                    max_model_len=2048, num_full_blocks=96, num_swa_blocks=320)
  print(f"v4_tiny, {a.sessions} sessions x ({a.system_len} shared + ~{a.user_len} own) tokens, chunk {a.chunk}, "
        f"budget {a.budget} tokens/step, max_num_seqs {ec.max_num_seqs}")
  print("| deferral | request | prompt | hit | admitted at step | first token at step | computed tokens |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for on in (False, True):
    eng, admitted = run(params, cfg, dataclasses.replace(ec, defer_shared_prefix=on), wl)
    for rid, r in eng.requests.items():
      print(f"| {'on' if on else 'off'} | {rid} | {len(r.prompt)} | {r.hit_tokens} | {admitted[rid]} | "
            f"{int(r.first_token_time)} | {r.computed_tokens} |")
    print(f"| {'on' if on else 'off'} | all | | {sum(r.hit_tokens for r in eng.requests.values())} | | "
          f"last {max(int(r.first_token_time) for r in eng.requests.values())} | {eng.stats['computed_tokens']} "
          f"(steps {eng.stats['steps']}, deferred request-steps {eng.stats['deferred_steps']}) |")


if __name__ == "__main__":
  define_flags()
  app.run(main)

"""Main job: batch offline inference through the paged hybrid cache with prefix reuse, every answer graded.

    python -m experiments.serve                          # shipped v4_retrieval model, recall sessions, CPU
    python -m experiments.serve --model=v41_retrieval    # or v4_count (its own counting task)
    python -m experiments.serve --requests=reqs.jsonl    # one JSON object per line, see dsv4/engine/schema.py:
        {"id": "a", "prompt": [0, 5, ...], "max_tokens": 1, "expected": [41], "tenant": "t1", "session": "s1", ...}
    python -m experiments.serve --model_api=nnx          # the same job through the Flax NNX modules (dsv4/nnx_model.py)
    python -m experiments.serve --kv_tiers=host,disk --kv_disk_dir=/tmp/kv   # KV tiers: a later run loads what this
                                                         # one stored (--kv_store_url=redis://... for a shared store)
    python -m experiments.serve --mesh=data:2,tensor:2,expert:2      # sharded step (CPU: 8 host devices)
    # one process per host under jax.distributed (here: 2 processes x 4 CPU devices on one machine)
    python -m experiments.serve --mesh=data:2,tensor:2,expert:2 --num_cpu_devices=4 \
        --coordinator=127.0.0.1:12345 --num_processes=2 --process_id=0 --out_dir=out/p0   # and process_id=1

The default workload ("task") asks the model questions in its own training format (experiments/task_workloads.py):
multi-turn sessions over long shared documents, so prefix reuse happens naturally and each output is graded
against the expected answer. Writes <out_dir>/outputs.jsonl and <out_dir>/metrics.json, and prints a summary table
with the accuracy beside the cache figures.

outputs.jsonl: one line per request with the expected answer and per-request errors. Lines are appended (and
flushed) as requests end, refused ones first, so a run killed midway keeps every finished answer (then in finish
order; each line has its `id` and, from a --requests file, its 1-based `line`); at the end the file is rewritten in
input order. metrics.json is strict JSON (no NaN: a statistic with no sample is null). TTFT percentiles leave out
requests that waited on an XLA compilation (`ttft_compiling_requests` of them; `compile_s` is the compile time).

Flags: the job's own (experiments/serve_options.py: ServeOptions) and the engine's, one per EngineConfig field
(dsv4/engine/config.py) with that field's default and help, except where serve_options.ENGINE_FLAG_OVERRIDES says
otherwise. The job itself is `experiments.serve_lib.run(options)`, callable from a notebook.

Exit codes: 2 = a mistake in the flags (a missing --requests file or --checkpoint directory, a bad tier setting,
an unreachable tier with --kv_tiers_strict), found before the model loads; 1 = the model failed to load (the
message names the file), never a fallback. Both are one line on stderr.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging

from experiments import serve_lib, serve_options
from experiments.serve_checks import ServeError
from experiments.serve_model import ModelLoadError

FLAGS = flags.FLAGS
serve_options.define_flags(FLAGS)


def _die(msg: str, code: int = 2):
  print(f"serve: {msg}", file=sys.stderr, flush=True)
  sys.exit(code)


def _parse_flags(argv):
  """absl's flag parsing, but a bad flag is one line and exit code 2 like every other usage mistake."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    _die(f"{' '.join(str(e).split())} (--helpfull lists the flags)")


def main(argv):
  del argv
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)      # orbax logs INFO lines on every restore; --verbosity=0 shows them
  try:
    serve_lib.run(serve_options.options_from_flags(FLAGS))
  except ModelLoadError as e:
    _die(f"cannot load the model: {e}", e.exit_code)
  except ServeError as e:
    _die(str(e), e.exit_code)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)

"""Main job: batch offline inference through the paged hybrid cache with prefix reuse.

    python -m experiments.serve                       # embedded default: tiny V4 model, chat workload, CPU
    python -m experiments.serve --workload=switch --retention_interval=128
    python -m experiments.serve --requests=reqs.jsonl # {"id": ..., "prompt": [ids], "max_tokens": ..., ...}

Writes <out_dir>/outputs.jsonl and <out_dir>/metrics.json and prints a summary table.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_enum("workload", "chat", ["chat", "agentic", "switch", "random"], "Generated workload kind.")
flags.DEFINE_string("requests", "", "JSONL of requests; overrides --workload.")
flags.DEFINE_string("out_dir", "out/serve", "Where outputs.jsonl and metrics.json go.")
flags.DEFINE_string("checkpoint", "auto", "'auto' = shipped trained tiny model if present, else random weights; "
                    "'random' = random tiny V4; or a path to an orbax params dir (with --preset).")
flags.DEFINE_string("preset", "v4_tiny", "Model preset when --checkpoint is random or a path.")
flags.DEFINE_integer("seed", 0, "Seed for random weights and workloads.")
flags.DEFINE_bool("prefix_caching", True, "Reuse cached prefixes.")
flags.DEFINE_integer("retention_interval", 0, "Keep an SWA checkpoint every N tokens (0 = boundaries only).")
flags.DEFINE_integer("chunk_size", 64, "Longest prefill chunk per request per step.")
flags.DEFINE_integer("max_num_seqs", 8, "Rows per step.")
flags.DEFINE_integer("max_num_batched_tokens", 512, "Token budget per step.")
flags.DEFINE_integer("max_model_len", 2048, "Longest request (prompt + output).")
flags.DEFINE_integer("num_full_blocks", 128, "Full-history blocks (128 tokens each).")
flags.DEFINE_integer("num_swa_blocks", 256, "SWA blocks (32 tokens each).")
flags.DEFINE_string("kv_tiers", "", "KV tiers below the device, fastest first, e.g. 'host,disk,redis' "
                    "(host, disk, redis, mooncake; '' = device only).")
flags.DEFINE_string("kv_disk_dir", "", "Directory of the disk tier (one file per record).")
flags.DEFINE_string("kv_store_url", "", "Shared store of the redis / mooncake tier: redis://127.0.0.1:6379/0 or "
                    "mooncake://127.0.0.1:<rpc port>?metadata=http://127.0.0.1:<port>/metadata.")
flags.DEFINE_string("compilation_cache_dir", "~/.cache/dsv4/jax", "Persistent XLA compilation cache ('' = off): "
                    "the step programs compile once per machine instead of once per run.")


def load_model(checkpoint: str, preset: str, seed: int):
  import jax

  from dsv4 import config as C
  from dsv4 import model
  if checkpoint == "auto":
    try:
      from experiments import train_lib
      return train_lib.load_trained("v4_retrieval")
    except Exception:  # no shipped checkpoint in this checkout: fall back to random weights
      checkpoint = "random"
  cfg = C.get_preset(preset)
  if checkpoint == "random":
    return cfg, model.init_params(cfg, jax.random.PRNGKey(seed))
  from dsv4.loading import orbax_io
  return cfg, orbax_io.restore_params(checkpoint, cfg)


def read_requests(path: str):
  from dsv4.engine.sampling import SamplingParams
  from dsv4.engine.workloads import Turn, Workload
  turns = []
  with open(path) as f:
    for i, line in enumerate(f):
      if not line.strip():
        continue
      d = json.loads(line)
      sp = SamplingParams(max_tokens=int(d.get("max_tokens", 16)), temperature=float(d.get("temperature", 0.0)),
                          top_k=int(d.get("top_k", 0)), top_p=float(d.get("top_p", 1.0)),
                          seed=int(d.get("seed", 0)), stop_token_ids=tuple(d.get("stop_token_ids", ())),
                          ignore_eos=bool(d.get("ignore_eos", False)))
      rid = str(d.get("id", f"line{i}"))
      turns.append(Turn(rid, tuple(d.get("prompt", ())), sp, rid=rid))
  return Workload(os.path.basename(path), (tuple(turns),))


def format_table(summary: dict) -> str:
  rows = [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in summary.items()]
  w = max(len(k) for k, _ in rows)
  line = "+" + "-" * (w + 2) + "+" + "-" * 14 + "+"
  return "\n".join([line] + [f"| {k:<{w}} | {v:>12} |" for k, v in rows] + [line])


def main(argv):
  del argv
  from tqdm import tqdm

  from dsv4.engine import workloads
  from dsv4.engine.api import run_workload
  from dsv4.engine.engine import Engine, EngineConfig
  from dsv4.engine.tiering import TieringConfig
  if FLAGS.compilation_cache_dir:
    import jax
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(FLAGS.compilation_cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  cfg, params = load_model(FLAGS.checkpoint, FLAGS.preset, FLAGS.seed)
  ec = EngineConfig(max_num_seqs=FLAGS.max_num_seqs, max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                    chunk_size=FLAGS.chunk_size, max_model_len=FLAGS.max_model_len,
                    num_full_blocks=FLAGS.num_full_blocks, num_swa_blocks=FLAGS.num_swa_blocks,
                    enable_prefix_caching=FLAGS.prefix_caching, retention_interval=FLAGS.retention_interval,
                    model_id=cfg.name,
                    tiering=TieringConfig.from_flags(FLAGS.kv_tiers, FLAGS.kv_disk_dir, FLAGS.kv_store_url))
  wl = read_requests(FLAGS.requests) if FLAGS.requests else workloads.make(FLAGS.workload, cfg.vocab_size,
                                                                             seed=FLAGS.seed)
  engine = Engine(params, cfg, ec)
  with tqdm(total=wl.num_requests, desc=f"{cfg.name} {wl.name}", unit="req") as bar:
    report = run_workload(engine, wl, progress=bar.update)
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  with open(os.path.join(FLAGS.out_dir, "outputs.jsonl"), "w") as f:
    for o in report.outputs:
      f.write(json.dumps({"id": o.rid, "prompt_len": len(o.prompt), "output": o.output, "finish_reason":
                          o.finish_reason, "error": o.error, "hit_tokens": o.hit_tokens}) + "\n")
  summary = report.summary()
  summary["compiled_step_shapes"] = len(engine.runner.shapes_run)
  tiers = None
  if engine.tiering is not None:
    engine.tiering.flush()
    tiers = engine.tiering.summary()
    summary["tier_hit_tokens"] = tiers["tier_hit_tokens"]
    for t in tiers["tiers"]:
      for k in ("hit_tokens", "bytes_read", "bytes_written", "load_ms_p50", "load_ms_p99", "rejected", "failures"):
        summary[f"{t['tier']}_{k}"] = t.get(k, 0)
    engine.tiering.close()
  with open(os.path.join(FLAGS.out_dir, "metrics.json"), "w") as f:
    json.dump({"model": cfg.name, "workload": wl.name, "engine": {k: str(v) for k, v in vars(ec).items()},
               "summary": summary, "tiers": tiers}, f, indent=2, default=str)
  for o in report.outputs:
    if o.error:
      print(f"request {o.rid}: error: {o.error}")
  print(format_table(summary))


if __name__ == "__main__":
  app.run(main)

"""Main job: batch offline inference through the paged hybrid cache with prefix reuse, every answer graded.

    python -m experiments.serve                          # shipped v4_retrieval model, recall sessions, CPU
    python -m experiments.serve --model=v41_retrieval    # or v4_count (its own counting task)
    python -m experiments.serve --requests=reqs.jsonl    # one JSON object per line, see dsv4/engine/schema.py:
        {"id": "a", "prompt": [0, 5, ...], "max_tokens": 1, "expected": [41], "tenant": "t1", "session": "s1", ...}
    python -m experiments.serve --model_api=nnx          # the same job through the Flax NNX modules (dsv4/nnx_model.py)
    python -m experiments.serve --mesh=data:2,tensor:2,expert:2      # sharded step (CPU: 8 host devices)
    # one process per host under jax.distributed (here: 2 processes x 4 CPU devices on one machine)
    python -m experiments.serve --mesh=data:2,tensor:2,expert:2 --num_cpu_devices=4 \
        --coordinator=127.0.0.1:12345 --num_processes=2 --process_id=0 --out_dir=out/p0   # and process_id=1

The default workload ("task") asks the model questions in its own training format (experiments/task_workloads.py):
multi-turn sessions over long shared documents, so prefix reuse happens naturally and each output is graded
against the expected answer. Writes <out_dir>/outputs.jsonl (one line per request, in input order, with the expected
answer and per-request errors) and <out_dir>/metrics.json, and prints a summary table with the accuracy beside the
cache figures. A model that fails to load is an error (exit code 1, the message names the file), never a fallback.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging

SHIPPED_MODELS = ("v4_retrieval", "v41_retrieval", "v4_count")

FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "v4_retrieval", [*SHIPPED_MODELS, "random"],
                  "Shipped trained model (experiments/checkpoints/<name>), or 'random' = random weights of --preset.")
flags.DEFINE_string("checkpoint", "", "Overrides --model: a release checkpoint directory (config.json + safetensors "
                    "shards in any naming + tokenizer.json; requests may then give text prompts, chat 'messages' "
                    "and 'stop' strings), a directory written by experiments.train (config.json + params/), or an "
                    "orbax params directory (config from --preset).")
flags.DEFINE_string("preset", "v4_tiny", "Model preset for --model=random or an orbax params --checkpoint.")
flags.DEFINE_enum("workload", "task", ["task", "chat", "agentic", "switch", "random"],
                  "'task' = graded sessions in the model's own task format; the others send random tokens "
                  "(cache behaviour only, nothing to grade).")
flags.DEFINE_string("requests", "", "JSONL of requests; overrides --workload.")
flags.DEFINE_string("out_dir", "out/serve", "Where outputs.jsonl and metrics.json go.")
flags.DEFINE_integer("seed", 0, "Seed for random weights and workloads.")
flags.DEFINE_bool("prefix_caching", True, "Reuse cached prefixes.")
flags.DEFINE_integer("retention_interval", 0, "Keep an SWA checkpoint every N tokens inside a request (0 = only at "
                     "prompt boundaries and request ends); must be a multiple of 128 (the full-attention block).")
flags.DEFINE_integer("chunk_size", 64, "Longest prefill chunk per request per step.")
flags.DEFINE_integer("max_num_seqs", 8, "Rows per step.")
flags.DEFINE_integer("max_num_batched_tokens", 512, "Token budget per step.")
flags.DEFINE_enum("token_bucket_growth", "4", ["2", "4"], "Token buckets of the ragged step grow by this factor "
                  "(EngineConfig.token_bucket_growth).")
flags.DEFINE_integer("token_bucket_steps", 1, "Buckets per growth interval, 1..8 (EngineConfig.token_bucket_steps): "
                     "more = less padding of mixed steps, more compiled programs.")
flags.DEFINE_integer("max_model_len", 2048, "Longest request (prompt + output).")
flags.DEFINE_integer("num_full_blocks", 128, "Full-history blocks (128 tokens each).")
flags.DEFINE_integer("num_swa_blocks", 256, "SWA blocks (32 tokens each).")
flags.DEFINE_bool("batch_invariant", False, "Bitwise-reproducible logits whatever shares a step and however a "
                  "prompt is chunked (every token runs one fixed-shape program; slower).")
flags.DEFINE_enum("kv_dtype", "fp32", ["fp32", "bf16", "fp8"], "Storage of the KV pools: fp32, bf16, or fp8 (the "
                  "V4 584-byte record for window + compressed KV; index keys bf16); compressor state stays fp32.")
flags.DEFINE_enum("dtype", "fp32", ["fp32", "bf16"], "Compute dtype of params / activations (fp32 norms, softmaxes "
                  "and logits in bf16).")
flags.DEFINE_enum("model_api", "functional", ["functional", "nnx"], "Run the model step through dsv4.model's "
                  "functions (default) or through the Flax NNX modules of dsv4.nnx_model (one device, same math).")
flags.DEFINE_string("mesh", "", "Device mesh for the model step, e.g. data:2,tensor:2,expert:2 ('' = one device).")
flags.DEFINE_enum("kv_latent", "replicated", ["replicated", "feature"], "Shard the K=V latent pools over tensor?")
flags.DEFINE_bool("pools_over_data", True, "With --mesh: one KV block pool (and cache manager) per data shard, the "
                  "pools split over `data` (false: one pool replicated over `data`).")
flags.DEFINE_integer("num_cpu_devices", 0, "On the CPU: host devices per process (0 = the mesh size with --mesh in "
                     "one process, else JAX's default).")
flags.DEFINE_string("coordinator", "", "host:port of the jax.distributed coordinator ('' = single process).")
flags.DEFINE_integer("num_processes", 1, "Processes under jax.distributed.")
flags.DEFINE_integer("process_id", 0, "This process's id under jax.distributed.")
flags.DEFINE_string("kv_tiers", "", "KV tiers below the device, fastest first, e.g. 'host,disk,redis' "
                    "(host, disk, redis, mooncake; '' = device only).")
flags.DEFINE_string("kv_disk_dir", "", "Directory of the disk tier (one file per record).")
flags.DEFINE_string("kv_store_url", "", "Shared store of the redis / mooncake tier: redis://127.0.0.1:6379/0 or "
                    "mooncake://127.0.0.1:<rpc port>?metadata=http://127.0.0.1:<port>/metadata.")
flags.DEFINE_string("compilation_cache_dir", "", "Persistent XLA compilation cache directory (opt-in; '' = off): "
                    "the step programs then compile once per machine instead of once per run.")


class ModelLoadError(Exception):
  """The requested model could not be loaded; the message names the file."""


def load_model(model: str, checkpoint: str = "", preset: str = "v4_tiny", seed: int = 0):
  """(config, params, task spec or None). Any failure is a ModelLoadError naming the file: never random weights
  in place of a model that was asked for."""
  import jax

  from dsv4 import config as C
  from dsv4 import model as M
  from dsv4.loading.safetensors_io import CheckpointError
  from experiments import train_lib
  if not checkpoint and model == "random":
    cfg = C.get_preset(preset)
    return cfg, M.init_params(cfg, jax.random.PRNGKey(seed)), None
  directory = checkpoint or os.path.join(train_lib.CHECKPOINT_ROOT, model)
  info_path = os.path.join(directory, "config.json")
  try:
    if checkpoint and _is_pretrained_dir(checkpoint):       # config.json + safetensors (any naming) + tokenizer
      from dsv4.config import ConfigError
      from dsv4.loading.pretrained import load_pretrained
      try:
        pre = load_pretrained(checkpoint)
      except ConfigError as e:
        raise ModelLoadError(str(e)) from e
      return pre.config, pre.params, None
    if checkpoint and not os.path.isdir(os.path.join(checkpoint, "params")):   # a bare orbax params directory
      from dsv4.loading import orbax_io
      return C.get_preset(preset), orbax_io.restore_params(checkpoint, C.get_preset(preset)), None
    if not os.path.isdir(directory):
      raise ModelLoadError(f"{directory}: no such checkpoint directory")
    try:
      with open(info_path) as f:
        info = json.load(f)
      cfg = train_lib.config_from_dict(info["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ModelLoadError(f"{info_path}: unreadable checkpoint config ({type(e).__name__}: {e})") from e
    from dsv4.loading import orbax_io
    params = orbax_io.restore_params(os.path.join(directory, "params"), cfg)
    spec = train_lib.task_spec_from_info(info) if "task" in info else None
    return cfg, params, spec
  except CheckpointError as e:
    raise ModelLoadError(str(e)) from e


def _is_pretrained_dir(path: str) -> bool:
  """A checkpoint directory in a release layout (not one written by experiments.train): config.json beside
  safetensors shards."""
  return (os.path.isfile(os.path.join(path, "config.json")) and not os.path.isdir(os.path.join(path, "params"))
          and any(f.endswith(".safetensors") or f.endswith(".safetensors.index.json") for f in os.listdir(path)))


def load_tokenizer(checkpoint: str):
  """The checkpoint dir's tokenizer (tokenizer.json + tokenizer_config.json chat template), or None."""
  if not checkpoint or not os.path.isfile(os.path.join(checkpoint, "tokenizer.json")):
    return None
  from dsv4.loading.tokenizer import Tokenizer
  return Tokenizer.from_dir(checkpoint)


def read_requests(path: str, vocab_size: int, tokenizer=None):
  """JSONL -> (Workload of the valid requests, [(line index, id, error)] of the refused ones, order).

  Every line is checked by the one request schema; a bad line (malformed JSON, unknown key, wrong type or range,
  duplicate id, including a collision with a default `line{i}` id) is refused on its own and the rest are served.
  Turns of one (tenant, session) run in file order, one wave each; requests without a session are independent.
  `order` lists ("ok", id) / ("refused", k) per non-blank line, in file order."""
  from dsv4.engine import schema
  from dsv4.engine.workloads import Turn, Workload
  refused, order, seen, stops = [], [], {}, {}
  waves: list[list[Turn]] = []
  turns_of: dict[tuple[str, str], int] = {}
  with open(path) as f:
    lines = f.read().splitlines()
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    default_id, d = f"line{i}", None
    try:
      try:
        d = json.loads(line)
      except ValueError as e:
        raise schema.RequestError(f"not valid JSON ({e})") from e
      spec = schema.parse_request(d, vocab_size=vocab_size, default_id=default_id, tokenizer=tokenizer)
      if spec.id in seen:
        how = "id" if "id" in d else "default id"
        raise schema.RequestError(f"{how} {spec.id!r} is already used by line {seen[spec.id]}; ids must be unique")
    except schema.RequestError as e:
      rid = d["id"] if isinstance(d, dict) and isinstance(d.get("id"), str) else default_id
      order.append(("refused", len(refused)))
      refused.append((i, rid, str(e)))
      continue
    seen[spec.id] = i
    if spec.session:
      key = (spec.tenant, spec.session)
      w = turns_of.get(key, 0)
      turns_of[key] = w + 1
      session = spec.session
    else:
      w, session = 0, ""
    while len(waves) <= w:
      waves.append([])
    waves[w].append(Turn(session, spec.prompt, spec.params, rid=spec.id, expected=spec.expected,
                         tenant=spec.tenant))
    if spec.stop:
      stops[spec.id] = spec.stop
    order.append(("ok", spec.id))
  return Workload(os.path.basename(path), tuple(tuple(w) for w in waves)), refused, order, stops


def format_table(summary: dict) -> str:
  rows = [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in summary.items()]
  w = max(len(k) for k, _ in rows)
  line = "+" + "-" * (w + 2) + "+" + "-" * 14 + "+"
  return "\n".join([line] + [f"| {k:<{w}} | {v:>12} |" for k, v in rows] + [line])


def init_devices():
  """CPU device count and jax.distributed must be set up before JAX touches a backend."""
  import jax
  n_cpu = FLAGS.num_cpu_devices
  if FLAGS.mesh and not n_cpu and not FLAGS.coordinator:
    import math

    from dsv4 import sharding
    n_cpu = math.prod(sharding.parse_mesh_spec(FLAGS.mesh).values())  # only the CPU backend reads this
  if n_cpu:
    jax.config.update("jax_num_cpu_devices", n_cpu)
  if FLAGS.coordinator:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process collectives on the CPU
    jax.distributed.initialize(FLAGS.coordinator, num_processes=FLAGS.num_processes, process_id=FLAGS.process_id)


def main(argv):
  del argv
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)      # orbax logs INFO lines on every restore; --verbosity=0 shows them
  if FLAGS.retention_interval < 0 or FLAGS.retention_interval % 128:
    raise app.UsageError(f"--retention_interval={FLAGS.retention_interval}: must be 0 or a positive multiple of "
                         "128 (the full-attention block size)")
  if FLAGS.model_api == "nnx" and (FLAGS.mesh or FLAGS.batch_invariant):
    raise app.UsageError("--model_api=nnx runs the one-device ragged step: drop --mesh / --batch_invariant (those "
                         "steps use dsv4.model)")
  from tqdm import tqdm

  init_devices()

  from dsv4.engine import workloads
  from dsv4.engine.api import WorkloadReport, grade, run_workload
  from dsv4.engine.engine import Engine, EngineConfig
  from dsv4.engine.request import RequestOutput
  from experiments import task_workloads
  from experiments.tasks import KVRecallSpec
  from dsv4.engine.tiering import TieringConfig
  import jax.numpy as jnp

  from dsv4 import caches
  if FLAGS.compilation_cache_dir:
    import jax
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(FLAGS.compilation_cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  try:
    cfg, params, spec = load_model(FLAGS.model, FLAGS.checkpoint, FLAGS.preset, FLAGS.seed)
  except ModelLoadError as e:
    sys.exit(f"serve: cannot load the model: {e}")
  ec = EngineConfig(max_num_seqs=FLAGS.max_num_seqs, max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                    chunk_size=FLAGS.chunk_size, max_model_len=FLAGS.max_model_len,
                    num_full_blocks=FLAGS.num_full_blocks, num_swa_blocks=FLAGS.num_swa_blocks,
                    enable_prefix_caching=FLAGS.prefix_caching, retention_interval=FLAGS.retention_interval,
                    model_id=cfg.name, batch_invariant=FLAGS.batch_invariant,
                    layout=caches.CacheLayout(kv_dtype={"fp32": jnp.float32, "bf16": jnp.bfloat16,
                                                        "fp8": caches.FP8}[FLAGS.kv_dtype]), dtype=FLAGS.dtype,
                    tiering=TieringConfig.from_flags(FLAGS.kv_tiers, FLAGS.kv_disk_dir, FLAGS.kv_store_url),
                    model_api=FLAGS.model_api, token_bucket_growth=int(FLAGS.token_bucket_growth),
                    token_bucket_steps=FLAGS.token_bucket_steps)
  refused, order, stops = [], None, {}
  tok = load_tokenizer(FLAGS.checkpoint)
  if FLAGS.requests:
    wl, refused, order, stops = read_requests(FLAGS.requests, cfg.vocab_size, tok)
  elif FLAGS.workload == "task":
    # A model without a task (random weights) is asked the recall task: its accuracy shows it knows nothing.
    wl = task_workloads.for_task(spec if spec is not None else KVRecallSpec(), seed=FLAGS.seed)
  else:
    wl = workloads.make(FLAGS.workload, cfg.vocab_size, seed=FLAGS.seed)
  mesh = rules = None
  if FLAGS.mesh:
    from dsv4 import sharding
    mesh, rules = sharding.make_mesh(FLAGS.mesh), sharding.Rules(kv_latent=FLAGS.kv_latent)
  engine = Engine(params, cfg, ec, mesh=mesh, rules=rules, pools_over_data=FLAGS.pools_over_data)
  with tqdm(total=wl.num_requests + len(refused), desc=f"{cfg.name} {wl.name}", unit="req") as bar:
    bar.update(len(refused))
    report = run_workload(engine, wl, progress=bar.update)
  # Requests refused at the door join the report in input order, as error outputs that never reached the engine.
  rows = [dict(id=o.rid, out=o, expected=e) for o, e in zip(report.outputs, report.expected)]
  if order is not None:
    by_id = {r["id"]: r for r in rows}
    rows = []
    for kind, key in order:
      if kind == "ok":
        rows.append(by_id[key])
      else:
        line, rid, err = refused[key]
        rows.append(dict(id=rid, line=line, out=RequestOutput(rid, [], [], "error", err, 0, 0, 0, 0, None, None),
                         expected=None))
    report = WorkloadReport([r["out"] for r in rows], report.wall_s, report.stats, report.peak_blocks,
                            [r["expected"] for r in rows])
  tenant_session = {t.rid or f"{t.session}.t{w}": (t.tenant, t.session) for w, wave in enumerate(wl.waves)
                    for t in wave}
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  with open(os.path.join(FLAGS.out_dir, "outputs.jsonl"), "w") as f:
    for r in rows:
      o, exp = r["out"], r["expected"]
      rec = {"id": o.rid, "prompt_len": len(o.prompt), "output": o.output,
             "expected": None if exp is None else list(exp),
             "correct": None if o.error is not None else grade(o.output, exp),
             "finish_reason": o.finish_reason, "error": o.error, "hit_tokens": o.hit_tokens}
      if "line" in r:
        rec["line"] = r["line"]
      if tok is not None and o.error is None:  # text, cut at the first stop string (checked after generation)
        text = tok.decode(o.output)
        hits = [text.find(x) for x in stops.get(o.rid, ()) if x and x in text]
        if hits:
          text, rec["finish_reason"] = text[: min(hits)], "stop"
        rec["text"] = text
      if o.rid in tenant_session and any(tenant_session[o.rid]):
        rec["tenant"], rec["session"] = tenant_session[o.rid]
      f.write(json.dumps(rec) + "\n")
  summary = report.summary()
  compiles = engine.compile_report()   # real XLA compilations this engine caused (all functions)
  summary["compilations"] = compiles["compilations"]
  summary["compile_s"] = compiles["compile_seconds"]
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
               "mesh": FLAGS.mesh, "pools_over_data": bool(FLAGS.mesh) and FLAGS.pools_over_data,
               "process": [FLAGS.process_id, FLAGS.num_processes],
               "summary": summary, "compiles": compiles, "tiers": tiers}, f, indent=2, default=str)
  for o in report.outputs:
    if o.error:
      print(f"request {o.rid}: error: {o.error}")
  print(format_table(summary))


if __name__ == "__main__":
  app.run(main)

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

Exit codes: 2 = a mistake in the flags (a missing --requests file or --checkpoint directory, a bad tier setting,
an unreachable tier with --kv_tiers_strict), found before the model loads; 1 = the model failed to load (the
message names the file), never a fallback. Both are one line on stderr.
"""

from __future__ import annotations

import json
import math
import os
import sys

from absl import app, flags, logging

SHIPPED_MODELS = ("v4_retrieval", "v41_retrieval", "v4_count", "v4_retrieval_mtp")

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
flags.DEFINE_bool("async_scheduling", True, "Plan and send step N+1 before reading step N's tokens (same tokens; "
                  "applies on one device without tiers or batch invariance).")
flags.DEFINE_integer("num_speculative_tokens", 0, "Speculative decoding: drafts per step from the model's MTP block "
                     "(0 = off, up to 8; e.g. --model=v4_retrieval_mtp). Greedy answers are unchanged; sampled "
                     "ones keep their distribution.")
flags.DEFINE_bool("batch_invariant", False, "Bitwise-reproducible logits whatever shares a step and however a "
                  "prompt is chunked (every token runs one fixed-shape program; slower).")
flags.DEFINE_enum("kv_dtype", "fp32", ["fp32", "bf16", "fp8"], "Storage of the KV pools: fp32, bf16, or fp8 (the "
                  "V4 584-byte record for window + compressed KV; index keys bf16); compressor state stays fp32.")
flags.DEFINE_enum("dtype", "auto", ["auto", "fp32", "bf16"], "Compute dtype of params / activations: 'auto' = the "
                  "checkpoint's own storage dtype (the shipped trained models and random weights: fp32; release "
                  "checkpoints: mostly bf16); bf16 keeps fp32 norms, softmaxes and logits.")
flags.DEFINE_enum("quantized_cache", "auto", ["auto", "on", "off"], "V4.1's fake-quantized cache (FP8 window KV, NVFP4 "
                  "compressed KV, MXFP4 index q/k): 'auto' = the checkpoint's default (on for NeMo V4.1 checkpoints).")
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
flags.DEFINE_string("kv_store_url", "", "Shared store of the redis / mooncake tier (required with it; no default "
                    "server): redis://127.0.0.1:6379/0 or "
                    "mooncake://127.0.0.1:<rpc port>?metadata=http://127.0.0.1:<port>/metadata.")
flags.DEFINE_enum("kv_tier_write", "store", ["store", "evict"], "When KV blocks are written to the tiers: 'store' = "
                  "as each block is registered (a later process, or another engine, hits it; a run killed midway "
                  "keeps what it wrote), 'evict' = only when the device cache evicts it.")
flags.DEFINE_bool("kv_tiers_strict", False, "A KV tier that cannot start or becomes unreachable is fatal (exit code "
                  "2) instead of one warning line and serving without it.")
flags.DEFINE_string("compilation_cache_dir", "", "Persistent XLA compilation cache directory (opt-in; '' = off): "
                    "the step programs then compile once per machine instead of once per run.")


class ModelLoadError(Exception):
  """The requested model could not be loaded; the message names the file."""


class FlagError(Exception):
  """A mistake in the flags, found before anything loads: one line on stderr, exit code 2."""


_CHECKPOINT_KINDS = ("a release checkpoint (config.json + *.safetensors), a directory written by experiments.train "
                     "(config.json + params/), or an orbax params directory")
_CONFIG_FILES = ("config.json", "text_config.json")      # text_config.json: NeMo Automodel text-only exports
_ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt", "checkpoint", "_sharding")
_LOAD_DTYPES = ("auto", "fp32", "bf16")


def _die(msg: str, code: int = 2):
  print(f"serve: {msg}", file=sys.stderr, flush=True)
  sys.exit(code)


def _quiet_closed_loop_callbacks() -> None:
  """When an orbax restore fails (a damaged checkpoint), the reads still in flight call back into its closed asyncio
  loop from tensorstore threads, and Python prints each RuntimeError as a bare traceback. They say nothing the load
  error does not; every other unraisable exception still prints."""
  default = sys.unraisablehook

  def hook(u):
    if not (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"):
      default(u)

  sys.unraisablehook = hook


def _warn(msg: str, bar=None) -> None:
  line = f"serve: warning: {msg}"
  if bar is not None:
    bar.write(line, file=sys.stderr)      # above the progress bar, not through it
  else:
    print(line, file=sys.stderr, flush=True)


def _parse_flags(argv):
  """absl's flag parsing, but a bad flag is one line and exit code 2 like every other usage mistake."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    _die(f"{' '.join(str(e).split())} (--helpfull lists the flags)")


def _check_checkpoint(d: str) -> None:
  if not os.path.exists(d):
    raise FlagError(f"--checkpoint={d}: no such directory")
  if not os.path.isdir(d):
    raise FlagError(f"--checkpoint={d}: not a directory — expected {_CHECKPOINT_KINDS}")
  try:
    names = set(os.listdir(d))
  except OSError as e:
    raise FlagError(f"--checkpoint={d}: cannot list it ({e.strerror})") from None
  if not names:
    raise FlagError(f"--checkpoint={d}: empty directory — expected {_CHECKPOINT_KINDS}")
  shards = any(n.endswith((".safetensors", ".safetensors.index.json")) for n in names)
  if "params" in names or shards or names & set(_ORBAX_MARKERS):
    return          # a checkpoint of a known kind; a file it lacks is a load error that names the file
  if names & set(_CONFIG_FILES):
    raise FlagError(f"--checkpoint={d}: a config but no *.safetensors shards and no params/ directory — expected "
                    f"{_CHECKPOINT_KINDS}")
  raise FlagError(f"--checkpoint={d}: not a checkpoint directory (no config.json, no orbax metadata) — expected "
                  f"{_CHECKPOINT_KINDS}")


def _check_tiers(kinds: list[str]) -> None:
  from cache.tiers.backends import SHARED_KINDS, check_tier_places
  try:   # the same rules (and words) as TieringConfig.from_flags
    check_tier_places(tuple(kinds), FLAGS.kv_disk_dir, FLAGS.kv_store_url,
                      {"tiers": "--kv_tiers", "disk_dir": "--kv_disk_dir", "store_url": "--kv_store_url"})
  except ValueError as e:
    raise FlagError(str(e)) from None
  if "disk" in kinds and os.path.exists(FLAGS.kv_disk_dir) and not os.path.isdir(FLAGS.kv_disk_dir):
    raise FlagError(f"--kv_disk_dir={FLAGS.kv_disk_dir}: not a directory")
  shared = [k for k in kinds if k in SHARED_KINDS]
  if not shared:
    return
  kind = shared[0]
  module, pkg = ("redis", "redis") if kind == "redis" else ("mooncake.store", "mooncake-transfer-engine")
  try:
    __import__(module)
  except ImportError as e:      # a setup error, never a silently missing tier
    raise FlagError(f"--kv_tiers=...{kind} needs the {module.split('.')[0]} client library: pip install {pkg} "
                    f"({e})") from None


def check_flags() -> list[str]:
  """Every mistake the flags show without loading anything (FlagError: one line, exit code 2); the first thing main
  does, before JAX touches a device. Returns the KV tiers asked for."""
  if FLAGS.retention_interval < 0 or FLAGS.retention_interval % 128:
    raise FlagError(f"--retention_interval={FLAGS.retention_interval}: must be 0 or a positive multiple of 128 (the "
                    "full-attention block size)")
  if FLAGS.model_api == "nnx" and FLAGS.mesh:
    raise FlagError("--model_api=nnx runs on one device (the module state carries no mesh shardings): drop --mesh "
                    "or use --model_api=functional")
  for name in ("max_num_seqs", "max_num_batched_tokens", "chunk_size", "max_model_len", "num_full_blocks",
               "num_swa_blocks", "num_processes"):
    if FLAGS[name].value < 1:
      raise FlagError(f"--{name}={FLAGS[name].value}: must be >= 1")
  if not 1 <= FLAGS.token_bucket_steps <= 8:
    raise FlagError(f"--token_bucket_steps={FLAGS.token_bucket_steps}: must be in 1..8")
  k = FLAGS.num_speculative_tokens
  if not 0 <= k <= 8:
    raise FlagError(f"--num_speculative_tokens={k}: must be in 0..8 (0 = off)")
  if k:
    for bad, why in ((FLAGS.batch_invariant, "--batch_invariant"), (FLAGS.mesh, "--mesh"),
                     (FLAGS.model_api != "functional", "--model_api=nnx")):
      if bad:
        raise FlagError(f"--num_speculative_tokens={k} with {why} is not supported (drafts run on one device, "
                        "through the functional model, without batch invariance)")
    if min(FLAGS.chunk_size, FLAGS.max_num_batched_tokens) < 1 + k:
      raise FlagError(f"--num_speculative_tokens={k}: --chunk_size and --max_num_batched_tokens must be >= {1 + k}")
    if not FLAGS.checkpoint and FLAGS.model in SHIPPED_MODELS:     # its config.json says, before any weight loads
      from experiments import train_lib
      try:
        with open(os.path.join(train_lib.CHECKPOINT_ROOT, FLAGS.model, "config.json")) as f:
          mtp = json.load(f)["config"].get("num_mtp_layers", 0)
      except (OSError, ValueError, KeyError):
        mtp = None                     # unreadable: load_model reports it
      if mtp == 0:
        raise FlagError(f"--num_speculative_tokens={k}: --model={FLAGS.model} has no MTP block (try "
                        "--model=v4_retrieval_mtp, or train one with experiments/train_mtp.py)")
    if FLAGS.checkpoint and os.path.isdir(FLAGS.checkpoint) and _is_pretrained_dir(FLAGS.checkpoint):
      from dsv4.config import ConfigError
      from dsv4.loading.config_json import read_config
      from dsv4.loading.pretrained import declared_mtp_blocks_stored
      from dsv4.loading.safetensors_io import CheckpointError
      try:                             # config.json and the shards' headers only
        cfg, info = read_config(FLAGS.checkpoint, strict=False)
        stored = declared_mtp_blocks_stored(FLAGS.checkpoint, cfg, info)
      except (ConfigError, CheckpointError, OSError):
        stored = None                  # unreadable: load_model reports it
      if stored == 0:
        raise FlagError(f"--num_speculative_tokens={k}: {FLAGS.checkpoint} has no MTP block (config.json declares "
                        "none, or the directory stores no mtp.* / e_proj tensors, as a transformers export)")
  if not 0 <= FLAGS.process_id < FLAGS.num_processes:
    raise FlagError(f"--process_id={FLAGS.process_id}: must be in [0, --num_processes={FLAGS.num_processes})")
  if FLAGS.mesh:
    from dsv4 import sharding
    try:
      sharding.parse_mesh_spec(FLAGS.mesh)
    except ValueError as e:
      raise FlagError(f"--mesh={FLAGS.mesh}: {e}") from None
  if FLAGS.requests:
    p = FLAGS.requests
    if not os.path.exists(p):
      raise FlagError(f"--requests={p}: no such file")
    if os.path.isdir(p):
      raise FlagError(f"--requests={p}: a directory, expected a JSONL file (one request per line)")
    if not os.access(p, os.R_OK):
      raise FlagError(f"--requests={p}: not readable")
  if FLAGS.checkpoint:
    _check_checkpoint(FLAGS.checkpoint)
  if FLAGS.model == "random" or (FLAGS.checkpoint and not _config_file(FLAGS.checkpoint)):
    from dsv4 import config as C
    if FLAGS.preset not in C.PRESETS:
      raise FlagError(f"--preset={FLAGS.preset}: unknown; known: {', '.join(sorted(C.PRESETS))}")
  kinds = [t.strip() for t in FLAGS.kv_tiers.split(",") if t.strip()]
  _check_tiers(kinds)
  return kinds


def probe_tiers(kinds: list[str], strict: bool) -> list[str]:
  """One cheap round trip to each tier that lives outside this process, before the model loads. A tier that does not
  answer is one warning line and is left out (fatal with --kv_tiers_strict). Returns the tiers to serve with."""
  from cache.tiers.backends import make_backend
  usable = []
  for kind in kinds:
    why = None
    try:
      if kind == "disk":
        os.makedirs(FLAGS.kv_disk_dir, exist_ok=True)
        if not os.access(FLAGS.kv_disk_dir, os.W_OK | os.X_OK):
          why = f"{FLAGS.kv_disk_dir}: not writable"
      elif kind in ("redis", "mooncake"):
        b = make_backend(kind, store_url=FLAGS.kv_store_url, timeout_s=1.0)
        try:
          if hasattr(b, "ping"):
            b.ping()
          else:
            b.exists_many(["dsv4kv:serve-probe"])
        finally:
          b.close()
    except ImportError as e:     # a setup error, not an outage: never a silently missing tier
      raise FlagError(f"--kv_tiers=...{kind}: {e}") from None
    except Exception as e:  # noqa: BLE001 - whatever the client raises, the store is not reachable
      why = f"{type(e).__name__}: {' '.join(str(e).split())}"
    if why is None:
      usable.append(kind)
    elif strict:
      raise FlagError(f"KV tier {kind} unavailable ({why}) and --kv_tiers_strict is set")
    else:
      _warn(f"KV tier {kind} unavailable ({why}); continuing without it")
  return usable


def _config_file(d: str) -> str | None:
  for n in _CONFIG_FILES:
    if os.path.isfile(os.path.join(d, n)):
      return os.path.join(d, n)
  return None


def _is_pretrained_dir(path: str) -> bool:
  """A checkpoint directory in a release layout (not one written by experiments.train): a config beside
  safetensors shards."""
  return (_config_file(path) is not None and not os.path.isdir(os.path.join(path, "params"))
          and any(f.endswith(".safetensors") or f.endswith(".safetensors.index.json") for f in os.listdir(path)))


def params_dtype(params) -> str:
  """The float dtype holding most of the params' elements, "bf16" or "fp32": what the engine computes in."""
  import jax
  import ml_dtypes
  import numpy as np
  counts = {}
  for x in jax.tree_util.tree_leaves(params):
    dt = np.dtype(x.dtype)
    if np.issubdtype(dt, np.floating) or dt == np.dtype(ml_dtypes.bfloat16):
      counts[dt] = counts.get(dt, 0) + int(np.prod(x.shape))
  if not counts:
    return "fp32"
  return "bf16" if max(counts, key=counts.get) == np.dtype(ml_dtypes.bfloat16) else "fp32"


def load_model(model: str, checkpoint: str = "", preset: str = "v4_tiny", seed: int = 0, dtype: str = "auto",
               quantized_cache: bool | None = None, mtp: bool | None = None):
  """(config, params, task spec or None). Any failure is a ModelLoadError naming the file: never random weights
  in place of a model that was asked for. dtype: "auto" (as stored), "fp32" or "bf16"; quantized_cache: None = the
  checkpoint's default; mtp: a release directory's MTP blocks (`load_pretrained`; None = those it stores)."""
  import dataclasses

  import jax
  import jax.numpy as jnp
  import ml_dtypes
  import numpy as np

  from dsv4 import config as C
  from dsv4 import model as M
  from dsv4.config import ConfigError
  from dsv4.loading.safetensors_io import CheckpointError
  from dsv4.loading.tokenizer import TokenizerError
  from experiments import train_lib
  if dtype not in _LOAD_DTYPES:
    raise ValueError(f"load_model: dtype {dtype!r}, expected one of {_LOAD_DTYPES}")

  def finish(cfg, params, spec):
    if quantized_cache is not None and cfg.quantized_cache != quantized_cache:
      try:
        cfg = dataclasses.replace(cfg, quantized_cache=quantized_cache)
      except ConfigError as e:
        raise FlagError(f"--quantized_cache={'on' if quantized_cache else 'off'}: {e} (model {cfg.name})") from None
    if dtype != "auto":       # the trained and random models store fp32
      params = M.cast_params(params, jnp.float32 if dtype == "fp32" else jnp.bfloat16)
    return cfg, params, spec

  if not checkpoint and model == "random":
    cfg = C.get_preset(preset)
    return finish(cfg, M.init_params(cfg, jax.random.PRNGKey(seed)), None)
  directory = checkpoint or os.path.join(train_lib.CHECKPOINT_ROOT, model)
  info_path = os.path.join(directory, "config.json")
  try:
    if checkpoint and _is_pretrained_dir(checkpoint):       # a config + safetensors (any naming) + tokenizer
      from dsv4.loading.pretrained import load_pretrained
      try:
        pre = load_pretrained(checkpoint, dtype={"auto": "auto", "fp32": np.float32, "bf16": ml_dtypes.bfloat16}[dtype],
                              quantized_cache=quantized_cache, mtp=mtp)
      except (ConfigError, TokenizerError) as e:
        raise ModelLoadError(str(e)) from e
      return pre.config, pre.params, None
    if checkpoint and _config_file(checkpoint) is None and any(
        f.endswith((".safetensors", ".safetensors.index.json")) for f in os.listdir(checkpoint)):
      raise ModelLoadError(f"{os.path.join(checkpoint, 'config.json')}: no such file (a release checkpoint has it "
                           "beside its *.safetensors shards)")
    if checkpoint and not os.path.isdir(os.path.join(checkpoint, "params")):   # a bare orbax params directory
      from dsv4.loading import orbax_io
      return finish(C.get_preset(preset), orbax_io.restore_params(checkpoint, C.get_preset(preset)), None)
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
    return finish(cfg, params, spec)
  except CheckpointError as e:
    raise ModelLoadError(str(e)) from e


def load_tokenizer(checkpoint: str):
  """The checkpoint dir's tokenizer (tokenizer.json + tokenizer_config.json chat template), or None."""
  if not checkpoint or not os.path.isfile(os.path.join(checkpoint, "tokenizer.json")):
    return None
  from dsv4.loading.tokenizer import Tokenizer
  return Tokenizer.from_dir(checkpoint)


def read_requests(path: str, vocab_size: int, tokenizer=None):
  """JSONL -> (Workload of the valid requests, [(line, id, error)] of the refused ones, order, stops, lines).

  Line numbers are 1-based, as an editor shows them. Every line is checked by the one request schema; a bad line
  (malformed JSON, unknown key, wrong type or range, duplicate id, including a collision with a default `line<n>`
  id) is refused on its own and the rest are served. Turns of one (tenant, session) run in file order, one wave
  each; requests without a session are independent. `order` lists ("ok", id) / ("refused", k) per non-blank line,
  in file order; `stops` maps ids to stop strings; `lines` maps the served ids to their line."""
  from dsv4.engine import schema
  from dsv4.engine.workloads import Turn, Workload
  refused, order, seen, stops = [], [], {}, {}
  waves: list[list[Turn]] = []
  turns_of: dict[tuple[str, str], int] = {}
  with open(path) as f:
    lines = f.read().splitlines()
  for i, line in enumerate(lines, start=1):
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
  return Workload(os.path.basename(path), tuple(tuple(w) for w in waves)), refused, order, stops, seen


def finite(x):
  """x with every non-finite float (NaN, inf) as None, numpy scalars as Python ones: strict JSON."""
  if hasattr(x, "item") and not isinstance(x, (list, tuple, dict, str)) and getattr(x, "ndim", 1) == 0:
    x = x.item()
  if isinstance(x, float):
    return x if math.isfinite(x) else None
  if isinstance(x, dict):
    return {k: finite(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [finite(v) for v in x]
  return x


def format_table(summary: dict) -> str:
  rows = [(k, "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in summary.items()]
  w = max(len(k) for k, _ in rows)
  line = "+" + "-" * (w + 2) + "+" + "-" * 14 + "+"
  return "\n".join([line] + [f"| {k:<{w}} | {v:>12} |" for k, v in rows] + [line])


def init_devices():
  """CPU device count and jax.distributed must be set up before JAX touches a backend."""
  import jax
  n_cpu = FLAGS.num_cpu_devices
  if FLAGS.mesh and not n_cpu and not FLAGS.coordinator:
    from dsv4 import sharding
    n_cpu = math.prod(sharding.parse_mesh_spec(FLAGS.mesh).values())  # only the CPU backend reads this
  if n_cpu:
    jax.config.update("jax_num_cpu_devices", n_cpu)
  if FLAGS.coordinator:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process collectives on the CPU
    jax.distributed.initialize(FLAGS.coordinator, num_processes=FLAGS.num_processes, process_id=FLAGS.process_id)


class _TierFatal(Exception):
  pass


class TierWatch:
  """One warning line per KV tier the first time it fails (start-up or later); with strict, the failure is fatal."""

  def __init__(self, strict: bool):
    self.strict, self.warned = strict, set()

  def report(self, name: str, why: str, bar=None) -> None:
    if name in self.warned:
      return
    self.warned.add(name)
    if self.strict:
      raise _TierFatal(f"KV tier {name} unavailable ({why}) and --kv_tiers_strict is set")
    _warn(f"KV tier {name} unavailable ({why}); continuing without it", bar)

  def __call__(self, tiering, bar=None) -> None:
    for t in tiering.store.tiers:        # counters only: cheap enough for every step
      if t.name not in self.warned and t.metrics.get("failures", 0):
        self.report(t.name, t.last_error or "failed", bar)


def main(argv):
  del argv
  if not FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)      # orbax logs INFO lines on every restore; --verbosity=0 shows them
  try:
    tier_kinds = probe_tiers(check_flags(), FLAGS.kv_tiers_strict)
  except FlagError as e:
    _die(str(e))
  from tqdm import tqdm

  init_devices()

  from dsv4.engine import workloads
  from dsv4.engine.api import StopStrings, WorkloadReport, grade, run_workload
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
  _quiet_closed_loop_callbacks()
  try:
    cfg, params, spec = load_model(FLAGS.model, FLAGS.checkpoint, FLAGS.preset, FLAGS.seed, FLAGS.dtype,
                                   {"auto": None, "on": True, "off": False}[FLAGS.quantized_cache],
                                   # the MTP block only when it drafts (its weights and window KV cost memory)
                                   mtp=None if FLAGS.num_speculative_tokens else False)
  except ModelLoadError as e:
    _die(f"cannot load the model: {e}", 1)
  except FlagError as e:
    _die(str(e))
  ec = EngineConfig(max_num_seqs=FLAGS.max_num_seqs, max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                    chunk_size=FLAGS.chunk_size, max_model_len=FLAGS.max_model_len,
                    num_full_blocks=FLAGS.num_full_blocks, num_swa_blocks=FLAGS.num_swa_blocks,
                    enable_prefix_caching=FLAGS.prefix_caching, retention_interval=FLAGS.retention_interval,
                    model_id=cfg.name, batch_invariant=FLAGS.batch_invariant,
                    layout=caches.CacheLayout(kv_dtype={"fp32": jnp.float32, "bf16": jnp.bfloat16,
                                                        "fp8": caches.FP8}[FLAGS.kv_dtype]),
                    dtype=params_dtype(params),      # what was loaded: --dtype=fp32 really computes in fp32
                    tiering=TieringConfig.from_flags(",".join(tier_kinds), FLAGS.kv_disk_dir, FLAGS.kv_store_url,
                                                     demote=FLAGS.kv_tier_write),
                    model_api=FLAGS.model_api, token_bucket_growth=int(FLAGS.token_bucket_growth),
                    token_bucket_steps=FLAGS.token_bucket_steps, async_scheduling=FLAGS.async_scheduling,
                    num_speculative_tokens=FLAGS.num_speculative_tokens)
  if ec.num_speculative_tokens and cfg.num_mtp_layers < 1:
    _die(f"--num_speculative_tokens={ec.num_speculative_tokens}: this model has no MTP block (try "
         "--model=v4_retrieval_mtp, or train one with experiments/train_mtp.py)")
  refused, order, stops, line_of = [], None, {}, {}
  tok = load_tokenizer(FLAGS.checkpoint)
  if FLAGS.requests:
    wl, refused, order, stops, line_of = read_requests(FLAGS.requests, cfg.vocab_size, tok)
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
  watch = TierWatch(FLAGS.kv_tiers_strict)
  try:
    if engine.tiering is not None:
      for name, why in engine.tiering.unavailable().items():     # its own start-up ping
        watch.report(name, why)
  except _TierFatal as e:
    _die(str(e))

  stopper = StopStrings(tok, stops) if stops else None
  tenant_session = {t.rid or f"{t.session}.t{w}": (t.tenant, t.session) for w, wave in enumerate(wl.waves)
                    for t in wave}

  def record(o: RequestOutput, exp, line=None) -> dict:
    rec = {"id": o.rid, "prompt_len": len(o.prompt), "output": o.output,
           "expected": None if exp is None else list(exp),
           "correct": None if o.error is not None else grade(o.output, exp),
           "finish_reason": o.finish_reason, "error": o.error, "hit_tokens": o.hit_tokens,
           "tier_hit_tokens": o.tier_hit_tokens}
    if line is not None:
      rec["line"] = line
    if tok is not None and o.error is None:     # text, cut before the stop string that ended it
      text, hit = stopper.text(o.rid, o.output) if stopper is not None else (tok.decode(o.output), None)
      rec["text"] = text
      if hit is not None:
        rec["finish_reason"], rec["stop"] = "stop", hit
    if o.rid in tenant_session and any(tenant_session[o.rid]):
      rec["tenant"], rec["session"] = tenant_session[o.rid]
    return rec

  os.makedirs(FLAGS.out_dir, exist_ok=True)
  out_path = os.path.join(FLAGS.out_dir, "outputs.jsonl")
  recs: dict[str, dict] = {}
  refused_recs = []
  with open(out_path, "w") as out_f:

    def emit(rec):
      out_f.write(json.dumps(rec) + "\n")
      out_f.flush()                   # a run killed midway keeps every finished answer

    for line, rid, err in refused:    # they never reach the engine
      refused_recs.append(record(RequestOutput(rid, [], [], "error", err, 0, 0, 0, 0, None, None), None, line))
      emit(refused_recs[-1])
    name = f"{cfg.name} {wl.name}"
    with tqdm(total=wl.num_requests + len(refused), desc=f"{name} (compiling…)", unit="req") as bar:
      bar.update(len(refused))
      steps = [0]

      def on_step(eng):
        steps[0] += 1
        if steps[0] == 1:
          bar.set_description(name)
        if stopper is not None:
          stopper(eng)
        if eng.tiering is not None:
          watch(eng.tiering, bar)

      def on_finish(o, exp):
        recs[o.rid] = record(o, exp, line_of.get(o.rid))
        emit(recs[o.rid])
        bar.update(1)

      try:
        report = run_workload(engine, wl, on_step=on_step, on_finish=on_finish)
      except _TierFatal as e:
        bar.close()
        _die(str(e))
  # Input order at the end (refused requests in their place); one atomic rename, so the file is always whole.
  rows = [(o, e) for o, e in zip(report.outputs, report.expected)]
  final = [recs[o.rid] for o, _ in rows]
  if order is not None:
    by_id = {o.rid: (o, e) for o, e in rows}
    rows, final = [], []
    for kind, key in order:
      if kind == "ok":
        rows.append(by_id[key])
        final.append(recs[key])
      else:
        line, rid, err = refused[key]
        rows.append((RequestOutput(rid, [], [], "error", err, 0, 0, 0, 0, None, None), None))
        final.append(refused_recs[key])
    waited = dict(zip([o.rid for o in report.outputs], report.waited_on_compile))
    report = WorkloadReport([o for o, _ in rows], report.wall_s, report.stats, report.peak_blocks,
                            [e for _, e in rows], [waited.get(o.rid, False) for o, _ in rows])
  with open(out_path + ".tmp", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in final)
  os.replace(out_path + ".tmp", out_path)

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
  summary = finite(summary)
  with open(os.path.join(FLAGS.out_dir, "metrics.json"), "w") as f:
    json.dump(finite({"model": cfg.name, "workload": wl.name, "dtype": ec.dtype,
                      "engine": {k: str(v) for k, v in vars(ec).items()},
                      "mesh": FLAGS.mesh, "pools_over_data": bool(FLAGS.mesh) and FLAGS.pools_over_data,
                      "process": [FLAGS.process_id, FLAGS.num_processes],
                      "summary": summary, "compiles": compiles, "tiers": tiers}), f, indent=2, default=str,
              allow_nan=False)
  for o in report.outputs:
    if o.error:
      print(f"request {o.rid}: error: {o.error}")
  print(format_table(summary))
  print(f"wrote {FLAGS.out_dir}")
  if engine.tiering is not None:
    try:
      watch(engine.tiering)           # failures of the last writes (flushed above)
    except _TierFatal as e:
      _die(str(e))
    finally:
      engine.tiering.close()


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)

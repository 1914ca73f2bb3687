"""What one run of the main job is asked to do: `ServeOptions` (with its `EngineConfig`), and its absl flags.

Every flag of `python -m experiments.serve` is a field: the job's own settings are ServeOptions' fields, the
engine's are EngineConfig's (dsv4/engine/config.py), each flag built from its field's default and help text
(experiments/dataclass_flags.py). A notebook builds the same object directly:

    from experiments import serve_lib, serve_options
    opts = serve_options.ServeOptions(model="v4_count", out_dir="/tmp/count",
                                      engine=dataclasses.replace(serve_options.SERVE_ENGINE, max_num_seqs=4))
    summary = serve_lib.run(opts)
"""

from __future__ import annotations

import dataclasses

from absl import flags

from dsv4.engine.config import EngineConfig, flag_field
from experiments.dataclass_flags import DataclassFlags, FlagOverride

flags.disclaim_key_flags()      # the flags defined through here belong to the script that asks (serve.py's --help)

SHIPPED_MODELS = ("v4_retrieval", "v41_retrieval", "v4_count", "v4_retrieval_mtp")

# EngineConfig fields whose flag is not simply --<field> with the field's default, and why. Checked by
# tests/experiments/test_serve_flags.py: every field is a flag or listed here.
ENGINE_FLAG_OVERRIDES = {
    "enable_prefix_caching": FlagOverride(name="prefix_caching"),     # serve's spelling since its first version
    # serve's pools since its first version, half EngineConfig's: ample for its jobs (the default job peaks at 14 full
    # and 16 SWA blocks) and kept so that runs compare with earlier ones (what evicts, and so what evict-mode tiers
    # write, depends on the pool size)
    "num_full_blocks": FlagOverride(default=128),
    "num_swa_blocks": FlagOverride(default=256),
}
ENGINE_NOT_FLAGS = {
    "layout": "--kv_dtype sets layout.kv_dtype (the rest of the layout is CacheLayout's default)",
    "tiering": "built from --kv_tiers, --kv_disk_dir, --kv_store_url and --kv_tier_write (TieringConfig.from_flags)",
    "dtype": "--dtype casts the params at load (auto = as stored); the engine computes in the dtype that loaded",
    "model_id": "the loaded model's name (it keys the KV tiers' records)",
    "kernel": "--kernels sets kernel.backend (the tunings are the kernels' defaults)",
    "record_logits": "serve writes no logits; keeping them costs memory per sampled position",
}
ENGINE_FLAGS = DataclassFlags(EngineConfig, overrides=ENGINE_FLAG_OVERRIDES, not_flags=ENGINE_NOT_FLAGS)
SERVE_ENGINE = ENGINE_FLAGS.defaults()        # the engine serve runs when no engine flag is given


@dataclasses.dataclass(frozen=True)
class ServeOptions:
  model: str = flag_field("v4_retrieval", "Shipped trained model (experiments/checkpoints/<name>), or 'random' = "
                          "random weights of --preset.", (*SHIPPED_MODELS, "random"))
  checkpoint: str = flag_field("", "Overrides --model: a release checkpoint directory (config.json + safetensors "
                               "shards in any naming + tokenizer.json; requests may then give text prompts, chat "
                               "'messages' and 'stop' strings), a directory written by experiments.train (config.json "
                               "+ params/), or an orbax params directory (config from --preset).")
  preset: str = flag_field("v4_tiny", "Model preset for --model=random or an orbax params --checkpoint.")
  workload: str = flag_field("task", "'task' = graded sessions in the model's own task format; the others send random "
                             "tokens (cache behaviour only, nothing to grade).",
                             ("task", "chat", "agentic", "switch", "random"))
  requests: str = flag_field("", "JSONL of requests; overrides --workload.")
  out_dir: str = flag_field("out/serve", "Where outputs.jsonl and metrics.json go.")
  seed: int = flag_field(0, "Seed for random weights and workloads.")
  kv_dtype: str = flag_field("fp32", "Storage of the KV pools: fp32, bf16, or fp8 (the V4 584-byte record for window + "
                             "compressed KV; index keys bf16); compressor state stays fp32.", ("fp32", "bf16", "fp8"))
  dtype: str = flag_field("auto", "Compute dtype of params / activations: 'auto' = the checkpoint's own storage dtype "
                          "(the shipped trained models and random weights: fp32; release checkpoints: mostly bf16); "
                          "bf16 keeps fp32 norms, softmaxes and logits.", ("auto", "fp32", "bf16"))
  quantized_cache: str = flag_field("auto", "V4.1's fake-quantized cache (FP8 window KV, NVFP4 compressed KV, MXFP4 "
                                    "index q/k): 'auto' = the checkpoint's default (on for NeMo V4.1 "
                                    "checkpoints).", ("auto", "on", "off"))
  mesh: str = flag_field("", "Device mesh for the model step, e.g. data:2,tensor:2,expert:2 ('' = one device).")
  kv_latent: str = flag_field("replicated", "Shard the K=V latent pools over tensor?", ("replicated", "feature"))
  pools_over_data: bool = flag_field(True, "With --mesh: one KV block pool (and cache manager) per data shard, the "
                                     "pools split over `data` (false: one pool replicated over `data`).")
  num_cpu_devices: int = flag_field(0, "On the CPU: host devices per process (0 = the mesh size with --mesh in one "
                                    "process, else JAX's default).")
  coordinator: str = flag_field("", "host:port of the jax.distributed coordinator ('' = single process).")
  num_processes: int = flag_field(1, "Processes under jax.distributed.")
  process_id: int = flag_field(0, "This process's id under jax.distributed.")
  kv_tiers: str = flag_field("", "KV tiers below the device, fastest first, e.g. 'host,disk,redis' (host, disk, redis, "
                             "mooncake; '' = device only).")
  kv_disk_dir: str = flag_field("", "Directory of the disk tier (one file per record).")
  kv_store_url: str = flag_field("", "Shared store of the redis / mooncake tier (required with it; no default server): "
                                 "redis://127.0.0.1:6379/0 or mooncake://127.0.0.1:<rpc "
                                 "port>?metadata=http://127.0.0.1:<port>/metadata.")
  kv_tier_write: str = flag_field("store", "When KV blocks are written to the tiers: 'store' = as each block is "
                                  "registered (a later process, or another engine, hits it; a run killed midway keeps "
                                  "what it wrote), 'evict' = only when the device cache evicts it.", ("store", "evict"))
  kv_tiers_strict: bool = flag_field(False, "A KV tier that cannot start or becomes unreachable is fatal (exit code 2) "
                                     "instead of one warning line and serving without it.")
  kernels: str = flag_field("auto", "Attention / indexer kernels: 'auto' = the Pallas kernels on a GPU, each kernel "
                            "configuration validated once against its XLA reference (a failing one serves on XLA), the "
                            "XLA reference elsewhere; 'xla' = the XLA reference everywhere; 'pallas' = the kernels "
                            "without validation (a GPU only).", ("auto", "xla", "pallas"))
  compilation_cache_dir: str = flag_field("", "Persistent XLA compilation cache directory (opt-in; '' = off): the step "
                                          "programs then compile once per machine instead of once per run.")
  # the engine's settings (their flags: ENGINE_FLAGS); model_id, dtype, layout.kv_dtype and tiering are filled in
  # from the loaded model and the options above when the job runs
  engine: EngineConfig = flag_field(SERVE_ENGINE, "The engine's settings.")

  @property
  def tier_kinds(self) -> list[str]:
    return [t.strip() for t in self.kv_tiers.split(",") if t.strip()]


OPTION_FLAGS = DataclassFlags(ServeOptions, not_flags={"engine": "its fields are flags of their own (ENGINE_FLAGS)"})


def flag_name(field: str) -> str:
  """The flag that sets a ServeOptions or EngineConfig field, for messages: `--prefix_caching` for
  enable_prefix_caching."""
  return "--" + {**OPTION_FLAGS.flag_names, **ENGINE_FLAGS.flag_names}.get(field, field)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Every flag of the main job, on flag_values (each a field of ServeOptions or EngineConfig)."""
  OPTION_FLAGS.define(flag_values)
  ENGINE_FLAGS.define(flag_values)


def options_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> ServeOptions:
  return OPTION_FLAGS.build(flag_values, engine=ENGINE_FLAGS.build(flag_values))

"""The main job as a library call: `run(options) -> summary` (experiments/serve.py is its command line).

    from experiments import serve_lib
    from experiments.serve_options import ServeOptions
    summary = serve_lib.run(ServeOptions(model="v41_retrieval", out_dir="/tmp/v41"))
    summary["accuracy"]

One run: check the options before anything loads (serve_checks), set up the devices, load the model
(serve_model), read or make the requests, build the engine with its KV tiers, serve every request with a progress
bar, write outputs.jsonl and metrics.json (serve_io), print the summary table. Whatever stops it is a ServeError
whose message is one line and whose exit_code the command line returns: FlagError (2, before the model loads),
ModelLoadError (1), TierFatal (2, a KV tier lost under --kv_tiers_strict).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
from tqdm import tqdm

from dsv4 import caches, sharding
from dsv4.engine import workloads
from dsv4.engine.api import StopStrings, run_workload
from dsv4.engine.engine import Engine
from dsv4.engine.tiering_config import TieringConfig
from experiments import serve_io, task_workloads
from experiments.serve_checks import FlagError, ServeError, check_options, probe_tiers, warn
from experiments.serve_model import ModelLoadError, load_model, load_tokenizer, params_dtype, \
    quiet_closed_loop_callbacks
from experiments.serve_options import ServeOptions
from experiments.tasks import KVRecallSpec
from pallas_kernels import dispatch

__all__ = ["run", "TierFatal", "TierWatch", "engine_config", "init_devices", "make_workload"]


class TierFatal(ServeError):
  """A KV tier failed under --kv_tiers_strict."""


class TierWatch:
  """One warning line per KV tier the first time it fails (start-up or later); with strict, the failure is fatal."""

  def __init__(self, strict: bool):
    self.strict, self.warned = strict, set()

  def report(self, name: str, why: str, bar=None) -> None:
    if name in self.warned:
      return
    self.warned.add(name)
    if self.strict:
      raise TierFatal(f"KV tier {name} unavailable ({why}) and --kv_tiers_strict is set")
    warn(f"KV tier {name} unavailable ({why}); continuing without it", bar)

  def __call__(self, tiering, bar=None) -> None:
    for t in tiering.store.tiers:        # counters only: cheap enough for every step
      if t.name not in self.warned and t.metrics.get("failures", 0):
        self.report(t.name, t.last_error or "failed", bar)


def init_devices(o: ServeOptions) -> None:
  """CPU device count and jax.distributed must be set up before JAX touches a backend."""
  n_cpu = o.num_cpu_devices
  if o.mesh and not n_cpu and not o.coordinator:
    n_cpu = math.prod(sharding.parse_mesh_spec(o.mesh).values())  # only the CPU backend reads this
  if n_cpu:
    jax.config.update("jax_num_cpu_devices", n_cpu)
  if o.coordinator:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process collectives on the CPU
    jax.distributed.initialize(o.coordinator, num_processes=o.num_processes, process_id=o.process_id)
  if o.compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(o.compilation_cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def engine_config(o: ServeOptions, model_name: str, params, tier_kinds: list[str]):
  """o.engine with what serve sets from the loaded model and its own options (serve_options.ENGINE_NOT_FLAGS)."""
  ec = o.engine
  kv_dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp8": caches.FP8}[o.kv_dtype]
  return dataclasses.replace(
      ec, model_id=model_name, layout=dataclasses.replace(ec.layout, kv_dtype=kv_dtype),
      kernel=dataclasses.replace(ec.kernel, backend=o.kernels),
      dtype=params_dtype(params),      # what was loaded: --dtype=fp32 really computes in fp32
      tiering=TieringConfig.from_flags(",".join(tier_kinds), o.kv_disk_dir, o.kv_store_url, demote=o.kv_tier_write))


def _check_kernels(o: ServeOptions) -> None:
  """--kernels=pallas off a GPU is a flag mistake, found before the model loads (the devices are up by now)."""
  try:
    dispatch.check_backend(dispatch.KernelConfig(backend=o.kernels))
  except ValueError as e:
    raise FlagError(f"--kernels={o.kernels}: {e}") from None


def make_workload(o: ServeOptions, cfg, spec, tokenizer):
  """(workload, refused, order, stops, line_of): the --requests file (serve_io.read_requests), else the model's own
  graded task, else a synthetic workload of random tokens."""
  if o.requests:
    return serve_io.read_requests(o.requests, cfg.vocab_size, tokenizer)
  if o.workload == "task":
    # A model without a task (random weights) is asked the recall task: its accuracy shows it knows nothing.
    wl = task_workloads.for_task(spec if spec is not None else KVRecallSpec(), seed=o.seed)
  else:
    wl = workloads.make(o.workload, cfg.vocab_size, seed=o.seed)
  return wl, [], None, {}, {}


def _serve_all(engine, wl, out: serve_io.OutputsFile, record, refused, line_of, stopper, watch, name):
  """Every request through the engine behind a progress bar, each record written as it ends. Returns the report,
  the records by id and the refused requests' records."""
  records: dict[str, dict] = {}
  refused_records = []
  for line, rid, err in refused:    # they never reach the engine
    refused_records.append(record(serve_io.refused_output(rid, err), None, line))
    out.emit(refused_records[-1])
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
      records[o.rid] = record(o, exp, line_of.get(o.rid))
      out.emit(records[o.rid])
      bar.update(1)

    report = run_workload(engine, wl, on_step=on_step, on_finish=on_finish)
  return report, records, refused_records


def _summary(report, engine) -> tuple[dict, dict, dict | None]:
  """(summary, compile report, tiers summary): the table's figures, compile and tier figures beside the report's."""
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
  return serve_io.finite(summary), compiles, tiers


def run(o: ServeOptions) -> dict:
  """One run of the main job (see the module docstring); returns the summary the table shows. Raises ServeError."""
  tier_kinds = probe_tiers(o, check_options(o))
  init_devices(o)
  _check_kernels(o)

  quiet_closed_loop_callbacks()
  cfg, params, spec = load_model(o.model, o.checkpoint, o.preset, o.seed, o.dtype,
                                 {"auto": None, "on": True, "off": False}[o.quantized_cache],
                                 # the MTP block only when it drafts (its weights and window KV cost memory)
                                 mtp=None if o.engine.num_speculative_tokens else False)
  ec = engine_config(o, cfg.name, params, tier_kinds)
  if ec.num_speculative_tokens and cfg.num_mtp_layers < 1:
    raise FlagError(f"--num_speculative_tokens={ec.num_speculative_tokens}: this model has no MTP block (try "
                    "--model=v4_retrieval_mtp, or train one with experiments/train_mtp.py)")
  tok = load_tokenizer(o.checkpoint)
  wl, refused, order, stops, line_of = make_workload(o, cfg, spec, tok)
  mesh = rules = None
  if o.mesh:
    mesh, rules = sharding.make_mesh(o.mesh), sharding.Rules(kv_latent=o.kv_latent)
  engine = Engine(params, cfg, ec, mesh=mesh, rules=rules, pools_over_data=o.pools_over_data)
  watch = TierWatch(o.kv_tiers_strict)
  if engine.tiering is not None:
    for name, why in engine.tiering.unavailable().items():     # its own start-up ping
      watch.report(name, why)

  stopper = StopStrings(tok, stops) if stops else None
  record = serve_io.Recorder(tok, stopper, wl)
  with serve_io.OutputsFile(o.out_dir) as out:
    report, records, refused_records = _serve_all(engine, wl, out, record, refused, line_of, stopper, watch,
                                                  f"{cfg.name} {wl.name}")
    # Input order at the end (refused requests in their place)
    report, final = serve_io.in_input_order(report, records, order, refused, refused_records)
    out.rewrite(final)

  summary, compiles, tiers = _summary(report, engine)
  with open(os.path.join(o.out_dir, "metrics.json"), "w") as f:
    json.dump(serve_io.finite({"model": cfg.name, "workload": wl.name, "dtype": ec.dtype,
                               "engine": {k: str(v) for k, v in vars(ec).items()},
                               "mesh": o.mesh, "pools_over_data": bool(o.mesh) and o.pools_over_data,
                               "process": [o.process_id, o.num_processes],
                               "summary": summary, "compiles": compiles, "tiers": tiers}), f, indent=2, default=str,
              allow_nan=False)
  for output in report.outputs:
    if output.error:
      print(f"request {output.rid}: error: {output.error}")
  print(serve_io.format_table(summary))
  print(f"wrote {o.out_dir}")
  if engine.tiering is not None:
    try:
      watch(engine.tiering)           # failures of the last writes (flushed above)
    finally:
      engine.tiering.close()
  return summary

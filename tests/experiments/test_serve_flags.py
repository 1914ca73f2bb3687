"""Mistakes a user makes on the `python -m experiments.serve` command line: each is one line on stderr, no traceback,
exit code 2, found before the model loads (fast, no JAX / orbax output). And the pieces of serve that need no model
run (experiments/serve_io.py, serve_lib.py, serve_model.py): strict JSON metrics, one warning line per failing KV
tier, stop strings through the per-step hook, --dtype and --quantized_cache at load time. The flags themselves
(built from ServeOptions' and EngineConfig's fields): tests/experiments/test_serve_options.py."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NO_REDIS = "<no redis>"      # run serve in an interpreter where `import redis` fails
KINDS = ("expected a release checkpoint (config.json + *.safetensors), a directory written by experiments.train "
         "(config.json + params/), or an orbax params directory")


def _dead_port() -> int:
  with socket.socket() as s:      # bound, never listening: connections are refused
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _cases(tmp):
  (tmp / "empty").mkdir()
  (tmp / "cfg_only").mkdir()
  (tmp / "cfg_only" / "config.json").write_text("{}")
  (tmp / "junk").mkdir()
  (tmp / "junk" / "notes.txt").write_text("x")
  (tmp / "reqs.jsonl").write_text("{}\n")
  (tmp / "a_file").write_text("x")
  dead = f"redis://127.0.0.1:{_dead_port()}/0"
  from tests.dsv4.test_loading_pretrained import make_checkpoint_dir
  make_checkpoint_dir(tmp / "no_mtp", "hf", mtp_declared=True)     # config.json declares a block, no tensors
  return [
      ("requests_missing", [f"--requests={tmp / 'nope.jsonl'}"], f"--requests={tmp / 'nope.jsonl'}: no such file"),
      ("requests_is_dir", [f"--requests={tmp / 'empty'}"], "a directory, expected a JSONL file"),
      ("unknown_tier", ["--kv_tiers=host,ssd"], "--kv_tiers: unknown tier(s) 'ssd'"),
      ("tier_twice", ["--kv_tiers=host,host"], "each tier at most once"),
      ("disk_without_dir", ["--kv_tiers=disk"], "--kv_disk_dir is required with the disk tier"),
      ("disk_dir_is_file", ["--kv_tiers=disk", f"--kv_disk_dir={tmp / 'a_file'}"], "not a directory"),
      ("redis_without_url", ["--kv_tiers=host,redis"], "--kv_store_url is required with the redis tier"),
      ("mooncake_without_url", ["--kv_tiers=mooncake"], "--kv_store_url is required with the mooncake tier"),
      ("redis_and_mooncake", ["--kv_tiers=redis,mooncake", "--kv_store_url=redis://h:1/0"], "one shared store"),
      ("url_scheme", ["--kv_tiers=redis", "--kv_store_url=http://127.0.0.1:6379/0"], "redis:// or rediss://"),
      ("url_wrong_tier", ["--kv_tiers=mooncake", "--kv_store_url=redis://127.0.0.1:6379/0"], "mooncake://"),
      ("url_port", ["--kv_tiers=redis", "--kv_store_url=redis://127.0.0.1:port/0"], "port"),
      ("url_host", ["--kv_tiers=redis", "--kv_store_url=redis://:6379/0"], "needs a host"),
      ("url_metadata", ["--kv_tiers=mooncake", "--kv_store_url=mooncake://127.0.0.1:50051"], "?metadata="),
      ("redis_down_strict", ["--kv_tiers=redis", f"--kv_store_url={dead}", "--kv_tiers_strict"],
       "KV tier redis unavailable (ConnectionError"),
      ("checkpoint_missing", [f"--checkpoint={tmp / 'ck'}"], f"{tmp / 'ck'}: no such directory"),
      ("checkpoint_empty", [f"--checkpoint={tmp / 'empty'}"], f"{tmp / 'empty'}: empty directory — {KINDS}"),
      ("checkpoint_is_file", [f"--checkpoint={tmp / 'a_file'}"], "not a directory"),
      ("checkpoint_config_only", [f"--checkpoint={tmp / 'cfg_only'}"], "no *.safetensors shards and no params/"),
      ("checkpoint_junk", [f"--checkpoint={tmp / 'junk'}"], "not a checkpoint directory"),
      ("bad_enum", ["--dtype=fp16"], "--dtype=fp16: value should be one of <auto|fp32|bf16>"),
      ("unknown_flag", ["--max_new_tokens=3"], "Unknown command line flag 'max_new_tokens'"),
      ("retention", ["--retention_interval=100"], "multiple of 128"),
      ("nnx_mesh", ["--model_api=nnx", "--mesh=tensor:2"], "--model_api=nnx runs on one device"),
      ("zero_rows", ["--max_num_seqs=0"], "--max_num_seqs=0: must be >= 1"),
      ("engine_validate", ["--cpu_step_opt_level=7"], "--cpu_step_opt_level: an integer in -1..3"),
      ("bad_preset", ["--model=random", "--preset=v9"], "--preset=v9: unknown"),
      ("drafts_without_mtp", ["--model=v4_retrieval", "--num_speculative_tokens=2"], "has no MTP block"),
      ("drafts_release_without_mtp", [f"--checkpoint={tmp / 'no_mtp'}", "--num_speculative_tokens=2"],
       f"{tmp / 'no_mtp'} has no MTP block"),
      ("redis_client_missing", [NO_REDIS, "--kv_tiers=redis", "--kv_store_url=redis://127.0.0.1:6379/0"],
       "needs the redis client library: pip install redis"),
  ]


# Each way a mistake is found goes through the command line once (absl's parser, the checks, the --requests file, a
# config.json read, the tiers' probe, a missing client library); every case goes through the checks in process.
CLI = ("bad_enum", "unknown_flag", "zero_rows", "requests_missing", "drafts_release_without_mtp", "redis_down_strict",
       "redis_client_missing")


def test_every_flag_mistake_is_one_line_exit_2_before_the_model_loads(tmp_path):
  failures = []
  for name, args, want in _cases(tmp_path):
    if name not in CLI:
      continue
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "experiments.serve"]
    if NO_REDIS in args:
      args = [a for a in args if a != NO_REDIS]
      cmd = [sys.executable, "-c", "import runpy, sys; sys.modules['redis'] = None; sys.argv[0] = 'serve'; "
             "runpy.run_module('experiments.serve', run_name='__main__')"]
    p = subprocess.run([*cmd, f"--out_dir={tmp_path / 'out'}", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    dt = time.perf_counter() - t0
    lines = p.stderr.strip().splitlines()
    ok = (p.returncode == 2 and len(lines) == 1 and lines[0].startswith("serve: ") and want in lines[0]
          and "Traceback" not in p.stderr and not p.stdout and dt < 30)
    if not ok:
      failures.append((name, p.returncode, round(dt, 1), p.stderr[-600:]))
  assert not failures, failures
  assert not os.path.exists(tmp_path / "out")       # nothing written: it stopped before the model loaded


def test_every_flag_mistake_is_a_one_line_flag_error_from_the_checks(tmp_path, monkeypatch):
  """What the command line runs before the model loads (serve_lib.run's first step), on the parsed flags."""
  from absl import flags

  from experiments import serve_checks, serve_options
  failures = []
  for name, args, want in _cases(tmp_path):
    if name in ("bad_enum", "unknown_flag"):          # absl's parser refuses them: the command line case above
      continue
    with monkeypatch.context() as m:
      if NO_REDIS in args:
        m.setitem(sys.modules, "redis", None)
        args = [a for a in args if a != NO_REDIS]
      fv = flags.FlagValues()
      serve_options.define_flags(fv)
      fv(["serve", f"--out_dir={tmp_path / 'out'}", *args])
      options = serve_options.options_from_flags(fv)
      try:
        serve_checks.probe_tiers(options, serve_checks.check_options(options))
        failures.append((name, "no error"))
      except serve_checks.FlagError as e:
        if want not in str(e) or "\n" in str(e):
          failures.append((name, str(e)))
  assert not failures, failures
  assert not os.path.exists(tmp_path / "out")


def test_release_checkpoint_missing_its_config_is_a_load_error_naming_the_file(tmp_path):
  (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"")
  p = subprocess.run([sys.executable, "-m", "experiments.serve", f"--checkpoint={tmp_path}",
                      f"--out_dir={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
  assert f"{tmp_path / 'config.json'}: no such file" in p.stderr
  assert "orbax" not in p.stderr                     # never worded as an orbax directory


# ---------------------------------------------------------------------------------------------------- in process
def test_metrics_are_strict_json():
  import numpy as np
  from experiments.serve_io import finite, format_table
  d = finite({"a": float("nan"), "b": [1.0, float("inf"), np.float32(2.5), np.float64("nan")],
              "c": {"d": -float("inf"), "e": "x", "f": 3, "g": None}, "h": np.int64(7)})
  assert d == {"a": None, "b": [1.0, None, 2.5, None], "c": {"d": None, "e": "x", "f": 3, "g": None}, "h": 7}
  json.dumps(d, allow_nan=False)
  assert "| a" in format_table({"a": None, "b": 0.5}) and "-" in format_table({"a": None})


class _Tier:
  def __init__(self, name):
    self.name, self.metrics, self.last_error = name, {}, ""


class _Tiering:
  def __init__(self, *names):
    self.store = type("S", (), {"tiers": [_Tier(n) for n in names]})()


def test_a_failing_tier_is_one_warning_line_or_fatal_when_strict(capsys):
  from experiments import serve_lib
  tiering = _Tiering("host", "redis")
  watch = serve_lib.TierWatch(strict=False)
  watch(tiering)
  assert capsys.readouterr().err == ""
  redis = tiering.store.tiers[1]
  redis.metrics["failures"], redis.last_error = 1, "put: ConnectionError: refused"
  for _ in range(3):                                 # fails again and again: still one line
    redis.metrics["failures"] += 1
    watch(tiering)
  err = capsys.readouterr().err.splitlines()
  assert err == ["serve: warning: KV tier redis unavailable (put: ConnectionError: refused); continuing without it"]
  strict = serve_lib.TierWatch(strict=True)
  with pytest.raises(serve_lib.TierFatal, match="KV tier redis unavailable .* --kv_tiers_strict"):
    strict(tiering)


class _Req:
  def __init__(self, rid, output):
    self.rid, self.output = rid, list(output)


class _Engine:
  """What the stop-string hook touches: the running requests and stop_request."""

  def __init__(self, reqs):
    self.running, self.stopped = list(reqs), []

  def stop_request(self, rid, reason="stop"):
    self.stopped.append((rid, reason))
    self.running = [r for r in self.running if r.rid != rid]
    return True


class _Tok:
  def decode(self, ids):
    return " ".join(f"w{i}" for i in ids)


def test_stop_strings_stop_generation_at_the_token_that_completes_them():
  from dsv4.engine.api import StopStrings
  a, b, c = _Req("a", [10]), _Req("b", [10]), _Req("c", [10])
  eng = _Engine([a, b, c])
  hook = StopStrings(_Tok(), {"a": ["w12 w1"], "b": ["never"]})       # "w12 w1" spans two tokens
  for tok in (11, 12, 13, 14):
    for r in eng.running:
      r.output.append(tok if r.rid != "a" or tok != 13 else 15)
    hook(eng)
    if eng.stopped:
      break
  assert eng.stopped == [("a", "stop")] and a.output == [10, 11, 12, 15]   # stopped after the completing token
  assert [r.rid for r in eng.running] == ["b", "c"]
  assert hook.text("a", a.output) == ("w10 w11 ", "w12 w1")           # text cut before the stop string
  assert hook.text("b", b.output) == ("w10 w11 w12 w13", None) and hook.text("c", [5]) == ("w5", None)
  # a stop string completed by the step that also ended the request (length): still cut, still reported
  assert StopStrings(_Tok(), {"x": ["w9"]}).text("x", [7, 9, 8]) == ("w7 ", "w9")


def test_dtype_and_quantized_cache_at_load(tmp_path):
  from experiments import serve_checks, serve_model
  from tests.dsv4.test_loading_pretrained import make_checkpoint_dir
  cfg, params, _ = serve_model.load_model("v4_retrieval")
  assert serve_model.params_dtype(params) == "fp32"              # auto: the trained models store fp32
  _, params, _ = serve_model.load_model("v4_retrieval", dtype="bf16")
  assert serve_model.params_dtype(params) == "bf16"
  with pytest.raises(serve_checks.FlagError, match="--quantized_cache=on: .*V4.1-only"):
    serve_model.load_model("v4_retrieval", quantized_cache=True)
  make_checkpoint_dir(tmp_path / "v4", "saved")                 # bf16 shards
  _, params, _ = serve_model.load_model("v4_retrieval", checkpoint=str(tmp_path / "v4"))
  assert serve_model.params_dtype(params) == "bf16"
  _, params, _ = serve_model.load_model("v4_retrieval", checkpoint=str(tmp_path / "v4"), dtype="fp32")
  assert serve_model.params_dtype(params) == "fp32"
  make_checkpoint_dir(tmp_path / "nemo", "nemo")                # NeMo V4.1: quantized cache on by default
  cfg, _, _ = serve_model.load_model("v4_retrieval", checkpoint=str(tmp_path / "nemo"))
  assert cfg.quantized_cache
  cfg, _, _ = serve_model.load_model("v4_retrieval", checkpoint=str(tmp_path / "nemo"), quantized_cache=False)
  assert not cfg.quantized_cache


def test_kernels_flag_sets_the_engines_backend_and_pallas_needs_a_gpu(tmp_path):
  """--kernels=xla|pallas|auto is EngineConfig.kernel.backend; 'pallas' off a GPU is a flag error found before the
  model loads (and an Engine refuses it at construction); the preset v4_flash_layers:N passes the checks."""
  import jax

  from dsv4.config import get_preset
  from dsv4.engine.config import EngineConfig
  from dsv4.engine.engine import Engine
  from experiments import serve_checks, serve_lib
  from experiments.serve_options import ServeOptions
  from pallas_kernels import dispatch
  for k in ("auto", "xla", "pallas"):
    assert serve_lib.engine_config(ServeOptions(kernels=k), "m", {}, []).kernel.backend == k
  serve_checks.check_options(ServeOptions(model="random", preset="v4_flash_layers:4", out_dir=str(tmp_path)))
  assert get_preset("v4_flash_layers:4").attention.num_heads == 64
  with pytest.raises(ValueError, match="EngineConfig.kernel: kernel backend 'mosaic'"):
    EngineConfig(kernel=dispatch.KernelConfig(backend="mosaic")).validate()
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is here: 'pallas' is allowed")
  with pytest.raises(serve_checks.FlagError, match="--kernels=pallas: kernel backend 'pallas' needs a GPU"):
    serve_lib.run(ServeOptions(kernels="pallas", out_dir=str(tmp_path / "out")))
  assert not (tmp_path / "out").exists()
  with pytest.raises(ValueError, match="needs a GPU"):
    Engine({}, get_preset("v4_tiny"), EngineConfig(kernel=dispatch.KernelConfig(backend="pallas")))

"""Config errors name the bad field (or serve flag) and what is allowed; no model is built."""

import dataclasses

import pytest

from dsv4.engine.config import EngineConfig
from dsv4.engine.tiering_config import TieringConfig


@pytest.mark.parametrize("kw, msg", [
    ({"policy": "maybe"}, r"TieringConfig\.policy: one of auto, load, recompute, got 'maybe'"),
    ({"demote": "later"}, r"TieringConfig\.demote: one of evict, store, got 'later'"),
    ({"tiers": ("host", "ssd")}, r"TieringConfig\.tiers: unknown tier\(s\) 'ssd'; choose from host, disk"),
    ({"tiers": ("host", "host")}, r"TieringConfig\.tiers: each tier at most once"),
    ({"tiers": "host"}, r"TieringConfig\.tiers: a tuple"),
    ({"tiers": ("disk",)}, r"TieringConfig\.disk_dir is required with the disk tier"),
    ({"tiers": ("redis",)}, r"TieringConfig\.store_url is required with the redis tier.*cache\.tiers\.servers redis"),
    ({"tiers": ("mooncake",)}, r"TieringConfig\.store_url is required with the mooncake tier"),
    ({"tiers": ("redis", "mooncake"), "store_url": "redis://h/0"}, r"TieringConfig\.tiers: one shared store"),
    ({"tiers": ("redis",), "store_url": "127.0.0.1:6379"},
     r"TieringConfig\.store_url: bad redis URL '127\.0\.0\.1:6379'"),
    ({"tiers": ("redis",), "store_url": "redis://h:x/0"}, r"TieringConfig\.store_url: bad redis URL .*port"),
    ({"tiers": ("mooncake",), "store_url": "mooncake://h:1"}, r"TieringConfig\.store_url: bad mooncake URL .*metadata"),
    ({"capacity_bytes": (1, 2)}, r"TieringConfig\.capacity_bytes"),
    ({"ttl_s": 0}, r"TieringConfig\.ttl_s: > 0 or None"),
    ({"tier_timeout_s": 0}, r"TieringConfig\.tier_timeout_s: > 0, got 0"),
    ({"write_queue": -1}, r"TieringConfig\.write_queue: >= 0"),
    ({"key_bits": 129}, r"TieringConfig\.key_bits"),
])
def test_tiering_config_names_the_bad_field(kw, msg):
  with pytest.raises(ValueError, match=msg):
    TieringConfig(**kw).validate()
  # an engine config carrying it fails the same way, before anything is built
  with pytest.raises(ValueError, match=msg):
    EngineConfig(tiering=TieringConfig(**kw)).validate()


def test_good_tiering_configs_pass():
  TieringConfig().validate()
  TieringConfig(tiers=("host", "disk", "redis"), disk_dir="/tmp/x", store_url="redis://127.0.0.1:6379/0",
                policy="load", demote="store", capacity_bytes=(1, 2, 3)).validate()
  TieringConfig(tiers=("mooncake",), store_url="mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/m").validate()


@pytest.mark.parametrize("args, msg", [
    (("host,disk",), r"^--kv_disk_dir is required with the disk tier"),
    (("host,redis", "/tmp/d"), r"^--kv_store_url is required with the redis tier"),
    (("mooncake",), r"^--kv_store_url is required with the mooncake tier"),
    (("redis", "", "localhost:6379"), r"^--kv_store_url: bad redis URL 'localhost:6379'"),
    (("host,nvme",), r"^--kv_tiers: unknown tier\(s\) 'nvme'"),
])
def test_from_flags_refuses_a_tier_without_its_place(args, msg):
  with pytest.raises(ValueError, match=msg) as e:
    TieringConfig.from_flags(*args)
  assert "\n" not in str(e.value)


def test_from_flags_builds_what_was_asked():
  assert TieringConfig.from_flags("") is None
  tc = TieringConfig.from_flags("host, disk,redis", "/tmp/d", "redis://127.0.0.1:7000/2")
  assert tc.tiers == ("host", "disk", "redis") and tc.store_url == "redis://127.0.0.1:7000/2"


@pytest.mark.parametrize("field, value, msg", [
    ("max_num_seqs", 0, r"EngineConfig\.max_num_seqs: an integer >= 1, got 0"),
    ("max_num_batched_tokens", -4, r"EngineConfig\.max_num_batched_tokens: an integer >= 1, got -4"),
    ("chunk_size", 0, r"EngineConfig\.chunk_size: an integer >= 1, got 0"),
    ("max_model_len", 0, r"EngineConfig\.max_model_len"),
    ("num_swa_blocks", 2.5, r"EngineConfig\.num_swa_blocks: an integer >= 1, got 2\.5"),
    ("retention_interval", -1, r"EngineConfig\.retention_interval: an integer >= 0"),
    ("dtype", "fp16", r"EngineConfig\.dtype: 'fp32' or 'bf16', got 'fp16'"),
    ("model_api", "flax", r"EngineConfig\.model_api: 'functional' or 'nnx', got 'flax'"),
    ("num_speculative_tokens", 9, r"EngineConfig\.num_speculative_tokens: an integer in 0\.\.8"),
    ("cpu_step_opt_level", 4, r"EngineConfig\.cpu_step_opt_level: an integer in -1\.\.3"),
    ("gpu_step_command_buffers", "FUSION,LOOPS", r"EngineConfig\.gpu_step_command_buffers: comma-separated names"),
    ("gpu_step_command_buffers", "FUSION, WHILE", r"EngineConfig\.gpu_step_command_buffers: comma-separated names"),
])
def test_engine_config_names_the_bad_field(field, value, msg):
  with pytest.raises(ValueError, match=msg):
    dataclasses.replace(EngineConfig(), **{field: value}).validate()
  EngineConfig().validate()


def test_cpu_step_options_reach_the_step_program_unless_xla_flags_set_them(monkeypatch):
  import jax
  from dsv4.engine import step_program
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
  on_cpu = jax.default_backend() == "cpu"
  hoist = (step_program.NO_LOOP_HOISTING,) if on_cpu else ()
  assert step_program.step_compiler_options(1) == (
      tuple(sorted(hoist + (("xla_backend_optimization_level", 1),))) if on_cpu else ())
  assert step_program.step_compiler_options(-1) == hoist
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")      # the user's (or the suite's) level wins
  assert step_program.step_compiler_options(1) == hoist
  monkeypatch.setenv("XLA_FLAGS", "--xla_disable_hlo_passes=fusion")         # so do the user's disabled passes
  assert step_program.step_compiler_options(-1) == ()
  # one jitted program per distinct option set, named as compile logs show it
  assert step_program.jitted_ragged_step(()) is step_program.ragged_step
  assert step_program.jitted_ragged_step((("xla_backend_optimization_level", 1),)) is not step_program.ragged_step
  assert step_program.ragged_step.__name__ == "ragged_step"


def test_gpu_command_buffers_reach_the_step_program_on_a_gpu(monkeypatch):
  """EngineConfig.gpu_step_command_buffers becomes the step's `xla_gpu_enable_command_buffer` on a GPU backend only
  (XLA parses the comma-separated names per compile); the CPU's options ignore it."""
  import jax
  from dsv4.engine import step_program
  cmds = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
  dataclasses.replace(EngineConfig(), gpu_step_command_buffers=cmds).validate()
  on_cpu = step_program.step_compiler_options(-1)
  assert step_program.step_compiler_options(-1, cmds) == on_cpu
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert step_program.step_compiler_options(-1, cmds) == (("xla_gpu_enable_command_buffer", cmds),)
  assert step_program.step_compiler_options(2, "") == ()

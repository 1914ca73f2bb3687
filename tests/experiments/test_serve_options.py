"""The main job's flags are built from fields: ServeOptions' (the job's own) and EngineConfig's (the engine's), each
with the field's default and help. Every EngineConfig field is a flag or listed with the reason it is not; the
flags' defaults build the engine serve has always run (EngineConfig's defaults but serve's two smaller pools); the
spellings in the README's commands parse to the fields they mean. And the generic helper
(experiments/dataclass_flags.py) on a toy dataclass. No model, no device."""

import dataclasses
import enum

import pytest
from absl import flags

from dsv4.engine.config import EngineConfig
from experiments import serve_options
from experiments.dataclass_flags import DataclassFlags, FlagOverride
from experiments.serve_options import ENGINE_FLAGS, ENGINE_NOT_FLAGS, OPTION_FLAGS, ServeOptions

SCALARS = ("bool", "int", "float", "str")
# serve's own engine defaults where they differ from EngineConfig's (serve_options.ENGINE_FLAG_OVERRIDES says why)
SERVE_POOLS = {"num_full_blocks": 128, "num_swa_blocks": 256}


def _parsed(*args) -> flags.FlagValues:
  fv = flags.FlagValues()
  serve_options.define_flags(fv)
  fv(["serve", *args])
  return fv


def test_every_engine_field_is_a_flag_or_listed_with_a_reason():
  for f in dataclasses.fields(EngineConfig):
    assert f.metadata.get("help"), f"EngineConfig.{f.name} has no help text"
    if f.name in ENGINE_NOT_FLAGS:
      assert f.name not in ENGINE_FLAGS.specs and len(ENGINE_NOT_FLAGS[f.name]) > 20, f.name     # a reason, not a tag
    else:
      assert f.type in SCALARS and f.name in ENGINE_FLAGS.specs, f"EngineConfig.{f.name}: neither a flag nor listed"
  assert [f.name for f in dataclasses.fields(ServeOptions) if f.name not in OPTION_FLAGS.specs] == ["engine"]
  names = [*ENGINE_FLAGS.flag_names.values(), *OPTION_FLAGS.flag_names.values()]
  assert len(names) == len(set(names))          # no flag spelled twice


def test_flag_defaults_round_trip_to_the_engine_serve_runs():
  options = serve_options.options_from_flags(_parsed())
  assert options == ServeOptions()
  assert options.engine == dataclasses.replace(EngineConfig(), **SERVE_POOLS) == serve_options.SERVE_ENGINE
  options.engine.validate()
  for f in dataclasses.fields(EngineConfig):      # every other field: EngineConfig's own default, same type
    mine, theirs = getattr(options.engine, f.name), getattr(EngineConfig(), f.name)
    if f.name not in SERVE_POOLS:
      assert mine == theirs and type(mine) is type(theirs), f.name


def test_readme_spellings_parse_to_the_fields_they_mean():
  o = serve_options.options_from_flags(_parsed(
      "--prefix_caching=false", "--retention_interval=128", "--mesh=data:2,tensor:2,expert:2", "--num_cpu_devices=8",
      "--model_api=nnx", "--model=v4_retrieval_mtp", "--num_speculative_tokens=2",
      "--requests=reqs.jsonl", "--checkpoint=ckpt/v4_release", "--kv_tiers=host,disk", "--kv_disk_dir=/tmp/kv",
      "--nodefer_shared_prefix"))
  ec = o.engine
  assert not ec.enable_prefix_caching and ec.retention_interval == 128
  assert ec.model_api == "nnx" and type(ec.model_api) is str                      # an enum flag, a str field
  assert ec.num_speculative_tokens == 2 and not ec.defer_shared_prefix
  assert (o.mesh, o.num_cpu_devices, o.model, o.requests, o.checkpoint) == (
      "data:2,tensor:2,expert:2", 8, "v4_retrieval_mtp", "reqs.jsonl", "ckpt/v4_release")
  assert o.tier_kinds == ["host", "disk"] and o.kv_disk_dir == "/tmp/kv"
  assert serve_options.flag_name("enable_prefix_caching") == "--prefix_caching"
  assert serve_options.flag_name("kv_tiers") == "--kv_tiers"


class Color(enum.Enum):
  RED = 1
  BLUE = 2


@dataclasses.dataclass(frozen=True)
class Toy:
  n: int = dataclasses.field(default=3, metadata={"help": "n"})
  growth: int = dataclasses.field(default=4, metadata={"help": "g", "choices": (2, 4)})
  frac: float = dataclasses.field(default=0.5, metadata={"help": "f"})
  on: bool = dataclasses.field(default=True, metadata={"help": "b"})
  name: str = dataclasses.field(default="a", metadata={"help": "s", "choices": ("a", "b")})
  color: Color = dataclasses.field(default=Color.RED, metadata={"help": "e"})
  nested: tuple = (1, 2)


def test_dataclass_flags_on_a_toy():
  toy = DataclassFlags(Toy, overrides={"n": FlagOverride(name="count", default=5), "name": FlagOverride(
      choices=("a", "b", "c"))}, not_flags={"nested": "a tuple: no flag"})
  fv = flags.FlagValues()
  toy.define(fv)
  fv(["toy"])
  assert toy.build(fv) == toy.defaults() == Toy(n=5)
  fv(["toy", "--count=7", "--growth=2", "--frac=0.25", "--noon", "--name=c", "--color=BLUE"])
  built = toy.build(fv, nested=(3,))
  assert built == Toy(n=7, growth=2, frac=0.25, on=False, name="c", color=Color.BLUE, nested=(3,))
  with pytest.raises(flags.IllegalFlagValueError):
    fv(["toy", "--growth=3"])
  with pytest.raises(TypeError, match="Toy.nested: type .* has no flag; list it in not_flags"):
    DataclassFlags(Toy)
  with pytest.raises(ValueError, match="Toy has no field.* colour"):
    DataclassFlags(Toy, not_flags={"nested": "x", "colour": "renamed"})
  with pytest.raises(TypeError, match="choices make an enum flag of an int or str field"):
    DataclassFlags(Toy, overrides={"frac": FlagOverride(choices=(0.5,))}, not_flags={"nested": "x"})

  @dataclasses.dataclass(frozen=True)
  class NoHelp:
    n: int = 1

  with pytest.raises(TypeError, match="NoHelp.n: no help text"):
    DataclassFlags(NoHelp)

"""absl flags from a frozen dataclass's fields, and the dataclass back from the parsed flags.

A script states its settings once, as dataclass fields with a help text each (`metadata={"help": ...}`, optionally
`"choices": (...)`), and gets one flag per scalar field with the field's own default, so a flag's default and help
cannot drift from the dataclass:

    ENGINE_FLAGS = DataclassFlags(EngineConfig, overrides={"num_full_blocks": FlagOverride(default=128)},
                                  not_flags={"layout": "built from --kv_dtype"})
    ENGINE_FLAGS.define(flags.FLAGS)              # at import, like any absl flag
    ec = ENGINE_FLAGS.build(flags.FLAGS, model_id=name)   # in main: the flags' values, plus the fields given here

Scalar fields are bool, int, float, str and enum.Enum subclasses; an int or str field with choices is an enum flag
(int choices are spelled as strings on the command line and converted back). Every other field (nested configs,
optional values) must be listed in `not_flags` with the reason, so a field added later is a flag or a decision,
never silently missing.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any, Mapping

from absl import flags

flags.disclaim_key_flags()      # flags defined through here belong to the module that asks (its --help lists them)

_UNSET = object()
_SCALARS = (bool, int, float, str)


@dataclasses.dataclass(frozen=True)
class FlagOverride:
  """How one script's flag departs from its field: another spelling, default, choices or help."""
  name: str | None = None
  default: Any = _UNSET
  choices: tuple | None = None
  help: str | None = None


@dataclasses.dataclass(frozen=True)
class FlagSpec:
  """One field's flag, as defined."""
  field: str
  flag: str
  kind: type                          # bool, int, float, str or an enum.Enum subclass
  default: Any
  choices: tuple | None
  help: str


class DataclassFlags:
  """The flags of one dataclass: `define` them on a FlagValues, `build` the dataclass from the parsed values."""

  def __init__(self, cls: type, *, overrides: Mapping[str, FlagOverride] | None = None,
               not_flags: Mapping[str, str] | None = None):
    overrides, not_flags = dict(overrides or {}), dict(not_flags or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted((set(overrides) | set(not_flags)) - set(fields))
    if unknown:                        # a renamed field must not leave a stale entry behind
      raise ValueError(f"{cls.__name__} has no field(s) {', '.join(unknown)}")
    both = sorted(set(overrides) & set(not_flags))
    if both:
      raise ValueError(f"{cls.__name__}: {', '.join(both)} both overridden and listed as not a flag")
    hints = typing.get_type_hints(cls)
    self.cls, self.not_flags, self.specs = cls, not_flags, {}
    for name, f in fields.items():
      if name in not_flags:
        continue
      kind = hints[name]
      if not (kind in _SCALARS or (isinstance(kind, type) and issubclass(kind, enum.Enum))):
        raise TypeError(f"{cls.__name__}.{name}: type {kind} has no flag; list it in not_flags with the reason")
      o = overrides.get(name, FlagOverride())
      default = o.default if o.default is not _UNSET else _field_default(f)
      if default is _UNSET:
        raise TypeError(f"{cls.__name__}.{name}: no default; give one in its FlagOverride")
      help_text = o.help or f.metadata.get("help")
      if not help_text:
        raise TypeError(f"{cls.__name__}.{name}: no help text (field metadata 'help')")
      choices = o.choices if o.choices is not None else f.metadata.get("choices")
      if choices is not None and kind not in (int, str):
        raise TypeError(f"{cls.__name__}.{name}: choices make an enum flag of an int or str field, not of {kind}")
      self.specs[name] = FlagSpec(name, o.name or name, kind, default, tuple(choices) if choices else None, help_text)

  @property
  def flag_names(self) -> dict[str, str]:
    """field -> flag spelling, for messages that name the flag."""
    return {s.field: s.flag for s in self.specs.values()}

  def define(self, flag_values: flags.FlagValues = flags.FLAGS, module_name: str | None = None) -> None:
    for s in self.specs.values():
      kw = {"flag_values": flag_values}
      if module_name:
        kw["module_name"] = module_name
      if s.choices is not None:
        flags.DEFINE_enum(s.flag, str(s.default), [str(c) for c in s.choices], s.help, **kw)
      elif issubclass(s.kind, enum.Enum):
        flags.DEFINE_enum_class(s.flag, s.default, s.kind, s.help, **kw)
      else:
        define = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, float: flags.DEFINE_float,
                  str: flags.DEFINE_string}[s.kind]
        define(s.flag, s.default, s.help, **kw)

  def values(self, flag_values: flags.FlagValues = flags.FLAGS) -> dict[str, Any]:
    """field -> value of its parsed flag, in the field's own type."""
    out = {}
    for s in self.specs.values():
      v = flag_values[s.flag].value
      out[s.field] = s.kind(v) if s.choices is not None and s.kind is int else v   # an int enum: "4" -> 4
    return out

  def defaults(self, **fields) -> Any:
    """The dataclass as the flags' defaults make it (overrides included); `fields` gives the others."""
    return self.cls(**{**{s.field: s.default for s in self.specs.values()}, **fields})

  def build(self, flag_values: flags.FlagValues = flags.FLAGS, **fields) -> Any:
    """The dataclass from the parsed flags; `fields` gives the others (or overrides a flag's value)."""
    return self.cls(**{**self.values(flag_values), **fields})


def _field_default(f: dataclasses.Field) -> Any:
  if f.default is not dataclasses.MISSING:
    return f.default
  if f.default_factory is not dataclasses.MISSING:
    return f.default_factory()
  return _UNSET

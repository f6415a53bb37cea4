"""Options declared once, as dataclass fields: the one helper every options dataclass uses.

    beam_size: int = opt(4, "Beam width; 1 runs greedy search.")
    out: Path = opt(help="Model directory to create.", path="any")        # required

`opt(default, help, **cli)` is a dataclass field that is also a command-line option: its default, its help
text and click-only settings (choices=..., min=..., max=..., metavar=..., multiple=True, path="dir" or "any",
exists=True, show_default=False, flag="--dtype", convert=f). pipeline/cli_options.py generates the click option
of every field that has a help text; runtime/, export/ and pipeline/ declare their fields with this one
function (runtime/ and export/ cannot import pipeline, tests/test_layout.py).

`Checked` gives a dataclass `flag(name)` (the field's command-line option) and `validate()` over its own
`problems(name)`, which names each field as `name` phrases it: the CLI's flags by default, the HTTP API's JSON
fields, or generation_config.json's names at import."""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from runtime.errors import RuntimeUserError

C = TypeVar("C", bound="Checked")


def opt(default: Any = dataclasses.MISSING, help: str = "", **cli: Any) -> Any:
    """A dataclass field that is also a command-line option (see the module's docstring for `cli`). A `bool | None`
    field defaulting to None is a --flag/--no-flag option that leaves None unless given."""
    metadata = {"help": help, "cli": cli}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag(field_name: str) -> str:
    """The command-line option of a field without a flag of its own: beam_size -> --beam-size."""
    return "--" + field_name.replace("_", "-")


def with_value(field_name: str, value: Any) -> str:
    """A field's option as it would be typed with this value: ("alpha", 1.0) -> "--alpha 1"."""
    return f"{flag(field_name)} {value:g}" if isinstance(value, float) else f"{flag(field_name)} {value}"


def flag_of(cls: type, name: str) -> str:
    """The command-line option of one field of `cls`: its cli `flag` (precision -> --dtype), else --field-name."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return str(f.metadata.get("cli", {}).get("flag") or flag(name))
    raise KeyError(f"{cls.__name__} has no field {name!r}")


class Checked:
    """A mixin for an options dataclass: `problems(name)` lists every impossible setting at once, each naming its
    field as `name` phrases it (the CLI's flag by default); `validate()` is self, or one `error` listing them."""

    error: ClassVar[type[Exception]] = RuntimeUserError

    @classmethod
    def flag(cls, name: str) -> str:
        return flag_of(cls, name)

    def problems(self, name: Callable[[str], str] | None = None) -> list[str]:
        return []

    def validate(self: C, name: Callable[[str], str] | None = None) -> C:
        problems = self.problems(name)
        if problems:
            raise self.error("; ".join(problems))
        return self


_KINDS = {"int": ((numbers.Integral,), "an integer"), "float": ((numbers.Real,), "a number"),
          "bool": ((bool,), "True or False")}  # (numpy's numbers too; a str field may be another thing that names
# one, a torch.device for a device: the fields' own checks read them)


def declared_types(obj: Any, n: Callable[[str], str] = flag) -> list[str]:
    """The fields of options dataclass `obj` whose value is not of its declared type (int, float, bool, or one of
    them | None; a Path takes a str too): a caller from Python passed threads="2" or max_steps=2.5 unchecked,
    and they failed deep in a library, or were taken."""
    out = []
    for f in dataclasses.fields(obj):
        declared, value = str(f.type), getattr(obj, f.name)
        optional = declared.endswith(" | None")
        base = declared.removesuffix(" | None")
        if value is None and optional:
            continue
        if base == "Path":
            if not isinstance(value, (str, os.PathLike)):
                out.append(f"{n(f.name)} must be a path (got {value!r:.40})")
            continue
        if base not in _KINDS:
            continue
        kinds, what = _KINDS[base]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            out.append(f"{n(f.name)} must be {what}{' or None' if optional else ''} (got {value!r:.40})")
    return out


def declared_bounds(obj: Any, n: Callable[[str], str] = flag) -> list[str]:
    """The fields of options dataclass `obj` outside the min/max their opt() declares (what click checks for the
    command line; a caller from Python passed them unchecked: export_model(atol=-1) failed after the export)."""
    out = []
    for f in dataclasses.fields(obj):
        cli, value = f.metadata.get("cli", {}), getattr(obj, f.name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if cli.get("min") is not None and value < cli["min"]:
            out.append(f"{n(f.name)} must be at least {cli['min']} (got {value})")
        elif cli.get("max") is not None and value > cli["max"]:
            out.append(f"{n(f.name)} must be at most {cli['max']} (got {value})")
    return out


def at_least(value: float | None, least: float, field_name: str, n: Callable[[str], str]) -> list[str]:
    """[the problem] when `value` (None: not given) is below `least`, else []: the problem most options have."""
    if value is None or value >= least:
        return []
    return [f"{n(field_name)} must be at least {least} (got {value})"]

"""Click options generated from the dataclasses that own them, so each default and help text
has one home.

`options_from(Cls)` turns every field of an options dataclass that carries a help text
(`opt(default, help)`, runtime/fields.py's one helper, re-exported here) into a click option with that
default, help and a type derived from the annotation (`field_option`); the command receives the fields by
name and `pick(Cls, values)` builds the dataclass from them. `decoding_options` does the same for
runtime.decoding.DecodingOptions through field_option and hands the command one validated `decoding` object.
Used by every command: `train` (TrainOptions), `average` (AverageOptions), `export` (ExportOptions), `serve`
(RequestLimits, ServeHttpOptions), `bench` (BenchOptions, ServeBenchOptions), `parity` (ParityOptions),
`demo` (DemoOptions), `tune-decoding` (TuneOptions), `random-checkpoint`, `doctor`, `import`, and every
command that loads or decodes a model dir (LoadOptions, DecodingOptions). tests/test_cli_fields.py allows at
most ten options written by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from runtime.decoding import OPTION_NAMES, PAPER, DecodingOptions
from runtime.fields import opt
from runtime.registry import backend_names, installed

__all__ = ["decoding_options", "field_option", "opt", "options_from", "parse_backends", "pick"]

# what a model dir's manifest may set (an import's generation config; a GPU's batch budget): DecodingOptions.for_model
MODEL_DEFAULTS = frozenset({"beam_size", "alpha", "max_len_a", "max_len_b", "min_len", "rules", "batch_tokens"})
_FIELDS = {f.name: f for f in dataclasses.fields(DecodingOptions) if f.name in OPTION_NAMES}
_HINTS = typing.get_type_hints(DecodingOptions)


def _base_type(annotation: Any) -> Any:
    """int for `int`, `int | None` and `Optional[int]`."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


def _click_type(base: Any, cli: dict[str, Any]) -> Any:
    if "choices" in cli:
        return click.Choice(list(cli["choices"]))
    if base is Path:
        if cli.get("path") == "any":
            return GivenPath(path_type=Path, exists=cli.get("exists", False))
        directory = cli.get("path") == "dir"
        return GivenPath(path_type=Path, file_okay=not directory, dir_okay=directory,
                          exists=cli.get("exists", False))
    if base is int:
        return click.IntRange(min=cli.get("min"), max=cli.get("max")) if "min" in cli or "max" in cli else int
    if base is float:
        return FiniteFloatRange(min=cli.get("min"), max=cli.get("max")) if "min" in cli or "max" in cli else FINITE
    return str


MODEL_DIR_KIND = "a model directory (a checkpoint becomes one with `pipeline export CHECKPOINT --out DIR`)"


class GivenPath(click.Path):
    """click.Path that refuses an empty path ('' from an unset shell variable), which click would take for the
    current directory: `train --save-dir "$RUN"` trained into it, `import x --out ''` wrote there."""

    def __init__(self, *args: Any, kind: str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.kind = kind  # a directory argument's meaning, for a file given in its place

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value:
            self.fail("is an empty path (is a shell variable unset?)", param, ctx)
        if self.kind and isinstance(value, str) and os.path.isfile(value):  # click: "Directory 'x.pt' is a file."
            self.fail(f"{value!r} is a file, not {self.kind}", param, ctx)
        if value == "-" and self.exists and not self.allow_dash:  # click: "File '-' does not exist."
            self.fail("'-' (standard input) cannot be read here; give a file", param, ctx)
        if isinstance(value, str) and not self.dir_okay and value.endswith(("/", os.sep)):  # Path() drops the /
            self.fail(f"{value!r} ends with / (a directory); give a file path", param, ctx)
        converted = super().convert(value, param, ctx)
        if isinstance(value, str) and value != "-" and str(converted) == "-":  # ./- is a file named -, which
            absolute = os.path.abspath(value)  # Path() spells "-", standard input's name
            return Path(absolute) if isinstance(converted, Path) else absolute
        return converted


class FiniteFloat(click.ParamType):
    """A float that is a number: nan and inf are refused where they are typed (a NaN gate passed everything, a
    NaN timeout failed every request later)."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return float(number)


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan (every comparison with it is false, so it passed the range)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = FINITE.convert(value, param, ctx)
        return super().convert(number, param, ctx)


FINITE = FiniteFloat()


class _Listed(click.ParamType):
    """A repeatable number option's value: one number, or several comma-separated (1,32), each checked by
    `inner` (its range): "'1,32' is not a valid integer range" was click's word for a list."""

    def __init__(self, inner: click.ParamType):
        self.inner, self.name = inner, inner.name

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and "," in value:
            listed = tuple(self.inner.convert(v.strip(), param, ctx) for v in value.split(",") if v.strip())
            if not listed:  # "," measured nothing and wrote an empty report
                self.fail(f"{value!r} holds no number; give one or several, comma-separated (1,32)", param, ctx)
            return listed
        return self.inner.convert(value, param, ctx)

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str | None:
        return self.inner.get_metavar(param, ctx) if ctx is not None else self.inner.get_metavar(param)  # type: ignore[call-arg]


def field_option(cls: type, f: dataclasses.Field, hints: dict[str, Any], note: str | None = None,
                 show_default: Any = None) -> Callable[[Any], Any]:
    """The click option of one dataclass field (`--field-name`, or the `flag` its cli settings name; passed to
    the command as `field_name`); `note`: the command's own remark, appended to the field's help;
    `show_default`: what --help shows as its default, instead of the field's (decoding_options)."""
    cli = dict(f.metadata.get("cli", {}))
    flag = cli.get("flag") or "--" + f.name.replace("_", "-")
    base = _base_type(hints[f.name])
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    shown = f.metadata["help"]
    if note and "[default here" in note:  # the command's own default, not the field's beside it
        shown = re.sub(r"\s*\[default: [^\]]*\]", "", shown)
    kwargs: dict[str, Any] = {"help": shown + (f" {note}" if note else "")}
    if "metavar" in cli:
        kwargs["metavar"] = cli["metavar"]
    if base is bool and f.default is None:  # tri-state: --flag, --no-flag or neither
        return click.option(f"{flag}/--no-{flag[2:]}", f.name, default=None, **kwargs)
    if base is bool:
        decls = [f"{flag}/--no-{flag[2:]}"] if f.default else [flag]
        kwargs.update(default=bool(f.default), show_default=bool(f.default))
        if not f.default:
            kwargs["is_flag"] = True
        return click.option(*decls, f.name, **kwargs)
    if cli.get("multiple"):  # a tuple[X, ...] field: the option repeated, each value an X
        if "show_default" in cli:
            kwargs["show_default"] = cli["show_default"]
        element = _base_type((typing.get_args(base) or (str,))[0])
        if element in (int, float):  # --batch-size 1,32 as bench's --backends and tune's --beams take lists
            return click.option(flag, f.name, multiple=True, type=_Listed(_click_type(element, cli)),
                                default=f.default, callback=lambda ctx, param, value: tuple(
                                    v for item in value for v in (item if isinstance(item, tuple) else (item,))),
                                **kwargs)
        return click.option(flag, f.name, multiple=True, type=_click_type(element, cli), default=f.default,
                            **kwargs)
    kwargs["type"] = _click_type(base, cli)
    if required:
        kwargs["required"] = True
    else:
        kwargs["default"] = f.default
        kwargs["show_default"] = cli.get("show_default", f.default is not None) if show_default is None \
            else show_default
    return click.option(flag, f.name, **kwargs)


def options_from(cls: type, *, skip: tuple[str, ...] = (), only: tuple[str, ...] = (),
                 notes: dict[str, str] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add one option per field of `cls` that has a help text (in field order): all of them, or `only` these,
    except `skip`; `notes` appends a command's own remark to a field's help (what it means there)."""
    hints = typing.get_type_hints(cls)
    chosen = [f for f in dataclasses.fields(cls)
              if "help" in f.metadata and f.name not in skip and (not only or f.name in only)]
    unknown = set(notes or {}) - {f.name for f in chosen}
    if unknown:
        raise ValueError(f"notes for options not added: {sorted(unknown)}")

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        for f in reversed(chosen):  # click lists options in reverse order of decoration
            command = field_option(cls, f, hints, (notes or {}).get(f.name))(command)
        return command

    return decorate


def pick(cls: type, values: dict[str, Any]) -> Any:
    """`cls(...)` from the command's keyword arguments that are its fields (removed from `values`); a field's
    cli `convert` turns the value given (not None) into the field's (--backends a,b -> ("a", "b"))."""
    converts = {f.name: f.metadata.get("cli", {}).get("convert") for f in dataclasses.fields(cls)}
    picked = {k: values.pop(k) for k in list(values) if k in converts}
    return cls(**{k: v if v is None or converts[k] is None else converts[k](v) for k, v in picked.items()})


def decoding_options(*names: str, notes: dict[str, str] | None = None, defaults_from: str | None = "the model dir's"
                     ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add --beam-size, --alpha, ... for the named DecodingOptions fields (all of them
    when none are named); the command receives `decoding: DecodingOptions`, already
    validated, so a bad value is a one-line error naming its option. It records which options
    the user set (`explicit`): the others give way to a model dir's own defaults
    (DecodingOptions.for_model). `notes` appends a command's own remark to an option's help
    (what n-best looks like in its output). `defaults_from`: whose own defaults fill the options not given (a
    model dir's: an imported model's num_beams, length penalty, ...; export: the checkpoint's), as --help says;
    None: the paper's."""
    chosen = names or tuple(_FIELDS)
    unknown = [n for n in chosen if n not in _FIELDS]
    if unknown:
        raise ValueError(f"not DecodingOptions fields: {unknown}")

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in chosen}
            ctx = click.get_current_context(silent=True)
            given = frozenset(name for name in chosen if ctx is None
                              or ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT)
            return command(*args, decoding=PAPER.replace(**values, explicit=given).validate(), **kwargs)

        # click lists options in reverse order of decoration: add the last one first.
        for name in reversed(chosen):
            shown = f"{defaults_from}, else {_FIELDS[name].default}" if defaults_from and name in MODEL_DEFAULTS \
                else True
            wrapper = field_option(DecodingOptions, _FIELDS[name], _HINTS, (notes or {}).get(name), shown)(wrapper)
        return wrapper

    return decorate


def parse_backends(value: str) -> list[str]:
    """A comma-separated list of the registry's backends (runtime.registry.backend_names): the --backends of
    parity, bench and demo."""
    names = [b.strip() for b in value.split(",") if b.strip()]
    allowed = backend_names()
    unknown = [b for b in names if b not in allowed]
    if not names:
        raise click.BadParameter(f"no backend given; choose from {', '.join(allowed)}")
    if unknown:
        raise click.BadParameter(f"unknown backend(s) {', '.join(map(repr, unknown))}; choose from "
                                 f"{', '.join(allowed)}")
    repeated = sorted({b for b in names if names.count(b) > 1})
    if repeated:  # measured or compared twice, and shown twice in the table
        raise click.BadParameter(f"{', '.join(repeated)} given more than once; name each backend once")
    return names


def installed_backends(ctx: click.Context, names: list[str]) -> list[str]:
    """`names` as --backends gave them; the default list without torch where PyTorch is not installed (a deploy
    install: parity and bench then take the exported graphs)."""
    if ctx.get_parameter_source("backends") is click.core.ParameterSource.DEFAULT and not installed("torch"):
        return [n for n in names if n != "torch"]
    return names

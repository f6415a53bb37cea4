"""Click options shared by several commands, defined once.

`decoding_options` gives serve-batch, parity, bench and demo the same decoding flags,
with defaults and help taken from runtime.decoding.DecodingOptions, and hands the
command one validated `decoding` object instead of loose values.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import click

from runtime.decoding import PAPER, DecodingOptions

_FIELDS = {f.name: f for f in dataclasses.fields(DecodingOptions)}


def decoding_options(*names: str, notes: dict[str, str] | None = None
                     ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add --beam-size, --alpha, ... for the named DecodingOptions fields (all of them
    when none are named); the command receives `decoding: DecodingOptions`, already
    validated, so a bad value is a one-line error naming its option. `notes` appends
    a command's own remark to an option's help (what n-best looks like in its output)."""
    chosen = names or tuple(_FIELDS)
    unknown = [n for n in chosen if n not in _FIELDS]
    if unknown:
        raise ValueError(f"not DecodingOptions fields: {unknown}")

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in chosen}
            return command(*args, decoding=PAPER.replace(**values).validate(), **kwargs)

        # click lists options in reverse order of decoration: add the last one first.
        for name in reversed(chosen):
            default = getattr(PAPER, name)
            note = (notes or {}).get(name)
            wrapper = click.option(f"--{name.replace('_', '-')}", name, type=type(default), default=default,
                                   show_default=True,
                                   help=DecodingOptions.help(name) + (f" {note}" if note else ""))(wrapper)
        return wrapper

    return decorate

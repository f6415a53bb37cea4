"""No command writes by hand an option that a dataclass declares: loading (LoadOptions), decoding
(DecodingOptions), serve-batch's reading and writing (ServeBatchOptions) and serve's (ServeHttpOptions,
RequestLimits) options are generated from their fields in every command that takes them, so each has one
default and one help text (a command may only append a note). train and export are held to their own
dataclasses in test_cli_options.py."""

from __future__ import annotations

import dataclasses

import click
import pytest

from pipeline.cli import all_commands
from pipeline.evaluation.serve_bench import ServeBenchOptions
from pipeline.serve.options import RequestLimits, ServeHttpOptions
from pipeline.serve_batch.translation import ServeBatchOptions
from runtime.decoding import DecodingOptions
from runtime.model_dir import LoadOptions

OWNERS = (LoadOptions, DecodingOptions, ServeBatchOptions, ServeHttpOptions, RequestLimits, ServeBenchOptions)
OWN_DATACLASS = {"train", "export"}  # TrainOptions / ExportOptions own every option there
COMMANDS = all_commands()


def declared() -> dict[str, list[dataclasses.Field]]:
    fields: dict[str, list[dataclasses.Field]] = {}
    for cls in OWNERS:
        for f in dataclasses.fields(cls):
            if "help" in f.metadata:
                fields.setdefault(f.name, []).append(f)
    return fields


@pytest.mark.parametrize("name", sorted(set(COMMANDS) - OWN_DATACLASS))
def test_an_option_a_dataclass_declares_is_generated_from_it(name):
    fields = declared()
    for p in COMMANDS[name].params:
        if not isinstance(p, click.Option) or p.name not in fields:
            continue
        owners = [f for f in fields[p.name] if (p.help or "").startswith(f.metadata["help"])]
        assert owners, f"pipeline {name} {p.opts[0]}: written by hand, though a dataclass declares {p.name}"
        assert p.default == owners[0].default, (name, p.name)


def test_serve_batch_has_no_option_outside_its_dataclasses():
    """serve-batch's options are LoadOptions, DecodingOptions and ServeBatchOptions, plus where to write and
    whether to show progress."""
    names = {f.name for cls in (LoadOptions, DecodingOptions, ServeBatchOptions) for f in dataclasses.fields(cls)
             if "help" in f.metadata}
    options = {p.name for p in COMMANDS["serve-batch"].params if isinstance(p, click.Option)}
    assert options - {"help"} == names | {"output", "output_dir", "suffix", "progress"}



def test_the_load_options_are_shared_by_every_command_that_loads_a_model_dir():
    for name in ("serve-batch", "serve", "parity", "bench", "tune-decoding"):
        assert "device" in {p.name for p in COMMANDS[name].params}, name

"""`pipeline doctor` command."""

from __future__ import annotations

import json
from pathlib import Path

import click

from model.errors import UserError
from pipeline.cli_options import GivenPath, options_from, pick
from pipeline.environment import DoctorOptions, check_model_dir, format_facts, format_verdicts, gather_facts


@click.command("doctor")
@click.argument("model_dir", required=False, type=GivenPath(path_type=Path))
@options_from(DoctorOptions)
def doctor(model_dir: Path | None, **values: bool) -> None:
    """Say what this machine can run: Python, PyTorch (CUDA, cuDNN, GPUs, bf16, NCCL),
    onnxruntime and its execution providers, TensorRT (or exactly why not), tokenizer /
    scoring / CTranslate2 versions and the CPU's instruction sets. With MODEL_DIR (what
    `pipeline export` wrote), also which backend, precision and device can serve it here,
    and why not for the others. Send this output with any bug report."""
    as_json = pick(DoctorOptions, values).validate().as_json
    if as_json and model_dir is not None and model_dir.suffix == ".json" and not model_dir.exists():
        raise UserError(f"{model_dir}: no such model directory; --json is a flag, not a file (`pipeline doctor "
                        f"[DIR] --json > {model_dir}` writes it)")
    facts = gather_facts()
    verdicts, broken = None, None
    try:
        verdicts = check_model_dir(model_dir, facts) if model_dir is not None else None
    except UserError as e:  # a broken dir is when the machine's facts are asked for most: they come first
        broken = e
    if as_json:
        payload = facts.to_json()
        if model_dir is not None:
            payload["model_dir"] = {"path": str(model_dir)} | (
                {"error": str(broken)} if broken is not None else {"backends": [v.__dict__ for v in verdicts or []]})
        click.echo(json.dumps(payload, indent=2))
    else:
        click.echo(format_facts(facts))
        if model_dir is not None and verdicts is not None:
            click.echo(format_verdicts(model_dir, verdicts))
    if broken is not None:
        raise broken  # the one error line, and exit 2: a build that gates on doctor fails
    if verdicts is not None and not any(v.ok for v in verdicts):  # the image's build passed, its start failed
        why = "the JSON's model_dir.backends say why" if as_json else "each row above says why"
        raise UserError(f"{model_dir}: no backend can translate with it on this machine ({why})")

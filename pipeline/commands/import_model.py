"""`pipeline import FORMAT DIR --out CHECKPOINT`: a model trained elsewhere, as one of our checkpoints.

One subcommand per format family (pipeline/importers/registry.py): `marian` for OPUS-MT / MarianMTModel
directories, `m2m100` (and `nllb`) for M2M-100 and NLLB-200; each runs the one import_checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from pipeline.textio import check_output_file


def _import_arguments(command: Any) -> Any:
    """HF_DIR, --out and --force: what every importer takes."""
    command = click.option("--force", is_flag=True, help="Replace OUT if it exists.")(command)
    command = click.option("--out", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
                           help="Checkpoint file to write (atomically, with its SHA-256).")(command)
    return click.argument("hf_dir", metavar="HF_DIR|HUB_ID", type=click.Path(file_okay=False, path_type=Path)
                          )(command)


def _summary(out: Path, family: str, summary: dict[str, Any], extra: str) -> str:
    """The line an import ends with: the model's shape, `extra`, and its decoding defaults."""
    cfg = summary["config"]
    return (f"{out}: {family} model, d_model {cfg['d_model']}, {cfg['n_enc_layers']}+{cfg['n_dec_layers']} layers, "
            f"vocabulary {cfg['vocab_size']}, {extra}; decoding defaults {json.dumps(summary['decoding'])}")


def _run(hf_dir: Path, out: Path, force: bool, command: str | None) -> None:
    """Import HF_DIR (a hub id resolved through the Hugging Face cache) as the family `command` names (None: the
    one config.json's model_type names), and say what was imported in one line."""
    from pipeline.importers.convert import import_checkpoint
    from pipeline.importers.hub_cache import resolve_model_dir
    from pipeline.importers.registry import COMMANDS, family

    check_output_file(out, "--out")
    summary = import_checkpoint(resolve_model_dir(hf_dir), out, force=force,
                                family=None if command is None else family(COMMANDS[command]))
    langs = summary.get("languages")
    if langs:
        shown = ", ".join(langs[:12]) + (", ..." if len(langs) > 12 else "")
        detail = f"{len(langs)} languages ({shown})"
    else:
        detail = f"activation {summary['config']['activation']}"
    click.echo(_summary(out, summary["family"], summary, detail))


@click.group("import")
def import_group() -> None:
    """Import a model trained elsewhere as a checkpoint that export, serve-batch, serve, parity and
    bench take as they take ours."""


@import_group.command("marian")
@_import_arguments
def marian(hf_dir: Path, out: Path, force: bool) -> None:
    """Import HF_DIR, a local OPUS-MT / MarianMTModel directory (what `save_pretrained` writes:
    config.json, model.safetensors or pytorch_model.bin, source.spm, target.spm, vocab.json and,
    when present, generation_config.json). Never touches the network.

        pipeline import marian opus-mt-de-en --out de-en.pt
        pipeline export de-en.pt --out models/de-en --int8
        pipeline serve-batch models/de-en in.de --output out.en

    The model's generation defaults (num_beams, max_length, length_penalty) and transformers' beam
    search rules become the model dir's decoding defaults; options given on the command line win.
    `pipeline parity models/de-en --reference transformers --src FILE` checks the translations
    token for token against transformers' own generate."""
    _run(hf_dir, out, force, "marian")


@import_group.command("m2m100")
@_import_arguments
def m2m100(hf_dir: Path, out: Path, force: bool) -> None:
    """Import HF_DIR, a local M2M-100 or NLLB-200 directory (what `save_pretrained` writes: config.json,
    model.safetensors or pytorch_model.bin, sentencepiece.bpe.model, tokenizer_config.json, vocab.json
    (M2M-100) or tokenizer.json (NLLB) and, when present, generation_config.json): one model for many
    language pairs. `pipeline import nllb` is the same command. Never touches the network.

        pipeline import m2m100 m2m100_418M --out m2m.pt
        pipeline export m2m.pt --out models/m2m --int8
        pipeline serve-batch models/m2m in.en --src-lang en --tgt-lang de --output out.de
        (NLLB: --src-lang eng_Latn --tgt-lang deu_Latn)

    Every language the tokenizer lists is served: a source starts with its language's token, the
    target's is forced as the first generated one. generate's defaults (num_beams, max_length,
    early_stopping) become the model dir's decoding defaults; options given on the command line win."""
    _run(hf_dir, out, force, "m2m100")


import_group.add_command(m2m100, name="nllb")  # NLLB-200: M2M-100's architecture with its own tokenizer

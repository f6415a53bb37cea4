"""`pipeline import DIR --out CHECKPOINT`: a model trained elsewhere, as one of our checkpoints.

The family is the one config.json's model_type names (pipeline/importers/registry.py); `pipeline import
marian|m2m100|nllb DIR` name it instead, as before the registry. Another family is one module and one registry
entry (docs/import.md), and needs nothing here."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import click

from pipeline.cli_options import GivenPath, options_from
from pipeline.importers.options import ImportOptions


def _import_arguments(command: Any) -> Any:
    """HF_DIR, --out and --force: what every importer takes."""
    command = options_from(ImportOptions)(command)
    # as typed (a str, not a Path, which drops "./"): `./nope` is a path, never a hub id
    return click.argument("hf_dir", metavar="HF_DIR|HUB_ID", type=GivenPath(file_okay=False, path_type=str))(command)


def _summary(out: Path, family: str, summary: dict[str, Any], extra: str) -> str:
    """The line an import ends with: the model's shape, `extra`, and its decoding defaults."""
    cfg = summary["config"]
    return (f"{out}: {family} model, d_model {cfg['d_model']}, {cfg['n_enc_layers']}+{cfg['n_dec_layers']} layers, "
            f"vocabulary {cfg['vocab_size']}, {extra}; decoding defaults {json.dumps(summary['decoding'])}")


VALUED = ("--out",)  # the options that take a value: it is no positional argument
USAGE_PATH = "pipeline.usage_path"  # ctx.meta: the command a usage error points at (pipeline/cli.py main)


class _ImportGroup(click.Group):
    """`pipeline import DIR` runs `auto`: a first argument that is not a command's name is the directory, and so
    is a directory named like one (./marian) that no other argument follows. A first argument like a command's
    name (marain) before another argument is the misspelt name, said so."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        positional = [a for a, before in zip(args[1:], args) if not a.startswith("-") and before not in VALUED]
        helped = any(a in ctx.help_option_names for a in args)  # `import marian --help`: the command's help
        if args and args[0] in self.commands and args[0] != "auto" and Path(args[0]).is_dir() and not positional \
                and not helped:
            args = ["auto", *args]  # `pipeline import marian --out m.pt` with ./marian: the directory
            ctx.meta[USAGE_PATH] = ctx.command_path  # `pipeline import DIR` runs `auto`, never typed
        elif args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            families = [c for c in self.commands if c != "auto"]
            if positional and not Path(args[0]).exists() and not args[0].startswith("-"):  # a family, then DIR
                if args[0].lower() in families:  # NLLB, Marian
                    return super().parse_args(ctx, [args[0].lower(), *args[1:]])
                close = difflib.get_close_matches(args[0].lower(), families, n=1)
                meant = f"did you mean {close[0]!r}? " if close else f"the families are {', '.join(families)} "
                raise click.UsageError(f"no family {args[0]!r}: {meant}(or leave it out: config.json's model_type "
                                       "names it)", ctx)
            args = ["auto", *args]
            ctx.meta[USAGE_PATH] = ctx.command_path  # `pipeline import DIR` runs `auto`, never typed
        return super().parse_args(ctx, args)


def _run(hf_dir: str, out: Path, force: bool, command: str | None) -> None:
    """Import HF_DIR (a hub id resolved through the Hugging Face cache) as the family `command` names (None: the
    one config.json's model_type names), and say what was imported in one line."""
    from pipeline.importers.convert import import_checkpoint
    from pipeline.importers.hub_cache import resolve_model_dir
    from pipeline.importers.registry import COMMANDS, family

    summary = import_checkpoint(resolve_model_dir(hf_dir), out, force=force,
                                family=None if command is None else family(COMMANDS[command]))
    langs = summary.get("languages")
    if langs:
        shown = ", ".join(langs[:12]) + (", ..." if len(langs) > 12 else "")
        detail = f"{len(langs)} languages ({shown})"
    else:  # a one-pair model: its languages when its files name them (export --src-lang/--tgt-lang else)
        detail = f"activation {summary['config']['activation']}" + (
            f", languages {summary['pair']}" if summary.get("pair") else ", languages not named")
    click.echo(_summary(out, summary["family"], summary, detail))


@click.group("import", cls=_ImportGroup, subcommand_metavar="[COMMAND] HF_DIR|HUB_ID --out CHECKPOINT [--force]")
def import_group() -> None:
    """Import a model trained elsewhere as a checkpoint that export, serve-batch, serve, parity and
    bench take as they take ours.

    \b
        pipeline import HF_DIR|HUB_ID --out CHECKPOINT

    imports the family that config.json's model_type names (marian: OPUS-MT; m2m_100: M2M-100, or NLLB
    by its tokenizer); `pipeline import marian|m2m100|nllb HF_DIR ...` names it instead. A hub id is read
    from the Hugging Face cache; nothing is downloaded."""


@import_group.command("auto")
@_import_arguments
def auto(hf_dir: str, out: Path, force: bool) -> None:
    """Import HF_DIR as the family its config.json's model_type names (`pipeline import HF_DIR` runs this):
    marian (OPUS-MT), m2m_100 (M2M-100, or NLLB-200 by its tokenizer). An unknown model_type is one line
    naming it and the families known. Never touches the network.

    \b
        pipeline import opus-mt-de-en --out de-en.pt
        pipeline import facebook/nllb-200-distilled-600M --out nllb.pt   (a hub id: the cached snapshot)"""
    _run(hf_dir, out, force, None)


@import_group.command("marian")
@_import_arguments
def marian(hf_dir: str, out: Path, force: bool) -> None:
    """Import HF_DIR, a local OPUS-MT / MarianMTModel directory (what `save_pretrained` writes:
    config.json, model.safetensors or pytorch_model.bin, source.spm, target.spm, vocab.json and,
    when present, generation_config.json). Never touches the network.

    \b
        pipeline import marian opus-mt-de-en --out de-en.pt
        pipeline export de-en.pt --out models/de-en --int8
        pipeline serve-batch models/de-en in.de --output out.en

    The model's generation defaults (num_beams, max_length, length_penalty) and transformers' beam
    search rules become the model dir's decoding defaults; options given on the command line win.
    `pipeline parity models/de-en --reference transformers --src FILE --ref FILE` checks the translations
    token for token against transformers' own generate."""
    _run(hf_dir, out, force, "marian")


@import_group.command("m2m100")
@_import_arguments
def m2m100(hf_dir: str, out: Path, force: bool) -> None:
    """Import HF_DIR, a local M2M-100 or NLLB-200 directory (what `save_pretrained` writes: config.json,
    model.safetensors or pytorch_model.bin, sentencepiece.bpe.model, tokenizer_config.json, vocab.json
    (M2M-100) or tokenizer.json (NLLB) and, when present, generation_config.json): one model for many
    language pairs. `pipeline import nllb` is the same command. Never touches the network.

    \b
        pipeline import m2m100 m2m100_418M --out m2m.pt
        pipeline export m2m.pt --out models/m2m --int8
        pipeline serve-batch models/m2m in.en --src-lang en --tgt-lang de --output out.de
        (NLLB: --src-lang eng_Latn --tgt-lang deu_Latn)

    Every language the tokenizer lists is served: a source starts with its language's token, the
    target's is forced as the first generated one. generate's defaults (num_beams, max_length,
    early_stopping) become the model dir's decoding defaults; options given on the command line win."""
    _run(hf_dir, out, force, "m2m100")


import_group.add_command(m2m100, name="nllb")  # NLLB-200: M2M-100's architecture with its own tokenizer

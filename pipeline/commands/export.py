"""`pipeline export`: checkpoint -> verified model dir (ONNX graphs, engines, manifest)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import click

from export import api, tensorrt_build
from export.options import CALIBRATION_LINES, ExportOptions
from export.shortlist import ShortlistCorpus, describe
from model import io_names
from model.manifest import Manifest
from pipeline.cli_options import options_from, pick
from pipeline.textio import read_lines, refuse_overwriting_inputs
from pipeline.training.trainer import corpus_languages, validation_files
from runtime import references

log = logging.getLogger(__name__)


@click.command("export")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@options_from(ExportOptions)
def export(checkpoint: Path, **values: Any) -> None:
    """Export CHECKPOINT (a save dir: its latest or averaged checkpoint; or one .pt file) to a
    verified model directory: encoder.onnx, decoder.onnx, TensorRT engines when possible,
    model.pt, spm.model and manifest.json."""
    options = read_inputs(checkpoint, pick(ExportOptions, values))
    manifest = api.export(checkpoint, options)
    if manifest.tensorrt_skipped:
        click.echo(tensorrt_build.skip_message(manifest.tensorrt_skipped), err=True)
    click.echo(summary_line(options.out, manifest))
    if manifest.shortlist is not None:
        click.echo(describe(manifest.shortlist))


def read_inputs(checkpoint: Path, options: ExportOptions) -> ExportOptions:
    """`options` with what its files hold: the held-out set (the save dir's validation set unless
    --reference-src/--reference-tgt) and the shortlist corpus; none of them may lie in --out, which
    --force replaces whole."""
    o = options
    pair = held_out_pair(checkpoint, o.reference_src, o.reference_tgt, o.reference_lines)
    if (o.shortlist_src is None) != (o.shortlist_tgt is None):
        raise click.UsageError("give both --shortlist-src and --shortlist-tgt, or neither")
    inputs = [checkpoint, *(pair or ()),
              *(p for p in (o.shortlist_src, o.shortlist_tgt, o.timing_cache, o.int8_calibrate) if p)]
    refuse_overwriting_inputs(inputs, [], "--out dir", output_dirs=[o.out])
    held_out = None if pair is None else references.held_out_lines(*pair, limit=o.reference_lines)
    shortlist = None if o.shortlist_src is None or o.shortlist_tgt is None else ShortlistCorpus(
        read_lines(o.shortlist_src), read_lines(o.shortlist_tgt), (str(o.shortlist_src), str(o.shortlist_tgt)),
        per_source=o.shortlist_per_source, frequent=o.shortlist_frequent)
    calibration = None
    if o.int8_calibrate is not None:
        calibration = [x for x in read_lines(o.int8_calibrate) if x.strip()][:CALIBRATION_LINES]
        if not calibration:
            raise click.UsageError(f"--int8-calibrate {o.int8_calibrate}: no non-blank line to calibrate on")
    src_lang, tgt_lang = o.src_lang, o.tgt_lang
    if src_lang is None and tgt_lang is None:  # a training run's corpus suffixes (train.de, train.en)
        codes = corpus_languages(checkpoint)
        if codes is not None:
            src_lang, tgt_lang = codes
            log.info("languages %s -> %s, from the training corpus' file names", *codes)
    return dataclasses.replace(o, references=held_out, shortlist=shortlist, calibration=calibration,
                               src_lang=src_lang, tgt_lang=tgt_lang)


def held_out_pair(checkpoint: Path, src: Path | None, tgt: Path | None, limit: int) -> tuple[Path, Path] | None:
    """The held-out files to record translations of: the given pair, else the save dir's validation set."""
    if (src is None) != (tgt is None):
        raise click.UsageError("give both --reference-src and --reference-tgt, or neither")
    if limit == 0:
        return None
    pair = (src, tgt) if src is not None and tgt is not None else validation_files(checkpoint)
    if pair is None:
        log.info("no held-out set known for %s: no reference translations recorded (parity without PyTorch "
                 "needs --reference-src/--reference-tgt)", checkpoint)
    return pair


def reference_set(checkpoint: Path, src: Path | None, tgt: Path | None, limit: int
                  ) -> tuple[list[str], list[str]] | None:
    """The held-out lines to record (held_out_pair's files, read)."""
    pair = held_out_pair(checkpoint, src, tgt, limit)
    return None if pair is None else references.held_out_lines(*pair, limit=limit)


def summary_line(out: Path, manifest: Manifest) -> str:
    """One line: where, precision, graph sizes, worst log-prob difference, time."""
    ver = manifest.verification
    diffs = [max(r["max_abs_diff"].get(io_names.TOPK_LOG_PROBS, 0.0),
                 r["max_abs_diff"].get(io_names.EOS_LOG_PROBS, 0.0))
             for r in ver.values() if isinstance(r, dict) and "max_abs_diff" in r]
    sizes = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in manifest.graphs.bytes.items())
    engines = " + TensorRT engines" if manifest.tensorrt else ""
    return (f"exported {manifest.precision} model to {out}{engines} (opset {manifest.opset}, {sizes}); "
            f"verified: max abs log-prob difference {max(diffs):.3g} (tolerance {ver['atol']:.3g}"
            f"{f' + {rtol:.3g} x |log-prob|' if (rtol := ver.get('rtol')) else ''}); "
            f"graphs exported in {manifest.graphs.export_seconds:.1f} s")

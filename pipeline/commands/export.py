"""`pipeline export`: checkpoint -> verified model dir (ONNX graphs, engines, manifest)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from pathlib import Path
from typing import Any

import click

from export import api, tensorrt_build
from export.options import CALIBRATION_LINES, Calibration, ExportOptions
from export.shortlist import ShortlistCorpus, describe
from model import io_names
from model.manifest import Manifest
from pipeline.cli_options import GivenPath, decoding_options, options_from, pick
from pipeline.textio import CORPUS_LINE_BYTES, check_line_ends, iter_lines, read_lines, refuse_overwriting_inputs
from pipeline.training.trainer import corpus_languages, validation_files
from runtime import references
from runtime.decoding import DecodingOptions
from runtime.fields import with_value

log = logging.getLogger(__name__)

# the search options a model dir records as its defaults (manifest.decoding)
SEARCH = ("beam_size", "alpha", "max_len_a", "max_len_b", "min_len", "rules")


@click.command("export")
@click.argument("checkpoint", type=GivenPath(path_type=Path))
@options_from(ExportOptions)
@decoding_options(*SEARCH, defaults_from="the checkpoint's",
                  notes={name: "Recorded as the model dir's default." for name in SEARCH})
def export(checkpoint: Path, decoding: DecodingOptions, **values: Any) -> None:
    """Export CHECKPOINT (a save dir: its latest or averaged checkpoint; or one .pt file) to a
    verified model directory: encoder.onnx, decoder.onnx, TensorRT engines when possible,
    model.pt, spm.model and manifest.json. Decoding options given (tune-decoding's choice) become the
    model dir's defaults, which serve-batch, serve, parity and ray-translate use unless told otherwise."""
    given = {name: getattr(decoding, name) for name in sorted(decoding.given())}
    from model.checkpoint import resolve_checkpoint  # torch: imported when the command runs

    resolve_checkpoint(checkpoint)  # a missing checkpoint is the one line, before "no held-out set known for" it
    options = read_inputs(checkpoint, dataclasses.replace(pick(ExportOptions, values), decoding=given))
    manifest = api.export(checkpoint, options, say=lambda line: click.echo(line, err=True))
    if manifest.tensorrt_skipped:
        click.echo(tensorrt_build.skip_message(manifest.tensorrt_skipped), err=True)
    click.echo(summary_line(options.out, manifest))
    if given:
        settings = ", ".join(with_value(k, v) for k, v in given.items())
        click.echo(f"{options.out} decodes with {settings} unless told otherwise (manifest.json decoding)")
    if manifest.shortlist is not None:
        click.echo(describe(manifest.shortlist))


def read_inputs(checkpoint: Path, options: ExportOptions) -> ExportOptions:
    """`options` with what its files hold: the held-out set (the save dir's validation set unless
    --reference-src/--reference-tgt), the int8 calibration lines (--int8-calibrate's, else the held-out
    set's sources) and the shortlist corpus; none of them may lie in --out, which --force replaces whole."""
    o = options
    pair = held_out_pair(checkpoint, o.reference_src, o.reference_tgt, o.reference_lines)
    if (o.shortlist_src is None) != (o.shortlist_tgt is None):
        raise click.UsageError("give both --shortlist-src and --shortlist-tgt, or neither")
    shaping = [f"--shortlist-{name.replace('_', '-')}" for name in ("per_source", "frequent")
               if getattr(o, f"shortlist_{name}") != getattr(ExportOptions, f"shortlist_{name}")]
    if shaping and o.shortlist_src is None:  # else no shortlist, and no word of it
        raise click.UsageError(f"{' and '.join(shaping)} shape a shortlist: add --shortlist-src and "
                               "--shortlist-tgt, or leave them out")
    calibrate_on = o.int8_calibrate
    if calibrate_on is None and o.int8 and not o.no_int8_calibrate:  # by default: the held-out set's sources
        files = pair if o.reference_lines else held_out_files(checkpoint, o.reference_src, o.reference_tgt)  # (once:
        calibrate_on = (files or (None,))[0]  # a validation set changed since training was said twice)
    inputs = [checkpoint, *(pair or ()),
              *(p for p in (o.shortlist_src, o.shortlist_tgt, o.timing_cache, calibrate_on) if p)]
    refuse_overwriting_inputs(inputs, [], "--out dir", output_dirs=[o.out])
    held_out = None if pair is None else references.held_out_lines(*pair, limit=o.reference_lines)
    if held_out is not None and not held_out[0]:  # nothing to record, and nothing for parity to gate on
        if o.reference_src is not None:
            raise click.UsageError(f"--reference-src {o.reference_src}: no line pair with text on both sides to "
                                   "record")
        log.info("the validation set of %s has no line pair with text: no reference translations recorded",
                 checkpoint)
        held_out = None
    shortlist = None if o.shortlist_src is None or o.shortlist_tgt is None else ShortlistCorpus(
        read_lines(o.shortlist_src, max_line_bytes=CORPUS_LINE_BYTES),
        read_lines(o.shortlist_tgt, max_line_bytes=CORPUS_LINE_BYTES),
        (absolute(o.shortlist_src), absolute(o.shortlist_tgt)),
        per_source=o.shortlist_per_source, frequent=o.shortlist_frequent)
    calibration = None if calibrate_on is None else calibration_lines(calibrate_on, default=o.int8_calibrate is None)
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
    pair = held_out_files(checkpoint, src, tgt)
    gone = validation_files(checkpoint, existing=False) if pair is None else None
    if gone is not None:  # the run's validation set, moved, deleted or changed since
        log.info("%s: its run's validation set (%s, %s) is gone or changed: no reference translations recorded (parity "
                 "without PyTorch needs --reference-src/--reference-tgt)", checkpoint, *gone)
    elif pair is None:
        log.info("no held-out set known for %s: no reference translations recorded (parity without PyTorch "
                 "needs --reference-src/--reference-tgt)", checkpoint)
    return pair


def calibration_lines(path: Path, default: bool) -> Calibration:
    """The first CALIBRATION_LINES non-blank lines of `path` to calibrate rowwise int8's activation scales on:
    --int8-calibrate's (none is an error) or, `default`, the held-out set's sources (another int8 flavour skips
    them, and none leaves per-row scales)."""
    lines = check_line_ends(list(itertools.islice((x for x in iter_lines(path) if x.strip()), CALIBRATION_LINES)), path)
    if not lines and not default:
        raise click.UsageError(f"--int8-calibrate {path}: no non-blank line to calibrate on")
    return Calibration(lines, absolute(path), default=default)


def absolute(path: Path) -> str:
    """A file the manifest records, as an absolute path (as typed, `calib.txt` said nothing once the command's
    directory was forgotten; the default ones were absolute already)."""
    return os.path.abspath(path)


def held_out_calibration(checkpoint: Path) -> Calibration | None:
    """What `pipeline export --int8` calibrates on without --int8-calibrate or --reference-src: the checkpoint's
    save dir validation set's sources (None without one). `pipeline demo` exports int8 with them too."""
    pair = validation_files(checkpoint)
    return None if pair is None else calibration_lines(pair[0], default=True)


def held_out_files(checkpoint: Path, src: Path | None, tgt: Path | None) -> tuple[Path, Path] | None:
    """The given held-out pair, else the checkpoint's save dir validation set (None: neither)."""
    return (src, tgt) if src is not None and tgt is not None else validation_files(checkpoint)


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

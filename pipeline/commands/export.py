"""`pipeline export`: checkpoint -> verified model dir (ONNX graphs, engines, manifest)."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from export import api, tensorrt_build, verify
from export.shortlist import ShortlistCorpus, describe
from model import io_names
from model.manifest import QUANTIZATIONS, Manifest
from pipeline.textio import read_lines, refuse_overwriting_inputs
from pipeline.training.trainer import validation_files
from runtime import references
from runtime.shortlist import DEFAULT_FREQUENT, DEFAULT_PER_SOURCE

log = logging.getLogger(__name__)


@click.command("export")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--out", "out", required=True, type=click.Path(path_type=Path),
              help="Model directory to create (everything serve-batch and parity need).")
@click.option("--fp16", is_flag=True,
              help="Half-precision graphs (fp16 weights, matmuls and caches; LayerNorm, softmax and "
                   "log-softmax stay fp32). TensorRT builds them strongly typed.")
@click.option("--int8", is_flag=True,
              help="int8 weights for every linear layer and the tied embedding/projection (symmetric, "
                   "per output channel); LayerNorm and softmax stay fp32. Verified against the fp32 "
                   "PyTorch model within --int8-atol.")
@click.option("--int8-flavour", type=click.Choice(["auto", *QUANTIZATIONS]), default="auto",
              show_default=True,
              help="With --int8: qdq (int8 weights through DequantizeLinear -> MatMul, fp32 activations; "
                   "the form TensorRT parses), rowwise (int8 activations too, quantized per row at run "
                   "time: faster on CPU ONNX Runtime, batch-independent, no TensorRT) or ort-dynamic "
                   "(ONNX Runtime's quantize_dynamic: one scale per batch, so results depend on "
                   "batching; no TensorRT). auto: qdq when TensorRT engines are built, else rowwise.")
@click.option("--opset", default=api.DEFAULTS.opset, show_default=True, type=int,
              help="ONNX opset of the graphs (17..23; TensorRT needs >= 17).")
@click.option("--topk", default=api.DEFAULTS.topk, show_default=True, type=int,
              help="Candidates per hypothesis leaving the decoder step (beam search needs 2 x beam).")
@click.option("--max-batch", default=api.DEFAULTS.max_batch, show_default=True, type=int,
              help="Most sentences per batch (TensorRT profiles; recorded in the manifest).")
@click.option("--max-src-len", default=None, type=int,
              help=f"Longest source in tokens, EOS included [default: {api.DEFAULTS.max_src_len}, at most the "
                   "model's max_positions].")
@click.option("--max-tgt-len", default=None, type=int,
              help="Longest output in tokens (decoder cache holds max-tgt-len + 1 slots) "
                   f"[default: {api.DEFAULTS.max_tgt_len}, below the model's max_positions].")
@click.option("--max-beam", default=api.DEFAULTS.max_beam, show_default=True, type=int,
              help="Largest beam the engines serve (decoder rows up to max-batch x max-beam).")
@click.option("--tensorrt/--no-tensorrt", default=None,
              help="Build TensorRT engines (error if TensorRT or a GPU is missing) or skip them. "
                   "Default: build them when possible, else say why they were skipped.")
@click.option("--force", is_flag=True,
              help="Replace an existing model directory (only once the new one is complete).")
@click.option("--atol", default=verify.FP32_ATOL, show_default=True, type=float,
              help="fp32 verification bound on log-prob abs differences (ONNX Runtime vs PyTorch).")
@click.option("--fp16-atol", default=verify.FP16_ATOL, show_default=True, type=float,
              help="fp16 verification bound (ONNX Runtime vs PyTorch half, PyTorch half vs fp32), plus "
                   f"{verify.FP16_RTOL:g} x |log-prob| (unlikely candidates carry larger fp16 errors).")
@click.option("--int8-atol", default=None, type=float,
              help="int8 verification bound on log-prob abs differences (ONNX Runtime int8 vs PyTorch "
                   f"fp32), plus {verify.INT8_RTOL:g} x |log-prob|. Default: {verify.INT8_ATOL:g} for qdq, "
                   f"{verify.INT8_ACTIVATIONS_ATOL:g} for rowwise and ort-dynamic (8-bit activations too).")
@click.option("--workspace-gib", default=tensorrt_build.DEFAULT_WORKSPACE_GIB, show_default=True,
              type=float, help="TensorRT builder workspace limit in GiB.")
@click.option("--reference-src", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Held-out source lines whose fp32 PyTorch translations are recorded in the model dir "
                   "(references.json), so `pipeline parity MODEL_DIR` can gate a backend without PyTorch. "
                   "Default: the checkpoint's save dir validation set, when it has one.")
@click.option("--reference-tgt", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Human references of --reference-src, line-aligned.")
@click.option("--reference-lines", type=click.IntRange(min=0), default=references.DEFAULT_LINES, show_default=True,
              help="Record at most this many line pairs (0: record none).")
@click.option("--shortlist-src", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Source side of a parallel corpus (the training data, say) to count a vocabulary shortlist "
                   "from: the model dir then also holds shortlist.npz and decoder_shortlist.onnx, which "
                   "serve-batch, serve, parity and bench use with --shortlist (docs/shortlist.md).")
@click.option("--shortlist-tgt", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Target side of --shortlist-src, line-aligned.")
@click.option("--shortlist-per-source", type=click.IntRange(min=0), default=DEFAULT_PER_SOURCE, show_default=True,
              help="Target pieces listed per source piece: those most often in the same sentence pair.")
@click.option("--shortlist-frequent", type=click.IntRange(min=1), default=DEFAULT_FREQUENT, show_default=True,
              help="Most frequent target pieces, candidates in every batch (at least --topk).")
@click.option("--timing-cache", type=click.Path(path_type=Path), default=None,
              help="TensorRT timing cache file, reused across builds "
                   "(default: ~/.cache/pipeline/tensorrt-VERSION.timing-cache).")
def export(checkpoint: Path, out: Path, fp16: bool, opset: int, topk: int, max_batch: int,
           max_src_len: int | None, max_tgt_len: int | None, max_beam: int, tensorrt: bool | None, force: bool,
           atol: float, fp16_atol: float, workspace_gib: float, timing_cache: Path | None,
           int8: bool = False, int8_atol: float | None = None, int8_flavour: str = "auto",
           reference_src: Path | None = None, reference_tgt: Path | None = None,
           reference_lines: int = references.DEFAULT_LINES, shortlist_src: Path | None = None,
           shortlist_tgt: Path | None = None, shortlist_per_source: int = DEFAULT_PER_SOURCE,
           shortlist_frequent: int = DEFAULT_FREQUENT) -> None:
    """Export CHECKPOINT (a save dir: its latest or averaged checkpoint; or one .pt file) to a
    verified model directory: encoder.onnx, decoder.onnx, TensorRT engines when possible,
    model.pt, spm.model and manifest.json."""
    pair = held_out_pair(checkpoint, reference_src, reference_tgt, reference_lines)
    if (shortlist_src is None) != (shortlist_tgt is None):
        raise click.UsageError("give both --shortlist-src and --shortlist-tgt, or neither")
    # --force replaces the whole dir: never one that holds what this export reads
    inputs = [checkpoint, *(pair or ()), *(p for p in (shortlist_src, shortlist_tgt, timing_cache) if p)]
    refuse_overwriting_inputs(inputs, [], "--out dir", output_dirs=[out])
    held_out = None if pair is None else references.held_out_lines(*pair, limit=reference_lines)
    shortlist = None if shortlist_src is None or shortlist_tgt is None else ShortlistCorpus(
        read_lines(shortlist_src), read_lines(shortlist_tgt), (str(shortlist_src), str(shortlist_tgt)),
        per_source=shortlist_per_source, frequent=shortlist_frequent)
    manifest = api.export_model(
        checkpoint, out, fp16=fp16, opset=opset, topk=topk, max_batch=max_batch,
        max_src_len=max_src_len, max_tgt_len=max_tgt_len, max_beam=max_beam, tensorrt=tensorrt,
        force=force, atol=atol, fp16_atol=fp16_atol, workspace_gib=workspace_gib,
        timing_cache=timing_cache, int8=int8, int8_atol=int8_atol, int8_flavour=int8_flavour,
        references=held_out, shortlist=shortlist)
    if manifest.tensorrt_skipped:
        click.echo(tensorrt_build.skip_message(manifest.tensorrt_skipped), err=True)
    click.echo(summary_line(out, manifest))
    if manifest.shortlist is not None:
        click.echo(describe(manifest.shortlist))


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

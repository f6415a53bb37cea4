"""`export_model`: a checkpoint -> a self-contained, verified model directory.

The directory is built in a hidden temp dir beside --out and renamed into place only
when everything (graphs, verification, engines, manifest) is done, so a failed or
interrupted export never leaves a directory that looks valid. The manifest is written
last: even a temp dir orphaned by a killed process has none, and backends refuse it.
"""

from __future__ import annotations

import errno
import importlib.metadata
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch

from export import onnx_export, quantize, tensorrt_build, trt_compat, verify
from export.errors import ExportError, TensorRTUnavailable
from export.shortlist import ShortlistCorpus, count_table, write_shortlist
from model import io_names
from model.atomic import (
    check_can_create_in,
    make_temp_dir,
    remove_stale_temps,
    replace_dir,
    usual_permissions,
    write_failure,
)
from model.checkpoint import CheckpointWriteError, load_model, resolve_checkpoint, save_checkpoint
from model.config import ModelConfig
from model.manifest import (
    CHECKPOINT_FILE,
    MANIFEST,
    ONNXRUNTIME_ONLY,
    QUANTIZATIONS,
    SPM_FILE,
    Engines,
    Graphs,
    Limits,
    Manifest,
    SourceCheckpoint,
    sha256_file,
    write_manifest,
)
from model.signals import signals_latched
from model.transformer import Transformer
from runtime import graph_files, references
from runtime.decoding import PAPER
from runtime.tokenizer import load_tokenizer
from runtime.torch_backend import TorchBackend

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class ExportDefaults:
    """The shape options' defaults, for export_model and `pipeline export` alike."""

    opset: int = 18
    topk: int = 16
    max_batch: int = 64
    max_src_len: int = 256  # both capped by the model's max_positions when not given
    max_tgt_len: int = 306  # max_src_len + the paper's 50
    max_beam: int = 8


DEFAULTS = ExportDefaults()


def check_options(cfg: ModelConfig, *, opset: int, topk: int, limits: Limits) -> None:
    """Every reason the exporter cannot serve this config with these options, at once."""
    problems = []
    if not onnx_export.MIN_OPSET <= opset <= onnx_export.MAX_OPSET:
        problems.append(f"--opset {opset} is not supported (use {onnx_export.MIN_OPSET}.."
                        f"{onnx_export.MAX_OPSET}; TensorRT needs >= 17)")
    for name in ("max_batch", "max_src_len", "max_tgt_len", "max_beam"):
        if getattr(limits, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if not 1 <= topk <= cfg.vocab_size:
        problems.append(f"--topk {topk} must be in 1..vocab_size ({cfg.vocab_size})")
    elif 2 * limits.max_beam > topk:
        problems.append(f"--max-beam {limits.max_beam} needs --topk >= {2 * limits.max_beam} "
                        "(beam search takes 2 x beam candidates per hypothesis)")
    if limits.max_src_len > cfg.max_positions:
        problems.append(f"--max-src-len {limits.max_src_len} exceeds the model's max_positions "
                        f"({cfg.max_positions})")
    if limits.max_tgt_len >= cfg.max_positions:
        problems.append(f"--max-tgt-len {limits.max_tgt_len} must be below the model's max_positions "
                        f"({cfg.max_positions})")
    if cfg.eos_id in (cfg.pad_id, cfg.bos_id):  # (Marian starts from its pad id: pad = bos is fine)
        problems.append(f"model config has pad/bos/eos ids {cfg.pad_id}/{cfg.bos_id}/{cfg.eos_id}; "
                        "the exporter needs an EOS id apart from the others")
    if problems:
        raise ExportError("cannot export: " + "; ".join(problems))


def _prepare_out(out: Path, force: bool, checkpoint: Path) -> None:
    """Refuse outputs we must not replace, before any work is done. What a killed export
    left beside --out goes first (a model dir it was replacing is put back)."""
    remove_stale_temps(out.parent)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory; choose another --out")
    if out.is_dir():
        if not force:
            raise ExportError(f"{out}: already exists; pass --force to replace it or choose another --out")
        if any(out.iterdir()) and not (out / MANIFEST).is_file():
            raise ExportError(f"{out}: exists and is not a model directory (no {MANIFEST}); "
                              "--force only replaces model directories; choose another --out")
        if out.resolve() in checkpoint.resolve().parents:
            raise ExportError(f"{out}: holds the checkpoint being exported; choose another --out")
    check_can_create_in(out.parent, "--out")
    out.parent.mkdir(parents=True, exist_ok=True)


def _versions() -> dict[str, str | None]:
    import onnx
    import onnxruntime

    try:
        pipeline_version = importlib.metadata.version("pipeline")
    except importlib.metadata.PackageNotFoundError:
        pipeline_version = None
    return {"pipeline": pipeline_version, "torch": torch.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "tensorrt": None}


def _write_graphs(graph_model: Transformer, tmp: Path, *, opset: int, topk: int,
                  int8: str | None = None) -> Graphs:
    t0 = time.perf_counter()
    onnx_export.export_encoder(graph_model, tmp / io_names.ENCODER_FILE, opset)
    onnx_export.export_decoder(graph_model, tmp / io_names.DECODER_FILE, opset, topk)
    if int8:  # the fp32 graphs, post-processed to int8 weights
        for name in (io_names.ENCODER_FILE, io_names.DECODER_FILE):
            quantize.quantize_flavour(int8, tmp / name)
    for name in (io_names.ENCODER_FILE, io_names.DECODER_FILE):
        graph_files.externalize(tmp / name)  # what ships, verified and built from below
    seconds = time.perf_counter() - t0
    for name in (io_names.ENCODER_FILE, io_names.DECODER_FILE):
        if int8 in ONNXRUNTIME_ONLY:
            break  # ONNX Runtime only by design: no engines are built from it
        problems = trt_compat.check_model(onnx.load(str(tmp / name), load_external_data=False))
        if problems:
            raise ExportError(f"{name} would not parse in TensorRT: " + "; ".join(problems))
    sizes = {name: (tmp / name).stat().st_size for graph in (io_names.ENCODER_FILE, io_names.DECODER_FILE)
             for name in (graph, io_names.weights_file(graph))}
    log.info("exported ONNX graphs in %.1f s (%s)", seconds,
             ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sizes.items()))
    return Graphs(export_seconds=round(seconds, 2), bytes=sizes)


def _engines(tmp: Path, cfg: ModelConfig, limits: Limits, *, fp16: bool,
             tensorrt: bool | None, workspace_gib: float, timing_cache: Path | None
             ) -> tuple[Engines | None, str | None]:
    """(manifest entry, None) when built; (None, reason) when skipped."""
    if tensorrt is False:
        return None, "--no-tensorrt"
    try:
        return Engines(**tensorrt_build.build_engines(tmp, cfg, limits, fp16=fp16, workspace_gib=workspace_gib,
                                                      timing_cache=timing_cache)), None
    except TensorRTUnavailable as e:
        if tensorrt:
            raise ExportError(f"--tensorrt was asked for but {e}") from None
        log.debug(tensorrt_build.skip_message(str(e)))
        return None, str(e)


def _write_failure(error: BaseException, tmp: Path, out: Path) -> OSError | None:
    """A write that failed inside the hidden temp dir (full disk, ...) named as --out, the
    path the user knows; None for any other error."""
    if isinstance(error, OSError) and str(error.filename or "").startswith(str(tmp)):
        return OSError(error.errno, error.strerror, str(out))
    if isinstance(error, CheckpointWriteError) and str(error.path).startswith(str(tmp)):  # model.pt
        code = error.errno or errno.EIO
        return OSError(code, os.strerror(code), str(out))
    return write_failure(error, out)


def export_model(checkpoint: Path, out: Path, *, fp16: bool = False, opset: int = DEFAULTS.opset,
                 topk: int = DEFAULTS.topk, max_batch: int = DEFAULTS.max_batch,
                 max_src_len: int | None = None, max_tgt_len: int | None = None,
                 max_beam: int = DEFAULTS.max_beam,
                 tensorrt: bool | None = None, force: bool = False, atol: float = verify.FP32_ATOL,
                 fp16_atol: float = verify.FP16_ATOL, workspace_gib: float = tensorrt_build.DEFAULT_WORKSPACE_GIB,
                 timing_cache: Path | None = None, int8: bool = False,
                 int8_atol: float | None = None, int8_flavour: str = quantize.AUTO,
                 references: tuple[list[str], list[str]] | None = None,
                 shortlist: ShortlistCorpus | None = None) -> Manifest:
    """Export CHECKPOINT (file or save dir) to the model dir `out`; returns the manifest.

    int8: graphs with int8 weights (export/quantize.py), verified against the fp32 PyTorch
    model within int8_atol (default: verify.INT8_ATOL for qdq, INT8_ACTIVATIONS_ATOL for the
    flavours with int8 activations); the manifest's precision is "int8" and its "quantization" the
    flavour: "qdq" (TensorRT-parseable), "rowwise" or "ort-dynamic" (ONNX Runtime on CPU
    only: no engines); "auto" is qdq when TensorRT engines are built, rowwise otherwise.

    references: (sources, human references) of a held-out set; the fp32 PyTorch model's
    translations of them are recorded in the model dir (runtime/references.py), so `pipeline
    parity` can gate a backend where PyTorch is not installed.

    shortlist: a parallel corpus to count a vocabulary shortlist from (export/shortlist.py): the model
    dir then also holds shortlist.npz and decoder_shortlist.onnx, which backends load with --shortlist.

    tensorrt: None builds engines when TensorRT and a GPU are available and otherwise
    skips them (manifest.tensorrt_skipped says why); True requires them; False skips.
    Raises ExportError / VerificationError / CheckpointError / ConfigError, leaving
    nothing at `out` (or the previous `out` untouched).
    """
    started = time.perf_counter()
    checkpoint, out = Path(checkpoint), Path(out)
    source = resolve_checkpoint(checkpoint)
    _prepare_out(out, force, source)
    if int8 and fp16:
        raise ExportError("--int8 and --fp16 cannot be combined: int8 weights run with fp32 activations")
    if int8_flavour not in (quantize.AUTO, *QUANTIZATIONS):
        raise ExportError(f"--int8-flavour {int8_flavour!r}: choose one of auto, {', '.join(QUANTIZATIONS)}")
    if int8 and int8_flavour in ONNXRUNTIME_ONLY:
        if tensorrt:
            raise ExportError(f"--int8-flavour {int8_flavour} runs on ONNX Runtime only (TensorRT rejects "
                              "its integer-matmul operators); use --int8-flavour qdq for TensorRT engines")
        tensorrt = False
    model, spm_bytes, payload = _load(source)
    # Unset source/target limits: the defaults, within the model's positions (an imported model may have fewer).
    positions = model.cfg.max_positions
    limits = Limits(max_batch, max_src_len if max_src_len is not None else min(DEFAULTS.max_src_len, positions),
                    max_tgt_len if max_tgt_len is not None else min(DEFAULTS.max_tgt_len, positions - 1), max_beam)
    check_options(model.cfg, opset=opset, topk=topk, limits=limits)
    # the shortlist's corpus is read and counted first: a bad one fails before minutes of export work
    counted = count_table(shortlist, load_tokenizer(spm_bytes), model.cfg, topk) if shortlist is not None else None
    unavailable = None
    if tensorrt is not False:  # fail now, not after minutes of export work; or skip engines knowingly
        try:
            tensorrt_build.load_tensorrt()
            tensorrt_build.gpu_identity()
        except TensorRTUnavailable as e:
            if tensorrt:
                raise ExportError(f"--tensorrt was asked for but {e}") from None
            unavailable = str(e)
    if int8 and int8_flavour == quantize.AUTO:  # TensorRT parses only qdq; ONNX Runtime runs rowwise faster
        int8_flavour = quantize.ROWWISE if tensorrt is False or unavailable else quantize.QDQ
        log.info("--int8-flavour auto: %s (%s)", int8_flavour,
                 "TensorRT engines will be built" if int8_flavour == quantize.QDQ else "no TensorRT engines")
        if int8_flavour == quantize.ROWWISE:
            tensorrt = False
    if int8_atol is None:  # the ONNX Runtime-only flavours are the ones that also quantize activations
        int8_atol = verify.INT8_ACTIVATIONS_ATOL if int8_flavour in ONNXRUNTIME_ONLY else verify.INT8_ATOL

    with signals_latched() as latch:
        tmp = make_temp_dir(out.parent, out.name, "partial")
        try:
            usual_permissions(tmp)
            save_checkpoint(tmp / CHECKPOINT_FILE, model, spm_bytes, extra=payload.get("extra") or {})
            (tmp / SPM_FILE).write_bytes(spm_bytes)
            # The one copy in the export precision: the graphs are traced from it and, for
            # fp16, the verifier runs it as the PyTorch half-precision reference.
            graph_model = onnx_export.inference_copy(model, fp16)
            graphs = _write_graphs(graph_model, tmp, opset=opset, topk=topk, int8=int8_flavour if int8 else None)
            verification = verify.verify_export(model, tmp / io_names.ENCODER_FILE, tmp / io_names.DECODER_FILE,
                                                fp16=fp16, topk=topk, atol=atol, fp16_atol=fp16_atol,
                                                model16=graph_model if fp16 else None, int8=int8, int8_atol=int8_atol)
            engines, skipped = _engines(tmp, model.cfg, limits, fp16=fp16, tensorrt=tensorrt,
                                        workspace_gib=workspace_gib, timing_cache=timing_cache)
            if int8 and int8_flavour in ONNXRUNTIME_ONLY:
                skipped = "; ".join(filter(None, [f"int8 flavour {int8_flavour} runs on ONNX Runtime only",
                                                  unavailable]))
            shortlist_info = None
            if shortlist is not None and counted is not None:
                shortlist_info = write_shortlist(
                    tmp, model, graph_model, load_tokenizer(spm_bytes), shortlist, counted, opset=opset, topk=topk,
                    fp16=fp16, int8=int8_flavour if int8 else None, atol=atol, fp16_atol=fp16_atol,
                    int8_atol=int8_atol, held_out=references)
            if references is not None:
                _record_references(tmp, model, spm_bytes, limits, topk, references, decoding_defaults(payload))
            versions = _versions()
            if engines:
                versions["tensorrt"] = engines.version
            manifest = write_manifest(tmp, Manifest(
                model_config=model.cfg, precision="int8" if int8 else "fp16" if fp16 else "fp32",
                quantization=int8_flavour if int8 else None,
                pair_bounded_weights=int8 and int8_flavour == quantize.ROWWISE,
                opset=opset, topk=topk,
                limits=limits, versions=versions, tensorrt=engines, tensorrt_skipped=skipped, graphs=graphs,
                verification=verification, decoding=decoding_defaults(payload), shortlist=shortlist_info,
                source_checkpoint=SourceCheckpoint(path=str(source.resolve()), sha256=sha256_file(source),
                                                   steps=checkpoint_steps(payload))))
            for f in tmp.iterdir():
                usual_permissions(f)
            latch.raise_if_received(f"export to {out}")  # a Ctrl-C some library swallowed
            replace_dir(tmp, out)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            failure = _write_failure(e, tmp, out)
            if failure is not None:
                raise failure from e
            raise
    log.info("export finished in %.1f s: %s", time.perf_counter() - started, out)
    return manifest


def decoding_defaults(payload: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's own decoding defaults (an imported model's generation config), checked."""
    defaults = dict((payload.get("extra") or {}).get("decoding") or {})
    PAPER.for_model(defaults)  # unknown or impossible values: one line now
    return defaults


def _record_references(model_dir: Path, model: Transformer, spm_bytes: bytes, limits: Limits, topk: int,
                       sources_refs: tuple[list[str], list[str]], defaults: dict[str, Any]) -> None:
    """references.json: the fp32 model's translations of the held-out lines, as the torch backend
    serves this model dir (its limits and top-k), with the model's decoding (the paper's unless it
    brings its own) within those limits."""
    started = time.perf_counter()
    backend = TorchBackend(model, "cpu", topk=topk, max_src_len=limits.max_src_len, max_tgt_len=limits.max_tgt_len)
    decoding = PAPER.for_model(defaults)
    decoding = decoding.replace(beam_size=max(1, min(decoding.beam_size, limits.max_beam, topk // 2)))
    recorded = references.record(backend, load_tokenizer(spm_bytes), *sources_refs, decoding)
    references.write(model_dir, recorded)
    log.info("recorded the fp32 model's translations of %d held-out lines for parity in %.1f s",
             len(recorded.sources), time.perf_counter() - started)


def checkpoint_steps(payload: dict[str, Any]) -> list[int]:
    """The training steps a checkpoint's weights come from: an averaged checkpoint's
    `extra["steps"]` (or, as older ones record, its `extra["averaged"]` file names
    checkpoint_<step>.pt); a step checkpoint's train_state step; else none known."""
    extra = payload.get("extra") or {}
    if isinstance(extra.get("steps"), list):
        return [int(s) for s in extra["steps"]]
    if isinstance(extra.get("averaged"), list):
        names = [re.fullmatch(r"checkpoint_(\d+)\.pt", Path(str(n)).name) for n in extra["averaged"]]
        return sorted(int(m.group(1)) for m in names if m)
    state = payload.get("train_state")
    step = state.get("step") if isinstance(state, dict) else None
    return [int(step)] if isinstance(step, int) else []


def _load(source: Path) -> tuple[Transformer, bytes, dict[str, Any]]:
    """The fp32 model, tokenizer bytes and payload; a checkpoint whose weights do not fit
    its config, or without a tokenizer, is an export error naming the file."""
    try:
        model, spm_bytes, payload = load_model(source, "cpu")
    except (RuntimeError, KeyError, TypeError) as e:
        raise ExportError(f"{source}: checkpoint cannot be loaded into its model config: "
                          f"{str(e).splitlines()[0]}") from None
    if not isinstance(spm_bytes, bytes) or not spm_bytes:
        raise ExportError(f"{source}: checkpoint holds no SentencePiece model; re-save it with `pipeline train`")
    return model.float().eval(), spm_bytes, payload

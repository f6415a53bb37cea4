"""`export_model`: a checkpoint -> a self-contained, verified model directory.

export/plan.resolve decides everything first (and refuses what would fail); the steps here carry
the plan out. The directory is built in a hidden temp dir beside --out and renamed into place only
when everything (graphs, verification, engines, manifest) is done, so a failed or interrupted export
never leaves a directory that looks valid. The manifest is written last: even a temp dir orphaned by
a killed process has none, and backends refuse it.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.metadata
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import torch

from export import (
    calibrate,
    cross_attention,
    onnx_export,
    quantize,
    rowwise,
    sample,
    self_attention,
    tensorrt_build,
    topk_split,
    trt_compat,
    verify,
)
from export.calibrate import RangeTable
from export.constrained import write_constrained
from export.errors import ExportError, TensorRTUnavailable, VerificationError
from export.options import READ_BY_THE_CALLER, ExportOptions, check_given
from export.out_dir import commit_out
from export.payload import checkpoint_steps, decoding_defaults
from export.plan import ExportPlan, resolve
from export.shortlist import write_shortlist
from model import io_names
from model.atomic import make_temp_dir, usual_permissions, write_failure
from model.checkpoint import CheckpointWriteError, save_checkpoint
from model.manifest import (
    CHECKPOINT_FILE,
    ONNXRUNTIME_ONLY,
    SPM_FILE,
    Engines,
    Graphs,
    Manifest,
    ShortlistInfo,
    SourceCheckpoint,
    sha256_file,
    write_manifest,
)
from model.signals import signals_latched
from model.transformer import Transformer
from runtime import graph_files, references
from runtime.decoding import PAPER, DecodingOptions
from runtime.torch_backend import TorchBackend

__all__ = ["ExportOptions", "ExportPlan", "checkpoint_steps", "decoding_defaults", "export", "export_model",
           "resolve"]

log = logging.getLogger(__name__)


def export_model(checkpoint: Path | str, out: Path | str, **options: Any) -> Manifest:
    """Export CHECKPOINT (file or save dir) to the model dir `out`; returns the manifest.

    The keywords are ExportOptions' fields (export/options.py: fp16=, int8=, topk=, max_src_len=, ...),
    the files `pipeline export` reads aside: give what they hold instead.

    int8: graphs with int8 weights (export/quantize.py), verified against the fp32 PyTorch
    model within int8_atol (default: verify.INT8_ATOL for qdq, INT8_ACTIVATIONS_ATOL for the
    flavours with int8 activations); the manifest's precision is "int8" and its "quantization" the
    flavour: "qdq" (TensorRT-parseable), "rowwise" or "ort-dynamic" (ONNX Runtime on CPU
    only: no engines); "auto" is qdq when TensorRT engines are built, rowwise otherwise. Rowwise measures static
    activation scales on `calibration` (export.options.Calibration, or a list of lines), else on the sources
    of `references`; per-row dynamic scales without either, or with no_int8_calibrate=True.

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
    files = sorted(set(options) & set(READ_BY_THE_CALLER))
    if files:
        raise TypeError(f"export_model() reads no files ({', '.join(files)}): pass what they hold as "
                        "references=(sources, references), calibration=[lines] or shortlist=ShortlistCorpus(...)")
    opts = ExportOptions(out=Path(out), **options)
    check_given(opts)
    return export(checkpoint, opts)


def export(checkpoint: Path | str, options: ExportOptions, say: Callable[[str], object] = log.info) -> Manifest:
    """The plan of this export, carried out; returns the manifest written. `say` gets the lines a user reads
    before the work starts (rowwise int8: which activation scales, and why) and, when scales calibrated on the
    built-in sample miss their gate, that they stay per row."""
    started = time.perf_counter()
    plan = resolve(Path(checkpoint), options)
    if plan.activation_scales is not None:
        say(plan.activation_scales)
    manifest = carry_out(plan, say)
    log.info("export finished in %.1f s: %s", time.perf_counter() - started, plan.out)
    return manifest


def carry_out(plan: ExportPlan, say: Callable[[str], object] = log.warning) -> Manifest:
    """The model dir, built in a temp dir beside --out and swapped in only when complete; a Ctrl-C
    or SIGTERM (even one a library swallowed) leaves nothing."""
    out = plan.out
    with signals_latched() as latch:
        tmp = make_temp_dir(out.parent, out.name, "partial")
        try:
            manifest = write_model_dir(plan, tmp, say)
            latch.raise_if_received(f"export to {out}")  # a Ctrl-C some library swallowed
            commit_out(tmp, out, plan.options.force)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, Exception):  # a Ctrl-C the exporter wrapped in its own error is one (SIGTERM's exit
                latch.raise_if_received(f"export to {out}")  # is no Exception: no library catches it)
            failure = _write_failure(e, tmp, out)
            if failure is not None:
                raise failure from e
            raise
    return manifest


def write_model_dir(plan: ExportPlan, tmp: Path, say: Callable[[str], object] = log.warning) -> Manifest:
    """Every file of the model dir into `tmp`, in the order that fails cheapest first, the manifest last; `say`
    gets the line telling that the built-in sample's scales missed their gate, or that it told little."""
    usual_permissions(tmp)
    save_checkpoint(tmp / CHECKPOINT_FILE, plan.model, plan.spm_bytes, extra=plan.payload.get("extra") or {})
    (tmp / SPM_FILE).write_bytes(plan.spm_bytes)
    # The one copy in the export precision: the graphs are traced from it and, for
    # fp16, the verifier runs it as the PyTorch half-precision reference.
    graph_model = onnx_export.inference_copy(plan.model, plan.fp16)
    ranges = _calibrate(plan)
    graphs, static_scales = _write_graphs(plan, graph_model, tmp, ranges)
    gate = _sample_gate(plan, tmp, graphs) if ranges is not None else None
    if gate is not None and not gate["passed"]:  # the built-in sample's scales missed the int8 gate: per row
        origin = plan.calibration.origin if plan.calibration else ""
        say(f"int8: the static activation scales calibrated on {origin} missed the int8 parity gate on it (BLEU "
            f"{gate['bleu_int8']:.2f} against fp32's {gate['bleu_fp32']:.2f}, at most {gate['max_bleu_delta']} "
            "apart): the graphs keep per-row dynamic scales; calibrate on text of your own with --reference-src/"
            "--reference-tgt or --int8-calibrate FILE")
        ranges = None
        graphs, static_scales = _write_graphs(plan, graph_model, tmp, None)
    elif gate is not None and gate["bleu_fp32"] < sample.TELLING_BLEU:  # passed, as two near-zero BLEUs do
        origin = plan.calibration.origin if plan.calibration else ""
        say(f"int8: the fp32 model scores BLEU {gate['bleu_fp32']:.2f} on {origin} (int8 {gate['bleu_int8']:.2f}, "
            f"{gate['identical']:.0%} of its lines as fp32 translates them), too low for the int8 gate to tell what "
            "the static scales cost: they are kept; calibrate on text of your own with --reference-src/"
            "--reference-tgt or --int8-calibrate FILE, or choose --no-int8-calibrate")
    graphs, constrained = _write_constrained(plan, tmp, graphs)
    verification = _verify(plan, graph_model, tmp)
    verification["constrained_step"] = constrained
    if plan.int8_flavour in ONNXRUNTIME_ONLY:  # the flavours whose self-attention export rewrites
        verification["self_attention"] = self_attention.describe(tmp / io_names.DECODER_FILE)
        verification["cross_attention"] = cross_attention.describe(tmp / io_names.DECODER_FILE)
    if plan.activation_scales is not None:  # rowwise: static or per row, and why
        verification["int8_activation_scales"] = _scales_record(plan, gate)
    if static_scales is not None:  # which layers run with calibrated constant scales
        verification["int8_static_scales"] = static_scales
    engines, skipped = _engines(plan, tmp)
    shortlist = _write_shortlist(plan, graph_model, tmp, ranges)
    if plan.references is not None:
        _record_references(plan, tmp)
    manifest = write_manifest(tmp, _manifest(plan, graphs, verification, engines,
                                             plan.tensorrt_skip_note() or skipped, shortlist))
    for f in tmp.iterdir():
        usual_permissions(f)
    return manifest


def _versions() -> dict[str, str | None]:
    import onnx
    import onnxruntime

    try:
        pipeline_version = importlib.metadata.version("pipeline")
    except importlib.metadata.PackageNotFoundError:
        pipeline_version = None
    return {"pipeline": pipeline_version, "torch": torch.__version__, "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "tensorrt": None}


def _scales_record(plan: ExportPlan, gate: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest's record of rowwise int8's activation scales: static (calibrated on what, chosen how) or per
    row, with the line the export printed, and the built-in sample's gate (a missed one leaves them per row)."""
    c = plan.calibration
    gated = {} if gate is None else {"sample_gate": gate}
    if c is None or (gate is not None and not gate["passed"]):
        return {"kind": "per-row", "note": plan.activation_scales, **gated}
    return {"kind": "static", "calibrated_on": c.origin, "lines": len(c.lines),
            "chosen": "default" if c.default else "given", "note": plan.activation_scales, **gated}


def _sample_gate(plan: ExportPlan, tmp: Path, graphs: Graphs) -> dict[str, Any] | None:
    """Parity's int8 gate on the built-in sample (export/sample.py) for scales calibrated on it: the graphs just
    written, in ONNX Runtime, against the fp32 PyTorch model, with the model's own decoding. None for other
    calibration lines, which are the user's."""
    if plan.calibration is None or not plan.calibration.gated:
        return None
    assert plan.tokenizer is not None  # resolve builds it for the calibration lines
    from runtime.ort_backend import OrtBackend

    started = time.perf_counter()
    limits, topk = plan.limits, plan.options.topk
    # fuse=False: the model stays as calibration and verification read it
    reference = TorchBackend(plan.model, "cpu", topk=topk, max_src_len=limits.max_src_len,
                             max_tgt_len=limits.max_tgt_len, step_mode="eager", fuse=False)
    draft = _manifest(plan, graphs, {}, None, plan.tensorrt_skip_note(), None)  # what OrtBackend reads
    int8 = OrtBackend(tmp, draft, device="cpu")
    result = sample.gate(reference, int8, plan.tokenizer, plan.calibration.directions, _served_decoding(plan),
                         references.INT8_MAX_BLEU_DELTA)
    log.info("int8 gate on the built-in sample: BLEU %.2f (fp32 %.2f) on %d lines, %s, in %.1f s",
             result["bleu_int8"], result["bleu_fp32"], result["lines"],
             "passed" if result["passed"] else "missed", time.perf_counter() - started)
    return result


def _calibrate(plan: ExportPlan) -> RangeTable | None:
    """Each linear layer's input range over the fp32 model's decoding of the calibration lines (--int8-calibrate's,
    else the held-out set's), when the plan has any."""
    if plan.calibration is None:
        return None
    assert plan.tokenizer is not None  # resolve builds it for the calibration lines
    started = time.perf_counter()
    lines = plan.calibration.lines
    sources, first = sample.encoded(plan.tokenizer, plan.model.cfg, plan.calibration, plan.limits.max_src_len)
    ranges = calibrate.activation_ranges(plan.model, sources, plan.limits.max_tgt_len, plan.options.topk,
                                         first_tokens=first)
    log.info("calibrated %d activation ranges on %d lines in %.1f s", len(ranges), len(lines),
             time.perf_counter() - started)
    return calibrate.RangeTable(plan.model, ranges)


def _write_graphs(plan: ExportPlan, graph_model: Transformer, tmp: Path,
                  ranges: RangeTable | None = None) -> tuple[Graphs, dict[str, Any] | None]:
    """encoder.onnx and decoder.onnx (int8 when planned), their weights in .data files, checked
    against the TensorRT parser's rules unless their flavour is ONNX Runtime's only; with `ranges`,
    rowwise int8 with static activation scales (and how many layers got them)."""
    opset, topk, int8 = plan.options.opset, plan.options.topk, plan.int8_flavour
    t0 = time.perf_counter()
    onnx_export.export_encoder(graph_model, tmp / io_names.ENCODER_FILE, opset)
    onnx_export.export_decoder(graph_model, tmp / io_names.DECODER_FILE, opset, topk)
    static: dict[str, Any] | None = None
    if int8:  # the fp32 graphs, post-processed to int8 weights
        for name in (io_names.ENCODER_FILE, io_names.DECODER_FILE):
            counts = rowwise.quantize_flavour(int8, tmp / name, ranges)
            if ranges is not None and counts is not None:
                static = static or {"calibration_lines": len(plan.calibration.lines if plan.calibration else [])}
                static[name] = {"static": counts[0], "per_row": counts[1]}
                log.info("%s: %d linear layers with static activation scales, %d per row", name, *counts)
        if int8 in ONNXRUNTIME_ONLY:  # a graph TensorRT never parses: the two-stage top-K (export/topk_split.py),
            _split_topk(tmp / io_names.DECODER_FILE, graph_model.cfg.vocab_size, topk)
            self_attention.rewrite_file(tmp / io_names.DECODER_FILE, graph_model.cfg)  # one kernel a layer
            cross_attention.rewrite_file(tmp / io_names.DECODER_FILE, graph_model.cfg)  # and one more
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
    return Graphs(export_seconds=round(seconds, 2), bytes=sizes), static


def _split_topk(path: Path, vocab_size: int, topk: int) -> None:
    proto = onnx.load(str(path))
    if topk_split.split_topk(proto, vocab_size, topk):
        onnx.save(proto, str(path))
        log.info("%s: top-%d in two stages over blocks of %d ids", path.name, topk, topk_split.BLOCK)


def _write_constrained(plan: ExportPlan, tmp: Path, graphs: Graphs) -> tuple[Graphs, dict[str, Any]]:
    """decoder_constrained.onnx (export/constrained.py) from the finished decoder.onnx, every flavour's:
    its size among the graphs', checked against the TensorRT parser's rules like decoder.onnx."""
    record = write_constrained(tmp)
    path = tmp / io_names.DECODER_CONSTRAINED_FILE
    if plan.int8_flavour not in ONNXRUNTIME_ONLY:
        problems = trt_compat.check_model(onnx.load(str(path), load_external_data=False))
        if problems:
            raise ExportError(f"{path.name} would not parse in TensorRT: " + "; ".join(problems))
    return dataclasses.replace(graphs, bytes={**graphs.bytes, path.name: path.stat().st_size}), record


def _verify(plan: ExportPlan, graph_model: Transformer, tmp: Path) -> dict[str, Any]:
    """The graphs in ONNX Runtime against PyTorch, within the plan's bound for its precision (decoder_constrained.onnx
    beside decoder.onnx)."""
    o = plan.options
    try:
        return verify.verify_export(plan.model, tmp / io_names.ENCODER_FILE, tmp / io_names.DECODER_FILE,
                                    fp16=o.fp16, topk=o.topk, atol=o.atol, fp16_atol=o.fp16_atol,
                                    model16=graph_model if o.fp16 else None, int8=plan.int8_flavour is not None,
                                    int8_atol=plan.int8_atol, constrained=tmp / io_names.DECODER_CONSTRAINED_FILE)
    except VerificationError as e:  # the option that sets the bound, and what a user can do (the README's promise)
        flag = "--int8-atol" if plan.int8_flavour is not None else "--fp16-atol" if o.fp16 else "--atol"
        more = (", or --no-int8-calibrate (dynamic scales)" if plan.int8_flavour == "rowwise"
                and not o.no_int8_calibrate else "")
        raise VerificationError(e.what, e.where, e.diff, e.bound, e.atol, e.rtol,
                                fix=f"; a small or briefly trained model can differ this much: raise {flag}{more}"
                                    + ("" if flag == "--atol" else ", or export in fp32")
                                    + ", then check the translations with `pipeline parity`") from None


def _engines(plan: ExportPlan, tmp: Path) -> tuple[Engines | None, str | None]:
    """(manifest entry, None) when built; (None, reason) when skipped."""
    if plan.tensorrt is False:
        return None, "--no-tensorrt"
    try:
        return Engines(**tensorrt_build.build_engines(
            tmp, plan.model.cfg, plan.limits, fp16=plan.fp16, workspace_gib=plan.options.workspace_gib,
            timing_cache=plan.options.timing_cache)), None
    except TensorRTUnavailable as e:
        if plan.tensorrt:
            raise ExportError(f"--tensorrt was asked for but {e}") from None
        log.debug(tensorrt_build.skip_message(str(e)))
        return None, str(e)


def _write_shortlist(plan: ExportPlan, graph_model: Transformer, tmp: Path,
                     ranges: RangeTable | None = None) -> ShortlistInfo | None:
    """shortlist.npz and decoder_shortlist.onnx, when the plan counted a shortlist table."""
    if plan.shortlist is None or plan.counted is None or plan.tokenizer is None:
        return None
    o = plan.options
    return write_shortlist(tmp, plan.model, graph_model, plan.tokenizer, plan.shortlist, plan.counted,
                           opset=o.opset, topk=o.topk, fp16=o.fp16, int8=plan.int8_flavour, atol=o.atol,
                           fp16_atol=o.fp16_atol, int8_atol=plan.int8_atol, held_out=plan.references, ranges=ranges)


def _served_decoding(plan: ExportPlan) -> DecodingOptions:
    """The model's decoding (the paper's unless it brings its own), its beam within the export's limits and top-k."""
    decoding = PAPER.for_model(plan.decoding)
    return decoding.replace(beam_size=max(1, min(decoding.beam_size, plan.limits.max_beam, plan.options.topk // 2)))


def _record_references(plan: ExportPlan, model_dir: Path) -> None:
    """references.json: the fp32 model's translations of the held-out lines, as the torch backend
    serves this model dir (its limits and top-k), with the model's decoding (the paper's unless it
    brings its own) within those limits."""
    assert plan.references is not None and plan.tokenizer is not None  # resolve builds the tokenizer for them
    started = time.perf_counter()
    limits, topk = plan.limits, plan.options.topk
    backend = TorchBackend(plan.model, "cpu", topk=topk, max_src_len=limits.max_src_len,
                           max_tgt_len=limits.max_tgt_len)
    recorded = references.record(backend, plan.tokenizer, *plan.references, _served_decoding(plan),
                                 plan.held_out_direction)
    references.write(model_dir, recorded)
    log.info("recorded the fp32 model's translations of %d held-out lines for parity in %.1f s",
             len(recorded.sources), time.perf_counter() - started)


def _manifest(plan: ExportPlan, graphs: Graphs, verification: dict[str, Any], engines: Engines | None,
              skipped: str | None, shortlist: ShortlistInfo | None) -> Manifest:
    versions = _versions()
    if engines:
        versions["tensorrt"] = engines.version
    return Manifest(
        model_config=plan.model.cfg, precision=plan.precision, quantization=plan.int8_flavour,
        pair_bounded_weights=plan.int8_flavour == quantize.ROWWISE, opset=plan.options.opset,
        topk=plan.options.topk, limits=plan.limits, versions=versions, tensorrt=engines, tensorrt_skipped=skipped,
        graphs=graphs, verification=verification, decoding=plan.decoding, shortlist=shortlist,
        language_pair=plan.language_pair,
        source_checkpoint=SourceCheckpoint(path=str(plan.source.resolve()), sha256=sha256_file(plan.source),
                                           steps=plan.steps))


def _write_failure(error: BaseException, tmp: Path, out: Path) -> OSError | None:
    """A write that failed inside the hidden temp dir (full disk, ...) named as --out, the
    path the user knows; None for any other error."""
    if isinstance(error, OSError) and str(error.filename or "").startswith(str(tmp)):
        return OSError(error.errno, error.strerror, str(out))
    if isinstance(error, CheckpointWriteError) and str(error.path).startswith(str(tmp)):  # model.pt
        code = error.errno or errno.EIO
        return OSError(code, os.strerror(code), str(out))
    return write_failure(error, out)

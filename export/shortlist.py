"""The vocabulary shortlist of a model dir: its lexical table and its decoder step over candidates.

`export_model(..., shortlist=ShortlistCorpus(src, tgt))` counts the table (runtime/shortlist.py) from a
parallel corpus tokenized by the model's tokenizer, exports decoder_shortlist.onnx (the same step as
decoder.onnx, its projection a Gather of the candidates' rows of the tied embedding: standard ONNX ops,
so TensorRT parses it too), quantized like decoder.onnx, and verifies it against the PyTorch step over
the same candidates. Its weights are decoder.onnx's: every initializer whose bytes equal one in
decoder.data is read from there, so the shortlist costs no second copy of the decoder on disk (and a
backend loads one of the two graphs, never both).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from export import onnx_export, rowwise, trt_compat, verify
from export.errors import ExportError
from model import io_names
from model.config import ModelConfig
from model.manifest import ONNXRUNTIME_ONLY, ShortlistInfo
from model.transformer import Transformer
from runtime import graph_files
from runtime.shortlist import DEFAULT_FREQUENT, DEFAULT_PER_SOURCE, Shortlist, build
from runtime.tokenizer import AnyTokenizer

if TYPE_CHECKING:
    from export.calibrate import RangeTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShortlistCorpus:
    """What the table is counted from (the lines of a parallel corpus, read by the caller, and the files
    they came from, for messages and the manifest), and its sizes (export's --shortlist-* options)."""

    sources: list[str]
    targets: list[str]
    files: tuple[str, str]
    per_source: int = DEFAULT_PER_SOURCE
    frequent: int = DEFAULT_FREQUENT


def count_table(corpus: ShortlistCorpus, tokenizer: AnyTokenizer, cfg: ModelConfig, topk: int) -> tuple[Shortlist, int]:
    """The lexical table of `corpus` as this model tokenizes it; an error naming the files when they
    are not line-aligned or too small to give top-k candidates."""
    src, tgt = corpus.sources, corpus.targets
    if len(src) != len(tgt):
        raise ExportError(f"--shortlist-src {corpus.files[0]} has {len(src)} lines but --shortlist-tgt "
                          f"{corpus.files[1]} has {len(tgt)}; they must be line-aligned")
    if corpus.frequent < topk:
        raise ExportError(f"--shortlist-frequent {corpus.frequent} must be at least --topk ({topk}): every step "
                          "needs that many candidates")
    exclude = {cfg.pad_id, *cfg.suppress_ids} | ({cfg.bos_id} if cfg.bos_id != cfg.eos_id else set())
    table, pairs = build(tokenizer.encode_source(src), tokenizer.encode(tgt), vocab_size=cfg.vocab_size,
                         eos_id=cfg.eos_id, exclude=exclude, per_source=corpus.per_source, frequent=corpus.frequent)
    if 1 + table.frequent.size < topk:
        raise ExportError(f"--shortlist-tgt {corpus.files[1]}: only {table.frequent.size} distinct target pieces, "
                          f"fewer than the decoder step's top {topk}; give a larger corpus")
    return table, pairs


def share_weights(graph: Path, donor: Path) -> int:
    """Point every initializer of `graph` whose dtype, shape and bytes equal an initializer of the same
    name in `donor`'s weights file at that file; the rest stay in `graph`'s own weights file (written
    again, or removed when nothing is left in it). Returns the bytes shared."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    donor_proto = onnx.load(str(donor), load_external_data=False)
    donor_data = np.memmap(donor.with_name(io_names.weights_file(donor.name)), dtype=np.uint8, mode="r")
    donors = {t.name: t for t in donor_proto.graph.initializer if uses_external_data(t)}
    proto = onnx.load(str(graph))  # with its weights
    shared = 0
    for t in proto.graph.initializer:
        d = donors.get(t.name)
        if d is None or d.data_type != t.data_type or list(d.dims) != list(t.dims) or not t.HasField("raw_data"):
            continue
        info = ExternalDataInfo(d)
        offset, length = info.offset, info.length
        if info.location != io_names.weights_file(donor.name) or offset is None or length is None:
            continue
        if bytes(donor_data[offset:offset + length]) != t.raw_data:
            continue
        t.ClearField("raw_data")
        t.data_location = onnx.TensorProto.EXTERNAL
        del t.external_data[:]
        for key, value in (("location", info.location), ("offset", str(offset)), ("length", str(length))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        shared += length
    own = graph.with_name(io_names.weights_file(graph.name))
    graph_files.save_graph(proto, graph)
    if own.exists() and own.stat().st_size == 0:
        own.unlink()
    return shared


def write_shortlist(tmp: Path, model32: Transformer, graph_model: Transformer, tokenizer: AnyTokenizer,
                    corpus: ShortlistCorpus, counted: tuple[Shortlist, int], *, opset: int, topk: int, fp16: bool,
                    int8: str | None, atol: float, fp16_atol: float, int8_atol: float,
                    held_out: tuple[list[str], list[str]] | None, ranges: RangeTable | None = None) -> ShortlistInfo:
    """shortlist.npz (the table `count_table` counted) and decoder_shortlist.onnx in the model dir being
    built at `tmp` (after decoder.onnx)."""
    started = time.perf_counter()
    table, pairs = counted
    table.save(tmp / io_names.SHORTLIST_FILE)
    path = tmp / io_names.DECODER_SHORTLIST_FILE
    onnx_export.export_decoder(graph_model, path, opset, topk, shortlist=True)
    if int8:
        rowwise.quantize_flavour(int8, path, ranges)
    graph_files.externalize(path)
    shared = share_weights(path, tmp / io_names.DECODER_FILE)
    if int8 not in ONNXRUNTIME_ONLY:
        import onnx

        problems = trt_compat.check_model(onnx.load(str(path), load_external_data=False))
        if problems:
            raise ExportError(f"{path.name} would not parse in TensorRT: " + "; ".join(problems))
    verification = verify.verify_export(model32, tmp / io_names.ENCODER_FILE, path, fp16=fp16, topk=topk, atol=atol,
                                        fp16_atol=fp16_atol, model16=graph_model if fp16 else None,
                                        int8=int8 is not None, int8_atol=int8_atol, shortlist=table)
    coverage = candidates = None
    if held_out is not None:
        sources = tokenizer.encode_source(held_out[0])
        inside, total = table.coverage(sources, tokenizer.encode(held_out[1]))
        coverage = round(inside / total, 4) if total else None
        candidates = round(float(np.mean([table.candidates(np.asarray(s)).size for s in sources if s])), 1)
    info = ShortlistInfo(corpus=list(corpus.files), pairs=pairs, per_source=corpus.per_source,
                         frequent=int(table.frequent.size), entries=int(table.targets.size),
                         shared_weight_bytes=shared, held_out_coverage=coverage,
                         held_out_candidates=candidates, verification=verification)
    held = "" if coverage is None else f"; held-out reference coverage {coverage:.1%}, {candidates} candidates " \
        "per sentence"
    log.info("shortlist from %d sentence pairs: %d frequent + up to %d per source piece (%d entries); "
             "decoder_shortlist.onnx shares %.1f MB of decoder.data%s; %.1f s", pairs, info.frequent,
             corpus.per_source, info.entries, shared / 1e6, held, time.perf_counter() - started)
    return info


def describe(info: ShortlistInfo) -> str:
    """One line for the export summary."""
    line = (f"shortlist: {info.frequent} frequent + up to {info.per_source} per source piece, counted on "
            f"{info.pairs} sentence pairs")
    if info.held_out_coverage is not None:
        line += (f"; covers {info.held_out_coverage:.1%} of the held-out references' tokens with "
                 f"{info.held_out_candidates} candidates per sentence")
    return line

"""Static activation scales for the rowwise int8 flavour (`pipeline export --int8 --int8-calibrate FILE`).

Rowwise int8 quantizes each linear layer's input one row at a time at run time: Abs, ReduceMax, Max, two Divs
and a QuantizeLinear before every integer GEMM and a Mul after it, 15-20% of an int8 step on AVX2. With
static scales each input is quantized with one constant, measured here: QuantizeLinear and the GEMM, whose
output is already scaled (export/quantize.py). Like rowwise, no sentence's result depends on another's.

Measured: the fp32 PyTorch model decodes the calibration sentences as the torch backend serves them (beam
search, q/k/v projected apart), and a hook on every nn.Linear and on the output projection keeps the
largest |input| each sees (`activation_ranges`), except a post-norm model's first layers, which read the
embedding table and keep per-row scales (`first_layer_projections`). A graph's linear layers are then found
by their weights, not their names (`RangeTable`): a column of an ONNX weight is a row of the torch weight it
was exported from (fused q/k/v share their input, so any of the three serves). A layer whose weight is found
nowhere keeps per-row scales; the export logs how many did.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from model.transformer import Transformer

log = logging.getLogger(__name__)

LOGITS = "logits"  # the output projection (the tied embedding), which is no nn.Linear
CALIBRATION_BATCH = 16


def activation_ranges(model: Transformer, sources: list[list[int]], max_tgt_len: int, topk: int,
                      beam_size: int = 4, first_tokens: list[int] | None = None) -> dict[str, float]:
    """{module name (or LOGITS): the largest |input| it saw} over a beam search of `sources` (token ids), each
    output at most source length + 50 tokens (the paper's limit, serving's default) and max_tgt_len;
    first_tokens: per source, its forced first token (a multilingual model's target language)."""
    from runtime.decoding import PAPER
    from runtime.search import beam_search
    from runtime.torch_backend import TorchBackend
    from runtime.translate import pad_batch

    seen: dict[str, float] = {}

    def record(name: str, x: torch.Tensor) -> None:
        seen[name] = max(seen.get(name, 0.0), float(x.detach().abs().max()))

    handles = [m.register_forward_pre_hook(lambda _m, args, name=name: record(name, args[0]))
               for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    projection = model.logits

    def logits(x: torch.Tensor, candidates: torch.Tensor | None = None) -> torch.Tensor:
        record(LOGITS, x)
        return projection(x, candidates)

    model.logits = logits  # type: ignore[method-assign]
    try:
        # fuse=False: q, k and v projected by their own modules, so each hook sees its input
        backend = TorchBackend(model, "cpu", topk=topk, max_tgt_len=max_tgt_len, step_mode="eager", fuse=False)
        with torch.inference_mode():
            for i in range(0, len(sources), CALIBRATION_BATCH):
                batch = sources[i:i + CALIBRATION_BATCH]
                longest = min(max_tgt_len - 1, max(map(len, batch)) + PAPER.max_len_b)
                first = None if first_tokens is None else first_tokens[i:i + CALIBRATION_BATCH]
                beam_search(backend, pad_batch(batch, model.cfg.pad_id), beam_size=min(beam_size, topk // 2),
                            max_len_a=0.0, max_len_b=longest, first_tokens=first)
    finally:
        for h in handles:
            h.remove()
        del model.logits
    if not model.cfg.pre_norm:  # the first layers read embedding + position: kept per row (first_layer_projections)
        for name in first_layer_projections():
            seen.pop(name, None)
    return seen


def first_layer_projections() -> list[str]:
    """A post-norm model's linear layers that read embedding x scale + position directly: the first encoder
    and decoder layers' q, k and v. They keep per-row scales, because any token of the table can reach them
    but calibration sees only the tokens it decodes, and neither that range nor the table's whole one
    served an imported Marian model (benchmarks/README.md, "static-scales-parity")."""
    return [f"{stack}.0.self_attn.{proj}" for stack in ("encoder", "decoder")
            for proj in ("q_proj", "k_proj", "v_proj")]


class RangeTable:
    """The calibrated range of a linear layer's input, looked up by one of its weight's columns."""

    def __init__(self, model: Transformer, ranges: dict[str, float]):
        self.by_row: dict[int, float] = {}
        weights: list[tuple[str, torch.Tensor]] = [(n, m.weight) for n, m in model.named_modules()
                                                   if isinstance(m, nn.Linear)]
        weights.append((LOGITS, model.embed.weight))
        for name, weight in weights:
            if name in ranges:
                for row in _rows(weight.detach().float().cpu().numpy()):
                    self.by_row[hash(row)] = ranges[name]
        self.ranges = ranges

    def output_projection(self) -> float | None:
        """The range of the output projection's input (the shortlist's gathered projection has no weight
        matrix to look up: its rows are gathered from the table at run time)."""
        return self.ranges.get(LOGITS)

    def lookup(self, kn: np.ndarray) -> float | None:
        """The range of the input of a (K, N) weight matrix, or None when no calibrated layer has it."""
        column = int(np.abs(kn).sum(axis=0).argmax())  # not the padding id's all-zero embedding row
        return self.by_row.get(hash(np.ascontiguousarray(kn[:, column], dtype=np.float32).tobytes()))


def _rows(matrix: np.ndarray) -> Iterable[bytes]:
    for row in np.ascontiguousarray(matrix, dtype=np.float32):
        yield row.tobytes()

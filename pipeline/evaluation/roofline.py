"""The roofline of one decoder step: what a step must read and compute, from the model's shape alone,
against what the card can do (a large device-to-device copy, a large matmul).

One decoder step (model.Transformer.decode_step) for `rows` = sentences x beam hypotheses at step t:

    weights    every decoder layer's self-attention Q/K/V/out, cross-attention Q/out (the cross K/V
               projections run once per sentence in the encoder, not per step), the feed-forward
               W1/W2, three LayerNorms, and the output projection (the tied embedding, V x d_model)
    self K/V   each hypothesis reads the keys and values of its t earlier positions in every layer,
               and writes the step's own (model/cache.py)
    cross K/V  each sentence's cross-attention keys and values (once per sentence, not per beam:
               the step folds a sentence's beam queries into one matmul against them)
    logits     the (rows, V) fp32 log-probs, written once and read once (log-softmax / top-k): the
               least an unfused step can do; at batch 128 x beam 4 they weigh as much as the weights

FLOPs count a multiply-add as 2: the linear layers (2 x rows x weights' matrix elements) and the
attention matmuls (QK^T and PV over t + 1 positions; over the source for cross-attention).
The arithmetic is plain Python; only the measurements import torch.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Shape:
    """What the step arithmetic needs of a model config (model.config.ModelConfig has these fields)."""

    d_model: int
    n_heads: int
    d_ff: int
    n_dec_layers: int
    vocab_size: int

    @classmethod
    def of(cls, cfg: Any) -> Shape:
        return cls(cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.n_dec_layers, cfg.vocab_size)


@dataclass(frozen=True)
class StepCost:
    """Bytes and FLOPs of one or more decoder steps (sums add up field by field)."""

    weight_bytes: int
    self_kv_bytes: int
    cross_kv_bytes: int
    logits_bytes: int
    linear_flops: int
    attention_flops: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.self_kv_bytes + self.cross_kv_bytes + self.logits_bytes

    @property
    def flops(self) -> int:
        return self.linear_flops + self.attention_flops

    def __add__(self, other: StepCost) -> StepCost:
        return StepCost(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def to_dict(self) -> dict[str, int]:
        return dict(asdict(self), bytes=self.bytes, flops=self.flops)


def astuple(cost: StepCost) -> tuple[int, ...]:
    return (cost.weight_bytes, cost.self_kv_bytes, cost.cross_kv_bytes, cost.logits_bytes, cost.linear_flops,
            cost.attention_flops)


def layer_matrix_elements(shape: Shape) -> int:
    """Weight-matrix elements one decoder layer multiplies per hypothesis and step: self-attention
    Q, K, V, out (4 d^2), cross-attention Q and out (2 d^2), feed-forward (2 d d_ff)."""
    d = shape.d_model
    return 6 * d * d + 2 * d * shape.d_ff


def layer_vector_elements(shape: Shape) -> int:
    """Bias and LayerNorm elements of one decoder layer read per step: six projection biases of d,
    the feed-forward biases (d_ff + d), three LayerNorms (gain and bias, 2 d each)."""
    d = shape.d_model
    return 6 * d + shape.d_ff + d + 3 * 2 * d


def step_weight_elements(shape: Shape) -> int:
    """Weight elements one decoder step reads: every decoder layer plus the output projection."""
    per_layer = layer_matrix_elements(shape) + layer_vector_elements(shape)
    return shape.n_dec_layers * per_layer + shape.vocab_size * shape.d_model


def step_cost(shape: Shape, sentences: int, beam: int, t: int, src_len: int, weight_bytes: int = 4,
              cache_bytes: int | None = None, logits_bytes: int = 4) -> StepCost:
    """Bytes and FLOPs of decoder step t (0-based: t earlier positions in the cache) for `sentences`
    x `beam` hypotheses over sources of `src_len` tokens. `weight_bytes`: bytes per weight element
    (4 fp32, 2 fp16/bf16); `cache_bytes`: per K/V element (default: as the weights)."""
    if min(sentences, beam, src_len) < 1 or t < 0:
        raise ValueError(f"sentences, beam and src_len must be >= 1 and t >= 0 (got {sentences}, {beam}, "
                         f"{src_len}, {t})")
    cache_bytes = weight_bytes if cache_bytes is None else cache_bytes
    rows = sentences * beam
    d, layers, vocab = shape.d_model, shape.n_dec_layers, shape.vocab_size
    self_kv = 2 * layers * rows * (t + 1) * d * cache_bytes  # read t earlier positions, write the step's own
    cross_kv = 2 * layers * sentences * src_len * d * cache_bytes
    logits = 2 * rows * vocab * logits_bytes
    linear = 2 * rows * (layers * layer_matrix_elements(shape) + vocab * d)
    attention = 2 * 2 * rows * d * layers * ((t + 1) + src_len)  # QK^T and PV, self then cross
    return StepCost(step_weight_elements(shape) * weight_bytes, self_kv, cross_kv, logits, linear, attention)


def decode_cost(shape: Shape, sentences: int, beam: int, steps: int, src_len: int, **kw: Any) -> StepCost:
    """Steps 0 .. steps-1 of one batch that stays whole (every sentence decodes `steps` steps,
    as in `pipeline bench --fixed-length N`, which runs N + 1 steps: N tokens, then the forced EOS)."""
    total = StepCost(0, 0, 0, 0, 0, 0)
    for t in range(steps):
        total = total + step_cost(shape, sentences, beam, t, src_len, **kw)
    return total


def achieved(cost: StepCost, seconds: float, bandwidth: float, flop_rate: float) -> dict[str, float]:
    """What `seconds` of stepping achieved against the card: bytes/s and FLOP/s, each as a share of
    the measured copy bandwidth and matmul rate, and the roofline bound (the larger of the two
    times) as a share of the time taken (100%: the step runs at the roofline)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0 (got {seconds})")
    bound = max(cost.bytes / bandwidth, cost.flops / flop_rate)
    return {
        "seconds": seconds,
        "bytes_per_s": cost.bytes / seconds,
        "flops_per_s": cost.flops / seconds,
        "bandwidth_pct": 100.0 * cost.bytes / seconds / bandwidth,
        "flops_pct": 100.0 * cost.flops / seconds / flop_rate,
        "roofline_seconds": bound,
        "roofline_pct": 100.0 * bound / seconds,
        "arithmetic_intensity": cost.flops / cost.bytes,
    }


# -- measurements (torch) --------------------------------------------------------------------


def _sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: str = "cuda", nbytes: int = 1 << 30, repeats: int = 10) -> dict[str, float]:
    """Device-to-device copy of `nbytes`: bytes read + written per second (the best of `repeats`)."""
    import torch

    dev = torch.device(device)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(torch, dev)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(torch, dev)
        best = min(best, time.perf_counter() - t0)
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    return {"bytes": float(moved), "seconds": best, "bytes_per_s": moved / best}


def measure_matmul_rate(device: str = "cuda", dtype: str = "fp32", n: int = 8192, repeats: int = 10,
                        allow_tf32: bool = False) -> dict[str, float]:
    """n x n x n matmul: FLOP/s (2 n^3 per product, the best of `repeats`). fp32 without TF32 by
    default, as the fp32 model runs with PyTorch's default (no TF32 matmuls)."""
    import torch

    dev = torch.device(device)
    dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    try:
        a = torch.randn(n, n, device=dev).to(dt)
        b = torch.randn(n, n, device=dev).to(dt)
        torch.matmul(a, b)
        _sync(torch, dev)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            _sync(torch, dev)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    flops = 2.0 * n ** 3
    return {"n": float(n), "seconds": best, "flops_per_s": flops / best}

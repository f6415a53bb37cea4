"""How far a CPU bench row is from what the machine can compute: multiply-adds per target token from the
model's shape, over the CPU's peak rate of int8 (or fp32) multiply-adds.

MACs per target token (`macs_per_target_token`): the decoder step of every hypothesis (beam of them per
sentence), each step's linear layers (self-attention q/k/v/out, cross-attention q/out, the feed-forward, the
output projection onto the vocabulary or the shortlist's candidates) and its attention over the step's
earlier positions and the source; plus the sentence's share of the encoder (its layers over every source
token, and the cross-attention K/V projections). LayerNorms, softmax and top-k are not multiply-adds.

The peak, two ways (`measure`), both for the threads the bench ran:
- `theoretical`: cores x clock x multiply-adds per cycle and core from the instruction set, for the
  widest form our int8 graphs use (ONNX Runtime's MLAS kernels), two vector multiplies per cycle:
  AVX-512 VNNI 128 int8 (VPDPBUSD, 64 lanes); AVX-512 without VNNI 128 (VPMADDUBSW, 64 byte products
  summed in pairs); AVX-VNNI and AVX2 64 (32 lanes); fp32 two FMAs (AVX-512 32, AVX2 16). Not a
  bound: AMD Zen 4 runs 512-bit instructions in two halves (half the AVX-512 figure), and the clock is
  /proc/cpuinfo's, which can be below the boost clock (a 2-core AVX2 EPYC's fp32 GEMM measured 90
  GMAC/s against 78 from its reported 2.445 GHz). (On an AVX2 EPYC at 2.45 GHz one thread's int8 GEMM
  measured 94 GMAC/s, 38 per cycle: more than the one VPMADDUBSW per cycle an earlier estimate assumed.)
- `measured`: the best rate of one large GEMM in ONNX Runtime (MatMulInteger u8 x s8 for int8, MatMul
  for fp32), the same library's kernels our int8 rows run: what this machine gives in practice.
A row's `pct_of_peak` is against both; the measured one is the honest ceiling.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.cpu_int8 import cpu_flags

GEMM = (256, 1024, 1024)  # rows x inner x columns of the measured GEMM: base-sized, cache-friendly


@dataclass(frozen=True)
class Peak:
    isa: str                     # the instruction set the theoretical figure assumes
    int8_per_cycle: int | None   # multiply-adds per cycle and core
    fp32_per_cycle: int | None
    ghz: float | None
    threads: int
    theoretical: dict[str, float | None]  # "int8"/"fp32" -> multiply-adds per second, all threads
    measured: dict[str, float]            # the same from a GEMM on this machine
    gemm: tuple[int, int, int]
    load_average: float | None  # the 1-minute load when measured: a loaded machine measures less

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def isa(flags: set[str]) -> tuple[str, int | None, int | None]:
    """(name, int8 and fp32 multiply-adds per cycle and core) of the widest form this CPU has."""
    avx512 = "avx512f" in flags
    if avx512 and flags & {"avx512_vnni", "avx512vnni"}:
        return "AVX-512 VNNI", 128, 32
    if avx512:
        return "AVX-512 without VNNI", 128, 32
    if flags & {"avx_vnni", "avxvnni"}:
        return "AVX-VNNI (AVX2)", 64, 16
    if "avx2" in flags:
        return "AVX2 without VNNI", 64, 16
    return f"{platform.machine()} (no x86 vector figure)", None, None


def clock_ghz(cpuinfo: str | None = None) -> float | None:
    """The highest 'cpu MHz' /proc/cpuinfo reports, in GHz (None where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return None
    mhz = [float(v) for k, _, v in (line.partition(":") for line in cpuinfo.splitlines())
           if k.strip() == "cpu MHz" and v.strip().replace(".", "", 1).isdigit()]
    return round(max(mhz) / 1000, 3) if mhz else None


def _gemm_session(precision: str, threads: int) -> tuple[Any, dict[str, np.ndarray]]:
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    m, k, n = GEMM
    rng = np.random.default_rng(0)
    if precision == "int8":
        w = rng.integers(-64, 64, size=(k, n), dtype=np.int8)
        node = helper.make_node("MatMulInteger", ["x", "w"], ["y"])
        x_type, y_type = TensorProto.UINT8, TensorProto.INT32
        feed = {"x": rng.integers(0, 256, size=(m, k), dtype=np.uint8)}
    else:
        w = rng.standard_normal((k, n), dtype=np.float32)
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
        x_type = y_type = TensorProto.FLOAT
        feed = {"x": rng.standard_normal((m, k), dtype=np.float32)}
    graph = helper.make_graph([node], "gemm", [helper.make_tensor_value_info("x", x_type, [m, k])],
                              [helper.make_tensor_value_info("y", y_type, [m, n])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session, feed


def measure_gemm(precision: str, threads: int, seconds: float = 0.5) -> float:
    """Multiply-adds per second of GEMM in ONNX Runtime: the best of repeated runs for about `seconds`."""
    session, feed = _gemm_session(precision, threads)
    session.run(None, feed)
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        session.run(None, feed)
        best = min(best, time.perf_counter() - t0)
    m, k, n = GEMM
    return m * k * n / best


def measure(threads: int | None = None, flags: set[str] | None = None) -> Peak:
    """This machine's peak for `threads` threads (default: every core)."""
    threads = threads or os.cpu_count() or 1
    name, int8, fp32 = isa(cpu_flags() if flags is None else flags)
    ghz = clock_ghz()

    def theory(per_cycle: int | None) -> float | None:
        return None if per_cycle is None or ghz is None else per_cycle * ghz * 1e9 * threads

    measured = {p: round(measure_gemm(p, threads)) for p in ("int8", "fp32")}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return Peak(name, int8, fp32, ghz, threads, {"int8": theory(int8), "fp32": theory(fp32)}, measured, GEMM,
                load)


def step_macs(cfg: Any, rows: int, t: float, src_len: float, vocab: float | None = None) -> float:
    """Multiply-adds of one decoder step for `rows` hypotheses with `t` earlier positions each, over sources
    of `src_len` tokens; `vocab`: the output projection's width (default the whole vocabulary)."""
    d = cfg.d_model
    vocab = cfg.vocab_size if vocab is None else vocab
    linear = cfg.n_dec_layers * (4 * d * d + 2 * d * d + 2 * d * cfg.d_ff) + d * vocab
    attention = cfg.n_dec_layers * 2 * d * ((t + 1) + src_len)  # QK and PV: own + earlier keys, the source
    return rows * (linear + attention)


def encoder_macs(cfg: Any, src_len: float) -> float:
    """Multiply-adds of encoding one source of `src_len` tokens, with its cross-attention K/V projections."""
    d = cfg.d_model
    layers = cfg.n_enc_layers * src_len * (4 * d * d + 2 * d * cfg.encoder_d_ff + 2 * d * src_len)
    return layers + src_len * cfg.n_dec_layers * 2 * d * d


def macs_per_target_token(cfg: Any, beam: int, src_len: float, tgt_len: float, vocab: float | None = None) -> float:
    """Multiply-adds per target token for sentences of `src_len` source and `tgt_len` target tokens (the
    decoder runs tgt_len + 1 steps: the last emits EOS), `beam` hypotheses each; `vocab`: the output
    projection's width (the shortlist's mean candidates), default the whole vocabulary."""
    steps = tgt_len + 1
    decoder = steps * step_macs(cfg, beam, (steps - 1) / 2, src_len, vocab)  # t runs 0 .. steps - 1
    return (decoder + encoder_macs(cfg, src_len)) / max(tgt_len, 1)


def share(row: dict[str, Any], macs: float, peak: dict[str, Any]) -> dict[str, float | None]:
    """A row's achieved multiply-adds per second as a percentage of the peak of its precision."""
    precision = "int8" if row.get("precision") == "int8" else "fp32"
    rate = macs * row["target_tokens_per_s"]
    out = {}
    for kind in ("measured", "theoretical"):
        top = peak[kind].get(precision)
        out[f"pct_of_{kind}_peak"] = round(100 * rate / top, 1) if top else None
    return out


def mean_candidates(shortlist: Any, sources: list[list[int]], batch_size: int) -> float:
    """The shortlist's mean candidate count over `sources` cut into batches as the bench cuts them."""
    counts = [len(shortlist.candidates(np.array([t for s in sources[i:i + batch_size] for t in s])))
              for i in range(0, len(sources), batch_size)]
    return float(np.mean(counts))


def annotate(row: dict[str, Any], cfg: Any, sources: list[list[int]], peak: dict[str, Any],
             shortlist: Any = None) -> None:
    """Add `macs_per_target_token` and the `pct_of_*_peak` figures to a CPU results row (in place); a row
    over the shortlist counts its mean candidates as the output projection's width."""
    if not str(row.get("device", "cpu")).startswith("cpu") or not row.get("target_tokens"):
        return
    vocab = mean_candidates(shortlist, sources, row["batch_size"]) if row.get("shortlist") and shortlist else None
    src_len = float(np.mean([len(s) for s in sources]))
    macs = macs_per_target_token(cfg, row["beam_size"], src_len, row["target_tokens"] / len(sources), vocab)
    row["macs_per_target_token"] = round(macs)
    row.update(share(row, macs, peak))


def percent(row: dict[str, Any]) -> str:
    """A table cell: the row's share of the measured peak ('-' for GPU rows)."""
    pct = row.get("pct_of_measured_peak")
    return "-" if pct is None else f"{pct:.0f}%"


def peak_line(peak: dict[str, Any]) -> str:
    """The table's footnote: what '% peak' is measured against."""
    def g(x: float | None) -> str:
        return "-" if x is None else f"{x / 1e9:.0f}"

    m, k, n = peak["gemm"]
    return (f"% peak: MACs per target token (from the shape; the shortlist's mean candidates where used) x tok/s, "
            f"over this CPU's measured {m}x{k}x{n} ONNX Runtime GEMM at {peak['threads']} threads: int8 "
            f"{g(peak['measured']['int8'])}, fp32 {g(peak['measured']['fp32'])} GMAC/s ({peak['isa']} at "
            f"{peak['ghz']} GHz would give int8 {g(peak['theoretical']['int8'])}, fp32 "
            f"{g(peak['theoretical']['fp32'])}; pct_of_theoretical_peak in the JSON); load average "
            f"{peak.get('load_average')}")

"""Verification of exported graphs: onnx.checker, then ONNX Runtime against PyTorch.

Both sides run the same functions (model.encode/cross_kv/decode_step + select_candidates)
on a real padded batch, then 10+ beam-like decoding steps: every step follows a `reorder`
with repeated rows (model/cache.py's ancestry index), the cache buffers grow past their
capacity twice, one step drops a finished sentence's hypotheses, its cache rows and its
cross K/V row, and each engine's own step K/V are written into its own cache (a decoder with a cache per
hypothesis keeps its own, export/self_attention.py), so errors accumulate as in serving. Candidate log-probs
are compared by max abs difference against a tolerance; candidate ids only where the gap to the neighbouring
candidates exceeds that tolerance (a tie within the tolerance may legitimately order either way).

fp16: ONNX Runtime on CPU lacks fp16 kernels for several ops and silently computes them
in fp32 (it inserts Casts), so ORT-vs-PyTorch alone would not test the fp16 arithmetic.
The half-precision model is therefore also run in PyTorch half precision (real fp16
matmuls) against the fp32 model, with the same fp16 tolerance.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from export import constrained as constrained_step
from export import self_attention, topk_split
from export.errors import ExportError, VerificationError
from export.onnx_export import inference_copy
from model import io_names
from model.cache import BeamCache, step_outputs
from model.transformer import Transformer, select_candidates
from runtime.cpu_int8 import ACCURACY_LEVEL, has_int8_dot_product, int8_session_config

log = logging.getLogger(__name__)

FP32_ATOL = 1e-4
FP16_ATOL = 2e-2  # measured ~4e-3 on random tiny, small and base models
# Log-probs are compared within atol + rtol * |reference|. A trained model's unlikely
# candidates sit at log-probs of -10..-30, where fp16 logits (about 3 significant digits)
# put abs errors of a few 1e-2 (0.038 measured on a tiny model that memorised its
# corpus), while the candidates search actually chooses (log-probs near 0) keep ~atol.
FP32_RTOL = 0.0  # fp32 errors are ~1e-6 whatever the magnitude: abs alone
FP16_RTOL = 1e-2
# int8 weights (per-channel, symmetric) with int8 GEMMs in ONNX Runtime, against the fp32
# PyTorch model: the error is the quantization's, not ORT's, and grows with |log-prob|
# like fp16's. Measured on the tiny random and trained models: see tests/test_int8.py.
INT8_ATOL = 0.15
INT8_RTOL = 0.05
# Flavours that also quantize activations to 8 bits (rowwise, ort-dynamic) add that error on top.
# Measured max |log-prob| differences: Multi30k `small` 0.126 (qdq 0.110, same checked inputs);
# the tiny test model that memorised its corpus, fed the random tokens checked here, 0.22.
INT8_ACTIVATIONS_ATOL = 0.3
N_STEPS = 12
VERIFY_CAPACITY = 4  # initial cache capacity (steps) in verification: N_STEPS grows it twice
BEAM = 2


def check_graph(path: Path) -> None:
    """onnx.checker on the file path (the path form also handles >2 GB external data)."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as e:  # noqa: BLE001 - checker raises ValidationError and friends
        raise ExportError(f"{path.name}: onnx.checker rejected the graph: {e}") from e


# -- the two engines behind one small interface ------------------------------------------

StepFn = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def ort_runner(graph: Path | str | bytes, config: dict[str, str] | None = None) -> StepFn:
    """Feed named numpy arrays to an ONNX Runtime CPU session of the graph (a file, or a serialized
    graph); outputs by name."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    for key, value in (config or {}).items():
        opts.add_session_config_entry(key, value)
    session = ort.InferenceSession(graph if isinstance(graph, bytes) else str(graph), opts,
                                   providers=["CPUExecutionProvider"])
    names, inputs = [o.name for o in session.get_outputs()], {i.name for i in session.get_inputs()}
    if io_names.CACHE_INDIRECTION in inputs:  # a cache per hypothesis, written in place (export/self_attention.py)
        return self_attention.indirect_runner(session)

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, {k: v for k, v in feeds.items() if k in inputs})))

    return run


def torch_encoder(model: Transformer) -> StepFn:
    """The PyTorch encoder computation with the encoder graph's names."""
    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            memory, src_bias = model.encode(torch.from_numpy(feeds[io_names.SRC_IDS]))
            ks, vs = model.cross_kv(memory)
        out = {io_names.SRC_BIAS: src_bias}
        for i, (k, v) in enumerate(zip(ks, vs)):
            out[io_names.cross_k(i)], out[io_names.cross_v(i)] = k, v
        return {name: t.numpy() for name, t in out.items()}
    return run


def torch_decoder(model: Transformer, topk: int) -> StepFn:
    """The PyTorch decoder step with the decoder graph's names (and the shortlisted step's, when
    the feeds hold candidates; the constrained step's, when they hold want ids)."""
    n = model.cfg.n_dec_layers

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        t = {k: torch.from_numpy(v) for k, v in feeds.items()}
        candidates = t.get(io_names.CANDIDATES)
        with torch.inference_mode():
            log_probs, step_k, step_v = model.decode_step(
                t[io_names.TOKENS], t[io_names.STEP], t[io_names.SELF_INDEX], t[io_names.SELF_BIAS],
                [t[io_names.self_k(i)] for i in range(n)], [t[io_names.self_v(i)] for i in range(n)],
                [t[io_names.cross_k(i)] for i in range(n)], [t[io_names.cross_v(i)] for i in range(n)],
                t[io_names.SRC_BIAS], candidates)
            lp, ids, eos = select_candidates(log_probs, topk, model.cfg.eos_id, candidates)
        out = {io_names.TOPK_LOG_PROBS: lp, io_names.TOPK_IDS: ids, io_names.EOS_LOG_PROBS: eos}
        if io_names.WANT_IDS in t:
            out[io_names.WANT_LOG_PROBS] = constrained_step.gathered(log_probs, t[io_names.WANT_IDS])
        for i in range(n):
            out[io_names.step_k(i)], out[io_names.step_v(i)] = step_k[i], step_v[i]
        return {name: v.numpy() for name, v in out.items()}
    return run


def with_candidates(decoder: StepFn, candidates: np.ndarray | None) -> StepFn:
    """`decoder` fed `candidates` too at every step (the shortlisted step); itself when None."""
    if candidates is None:
        return decoder
    return lambda feeds: decoder({**feeds, io_names.CANDIDATES: candidates})


# -- inputs ------------------------------------------------------------------------------

def sample_batch(model: Transformer, batch: int = 3, seed: int = 0) -> np.ndarray:
    """A padded batch of source ids as the tokenizer makes them: pieces + EOS, then PAD,
    with distinct lengths (the longest row has no padding)."""
    cfg = model.cfg
    rng = np.random.default_rng(seed)
    lengths = [9, 4, 6, 2, 7][:batch] if batch <= 5 else list(rng.integers(2, 10, batch))
    ids = np.full((batch, max(lengths)), cfg.pad_id, dtype=np.int64)
    pieces = np.setdiff1d(np.arange(cfg.vocab_size), [cfg.pad_id, cfg.bos_id, cfg.eos_id, cfg.unk_id])
    for row, n in enumerate(lengths):
        ids[row, :n - 1] = rng.choice(pieces, n - 1)
        ids[row, n - 1] = cfg.eos_id
    return ids


# -- comparison --------------------------------------------------------------------------

@dataclass
class Report:
    """Largest differences seen, by compared quantity."""

    max_abs: dict[str, float] = field(default_factory=dict)
    ids_checked: int = 0
    steps: int = 0

    def add(self, key: str, diff: float) -> None:
        self.max_abs[key] = max(self.max_abs.get(key, 0.0), diff)


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        raise ExportError(f"shape mismatch {a.shape} vs {b.shape}")
    return float(np.max(_abs_diff(a, b))) if a.size else 0.0


def _abs_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b|, 0 where both are the same infinity (a suppressed id, or a want id of -1)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf
        return np.where(a64 == b64, 0.0, np.abs(a64 - b64))


def _check(report: Report, key: str, where: str, a: np.ndarray, b: np.ndarray, atol: float | None,
           rtol: float = 0.0) -> None:
    """Record max |a - b|; with atol, fail where |a - b| > atol + rtol * |b| (b: the reference)."""
    try:
        diff = _max_abs(a, b)
    except ExportError as e:
        raise ExportError(f"verification failed: {key} at {where}: {e}") from None
    report.add(key, diff)
    if atol is None or not a.size:
        return
    err = _abs_diff(a, b)
    with np.errstate(invalid="ignore"):  # 0 * inf: NaN, the same infinity on both sides excepted
        bound = atol + rtol * np.abs(b.astype(np.float64))
        excess = np.where(err == 0, 0.0, err - bound)
    if not np.all(excess <= 0):  # also catches NaN
        worst = np.unravel_index(int(np.nanargmax(np.where(np.isnan(excess), np.inf, excess))), err.shape)
        raise VerificationError(key, where, float(err[worst]), float(bound[worst]), atol, rtol)


def _check_ids(report: Report, where: str, ref_lp: np.ndarray, ref_ids: np.ndarray,
               ids: np.ndarray, atol: float, rtol: float = 0.0) -> None:
    """Candidate ids must agree where the reference ranks them apart by more than twice the
    log-prob tolerance (atol + rtol * |log-prob|) there."""
    lp = ref_lp.astype(np.float64)
    gap_next = np.full(lp.shape, np.inf)
    gap_next[:, :-1] = lp[:, :-1] - lp[:, 1:]
    gap_prev = np.full(lp.shape, np.inf)
    gap_prev[:, 1:] = gap_next[:, :-1]
    # The last slot's gap to the (unseen) K+1-th candidate is unknown: skip it.
    clear = (np.minimum(gap_next, gap_prev) > 2 * (atol + rtol * np.abs(lp)))
    clear[:, -1] = False
    report.ids_checked += int(clear.sum())
    bad = clear & (ref_ids != ids)
    if bad.any():
        r, c = map(int, np.argwhere(bad)[0])
        raise ExportError(f"verification failed: topk_ids at {where} row {r} rank {c}: "
                          f"{int(ids[r, c])} != reference {int(ref_ids[r, c])} although the reference "
                          f"gap to its neighbours is {float(min(gap_next[r, c], gap_prev[r, c])):.3g}")


def compare_engines(model: Transformer, encoder: StepFn, decoder: StepFn, ref_encoder: StepFn,
                    ref_decoder: StepFn, atol: float, rtol: float, label: str,
                    n_steps: int = N_STEPS, shortlist: Any = None) -> Report:
    """Run encoder + n_steps beam-like steps on both engines and bound their differences.
    shortlist (runtime.shortlist.Shortlist): both decoders are shortlisted steps, fed the batch's
    candidates."""
    cfg = model.cfg
    n = cfg.n_dec_layers
    report = Report()
    src = sample_batch(model)
    if shortlist is not None:
        candidates = shortlist.candidates(src)
        decoder, ref_decoder = with_candidates(decoder, candidates), with_candidates(ref_decoder, candidates)
    enc, ref_enc = encoder({io_names.SRC_IDS: src}), ref_encoder({io_names.SRC_IDS: src})
    for name in io_names.encoder_outputs(n):
        _check(report, "encoder", f"{label} encoder output {name}", enc[name], ref_enc[name], None)

    # Each sentence gets BEAM consecutive hypothesis rows that share its one row of cross
    # K/V and src_bias (as search feeds them); a finished sentence's row is dropped.
    rows = np.repeat(np.arange(src.shape[0]), BEAM)
    cross = {name: enc[name] for name in io_names.encoder_outputs(n)}
    ref_cross = {name: ref_enc[name] for name in io_names.encoder_outputs(n)}
    # Each engine writes its own step K/V into its own cache, of its own cross K/V's dtype;
    # capacity 4, so the caches grow twice.
    caches = [BeamCache(cfg, len(rows), torch.from_numpy(e[io_names.cross_k(0)][:0]).dtype,
                        initial_capacity=VERIFY_CAPACITY) for e in (enc, ref_enc)]
    tokens = np.full(len(rows), cfg.bos_id, dtype=np.int64)
    sent = rows.copy()
    reorder = np.arange(len(rows), dtype=np.int64)
    for step in range(n_steps):
        where = f"{label} decoder step {step}"
        feeds = {io_names.TOKENS: tokens, io_names.STEP: np.array([step], dtype=np.int64),
                 self_attention.REORDER: reorder}
        n_sent = len(np.unique(sent))
        own, ref_own = ({k: v.numpy() for k, v in c.advance(torch.from_numpy(reorder), n_sent).items()}
                        for c in caches)
        out = decoder({**feeds, **own, **cross})
        ref = topk_split.as_wide(ref_decoder({**feeds, **ref_own, **ref_cross}), out, len(tokens) // n_sent, where)
        for name in (io_names.TOPK_LOG_PROBS, io_names.EOS_LOG_PROBS, io_names.WANT_LOG_PROBS):
            if name in ref:  # want_log_probs: where both steps are fed want ids
                _check(report, name, where, out[name], ref[name], atol, rtol)
        _check_ids(report, where, ref[io_names.TOPK_LOG_PROBS], ref[io_names.TOPK_IDS],
                   out[io_names.TOPK_IDS], atol, rtol)
        for i in range(n):
            for name in (io_names.step_k(i), io_names.step_v(i)):
                _check(report, "cache", where + f" {name}", out[name], ref[name], None)
        for c, o in zip(caches, (out, ref)):
            c.append(*([torch.from_numpy(a) for a in kv] for kv in step_outputs(o, n)))
        keep, tokens, reorder = _beam_like_choice(ref, sent, step)
        live = np.unique(sent, return_index=True)[1]  # each sentence's first row, in order
        kept_sentences = np.flatnonzero(np.isin(sent[live], sent[keep]))
        sent = sent[keep]
        cross = {k: v[kept_sentences] for k, v in cross.items()}
        ref_cross = {k: v[kept_sentences] for k, v in ref_cross.items()}
        report.steps += 1
    return report


def _beam_like_choice(ref: dict[str, np.ndarray], sent: np.ndarray, step: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Next (kept rows, tokens, reorder): a deterministic stand-in for beam search.

    `sent` maps each current row to its sentence (sorted: a sentence's rows are
    consecutive). Each kept row continues a row of its own sentence: on even steps the
    sentence's first row (so rows repeat in `reorder`), on odd steps its last row; with
    the 1st or 2nd candidate by its rank in the sentence. At step 3 the last sentence
    finishes (its rows are dropped), so the next step has hyps = prev_hyps - BEAM and
    the kept sentences' cross K/V are selected.
    """
    finished = step == 3 and len(np.unique(sent)) > 1
    keep = np.flatnonzero(sent != sent[-1]) if finished else np.arange(len(sent))
    first = {int(s): int(np.flatnonzero(sent == s)[0]) for s in np.unique(sent)}
    last = {int(s): int(np.flatnonzero(sent == s)[-1]) for s in np.unique(sent)}
    pick = first if step % 2 == 0 else last
    parents = np.array([pick[int(sent[r])] for r in keep], dtype=np.int64)
    ranks = np.array([int(r - first[int(sent[r])]) % 2 for r in keep])
    tokens = ref[io_names.TOPK_IDS][parents, ranks].astype(np.int64)
    return keep, tokens, parents


# -- the verification the export command runs ----------------------------------------------

def verify_export(model32: Transformer, encoder_path: Path, decoder_path: Path, *, fp16: bool,
                  topk: int, atol: float = FP32_ATOL, fp16_atol: float = FP16_ATOL,
                  rtol: float = FP32_RTOL, fp16_rtol: float = FP16_RTOL,
                  model16: Transformer | None = None, int8: bool = False,
                  int8_atol: float = INT8_ATOL, int8_rtol: float = INT8_RTOL, shortlist: Any = None,
                  constrained: Path | None = None) -> dict[str, Any]:
    """Check both graphs and compare them with PyTorch; returns the manifest's figures.

    fp32: ORT vs the fp32 model. fp16: ORT vs the half model in PyTorch (same graph
    arithmetic up to ORT's fp32 fallbacks), and the half model in PyTorch vs the fp32
    model (the honest fp16-arithmetic check), both within fp16_atol + fp16_rtol * |log-prob|.
    `model16`: the half copy the graphs were exported from, when the caller has one.
    `shortlist` (runtime.shortlist.Shortlist): decoder_path is the shortlisted step, checked on the
    sample batch's candidates against the PyTorch step over the same candidates.
    `constrained` (decoder_constrained.onnx): run beside decoder_path on the same feeds plus want ids, its
    shared outputs bitwise equal and its want_log_probs within the same bound (_decoders).
    """
    for path in (encoder_path, decoder_path):
        check_graph(path)
    if int8:
        return verify_int8(model32, encoder_path, decoder_path, topk=topk, atol=int8_atol, rtol=int8_rtol,
                           shortlist=shortlist, constrained=constrained)
    enc = ort_runner(encoder_path)
    if not fp16:
        dec, ref = _decoders(model32, decoder_path, constrained, torch_decoder(model32, topk))
        rep = compare_engines(model32, enc, dec, torch_encoder(model32), ref,
                              atol, rtol, "onnxruntime vs torch fp32", shortlist=shortlist)
        return _summary("fp32", atol, rtol, {"onnxruntime_vs_torch_fp32": rep},
                        "onnx.checker; ONNX Runtime CPU vs PyTorch fp32 on a padded batch, "
                        f"{rep.steps} decoder steps with beam reorder and a finished sentence", constrained)
    if model16 is None:
        model16 = inference_copy(model32, fp16=True)
    dec, ref = _decoders(model16, decoder_path, constrained, torch_decoder(model16, topk))
    rep_ort = compare_engines(model16, enc, dec, torch_encoder(model16), ref,
                              fp16_atol, fp16_rtol, "onnxruntime fp16 vs torch fp16", shortlist=shortlist)
    rep_half = compare_engines(model32, torch_encoder(model16), torch_decoder(model16, topk),
                               torch_encoder(model32), torch_decoder(model32, topk), fp16_atol, fp16_rtol,
                               "torch fp16 vs torch fp32", shortlist=shortlist)
    return _summary("fp16", fp16_atol, fp16_rtol, {"onnxruntime_vs_torch_fp16": rep_ort,
                                        "torch_fp16_vs_torch_fp32": rep_half},
                    "onnx.checker; ONNX Runtime CPU (which may run some fp16 nodes in fp32) vs "
                    "PyTorch half precision; PyTorch half precision (real fp16 matmuls) vs PyTorch "
                    f"fp32; each on a padded batch, {rep_ort.steps} decoder steps with beam reorder", constrained)


def _decoders(model: Transformer, decoder_path: Path, constrained: Path | None, ref: StepFn,
              config: dict[str, str] | None = None) -> tuple[StepFn, StepFn]:
    """The ONNX Runtime decoder step and `ref` for compare_engines; with `constrained`, that graph beside the
    decoder on the same feeds (shared outputs bitwise equal), both sides fed want ids (export/constrained.py)."""
    dec = ort_runner(decoder_path, config)
    if constrained is None:
        return dec, ref
    both = constrained_step.both_graphs(dec, ort_runner(constrained, config))
    vocab = model.cfg.vocab_size
    return constrained_step.with_want(both, vocab), constrained_step.with_want(ref, vocab)


def verify_int8(model32: Transformer, encoder_path: Path, decoder_path: Path, *, topk: int,
                atol: float = INT8_ATOL, rtol: float = INT8_RTOL, shortlist: Any = None,
                constrained: Path | None = None) -> dict[str, Any]:
    """int8 graphs in ONNX Runtime (int8 GEMMs, as served) vs the fp32 PyTorch model.

    Candidate log-probs within atol + rtol * |log-prob|; candidate ids (top-1 included)
    must agree wherever the fp32 model ranks them apart by more than twice that.
    """
    config = int8_session_config()  # what the onnxruntime backend does on this machine; the rowwise
    # weights are pair-bounded int8, which every CPU loads as stored (runtime/cpu_int8.py)
    enc = ort_runner(encoder_path, config)
    dec, ref = _decoders(model32, decoder_path, constrained, torch_decoder(model32, topk), config)
    rep = compare_engines(model32, enc, dec, torch_encoder(model32), ref,
                          atol, rtol, "onnxruntime int8 vs torch fp32", shortlist=shortlist)
    kernel = ("u8 x s8 with int8 dot products" if has_int8_dot_product() else
              "u8 x s8 on int16 pairs of products, no int8 dot products; pair-bounded weights keep them exact")
    return _summary("int8", atol, rtol, {"onnxruntime_int8_vs_torch_fp32": rep},
                    "onnx.checker; ONNX Runtime CPU running the int8 graphs as served (qdq: MatMulNBits "
                    f"at accuracy level {config[ACCURACY_LEVEL]}, the level this CPU gets; rowwise: "
                    "MatMulIntegerToFloat on per-row 8-bit activations and 8-bit weights, exact integer "
                    f"GEMMs ({kernel} on this CPU); "
                    "ort-dynamic: MatMulInteger) vs PyTorch fp32 on a padded batch, "
                    f"{rep.steps} decoder steps with beam reorder and a dropped hypothesis; candidate "
                    "ids (top-1 included) checked wherever fp32 separates them by more than the tolerance",
                    constrained)


def _summary(precision: str, atol: float, rtol: float, reports: dict[str, Report], how: str,
             constrained: Path | None = None) -> dict[str, Any]:
    how += constrained_step.HOW if constrained is not None else ""
    out: dict[str, Any] = {"precision": precision, "atol": atol, "rtol": rtol, "how": how}
    for name, rep in reports.items():
        out[name] = {"max_abs_diff": {k: float(f"{v:.4g}") for k, v in sorted(rep.max_abs.items())},
                     "topk_ids_checked": rep.ids_checked, "steps": rep.steps}
        lp = max(rep.max_abs.get(io_names.TOPK_LOG_PROBS, 0.0), rep.max_abs.get(io_names.EOS_LOG_PROBS, 0.0))
        bound = f"{atol:.3g} + {rtol:g} x |log-prob|" if rtol else f"{atol:.3g}"  # as the export's summary says
        log.info("verified %s: max abs log-prob difference %.3g (tolerance %s)", name, lp, bound)
    return out

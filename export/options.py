"""Every option of an export, once: its default and its help text. `pipeline export`'s command line
is generated from ExportOptions (pipeline/cli_options.options_from), and export_model's keywords
are its fields, so the two cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from export import quantize, tensorrt_build, verify
from export.errors import ExportError
from export.shortlist import ShortlistCorpus
from model.config import ModelConfig
from model.manifest import DEFAULT_LIMITS, DEFAULT_TOPK, QUANTIZATIONS
from runtime.fields import declared_bounds, declared_types, opt
from runtime.languages import Direction, direction
from runtime.references import DEFAULT_LINES as DEFAULT_REFERENCE_LINES
from runtime.shortlist import DEFAULT_FREQUENT, DEFAULT_PER_SOURCE

CALIBRATION_LINES = 200  # --int8-calibrate reads at most this many lines

DEFAULT_MAX_SRC_LEN = DEFAULT_LIMITS.max_src_len  # both capped by the model's max_positions when not given
DEFAULT_MAX_TGT_LEN = DEFAULT_LIMITS.max_tgt_len  # max_src_len + the paper's 50
DEFAULT_MAX_BEAM = DEFAULT_LIMITS.max_beam

# The options naming files that the command line reads (it knows a save dir's validation set and reads
# text strictly); export itself takes what they hold: ExportOptions.references and .shortlist.
READ_BY_THE_CALLER = ("reference_src", "reference_tgt", "reference_lines", "shortlist_src", "shortlist_tgt",
                      "shortlist_per_source", "shortlist_frequent", "int8_calibrate")


@dataclass(frozen=True)
class SampleDirection:
    """Calibration lines in one direction (the built-in sample's, export/sample.py, or the user's): `codes` the
    model's own (source, target) codes for a multilingual model (its language tokens), None for a model of one
    pair; `references` their translations (the sample's, which gate the scales; none for the user's)."""

    codes: tuple[str, str] | None
    lines: list[str]
    references: list[str]

    def direction(self, cfg: ModelConfig) -> Direction:
        source, target = self.codes or (None, None)
        return direction(cfg, source, target)


@dataclass(frozen=True)
class Calibration:
    """Source sentences that rowwise int8 measures its static activation scales on (export/calibrate.py)."""

    lines: list[str]  # at most CALIBRATION_LINES, none blank
    origin: str  # where they come from (a file name), for the export's one line and the manifest
    # taken by default (the held-out set's sources) rather than asked for with --int8-calibrate: another int8
    # flavour then skips them without an error, and the one line says how to choose others or opt out
    default: bool = False
    # the lines by direction (a multilingual model's language tokens; none given: `lines`, one pair); the built-in
    # sample's carry references, which gate the scales it gives (export/sample.py)
    directions: tuple[SampleDirection, ...] = ()

    @property
    def gated(self) -> bool:
        """Whether these are the built-in sample's lines, kept only if the int8 gate passes on their references."""
        return bool(self.directions) and all(d.references for d in self.directions)


@dataclass(frozen=True)
class ExportOptions:
    """What the user asked of one export (None: decided from the checkpoint and this machine, by
    export/plan.resolve)."""

    out: Path = opt(help="Model directory to create (everything serve-batch and parity need).", path="any")
    fp16: bool = opt(False, "Half-precision graphs (fp16 weights, matmuls and caches; LayerNorm, softmax and "
                     "log-softmax stay fp32). TensorRT builds them strongly typed.")
    int8: bool = opt(False, "int8 weights for every linear layer and the tied embedding/projection (symmetric, "
                     "per output channel); LayerNorm and softmax stay fp32. Verified against the fp32 "
                     "PyTorch model within --int8-atol.")
    int8_flavour: str = opt(quantize.AUTO, "With --int8: qdq (int8 weights through DequantizeLinear -> MatMul, "
                            "fp32 activations; the form TensorRT parses), rowwise (int8 activations too, quantized "
                            "per row at run time: faster on CPU ONNX Runtime, batch-independent, no TensorRT) or "
                            "ort-dynamic (ONNX Runtime's quantize_dynamic: one scale per batch, so results depend "
                            "on batching; no TensorRT). auto: qdq when TensorRT engines are built, else rowwise.",
                            choices=(quantize.AUTO, *QUANTIZATIONS))
    int8_calibrate: Path | None = opt(None, "With rowwise int8: source sentences (one per line, at most "
                                      f"{CALIBRATION_LINES} read) that the fp32 model decodes to measure each "
                                      "linear layer's input range, stored as constant activation scales: one "
                                      "QuantizeLinear per layer instead of a per-row quantization (docs/int8.md). "
                                      "Default: the held-out set's sources (--reference-src, else the checkpoint's "
                                      "save dir validation set), else the built-in sample in the model's languages "
                                      "when they are known (kept only if int8 parity passes on it); per-row scales "
                                      "when there is none. Gate the result with `pipeline parity`.", exists=True)
    no_int8_calibrate: bool = opt(False, "With rowwise int8: per-row dynamic activation scales, calibrated on "
                                  "nothing (the form before static scales were the default).")
    opset: int = opt(18, "ONNX opset of the graphs (17..23; TensorRT needs >= 17).")
    topk: int = opt(DEFAULT_TOPK, "Candidates per hypothesis leaving the decoder step (beam search needs 2 x beam; "
                    "the CPU int8 graphs return min(this, 2 x beam): docs/int8.md).")
    max_batch: int = opt(DEFAULT_LIMITS.max_batch, "Most sentences per batch (TensorRT profiles; recorded in the "
                         "manifest).", min=1)
    max_src_len: int | None = opt(None, f"Longest source in tokens, EOS included [default: {DEFAULT_MAX_SRC_LEN}, "
                                  "at most the model's max_positions; an imported model's: its max_positions].",
                                  min=1)
    max_tgt_len: int | None = opt(None, "Longest output in tokens (decoder cache holds max-tgt-len + 1 slots) "
                                  f"[default: {DEFAULT_MAX_TGT_LEN}, below the model's max_positions; an imported "
                                  "model's: what its generation config's max_length allows].", min=1)
    max_beam: int = opt(DEFAULT_MAX_BEAM, "Largest beam the engines serve (decoder rows up to max-batch x max-beam).",
                        min=1)
    tensorrt: bool | None = opt(None, "Build TensorRT engines (error if TensorRT or a GPU is missing) or skip "
                                "them. Default: build them when possible, else say why they were skipped.")
    force: bool = opt(False, "Replace an existing model directory (only once the new one is complete).")
    atol: float = opt(verify.FP32_ATOL, "fp32 verification bound on log-prob abs differences (ONNX Runtime vs "
                      "PyTorch).", min=0)
    fp16_atol: float = opt(verify.FP16_ATOL, "fp16 verification bound (ONNX Runtime vs PyTorch half, PyTorch half "
                           f"vs fp32), plus {verify.FP16_RTOL:g} x |log-prob| (unlikely candidates carry larger "
                           "fp16 errors).", min=0)
    int8_atol: float | None = opt(None, "int8 verification bound on log-prob abs differences (ONNX Runtime int8 "
                                  f"vs PyTorch fp32), plus {verify.INT8_RTOL:g} x |log-prob|. Default: "
                                  f"{verify.INT8_ATOL:g} for qdq, {verify.INT8_ACTIVATIONS_ATOL:g} for rowwise and "
                                  "ort-dynamic (8-bit activations too).", min=0)
    workspace_gib: float = opt(tensorrt_build.DEFAULT_WORKSPACE_GIB, "TensorRT builder workspace limit in GiB.",
                               min=0)
    reference_src: Path | None = opt(None, "Held-out source lines whose fp32 PyTorch translations are recorded in "
                                     "the model dir (references.json), so `pipeline parity MODEL_DIR` can gate a "
                                     "backend without PyTorch. Default: the checkpoint's save dir validation set, "
                                     "when it has one.", exists=True)
    reference_tgt: Path | None = opt(None, "Human references of --reference-src, line-aligned.", exists=True)
    reference_lines: int = opt(DEFAULT_REFERENCE_LINES, "Record at most this many line pairs (0: record none).",
                               min=0)
    shortlist_src: Path | None = opt(None, "Source side of a parallel corpus (the training data, say) to count a "
                                     "vocabulary shortlist from: the model dir then also holds shortlist.npz and "
                                     "decoder_shortlist.onnx, which serve-batch, serve, parity and bench use with "
                                     "--shortlist (docs/shortlist.md).", exists=True)
    shortlist_tgt: Path | None = opt(None, "Target side of --shortlist-src, line-aligned.", exists=True)
    shortlist_per_source: int = opt(DEFAULT_PER_SOURCE, "Target pieces listed per source piece: those most often "
                                    "in the same sentence pair.", min=0)
    shortlist_frequent: int = opt(DEFAULT_FREQUENT, "Most frequent target pieces, candidates in every batch (at "
                                  "least --topk).", min=1)
    src_lang: str | None = opt(None, "The language code the model translates from (de, eng_Latn), recorded in the "
                               "manifest: `pipeline serve` then serves the model under LibreTranslate's API "
                               "whatever its name. Default: the checkpoint's (an imported Marian model's "
                               "tokenizer_config.json), else the training run's corpus suffix (train.de). For a "
                               "multilingual model (M2M-100, NLLB): the language of --reference-src and "
                               "--int8-calibrate's lines, which it then needs.", metavar="CODE")
    tgt_lang: str | None = opt(None, "The language code the model translates into; as --src-lang (a multilingual "
                               "model: the language of --reference-tgt, the one its held-out lines are decoded into).",
                               metavar="CODE")
    timing_cache: Path | None = opt(None, "TensorRT timing cache file, reused across builds "
                                    "(default: ~/.cache/pipeline/tensorrt-VERSION.timing-cache).", path="any")
    # What the files above hold, read by the caller (no command-line option of their own):
    # (sources, human references) of a held-out set, and the corpus to count a shortlist from.
    references: tuple[list[str], list[str]] | None = None
    calibration: Calibration | list[str] | None = None  # --int8-calibrate's lines, else the held-out set's
    shortlist: ShortlistCorpus | None = None
    # Decoding defaults to record in the manifest over the checkpoint's own (export's --beam-size, --alpha, ...:
    # tune-decoding's choice), as runtime.decoding.DecodingOptions fields; serving uses them unless told otherwise
    decoding: dict[str, Any] = field(default_factory=dict)


def check_given(o: ExportOptions) -> None:
    """What the command line checks or builds itself, checked for a caller from Python before the work (a
    references list of two strings was recorded as text; atol=-1 failed after the export)."""
    def texts(x: Any) -> bool:
        return isinstance(x, (list, tuple)) and all(isinstance(t, str) for t in x)

    refs = o.references
    if refs is not None and not (isinstance(refs, (list, tuple)) and len(refs) == 2 and all(map(texts, refs))):
        raise TypeError("references must be (sources, references): two lists of strings")
    if refs is not None and len(refs[0]) != len(refs[1]):
        raise ExportError(f"references: {len(refs[0])} sources but {len(refs[1])} references; they must be "
                          "line-aligned")
    if o.calibration is not None and not isinstance(o.calibration, Calibration) and not texts(o.calibration):
        raise TypeError("calibration must be a list of source lines (or a Calibration)")
    problems = declared_types(o, lambda name: name) or declared_bounds(o, lambda name: name)
    if problems:
        raise ExportError("; ".join(problems))

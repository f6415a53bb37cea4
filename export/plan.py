"""`resolve(checkpoint, options) -> ExportPlan`: everything an export decides before it writes anything.

The checkpoint and its tokenizer are loaded once, every option the user left to "auto" or unset is
decided (precision, int8 flavour, limits within the model's positions, TensorRT built or why not, the
int8 tolerance, the model's decoding defaults), and every reason the export would fail is raised here,
before minutes of work (export/api.py runs the plan's steps).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from export import onnx_export, quantize, tensorrt_build, verify
from export.errors import ExportError, TensorRTUnavailable
from export.options import (
    CALIBRATION_LINES,
    DEFAULT_MAX_SRC_LEN,
    DEFAULT_MAX_TGT_LEN,
    Calibration,
    ExportOptions,
    SampleDirection,
)
from export.out_dir import prepare_out
from export.payload import checkpoint_steps, decoding_defaults
from export.sample import sample_calibration
from export.shortlist import ShortlistCorpus, count_table
from model.checkpoint import load_model, resolve_checkpoint
from model.config import ModelConfig
from model.manifest import ONNXRUNTIME_ONLY, QUANTIZATIONS, Languages, Limits
from model.transformer import Transformer
from runtime.decoding import PAPER
from runtime.languages import LANG_CODE, LanguageError, direction
from runtime.shortlist import Shortlist
from runtime.tokenizer import AnyTokenizer, TokenizerError, load_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportPlan:
    """One export, decided: the options as given, what they resolve to for this checkpoint on this
    machine, and the loaded model (fp32, eval) with its tokenizer bytes and payload."""

    options: ExportOptions
    source: Path  # the checkpoint file (a save dir resolved to its latest or averaged checkpoint)
    model: Transformer
    spm_bytes: bytes
    payload: dict[str, Any]
    tokenizer: AnyTokenizer | None  # built once, when references or a shortlist need it
    limits: Limits
    int8_flavour: str | None  # None: not int8; else qdq, rowwise or ort-dynamic ("auto" decided)
    tensorrt: bool | None  # False: engines skipped; True: required; None: built if the build works
    tensorrt_unavailable: str | None  # why TensorRT cannot run here, found before any work
    int8_atol: float  # the int8 bound, per flavour when not given
    decoding: dict[str, Any]  # the checkpoint's own decoding defaults, checked
    steps: list[int]  # the training steps the weights come from
    counted: tuple[Shortlist, int] | None  # the shortlist's table and its sentence pairs
    language_pair: Languages | None = None  # a model of one pair: its codes, when known
    held_out_direction: tuple[str, str] | None = None  # a multilingual model: its held-out lines' codes
    calibration: Calibration | None = None  # rowwise int8's static activation scales are measured on these
    activation_scales: str | None = None  # rowwise int8: the one line saying which scales, and why

    @property
    def out(self) -> Path:
        return self.options.out

    @property
    def fp16(self) -> bool:
        return self.options.fp16

    @property
    def precision(self) -> str:
        return "int8" if self.int8_flavour else "fp16" if self.options.fp16 else "fp32"

    @property
    def references(self) -> tuple[list[str], list[str]] | None:
        return self.options.references

    @property
    def shortlist(self) -> ShortlistCorpus | None:
        return self.options.shortlist

    def tensorrt_skip_note(self) -> str | None:
        """Why engines are skipped, when the int8 flavour rules them out (else the build's own reason)."""
        if self.int8_flavour not in ONNXRUNTIME_ONLY:
            return None
        return "; ".join(filter(None, [f"int8 flavour {self.int8_flavour} runs on ONNX Runtime only",
                                       self.tensorrt_unavailable]))


def resolve(checkpoint: Path, options: ExportOptions) -> ExportPlan:
    """The plan of exporting `checkpoint` with `options`; raises ExportError / CheckpointError /
    ConfigError for anything that would fail later, in the order a user fixes them: the paths, the
    options that contradict each other, the checkpoint, the shapes, the shortlist corpus, TensorRT."""
    source = resolve_checkpoint(Path(checkpoint))
    if source != Path(checkpoint):  # a save dir: which of its checkpoints (the manifest records it too)
        stale = source.name != "averaged.pt" and (Path(checkpoint) / "averaged.pt").is_file()
        what = "the average `pipeline average` wrote" if source.name == "averaged.pt" else \
            "the latest step checkpoint: averaged.pt there does not average up to it; run `pipeline average` " \
            "again to export an average" if stale else \
            "the latest step checkpoint; `pipeline average` makes averaged.pt"
        (log.warning if stale else log.info)("%s: exporting %s (%s)", checkpoint, source.name, what)
    prepare_out(options.out, options.force, source)
    tensorrt = _check_precision(options)
    model, spm_bytes, payload, loaded = load(source)
    limits = _limits(options, model.cfg.max_positions, payload)
    check_options(model.cfg, opset=options.opset, topk=options.topk, limits=limits)
    pair = language_pair(options, payload, model.cfg)
    # the shortlist's corpus is read and counted first: a bad one fails before minutes of export work
    counted = None
    if options.shortlist is not None:
        counted = count_table(options.shortlist, loaded, model.cfg, options.topk)
    unavailable = _tensorrt_unavailable(tensorrt)
    flavour = _int8_flavour(options, tensorrt, unavailable)
    held_out = held_out_direction(options, model.cfg)
    calibration, scales = activation_scales(options, flavour, model.cfg, pair)
    if calibration is not None and held_out is not None and not calibration.directions:  # the user's lines
        calibration = dataclasses.replace(calibration, directions=(SampleDirection(held_out, calibration.lines, []),))
    needed = options.references is not None or options.shortlist is not None or calibration is not None
    tokenizer = loaded if needed else None
    if flavour in ONNXRUNTIME_ONLY:  # no engines from their integer-matmul graphs
        tensorrt = False
    return ExportPlan(options=options, source=source, model=model, spm_bytes=spm_bytes, payload=payload,
                      tokenizer=tokenizer, limits=limits, int8_flavour=flavour, tensorrt=tensorrt,
                      tensorrt_unavailable=unavailable, int8_atol=_int8_atol(options, flavour),
                      decoding=decoding_defaults(payload, options.decoding, limits),
                      steps=checkpoint_steps(payload), counted=counted,
                      language_pair=pair, held_out_direction=held_out, calibration=calibration,
                      activation_scales=scales)


def _check_precision(options: ExportOptions) -> bool | None:
    """The --tensorrt wish after the precision options' own rules (False for an ONNX Runtime-only flavour)."""
    if options.int8 and options.fp16:
        raise ExportError("--int8 and --fp16 cannot be combined: int8 weights run with fp32 activations")
    if options.int8_flavour not in (quantize.AUTO, *QUANTIZATIONS):
        raise ExportError(f"--int8-flavour {options.int8_flavour!r}: choose one of auto, {', '.join(QUANTIZATIONS)}")
    int8_only = [flag for flag, given in (("--int8-flavour", options.int8_flavour != quantize.AUTO),
                                          ("--no-int8-calibrate", options.no_int8_calibrate),
                                          ("--int8-atol", options.int8_atol is not None)) if given]
    if int8_only and not options.int8:  # else an fp32 export would pass for the int8 one asked for
        verb = "shape" if len(int8_only) > 1 else "shapes"
        raise ExportError(f"{' and '.join(int8_only)} {verb} an int8 export: add --int8, or leave them out")
    if options.fp16_atol != verify.FP16_ATOL and not options.fp16:  # the tolerances of other precisions: unused
        raise ExportError("--fp16-atol bounds an fp16 export's verification: add --fp16, or leave it out")
    if options.atol != verify.FP32_ATOL and (options.fp16 or options.int8):
        raise ExportError(f"--atol bounds an fp32 export's verification; this {'fp16' if options.fp16 else 'int8'} "
                          f"export's is {'--fp16-atol' if options.fp16 else '--int8-atol'}")
    if options.int8 and options.int8_flavour in ONNXRUNTIME_ONLY:
        if options.tensorrt:
            raise ExportError(f"--int8-flavour {options.int8_flavour} runs on ONNX Runtime only (TensorRT rejects "
                              "its integer-matmul operators); use --int8-flavour qdq for TensorRT engines")
        return False
    return options.tensorrt


def _limits(options: ExportOptions, positions: int, payload: dict[str, Any]) -> Limits:
    """Unset source/target limits: the defaults, within the model's positions (an imported model may have fewer).
    A checkpoint with decoding defaults of its own (an imported model's generation config: OPUS-MT's max_length
    512) gets what they allow, as transformers translates: every source its positions take, and the outputs its
    max_len_a * source + max_len_b asks for (a dir of the defaults cut them at 305 tokens without a word)."""
    own = (payload.get("extra") or {}).get("decoding") or {}
    src = options.max_src_len if options.max_src_len is not None else \
        positions if own else min(DEFAULT_MAX_SRC_LEN, positions)
    longest = math.ceil(float(own.get("max_len_a", PAPER.max_len_a)) * src) + int(own.get("max_len_b", PAPER.max_len_b))
    tgt = options.max_tgt_len if options.max_tgt_len is not None else \
        min(max(DEFAULT_MAX_TGT_LEN, longest + 1) if own else DEFAULT_MAX_TGT_LEN, positions - 1)
    if own and src < positions:  # transformers translates every source its positions take
        log.warning("the model dir cuts sources at %d tokens (--max-src-len %d), where the model takes %d; "
                    "--max-src-len %d serves all of them", src, src, positions, positions)
    enough = min(longest + 1, positions - 1)
    if own and tgt < enough:  # the longest output the model's own decoding asks for does not fit: say so
        log.warning("the model dir's outputs stop at %d tokens (--max-tgt-len %d), where the checkpoint's decoding "
                    "allows %d; --max-tgt-len %d serves %s", tgt - 1, tgt, longest, enough,
                    "all of them" if enough > longest else "as many as the model's positions allow")
    return Limits(options.max_batch, src, tgt, options.max_beam)


def _tensorrt_unavailable(tensorrt: bool | None) -> str | None:
    """Why TensorRT or a GPU is missing (None: present, or not wanted): an error now when --tensorrt
    asks for them, not after minutes of export work."""
    if tensorrt is False:
        return None
    try:
        tensorrt_build.load_tensorrt()
        tensorrt_build.gpu_identity()
    except TensorRTUnavailable as e:
        if tensorrt:
            raise ExportError(f"--tensorrt was asked for but {e}") from None
        return str(e)
    return None


def _int8_flavour(options: ExportOptions, tensorrt: bool | None, unavailable: str | None) -> str | None:
    """The flavour of the int8 weights (None without --int8): auto is qdq when engines will be built
    (TensorRT parses only qdq), else rowwise (faster on ONNX Runtime)."""
    if not options.int8:
        return None
    if options.int8_flavour != quantize.AUTO:
        return options.int8_flavour
    flavour = quantize.ROWWISE if tensorrt is False or unavailable else quantize.QDQ
    log.info("--int8-flavour auto: %s (%s)", flavour,
             "TensorRT engines will be built" if flavour == quantize.QDQ else "no TensorRT engines")
    return flavour


NO_SENTENCES = "no held-out sentences to calibrate on: give --int8-calibrate FILE or --reference-src/--reference-tgt"


def activation_scales(options: ExportOptions, flavour: str | None, cfg: ModelConfig | None = None,
                      pair: Languages | None = None) -> tuple[Calibration | None, str | None]:
    """Rowwise int8's activation scales: the sentences to calibrate static ones on (None: per row at run time)
    and the one line that says which, and why (None for the other flavours). Static by default: on
    --int8-calibrate's lines, else the held-out set's (`options.calibration` marked default, or the sources of
    `options.references`), else the built-in sample in the model's languages (`cfg`, `pair`; export/sample.py),
    kept only if they pass the int8 gate on it; per row with --no-int8-calibrate or without any sentences."""
    given = options.calibration
    if isinstance(given, list):  # export_model(calibration=[...]): lines asked for, like --int8-calibrate's
        given = Calibration(given, "the calibration lines")
    asked = options.int8_calibrate is not None or (given is not None and not given.default)
    if asked and options.no_int8_calibrate:
        raise ExportError("--int8-calibrate FILE and --no-int8-calibrate contradict each other: give one")
    if (asked or options.no_int8_calibrate) and flavour != quantize.ROWWISE:  # else it changes nothing
        flag = "--no-int8-calibrate turns off" if options.no_int8_calibrate else "--int8-calibrate measures"
        raise ExportError(f"{flag} static activation scales for --int8 --int8-flavour rowwise; this export's int8 "
                          f"flavour is {flavour or 'none (no --int8)'}")
    if flavour != quantize.ROWWISE:
        return None, None  # qdq: fp32 activations; ort-dynamic: ONNX Runtime's own scales
    if options.no_int8_calibrate:
        return None, "int8: per-row dynamic activation scales (--no-int8-calibrate)"
    if given is None and options.references is not None:
        given = Calibration([x for x in options.references[0] if x.strip()][:CALIBRATION_LINES],
                            "the held-out set's sources", default=True)
    gated = ""
    if (given is None or not given.lines) and cfg is not None:
        given, why = sample_calibration(cfg, pair)
        if given is None:
            return None, f"int8: per-row dynamic activation scales ({NO_SENTENCES}; {why})"
        gated = ", kept if they pass the int8 parity gate on it"
    if given is None or not given.lines:
        return None, f"int8: per-row dynamic activation scales ({NO_SENTENCES})"
    said = f"int8: static activation scales calibrated on {len(given.lines)} lines of {given.origin}{gated}"
    if not given.default:
        return given, f"{said} (--int8-calibrate)"
    return given, f"{said} (--int8-calibrate FILE to choose others; --no-int8-calibrate for per-row dynamic scales)"


def _int8_atol(options: ExportOptions, flavour: str | None) -> float:
    """The int8 bound: as given, else wider for the flavours that also quantize activations."""
    if options.int8_atol is not None:
        return options.int8_atol
    return verify.INT8_ACTIVATIONS_ATOL if flavour in ONNXRUNTIME_ONLY else verify.INT8_ATOL


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
    # Marian starts from its pad id, M2M-100 from its EOS: a start token equal to either is fine; padding must
    # differ from EOS, or every source's EOS would be masked as padding
    if cfg.eos_id == cfg.pad_id:
        problems.append(f"model config has pad and eos id {cfg.pad_id}; the exporter needs an EOS id apart from "
                        "the padding id")
    if problems:
        raise ExportError("cannot export: " + "; ".join(problems))


def load(source: Path) -> tuple[Transformer, bytes, dict[str, Any], AnyTokenizer]:
    """The fp32 model, tokenizer bytes, payload and tokenizer; a checkpoint whose weights do not fit
    its config, or without a tokenizer that loads, is an export error naming the file (a model dir must never
    ship an spm.model that serve cannot load)."""
    try:
        model, spm_bytes, payload = load_model(source, "cpu")
    except (RuntimeError, KeyError, TypeError) as e:
        raise ExportError(f"{source}: checkpoint cannot be loaded into its model config: "
                          f"{str(e).splitlines()[0]}") from None
    if not isinstance(spm_bytes, bytes) or not spm_bytes:
        raise ExportError(f"{source}: checkpoint holds no SentencePiece model; re-save it with `pipeline train`")
    try:
        tokenizer = load_tokenizer(spm_bytes)
    except TokenizerError as e:
        raise ExportError(f"{source}: the checkpoint's tokenizer cannot be loaded ({e}); re-import or re-train "
                          "it") from None
    if tokenizer.vocab_size != model.cfg.vocab_size:  # else a "verified" model dir that no command can serve
        raise ExportError(f"{source}: its tokenizer has {tokenizer.vocab_size} pieces but the model's vocabulary "
                          f"{model.cfg.vocab_size}: they are not of one model; re-import or re-train it")
    return model.float().eval(), spm_bytes, payload, tokenizer


def language_pair(options: ExportOptions, payload: dict[str, Any], cfg: ModelConfig) -> Languages | None:
    """The model's (source, target) codes: --src-lang/--tgt-lang, else the checkpoint's `extra["languages"]`
    (an import's); None when unknown or for a multilingual model, whose codes are its language tokens."""
    given = (options.src_lang, options.tgt_lang)
    if cfg.languages:
        return None  # --src-lang/--tgt-lang name its held-out lines' direction (held_out_direction)
    if (given[0] is None) != (given[1] is None):
        raise ExportError("give both --src-lang and --tgt-lang, or neither")
    recorded = (payload.get("extra") or {}).get("languages") or {}
    source, target = given if given[0] is not None else (recorded.get("source"), recorded.get("target"))
    if source is None or target is None:
        return None
    for flag, code in (("--src-lang", source), ("--tgt-lang", target)):
        if not isinstance(code, str) or not LANG_CODE.fullmatch(code):
            raise ExportError(f"{flag} {str(code)[:20]!r}: give a language code like de, eng or eng_Latn")
    if source == target:
        raise ExportError(f"--src-lang and --tgt-lang are both {source}: a model translates between two languages")
    return Languages((source,), (target,))


def held_out_direction(options: ExportOptions, cfg: ModelConfig) -> tuple[str, str] | None:
    """A multilingual model's (source, target) codes of the held-out and calibration lines (--reference-src,
    --int8-calibrate): --src-lang/--tgt-lang, which they need, as the model has them. None for a model of one
    pair, or for one with no such lines (the built-in sample knows its own languages)."""
    if not cfg.languages:
        return None
    given = (options.src_lang, options.tgt_lang)
    lines = options.references is not None or options.calibration is not None
    if not lines:
        if any(given):
            raise ExportError("--src-lang/--tgt-lang name the languages of a multilingual model's held-out lines "
                              "(--reference-src, --int8-calibrate); there are none: leave them out, this model "
                              f"serves its {len(cfg.languages)} languages")
        return None
    try:
        way = direction(cfg, *given)
    except LanguageError as e:
        raise ExportError(f"{e} (the languages of --reference-src / --int8-calibrate's lines)") from None
    assert way.source is not None and way.target is not None
    return way.source, way.target

"""The model directory's manifest: what `pipeline export` wrote and every backend reads.

`manifest.json` records the model config, precision, opset, shape limits, versions, the
checkpoint it came from and the SHA-256 of every file. It has one writer
(`write_manifest`) and one reader (`read_manifest`), both typed by `Manifest`: consumers
read attributes, never JSON keys, and a manifest of the wrong shape is refused on
reading with the field named. Backends refuse a directory whose files do not match it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.atomic import atomic_write_text
from model.config import ConfigError, ModelConfig
from model.digests import file_digest, sha256_file
from model.errors import UserError

MANIFEST = "manifest.json"
FORMAT = "pipeline-model-dir-v2"
OLD_FORMATS = ("pipeline-model-dir-v1",)  # before the typed manifest (source_checkpoint.step)
CHECKPOINT_FILE = "model.pt"
SPM_FILE = "spm.model"
REFERENCES_FILE = "references.json"  # the fp32 model's translations of a held-out set (runtime/references.py)
PRECISIONS = ("fp32", "fp16", "int8")  # graph / engine precisions an export can record
# int8 flavours an export can record as `quantization` (export/quantize.py makes them):
QDQ = "qdq"  # int8 weights read through DequantizeLinear, fp32 activations: TensorRT parses it
ROWWISE = "rowwise"  # int8 weights and int8 activations, one scale per row: ONNX Runtime CPU only
ORT_DYNAMIC = "ort-dynamic"  # ONNX Runtime's quantize_dynamic, one activation scale per batch: CPU only
QUANTIZATIONS = (QDQ, ROWWISE, ORT_DYNAMIC)
ONNXRUNTIME_ONLY = (ROWWISE, ORT_DYNAMIC)  # com.microsoft / MatMulInteger ops: no TensorRT engines
REDO = "re-run `pipeline export CHECKPOINT --out DIR --force`"
# where export --force cannot tell the dir for one of its own (no manifest, or one it cannot read): it replaces none
REDO_ELSEWHERE = "export the checkpoint again into a new --out (`pipeline export CHECKPOINT --out NEW_DIR`)"
READ_BY_BACKENDS = (".onnx", ".data", ".plan", ".pt", ".model")  # graphs, their weights, engines, checkpoint, spm


class ModelDirError(UserError, ValueError):
    """A model directory that is missing, incomplete, tampered with, or built elsewhere."""


def check_precision(value: str, name: str = "precision") -> str:
    if value not in PRECISIONS:
        raise ModelDirError(f"manifest field {name!r} is {value!r}, expected one of {', '.join(PRECISIONS)}")
    return value


@dataclass(frozen=True)
class Languages:
    """The source and target language codes a model dir serves (a multilingual model: every pair of them)."""

    source: tuple[str, ...]
    target: tuple[str, ...]


@dataclass(frozen=True)
class Limits:
    """Shape limits the export was built for (its --max-* options; TensorRT profiles)."""

    max_batch: int
    max_src_len: int
    max_tgt_len: int
    max_beam: int

    def __post_init__(self) -> None:
        bad = [f"{name} must be at least 1, got {getattr(self, name)!r}" for name in ("max_batch", "max_src_len",
               "max_tgt_len", "max_beam") if isinstance(getattr(self, name), int) and getattr(self, name) < 1]
        if bad:
            raise ConfigError("; ".join(bad))

    @property
    def max_hyps(self) -> int:
        return self.max_batch * self.max_beam

    @property
    def max_cache_rows(self) -> int:
        return self.max_tgt_len * self.max_beam  # self-attention keys per sentence (model/cache.py)


# export's shape options when not given (export/options.py; its source and output lengths are capped by the model's
# positions, an imported model's set by them), and the candidates per hypothesis a step returns (--topk)
DEFAULT_LIMITS = Limits(max_batch=64, max_src_len=256, max_tgt_len=306, max_beam=8)  # max_tgt_len: + the paper's 50
DEFAULT_TOPK = 16  # 2 x a beam of 8


@dataclass(frozen=True)
class SourceCheckpoint:
    """The checkpoint file exported; `steps`: the training steps its weights come from
    (one for a step checkpoint, several for an averaged one, none when unknown).

    `sha256` is provenance (which file, as it was then), never a check of this model dir:
    its model.pt is a re-saved copy with other bytes, verified by `files` and by the
    checksum every checkpoint carries (model/checkpoint.py)."""

    path: str
    sha256: str
    steps: list[int]


@dataclass(frozen=True)
class Engines:
    """TensorRT engines: they only run on this TensorRT version and GPU model."""

    version: str
    gpu: str
    compute_capability: str
    precision: str
    workspace_gib: float
    timing_cache: str

    def __post_init__(self) -> None:
        check_precision(self.precision, "tensorrt.precision")


@dataclass(frozen=True)
class Graphs:
    """How the ONNX graphs were made: export time and file sizes."""

    export_seconds: float
    bytes: dict[str, int]


@dataclass(frozen=True)
class ShortlistInfo:
    """The vocabulary shortlist exported with the model (export --shortlist-src/--shortlist-tgt):
    shortlist.npz and decoder_shortlist.onnx (runtime/shortlist.py, export/shortlist.py)."""

    corpus: list[str]               # the source and target files counted
    pairs: int                      # sentence pairs counted
    per_source: int                 # most target pieces listed per source piece
    frequent: int                   # most frequent target pieces, always candidates
    entries: int                    # listed (source, target) pairs
    shared_weight_bytes: int        # of decoder.data that decoder_shortlist.onnx reads instead of a copy
    held_out_coverage: float | None  # share of held-out reference tokens (EOS too) among their candidates
    held_out_candidates: float | None  # mean candidates per held-out sentence
    verification: dict[str, Any]    # the verifier's report on decoder_shortlist.onnx


@dataclass(frozen=True)
class Manifest:
    model_config: ModelConfig
    precision: str
    opset: int
    topk: int
    limits: Limits
    source_checkpoint: SourceCheckpoint
    versions: dict[str, str | None]
    graphs: Graphs
    verification: dict[str, Any]  # the verifier's report (export/verify.py), read by people
    tensorrt: Engines | None = None
    tensorrt_skipped: str | None = None  # why no engines were built
    quantization: str | None = None  # int8 only: one of QUANTIZATIONS
    # rowwise only: integer-matmul weights stored as uint8 w + 128 (some older exports; current ones
    # store int8). Each CPU loads the form it multiplies fastest and exactly (runtime/cpu_int8.py)
    unsigned_weights: bool = False
    # rowwise only: integer-matmul weights pair-bounded (export/quantize.py quantize_columns), so
    # the u8 x s8 kernel is exact on every CPU and no CPU flips them (current exports)
    pair_bounded_weights: bool = False
    # The model's own decoding defaults (runtime.decoding.DecodingOptions fields), from the checkpoint:
    # an imported model's num_beams, max_length, length penalty and search rules. Options given on the
    # command line override them (DecodingOptions.for_model); empty: the paper's.
    decoding: dict[str, Any] = field(default_factory=dict)
    shortlist: ShortlistInfo | None = None  # a vocabulary shortlist was exported too (--shortlist)
    files: dict[str, str] = field(default_factory=dict)  # name -> SHA-256, filled by write_manifest
    # a model of one pair: its source and target codes (an imported Marian model's tokenizer_config.json,
    # a training run's corpus suffixes, or export --src-lang/--tgt-lang); None where they are not known
    language_pair: Languages | None = None

    def __post_init__(self) -> None:
        check_precision(self.precision)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ModelDirError(f"manifest field 'quantization' is {self.quantization!r}, expected one of "
                                f"{', '.join(QUANTIZATIONS)}")
        for name in self.files:
            if not is_plain_name(name):
                raise ModelDirError(f"manifest field 'files' lists {name[:80]!r}, which is not a file name inside "
                                    f"the model directory")
        cfg, lim = self.model_config, self.limits  # what export refuses together (export/plan.py check_options)
        if not (2 * lim.max_beam <= self.topk <= cfg.vocab_size and lim.max_src_len <= cfg.max_positions
                and lim.max_tgt_len < cfg.max_positions and cfg.eos_id != cfg.pad_id):
            raise ModelDirError(f"manifest fields disagree: topk {self.topk} (2 x max_beam {lim.max_beam} .. "
                                f"vocab_size {cfg.vocab_size}), max_src_len {lim.max_src_len} and max_tgt_len "
                                f"{lim.max_tgt_len} (max_positions {cfg.max_positions}), eos_id {cfg.eos_id} (pad_id "
                                f"{cfg.pad_id}); {REDO}")

    @property
    def languages(self) -> Languages | None:
        """The languages a model dir serves: a multilingual model's (model_config.languages, every pair among
        them), else its recorded pair; None where neither is known."""
        codes = tuple(code for code, _ in self.model_config.languages)
        return Languages(codes, codes) if codes else self.language_pair

    def lists(self, *names: str) -> bool:
        """Whether the manifest lists every one of these files."""
        return all(name in self.files for name in names)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["model_config"] = self.model_config.to_dict()  # without the later fields a model does not use
        if data["language_pair"] is None:  # unknown: written as before it existed
            del data["language_pair"]
        return {"format": FORMAT, **data}

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """A Manifest from parsed JSON; ModelDirError naming the first field of the wrong shape."""
        return _parse(cls, data, "")


def is_plain_name(name: str) -> bool:
    """A model dir is flat: a file it lists is one path component, never '..', absolute or a subpath,
    so that nothing outside the named directory is ever opened or hashed through its manifest."""
    return (bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name
            and os.path.basename(name) == name)


def inside(model_dir: Path, name: str) -> Path:
    """model_dir / name, refused when it is a link that resolves outside model_dir."""
    path = model_dir / name
    real_dir = os.path.realpath(model_dir)
    if os.path.commonpath([real_dir, os.path.realpath(path)]) != real_dir:
        raise ModelDirError(f"{path}: a link to {os.path.realpath(path)}, outside the model directory; copy the "
                            "file into the directory (a model dir never reads outside itself)")
    return path


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple, dict):
        return "an object" if origin is dict else "a list"
    if dataclasses.is_dataclass(tp):
        return "an object"
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
    return names.get(tp, str(tp))


def _parse(tp: Any, value: Any, name: str, shown: Any = None) -> Any:
    """`value` (parsed JSON) checked against the type hint `tp`, recursively; `shown`: the
    type to name in the error (the whole `X | None` when checking its X)."""
    def wrong() -> ModelDirError:
        return ModelDirError(f"manifest field {name!r} must be {_type_name(shown or tp)}, "
                             f"got {json.dumps(value)[:40]}")

    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        real = [a for a in args if a is not type(None)]
        if len(real) != 1:
            raise TypeError(f"manifest type {tp} is not supported")
        return _parse(real[0], value, name, shown=tp)
    if origin is list:
        if not isinstance(value, list):
            raise wrong()
        (item,) = typing.get_args(tp)
        return [_parse(item, v, f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:  # tuple[X, ...] or tuple[X, Y]: a JSON list
        args = typing.get_args(tp)
        if not isinstance(value, list) or (args[-1] is not Ellipsis and len(value) != len(args)):
            raise wrong()
        items = [args[0]] * len(value) if args[-1] is Ellipsis else list(args)
        return tuple(_parse(item, v, f"{name}[{i}]") for i, (item, v) in enumerate(zip(items, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise wrong()
        _, item = typing.get_args(tp)
        return {k: _parse(item, v, f"{name}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise wrong()
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            sub = f"{name}.{f.name}" if name else f.name
            if f.name in value:
                kwargs[f.name] = _parse(hints[f.name], value[f.name], sub)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ModelDirError(f"manifest field {sub!r} is missing")
        try:
            return typing.cast(Any, tp)(**kwargs)  # is_dataclass narrowed tp to an instance type
        except ConfigError as e:
            raise ModelDirError(f"manifest field {name!r}: {e}") from None
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise wrong()
    return value


def write_manifest(model_dir: Path, manifest: Manifest) -> Manifest:
    """Hash every file of model_dir (but the manifest) into `files` and write it atomically."""
    model_dir = Path(model_dir)
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest = dataclasses.replace(manifest, files={p.name: sha256_file(p) for p in files})
    atomic_write_text(model_dir / MANIFEST, json.dumps(manifest.to_json(), indent=2, sort_keys=True) + "\n")
    return manifest


def refuse_unless_model_dir(model_dir: Path) -> Path:
    """Its manifest's path, or a ModelDirError saying what `model_dir` is instead (a file, missing, a training
    run, a dir without a manifest) and the fix: the check commands make before they check their outputs."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        what = "is a file, not a model directory" if model_dir.exists() else "no such model directory"
        raise ModelDirError(f"{model_dir}: {what} (create one with `pipeline export`)")
    path = model_dir / MANIFEST
    if not path.is_file():
        if any(model_dir.glob("checkpoint_*.pt")) or (model_dir / "averaged.pt").is_file():  # a training run
            raise ModelDirError(f"{model_dir}: a training save dir, not a model directory; export it first: "
                                f"`pipeline export {model_dir} --out MODEL_DIR`, then give MODEL_DIR")
        raise ModelDirError(f"{model_dir}: no {MANIFEST}; not a model directory ({REDO_ELSEWHERE})")
    return path


def read_manifest(model_dir: Path, verify: bool = True, need: tuple[str, ...] = ()) -> Manifest:
    """Load and (by default) verify model_dir/manifest.json against the files on disk.

    `need` names files that the caller's backend requires (e.g. the ONNX graphs).
    """
    model_dir = Path(model_dir)
    path = inside(model_dir, refuse_unless_model_dir(model_dir).name)  # (a link out of it, as a listed file's)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelDirError(f"{path}: unreadable manifest ({e}); {REDO_ELSEWHERE}") from None
    except RecursionError:  # (a traceback)
        raise ModelDirError(f"{path}: unreadable manifest (nested too deeply); {REDO_ELSEWHERE}") from None
    fmt = data.get("format") if isinstance(data, dict) else None
    if fmt in OLD_FORMATS:
        raise ModelDirError(f"{model_dir}: exported by an older pipeline ({fmt}); re-export it: {REDO}")
    if fmt != FORMAT:
        raise ModelDirError(f"{path}: unknown manifest format {fmt!r}; {REDO_ELSEWHERE}")
    try:
        manifest = Manifest.from_json({k: v for k, v in data.items() if k != "format"})
    except ModelDirError as e:  # said once (the fields' own check may give it); export --force replaces only a
        redo = REDO if isinstance(data.get("files"), dict) else REDO_ELSEWHERE  # dir whose manifest lists files
        raise ModelDirError(f"{path}: {e}" if REDO in str(e) else f"{path}: {e}; {redo}") from None
    for name in need:
        if name not in manifest.files:
            raise ModelDirError(f"{model_dir}: the manifest lists no {name}; {REDO}")
    if verify:  # a file of the kinds backends read (an ONNX graph's .data beside it) is checked, so listed
        unlisted = sorted(p.name for p in model_dir.iterdir() if p.suffix in READ_BY_BACKENDS and p.name not in
                          manifest.files)
        if unlisted:
            raise ModelDirError(f"{model_dir / unlisted[0]}: not listed in the manifest, so never checked, yet a "
                                f"backend would read it; {REDO}")
        for name, digest in manifest.files.items():
            f = inside(model_dir, name)
            if not f.is_file():
                raise ModelDirError(f"{f}: listed in the manifest but missing; {REDO}")
            if file_digest(f) != digest:
                raise ModelDirError(f"{f}: SHA-256 does not match the manifest (file changed); {REDO}")
    return manifest

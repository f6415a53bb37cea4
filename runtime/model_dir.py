"""A model dir as an object: opened once, loaded with one options type, decoded with its own defaults.

    model_dir = ModelDir.open(path)                     # swap restored, manifest read and verified once,
                                                        # tokenizer built once
    loaded = load(model_dir, LoadOptions(backend="onnxruntime", threads=2), decoding_given)
    loaded.backend.encode(...)                          # a typed runtime.backend.Backend
    loaded.decoding                                     # the model's defaults under what the user gave
    loaded.translate(ids)                               # the search, with that decoding

`load` is the one place where a model dir's decoding defaults (DecodingOptions.for_model) and the
device's batch sentence cap (for_device) are applied, and where the backend registry (runtime/registry.py)
is asked which backend serves the dir. Nothing here imports torch: the deploy install opens and loads
ONNX model dirs with it."""

from __future__ import annotations

import functools
import importlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model import io_names
from model.atomic import restore_replaced_dir
from model.manifest import (
    CHECKPOINT_FILE,
    MANIFEST,
    ORT_DYNAMIC,
    REDO,
    SPM_FILE,
    Manifest,
    ModelDirError,
    read_manifest,
)
from runtime.backend import Backend
from runtime.decoding import PAPER, DecodingOptions
from runtime.errors import RuntimeUserError
from runtime.fields import Checked, declared_types, opt
from runtime.machine import thread_problem
from runtime.registry import (
    BACKENDS,
    ONLY_SOME,
    BackendEntry,
    check_device,
    choose_backend,
    entry,
    import_torch,
    not_taken,
)
from runtime.tokenizer import AnyTokenizer, tokenizer_from_file, word_continuations
from runtime.translate import NBest, translate_ids

if TYPE_CHECKING:
    from runtime.references import References
    from runtime.shortlist import Shortlist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelDir:
    """A verified model dir: its manifest (read once), its tokenizer, and what it records."""

    path: Path
    manifest: Manifest
    tokenizer: AnyTokenizer = field(repr=False)

    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> ModelDir:
        """Put back a dir an interrupted `export --force` left swapped, read the manifest, verify every
        file it lists (a one-line ModelDirError naming the file otherwise) and build the tokenizer.
        `verify=False` leaves the files' digests unchecked: for a caller that reads what the dir records (its
        shape, languages, tokenizer) and loads nothing from it, or hands it to a process that loads it."""
        path = Path(path)
        restore_replaced_dir(path)
        manifest = read_manifest(path, verify=verify, need=(SPM_FILE,))
        return cls(path, manifest, tokenizer_from_file(path / SPM_FILE))

    @property
    def decoding_defaults(self) -> dict[str, Any]:
        """The model's own decoding defaults (an imported model's num_beams, ...); empty: the paper's."""
        return self.manifest.decoding

    def file(self, name: str) -> Path:
        return self.path / name

    def references(self) -> References:
        """The fp32 model's translations recorded at export (runtime/references.py)."""
        from runtime import references

        return references.read(self.path)

    @functools.cached_property
    def shortlist(self) -> Shortlist:
        """The vocabulary shortlist table exported with the dir (a one-line error when there is none)."""
        from runtime.shortlist import Shortlist

        if self.manifest.shortlist is None:
            raise RuntimeUserError(f"{self.path}: exported without a vocabulary shortlist; export it again with "
                                   "--shortlist-src and --shortlist-tgt (a parallel corpus), or leave out --shortlist")
        return Shortlist.load(self.path / io_names.SHORTLIST_FILE)


STEPS = ("eager", "graph", "compiled")  # the torch backend's decoder steps a user picks (runtime/torch_backend.py)


SHORTLIST_HELP = ("Decode over the model dir's vocabulary shortlist (export --shortlist-src/--shortlist-tgt): faster "
                  "on large vocabularies, but a sentence's output may depend on the sentences batched with it. On "
                  "torch and onnxruntime only; see docs/shortlist.md.")


@dataclass(frozen=True)
class LoadOptions(Checked):
    """How to load a model dir: which engine, where, with how many threads, in which precision. Every
    command that loads one takes its options from these fields (a command adds a note of its own)."""

    backend: str = opt("auto", "auto: tensorrt if the engines, TensorRT and a GPU are present, else onnxruntime "
                                "if installed, else torch.", choices=BACKENDS)
    device: str | None = opt(None, "cpu, cuda or cuda:N [default: cuda when available, else cpu].", metavar="DEV")
    threads: int | None = opt(None, "Intra-op threads of torch / onnxruntime [default: all cores].", min=1)
    precision: str | None = opt(None, "Torch backend precision [default: the model dir's; fp16 only on GPU].",
                                 flag="--dtype", choices=("fp32", "fp16"))
    shortlist: bool = opt(False, SHORTLIST_HELP)
    parallel_batches: int | None = opt(None, "Batches decoded at once, each on --threads / N intra-op threads "
                                             "(onnxruntime on the CPU only): every operator of two batches runs side "
                                             "by side instead of one batch's split over the cores. Same output; faster "
                                             "where a file makes many batches or a server has several requests at "
                                             "once, and for a lone sentence, at the memory of N batches "
                                             "(docs/performance.md) [default: 2 where serve-batch or serve runs "
                                             "onnxruntime on a CPU with 2 or more threads, else 1].", min=1,
                            metavar="N")
    # what the loading is for, set by the command (no option): many batches (serve-batch's files, the HTTP server's
    # queue), which the onnxruntime backend on a CPU then decodes runtime/machine.py's default_parallel_batches at
    # a time unless --parallel-batches says
    many_batches: bool = False
    step: str | None = opt(None, "Torch backend's decoder step: eager; graph (replayed as a CUDA graph, CUDA only); "
                                  "compiled (torch.compile, once per batch shape, 9-22 s each, then a CUDA graph "
                                  "on CUDA; docs/gpu.md) [default: graph on CUDA, else eager].",
                            choices=STEPS)
    steps_per_replay: int | None = opt(None, "Torch backend: beam search steps run on the device per CUDA graph "
                                             "replay (--step graph or compiled; docs/gpu.md): the same translations, "
                                             "fewer trips to the host [default: 4 where the step is a CUDA graph, "
                                             "else 1].", min=1, metavar="K")

    def problems(self, name: Callable[[str], str] | None = None) -> list[str]:
        """Every impossible setting, each naming its field as `name` phrases it: the CLI's flag by default."""
        n = name or self.flag
        mistyped = declared_types(self, n)
        if mistyped:  # (threads="2" failed in os.sched_getaffinity's arithmetic, 1.5 in onnxruntime's binding)
            return mistyped
        out = []
        if self.backend not in BACKENDS:
            out.append(f"{n('backend')} {self.backend!r}: choose one of {', '.join(BACKENDS)}")
        threads = thread_problem(self.threads, n("threads"))
        if threads:
            out.append(threads)
        if self.precision not in (None, "fp32", "fp16", "int8"):
            out.append(f"{n('precision')} {self.precision!r}: choose fp32 or fp16")
        if self.step not in (None, *STEPS):
            out.append(f"{n('step')} {self.step!r}: choose one of {', '.join(STEPS)}")
        if self.steps_per_replay is not None and self.steps_per_replay < 1:
            out.append(f"{n('steps_per_replay')} must be at least 1 (got {self.steps_per_replay})")
        elif self.steps_per_replay is not None and self.steps_per_replay > 1 and self.step == "eager":
            out.append(f"{n('steps_per_replay')} {self.steps_per_replay} needs a fixed-shape step: "
                       f"{n('step')} graph or compiled, not eager")
        batches = self.parallel_batches  # None: the command's default (many_batches)
        if batches is not None and batches < 1:
            out.append(f"{n('parallel_batches')} must be at least 1 (got {batches})")
        elif batches is not None and self.threads is not None and self.threads < batches:
            out.append(f"{n('parallel_batches')} {batches} needs at least as many {n('threads')} (got "
                       f"{self.threads}): each batch runs on {n('threads')} / {n('parallel_batches')} of them")
        return out

    def only_some(self) -> dict[str, Any]:
        """The options set here that only some backends take (runtime/registry.py ONLY_SOME), with their values."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name in ONLY_SOME and getattr(self, f.name) != f.default}

    def for_backend(self, name: str) -> LoadOptions:
        """These options for backend `name`, without those of ONLY_SOME it does not take (bench and parity give
        --step to torch and --parallel-batches to onnxruntime only)."""
        taken = entry(name).options
        unset: dict[str, Any] = {f.name: f.default for f in fields(self) if f.name in ONLY_SOME and f.name not in taken}
        return replace(self, backend=name, **unset)


@dataclass
class Loaded:
    """A model dir with a backend running it, the options it was loaded with (`auto` and the torch backend's
    default step resolved: what runs) and the decoding it will be run with."""

    model_dir: ModelDir
    backend: Backend
    decoding: DecodingOptions
    options: LoadOptions = field(default_factory=LoadOptions)

    @property
    def tokenizer(self) -> AnyTokenizer:
        return self.model_dir.tokenizer

    @property
    def manifest(self) -> Manifest:
        return self.model_dir.manifest

    def translate(self, ids: list[list[int]], decoding: DecodingOptions | None = None,
                  first_tokens: list[int] | None = None, on_batch: Callable[[int], None] | None = None,
                  constraints: list[list[list[int]]] | None = None, workers: int | None = None) -> list[NBest]:
        """The search: each source's hypotheses as (tokens, score), best first, in input order ([] for an empty
        source), with `decoding` or else this model's; first_tokens, on_batch, constraints (a glossary's
        terms per source: EncodedTexts.constraints) and workers as runtime.translate's translate_ids, which
        batches by length and runs the search."""
        vocab = self.backend.cfg.vocab_size  # ids a caller made: -1 was the last row on one backend, an
        lines = [line for line in ids if len(line)]  # IndexError on another (a line's min and max: C's loop, on
        low, high = min(map(min, lines), default=0), max(map(max, lines), default=0)  # every batch served)
        if low < 0 or high >= vocab:
            raise RuntimeUserError(f"source id {low if low < 0 else high} is not in this model's vocabulary "
                                   f"(ids 0..{vocab - 1})")
        if first_tokens is not None and len(first_tokens) != len(ids):
            raise RuntimeUserError(f"first_tokens has {len(first_tokens)} ids for {len(ids)} sources: give one each")
        joins = word_continuations(self.tokenizer) if constraints is not None else None
        hyps = translate_ids(self.backend, ids, self.decoding if decoding is None else decoding, first_tokens,
                             on_batch, constraints, joins, workers)
        return [[(h.tokens, h.score) for h in nbest] for nbest in hyps]


def check_load(opened: ModelDir, options: LoadOptions) -> BackendEntry:
    """The registry entry `load` would open `opened` with under `options`, once the device exists, the backend
    takes these options and the model dir holds what it needs; else one RuntimeUserError or ModelDirError. It
    loads nothing (a driver checks what its workers will load: ray-translate)."""
    check_device(options.device)
    chosen = entry(choose_backend(opened.manifest) if options.backend == "auto" else options.backend)
    refused = not_taken(chosen, options.only_some(), LoadOptions.flag)
    if refused:
        raise RuntimeUserError(refused)
    missing = [name for name in chosen.needs(opened.manifest, options.shortlist, opened.path)
               if name not in opened.manifest.files]
    if options.shortlist:
        opened.shortlist  # noqa: B018 - a dir exported without one says how to get one (read once, kept)
    own = [name for name in missing if name in chosen.files]
    if own:  # in the backend's words (engines an export skipped: why, and where to build them)
        raise ModelDirError(f"{opened.path}: {chosen.missing(opened.manifest, own)}")
    if missing:
        raise ModelDirError(f"{opened.path}: the manifest lists no {missing[0]}; {REDO}")
    return chosen


def _check_config(opened: ModelDir, cfg: Any) -> None:
    """The manifest's model_config against the files whose digests it checks: the tokenizer's vocabulary and EOS,
    and model.pt's config where the backend read it (torch). The manifest itself no digest covers: one edited by
    hand translated with the wrong EOS to the length limit, or fed the graphs shapes they refused mid-batch."""
    given = opened.manifest.model_config
    found = {"vocab_size": (opened.tokenizer.vocab_size, SPM_FILE), "eos_id": (opened.tokenizer.eos_id, SPM_FILE)}
    if cfg is not given:  # model.pt's own config: every field
        found = {f.name: (getattr(cfg, f.name), CHECKPOINT_FILE) for f in fields(cfg)} | found  # (spm.model's
        # vocabulary and EOS checked as well: a tokenizer that disagrees with both is named by its own file)
    wrong = [f"model_config.{key} is {getattr(given, key, None)!r} but {file} has {value!r}"
             for key, (value, file) in found.items() if getattr(given, key, None) != value]
    if wrong:
        raise ModelDirError(f"{opened.path / MANIFEST}: {'; '.join(wrong[:3])} (edited, or from another export); "
                            f"{REDO}")


def load(model_dir: ModelDir | str | Path, options: LoadOptions | None = None,
         decoding_given: DecodingOptions = PAPER) -> Loaded:
    """The model dir (opened unless given open) on the backend `options` name or the registry picks,
    with `decoding_given` under the model's own defaults and the device's batch budget."""
    started = time.perf_counter()
    options = (options or LoadOptions()).validate()
    opened = model_dir if isinstance(model_dir, ModelDir) else ModelDir.open(model_dir)
    manifest = opened.manifest
    chosen = check_load(opened, options)
    table = opened.shortlist if options.shortlist else None  # a dir exported without one says how to get one
    if not chosen.checkpoint_weights and manifest.quantization == ORT_DYNAMIC:  # the graphs' int8, not model.pt
        log.warning("%s: int8 flavour ort-dynamic quantizes activations per batch, so a sentence's translation "
                    "can depend on the sentences batched with it (docs/int8.md); use the rowwise or qdq flavour "
                    "where outputs must not depend on batching", opened.path)
    module, name = chosen.opener.split(":")  # the backend's module, imported only now (torch, TensorRT)
    if chosen.needs_torch:
        import_torch(f"the {chosen.name} backend")
    opener: Callable[[ModelDir, LoadOptions, Shortlist | None], Backend] = getattr(importlib.import_module(module),
                                                                                  name)
    backend = opener(opened, options, table)
    _check_config(opened, backend.cfg)
    log.info("backend %s on %s, loaded in %.2f s", backend.name, backend.device, time.perf_counter() - started)
    decoding = decoding_given.for_device(backend.device).for_model(opened.decoding_defaults,
                                                                   str(opened.path / MANIFEST))
    return Loaded(opened, backend, decoding, replace(options, backend=chosen.name, step=backend.step_mode))

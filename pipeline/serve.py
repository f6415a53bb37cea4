"""`pipeline serve-batch`: translate text files, streaming, line-aligned, atomically.

Each input is read a window of lines at a time (memory stays bounded on any file size);
the window is tokenized, sorted by length into dense batches (runtime.translate),
translated, put back in input order and written. Output goes to a temp file renamed
into place at the end, so an interrupted run never leaves a truncated translation.

Bad input never shifts lines: empty or whitespace-only lines give empty lines; lines
longer than the model's source limit are truncated (counted) or refused; invalid UTF-8
is refused with file:line or replaced (counted).

Under torchrun (WORLD_SIZE > 1) rank 0 reads and tokenizes each window, every rank
translates lines i % world == rank on its own device, and rank 0 gathers the results
and writes them in input order.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from pipeline.errors import UserError
from pipeline.textio import atomic_output, decode_line, open_binary
from runtime.search import Hypothesis
from runtime.tokenizer import Tokenizer
from runtime.translate import DEFAULT_BATCH_TOKENS, translate_ids

log = logging.getLogger(__name__)

NBEST_SEP = " ||| "


@dataclass(frozen=True)
class ServeOptions:
    beam_size: int = 4
    alpha: float = 0.6
    max_len_a: float = 1.0
    max_len_b: int = 50
    min_len: int = 0
    nbest: int = 1
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    window: int = 10000
    long_lines: str = "truncate"  # or "error"
    invalid_utf8: str = "error"   # or "replace"

    def search_options(self) -> dict[str, Any]:
        return dict(beam_size=self.beam_size, alpha=self.alpha, max_len_a=self.max_len_a,
                    max_len_b=self.max_len_b, min_len=self.min_len, nbest=self.nbest,
                    batch_tokens=self.batch_tokens)


@dataclass
class ServeStats:
    sentences: int = 0
    empty: int = 0
    truncated: int = 0
    replaced: int = 0
    src_tokens: int = 0
    tgt_tokens: int = 0
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)

    def add(self, other: ServeStats) -> None:
        for name in ("sentences", "empty", "truncated", "replaced", "src_tokens", "tgt_tokens", "seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.files += other.files

    def summary(self, backend: str, device: str) -> str:
        rate = self.tgt_tokens / self.seconds if self.seconds > 0 else 0.0
        return (f"translated {self.sentences} sentences ({self.src_tokens} source tokens, "
                f"{self.tgt_tokens} target tokens) in {self.seconds:.2f} s: {rate:.1f} target tokens/s; "
                f"backend {backend}, device {device}")


# -- distribution -------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """This process's place under torchrun (rank 0 of 1 without it)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_writer(self) -> bool:
        return self.rank == 0


def world_from_env() -> World:
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return World(int(os.environ.get("RANK", "0")), size, int(os.environ.get("LOCAL_RANK", "0")))


@contextmanager
def process_group(world: World) -> Iterator[None]:
    """Initialise the process group for a torchrun launch and always tear it down.
    Object collectives go through gloo, which every build of torch has."""
    if world.size <= 1:
        yield
        return
    dist.init_process_group("gloo", rank=world.rank, world_size=world.size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def rank_device(world: World, device: str | None) -> str | None:
    """Under torchrun each rank takes its own GPU (cuda:LOCAL_RANK) when on CUDA."""
    if world.size <= 1:
        return device
    if device in (None, "cuda") and torch.cuda.is_available():
        return f"cuda:{world.local_rank % torch.cuda.device_count()}"
    return device


# -- reading ------------------------------------------------------------------------------


@dataclass
class Window:
    """One window of an input: source ids per line ([] for empty lines) and counts."""

    ids: list[list[int]]
    empty: int = 0
    truncated: int = 0
    replaced: int = 0


def read_windows(path: str, tokenizer: Tokenizer, max_src_len: int, opts: ServeOptions
                 ) -> Iterator[Window]:
    """Windows of `opts.window` lines, tokenized, with the bad-input policy applied."""
    f = open_binary(path)
    try:
        texts: list[str] = []
        replaced = 0
        first_line = 1
        for lineno, raw in enumerate(_raw_lines(f, path), start=1):
            text, bad = _decode(raw, path, lineno, opts.invalid_utf8)
            replaced += bad
            texts.append(text)
            if len(texts) == opts.window:
                yield _tokenize(texts, first_line, path, tokenizer, max_src_len, opts, replaced)
                texts, replaced, first_line = [], 0, lineno + 1
        if texts:
            yield _tokenize(texts, first_line, path, tokenizer, max_src_len, opts, replaced)
    finally:
        if f is not sys.stdin.buffer:
            f.close()


def _raw_lines(f: IO[bytes], path: str) -> Iterator[bytes]:
    try:
        yield from f
    except (OSError, EOFError) as e:
        raise UserError(f"{path}: cannot read ({e})") from None


def _decode(raw: bytes, path: str, lineno: int, policy: str) -> tuple[str, int]:
    try:
        return decode_line(raw, path, lineno), 0
    except UserError as e:
        if policy != "replace":
            raise UserError(f"{e} (or pass --invalid-utf8 replace)") from None
        return decode_line(raw, path, lineno, errors="replace"), 1


def _tokenize(texts: list[str], first_line: int, path: str, tokenizer: Tokenizer, max_src_len: int,
              opts: ServeOptions, replaced: int) -> Window:
    live = [i for i, t in enumerate(texts) if t.strip()]
    window = Window([[] for _ in texts], empty=len(texts) - len(live), replaced=replaced)
    if not live:
        return window
    for i, seq in zip(live, tokenizer.encode_source([texts[i] for i in live])):
        if len(seq) > max_src_len:
            if opts.long_lines == "error":
                raise UserError(f"{path}:{first_line + i}: {len(seq)} tokens, more than the model's limit "
                                f"of {max_src_len}; pass --long-lines truncate or split the line")
            window.truncated += 1
            seq = seq[: max_src_len - 1] + seq[-1:]
        window.ids[i] = seq
    return window


# -- translating --------------------------------------------------------------------------


def _translate_share(backend: Any, ids: list[list[int]], world: World, opts: ServeOptions
                     ) -> list[list[tuple[list[int], float]]]:
    """This rank's lines of the window (i % size == rank), as (tokens, score) per hypothesis."""
    mine = ids[world.rank::world.size]
    hyps: list[list[Hypothesis]] = translate_ids(backend, mine, **opts.search_options())
    return [[(h.tokens, h.score) for h in nbest] for nbest in hyps]


def _gather(share: list[Any], world: World, n_lines: int) -> list[Any] | None:
    """All ranks' shares interleaved back into input order, on rank 0 (None elsewhere)."""
    if world.size <= 1:
        return share
    shares: list[Any] = [None] * world.size if world.is_writer else None  # type: ignore[assignment]
    dist.gather_object(share, shares, dst=0)
    if not world.is_writer:
        return None
    merged: list[Any] = [None] * n_lines
    for rank, part in enumerate(shares):
        merged[rank::world.size] = part
    return merged


def _broadcast(window: Window | None, error: str | None, world: World) -> tuple[Window | None, str | None]:
    """Rank 0's window (or its error, or None at the end of the input) to every rank."""
    if world.size <= 1:
        return window, error
    box = [(window, error)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def format_line(tokenizer: Tokenizer, nbest: list[tuple[list[int], float]], n: int) -> str:
    """One output line: the best translation, or with n > 1 the n best as
    `text ||| score` joined by ' ||| ' (line-aligned with the input whatever n is)."""
    if not nbest:
        return ""
    texts = tokenizer.decode([tokens for tokens, _ in nbest])
    if n == 1:
        return texts[0]
    return NBEST_SEP.join(f"{t}{NBEST_SEP}{score:.4f}" for t, (_, score) in zip(texts, nbest))


def translate_stream(backend: Any, tokenizer: Tokenizer, input_path: str, out: IO[str] | None,
                     opts: ServeOptions, world: World = World(), progress: bool = True) -> ServeStats:
    """Translate one input into `out` (rank 0; None on other ranks), window by window."""
    stats = ServeStats(files=[input_path])
    started = time.perf_counter()
    windows = read_windows(input_path, tokenizer, backend.max_src_len, opts) if world.is_writer else None
    bar = tqdm(desc=Path(input_path).name if input_path != "-" else "stdin", unit=" lines",
               disable=not (progress and world.is_writer), leave=False)
    try:
        while True:
            window, error = None, None
            if windows is not None:
                try:
                    window = next(windows, None)
                except UserError as e:
                    error = str(e)
            window, error = _broadcast(window, error, world)
            if error is not None:
                raise UserError(error)
            if window is None:
                stats.seconds = time.perf_counter() - started
                return stats
            share = _translate_share(backend, window.ids, world, opts)
            merged = _gather(share, world, len(window.ids))
            if merged is None:
                continue
            for nbest in merged:
                out.write(format_line(tokenizer, nbest, opts.nbest) + "\n")  # type: ignore[union-attr]
            _count(stats, window, merged)
            bar.update(len(window.ids))
    finally:
        bar.close()


def _count(stats: ServeStats, window: Window, merged: list[list[tuple[list[int], float]]]) -> None:
    stats.sentences += len(window.ids)
    stats.empty += window.empty
    stats.truncated += window.truncated
    stats.replaced += window.replaced
    stats.src_tokens += sum(len(s) for s in window.ids)
    stats.tgt_tokens += sum(len(n[0][0]) + 1 for n in merged if n)  # generated tokens incl. EOS


# -- files ----------------------------------------------------------------------------------


def output_paths(inputs: list[str], output: str | None, output_dir: str | None) -> list[str]:
    """Where each input's translation goes: --output FILE for one input, or
    DIR/<input name> (a trailing .gz dropped: the output is plain text)."""
    if (output is None) == (output_dir is None):
        raise UserError("give exactly one of --output FILE or --output-dir DIR")
    if output is not None:
        if len(inputs) != 1:
            raise UserError(f"--output takes one input, got {len(inputs)}; use --output-dir DIR")
        return [output]
    paths = []
    for inp in inputs:
        if inp == "-":
            raise UserError("input '-' (stdin) has no name for --output-dir; use --output FILE or '-'")
        name = Path(inp).name
        paths.append(str(Path(output_dir) / (name[:-3] if name.endswith(".gz") else name)))
    if len(set(paths)) != len(paths):
        raise UserError("two inputs have the same file name, so --output-dir would write one over "
                        "the other; translate them in separate runs")
    for inp, out in zip(inputs, paths):
        if inp != "-" and out != "-" and Path(inp).exists() and Path(out).exists() \
                and Path(inp).resolve() == Path(out).resolve():
            raise UserError(f"{out}: output would replace its own input; choose another output")
    return paths


def check_options(opts: ServeOptions) -> None:
    problems = []
    if opts.beam_size < 1:
        problems.append("--beam-size must be >= 1")
    if not 1 <= opts.nbest <= max(opts.beam_size, 1):
        problems.append(f"--nbest {opts.nbest} must be between 1 and --beam-size ({opts.beam_size})")
    if opts.batch_tokens < 1:
        problems.append("--batch-tokens must be >= 1")
    if opts.window < 1:
        problems.append("--window must be >= 1")
    if problems:
        raise UserError("; ".join(problems))


def serve_files(backend: Any, tokenizer: Tokenizer, inputs: list[str], outputs: list[str],
                opts: ServeOptions, world: World = World(), progress: bool = True) -> ServeStats:
    """Translate every input to its output; each output appears complete or not at all."""
    total = ServeStats()
    for inp, outp in zip(inputs, outputs):
        if inp != "-":
            open_binary(inp).close()  # a missing input fails on every rank, before any output
        if world.is_writer:
            with atomic_output(outp, "w") as out:
                stats = translate_stream(backend, tokenizer, inp, out, opts, world, progress)
        else:
            stats = translate_stream(backend, tokenizer, inp, None, opts, world, progress)
        total.add(stats)
        _warn(stats, inp)
    return total


def _warn(stats: ServeStats, path: str) -> None:
    if stats.truncated:
        log.warning("%s: %d line(s) longer than the model's source limit were truncated "
                    "(--long-lines error refuses them)", path, stats.truncated)
    if stats.replaced:
        log.warning("%s: %d line(s) had invalid UTF-8, replaced by U+FFFD", path, stats.replaced)

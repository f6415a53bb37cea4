"""`pipeline serve-batch`: translate text files, streaming, line-aligned, atomically.

Each input is read a window of lines at a time (memory stays bounded on any file size);
the window is tokenized, sorted by length into dense batches (runtime.translate),
translated, put back in input order and written. Output goes to a temp file renamed
into place at the end, so an interrupted run never leaves a truncated translation.

Bad input never shifts lines: empty or whitespace-only lines give empty lines; lines
longer than the model's source limit are truncated (counted) or refused; invalid UTF-8
is refused with file:line or replaced (counted).

`translate_windows` is the serving path itself (pipeline/translation.py reads and formats);
parity runs every backend through it, so it measures exactly what serve-batch writes.

Under torchrun (WORLD_SIZE > 1) rank 0 reads and tokenizes each window, every rank
translates lines i % world == rank on its own device, and rank 0 gathers the results
and writes them in input order.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from pipeline.errors import UserError
from pipeline.textio import atomic_output, open_binary
from pipeline.translation import (
    NBest,
    ServeOptions,
    TranslatedWindow,
    Window,
    finish_window,
    read_windows,
)
from runtime.decoding import DecodingOptions
from runtime.tokenizer import Tokenizer
from runtime.translate import translate_ids

log = logging.getLogger(__name__)

@dataclass
class ServeStats:
    sentences: int = 0
    empty: int = 0
    truncated: int = 0
    replaced: int = 0
    src_tokens: int = 0
    tgt_tokens: int = 0
    seconds: float = 0.0

    def add(self, other: ServeStats) -> None:
        for name in ("sentences", "empty", "truncated", "replaced", "src_tokens", "tgt_tokens", "seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def count(self, window: TranslatedWindow) -> None:
        self.sentences += len(window.lines)
        self.empty += window.empty
        self.truncated += window.truncated
        self.replaced += window.replaced
        self.src_tokens += window.src_tokens
        self.tgt_tokens += window.tgt_tokens

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


# -- translating --------------------------------------------------------------------------


def _translate_share(backend: Any, ids: list[list[int]], world: World, decoding: DecodingOptions
                     ) -> list[NBest]:
    """This rank's lines of the window (i % size == rank), as (tokens, score) per hypothesis."""
    hyps = translate_ids(backend, ids[world.rank::world.size], decoding)
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


def translate_windows(backend: Any, tokenizer: Tokenizer, input_path: str, opts: ServeOptions,
                      world: World = World(), progress: bool = False) -> Iterator[TranslatedWindow]:
    """The serving path: each window of `input_path` read, encoded, translated (split over
    the ranks) and formatted, in input order. Rank 0 gets every window; other ranks only
    do their share and get nothing. serve-batch writes these; parity measures them."""
    windows = read_windows(input_path, tokenizer, backend.max_src_len, opts) if world.is_writer else None
    bar = tqdm(desc=Path(input_path).name if input_path != "-" else "stdin", unit=" lines",
               disable=not (progress and world.is_writer), leave=False)
    try:
        while True:
            window: Window | None = None
            error: str | None = None
            if windows is not None:
                try:
                    window = next(windows, None)
                except UserError as e:
                    error = str(e)
            window, error = _broadcast(window, error, world)
            if error is not None:
                raise UserError(error)
            if window is None:
                return
            share = _translate_share(backend, window.ids, world, opts.decoding)
            merged = _gather(share, world, len(window.ids))
            if merged is None:
                continue
            yield finish_window(tokenizer, window, merged, opts.decoding.nbest)
            bar.update(len(window.ids))
    finally:
        bar.close()


def translate_stream(backend: Any, tokenizer: Tokenizer, input_path: str, out: IO[str] | None,
                     opts: ServeOptions, world: World = World(), progress: bool = True) -> ServeStats:
    """Translate one input into `out` (rank 0; None on other ranks), window by window."""
    stats = ServeStats()
    started = time.perf_counter()
    for window in translate_windows(backend, tokenizer, input_path, opts, world, progress):
        out.write("".join(line + "\n" for line in window.lines))  # type: ignore[union-attr]
        stats.count(window)
    stats.seconds = time.perf_counter() - started
    return stats


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

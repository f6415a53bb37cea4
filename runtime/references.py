"""Reference translations recorded in a model dir at export: the fp32 PyTorch model's output on a
small held-out set, so `pipeline parity` can gate a backend where PyTorch is not installed.

The record holds the source lines, their human references, the decoding options, and the
PyTorch model's best hypothesis per line (token ids and text), translated through the same
encode / search / format functions that serve-batch uses (runtime.translate). The manifest
hashes the file like every other, so a changed record is refused as a changed model dir."""

from __future__ import annotations

import gzip
import itertools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.atomic import atomic_write_text
from model.manifest import REFERENCES_FILE
from runtime.backend import Backend
from runtime.decoding import PAPER, DecodingOptions
from runtime.errors import RuntimeUserError
from runtime.languages import direction
from runtime.tokenizer import AnyTokenizer
from runtime.translate import encode_sources, format_line, translate_ids

log = logging.getLogger(__name__)

FORMAT = "pipeline-references-v1"
LINE_BYTES = 1 << 20  # a held-out line read at all: longer is no sentence (a device, a file without line ends)
DEFAULT_LINES = 100  # enough sentences for a token-agreement gate, seconds to translate at export
# `pipeline parity`'s int8 gate: the largest |BLEU(int8) - BLEU(fp32)| (pipeline/evaluation/parity_options.py),
# which the export also applies to static scales calibrated on its built-in sample (export/sample.py)
INT8_MAX_BLEU_DELTA = 0.5


@dataclass(frozen=True)
class References:
    """What a model dir's references.json holds."""

    sources: list[str]
    references: list[str]  # human references, line-aligned with sources
    decoding: DecodingOptions
    hypotheses: list[list[int]]  # the fp32 PyTorch model's best hypothesis per line
    lines: list[str]  # those hypotheses as serve-batch writes them
    # a multilingual model's direction of these lines (its language codes); None for a model of one pair
    source_lang: str | None = None
    target_lang: str | None = None

    def to_json(self) -> dict[str, Any]:
        languages = {} if self.source_lang is None else {"source_lang": self.source_lang,
                                                          "target_lang": self.target_lang}
        return {"format": FORMAT, "decoding": self.decoding.to_dict(), "sources": self.sources,
                "references": self.references, "hypotheses": self.hypotheses, "lines": self.lines, **languages}


def record(backend: Backend, tokenizer: AnyTokenizer, sources: list[str], references: list[str],
           decoding: DecodingOptions = PAPER, languages: tuple[str, str] | None = None) -> References:
    """The reference backend's (the fp32 PyTorch model's) translations of `sources`; `languages`: a multilingual
    model's (source, target) codes of them, told in its language tokens as serve-batch tells them."""
    if len(sources) != len(references):
        raise RuntimeUserError(f"{len(sources)} reference sources but {len(references)} references: "
                               "they must be line-aligned")
    way = direction(backend.cfg, *(languages or (None, None)))
    encoded = encode_sources(tokenizer, sources, backend.max_src_len, prefix=way.prefix)
    nbest = translate_ids(backend, encoded.ids, decoding, first_tokens=way.first_tokens(len(sources)))
    best = [hyps[0].tokens if hyps else [] for hyps in nbest]
    lines = [format_line(tokenizer, [(h.tokens, h.score) for h in hyps], 1) for hyps in nbest]
    return References(sources, references, decoding, best, lines, way.source, way.target)


def write(model_dir: Path, refs: References) -> None:
    atomic_write_text(Path(model_dir) / REFERENCES_FILE, json.dumps(refs.to_json(), ensure_ascii=False) + "\n")


def read(model_dir: Path) -> References:
    """The model dir's recorded references (verify the manifest first: this only parses)."""
    path = Path(model_dir) / REFERENCES_FILE
    if not path.is_file():
        raise RuntimeUserError(f"{model_dir}: no {REFERENCES_FILE} (exported without a reference set); pass "
                               "--src and --ref to compare against the PyTorch model live, or export again with "
                               "--reference-src/--reference-tgt")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        refs = References([str(s) for s in data["sources"]], [str(r) for r in data["references"]],
                          DecodingOptions(**data["decoding"]).validate(),
                          [[int(t) for t in h] for h in data["hypotheses"]], [str(x) for x in data["lines"]],
                          *(None if data.get(k) is None else str(data[k]) for k in ("source_lang", "target_lang")))
    except (ValueError, KeyError, TypeError) as e:
        raise RuntimeUserError(f"{path}: unreadable reference record ({e}); export the model again") from None
    if not (len(refs.sources) == len(refs.references) == len(refs.hypotheses) == len(refs.lines)):
        raise RuntimeUserError(f"{path}: its lists are not line-aligned; export the model again")
    if not refs.sources:
        raise RuntimeUserError(f"{path}: no sentences recorded; pass --src and --ref, or export again with a "
                               "held-out set that has lines")
    return refs


def held_out_lines(src: Path, tgt: Path, limit: int = DEFAULT_LINES) -> tuple[list[str], list[str]]:
    """The first `limit` non-blank line pairs of a parallel held-out set (plain or .gz), split on b"\\n" as
    serve-batch splits them; a file that cannot be read, holds invalid UTF-8, a line longer than LINE_BYTES or
    lines ended by CR alone is one error naming it (and the line). Both files are read once, line by line (their
    line counts must agree), and only the pairs kept are held: /dev/zero was read whole, until a MemoryError."""
    pairs: list[tuple[str, str]] = []
    blank = counted_src = counted_tgt = 0
    for s, t in itertools.zip_longest(_lines(Path(src)), _lines(Path(tgt))):
        counted_src, counted_tgt = counted_src + (s is not None), counted_tgt + (t is not None)
        if s is None or t is None or len(pairs) == limit:
            continue
        if s.strip() and t.strip():
            pairs.append((s, t))
        else:
            blank += 1
    if counted_src != counted_tgt:
        raise RuntimeUserError(f"{src} has {counted_src} lines but {tgt} has {counted_tgt}; they must be "
                               "line-aligned")
    if blank:
        log.warning("%s / %s: %d line pair(s) with a blank side left out of the held-out lines", src, tgt, blank)
    return [s for s, _ in pairs], [t for _, t in pairs]


def _lines(path: Path) -> Iterator[str]:
    """The lines of a held-out file, as held_out_lines says."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    number = carriage_returns = 0
    try:
        with opener(path, "rb") as f:
            while raw := f.readline(LINE_BYTES + 1):
                number += 1
                if len(raw) > LINE_BYTES and not raw.endswith(b"\n"):
                    if raw.count(b"\r") > 1:  # lines ended by CR alone, read as one: said so
                        raise _cr_only(path, raw.count(b"\r"), number)
                    raise RuntimeUserError(f"{path}:{number}: a line of more than {LINE_BYTES >> 20} MiB, longer "
                                           "than any sentence: is it a text file with line ends?")
                try:  # a UTF-8 byte order mark starting the file is no text (it lowered the first line's BLEU)
                    line = raw.decode("utf-8").removesuffix("\n").rstrip("\r")
                except UnicodeDecodeError as e:
                    raise RuntimeUserError(f"{path}:{number}: invalid UTF-8 (byte {e.start}: "
                                           f"{raw[e.start:e.start + 1]!r}); fix the file") from None
                carriage_returns += line.count("\r")
                yield line.removeprefix("\ufeff") if number == 1 else line
    except (OSError, EOFError) as e:  # missing, unreadable, a .gz that is not one or is cut short
        raise RuntimeUserError(f"{path}: cannot read ({e})") from None
    if carriage_returns and (number == 1 or carriage_returns > number):  # lines end at \n only
        raise _cr_only(path, carriage_returns, number)


def _cr_only(path: Path, carriage_returns: int, lines: int) -> RuntimeUserError:
    return RuntimeUserError(f"{path}: {carriage_returns} carriage returns inside its {lines} line(s): are its lines "
                            "ended by CR alone (classic Mac)? convert them to \\n first (tr '\\r' '\\n')")

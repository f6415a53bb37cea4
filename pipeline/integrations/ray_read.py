"""Shards as Ray Data rows, read as `ray-translate` reads them: plain, .gz or Parquet files, each row its shard, line
number, text and path, with read tasks that reserve no CPU (an actor pool as large as the cluster cannot starve
them). `read_shards` is the same reader for a Ray job of your own (docs/scale-out.md)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from model.errors import UserError
from pipeline.integrations.shards import PARQUET, Shard, expand, not_text
from pipeline.serve_batch.files import count_lines
from pipeline.serve_batch.translation import MAX_LINE_BYTES, decode_row, line_too_long
from runtime.translate import not_text as no_text

READ_CHUNK = 1 << 20


def _datasource_base() -> type:
    from ray.data.datasource import FileBasedDatasource

    return FileBasedDatasource


class LinesDatasource(_datasource_base()):  # type: ignore[misc]
    """Each shard's rows as blocks of (shard, line, text, path, last, replaced): text files split on b'\\n' only
    and decoded with serve-batch's --invalid-utf8 policy; Parquet files' `column`, a null as a blank row."""

    def __init__(self, shards: list[Shard], column: str, invalid_utf8: str, rows_per_block: int):
        super().__init__([s.path for s in shards])
        # a path as given first: two shards may be one file (a symlink beside its target)
        self.index = {os.path.realpath(s.path): s.index for s in shards} | {s.path: s.index for s in shards}
        self.column, self.invalid_utf8, self.rows_per_block = column, invalid_utf8, rows_per_block

    def resolve_compression(self, path: str, open_args: dict[str, Any]) -> str | None:
        """Only .gz is decompressed, as serve-batch reads it: Ray guessed bz2, zstd, ... from a name, and the
        translation of a .bz2 was plain text under the compressed file's name."""
        return "gzip" if path.endswith(".gz") else None

    def _read_stream(self, f: Any, path: str) -> Iterator[Any]:
        shard = self.index.get(path, self.index.get(os.path.realpath(path)))
        if shard is None:
            raise RuntimeError(f"{path}: Ray read a file that is not one of the shards")
        rows = _parquet_rows(f, path, self.column, self.invalid_utf8) if path.endswith(PARQUET) else \
            _text_rows(f, path, self.invalid_utf8)
        block: list[tuple[str, int]] = []
        lineno = 0
        for lineno, row in enumerate(rows, start=1):
            block.append(row)
            if len(block) > self.rows_per_block:  # one row held back, to mark the shard's last
                yield _block(shard, path, lineno - len(block) + 1, block[:-1], last=False)
                block = block[-1:]
        if block:
            yield _block(shard, path, lineno - len(block) + 1, block, last=True)


def shard_lines(shards: list[Shard]) -> int | None:
    """Lines in all the shards, for the bar's total and ETA: plain files' line breaks counted, Parquet files' rows
    from their footers; None when a shard is .gz (counting would decompress it all) or cannot be read."""
    total = 0
    for shard in shards:
        if shard.parquet:
            try:
                import pyarrow.parquet as pq

                total += pq.ParquetFile(shard.path).metadata.num_rows
            except Exception:  # the job's reader names a bad file in one line; the bar just has no total
                return None
            continue
        lines = count_lines(shard.path)
        if lines is None:
            return None
        total += lines
    return total


# read tasks at once: reserving no CPU, nothing else caps them, and Ray started a worker process for each shard's
# (30 files of 500 lines: 24 processes, 4.5 GB, and "(raylet) WARNING: 26 PYTHON worker processes" on the
# terminal, against 8 for the same lines in one file). Reading is a small share of a job: 2 keep the actors fed.
READERS = 2


def read_shards(inputs: list[str], column: str = "text", invalid_utf8: str = "error", rows_per_block: int = 500
                ) -> Any:
    """A Ray Dataset of the rows of `inputs` (files, globs or directories of plain, .gz or Parquet shards, as
    `ray-translate` takes them), read as it reads them: columns shard, line, text, path, last, replaced; a null
    is a blank row, invalid UTF-8 refused (or replaced with invalid_utf8="replace"). Its read tasks reserve no
    CPU, so an actor pool as large as the cluster cannot starve them (Ray's own readers wait for a core the
    actors hold, for ever)."""
    import ray

    files, _ = expand(inputs)
    if not files:
        raise UserError(f"no input files in {', '.join(inputs)}")
    shards = [Shard(i, os.path.abspath(f), Path()) for i, f in enumerate(files)]
    return ray.data.read_datasource(LinesDatasource(shards, column, invalid_utf8, rows_per_block), num_cpus=0,
                                    concurrency=READERS)


def _block(shard: int, path: str, first: int, rows: list[tuple[str, int]], last: bool) -> Any:
    import pyarrow as pa

    n = len(rows)
    return pa.table({"shard": pa.array([shard] * n, pa.int32()),
                     "line": pa.array(range(first, first + n), pa.int64()),
                     "text": pa.array([r[0] for r in rows], pa.string()),
                     "path": pa.array([path] * n, pa.string()),
                     "last": pa.array([False] * (n - 1) + [last], pa.bool_()),
                     "replaced": pa.array([bool(r[1]) for r in rows], pa.bool_())})


def _text_rows(f: Any, path: str, invalid_utf8: str) -> Iterator[tuple[str, int]]:
    """Lines as serve-batch reads them: split on b'\\n' only, a last line without one kept."""
    rest = b""
    lineno = 0
    while True:
        try:
            chunk = f.read(READ_CHUNK)
        except (OSError, EOFError) as e:
            raise UserError(f"{path}: cannot read ({e})") from None
        if not chunk:
            break
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        for raw in lines:
            lineno += 1
            yield decode_row(raw, path, lineno, invalid_utf8)
        if len(rest) > MAX_LINE_BYTES:  # as serve-batch: a file without line breaks is not read whole
            raise line_too_long(path, lineno + 1)
    if rest:
        yield decode_row(rest, path, lineno + 1, invalid_utf8)


def _parquet_rows(f: Any, path: str, column: str, invalid_utf8: str = "error") -> Iterator[tuple[str, int]]:
    """The column's values (a dictionary-encoded column decoded, a null a blank row), each with 1 when it will be
    repaired (a NUL or lone surrogate under invalid_utf8 "replace", replaced by the Translator: counted as a text
    shard's replaced line is); a file that turns out unreadable past its footer (a corrupt page) is a UserError
    naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(pa.BufferReader(f.readall()))
        problem = not_text(table.schema_arrow.field(column).type)
        if problem:
            raise UserError(f"{path}: column {column!r} {problem}; name a string column")
        for batch in table.iter_batches(columns=[column]):
            for value in batch.column(0).to_pylist():
                yield (value or "", int(invalid_utf8 == "replace" and bool(value) and bool(no_text(value))))
    except (OSError, ValueError, EOFError) as e:  # pyarrow's ArrowInvalid is a ValueError, its IOError an OSError
        raise UserError(f"{path}: cannot read as Parquet ({_one_line(e)})") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__

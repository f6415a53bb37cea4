"""A corpus as shards: which files, where each translation goes, which are already done, and the writer that
puts each shard's translated rows back in line order and renames its output into place when it is complete.

Nothing here imports Ray: the plan is made (and every refusal said) before a cluster is reached, and the
writer takes rows in whatever order the cluster returns them."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from model.atomic import atomic_write_text, remove_stale_temps
from model.errors import UserError
from pipeline.serve_batch.files import output_name as translated_name
from pipeline.textio import atomic_output, check_output_file, open_binary, read_head, refuse_overwriting_inputs

log = logging.getLogger(__name__)

PARQUET = (".parquet", ".pq")
# what Spark, Hive and Parquet write beside a dataset's parts (its schema, commit markers): never shards
DATASET_FILES = ("_SUCCESS", "_metadata", "_common_metadata")
DATASET_PREFIXES = ("_committed_", "_started_", "_temporary")
RECORD = ".pipeline-ray-translate.json"  # what the outputs in a directory were made with


@dataclass(frozen=True)
class Shard:
    index: int
    path: str      # absolute
    output: Path

    @property
    def parquet(self) -> bool:
        return self.path.endswith(PARQUET)


@dataclass
class Plan:
    shards: list[Shard]               # every input, in order
    todo: list[Shard]                 # those without a complete output
    skipped: list[Shard] = field(default_factory=list)


def expand(inputs: list[str]) -> tuple[list[str], list[str]]:
    """Input files from files, globs and directories (their files, in name order; hidden files and Spark's
    `_SUCCESS`-style markers left out), and the directories named."""
    files: list[str] = []
    dirs: list[str] = []
    for given in inputs:
        if given == "-":
            raise UserError("input '-' (stdin): a cluster reads files; give files, globs or a directory")
        if Path(given).is_dir():
            dirs.append(given)
            found = sorted(p for p in Path(given).iterdir() if not p.name.startswith((".", "_")))
            marked = sorted(p.name for p in Path(given).iterdir() if p.name.startswith("_") and p.is_file()
                            and p.stat().st_size > 0 and p.name not in DATASET_FILES
                            and not p.name.startswith(DATASET_PREFIXES))
            if marked:  # _SUCCESS is empty; a file of text named so is left out too, but not in silence
                log.warning("%s: left out %d file(s) named with a leading _ as Spark's markers are (%s); name them "
                            "to translate them", given, len(marked), ", ".join(marked[:3]))
            nested = [p for p in found if p.is_dir()]
            if nested:
                raise UserError(f"{nested[0]}: a directory inside the input directory {given}; name the files or "
                                "globs to translate")
            if not found:
                raise UserError(f"{given}: an input directory with no files")
            files += [str(p) for p in found]
        elif glob.has_magic(given) and not os.path.lexists(given):  # "br[1].txt" may be a file's own name
            matched = sorted(p for p in glob.glob(given) if Path(p).is_file())
            if not matched:
                raise UserError(f"{given}: no file matches this pattern")
            files += matched
        elif not os.path.lexists(given):  # plan's readers say it too; read_shards has none before Ray's
            raise UserError(f"{given}: no such file, directory or glob match")
        else:
            files.append(given)
    return files, dirs


def output_name(path: str, suffix: str | None = None) -> str:
    """DIR/<input name> as serve-batch names it (.gz dropped, the language suffix made `suffix`); a Parquet
    file's gets `suffix`, else .txt."""
    name = Path(path).name
    if name.endswith(PARQUET):
        return name[: name.rindex(".")] + (suffix or ".txt")
    return translated_name(name, suffix)


def plan(inputs: list[str], output_dir: str | Path, column: str, record: dict[str, Any], suffix: str | None = None,
         model_dir: str | Path | None = None, earlier: dict[int, dict[str, Any]] | None = None) -> Plan:
    """Every check before any work: inputs readable regular files (a Parquet file holding `column`; a pipe or a
    device would hang a reader or never end), outputs distinct and neither inputs nor inside `model_dir`, the
    output dir writable and made with the same model and options if it has outputs already (`record`; a rerun
    of the same command resumes, another refuses; a record an earlier version wrote is compared with what
    `earlier` says that version would have written for it). Leftover temps are removed."""
    files, dirs = expand(inputs)
    out_dir = Path(output_dir)
    outputs = [out_dir / output_name(f, suffix) for f in files]
    seen: dict[Path, str] = {}
    for f, out in zip(files, outputs):
        if out in seen:
            raise UserError(f"{f} and {seen[out]} would both be written to {out}; translate them in separate runs")
        seen[out] = f
    refuse_overwriting_inputs(files, outputs, input_dirs=dirs + ([str(model_dir)] if model_dir else []),
                              output_dirs=[out_dir])
    for f in files:
        if os.path.exists(f) and not os.path.isfile(f) and not os.path.isdir(f):
            raise UserError(f"{f}: not a regular file (a pipe, device or socket); a cluster reads files")
        if f.endswith(PARQUET):
            _check_parquet(f, column)
        else:
            open_binary(f).close()
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--output-dir {out_dir}: a file, not a directory; name a directory (made if missing)")
    out_dir.mkdir(parents=True, exist_ok=True)
    for out in outputs:
        check_output_file(out, "--output-dir")
    remove_stale_temps(out_dir)
    _check_record(out_dir, record, {out.name: _identity(f) for f, out in zip(files, outputs)}, earlier or {})
    shards = [Shard(i, os.path.abspath(f), out) for i, (f, out) in enumerate(zip(files, outputs))]
    todo = [s for s in shards if not s.output.exists()]  # an output exists only once complete (renamed)
    return Plan(shards, todo, [s for s in shards if s.output.exists()])


def _check_parquet(path: str, column: str) -> None:
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    try:
        schema = pq.read_schema(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise UserError(f"{path}: cannot read as Parquet ({e})") from None
    if column not in schema.names:
        raise UserError(f"{path}: no column {column!r} (it has: {', '.join(schema.names)}); pass --column NAME")
    problem = not_text(schema.field(column).type)
    if problem:
        raise UserError(f"{path}: column {column!r} {problem}; name a string column")


def not_text(kind: Any) -> str | None:
    """Why a Parquet column of this Arrow type is not source text (None: it is). Text is a string column, or
    one dictionary-encoded (pandas' `category`), or a column of nulls only (every row a blank line)."""
    import pyarrow as pa

    value = kind.value_type if pa.types.is_dictionary(kind) else kind
    if pa.types.is_null(value) or pa.types.is_string(value) or pa.types.is_large_string(value) or \
            getattr(pa.types, "is_string_view", lambda _: False)(value):
        return None
    return f"holds {kind}, not text"


def job_record(model_dir: str | Path, settings: dict[str, Any]) -> dict[str, Any]:
    """What a directory's outputs are made with: the model dir's manifest (its bytes' SHA-256: every file's
    hash is in it) and the options that change a translation."""
    manifest = Path(model_dir) / "manifest.json"
    digest = hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None
    return {"manifest_sha256": digest, **settings}


# records list the outputs they made; 2: the search as it runs (1, a record without a version: as asked); 3: the
# backend that runs ("auto" resolved) and sentence rules only where sentences are split
RECORD_VERSION = 3
# what a record holds besides what makes the translations (not option names: "format" is --format's)
_BOOKKEEPING = ("record_version", "outputs", "inputs")


def _identity(path: str) -> dict[str, Any]:
    """What tells one input from another, or from itself rewritten: its absolute path, size and mtime."""
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _check_record(out_dir: Path, record: dict[str, Any], sources: dict[str, dict[str, Any]],
                  earlier: dict[int, dict[str, Any]]) -> None:
    """Refuse outputs made otherwise: a record that differs while the dir holds an output it lists or one of
    these inputs' (replacing it would mix two jobs' outputs in one dir), these inputs' outputs without a
    record, or an output made from another input (`sources`: output name -> its input's identity; another file
    of the same name, or this one rewritten, would be skipped as done). A record of an earlier version is
    compared as that version wrote it (`earlier`, by version: a job started before an upgrade resumes). The
    record written lists every output of the dir's job and the input each was made from."""
    path = out_dir / RECORD
    outputs = list(sources)
    made = [name for name in outputs if (out_dir / name).exists()]
    listed: list[str] = []
    inputs: dict[str, Any] = {}
    if path.exists():
        try:
            before = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: the record of the job that wrote {out_dir} is unreadable ({e}); it cannot "
                            "tell whether the outputs there match this command: choose another --output-dir") from None
        listed = before.get("outputs", []) if isinstance(before, dict) else []
        if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
            listed = []
        inputs = before.get("inputs", {}) if isinstance(before, dict) else {}
        inputs = inputs if isinstance(inputs, dict) else {}
        for name in made:  # an output recorded with its input (records before this one hold none)
            if name in inputs and inputs[name] != sources[name]:
                was, now = inputs[name], sources[name]
                why = "another file" if was.get("path") != now["path"] else "the same file, changed since"
                change = f"size {was.get('size')} -> {now['size']}" if was.get("size") != now["size"] else \
                    "the same size, modified at another time" if was.get("mtime_ns") != now["mtime_ns"] else \
                    "the same size and time"
                raise UserError(f"{out_dir / name}: translated from {was.get('path')}, and {now['path']} is "
                                f"{why} ({change}); it would be skipped as done: "
                                "delete that output to translate it again, or choose another --output-dir")
        version = before.get("record_version", 1) if isinstance(before, dict) else RECORD_VERSION
        wanted = earlier.get(version, record) if version != RECORD_VERSION else record
        core = {k: v for k, v in before.items() if k not in _BOOKKEEPING} if isinstance(before, dict) else None
        same = core == wanted
        if not same and (made or any((out_dir / name).exists() for name in listed)):
            changed = sorted(k for k in set(core) | set(wanted) if core.get(k) != wanted.get(k)) \
                if core is not None else ["all"]
            raise UserError(f"{out_dir}: holds translations made with another model or options "
                            f"({', '.join(changed)} differ); rerun with the same ones to resume, or choose another "
                            "--output-dir")
        if not same:
            listed, inputs = [], {}
    elif made:
        raise UserError(f"{out_dir}: already holds outputs this command did not record; choose another "
                        "--output-dir")
    kept = {name: source for name, source in inputs.items() if name in listed and name not in sources}
    full = {**record, "record_version": RECORD_VERSION, "outputs": sorted(set(listed) | set(outputs)),
            "inputs": {**kept, **sources}}
    atomic_write_text(path, json.dumps(full, indent=1, sort_keys=True) + "\n")


def _empty_input(shard: Shard) -> bool:
    if shard.parquet:
        import pyarrow.parquet as pq

        return bool(pq.read_metadata(shard.path).num_rows == 0)
    return read_head(shard.path, 1) == b""


class ShardWriter:
    """Rows (shard, line, text, last) in any order to one output per shard: each written in line order as the
    lines before it arrive, and renamed into place once its last line is written. A line that comes twice or
    a shard left with a gap is an error; on any error every unfinished output is removed."""

    def __init__(self, shards: Iterable[Shard]):
        self.shards = {s.index: s for s in shards}
        self.next: dict[int, int] = {}                      # shard -> next line to write (0-based)
        self.pending: dict[int, dict[int, str]] = {}        # shard -> line -> text, arrived early
        self.last: dict[int, int] = {}                      # shard -> its last line, once seen
        self.open: dict[int, tuple[contextlib.ExitStack, IO[str]]] = {}
        self.done: set[int] = set()
        self.lines = 0

    def add(self, shard: int, line: int, text: str, last: bool) -> None:
        if shard in self.done or line < self.next.get(shard, 0) or line in self.pending.get(shard, {}):
            raise RuntimeError(f"{self.shards[shard].path}: line {line + 1} came back twice")
        if last:
            self.last[shard] = line
        self.pending.setdefault(shard, {})[line] = text
        self._flush(shard)

    def add_rows(self, shards: Iterable[int], lines: Iterable[int], texts: Iterable[str], last: Iterable[bool]
                 ) -> None:
        for row in zip(shards, lines, texts, last):
            self.add(int(row[0]), int(row[1]), str(row[2]), bool(row[3]))

    def _flush(self, shard: int) -> None:
        pending, start = self.pending[shard], self.next.get(shard, 0)
        end = start
        while end in pending:
            end += 1
        if end == start:
            return
        out = self._file(shard)
        out.write("".join(pending.pop(i) + "\n" for i in range(start, end)))
        self.next[shard] = end
        self.lines += end - start
        if self.last.get(shard) == end - 1:
            stack, _ = self.open.pop(shard)
            stack.close()  # fsync and rename into place
            self.done.add(shard)
            del self.pending[shard]

    def _file(self, shard: int) -> IO[str]:
        if shard not in self.open:
            stack = contextlib.ExitStack()
            self.open[shard] = (stack, stack.enter_context(atomic_output(self.shards[shard].output, "w")))
        return self.open[shard][1]

    def finish(self) -> None:
        """After the last row: a shard that produced no rows is an empty input (an empty output); one that
        started but never reached its last line lost rows, which is an error."""
        for index, shard in self.shards.items():
            if index in self.done:
                continue
            if index in self.next or self.pending.get(index) or not _empty_input(shard):
                raise RuntimeError(f"{shard.path}: rows after line {self.next.get(index, 0)} never came back")
            with atomic_output(shard.output, "w"):
                pass
            self.done.add(index)

    def abort(self, error: BaseException) -> None:
        """Remove every unfinished output's temp file."""
        for stack, _ in self.open.values():
            stack.__exit__(type(error), error, error.__traceback__)
        self.open.clear()

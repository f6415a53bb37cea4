"""Text files in and out: strict UTF-8 with file/line errors, .gz, atomic writes."""

from __future__ import annotations

import codecs
import contextlib
import gzip
import io
import os
import stat
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from model.atomic import atomic_write, check_can_create_in, descriptor_alias, is_special_file
from model.errors import UserError


def open_binary(path: str | Path) -> IO[bytes]:
    """Open a corpus file for reading bytes; '-' is stdin; '.gz' is decompressed."""
    path = check_input(path)
    if str(path) == "-":  # (a file named - is returned as its absolute path)
        return sys.stdin.buffer
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    return open(path, "rb")


def check_input(path: str | Path) -> Path:
    """The path of an input file that is there and not a directory (UserError naming it otherwise), checked
    without opening it (a named pipe is opened once, by its reader)."""
    if str(path) == "-":  # standard input
        if sys.stdin is None:  # `<&-`: Python sets it to None
            raise UserError("'-' reads standard input, which is closed; give an input file")
        return Path("-")
    given, path = path, Path(path)
    if str(path) == "-":  # ./-: a file named -, which Path() spells as standard input's name
        path = Path(os.path.abspath(given))
    if not path.exists():
        link = " (a symbolic link that leads nowhere, or back to itself)" if path.is_symlink() else ""
        raise UserError(f"{path}: no such file{link}")
    if path.is_dir():
        raise UserError(f"{path}: is a directory, expected a text file")
    return path


def read_head(path: str | Path, size: int) -> bytes:
    """The first `size` bytes of a text file (plain or .gz, decompressed); a file that cannot be read (a corrupt
    or truncated .gz among them) is a UserError naming it."""
    try:
        with open_binary(path) as f:
            return f.read(size)
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; a truncated stream raises EOFError
        raise UserError(f"{path}: cannot read ({e})") from None


class NotUtf8(UserError):
    """A file in another encoding (UTF-16), which no --invalid-utf8 repair would make text of."""


def decode_line(raw: bytes, path: str | Path, lineno: int, errors: str = "strict") -> str:
    """One line of bytes to str without its line end (\\n or \\r\\n; a \\r before it is the text's); invalid UTF-8
    names file and line. UTF-16 (a byte order mark starting the file, or a line of NUL bytes every other byte,
    whichever line it is) is a NotUtf8 naming the file and line; another NUL byte is not text: named too, or with
    errors="replace" made U+FFFD as invalid bytes are. A UTF-8 byte order mark starting the file is dropped (it
    is no text: kept, it lowered the BLEU of a reference's first line)."""
    # UTF-32's marks start as UTF-16's do: it was called UTF-16, with an iconv that made UTF-16 of it
    if lineno == 1 and raw.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        raise NotUtf8(f"{path}: is UTF-32 (its byte order mark), not UTF-8: convert it first (iconv -f UTF-32 -t "
                      "UTF-8)")
    bom = lineno == 1 and raw.startswith((b"\xff\xfe", b"\xfe\xff"))
    nuls = raw.count(b"\x00")
    if bom or nuls > 1 and nuls * 4 >= len(raw) and max(raw[0::2].count(0), raw[1::2].count(0)) >= 0.9 * nuls:
        why = "its byte order mark" if bom else f"line {lineno}: NUL bytes between its characters"
        raise NotUtf8(f"{path}: is UTF-16 ({why}), not UTF-8: convert it first (iconv -f UTF-16 -t UTF-8)")
    if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
    try:
        text = raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        if lineno == 1 and raw.startswith(b"\x1f\x8b"):  # gzip's magic: compressed, named otherwise
            raise UserError(f"{path}: is gzip-compressed but not named .gz: rename it FILE.gz, or gunzip it") from None
        raise UserError(
            f"{path}:{lineno}: invalid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r}); "
            "fix the file") from None
    if nuls:
        if errors != "replace":
            raise UserError(f"{path}:{lineno}: a NUL byte (byte {raw.index(0)}), which no text holds; is it a text "
                            "file? fix the file")
        text = text.replace("\x00", "\ufffd")
    text = text[:-1] if text.endswith("\n") else text
    return text[:-1] if text.endswith("\r") else text


MAX_LINE_BYTES = 1 << 20  # a line of a file read whole (a test set, references, calibration sentences)
SERVED_LINE_BYTES = 16 << 20  # a line serve-batch translates (its windows, ray-translate's rows): longer is no text
# a training corpus's line (one longer than any --max-len is dropped and counted after reading, pipeline/corpus/data.py)
CORPUS_LINE_BYTES = 256 << 20


def iter_lines(path: str | Path, errors: str = "strict", max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[str]:
    """Lines of a text file (plain, .gz or '-'), strictly decoded unless errors='replace'.

    Splits on b'\\n' only, so a stray U+2028 or form feed inside a line never shifts
    the alignment between parallel files. A line over `max_line_bytes` is a UserError naming the file and line,
    read no further: /dev/zero or a file without line ends was read until memory ran out (a MemoryError).
    """
    f = open_binary(path)
    try:
        try:
            lineno = 0
            while raw := f.readline(max_line_bytes + 1):
                lineno += 1
                if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                    check_line_ends([raw.decode("utf-8", "replace")], path)  # lines ended by CR alone: said so
                    raise UserError(f"{path}:{lineno}: a line of more than {_size(max_line_bytes)}, longer than any "
                                    "sentence: is it a text file with line ends?")
                yield decode_line(raw, path, lineno, errors)
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            raise UserError(f"{path}: cannot read ({e})") from None
    finally:
        if f is not sys.stdin.buffer:
            f.close()


def read_lines(path: str | Path, errors: str = "strict", max_line_bytes: int = MAX_LINE_BYTES) -> list[str]:
    """Every line of a text file (iter_lines), its line ends checked (check_line_ends)."""
    return check_line_ends(list(iter_lines(path, errors, max_line_bytes)), path)


def read_served_lines(path: str | Path) -> list[str]:
    """A file's lines as serve-batch translates them (bench --whole-process, --serve): split at \\n only, a lone
    CR kept in its line, each up to SERVED_LINE_BYTES."""
    return list(iter_lines(path, max_line_bytes=SERVED_LINE_BYTES))


def check_line_ends(lines: list[str], path: str | Path) -> list[str]:
    """`lines` unless their line ends were CR alone (classic Mac): lines end at \\n only, so such a file was one
    line of all its sentences (one pair of a corpus, one calibration or test line); a UserError naming it then."""
    inside = sum(line.count("\r") for line in lines)
    if inside and (len(lines) == 1 or inside > len(lines)):
        raise UserError(f"{path}: {inside} carriage returns inside its {len(lines)} line(s): are its lines ended "
                        "by CR alone (classic Mac)? convert them to \\n first (tr '\\r' '\\n')")
    return lines


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n} bytes"


class _WholeWrites(io.TextIOBase):
    """Standard output, each write taken whole or refused: CPython's text layer drops the rest of a large write
    that a pipe took only in part, its reader gone (`-o - | consumer` where the consumer quit: the end of the
    output was lost and the command said it wrote it, exit 0). Writing the bytes until every one is taken gets
    OutputClosed instead (pipeline/cli.py: exit 141, as a command killed by SIGPIPE)."""

    def __init__(self, text: bool) -> None:
        super().__init__()
        self.text = text

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        stream = sys.stdout
        if self.text:
            stream.flush()  # whatever print() left in the text layer goes first
            raw = memoryview(data.encode(stream.encoding, stream.errors or "strict"))
        else:
            raw = memoryview(data).cast("B")
        try:
            while raw:  # a blocking write takes less than all only when its reader went: the next one raises
                raw = raw[stream.buffer.write(raw):]
        except BrokenPipeError as e:
            raise OutputClosed("standard output was closed by its reader") from e
        return len(data)

    def flush(self) -> None:
        try:
            sys.stdout.flush()
        except BrokenPipeError as e:
            raise OutputClosed("standard output was closed by its reader") from e


class OutputClosed(Exception):
    """The reader of standard output went before all of it was written (`| head`)."""


@contextlib.contextmanager
def atomic_output(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """Write to a temp file beside `path` and rename it into place only on success.

    '-' writes to stdout. A crash or Ctrl-C leaves the old file (or none), never a
    truncated one.
    """
    if str(path) == "-":
        whole = _WholeWrites("b" not in mode)
        yield whole  # type: ignore[misc]
        whole.flush()
        return
    if "b" not in mode and str(path).endswith(".gz"):  # named .gz: gzip'd, as a .gz input is read
        with atomic_write(path, "wb", suffix=".part") as f, gzip.open(f, "wt", encoding="utf-8", newline="\n") as z:
            yield z
        return
    with atomic_write(path, mode, suffix=".part") as f:
        yield f


def refuse_overwriting_inputs(inputs: Sequence[str | Path], outputs: Sequence[str | Path], what: str = "output", *,
                              input_dirs: Sequence[str | Path] = (), output_dirs: Sequence[str | Path] = ()) -> None:
    """Refuse, before anything is read, an output that would destroy an input, under any
    spelling (./in.de, dir/../in.de) or through a symlink either way: an output file that is
    one of the inputs or lies inside an input directory (a directory read whole: every file in
    it is an input), and an output directory (replaced whole) that is, holds or lies inside one.
    A hard link to an input file is allowed: the atomic rename replaces only the output's
    directory entry, so the input's content survives under its own name."""
    real_inputs = {os.path.realpath(p): str(p) for p in inputs if str(p) != "-"}
    reads_stdin = any(str(p) == "-" for p in inputs)
    stdin = _stdio_file(0) if reads_stdin else None
    for name in real_inputs.values() if reads_stdin else ():
        # `--glossary /dev/stdin` beside '-': a pipe's lines went to the first read; a file redirected to '-' is
        # read whole by each, unless named as standard input itself (the glossary then meant '-')
        if _is_stdin(name) and (stdin is None or descriptor_alias(name)):
            raise UserError(f"{name} is standard input, which the input '-' reads too: one would take the other's "
                            "lines; give one of them as a file")
    stdout = _stdio_file(1) if any(str(p) == "-" for p in outputs) else None
    if stdout is not None:  # `-o - >> F` where F is read (named, or on stdin): its own translations read back
        read = {name: _identity(real) for real, name in real_inputs.items()} | {"'-' (standard input)": stdin}
        for name, identity in read.items():
            if identity == stdout:
                raise UserError(f"standard output is the input {name}: the {what} '-' would be read back and "
                                "translated again without end; write it elsewhere")
    for out in outputs:
        if str(out) == "-":
            continue
        same = real_inputs.get(os.path.realpath(out))
        if same is None and stdin is not None and _identity(out) == stdin:
            same = "'-' (standard input)"
        if same is not None:
            raise UserError(f"{out}: this {what} is the input {same}; writing it would destroy the input, "
                            "choose another path")
        for directory in input_dirs:
            if within(out, directory):
                raise UserError(f"{out}: this {what} lies inside the input directory {directory}; writing there "
                                "could replace its files, choose a path outside it")
    for out in output_dirs:
        for directory in input_dirs:
            if within(out, directory) or within(directory, out):
                raise UserError(f"{out}: this {what} overlaps the input directory {directory}; replacing it "
                                "would destroy the input, choose another path")
        for inp in inputs:
            if str(inp) != "-" and within(inp, out):
                raise UserError(f"{out}: this {what} holds the input {inp}; replacing it would destroy the input, "
                                "choose another path")


def _identity(path: str | Path) -> tuple[int, int] | None:
    """(device, inode) of an existing regular file, else None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def _is_stdin(path: str | Path) -> bool:
    """Whether `path` is what standard input reads (/dev/stdin, /proc/self/fd/0, or the file redirected to it)."""
    try:
        named, stdin = os.stat(path), os.fstat(0)
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (stdin.st_dev, stdin.st_ino)


def _stdio_file(fd: int) -> tuple[int, int] | None:
    """(device, inode) of the regular file on standard input (0) or output (1), else None (a pipe, a terminal,
    closed)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def within(path: str | Path, directory: str | Path) -> bool:
    """Whether `path` is `directory` or lies inside it, as written (symlinks kept) or resolved."""
    return any(os.path.commonpath([spell(path), spell(directory)]) == spell(directory)
               for spell in (os.path.abspath, os.path.realpath))


def check_output_file(path: str | Path, option: str, what: str | None = None, probed: set[Path] | None = None
                      ) -> None:
    """Fail fast, before a model is loaded: an output that is a directory, or whose
    directory cannot be written, is one line now rather than a traceback at the end. `what`: the output is
    this (a checkpoint), a file of its own: '-' is refused, not taken for standard output. `probed`: directories
    written to already by this check (a probe file synced per output: 7 ms each, 2,000 outputs 14 s)."""
    if str(path) == "-" and what is not None:  # it was written to a file named '-' in the current directory
        raise UserError(f"{option} -: {what} is a file, not standard output; give a file path")
    if str(path) == "-" and sys.stdout is None:  # `>&-`: Python sets it to None
        raise UserError(f"{option} - writes standard output, which is closed; give a file path")
    if str(path) == "-" or is_special_file(path):  # stdout; /dev/null or a FIFO, written through
        return
    if Path(path).is_symlink():  # written where the link leads (model.atomic.atomic_write): checked there
        path = Path(os.path.realpath(path))
    if str(path) in ("", "."):  # click makes '' (an unset shell variable, say) the current directory
        raise UserError(f"{option} is empty; give a file path")
    if str(path).endswith(os.sep):  # `-o newdir/` made a file named newdir
        raise UserError(f"{option} {path}: ends in {os.sep}, as a directory does; give a file path")
    if Path(path).is_dir():
        raise UserError(f"{path}: is a directory; {option} needs a file path")
    if probed is not None and Path(path).parent in probed:
        return
    try:
        check_can_create_in(Path(path).parent, option)
    except OSError as e:
        raise UserError(f"{e.filename}: cannot write {option} here ({e.strerror})") from None
    if probed is not None:
        probed.add(Path(path).parent)

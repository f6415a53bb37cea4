"""Held-out files that parity, export and tune-decoding read: a .gz that is not one or is cut short, invalid
UTF-8 and empty files are one line naming the file (and line), before any decoding; none is read as fewer
lines, replaced characters or an empty score."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from helpers import assert_one_line_error, run_cli_captured, write_lines

from runtime.errors import RuntimeUserError
from runtime.references import held_out_lines


@pytest.fixture()
def bad(tmp_path: Path) -> dict[str, Path]:
    files = {"not-gzip.gz": b"plain text\n", "cut.gz": gzip.compress(b"ab cd\n" * 50)[:20],
             "latin1.txt": "ab\nK\u00f6ln\n".encode("latin-1")}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return {name: tmp_path / name for name in files}


def test_held_out_lines_names_what_it_cannot_read(bad, tmp_path):
    good = write_lines(tmp_path / "good.txt", ["ab", "K\u00f6ln"])
    assert held_out_lines(good, good) == (["ab", "K\u00f6ln"], ["ab", "K\u00f6ln"])
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"ab\r\ncd\rx\n")  # split on \n only, as serve-batch splits: a lone \r stays in its line
    assert held_out_lines(crlf, crlf)[0] == ["ab", "cd\rx"]
    for name, says in (("not-gzip.gz", ": cannot read (Not a gzipped file"), ("cut.gz", ": cannot read (Compressed"),
                       ("latin1.txt", ":2: invalid UTF-8")):
        with pytest.raises(RuntimeUserError) as e:
            held_out_lines(bad[name], good)
        assert str(e.value).startswith(f"{bad[name]}{says}"), e.value


def test_parity_names_a_source_it_cannot_read(capsys, fp32_dir, bad, tmp_path):
    ref = write_lines(tmp_path / "ref.txt", ["x"])
    for name in ("not-gzip.gz", "cut.gz"):
        code, _, err = run_cli_captured(capsys, "parity", fp32_dir, "--src", bad[name], "--ref", ref)
        assert_one_line_error(code, err, f"{bad[name]}: cannot read")


def test_tune_decoding_refuses_empty_references(capsys, fp32_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, _, err = run_cli_captured(capsys, "tune-decoding", fp32_dir, "--src", empty, "--ref", empty)
    assert_one_line_error(code, err, f"{empty}: no reference line to score against")


def test_export_refuses_held_out_files_it_cannot_use(capsys, random_checkpoint, bad, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    for src, says in ((bad["cut.gz"], "cannot read"), (bad["latin1.txt"], ":2: invalid UTF-8"),
                      (empty, "no line pair with text on both sides")):
        code, _, err = run_cli_captured(capsys, "export", random_checkpoint, "--out", tmp_path / "m",
                                        "--reference-src", src, "--reference-tgt", src, "--no-tensorrt")
        assert code == 2 and says in err, err
        assert "Traceback" not in err and not (tmp_path / "m").exists()


@pytest.fixture()
def unlined(tmp_path: Path) -> dict[str, Path]:
    """A file of sentences ended by CR alone (classic Mac), and one line longer than any sentence (/dev/zero's
    kind: no line end in its first MiB)."""
    cr = tmp_path / "cr.txt"
    cr.write_bytes(b"Ein Hund.\rEine Katze.\rEin Haus.\r")
    endless = tmp_path / "endless.txt"
    endless.write_bytes(b"x" * (1 << 20) + b"y\n")
    big_cr = tmp_path / "big-cr.txt"  # CR-ended, over the line bound: still said to be CR-ended
    big_cr.write_bytes(b"Ein Hund.\r" * 120_000)
    return {"cr": cr, "endless": endless, "big_cr": big_cr}


def test_lines_ended_by_cr_alone_or_without_end_are_refused_where_held_out_lines_are_read(unlined, tmp_path):
    """parity, tune-decoding, export's calibration and --reference-src took a CR-only file as one line (one
    sentence of all its text: a score on 1 line, calibration on 1 sentence), and /dev/zero or a file without line
    ends was read until a MemoryError. Each is one error naming the file now; training refused CR-only already."""
    from export.options import CALIBRATION_LINES
    from pipeline.commands.export import calibration_lines
    from pipeline.textio import read_lines

    good = write_lines(tmp_path / "good.txt", ["Ein Hund.", "Eine Katze.", "Ein Haus."])
    for reader in (read_lines, lambda path: held_out_lines(path, good), lambda path: held_out_lines(good, path),
                   lambda path: calibration_lines(path, default=False)):
        with pytest.raises(Exception) as e:
            reader(unlined["cr"])
        assert str(e.value).startswith(f"{unlined['cr']}: 2 carriage returns inside its 1 line(s)"), e.value
        with pytest.raises(Exception) as e:
            reader(unlined["endless"])
        assert str(e.value).startswith(f"{unlined['endless']}:1: a line of more than 1 MiB"), e.value
        with pytest.raises(Exception, match="carriage returns inside its 1 line"):
            reader(unlined["big_cr"])
    if Path("/dev/zero").exists():  # read no further than its first MiB
        with pytest.raises(Exception, match="/dev/zero:1: a line of more than 1 MiB"):
            calibration_lines(Path("/dev/zero"), default=False)
    long = tmp_path / "long.txt"  # a calibration file of many lines is read only as far as it is used
    long.write_bytes(b"Ein Hund.\n" * (CALIBRATION_LINES + 5) + b"\xff not UTF-8, never read\n")
    assert len(calibration_lines(long, default=False).lines) == CALIBRATION_LINES


def test_parity_and_tune_refuse_a_cr_only_source(capsys, fp32_dir, unlined, tmp_path):
    good = write_lines(tmp_path / "good.txt", ["Ein Hund.", "Eine Katze.", "Ein Haus."])
    for command in ("parity", "tune-decoding"):
        code, _, err = run_cli_captured(capsys, command, fp32_dir, "--src", unlined["cr"], "--ref", good)
        assert_one_line_error(code, err, f"{unlined['cr']}: 2 carriage returns inside its 1 line(s)")


def test_a_corpus_line_longer_than_a_sentence_is_still_read_for_training(tmp_path):
    """Training drops (and counts) a line over --max-len after reading it: up to CORPUS_LINE_BYTES it is read."""
    from pipeline.corpus.data import read_parallel

    src = tmp_path / "train.de"
    src.write_bytes(b"Ein Hund.\n" + b"x" * (2 << 20) + b"\n")
    src_lines, _ = read_parallel(src, src)
    assert len(src_lines) == 2 and len(src_lines[1]) == 2 << 20


def test_bench_reads_a_file_as_serve_batch_does(tmp_path):
    """bench --whole-process and --serve time serve-batch on their files: a line serve-batch translates (2 MiB, a
    lone CR inside) is read, not refused by the bound on held-out lines."""
    from pipeline.textio import read_served_lines

    path = tmp_path / "long.txt"
    path.write_bytes(b"x" * (2 << 20) + b"\nab\rcd\n")
    lines = read_served_lines(path)
    assert [len(lines[0]), lines[1]] == [2 << 20, "ab\rcd"]

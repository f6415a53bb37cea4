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

"""Atomic writes: complete or absent, with the permissions a plain open() would give."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from model.checkpoint import atomic_torch_save
from model.errors import UserError
from pipeline.textio import atomic_output, check_output_file, refuse_overwriting_inputs


@pytest.fixture()
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_outputs_get_umask_permissions_not_owner_only(tmp_path, umask_022):
    with atomic_output(tmp_path / "out.txt") as f:
        f.write("line\n")
    atomic_torch_save({"x": torch.zeros(2)}, tmp_path / "ckpt.pt")
    for name in ("out.txt", "ckpt.pt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name


def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old\n")
    with pytest.raises(RuntimeError):
        with atomic_output(target) as f:
            f.write("half")
            raise RuntimeError("crash")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_refuse_overwriting_inputs_understands_directories(tmp_path):
    """An output inside a directory read whole, or a directory replaced whole that holds or lies in an
    input, is refused under any spelling; a neighbour whose name merely starts alike is not."""
    (tmp_path / "hf" / "sub").mkdir(parents=True)
    (tmp_path / "hf" / "vocab.json").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "hf")
    for out in ("hf/vocab.json", "hf/sub/../new.pt", "link/x.pt", "hf"):
        with pytest.raises(UserError, match="inside the input directory"):
            refuse_overwriting_inputs([], [tmp_path / out], input_dirs=[tmp_path / "hf"])
    refuse_overwriting_inputs([], [tmp_path / "hf2" / "x.pt", tmp_path / "x.pt"], input_dirs=[tmp_path / "hf"])
    for out_dir in ("hf", "link", "."):
        with pytest.raises(UserError, match="holds the input"):
            refuse_overwriting_inputs([tmp_path / "hf" / "vocab.json"], [], output_dirs=[tmp_path / out_dir])
        with pytest.raises(UserError, match="overlaps the input directory"):
            refuse_overwriting_inputs([], [], input_dirs=[tmp_path / "hf" / "sub"], output_dirs=[tmp_path / out_dir])
    refuse_overwriting_inputs([tmp_path / "hf" / "vocab.json"], [], output_dirs=[tmp_path / "hf" / "sub"])


def test_read_head_names_a_file_that_is_no_gzip_or_is_cut_short(tmp_path):
    import gzip

    from pipeline.textio import read_head

    good = tmp_path / "good.txt.gz"
    good.write_bytes(gzip.compress(b"ab cd\nef\n"))
    assert read_head(good, 4) == b"ab c"
    not_gzip, cut = tmp_path / "not.gz", tmp_path / "cut.gz"
    not_gzip.write_bytes(b"plain text\n")
    cut.write_bytes(gzip.compress(b"ab cd\n" * 100)[:20])
    with pytest.raises(UserError, match=rf"^{not_gzip}: cannot read \(Not a gzipped file"):
        read_head(not_gzip, 1)
    with pytest.raises(UserError, match=rf"^{cut}: cannot read \(Compressed file ended"):
        read_head(cut, 1 << 16)


def test_an_escaped_eof_error_is_a_bug_with_its_traceback_not_a_ctrl_c(monkeypatch, capsys):
    """click turns an EOFError that escapes a command into Abort, which main reported as Ctrl-C (exit 130)."""
    import pipeline.commands.doctor as doctor
    from pipeline.cli import main

    def cut_short(*args, **kwargs):
        raise EOFError("Compressed file ended before the end-of-stream marker was reached")

    monkeypatch.setattr(doctor, "gather_facts", cut_short)
    with pytest.raises(EOFError, match="Compressed file ended"):
        main(["doctor"])
    assert "interrupted" not in capsys.readouterr().err


def test_a_device_or_fifo_output_is_written_through_not_replaced(tmp_path):
    """`-o /dev/null` (here a link to it, so that a regression replaces the link, not the device) and a named
    pipe receive the output; the atomic temp-and-rename replaced them with a regular file."""
    import threading

    from model.atomic import atomic_write
    from pipeline.textio import atomic_output, check_output_file

    null = tmp_path / "null"
    null.symlink_to("/dev/null")
    check_output_file(null, "--output")
    with atomic_output(null) as f:
        f.write("discarded\n")
    assert os.readlink(null) == "/dev/null" and stat.S_ISCHR(os.stat(null).st_mode)
    assert not [p for p in tmp_path.iterdir() if p.name != "null"]  # no temp file left either

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    with atomic_write(fifo, "w") as f:
        f.write("through the pipe\n")
    reader.join(10)
    assert received == [b"through the pipe\n"] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_nul_byte_is_named_utf16_only_where_it_is_and_a_utf8_bom_is_dropped():
    """`ab\\0` and an ELF binary were called UTF-16 (iconv would have garbled them); NUL bytes in a longer line
    went to the model; a UTF-8 byte order mark stayed in a reference's first line (a lower BLEU)."""
    from pipeline.textio import NotUtf8, decode_line

    for raw in (b"ab\x00\n", b"\x00\n", b"\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x03\x00>\x00\n",
                b"der hund sieht die katze\x00 und das kind\n"):
        with pytest.raises(UserError, match=r"f:3: a NUL byte \(byte \d+\), which no text holds") as e:
            decode_line(raw, "f", 3)
        assert not isinstance(e.value, NotUtf8)
    assert decode_line(b"a\x00b\n", "f", 3, errors="replace") == "a\ufffdb"
    for raw in ("der hund\n".encode("utf-16-le"), "\nder hund".encode("utf-16-le")[1:]):
        with pytest.raises(NotUtf8, match="is UTF-16"):
            decode_line(raw, "f", 2)
    for codec, name in (("utf-32", "UTF-32"), ("utf-16", "UTF-16")):  # with their marks: UTF-32 was called UTF-16,
        with pytest.raises(NotUtf8, match=rf"^f: is {name} \(its byte order mark\), not UTF-8: convert it first "
                           rf"\(iconv -f {name} -t UTF-8\)$"):  # with an iconv that made UTF-16 of it
            decode_line("der hund\n".encode(codec), "f", 1)
    assert decode_line(b"\xef\xbb\xbfder hund\r\n", "f", 1) == "der hund"
    assert decode_line(b"\xef\xbb\xbfder hund\n", "f", 2) == "\ufeffder hund"  # inside the file: the text's


def test_writing_to_dev_stdout_shares_the_offset_of_what_the_process_prints(tmp_path):
    """`parity --json /dev/stdout > FILE`: the JSON went through a second open of the file, and the table the
    command printed afterwards, at its own offset 0, wrote over the JSON's start."""
    import subprocess
    import sys

    from helpers import cli_env

    stdout = tmp_path / "stdout"  # as /dev/stdout is (a regression would replace the real one with a file)
    stdout.symlink_to("/proc/self/fd/1")
    code = ("import sys\nfrom model.atomic import atomic_write\nprint('table before')\n"
            f"with atomic_write({str(stdout)!r}, 'w') as f:\n    f.write('{{\"json\": 1}}\\n')\nprint('table after')\n")
    out = tmp_path / "out.txt"
    for opened in ("wb", "ab"):  # `>` and `>>`
        out.write_text("kept\n")
        with open(out, opened) as stdout:
            subprocess.run([sys.executable, "-c", code], stdout=stdout, env=cli_env(), check=True, timeout=60)
        kept = "kept\n" if opened == "ab" else ""
        assert out.read_text() == kept + 'table before\n{"json": 1}\ntable after\n'


def test_outputs_in_one_directory_probe_it_once(tmp_path, monkeypatch):
    """serve-batch of 2,000 small files wrote and synced a probe file per output before the first line (7 ms
    each on the audit's disk, 14 s); each directory is probed once, and a second directory on its own."""
    from pipeline import textio
    from pipeline.serve_batch.files import check_outputs

    probes: list[str] = []
    real = textio.check_can_create_in
    monkeypatch.setattr(textio, "check_can_create_in", lambda d, o: (probes.append(str(d)), real(d, o))[1])
    (tmp_path / "b").mkdir()
    outputs = [str(tmp_path / f"{i}.en") for i in range(5)] + [str(tmp_path / "b" / "x.en")]
    check_outputs([str(tmp_path / "in.de")], outputs, "--output-dir")
    assert probes == [str(tmp_path), str(tmp_path / "b")]


def test_an_output_in_a_virtual_file_system_says_so():
    """`--out /proc/x` said "/proc: cannot write --out here (No such file or directory)" of a directory that is
    there: /proc takes no new files."""
    import errno
    import tempfile

    try:
        os.close(tempfile.mkstemp(dir="/proc")[0])
        pytest.skip("/proc takes files here")
    except OSError as e:
        if e.errno != errno.ENOENT:
            pytest.skip(f"/proc refuses files otherwise here ({e.strerror})")
    with pytest.raises(UserError, match=r"^/proc: cannot write --out here \(it takes no new files: a virtual file "):
        check_output_file("/proc/x.txt", "--out")


def test_a_gzip_file_not_named_gz_is_said_to_be_one(tmp_path):
    """It was "UP.GZ:1: invalid UTF-8 (byte 1: b'\\x8b')"."""
    import gzip

    from pipeline.textio import read_lines

    path = tmp_path / "train.GZ"
    path.write_bytes(gzip.compress(b"hallo\nwelt\n"))
    with pytest.raises(UserError, match=r"train.GZ: is gzip-compressed but not named .gz: rename it"):
        read_lines(path)

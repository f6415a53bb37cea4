"""serve-batch, parity and bench never destroy an input, and every user mistake or
environment fault (full disk, read-only dir, a directory as -o, a bad device, an empty
--src, Ctrl-C) is one line, never a traceback, and leaves no partial output behind."""

from __future__ import annotations

import gzip
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (
    FAST,
    assert_one_line_error,
    cli_env,
    dead_pid,
    make_parallel,
    pipeline_cmd,
    run_cli,
    run_pipeline,
    small_tmpfs,
)
from helpers import write_lines as write

pytest.importorskip("onnxruntime")


@pytest.fixture()
def model_dir(fp32_dir) -> Path:
    """The random checkpoint exported fp32 (conftest, shared read-only)."""
    return fp32_dir


# -- inputs are sacred -----------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["in.de", "./in.de", "sub/../in.de", "link.de"])
def test_output_that_is_the_input_is_refused_before_reading(model_dir, tmp_path, monkeypatch, capsys, spelling):
    inp = write(tmp_path / "in.de", ["der hund", "die katze"])
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.de").symlink_to(inp)
    before = inp.read_bytes()
    monkeypatch.chdir(tmp_path)
    assert run_cli("serve-batch", model_dir, "in.de", "-o", spelling, *FAST) == 2
    err = capsys.readouterr().err
    assert f"{spelling}: this output is the input in.de" in err
    assert inp.read_bytes() == before and (tmp_path / "link.de").is_symlink()


def test_symlinked_input_cannot_overwrite_its_target(model_dir, tmp_path, capsys):
    real = write(tmp_path / "real.de", ["der hund"])
    (tmp_path / "alias.de").symlink_to(real)
    assert run_cli("serve-batch", model_dir, tmp_path / "alias.de", "-o", real, *FAST) == 2
    assert "is the input" in capsys.readouterr().err and real.read_text() == "der hund\n"


def test_an_output_through_a_symlink_writes_what_it_names(model_dir, tmp_path):
    """-o LINK replaced the link by a file; -o /dev/stdout (a link to /proc/self/fd/1) > FILE left FILE empty, exit 0.
    Now the link's file is written (the link kept), and a descriptor's name is written into."""
    inp = write(tmp_path / "in.de", ["der hund", "die katze"])
    (tmp_path / "real").mkdir()
    real = write(tmp_path / "real" / "out.en", ["old"])
    (tmp_path / "link.en").symlink_to(real)
    assert run_cli("serve-batch", model_dir, inp, "-o", tmp_path / "link.en", *FAST) == 0
    assert (tmp_path / "link.en").is_symlink() and len(real.read_text().splitlines()) == 2
    (tmp_path / "dev").mkdir()  # /dev/stdout's own link, not the real one: the bug replaced it with a file
    (tmp_path / "dev" / "stdout").symlink_to("/proc/self/fd/1")
    (tmp_path / "dev" / "fd1").symlink_to("/dev/fd/1")
    for out in (tmp_path / "dev" / "stdout", tmp_path / "dev" / "fd1"):
        redirected = tmp_path / "redirected.en"
        with open(redirected, "wb") as stdout:
            proc = subprocess.run(pipeline_cmd("serve-batch", model_dir, inp, "-o", out, *FAST), stdout=stdout,
                                  stderr=subprocess.PIPE, env=cli_env(), timeout=300)
        assert proc.returncode == 0 and redirected.read_text() == real.read_text(), proc.stderr
    assert (tmp_path / "dev" / "stdout").is_symlink()
    (tmp_path / "afile").write_text("x\n")  # a link whose file cannot be made: refused where the link leads
    (tmp_path / "nowhere.en").symlink_to(tmp_path / "afile" / "out.en")
    code, err = run_pipeline("serve-batch", model_dir, inp, "-o", tmp_path / "nowhere.en", *FAST)
    assert_one_line_error(code, err, f"{tmp_path / 'afile'}: cannot write --output here")
    assert "loaded" not in err  # before the model


def test_standard_input_or_output_that_is_an_input_file_is_refused(model_dir, tmp_path):
    """`- -o F < F` replaced the input read on stdin; `F -o - >> F` translated its own output without end."""
    victim = write(tmp_path / "victim.de", ["der hund", "die katze"])
    before = victim.read_bytes()
    with open(victim, "rb") as stdin:
        proc = subprocess.run(pipeline_cmd("serve-batch", model_dir, "-", "-o", victim, *FAST), stdin=stdin,
                              capture_output=True, text=True, env=cli_env(), timeout=300)
    assert_one_line_error(proc.returncode, proc.stderr, "this output is the input '-' (standard input)")
    with open(victim, "ab") as stdout:
        proc = subprocess.run(pipeline_cmd("serve-batch", model_dir, victim, "-o", "-", *FAST), stdout=stdout,
                              stderr=subprocess.PIPE, text=True, env=cli_env(), timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr, f"standard output is the input {victim}")
    with open(victim, "rb") as stdin, open(victim, "ab") as stdout:  # `- -o - < F >> F`
        proc = subprocess.run(pipeline_cmd("serve-batch", model_dir, "-", "-o", "-", *FAST), stdin=stdin,
                              stdout=stdout, stderr=subprocess.PIPE, text=True, env=cli_env(), timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr, "standard output is the input '-' (standard input)")
    assert victim.read_bytes() == before


def test_a_glossary_on_standard_input_beside_the_input_dash_is_refused(model_dir, tmp_path):
    """`cat terms.tsv in.de | serve-batch - --glossary /dev/stdin`: the glossary took every line, 0 lines were
    translated, exit 0; `- --glossary /dev/stdin < in.de`: the input became a do-not-translate glossary."""
    glossary = write(tmp_path / "terms.tsv", ["hund\tdog"])
    inp = write(tmp_path / "in.de", ["der hund", "die katze"])
    out = tmp_path / "out.en"
    for stdin in (glossary.read_bytes() + inp.read_bytes(), None):
        with open(inp, "rb") as redirected:
            proc = subprocess.run(pipeline_cmd("serve-batch", model_dir, "-", "-o", out, "--glossary", "/dev/stdin",
                                               *FAST), input=stdin, stdin=None if stdin else redirected,
                                  capture_output=True, env=cli_env(), timeout=120)
        assert_one_line_error(proc.returncode, proc.stderr.decode(), "/dev/stdin is standard input, which the input "
                              "'-' reads too")
        assert not out.exists()
    with open(glossary, "rb") as redirected:  # a file redirected to '-' and named too: each reads it whole
        proc = subprocess.run(pipeline_cmd("serve-batch", model_dir, "-", "-o", out, "--glossary", glossary, *FAST),
                              stdin=redirected, capture_output=True, env=cli_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_glossary_is_an_input_and_a_replaced_output_keeps_its_permissions(model_dir, tmp_path, capsys):
    inp = write(tmp_path / "in.de", ["der hund"])
    glossary = write(tmp_path / "terms.tsv", ["hund\tdog"])
    assert run_cli("serve-batch", model_dir, inp, "-o", glossary, "--glossary", glossary, *FAST) == 2
    assert "terms.tsv: this output is the input" in capsys.readouterr().err
    assert glossary.read_text() == "hund\tdog\n"
    private = write(tmp_path / "private.en", ["old"])
    private.chmod(0o600)  # it was replaced by a file of the umask's mode (0644: readable by all)
    assert run_cli("serve-batch", model_dir, inp, "-o", private, *FAST) == 0
    assert private.stat().st_mode & 0o777 == 0o600 and private.read_text() != "old\n"


@pytest.mark.parametrize("closed, args, says", [
    ("<&-", ("-", "-o", "out.en"), "'-' reads standard input, which is closed"),
    (">&-", ("in.de", "-o", "-"), "--output - writes standard output, which is closed")])
def test_a_closed_standard_input_or_output_is_one_line(model_dir, tmp_path, closed, args, says):
    """serve-batch with stdin or stdout closed (`<&-`, `>&-`) ended in an AttributeError traceback."""
    write(tmp_path / "in.de", ["der hund"])
    proc = subprocess.run(["bash", "-c", f'exec "$@" {closed}', "_",
                           *pipeline_cmd("serve-batch", model_dir, *args, *FAST)],
                          cwd=tmp_path, stderr=subprocess.PIPE, text=True, env=cli_env(), timeout=300)
    assert_one_line_error(proc.returncode, proc.stderr, says)
    assert not (tmp_path / "out.en").exists()


def test_standard_output_whose_reader_quits_ends_the_run_quietly_not_as_written(model_dir, tmp_path):
    """`-o - | head -c 100`: the pipe took part of a window's translations, its reader went, and CPython's text layer
    dropped the rest without a word: "translated 4000 sentences", exit 0, most of them never written. Now the run
    ends as a command killed by SIGPIPE does (status 141, nothing on stderr), the summary unsaid."""
    write(tmp_path / "in.de", [f"der hund {i} sieht die katze" for i in range(4000)])  # > a pipe's 64 KiB out
    proc = subprocess.run(["bash", "-c", '"$@" 2>err.txt | head -c 100 >/dev/null; echo "${PIPESTATUS[0]}"', "_",
                           *pipeline_cmd("serve-batch", model_dir, "in.de", "-o", "-", *FAST, "--beam-size", "1")],
                          cwd=tmp_path, capture_output=True, text=True, env=cli_env(), timeout=300)
    err = (tmp_path / "err.txt").read_text()
    assert proc.stdout.strip() == "141", err
    assert "translated" not in err and "Traceback" not in err and "Exception ignored" not in err


def test_an_input_without_line_breaks_is_refused_not_read_whole(model_dir, tmp_path, capsys, monkeypatch):
    """serve-batch /dev/zero read one endless line until memory ran out (a MemoryError traceback)."""
    from pipeline.serve_batch import translation

    assert run_cli("serve-batch", model_dir, "/dev/zero", "-o", tmp_path / "z.en", *FAST) == 2
    assert "/dev/zero:1: a line of more than 16 MiB with no line break" in capsys.readouterr().err
    monkeypatch.setattr(translation, "MAX_LINE_BYTES", 20)
    fits = write(tmp_path / "fits.de", ["der hund", "x" * 20])  # 20 bytes and its line break: taken, as ray-translate
    assert run_cli("serve-batch", model_dir, fits, "-o", tmp_path / "fits.en", *FAST) == 0  # takes it (refused)
    over = write(tmp_path / "over.de", ["der hund", "x" * 21])
    assert run_cli("serve-batch", model_dir, over, "-o", tmp_path / "over.en", *FAST) == 2
    assert "over.de:2: a line of more than 0 MiB" in capsys.readouterr().err
    assert not (tmp_path / "z.en").exists() and not (tmp_path / "over.en").exists()


def test_outputs_named_as_a_user_means_them(model_dir, tmp_path, capsys):
    """-o out.gz wrote plain text that serve-batch itself then refused as "Not a gzipped file"; -o newdir/ made a
    file named newdir; --suffix with -o was ignored in silence."""
    inp = write(tmp_path / "in.de", ["der hund", "die katze"])
    assert run_cli("serve-batch", model_dir, inp, "-o", tmp_path / "out.en.gz", *FAST) == 0
    assert run_cli("serve-batch", model_dir, inp, "-o", tmp_path / "out.en", *FAST) == 0
    assert gzip.decompress((tmp_path / "out.en.gz").read_bytes()) == (tmp_path / "out.en").read_bytes()
    assert run_cli("serve-batch", model_dir, tmp_path / "out.en.gz", "-o", tmp_path / "again.de", *FAST) == 0
    capsys.readouterr()
    assert run_cli("serve-batch", model_dir, inp, "-o", f"{tmp_path / 'newdir'}/", *FAST) == 2
    assert "newdir/: ends in /, as a directory does; give a file path" in capsys.readouterr().err
    assert run_cli("serve-batch", model_dir, inp, "-o", tmp_path / "x.en", "--suffix", ".fr", *FAST) == 2
    assert "--suffix names the outputs of --output-dir" in capsys.readouterr().err
    assert not (tmp_path / "newdir").exists() and not (tmp_path / "x.en").exists()


def test_gz_input_as_its_own_output_is_refused(model_dir, tmp_path, capsys):
    inp = tmp_path / "in.de.gz"
    inp.write_bytes(gzip.compress(b"der hund\n"))
    before = inp.read_bytes()
    assert run_cli("serve-batch", model_dir, inp, "-o", inp, *FAST) == 2
    assert "is the input" in capsys.readouterr().err and inp.read_bytes() == before


@pytest.mark.parametrize("out_dir", [".", "sub/.."])
def test_output_dir_onto_an_input_is_refused(model_dir, tmp_path, monkeypatch, capsys, out_dir):
    plain = write(tmp_path / "a.de", ["der hund"])
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    assert run_cli("serve-batch", model_dir, "a.de", "--output-dir", out_dir, *FAST) == 2
    assert "is the input a.de" in capsys.readouterr().err and plain.read_text() == "der hund\n"


def test_hard_link_to_the_input_keeps_the_input(model_dir, tmp_path):
    """The atomic rename replaces the output's directory entry, not the shared inode."""
    inp = write(tmp_path / "in.de", ["der hund", "die katze"])
    os.link(inp, tmp_path / "out.de")
    assert run_cli("serve-batch", model_dir, inp, "-o", tmp_path / "out.de", *FAST) == 0
    assert inp.read_text() == "der hund\ndie katze\n"
    assert os.stat(inp).st_ino != os.stat(tmp_path / "out.de").st_ino
    assert len((tmp_path / "out.de").read_text().splitlines()) == 2


def test_parity_and_bench_outputs_never_replace_their_inputs(model_dir, tmp_path, capsys):
    src = write(tmp_path / "src.de", ["der hund"])
    ref = write(tmp_path / "ref.en", ["the dog"])
    assert run_cli("parity", model_dir, "--src", src, "--ref", ref, "--backends", "torch", "--json", ref) == 2
    assert "--json file is the input" in capsys.readouterr().err and ref.read_text() == "the dog\n"
    hyps = tmp_path / "hyps"
    hyps.mkdir()
    (hyps / "torch.fp32.txt").symlink_to(src)
    assert run_cli("parity", model_dir, "--src", src, "--ref", ref, "--backends", "torch", "--save-hyps", hyps) == 2
    assert "--save-hyps file is the input" in capsys.readouterr().err and src.read_text() == "der hund\n"
    assert run_cli("bench", model_dir, "--src", src, "--json", tmp_path / "." / "src.de") == 2
    assert "--json file is the input" in capsys.readouterr().err and src.read_text() == "der hund\n"


# -- one line, not a traceback ---------------------------------------------------------------


@pytest.mark.slow
def test_directory_as_output_is_one_line(model_dir, tmp_path):
    inp = write(tmp_path / "in.de", ["der hund"])
    (tmp_path / "out").mkdir()
    code, err = run_pipeline("serve-batch", model_dir, inp, "-o", tmp_path / "out", *FAST)
    assert_one_line_error(code, err, "out: is a directory")


@pytest.mark.slow
@pytest.mark.parametrize("device, says", [("gpu0", "use cpu, cuda or cuda:N"), ("cuda", "use --device cpu")])
def test_unusable_device_is_one_line(model_dir, tmp_path, device, says):
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    inp = write(tmp_path / "in.de", ["der hund"])
    code, err = run_pipeline("serve-batch", model_dir, inp, "-o", tmp_path / "o", *FAST, "--device", device)
    assert_one_line_error(code, err, f"--device {device}" if device == "cuda" else "--device 'gpu0'", says)
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_bench_on_an_empty_src_is_one_line(model_dir, tmp_path):
    empty = tmp_path / "empty.de"
    empty.write_text("\n\n")
    code, err = run_pipeline("bench", model_dir, "--src", empty, "--backends", "torch", "--sentences", "2")
    assert_one_line_error(code, err, "empty.de: has no non-blank line")


@pytest.mark.slow
def test_full_disk_is_one_line_and_leaves_nothing(model_dir, tmp_path):
    src, _ = make_parallel(200, seed=3)
    inp = write(tmp_path / "in.de", src * 10)  # 2,000 lines: far more output than 16 KiB
    with small_tmpfs(tmp_path / "disk", "16k") as disk:
        code, err = run_pipeline("serve-batch", model_dir, inp, "-o", disk / "out.en", *FAST, "--window", "500")
        assert_one_line_error(code, err, "out.en: no space left on device; free space and rerun")
        assert list(disk.iterdir()) == []


@pytest.mark.slow
def test_read_only_output_dir_fails_before_the_model_loads(tmp_path):
    inp = write(tmp_path / "in.de", ["der hund"])
    with small_tmpfs(tmp_path / "ro", "1m", readonly=True) as ro:
        # The model dir's manifest is unreadable: the output is checked before the model loads, so that is not
        # what we hear of (a dir that is no model dir at all is named first: its outputs are checked against it)
        broken = tmp_path / "broken-model"
        broken.mkdir()
        (broken / "manifest.json").write_text("{")
        code, err = run_pipeline("serve-batch", broken, inp, "-o", ro / "out.en", *FAST)
        assert_one_line_error(code, err, f"{ro}: cannot write --output here (Read-only file system)")


@pytest.mark.slow
@pytest.mark.parametrize("batches", [[], ["--threads", "2", "--parallel-batches", "2"]],
                         ids=["one-batch", "two-batches"])
def test_ctrl_c_in_the_middle_exits_130_leaving_nothing(model_dir, tmp_path, batches):
    """Also with two batches decoded at once: the running ones end, the waiting ones are dropped."""
    src, _ = make_parallel(200, seed=4)
    inp = write(tmp_path / "in.txt", src * 100)  # 20k lines: far longer than the wait below
    out = tmp_path / "out.txt"
    proc = subprocess.Popen(pipeline_cmd("serve-batch", model_dir, inp, "-o", out, "--window", "50", *FAST, *batches),
                            env=cli_env(), cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".out.txt.*")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()  # type: ignore[union-attr]
            time.sleep(0.05)
        time.sleep(0.5)  # some windows written to the temp file
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted (Ctrl-C)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


# -- leftovers and warnings --------------------------------------------------------------------


def test_temps_of_a_killed_run_are_removed_by_the_next(model_dir, tmp_path):
    inp = write(tmp_path / "in.de", ["der hund"])
    pid = dead_pid()
    stale = tmp_path / f".out.en.~pipeline-{pid}-abc123.part"
    stale.write_text("half a translation")
    live = tmp_path / f".out.en.~pipeline-{os.getpid()}-abc123.part"  # a live writer's: kept
    live.write_text("in progress")
    assert run_cli("serve-batch", model_dir, inp, "-o", tmp_path / "out.en", *FAST) == 0
    assert not stale.exists() and live.exists()
    assert (tmp_path / "out.en").is_file()


def test_min_len_above_a_lines_maximum_is_a_counted_warning(model_dir, tmp_path, caplog):
    # max output = floor(0.5 * source tokens + 1): a two-word line (about 3-5 tokens) gets at most 3,
    # below --min-len 4; a 12-word line gets 6 or more.
    inp = write(tmp_path / "in.de", ["der hund", "", "der hund sieht die katze und das kind hat ein rotes haus"])
    opts = ["--max-len-a", "0.5", "--max-len-b", "1", "--min-len", "4", "--no-progress", "--threads", "1"]
    with caplog.at_level(logging.WARNING):
        assert run_cli("serve-batch", model_dir, inp, "-o", tmp_path / "out.en", *opts) == 0
    warnings = [r.getMessage() for r in caplog.records if "below --min-len" in r.getMessage()]
    assert len(warnings) == 1 and "1 line(s)" in warnings[0], warnings
    assert len((tmp_path / "out.en").read_text().splitlines()) == 3

"""`pipeline serve-batch` end to end on a tiny exported model: line alignment with every
kind of bad input, order restored after length sorting, atomic outputs, stdin/stdout,
n-best format, and a 2-process torchrun run equal to the single-process one."""

from __future__ import annotations

import gzip
import io
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import cli_env, documents, make_parallel, pipeline_cmd, run_cli
from helpers import write_lines as write

from runtime.model_dir import LoadOptions, load
from runtime.translate import translate_lines

pytest.importorskip("onnxruntime")

FAST = ["--max-len-a", "0", "--max-len-b", "6", "--no-progress", "--threads", "1"]


@pytest.fixture()
def model_dir(trained_model_dir) -> Path:
    """The tiny trained model (lines get different translations), exported with a source limit that
    long lines are easy to exceed: conftest's trained_model_dir."""
    return trained_model_dir


def reference(model_dir: Path, lines: list[str], backend: str = "onnxruntime", **opts) -> list[str]:
    """Each line translated alone through the library (no windows, no sorting)."""
    loaded = load(model_dir, LoadOptions(backend=backend))
    impl, tok = loaded.backend, loaded.tokenizer
    opts = {"beam_size": 4, "max_len_a": 0.0, "max_len_b": 6, **opts}
    return [translate_lines(impl, tok, [line], **opts)[0] for line in lines]


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_order_restored_after_length_sorting(model_dir, tmp_path, backend):
    src, _ = make_parallel(23, seed=11)
    inp = write(tmp_path / "in.txt", src)
    out = tmp_path / "out.txt"
    # Small windows and batches: many sorted batches per window, several windows.
    assert run_cli("serve-batch", model_dir, inp, "--output", out, "--backend", backend,
                   "--window", 7, "--batch-tokens", 60, *FAST) == 0
    got = out.read_text(encoding="utf-8").split("\n")
    assert got[-1] == "" and len(got) - 1 == len(src)
    assert got[:-1] == reference(model_dir, src, backend)
    assert len(set(got[:-1])) > 5  # the lines really differ, so a shuffle would show


def test_bad_input_stays_line_aligned(model_dir, tmp_path, caplog, capsys):
    long_line = " ".join(["der hund sieht die katze"] * 12)
    lines = ["der hund", "", "   \t", long_line, "eine frau hat ein rotes haus", "ein kind"]
    raw = "\n".join(lines).encode() + b"\ndie \xff\xfe katze\nder mann\n"
    inp = tmp_path / "in.txt"
    inp.write_bytes(raw)
    out = tmp_path / "out.txt"
    assert run_cli("serve-batch", model_dir, inp, "-o", out, "--invalid-utf8", "replace", "--window", 3,
                   *FAST) == 0
    got = out.read_text(encoding="utf-8").split("\n")[:-1]
    assert len(got) == 8
    assert got[1] == "" and got[2] == ""
    assert all(got[i] for i in (0, 3, 4, 5, 6, 7))
    normal = [0, 4, 5, 7]
    assert [got[i] for i in normal] == reference(model_dir, [(lines + ["", "der mann"])[i] for i in normal])
    assert got[6] == reference(model_dir, ["die \ufffd\ufffd katze"])[0]
    assert got[3] == reference(model_dir, [long_line])[0]  # truncated to the same source-limit tokens
    text = caplog.text
    assert "1 line(s) longer than the model's source limit were truncated" in text
    assert "1 line(s) had invalid UTF-8 or a NUL byte, replaced by U+FFFD" in text  # a NUL is repaired so too
    summary = capsys.readouterr().err
    assert "translated 6 sentences" in summary and "target tokens/s" in summary  # the two blank lines are not
    assert "backend onnxruntime, device cpu" in summary
    # as documents the long sentence is cut into sentences that fit: every word translated, and said as plain mode
    # says a truncation (it was silent; the summary counted the pieces as sentences)
    caplog.clear()
    for mode in (["--split", "sentences"], ["--format", "html"]):
        assert run_cli("serve-batch", model_dir, inp, "-o", out, "--invalid-utf8", "replace", *mode, *FAST) == 0
        assert "1 line(s) held a sentence longer than the model's source limit, translated in pieces" in caplog.text
        assert "were truncated" not in caplog.text
        caplog.clear()


def test_invalid_utf8_names_file_and_line_and_writes_nothing(model_dir, tmp_path, capsys):
    src, _ = make_parallel(6, seed=3)
    inp = tmp_path / "in.txt"
    inp.write_bytes(("\n".join(src[:4]) + "\nbad \xff line\n" + src[4] + "\n").encode("latin-1"))
    out = tmp_path / "out.txt"
    out.write_text("previous complete translation\n")
    # window 2: two windows are translated and written to the temp file before the error
    assert run_cli("serve-batch", model_dir, inp, "-o", out, "--window", 2, *FAST) == 2
    err = capsys.readouterr().err
    assert f"{inp}:5: invalid UTF-8" in err and "--invalid-utf8 replace" in err
    assert "Traceback" not in err
    assert out.read_text() == "previous complete translation\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]  # no temp file left


def test_long_lines_error_option(model_dir, tmp_path, capsys):
    inp = write(tmp_path / "in.txt", ["der hund", " ".join(["die katze"] * 30)])
    out = tmp_path / "out.txt"
    assert run_cli("serve-batch", model_dir, inp, "-o", out, "--long-lines", "error", *FAST) == 2
    err = capsys.readouterr().err
    assert f"{inp}:2:" in err and "--long-lines truncate" in err
    assert not out.exists()


def test_output_dir_several_inputs_and_gz(model_dir, tmp_path, capsys):
    a, _ = make_parallel(5, seed=1)
    b, _ = make_parallel(4, seed=2)
    inp_a = write(tmp_path / "a.de", a)
    inp_b = tmp_path / "b.de.gz"
    with gzip.open(inp_b, "wt", encoding="utf-8") as f:
        f.write("\n".join(b) + "\n")
    out_dir = tmp_path / "out"
    assert run_cli("serve-batch", model_dir, inp_a, inp_b, "--output-dir", out_dir, *FAST) == 0
    assert (out_dir / "a.de").read_text().splitlines() == reference(model_dir, a)
    assert (out_dir / "b.de").read_text().splitlines() == reference(model_dir, b)
    assert run_cli("serve-batch", model_dir, inp_a, inp_b, "--output", tmp_path / "x", *FAST) == 2
    assert "--output takes one input" in capsys.readouterr().err


def test_stdin_to_stdout_and_nbest(model_dir, tmp_path, monkeypatch, capsys):
    src, _ = make_parallel(4, seed=5)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(("\n".join(src) + "\n\n").encode())))
    assert run_cli("serve-batch", model_dir, "-", "-o", "-", "--beam-size", 3, "--nbest", 2, *FAST) == 0
    lines = capsys.readouterr().out.split("\n")[:-1]
    assert len(lines) == 5 and lines[4] == " ||| 0.0000"  # a blank line: one empty hypothesis, as over HTTP
    loaded = load(model_dir, LoadOptions(backend="onnxruntime"))
    impl, tok = loaded.backend, loaded.tokenizer
    from runtime.translate import translate_ids
    ids = tok.encode_source(src)
    hyps = translate_ids(impl, ids, beam_size=3, nbest=2, max_len_a=0.0, max_len_b=6)
    for line, nbest in zip(lines, hyps):
        fields = line.split(" ||| ")
        assert len(fields) == 4
        assert fields[0::2] == tok.decode([h.tokens for h in nbest])
        assert [float(x) for x in fields[1::2]] == pytest.approx([h.score for h in nbest], abs=1e-4)
        assert float(fields[1]) >= float(fields[3])


def test_user_errors_are_one_line(model_dir, tmp_path, capsys):
    inp = write(tmp_path / "in.txt", ["der hund"])
    assert run_cli("serve-batch", tmp_path / "nope", inp, "-o", tmp_path / "o") == 2
    assert "no such model directory" in capsys.readouterr().err
    assert run_cli("serve-batch", model_dir, inp, "-o", tmp_path / "o", "--backend", "tensorrt") == 2
    assert "no TensorRT engines (export skipped them: --no-tensorrt)" in capsys.readouterr().err
    assert run_cli("serve-batch", model_dir, tmp_path / "missing.txt", "-o", tmp_path / "o") == 2
    assert "missing.txt: no such file" in capsys.readouterr().err
    assert run_cli("serve-batch", model_dir, inp, "-o", tmp_path / "o", "--beam-size", 9) == 2
    assert "top-16" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_torchrun_two_ranks_equal_one_process(model_dir, tmp_path):
    src, _ = make_parallel(31, seed=9)
    src[7] = ""
    inp = write(tmp_path / "in.txt", src)
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    assert run_cli("serve-batch", model_dir, inp, "-o", one, "--window", 10, *FAST) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "pipeline", "serve-batch", str(model_dir), str(inp), "-o", str(two), "--window", "10",
           *FAST]
    proc = subprocess.run(cmd, env=cli_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert two.read_text() == one.read_text()
    assert "translated 30 sentences" in proc.stderr and "2 ranks" in proc.stderr  # line 8 is blank


@pytest.mark.slow
def test_torchrun_says_a_glossary_once_and_a_bad_one_in_one_line(model_dir, tmp_path):
    """Under torchrun rank 0 alone read the glossary: a bad one was its one line beneath rank 1's traceback (a
    gloo "Connection closed by peer"), and rank 1 warned "0 found in the input" of a glossary it never read."""
    inp = write(tmp_path / "in.txt", make_parallel(6, seed=9)[0])
    for content, ok in (("zzqx\tdog\n", True), ("Hund\t\u2581dog\n", False)):
        glossary = tmp_path / "terms.tsv"
        glossary.write_text(content, encoding="utf-8")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "pipeline", "serve-batch", str(model_dir), str(inp), "-o", str(tmp_path / "out.txt"), "--glossary",
               str(glossary), *FAST]
        proc = subprocess.run(cmd, env=cli_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
        # a traceback through our code (torchrun's launcher prints its own of a rank that failed: not ours)
        ours = re.search(r'File "[^"]*/(pipeline|runtime|model|export)/', proc.stderr)
        assert (proc.returncode == 0) == ok and not ours and "closed by peer" not in proc.stderr, proc.stderr[-3000:]
        if ok:
            assert proc.stderr.count("the glossary's terms: 0 found in the input") == 1, proc.stderr[-3000:]
        else:
            assert proc.stderr.count(f"error: {glossary}:1:") == 2, proc.stderr[-3000:]  # each rank's one line


@pytest.mark.slow
def test_killed_run_leaves_no_output_and_no_temp_file(model_dir, tmp_path):
    src, _ = make_parallel(200, seed=4)
    inp = write(tmp_path / "in.txt", src * 100)  # 20k lines: far longer than the wait below
    out = tmp_path / "out.txt"
    proc = subprocess.Popen(pipeline_cmd("serve-batch", model_dir, inp, "-o", out, "--window", "50", *FAST),
                            env=cli_env(), cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".out.txt.*")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        time.sleep(0.5)  # some windows written to the temp file
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) != 0
    finally:
        proc.kill()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_split_sentences_translates_sentence_by_sentence_keeping_whitespace(model_dir, tmp_path, capsys):
    from runtime.sentences import split_sentences

    docs = documents()
    out = tmp_path / "out.txt"
    assert run_cli("serve-batch", model_dir, write(tmp_path / "in.txt", docs), "-o", out, "--split", "sentences",
                   "--window", 2, *FAST) == 0
    got = out.read_text(encoding="utf-8").split("\n")[:-1]
    splits = [split_sentences(d, "en") for d in docs]
    assert [len(s.sentences) for s in splits] == [4, 0, 0, 1, 3, 4]
    expected = [s.rebuild(reference(model_dir, s.sentences)) for s in splits]
    assert got == expected
    assert got[1:3] == ["", " \t "] and got[3].startswith("  ") and got[3].endswith(" ")
    assert "translated 12 sentences" in capsys.readouterr().err
    assert run_cli("serve-batch", model_dir, tmp_path / "in.txt", "-o", out, "--split", "sentences",
                   "--nbest", 2, "--beam-size", 2, *FAST) == 2
    assert "--split sentences" in capsys.readouterr().err


def test_progress_bar_only_on_a_terminal(model_dir, tmp_path, capsys, monkeypatch):
    """The bar is on by default, but a log or a pipe gets no carriage-return redraws (and the process does not
    pay tqdm's import); on a terminal it is drawn."""
    from pipeline.serve_batch import files

    inp = write(tmp_path / "in.txt", ["ein Hund läuft", "zwei Männer"])
    args = ["serve-batch", model_dir, inp, "-o", tmp_path / "out.txt", *[a for a in FAST if a != "--no-progress"]]
    assert run_cli(*args) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "lines/s" not in err, err
    assert "2 lines" in err or "2 sentences" in err, err  # the summary line is still there

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = files.progress_bar("in.txt", True)
    bar.close()
    assert type(bar).__name__ == "tqdm" and type(files.progress_bar("in.txt", False)).__name__ == "_NoBar"


def test_a_pipe_input_on_a_terminal_is_read_once_by_the_translation(model_dir, tmp_path, capsys, monkeypatch):
    """With stderr on a terminal, the progress bar counted a named pipe's (or <(...)'s) lines by reading it to
    the end first: the translation then found nothing (exit 0, an empty output) or waited for ever."""
    import os
    import threading

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    lines = [f"der hund {i}" for i in range(40)]
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("".join(line + "\n" for line in lines)))
    writer.start()
    monkeypatch.setattr(sys, "stderr", Terminal())
    codes: list[int] = []
    run = threading.Thread(target=lambda: codes.append(run_cli(
        "serve-batch", model_dir, fifo, "-o", tmp_path / "out.txt", *[a for a in FAST if a != "--no-progress"])))
    run.start()
    run.join(120)
    if run.is_alive():  # waiting for a writer that has gone: give it an end of file
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        run.join(60)
    writer.join(10)
    assert codes == [0]
    assert (tmp_path / "out.txt").read_text().count("\n") == len(lines)


def test_output_names_and_encodings_a_user_can_get_wrong(model_dir, tmp_path, capsys):
    """--output-dir '' (an unset variable) wrote into the current directory; an input named .gz became a file
    named like the output dir; UTF-16 was translated as garbage (with --invalid-utf8 replace "1 line had invalid
    UTF-8"); a \\r that is the text's, before a line's \\r\\n, was dropped."""
    (tmp_path / "in").mkdir()
    plain = write(tmp_path / "in" / "a.de", ["der hund"])
    assert run_cli("serve-batch", model_dir, plain, "--output-dir", "", *FAST) == 2
    assert "'--output-dir': is an empty path" in capsys.readouterr().err
    gz_named = tmp_path / "in" / ".gz"
    gz_named.write_text("der hund\n")
    assert run_cli("serve-batch", model_dir, gz_named, "--output-dir", tmp_path / "out", "--suffix", "en", *FAST) == 0
    assert (tmp_path / "out").is_dir() and [p.name for p in (tmp_path / "out").iterdir()] == [".gz.en"]
    nul = "NUL bytes between its characters"
    for name, data, why in [("bom.de", "der hund\n".encode("utf-16"), "its byte order mark"),
                            ("le.de", "der hund\nein kind\n".encode("utf-16-le"), f"line 1: {nul}"),
                            ("blank.de", "\nder hund\n".encode("utf-16-le"), f"line 2: {nul}")]:
        (tmp_path / name).write_bytes(data)
        assert run_cli("serve-batch", model_dir, tmp_path / name, "-o", tmp_path / "x.en", "--invalid-utf8",
                       "replace", *FAST) == 2
        assert f"{tmp_path / name}: is UTF-16 ({why}), not UTF-8" in capsys.readouterr().err
        assert not (tmp_path / "x.en").exists()
    cr = tmp_path / "cr.de"
    cr.write_bytes(b"der hund\r\r\nein kind\r\n")
    assert run_cli("serve-batch", model_dir, cr, "-o", tmp_path / "cr.en", "--split", "sentences", *FAST) == 0
    got = (tmp_path / "cr.en").read_bytes().split(b"\n")
    assert len(got) == 3 and got[0].endswith(b"\r") and not got[1].endswith(b"\r")


def test_warnings_and_the_summary_count_lines_not_sentences(model_dir, tmp_path, caplog, capsys):
    """With --split sentences a line of three long sentences was "3 line(s) ... truncated", blank lines were
    counted as translated sentences, and a line's sentences each counted against --min-len. A sentence longer
    than the model takes is cut into sentences that fit now, none truncated: --long-lines error counts lines."""
    long = " ".join(["der hund sieht die katze"] * 12)
    inp = write(tmp_path / "in.txt", [f"{long}. {long}. {long}.", "", "der hund. die katze. ein kind.", "12. 34."])
    assert run_cli("serve-batch", model_dir, inp, "-o", tmp_path / "out.txt", "--split", "sentences",
                   "--min-len", 8, "--max-len-a", 0.3, "--max-len-b", 5, "--no-progress", "--threads", 1) == 0
    assert "truncated" not in caplog.text
    assert "1 line(s) have a maximum output length" in caplog.text  # the short sentences' line
    err = capsys.readouterr().err
    found = re.search(r"translated (\d+) sentences", err)
    assert found and int(found.group(1)) > 6, err  # 3 long ones cut to fit, + 3; the blank line and "12." "34." not


def test_no_bar_is_drawn_over_translations_written_to_the_terminal(model_dir, tmp_path, monkeypatch):
    """`serve-batch in -o -` on a terminal joined the bar and the first line of a window ("446.00 lines/s]san
    jujea ..."): the bar is left out when the translations go to the terminal, and drawn when they go to a file."""
    from pipeline.serve_batch import files
    from pipeline.serve_batch.translation import ServeBatchOptions

    drawn: list[bool] = []
    real = files.progress_bar
    monkeypatch.setattr(files, "progress_bar", lambda desc, on, total=None: (drawn.append(on), real(desc, False))[1])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    loaded = load(model_dir, LoadOptions(backend="onnxruntime", threads=1))
    src = write(tmp_path / "in.txt", ["der hund"])
    for out, bar in ((Terminal(), False), (io.StringIO(), True)):
        files.translate_stream(loaded.backend, loaded.tokenizer, str(src), out, ServeBatchOptions())
        assert drawn.pop() is bar and out.getvalue().count("\n") == 1


def test_a_failing_input_says_which_outputs_were_written(model_dir, tmp_path, caplog):
    """Of three inputs the second refused (invalid UTF-8): only its error was said, while the first's output was
    written and the third's not; the outputs that are whole are named, and nothing is said when none is."""
    (tmp_path / "in").mkdir()
    first = write(tmp_path / "in" / "1.de", ["der hund"])
    (tmp_path / "in" / "2.de").write_bytes(b"die \xff katze\n")
    third = write(tmp_path / "in" / "3.de", ["ein kind"])
    out = tmp_path / "out"
    assert run_cli("serve-batch", model_dir, first, tmp_path / "in" / "2.de", third, "--output-dir", out, *FAST) == 2
    assert (out / "1.de").exists() and not (out / "2.de").exists() and not (out / "3.de").exists()
    assert f"1 of 3 inputs were translated, their outputs complete (the last: {out / '1.de'}); " in caplog.text
    caplog.clear()
    assert run_cli("serve-batch", model_dir, tmp_path / "in" / "2.de", third, "--output-dir", out, *FAST) == 2
    assert "inputs were translated" not in caplog.text

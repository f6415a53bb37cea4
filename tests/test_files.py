"""model.atomic.atomic_write, the one atomic write behind checkpoints, outputs, reports,
the manifest and the TensorRT timing cache: fsync'd file and directory, umask
permissions, and nothing left behind when the write fails."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from export import tensorrt_build
from model.atomic import atomic_write, atomic_write_bytes, atomic_write_text
from model.checkpoint import atomic_torch_save
from pipeline.textio import atomic_output


@pytest.fixture()
def synced(monkeypatch) -> list[tuple[str, int, bytes | None]]:
    """Every os.fsync as (kind, inode, file content then), still really syncing."""
    calls: list[tuple[str, int, bytes | None]] = []
    real = os.fsync

    def spy(fd: int) -> None:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            calls.append(("dir", st.st_ino, None))
        else:
            calls.append(("file", st.st_ino, os.pread(fd, st.st_size, 0)))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return calls


@pytest.fixture()
def umask_027():
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


WRITERS = {
    "atomic_write_bytes": lambda p: atomic_write_bytes(p, b"payload"),
    "atomic_write_text": lambda p: atomic_write_text(p, "payload"),
    "atomic_output": lambda p: _write_via(atomic_output(p, "wb"), b"payload"),
    "atomic_torch_save": lambda p: atomic_torch_save({"x": torch.arange(3)}, p),
}


def _write_via(ctx, data) -> None:
    with ctx as f:
        f.write(data)


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_file_then_directory_are_fsynced_before_return(tmp_path, synced, writer):
    target = tmp_path / "sub" / "out.bin"
    target.parent.mkdir()
    WRITERS[writer](target)
    final = target.read_bytes()
    kinds = [k for k, _, _ in synced]
    assert kinds == ["file", "dir"], kinds
    # The file synced is the one now at `target`, complete; the directory is its parent.
    assert synced[0][1] == target.stat().st_ino and synced[0][2] == final
    assert synced[1][1] == target.parent.stat().st_ino


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_usual_permissions_under_the_umask(tmp_path, umask_027, writer):
    target = tmp_path / "out.bin"
    WRITERS[writer](target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # 0666 & ~027, not mkstemp's 0600


def test_exception_leaves_the_old_file_and_no_temp(tmp_path, synced):
    target = tmp_path / "out.txt"
    target.write_text("old\n")
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(target, "w") as f:
            f.write("half")
            raise KeyboardInterrupt
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    assert synced == []


def test_a_failed_replace_names_the_path_not_the_temp_file(tmp_path):
    """os.replace(temp, path) fails naming the temp file first: `demo --out` holding a directory test.hyp said
    ".test.hyp.~pipeline-3060.15bc72ff-zlpdd2ba.part: is a directory"."""
    from pipeline.cli import describe_os_error

    (tmp_path / "out.txt").mkdir()
    with pytest.raises(OSError) as info, atomic_write(tmp_path / "out.txt", "w") as f:
        f.write("x")
    assert describe_os_error(info.value).startswith(f"{tmp_path / 'out.txt'}: is a directory")
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_text_mode_is_utf8_with_unix_newlines(tmp_path):
    target = tmp_path / "t.txt"
    with atomic_write(target, "w") as f:
        f.write("ä\n")
    assert target.read_bytes() == "ä\n".encode()
    with pytest.raises(ValueError, match="write mode"):
        with atomic_write(target, "r"):
            pass


def test_timing_cache_is_written_atomically(tmp_path, synced, umask_027):
    """The TensorRT builder's cache goes through the same write (the builder itself needs a GPU)."""
    class Blob:  # what TensorRT's ITimingCache.serialize() returns: a buffer
        def serialize(self) -> memoryview:
            return memoryview(b"timings")

    class Config:
        def get_timing_cache(self) -> Blob:
            return Blob()

    path = tmp_path / "cache" / "tensorrt-10.timing-cache"
    tensorrt_build._save_timing_cache(Config(), path)
    assert path.read_bytes() == b"timings" and [k for k, _, _ in synced] == ["file", "dir"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert sorted(p.name for p in Path(path.parent).iterdir()) == [path.name]


def test_stale_temps_of_dead_processes_are_removed(tmp_path):
    import subprocess
    import sys

    from model.atomic import make_temp_dir, remove_stale_temps, temp_prefix

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    stale_file = tmp_path / f".checkpoint_00000010.pt.~pipeline-{dead_pid}-abc.tmp"
    stale_file.write_bytes(b"x" * 100)
    stale_dir = tmp_path / f".model.~pipeline-{dead_pid}-partial-xyz"
    (stale_dir / "sub").mkdir(parents=True)
    mine = tmp_path / f"{temp_prefix('out.txt')}live.part"
    mine.write_text("being written")
    live_dir = make_temp_dir(tmp_path, "model", "partial")
    user_files = [tmp_path / ".hidden", tmp_path / "notes.~pipeline-1-x", tmp_path / "checkpoint_00000010.pt"]
    for f in user_files:
        f.write_text("user data")

    removed = remove_stale_temps(tmp_path)

    assert sorted(removed) == sorted([stale_file, stale_dir])
    assert not stale_file.exists() and not stale_dir.exists()
    assert mine.exists() and live_dir.is_dir()
    assert all(f.read_text() == "user data" for f in user_files)
    assert remove_stale_temps(tmp_path / "missing") == []


def test_temps_of_another_host_or_container_are_never_taken_for_stale(tmp_path, caplog):
    """A run in another PID namespace (a container writing to a shared volume) has process ids this one cannot
    check: its live temp was deleted as a dead run's, and that run failed at its end. Temps name their host and
    namespace; another's are kept and counted, this one's dead ones still go."""
    import logging
    import subprocess
    import sys

    from model.atomic import HERE, remove_stale_temps, restore_replaced_dir

    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True, check=True).stdout)
    other = "0123abcd" if HERE != "0123abcd" else "89abcdef"
    theirs = tmp_path / f".big.en.~pipeline-{dead_pid}.{other}-abc.part"
    theirs.write_text("another container's run, still writing")
    parked = tmp_path / f".m.~pipeline-{dead_pid}.{other}-old-xyz"
    (parked / "m").mkdir(parents=True)
    ours = tmp_path / f".small.en.~pipeline-{dead_pid}.{HERE}-abc.part"
    ours.write_text("this namespace's dead run")
    with caplog.at_level(logging.INFO, logger="model.atomic"):
        assert remove_stale_temps(tmp_path) == [ours]
    assert theirs.read_text() == "another container's run, still writing" and (parked / "m").is_dir()
    assert "kept 2 temp file(s)/dir(s)" in caplog.text and "another host or container" in caplog.text
    assert not restore_replaced_dir(tmp_path / "m") and not (tmp_path / "m").exists()


def test_signals_wait_for_a_deferred_write_then_arrive_in_order():
    """A second Ctrl-C inside a checkpoint write must neither tear it nor be lost."""
    import signal
    import time

    from model.signals import signals_deferred

    got: list[int] = []

    def record(signum, frame):
        got.append(signum)

    previous = {sig: signal.signal(sig, record) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with signals_deferred():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGINT):
                os.kill(os.getpid(), sig)
            time.sleep(0.05)  # a handler left in place would have run by now
            assert got == []
        assert got == [signal.SIGINT, signal.SIGTERM, signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) is record
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    written = []
    with pytest.raises(KeyboardInterrupt):  # the default handler: Ctrl-C after the body finished
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            written.append("complete")
    assert written == ["complete"]


def test_an_ignored_signal_stays_ignored_through_a_deferred_write(caplog):
    """Training started with SIGINT ignored (a script's `cmd &`) keeps it so; a checkpoint write hooked it anyway
    and said "SIGINT received while writing a file: acting on it once the write is complete", then did nothing."""
    import logging
    import signal
    import time

    from model.signals import signals_deferred

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with caplog.at_level(logging.WARNING), signals_deferred():
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        assert "received while writing" not in caplog.text and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_latched_signals_survive_a_swallowed_keyboard_interrupt_and_reach_the_old_handler():
    import signal
    import time

    from model.signals import signals_latched

    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        with signals_latched() as latch:
            latch.raise_if_received("nothing yet")  # no signal: no-op
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            except KeyboardInterrupt:  # the default handler still ran: Ctrl-C acts at once
                pass
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            assert got == [signal.SIGTERM]  # passed on to the handler that was in place
            with pytest.raises(KeyboardInterrupt, match="SIGINT received: the commit not done"):
                latch.raise_if_received("the commit")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with signals_latched() as latch:  # an ignored signal stays ignored
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            latch.raise_if_received("the commit")
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_output_dir_names_take_the_target_language():
    """--output-dir wrote English into part-000.de; the language suffix is now the target's where it is
    known (--suffix, --tgt-lang, the model dir's recorded pair)."""
    from pipeline.serve_batch.files import output_name, output_paths

    assert output_name("part-000.de.gz") == "part-000.de"  # nothing known: the input's name, as before
    assert output_name("part-000.de.gz", ".en") == "part-000.en"
    assert output_name("part-000", ".en") == "part-000.en" and output_name("notes.txt", ".en") == "notes.txt.en"
    assert output_name("test.pt-BR", ".en") == "test.en"
    # an extension ISO 639-3 reads as a language is a format's all the same (report.tar.gz was written as report.en)
    assert output_name("report.tar.gz", ".en") == "report.tar.en" and output_name("ch.tex", ".en") == "ch.tex.en"
    assert output_name("europarl.pl", ".en") == "europarl.en"
    assert output_paths(["a/x.de", "b/y.de"], None, "out", ".en") == ["out/x.en", "out/y.en"]
    # names the suffix makes one were "two inputs have the same file name": y and y.en differ; name them
    from model.errors import UserError

    with pytest.raises(UserError, match=r"^in/y and in/y\.en would both be written to out/y\.en, one over the "
                                        r"other"):
        output_paths(["in/y", "in/y.en"], None, "out", ".en")
    with pytest.raises(UserError, match=r"^input /dev/fd/63 \(a pipe: `<\(...\)`\) has no name for --output-dir"):
        output_paths(["a.de", "/dev/fd/63"], None, "out", ".en")  # it was written as out/63


def test_the_suffix_comes_from_the_option_the_target_or_the_model_dir(tmp_path, fp32_dir):
    from helpers import run_cli, with_language_pair

    from pipeline.serve_batch.files import target_suffix

    empty = tmp_path / "m"
    empty.mkdir()
    assert target_suffix(None, str(empty), None) is None  # no manifest: loading says so later, in one line
    assert target_suffix("en", str(empty), "fr") == ".en" and target_suffix(None, str(empty), "fr") == ".fr"
    assert target_suffix("", str(empty), "fr") == ""  # --suffix '': keep the input's name
    assert target_suffix(None, str(fp32_dir), None) is None  # a model dir that records no pair
    model = with_language_pair(fp32_dir, tmp_path / "de-en", "de", "en")
    assert target_suffix(None, str(model), None) == ".en"
    src = tmp_path / "in" / "part-000.de"
    src.parent.mkdir()
    src.write_text("der hund\n")
    assert run_cli("serve-batch", model, src, "--output-dir", tmp_path / "out", "--backend", "onnxruntime",
                   "--no-progress") == 0
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["part-000.en"]


def test_a_one_pair_model_takes_its_own_languages_as_the_native_api_does(tmp_path, fp32_dir, capsys):
    """The docs name outputs by --tgt-lang, and the native API takes a one-pair model's own "source"/"target";
    serve-batch (parity, ray-translate, bench, tune-decoding) refused them: "this model translates one language pair
    and has no language tokens". Its own are taken and change nothing; another is refused naming its pair."""
    from helpers import assert_one_line_error, run_cli_captured, with_language_pair

    model = with_language_pair(fp32_dir, tmp_path / "de-en", "de", "en")
    src = tmp_path / "in" / "part-000.txt"
    src.parent.mkdir()
    src.write_text("der hund\nein kind\n")
    common = ["--backend", "onnxruntime", "--no-progress", "--max-len-b", "8", "--max-len-a", "0"]
    code, _, err = run_cli_captured(capsys, "serve-batch", model, src, "-o", tmp_path / "plain.txt", *common)
    assert code == 0, err
    code, _, err = run_cli_captured(capsys, "serve-batch", model, src, "--output-dir", tmp_path / "out",
                                    "--src-lang", "de", "--tgt-lang", "en", *common)
    assert code == 0, err
    assert (tmp_path / "out" / "part-000.txt.en").read_text() == (tmp_path / "plain.txt").read_text()
    code, _, err = run_cli_captured(capsys, "serve-batch", model, src, "-o", tmp_path / "fr.txt", "--tgt-lang", "fr",
                                    *common)
    assert_one_line_error(code, err, "--tgt-lang fr: this model translates one language pair (de-en, no language "
                                     "tokens)")
    from model.config import ModelConfig
    from model.manifest import Languages
    from runtime.languages import LanguageError, direction

    with pytest.raises(LanguageError, match=r"\(en-mul, no language tokens\); give its own languages or leave them "
                       r"out; a model into many \(an OPUS-MT \*-mul, \*-ROMANCE\) is told its target by each source "
                       r"line's first token, as in transformers: start the lines with >>fr<<$"):
        direction(ModelConfig(vocab_size=64), "en", "fr", pair=Languages(("en",), ("mul",)))
    from pipeline.integrations.translator import Translator  # Ray's and Spark's, alike
    from pipeline.serve_batch.translation import ServeBatchOptions

    assert Translator(model, options=ServeBatchOptions(src_lang="de", tgt_lang="en")).direction.prefix == ()


def test_a_file_named_dash_given_as_dot_slash_dash_is_that_file(tmp_path, fp32_dir, capsys, monkeypatch):
    """./- was read as standard input (Path("./-") is "-"), then closed: serve-batch's traceback ("readline of
    closed file"); bench --src ./- read stdin instead of the file."""
    from helpers import run_cli_captured

    from pipeline.cli_options import GivenPath

    monkeypatch.chdir(tmp_path)
    (tmp_path / "-").write_text("der hund\n")
    common = ["--backend", "onnxruntime", "--no-progress", "--max-len-b", "8", "--max-len-a", "0"]
    code, _, err = run_cli_captured(capsys, "serve-batch", fp32_dir, "./-", "-o", "out.txt", *common)
    assert code == 0, err
    assert (tmp_path / "out.txt").read_text().count("\n") == 1 and (tmp_path / "out.txt").read_text().strip()
    assert GivenPath(path_type=Path).convert("./-", None, None) == tmp_path / "-"
    assert GivenPath(path_type=Path, allow_dash=True).convert("-", None, None) == Path("-")


def test_stale_temps_are_looked_for_once_per_output_dir(tmp_path, monkeypatch):
    """Once per output: 6,000 outputs into a dir of 6,000 files scanned it 6,000 times (a minute before the
    first line was translated)."""
    from pipeline.serve_batch import files

    scanned: list[Path] = []
    monkeypatch.setattr(files, "remove_stale_temps", scanned.append)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    outputs = [str(tmp_path / d / f"{k}.txt") for d in ("a", "b") for k in range(50)]
    files.check_outputs([str(tmp_path / "in.txt")], outputs + ["-"])
    assert scanned == [tmp_path / "a", tmp_path / "b"]


def test_split_sentences_takes_the_source_languages_rules(tmp_path, fp32_dir, capsys):
    """--lang stayed en whatever the source: "Er kam am 3. Oktober nach Hause." was two sentences, translated
    apart, with --src-lang de (the HTTP API takes "lang" from "source"). --lang, else --src-lang, else the model
    dir's source language; a --lang that is no language code is refused."""
    from helpers import assert_one_line_error, run_cli_captured, with_language_pair

    model = with_language_pair(fp32_dir, tmp_path / "de-en", "de", "en")
    src = tmp_path / "doc.txt"
    src.write_text("Er kam am 3. Oktober nach Hause. Dann schlief er.\n")
    common = ["--backend", "onnxruntime", "--no-progress", "--max-len-b", "8", "--max-len-a", "0", "--split",
              "sentences"]
    for flags, sentences in (([], 2), (["--src-lang", "de"], 2), (["--lang", "en"], 3)):
        code, _, err = run_cli_captured(capsys, "serve-batch", model, src, "-o", tmp_path / "out.txt", *common,
                                        *flags)
        assert code == 0 and f"translated {sentences} sentences" in err, (flags, err)
    code, _, err = run_cli_captured(capsys, "serve-batch", fp32_dir, src, "-o", tmp_path / "out.txt", *common)
    assert code == 0 and "translated 3 sentences" in err, err  # a model dir that records no languages: en's
    code, _, err = run_cli_captured(capsys, "serve-batch", model, src, "-o", tmp_path / "x.txt", *common, "--lang",
                                    "de; rm -rf")
    assert_one_line_error(code, err, "--lang must be a language code like de (got 'de; rm -rf')")

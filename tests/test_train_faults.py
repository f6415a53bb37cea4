"""Faults during training lose nothing and print one line: a torn metrics.jsonl line, a
corpus changed under a save dir, a full disk during a checkpoint write (patched and, where
this test may mount one, a real tmpfs), a read-only save dir found before any work, a
double Ctrl-C or kill -9 inside a checkpoint write, stale temps, --save-every 0."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import (
    TINY,
    cli_env,
    last_step,
    make_parallel,
    pipeline_cmd,
    run_cli,
    run_pipeline,
    weights,
    write_parallel,
)

from model import checkpoint as checkpoint_module
from model.checkpoint import read_checkpoint, step_checkpoints
from pipeline.corpus.data import CACHE_DIR

LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR) ")


def messages(stderr: str) -> list[str]:
    """stderr without log lines: what the command itself says."""
    return [line for line in stderr.splitlines() if line.strip() and not LOG_LINE.match(line)]


def temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if "~pipeline-" in p.name)


@pytest.fixture()
def corpus(tmp_path) -> tuple[Path, Path]:
    return write_parallel(tmp_path / "corpus", "train", *make_parallel(80, seed=5))


def common(run: Path, corpus: tuple[Path, Path], *extra: object) -> list[object]:
    return ["--save-dir", run, "--train-src", corpus[0], "--train-tgt", corpus[1], *TINY, *extra]


# -- metrics.jsonl --------------------------------------------------------------------------

@pytest.mark.slow
def test_a_torn_metrics_line_is_dropped_and_resume_works(corpus, tmp_path, caplog):
    run = tmp_path / "run"
    assert run_cli("train", *common(run, corpus, "--log-every", "1", "--max-steps", "2")) == 0
    with open(run / "metrics.jsonl", "a") as f:  # what a full disk leaves: half a line
        f.write('{"event": "train", "step": 3, "loss": 1.2')
    with caplog.at_level(logging.WARNING):
        assert run_cli("train", *common(run, corpus, "--log-every", "1", "--max-steps", "3")) == 0
    assert any("dropped 1 unreadable line" in r.getMessage() for r in caplog.records)
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "train"] == [1, 2, 3]


# -- the corpus is part of the resume contract ----------------------------------------------


@pytest.mark.slow
def test_a_moved_corpus_with_the_same_contents_resumes(corpus, tmp_path, caplog, capsys):
    """The corpus paths were part of the config a resume must match: a project moved (or mounted elsewhere) was
    "a different config", even with --allow-changed-data. Its files' contents decide now; a changed one is still
    refused, and a file added or dropped is still a different config."""
    run = tmp_path / "run"
    assert run_cli("train", *common(run, corpus, "--save-every", "1", "--max-steps", "1")) == 0
    moved = (tmp_path / "moved").mkdir() or tuple(tmp_path / "moved" / p.name for p in corpus)
    for old, new in zip(corpus, moved):
        old.rename(new)
    with caplog.at_level(logging.INFO):
        assert run_cli("train", *common(run, moved, "--save-every", "1", "--max-steps", "2")) == 0
    assert any(f"--train-src {moved[0]}: the same contents as {corpus[0]}" in r.getMessage() for r in caplog.records)
    assert json.loads((run / "config.json").read_text())["data_files"]["train_src"]["path"] == str(moved[0])
    assert last_step(run) == 2
    moved[1].write_text(moved[1].read_text().replace("cat", "dog"))
    capsys.readouterr()
    assert run_cli("train", *common(run, moved, "--save-every", "1", "--max-steps", "3")) == 2
    assert f"--train-tgt {moved[1]}" in capsys.readouterr().err
    assert run_cli("train", *common(run, moved, "--valid-src", moved[0], "--valid-tgt", moved[1],
                                    "--max-steps", "3", "--allow-changed-data")) == 2
    assert "different config (--valid-src none -> " in capsys.readouterr().err  # not the Python spelling, None

@pytest.mark.slow
def test_a_changed_corpus_is_refused_unless_allowed(corpus, tmp_path, capsys, caplog):
    src, tgt = corpus
    run = tmp_path / "run"
    assert run_cli("train", *common(run, corpus, "--save-every", "1", "--max-steps", "1")) == 0
    recorded = json.loads((run / "config.json").read_text())["data_files"]
    assert recorded["train_tgt"]["size"] == tgt.stat().st_size and len(recorded["train_tgt"]["sha256"]) == 64
    later = time.time() + 100
    os.utime(src, (later, later))  # touched, same contents: the same data
    assert run_cli("train", *common(run, corpus, "--save-every", "1", "--max-steps", "2")) == 0

    text = tgt.read_text()
    assert "cat" in text
    tgt.write_text(text.replace("cat", "dog"))  # same size, other contents
    before = {p.name: p.read_bytes() for p in step_checkpoints(run)}
    capsys.readouterr()
    assert run_cli("train", *common(run, corpus, "--save-every", "1", "--max-steps", "3")) == 2
    err = capsys.readouterr().err
    assert len(messages(err)) == 1 and err.startswith("error: ")
    assert f"--train-tgt {tgt}" in err and "--train-src" not in err
    assert "new --save-dir" in err and "--allow-changed-data" in err
    assert {p.name: p.read_bytes() for p in step_checkpoints(run)} == before

    with caplog.at_level(logging.WARNING):
        assert run_cli("train", *common(run, corpus, "--save-every", "1", "--max-steps", "3",
                                        "--allow-changed-data")) == 0
    assert any("corpus changed" in r.getMessage() and str(tgt) in r.getMessage() for r in caplog.records)
    now = json.loads((run / "config.json").read_text())["data_files"]["train_tgt"]
    assert now["sha256"] != recorded["train_tgt"]["sha256"]
    assert read_checkpoint(step_checkpoints(run)[-1])["train_state"]["data_files"]["train_tgt"] == now
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "data_changed"] == [2]
    # The new contents are now the run's data: resuming again needs no flag.
    assert run_cli("train", *common(run, corpus, "--save-every", "1", "--max-steps", "4")) == 0


# -- a full disk during a checkpoint write --------------------------------------------------

@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_and_a_rerun_resumes_exactly(corpus, tmp_path, capsys,
                                                                         monkeypatch):
    """The disk fills in the middle of the step-2 checkpoint: torch.save's writer then
    raises its RuntimeError('... unexpected pos ...') over our OSError(ENOSPC)."""
    run, straight = tmp_path / "run", tmp_path / "straight"
    args = ("--save-every", "1", "--dropout", "0.1")
    assert run_cli("train", *common(run, corpus, *args, "--max-steps", "1")) == 0
    first = step_checkpoints(run)[0].read_bytes()
    written = [0]
    real_write = checkpoint_module._DigestWriter.write

    def fill_up(self, data):
        written[0] += memoryview(data).nbytes
        if written[0] > 50_000:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, data)

    monkeypatch.setattr(checkpoint_module._DigestWriter, "write", fill_up)
    capsys.readouterr()
    assert run_cli("train", *common(run, corpus, *args, "--max-steps", "3")) == 2
    (line,) = messages(capsys.readouterr().err)
    assert line.startswith("error: ") and "no space left on device" in line
    assert str(run / "checkpoint_00000002.pt") in line and "resume from checkpoint_00000001.pt" in line
    assert [p.name for p in step_checkpoints(run)] == ["checkpoint_00000001.pt"]
    assert step_checkpoints(run)[0].read_bytes() == first and temps(run) == []

    monkeypatch.undo()  # space is back
    assert run_cli("train", *common(run, corpus, *args, "--max-steps", "3")) == 0
    assert run_cli("train", *common(straight, corpus, *args, "--max-steps", "3")) == 0
    a, b = weights(run), weights(straight)
    assert last_step(run) == 3 and all((a[k] == b[k]).all() for k in a)


@pytest.fixture()
def mount_tmpfs(tmp_path) -> Iterator:
    """mount(options) -> a fresh tmpfs dir; skips where this test may not mount one."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


@pytest.mark.slow
def test_a_real_full_disk_keeps_earlier_checkpoints_and_a_rerun_resumes(corpus, tmp_path, mount_tmpfs):
    disk = mount_tmpfs("size=16m")
    run = disk / "run"
    args = common(run, corpus, "--save-every", "1")
    assert run_cli("train", *args, "--max-steps", "1") == 0
    first = step_checkpoints(run)[0]
    kept = first.read_bytes()
    st = os.statvfs(disk)
    filler = disk / "filler"
    with open(filler, "wb") as f:  # leave room for half a checkpoint
        left = st.f_bavail * st.f_frsize - len(kept) // 2
        while left > 0:
            left -= f.write(b"\0" * min(left, 1 << 20))
    proc = subprocess.run(pipeline_cmd("train", *args, "--max-steps", "3"), env=cli_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = messages(proc.stderr)
    assert "no space left on device" in line and str(run / "checkpoint_00000002.pt") in line
    assert step_checkpoints(run) == [first] and first.read_bytes() == kept and temps(run) == []
    filler.unlink()
    assert run_cli("train", *args, "--max-steps", "3") == 0 and last_step(run) == 3


@pytest.fixture()
def read_only_dir(tmp_path, mount_tmpfs) -> Iterator[Path]:
    """A read-only tmpfs as root (who may write anywhere else), a mode-0555 dir otherwise."""
    if os.geteuid() == 0:
        yield mount_tmpfs("ro,size=1m")
        return
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    yield locked
    locked.chmod(0o755)


def test_a_read_only_save_dir_fails_before_any_work(corpus, read_only_dir, capsys, monkeypatch):
    import pipeline.corpus.data

    def never(*args, **kwargs):
        raise AssertionError("SentencePiece trained before the save dir was checked")

    monkeypatch.setattr(pipeline.corpus.data, "train_sentencepiece", never)
    run = read_only_dir / "run"
    assert run_cli("train", *common(run, corpus, "--max-steps", "1")) == 2
    (line,) = messages(capsys.readouterr().err)
    reason = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
    assert line == f"error: {run}: cannot write to this --save-dir ({reason}); choose a writable one"


@pytest.mark.slow
def test_average_into_a_read_only_dir_is_one_line(corpus, tmp_path, read_only_dir, capsys):
    run = tmp_path / "run"
    assert run_cli("train", *common(run, corpus, "--max-steps", "2", "--save-every", "1")) == 0
    capsys.readouterr()
    out = read_only_dir / "avg.pt"
    assert run_cli("average", run, "--out", out) == 2
    (line,) = messages(capsys.readouterr().err)
    reason = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
    # refused before a checkpoint is read, naming the directory (check_output_file), not after averaging
    assert line == f"error: {read_only_dir}: cannot write --out here ({reason})" and not out.exists(), line


# -- signals and kills inside a checkpoint write --------------------------------------------

# Runs the real CLI with each write of a checkpoint slowed down, so that a signal sent
# once the marker exists lands inside torch.save (nothing else is changed).
SLOW_SAVES = """
import os, sys, time
from model import checkpoint
real_write = checkpoint._DigestWriter.write
def slow_write(self, data):
    if not os.path.exists(os.environ["MARKER"]):
        open(os.environ["MARKER"], "w").close()
    time.sleep(0.005)
    return real_write(self, data)
checkpoint._DigestWriter.write = slow_write
from pipeline.cli import main
main(sys.argv[1:])
"""


def _start_slow_run(run: Path, corpus: tuple[Path, Path], tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    assert run_cli("train", *common(run, corpus, "--max-steps", "1")) == 0  # data cached: saves only
    marker = tmp_path / "in-write"
    args = map(str, ["train", *common(run, corpus, "--save-every", "2", "--max-steps", "1000")])
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVES, *args], cwd=tmp_path, text=True,
                            env=dict(cli_env(), MARKER=str(marker)), stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.01)
    time.sleep(0.2)
    return proc, marker


@pytest.mark.slow
def test_a_double_ctrl_c_inside_a_checkpoint_write_leaves_it_complete(corpus, tmp_path):
    run = tmp_path / "run"
    proc, _ = _start_slow_run(run, corpus, tmp_path)
    try:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
        stderr = proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
    assert "Traceback" not in stderr
    (line,) = messages(stderr)
    written = run / "checkpoint_00000002.pt"
    assert line.startswith("aborted by a second SIGINT at step 2") and str(written) in line, stderr
    assert [p.name for p in step_checkpoints(run)] == ["checkpoint_00000001.pt", written.name]
    assert read_checkpoint(written)["train_state"]["step"] == 2 and temps(run) == []
    assert run_cli("train", *common(run, corpus, "--max-steps", "3")) == 0 and last_step(run) == 3


@pytest.mark.slow
def test_kill_9_inside_a_checkpoint_write_leaves_a_temp_the_next_run_removes(corpus, tmp_path):
    run = tmp_path / "run"
    proc, _ = _start_slow_run(run, corpus, tmp_path)
    proc.kill()
    proc.wait(timeout=60)
    (left,) = temps(run)
    assert left.startswith(".checkpoint_00000002.pt.~pipeline-") and (run / left).stat().st_size > 0
    assert run_cli("train", *common(run, corpus, "--max-steps", "2")) == 0
    assert temps(run) == [] and last_step(run) == 2


@pytest.mark.slow
def test_stale_temps_go_and_live_ones_stay_at_train_and_average(corpus, tmp_path):
    run = tmp_path / "run"
    assert run_cli("train", *common(run, corpus, "--max-steps", "2", "--save-every", "1")) == 0
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        def plant() -> tuple[list[Path], list[Path]]:
            stale = [run / f".checkpoint_00000009.pt.~pipeline-{dead.stdout.strip()}-x.tmp",
                     run / CACHE_DIR / f".train-abc.pt.~pipeline-{dead.stdout.strip()}-y.tmp"]
            alive = [run / f".checkpoint_00000010.pt.~pipeline-{live.pid}-z.tmp"]
            for p in stale + alive:
                p.write_bytes(b"\0" * 1000)
            return stale, alive

        stale, alive = plant()
        assert run_cli("train", *common(run, corpus, "--max-steps", "3", "--save-every", "1")) == 0
        assert not any(p.exists() for p in stale) and all(p.exists() for p in alive)
        stale, alive = plant()
        assert run_cli("average", run, "--last", "2") == 0
        assert not stale[0].exists() and all(p.exists() for p in alive)
    finally:
        live.kill()
        live.wait()


# -- option validation ----------------------------------------------------------------------

@pytest.mark.parametrize("option,value,says", [("--max-len", "10000000", "must be at most 16384 tokens"),
                                               ("--valid-beam", "65", "must be at most 64")])
def test_numbers_too_large_are_refused_before_any_update(corpus, tmp_path, capsys, option, value, says):
    """--max-len 10,000,000 built a positional table of that many rows (8 GB in training, 2.5 GB of ONNX); a
    thousand million was a traceback."""
    run = tmp_path / "run"
    assert run_cli("train", *common(run, corpus, "--max-steps", "2", option, value)) == 2
    (line,) = messages(capsys.readouterr().err)
    assert line.startswith(f"error: {option} {says} (got {value})"), line
    assert not run.exists()


def test_a_validation_beam_above_eight_validates(corpus, tmp_path, capsys):
    """--valid-beam 9 was refused at the first validation ("needs 18 candidates ... re-export with a larger
    --topk"), after the updates before it, and the save dir was removed as a run refused before its first
    checkpoint: the validation search asks the model for the candidates its beam needs."""
    run = tmp_path / "run"
    assert run_cli("train", *common(run, corpus, "--max-steps", "2", "--save-every", "2", "--valid-beam", "9",
                                    "--valid-src", corpus[0], "--valid-tgt", corpus[1],
                                    "--valid-max-sentences", "2")) == 0
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("beam") == 9 and "bleu" in e for e in events), events
    assert step_checkpoints(run)


@pytest.mark.parametrize("option,value", [("--save-every", "0"), ("--save-every", "-3"), ("--valid-every", "0")])
def test_zero_or_negative_intervals_are_refused(corpus, tmp_path, capsys, option, value):
    run = tmp_path / "run"
    assert run_cli("train", *common(run, corpus, "--max-steps", "2", option, value)) == 2
    (line,) = messages(capsys.readouterr().err)
    assert line == f"error: {option} must be at least 1 (got {value})"
    assert not step_checkpoints(run)


@pytest.mark.slow
def test_a_second_ctrl_c_while_the_stop_checkpoint_is_written_keeps_it_a_resume_point(corpus, tmp_path):
    """The checkpoint a first Ctrl-C writes is recorded as a resume point (interrupted.json), so --keep-last and
    `average --last` do not count it; a second Ctrl-C inside its write came out between the write and that
    record: the checkpoint stayed for good as a scheduled one. And Python's exit then printed a traceback."""
    run = tmp_path / "run"
    assert run_cli("train", *common(run, corpus, "--max-steps", "1")) == 0  # data cached
    marker = tmp_path / "in-write"
    args = map(str, ["train", *common(run, corpus, "--save-every", "100000", "--log-every", "1",
                                      "--max-steps", "100000")])
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVES, *args], cwd=tmp_path, text=True,
                            env=dict(cli_env(), MARKER=str(marker)), stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while '"step": 3' not in ((run / "metrics.jsonl").read_text() if (run / "metrics.jsonl").exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)  # the stop: its checkpoint is the first write of this process
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)  # inside that write
        assert proc.wait(timeout=120) == 130
        stderr = proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-2000:]
    written = [p for p in step_checkpoints(run) if p.name != "checkpoint_00000001.pt"]
    assert len(written) == 1, written
    step = read_checkpoint(written[0])["train_state"]["step"]
    assert json.loads((run / "interrupted.json").read_text()) == {"steps": [step]}, stderr[-2000:]


@pytest.mark.slow
def test_a_time_budget_spent_before_the_first_update_leaves_no_checkpoint_to_average(corpus, tmp_path):
    """--max-time spent on preparing the data wrote checkpoint_00000000.pt (untrained weights) as the run's: it
    survived the resume, and `average --last` averaged it with trained ones. It is a resume point now."""
    run = tmp_path / "run"  # in fresh processes: --max-time counts from the process's start (pytest's, in-process)
    for budget in ("0.001s", "5m"):
        code, err = run_pipeline("train", *common(run, corpus, "--max-steps", "3", "--max-time", budget))
        assert code == 0, err
        if budget == "0.001s":
            assert [p.name for p in step_checkpoints(run)] == ["checkpoint_00000000.pt"]
            assert json.loads((run / "interrupted.json").read_text()) == {"steps": [0]}
    assert [p.name for p in step_checkpoints(run)] == ["checkpoint_00000003.pt"]


@pytest.mark.slow
def test_train_called_from_python_counts_its_budget_from_the_call(corpus, tmp_path):
    """`train(opts)` from a notebook or a script counted --max-time from the process's start: a kernel that had
    lived longer than the budget stopped at step 0 with untrained weights. The budget starts with the call now
    (`pipeline train` passes its process's start: its imports count there)."""
    from pipeline.training import TrainOptions, train
    from pipeline.training.budget import process_start_time

    lived = time.time() - process_start_time()
    if lived < 40:  # this process must have lived longer than the budget before the call
        time.sleep(40 - lived)
        lived = 40
    run = tmp_path / "run"
    train(TrainOptions(save_dir=run, train_src=corpus[0], train_tgt=corpus[1], preset="tiny", vocab_size=64,
                       batch_tokens=256, warmup=20, threads=1, max_steps=3, progress=False,
                       max_time=f"{int(lived) - 5}s"))
    assert [p.name for p in step_checkpoints(run)] == ["checkpoint_00000003.pt"]


def test_a_time_budget_spent_before_the_first_update_says_so_not_to_average(corpus, tmp_path, capsys):
    """--max-time spent on start-up ended "average them with `pipeline average RUN`", which then refused the
    run's only checkpoint (a resume point)."""
    run = tmp_path / "run"
    assert run_cli("train", *common(run, corpus, "--max-time", "1s")) == 0
    out = capsys.readouterr().out
    assert "holds a resume point only; rerun the command (with a larger --max-time) to train" in out, out
    assert "pipeline average" not in out


def test_a_side_too_long_for_max_len_whatever_it_holds_is_dropped_untokenized(monkeypatch):
    """A 20 MB line was tokenized whole before --max-len dropped it (1.3 GB), and 200,000 of one unseen character
    (one "▁<unk>") was kept: a side of more than --max-len x 64 characters is dropped as too long, untokenized."""
    from pipeline.corpus import data

    class Recording:
        seen: list[int] = []

        def encode(self, texts: list[str]) -> list[list[int]]:
            self.seen += [len(t) for t in texts]
            return [[5] * min(len(t.split()), 3) for t in texts]

    tokenizer = Recording()
    src = ["ab cd", "\u2603" * 200_000, "ef"]
    tgt = ["x y", "z", "w" * (16 * 64 + 1)]
    corpus = data.encode_and_filter(tokenizer, src, tgt, 16, "train")  # type: ignore[arg-type]
    assert list(corpus.rows) == [0] and max(tokenizer.seen) <= 5


@pytest.mark.parametrize("option,value,says", [
    ("--dropout", "1.5", "--dropout must be in [0, 1), got 1.5"),
    ("--layers", "0", "--layers must be a positive integer, got 0"),
    ("--n-heads", "3", "--d-model (32) must be divisible by --n-heads (3)")])
def test_a_model_option_that_makes_no_transformer_is_named_before_the_corpus_is_read(corpus, tmp_path, capsys,
                                                                                    option, value, says):
    """--dropout 1.5 said "invalid model config: dropout must be ..." (a config key, not the option), after the
    corpus was read and SentencePiece trained on it."""
    run = tmp_path / "run"
    assert run_cli("train", *common(run, corpus, "--max-steps", "2", option, value)) == 2
    (line,) = messages(capsys.readouterr().err)
    assert line.startswith("error: the model (--preset tiny): ") and says in line, line
    assert "enc_heads" not in line and not run.exists()


def test_a_resume_refusal_names_options_and_what_they_were():
    """It printed config keys and Python values: "lr_schedule none -> 'linear'" for a run of the default schedule
    (rsqrt, recorded only when another) resumed with --lr-schedule linear."""
    from pipeline.training.options import config_differences

    old = {"model": {"d_model": 32, "pre_norm": False}, "training": {"seed": 1, "valid_src": None}}
    new = {"model": {"d_model": 64, "pre_norm": True},
           "training": {"seed": 1, "valid_src": "/data/dev.de", "lr_schedule": "linear", "spm_alpha": 0.1}}
    assert config_differences(old, new) == [
        "--d-model 32 -> 64", "the model's pre_norm False -> True", "--lr-schedule rsqrt -> linear",
        "--spm-alpha 0.0 -> 0.1", "--valid-src none -> /data/dev.de"]

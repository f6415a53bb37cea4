"""Progress a user sees move: serve-batch's bar advances batch by batch with a total and an ETA on a terminal
(a pty) and draws nothing on a pipe; training logs a line every --log-seconds where no bar is drawn; the demo
says which limit ended its training."""

from __future__ import annotations

import fcntl
import logging
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time

import pytest
from helpers import TINY, cli_env, pipeline_cmd, run_cli

from pipeline.demo.run import DemoOptions, _how_training_ended
from pipeline.training.budget import TimeBudget
from pipeline.training.loop import _Heartbeat, _Throughput


def run_in_pty(args: list[object], timeout: float = 300) -> tuple[int, str]:
    """A command with its stdin, stdout and stderr on a pseudo-terminal, as in a user's shell: its exit status
    and everything it drew."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a window: tqdm draws to its width
    proc = subprocess.Popen(pipeline_cmd(*args), env={**cli_env(), "COLUMNS": "120"}, stdin=child, stdout=child,
                            stderr=child, close_fds=True)
    os.close(child)
    seen, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    os.close(main)
    return proc.wait(timeout=30), seen.decode("utf-8", "replace")


@pytest.mark.slow
def test_serve_batch_bar_moves_per_batch_with_a_total_on_a_terminal_and_is_silent_on_a_pipe(fp32_dir, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("".join(f"der hund {'und die katze ' * (i % 5)}sieht {i}\n" for i in range(120)))
    code, drawn = run_in_pty(["serve-batch", fp32_dir, src, "-o", tmp_path / "out.txt", "--backend",
                              "onnxruntime", "--batch-tokens", "200", "--threads", "1"])
    assert code == 0, drawn
    counts = {int(m.group(1)) for m in re.finditer(r"(\d+)/120 ", drawn)}
    assert 120 in counts or len(counts) > 1, drawn  # a total, the file's lines counted first
    assert any(0 < n < 120 for n in counts), f"the bar only moved at the end of the window: {drawn!r}"
    proc = subprocess.run(pipeline_cmd("serve-batch", fp32_dir, src, "-o", tmp_path / "out2.txt", "--backend",
                                       "onnxruntime", "--batch-tokens", "200", "--threads", "1"),
                          env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "\r" not in proc.stderr and "/120" not in proc.stderr, proc.stderr
    assert (tmp_path / "out.txt").read_text() == (tmp_path / "out2.txt").read_text()


def test_the_bar_counts_lines_when_a_window_is_translated_in_sentences():
    """--split sentences (and --format html) advanced the bar by sentences against a total of lines: 1776/600."""
    from pipeline.serve_batch.files import _Advance

    class Bar:
        def __init__(self) -> None:
            self.n = 0
            self.seen: list[int] = []

        def update(self, step: int) -> None:
            self.n += step
            self.seen.append(self.n)

    bar = Bar()
    advance = _Advance(bar, 3, 9, 1)  # 3 lines of 3 sentences each, translated 2 sentences a batch
    for _ in range(4):
        advance(2)
    assert bar.seen == [0, 1, 2, 2] and bar.n <= 3
    advance(1)
    advance.finish()
    assert bar.n == 3
    two_ranks = _Advance(bar := Bar(), 4, 4, 2)  # this rank's batches stand for both ranks'
    two_ranks(1)
    assert bar.n == 2


def test_the_heartbeat_says_step_loss_speed_and_time_left(caplog, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    speed = _Throughput(start=1000.0)
    beat = _Heartbeat(first_step=0, started=1000.0, every_s=30.0)
    budget = TimeBudget(limit_s=600.0, started=1000.0)
    with caplog.at_level(logging.INFO, logger="pipeline.training.loop"):
        for step in range(1, 101):
            now[0] += 1.0  # one second a step
            speed.add(500)
            beat.maybe_log(step, 1200, 2.5, speed, budget)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines  # at 30, 60 and 90 s
    assert lines[0] == "step 30/1200, loss 2.500, 500 tokens/s, 0m30s elapsed, about 9m30s left (--max-time)"
    no_budget = _Heartbeat(first_step=0, started=now[0], every_s=30.0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline.training.loop"):
        now[0] += 40
        no_budget.maybe_log(140, 150, 2.0, speed, TimeBudget(limit_s=None, started=1000.0))
    assert caplog.records[0].getMessage().endswith("about 0m02s left (--max-steps)")  # 10 steps at 0.29 s


HEARTBEAT = r"step (\d+)/60, loss [\d.]+, \d+ tokens/s, \d+m\d\ds elapsed, about \d+m\d\ds left \(--max-steps\)"


def train_args(tmp_path, name: str) -> list[object]:
    corpus = tmp_path / "c"
    corpus.mkdir(exist_ok=True)
    for side, words in (("src", "der hund die katze ein haus"), ("tgt", "the dog the cat a house")):
        (corpus / f"train.{side}").write_text("".join(f"{words} {i}\n" for i in range(300)))
    return ["train", "--save-dir", tmp_path / name, "--train-src", corpus / "train.src", "--train-tgt",
            corpus / "train.tgt", *[a for a in TINY if a != "--no-progress"], "--max-steps", "60",
            "--log-seconds", "0.2", "--save-every", "1000"]


@pytest.mark.slow
def test_training_logged_to_a_pipe_says_where_it_is_and_on_a_terminal_draws_its_bar(tmp_path):
    proc = subprocess.run(pipeline_cmd(*train_args(tmp_path, "pipe")), env=cli_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert re.findall(HEARTBEAT, proc.stderr) and "\r" not in proc.stderr, proc.stderr
    code, drawn = run_in_pty(train_args(tmp_path, "pty"))
    assert code == 0, drawn
    assert re.search(r"\d+/60 \[", drawn) and not re.findall(HEARTBEAT, drawn), drawn  # the bar, not log lines


def test_the_demo_says_which_limit_ended_training(tmp_path):
    save = tmp_path / "train"
    save.mkdir()
    (save / "checkpoint_400.pt").write_bytes(b"")
    opts = DemoOptions(out=tmp_path, max_steps=1200, max_time="10m")
    assert _how_training_ended(save, opts) == \
        "training stopped at step 400 of 1200 by its time budget (--max-time 10m)"
    (save / "checkpoint_1200.pt").write_bytes(b"")
    assert _how_training_ended(save, opts, before=400) == "training ran all 1200 steps (--max-steps)"
    # a rerun on the same --out: it said "ran all 1200 steps" though it trained none
    assert _how_training_ended(save, opts, before=1200) == \
        f"training: {save} was at step 1200 already, nothing to train (--max-steps 1200)"


def test_demo_help_names_its_time_budget(capsys):
    assert run_cli("demo", "--help") == 0
    assert "--max-time" in capsys.readouterr().out

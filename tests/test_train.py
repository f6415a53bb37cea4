"""`pipeline train` and `pipeline average`: memorisation, DDP == one process, exact resume
(also after SIGTERM), averaging, the built-in corpus, caching, and every bad input."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    MEMORISE_PAIRS,
    TINY,
    assert_one_line_error,
    cli_env,
    last_step,
    make_parallel,
    run_cli,
    run_cli_captured,
    train_until_sigterm,
    weights,
    write_parallel,
)

from model.checkpoint import read_checkpoint, step_checkpoints
from model.errors import UserError
from pipeline.corpus import synthetic
from pipeline.corpus.data import make_batches
from pipeline.training import learning_rate
from runtime.torch_backend import open_checkpoint
from runtime.translate import translate_lines


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    src, tgt = make_parallel(120, seed=3)
    return write_parallel(tmp_path_factory.mktemp("corpus"), "train", src, tgt)


# -- the recipe ----------------------------------------------------------------------------

def test_learning_rate_is_the_papers_schedule():
    d, warmup = 512, 4000
    assert learning_rate(1, d, warmup) == pytest.approx(d ** -0.5 * warmup ** -1.5)
    assert learning_rate(warmup, d, warmup) == pytest.approx(d ** -0.5 * warmup ** -0.5)
    assert learning_rate(4 * warmup, d, warmup) == pytest.approx(learning_rate(warmup, d, warmup) / 2)
    assert learning_rate(100, d, warmup, scale=2.0) == pytest.approx(2 * learning_rate(100, d, warmup))


def test_a_resume_that_validates_otherwise_starts_a_new_best(corpus, tmp_path, caplog):
    """Resumed with --valid-max-sentences 1, a BLEU on 1 line was compared with the recorded best on every line
    (14.54 beat 7.00), took checkpoint_best.pt and the summary. A changed measure starts a new best, said."""
    import logging

    src, tgt = corpus
    run = tmp_path / "run"
    common = ["--train-src", src, "--train-tgt", tgt, "--valid-src", src, "--valid-tgt", tgt, *TINY,
              "--save-every", "2", "--valid-every", "2", "--valid-max-sentences", "8"]
    assert run_cli("train", "--save-dir", run, *common, "--max-steps", "2") == 0
    assert read_checkpoint(run / "checkpoint_best.pt")["extra"]["step"] == 2
    with caplog.at_level(logging.WARNING):
        assert run_cli("train", "--save-dir", run, *common[:-1], "1", "--max-steps", "4") == 0
    assert ("validation BLEU is measured otherwise now (--valid-max-sentences 8 -> 1): the best so far"
            in caplog.text)
    best = read_checkpoint(run / "checkpoint_best.pt")["extra"]
    assert best["step"] == 4 and best["valid"]["sentences"] == 1  # the new measure's first, whatever its BLEU


@pytest.mark.slow
def test_tiny_model_memorises_tiny_corpus(trained_save_dir, memorise_corpus):
    """Greedy output equals the references on every training sentence."""
    src_path, tgt_path = memorise_corpus
    src, tgt = src_path.read_text().splitlines(), tgt_path.read_text().splitlines()
    assert len(src) == MEMORISE_PAIRS
    backend, tok = open_checkpoint(trained_save_dir, "cpu")
    assert translate_lines(backend, tok, src, beam_size=1) == tgt
    events = [json.loads(line) for line in (trained_save_dir / "metrics.jsonl").read_text().splitlines()]
    valid = [e for e in events if e["event"] == "valid"]
    assert valid and valid[-1]["bleu"] == 100.0 and "nrefs:1" in valid[-1]["bleu_signature"]
    train_events = [e for e in events if e["event"] == "train"]
    assert train_events[-1]["loss"] < train_events[0]["loss"] and train_events[-1]["tokens_per_s"] > 0


@pytest.mark.slow
def test_save_dir_is_self_contained(trained_save_dir):
    payload = read_checkpoint(step_checkpoints(trained_save_dir)[-1])
    assert payload["model_config"]["d_model"] == 32 and payload["spm_model"]
    state = payload["train_state"]
    assert {"optimizer", "rng", "data", "step", "config"} <= set(state)
    assert (trained_save_dir / "spm.model").read_bytes() == payload["spm_model"]
    config = json.loads((trained_save_dir / "config.json").read_text())
    assert config["model"]["n_heads"] == 4 and config["training"]["label_smoothing"] == 0.1


# -- DDP ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_gloo_processes_equal_one_process_with_the_same_global_batch(corpus, tmp_path, caplog):
    """2 ranks x update-freq 1 and 1 process x update-freq 2 see the same global batches and
    normalise by the same global token count, so they make the same updates."""
    src, tgt = corpus
    common = ["--train-src", src, "--train-tgt", tgt, *TINY, "--max-steps", "6", "--seed", "5"]
    one = tmp_path / "one"
    assert run_cli("train", "--save-dir", one, "--update-freq", "2", *common) == 0
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "pipeline", "train", "--save-dir", str(two), "--update-freq", "1", *map(str, common)]
    proc = subprocess.run(cmd, env=cli_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if " INFO " in line and "parameters" in line]
    assert len(said) == 1 and "rank 1" not in proc.stderr, said  # once, by rank 0 (each line was there twice)
    a, b = weights(one), weights(two)
    assert last_step(one) == last_step(two) == 6
    initial = read_checkpoint(step_checkpoints(one)[0])
    assert initial["train_state"]["world_size"] == 1
    assert read_checkpoint(step_checkpoints(two)[-1])["train_state"]["world_size"] == 2
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=2e-6, rtol=1e-5, msg=name)
    # ... and training actually moved the weights, so the comparison means something.
    assert any(not torch.equal(a[n], b2) for n, b2 in _init_weights(corpus, tmp_path).items())
    # resumed in one process: no word of dropout masks for a model without dropout (the tiny preset's 0)
    with caplog.at_level(logging.WARNING):
        assert run_cli("train", "--save-dir", two, "--update-freq", "2", *common, "--max-steps", "7") == 0
    assert last_step(two) == 7 and "dropout masks" not in caplog.text, caplog.text


def _init_weights(corpus, tmp_path) -> dict[str, torch.Tensor]:
    src, tgt = corpus
    zero = tmp_path / "zero"
    run_cli("train", "--save-dir", zero, "--train-src", src, "--train-tgt", tgt, *TINY, "--max-steps", "1",
            "--seed", "5", "--lr-scale", "1e-12")
    return weights(zero)


# -- resume --------------------------------------------------------------------------------

@pytest.mark.slow
def test_resume_equals_uninterrupted(corpus, tmp_path):
    """N steps, stop, rerun to 2N == 2N at once (weights, optimizer, data position, dropout RNG)."""
    src, tgt = corpus
    common = ["--train-src", src, "--train-tgt", tgt, *TINY, "--dropout", "0.1", "--save-every", "100"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_cli("train", "--save-dir", straight, *common, "--max-steps", "10") == 0
    assert run_cli("train", "--save-dir", resumed, *common, "--max-steps", "5") == 0
    assert last_step(resumed) == 5
    assert run_cli("train", "--save-dir", resumed, *common, "--max-steps", "10") == 0
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa = read_checkpoint(step_checkpoints(straight)[-1])["train_state"]
    sb = read_checkpoint(step_checkpoints(resumed)[-1])["train_state"]
    assert sa["data"] == sb["data"] and sa["tokens"] == sb["tokens"]
    # metrics.jsonl holds each step once, whatever the interruptions.
    steps = [json.loads(x)["step"] for x in (resumed / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["event"] == "train"]
    assert steps == sorted(set(steps))


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_rerun_resumes_exactly(corpus, tmp_path):
    src, tgt = corpus
    common = ["--train-src", src, "--train-tgt", tgt, *TINY, "--dropout", "0.1", "--save-every", "100000",
              "--log-every", "1"]
    run = tmp_path / "run"
    stderr = train_until_sigterm(run, [*common, "--max-steps", "100000"], tmp_path)
    assert "rerun the same command to resume" in stderr
    stopped_at = last_step(run)
    assert stopped_at >= 3
    assert json.loads((run / "interrupted.json").read_text()) == {"steps": [stopped_at]}  # a resume point
    target = str(stopped_at + 4)
    assert run_cli("train", "--save-dir", run, *common, "--max-steps", target) == 0
    straight = tmp_path / "straight"
    assert run_cli("train", "--save-dir", straight, *common, "--max-steps", target) == 0
    a, b = weights(straight), weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the signal's checkpoint was a resume point: superseded by the run's last, it went, so the run holds what an
    # uninterrupted one holds (--keep-last and `average --last` counted it, and its step depended on the signal)
    assert [p.name for p in step_checkpoints(run)] == [p.name for p in step_checkpoints(straight)] == [
        f"checkpoint_{int(target):08d}.pt"]
    assert not (run / "interrupted.json").exists()


@pytest.mark.slow
def test_stop_signal_checkpoints_never_pile_up_and_a_finished_run_keeps_its_last(corpus, tmp_path, capsys):
    """Two SIGTERMs before the first scheduled save left both resume points (uncounted by --keep-last); a rerun
    to the stopped step left its weights marked a resume point, so `average --last` skipped the run's last."""
    from model.checkpoint import checkpoint_step

    src, tgt = corpus
    common = ["--train-src", src, "--train-tgt", tgt, *TINY, "--save-every", "100000", "--log-every", "1"]
    run = tmp_path / "run"
    train_until_sigterm(run, [*common, "--max-steps", "100000"], tmp_path)
    first = last_step(run)
    seen = len((run / "metrics.jsonl").read_text().splitlines())
    train_until_sigterm(run, [*common, "--max-steps", "100000"], tmp_path, lines=seen + 3)
    second = last_step(run)
    assert second > first
    assert [checkpoint_step(p) for p in step_checkpoints(run)] == [second]  # the first resume point went
    assert json.loads((run / "interrupted.json").read_text()) == {"steps": [second]}
    code, _, err = run_cli_captured(capsys, "average", run)
    assert code == 2 and "its only checkpoints were written at a stop signal or before the first update" in err
    assert run_cli("train", "--save-dir", run, *common, "--max-steps", second) == 0  # nothing left to train
    assert not (run / "interrupted.json").exists()  # the run's last checkpoint now
    assert run_cli("average", run, "--last", 2) == 0


# -- averaging -------------------------------------------------------------------------------

@pytest.mark.slow
def test_average_last_checkpoints(corpus, tmp_path, capsys):
    src, tgt = corpus
    run = tmp_path / "run"
    assert run_cli("train", "--save-dir", run, "--train-src", src, "--train-tgt", tgt, *TINY,
                   "--max-steps", "4", "--save-every", "1", "--keep-last", "3") == 0
    paths = step_checkpoints(run)
    assert [p.name for p in paths] == [f"checkpoint_0000000{i}.pt" for i in (2, 3, 4)]
    assert run_cli("average", run, "--last", "2") == 0
    averaged = read_checkpoint(run / "averaged.pt")["model"]
    a, b = read_checkpoint(paths[-2])["model"], read_checkpoint(paths[-1])["model"]
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(averaged[k], (a[k].double() + b[k].double()).div(2).float())
    assert "averaged.pt" in capsys.readouterr().out
    assert run_cli("average", tmp_path / "nothing") == 2


@pytest.mark.slow
def test_averaged_checkpoint_records_its_steps(corpus, tmp_path):
    """extra["steps"]: the step numbers averaged, ascending (export reads them); uneven save
    intervals, so they cannot be guessed from the checkpoint count."""
    src, tgt = corpus
    run = tmp_path / "run"
    assert run_cli("train", "--save-dir", run, "--train-src", src, "--train-tgt", tgt, *TINY,
                   "--max-steps", "5", "--save-every", "2") == 0
    assert [read_checkpoint(p)["train_state"]["step"] for p in step_checkpoints(run)] == [2, 4, 5]
    assert run_cli("average", run, "--last", "2", "--out", tmp_path / "avg.pt") == 0
    extra = read_checkpoint(tmp_path / "avg.pt")["extra"]
    assert extra["steps"] == [4, 5]
    assert extra["averaged"] == ["checkpoint_00000004.pt", "checkpoint_00000005.pt"] and extra["step"] == 5
    assert run_cli("average", run, "--last", "9") == 0
    assert read_checkpoint(run / "averaged.pt")["extra"]["steps"] == [2, 4, 5]


def _run_of(random_checkpoint: Path, run: Path, steps: dict[str, int]) -> list[str]:
    """A save dir of checkpoints whose parameters are all their step (names -> steps); the parameter names."""
    from model.checkpoint import load_model, save_checkpoint

    model, spm, _ = load_model(random_checkpoint)
    run.mkdir()
    for name, step in steps.items():
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        save_checkpoint(run / name, model, spm, extra={"step": step})
    return [name for name, _ in model.named_parameters()]


def test_average_best_ends_at_the_best_weights_validated_between_saves(random_checkpoint, tmp_path):
    """--valid-every 3 with --save-every 4: the best (step 6) is in checkpoint_best.pt only. `--best 2` averaged
    checkpoint 4 alone (with a warning of too few checkpoints); the window now ends at the best weights."""
    from model.checkpoint import BEST

    run = tmp_path / "run"
    names = _run_of(random_checkpoint, run, {"checkpoint_00000004.pt": 4, "checkpoint_00000008.pt": 8, BEST: 6})
    assert run_cli("average", run, "--best", 2, "--out", tmp_path / "avg.pt") == 0
    avg = read_checkpoint(tmp_path / "avg.pt")
    assert avg["extra"]["steps"] == [4, 6]
    assert all(torch.allclose(avg["model"][n], torch.full_like(avg["model"][n], 5.0)) for n in names)
    for step in (4, 8):  # only the best's weights left
        (run / f"checkpoint_0000000{step}.pt").unlink()
    assert run_cli("average", run, "--best", 1, "--out", tmp_path / "best.pt") == 0
    assert read_checkpoint(tmp_path / "best.pt")["extra"]["steps"] == [6]


def test_a_save_dir_resolves_to_its_average_whatever_the_files_times(random_checkpoint, tmp_path):
    """export and tune-decoding of a save dir took the latest step checkpoint over averaged.pt when a copy
    (cp -r, rsync without -t) left the step checkpoint newer; now only another newest step checkpoint does (a
    later step, or the same step written again after a rollback)."""
    import os

    from model.checkpoint import resolve_checkpoint

    run = tmp_path / "run"
    _run_of(random_checkpoint, run, {"checkpoint_00000004.pt": 4, "checkpoint_00000008.pt": 8})
    assert run_cli("average", run, "--last", 2) == 0
    os.utime(run / "checkpoint_00000008.pt", (2e9, 2e9))  # newer than averaged.pt, as a copy can leave it
    assert resolve_checkpoint(run) == run / "averaged.pt"
    # a rollback: step 8 deleted and trained again (on other data): another file, though the same step
    _run_of(random_checkpoint, tmp_path / "again", {"checkpoint_00000008.pt": 9})
    (tmp_path / "again" / "checkpoint_00000008.pt").replace(run / "checkpoint_00000008.pt")
    os.utime(run / "averaged.pt", (3e9, 3e9))
    assert resolve_checkpoint(run) == run / "checkpoint_00000008.pt"
    _run_of(random_checkpoint, tmp_path / "more", {"checkpoint_00000012.pt": 12})
    (tmp_path / "more" / "checkpoint_00000012.pt").rename(run / "checkpoint_00000012.pt")  # training went on
    assert resolve_checkpoint(run) == run / "checkpoint_00000012.pt"


def test_a_save_dir_holding_only_step_0_is_refused_where_a_checkpoint_is_resolved(random_checkpoint, tmp_path,
                                                                                   capsys):
    """A run stopped before its first update (--max-time 1s) holds checkpoint_00000000.pt, a resume point: train
    said so and average refused it, but export wrote a model dir of untrained weights (verified, passing) and
    tune-decoding tuned them, without a word. Named as a file, it is still taken."""
    import shutil

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(random_checkpoint, run / "checkpoint_00000000.pt")
    text = tmp_path / "lines.txt"
    text.write_text("ab cd\n")
    for args in (("export", run, "--out", tmp_path / "m", "--no-tensorrt"),
                 ("tune-decoding", run, "--src", text, "--ref", text)):
        assert run_cli(*args) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {run}: its one checkpoint is step 0, written before any update") and \
            "rerun the train command" in err, err
    assert not (tmp_path / "m").exists()
    assert run_cli("export", run / "checkpoint_00000000.pt", "--out", tmp_path / "m", "--no-tensorrt",
                   "--max-src-len", 16, "--max-tgt-len", 16, "--reference-lines", 0) == 0


def test_average_refuses_last_and_best_together(tmp_path, capsys):
    """--last and --best choose the checkpoints two ways; given both, the average used --best alone."""
    run = tmp_path / "run"
    run.mkdir()
    assert run_cli("average", run, "--last", "2", "--best", "2", "--out", tmp_path / "avg.pt") == 2
    assert "--last and --best choose the checkpoints two ways: give one" in capsys.readouterr().err
    assert not (tmp_path / "avg.pt").exists()


# -- the built-in default --------------------------------------------------------------------

def test_builtin_corpus_needs_reordering_and_agreement():
    lex = synthetic.build_lexicon()
    assert lex == synthetic.build_lexicon()  # fixed on every machine
    src, tgt = synthetic.generate(300, seed=1, lex=lex)
    assert (src, tgt) == synthetic.generate(300, seed=1, lex=lex)
    verbs = {t for _, t in lex.verbs}
    verb_first = verb_last = 0
    for s, t in zip(src, tgt):
        words = t.split()
        last = words[-2] if words[-1] == "nu" else words[-1]
        verb_last += any(last.startswith(v) for v in verbs)
        verb_first += any(w in {sv for sv, _ in lex.verbs} for w in s.split()[2:4])
    assert verb_last == len(tgt)  # SOV target: every sentence ends with its verb
    assert verb_first > 100  # SVO source: the verb comes early
    # Agreement: the same source noun gets different target articles by number/case.
    articles = {t.split()[0] for s, t in zip(src, tgt) if s.startswith("da ")}
    assert len(articles) > 3


@pytest.mark.slow
def test_train_without_data_uses_the_builtin_corpus(tmp_path, capsys):
    run = tmp_path / "builtin"
    assert run_cli("train", "--save-dir", run, "--preset", "tiny", "--builtin-pairs", "200",
                   "--max-steps", "3", "--no-progress", "--threads", "1") == 0
    assert (run / "data" / "train.src").read_text().count("\n") == 200
    assert last_step(run) == 3
    valid = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["event"] == "valid"]
    assert valid and "bleu" in valid[-1]


# -- data: caching, filtering, batches -----------------------------------------------------

@pytest.mark.slow
def test_second_run_reuses_tokenizer_and_encoded_corpus(corpus, tmp_path, caplog):
    src, tgt = corpus
    run = tmp_path / "run"
    args = ["--save-dir", run, "--train-src", src, "--train-tgt", tgt, *TINY]
    assert run_cli("train", *args, "--max-steps", "1") == 0
    spm_mtime = (run / "spm.model").stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert run_cli("train", *args, "--max-steps", "2") == 0
    assert "trained SentencePiece" not in caplog.text  # resumed: the checkpoint's tokenizer
    assert "using the encoded corpus cached" in caplog.text
    # A fresh run in the same dir (no checkpoint yet) also reuses the cached tokenizer.
    for path in step_checkpoints(run):
        path.unlink()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert run_cli("train", *args, "--max-steps", "1") == 0
    assert "using the cached SentencePiece model" in caplog.text and "trained SentencePiece" not in caplog.text
    assert "using the encoded corpus cached" in caplog.text
    assert (run / "spm.model").stat().st_mtime_ns == spm_mtime


@pytest.mark.slow
def test_length_filter_is_counted(tmp_path, caplog):
    src, tgt = make_parallel(60, seed=2)
    src[5] = " ".join(["katze"] * 80)
    tgt[9] = ""
    s, t = write_parallel(tmp_path, "c", src, tgt)
    with caplog.at_level(logging.INFO):
        assert run_cli("train", "--save-dir", tmp_path / "run", "--train-src", s, "--train-tgt", t, *TINY,
                       "--max-len", "40", "--max-steps", "1") == 0
    assert "60 pairs read, 1 with an empty side dropped, 1 longer than --max-len 40 tokens dropped, 58 kept" \
        in caplog.text


def test_batches_respect_the_budget_and_are_deterministic():
    import numpy as np

    rng = np.random.default_rng(0)
    src_lens, tgt_lens = rng.integers(1, 30, 500), rng.integers(1, 30, 500)
    batches = make_batches(src_lens, tgt_lens, batch_tokens=200, seed=1, epoch=1)
    assert sorted(np.concatenate(batches).tolist()) == list(range(500))  # every sentence once
    for b in batches:
        longest = int(np.maximum(src_lens[b], tgt_lens[b]).max()) + 1
        assert longest * len(b) <= 200
    again = make_batches(src_lens, tgt_lens, batch_tokens=200, seed=1, epoch=1)
    assert all(np.array_equal(x, y) for x, y in zip(batches, again))
    other = make_batches(src_lens, tgt_lens, batch_tokens=200, seed=1, epoch=2)
    assert any(not np.array_equal(x, y) for x, y in zip(batches, other))


# -- bad input: one clear line, exit 2, nothing that looks like a checkpoint ------------------

def _fails(capsys, tmp_path, *args) -> str:
    run = tmp_path / "bad-run"
    code = run_cli("train", "--save-dir", run, *TINY, "--max-steps", "2", *args)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert not run.exists()  # made for the run and refused before a file was written there: gone (it was left)
    return lines[0]


def test_mismatched_line_counts_name_both_files(tmp_path, capsys):
    s, t = write_parallel(tmp_path, "c", ["a b", "c d", "e f"], ["x y", "z w"])
    err = _fails(capsys, tmp_path, "--train-src", s, "--train-tgt", t)
    assert str(s) in err and str(t) in err and "3 lines" in err and "2" in err


def test_missing_and_empty_files(tmp_path, capsys):
    s, t = write_parallel(tmp_path, "c", ["a b"], ["x y"])
    err = _fails(capsys, tmp_path, "--train-src", tmp_path / "nope.src", "--train-tgt", t)
    assert f"--train-src {tmp_path / 'nope.src'}: no such file" in err  # its option, and no word of pipes
    assert "more than once" not in err
    empty = tmp_path / "empty.tgt"
    empty.write_text("\n\n")
    err = _fails(capsys, tmp_path, "--train-src", s, "--train-tgt", empty)
    assert "empty.tgt" in err and "empty" in err


def test_invalid_utf8_names_file_and_line(tmp_path, capsys):
    s, t = write_parallel(tmp_path, "c", ["a b", "c d", "e f"], ["x y", "z w", "v u"])
    t.write_bytes(b"x y\nz \xff w\nv u\n")
    err = _fails(capsys, tmp_path, "--train-src", s, "--train-tgt", t)
    assert f"{t}:2: invalid UTF-8" in err and "fix the file" in err
    assert "pass" not in err  # train has no option that replaces invalid bytes: it names none


def test_impossible_model_config(corpus, tmp_path, capsys):
    s, t = corpus
    err = _fails(capsys, tmp_path, "--train-src", s, "--train-tgt", t, "--d-model", "30", "--n-heads", "4")
    assert "--d-model (30) must be divisible by --n-heads (4)" in err
    err = _fails(capsys, tmp_path, "--train-src", s, "--train-tgt", t, "--update-freq", "0")
    assert "--update-freq must be at least 1" in err


def test_a_refused_run_leaves_none_of_the_directories_it_made(tmp_path, capsys):
    """A refused run into a new runs/n1/n2/n3 removed n3 and left n1/n2 behind."""
    s, t = write_parallel(tmp_path, "c", ["a b", "c d"], ["x y"])  # unequal lines: refused once read
    (tmp_path / "runs").mkdir()
    code = run_cli("train", "--save-dir", tmp_path / "runs" / "n1" / "n2" / "n3", "--train-src", s, "--train-tgt", t,
                   *TINY, "--max-steps", "2")
    assert code == 2 and "lines" in capsys.readouterr().err
    assert list((tmp_path / "runs").iterdir()) == []  # runs existed: it stays


def test_only_torchrun_s_rank_0_makes_the_save_dir(tmp_path, monkeypatch):
    """Every rank made the save dir: where rank 1 made it first, rank 0 found it made by another and, its run
    refused (a corpus of unequal lines), left it behind (8 of 17 torchrun tries). Rank 0 alone makes it now."""
    from pipeline.training import TrainOptions, trainer

    there: list[bool] = []

    def refused(device: str) -> None:  # the group coming up (where rank 0 may not have started yet), then the
        there.append((tmp_path / "run").exists())  # corpus read and refused
        raise UserError("unequal lines")

    s, t = write_parallel(tmp_path, "c", ["a b", "c d"], ["x y"])
    monkeypatch.setattr(trainer, "init_distributed", refused)
    opts = TrainOptions(save_dir=tmp_path / "run", train_src=s, train_tgt=t, preset="tiny", vocab_size=64)
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(UserError):
            trainer.train(opts)
    assert there == [False, True]  # rank 1 made nothing; rank 0 made it ...
    assert not (tmp_path / "run").exists()  # ... and, refused, removed it


def test_options_dropped_or_refused_late_are_refused_first(corpus, tmp_path, capsys):
    """--builtin-pairs beside a corpus was dropped in silence; --vocab-size 5 was refused only once the corpus was
    read (0 and 5 said different minimums)."""
    s, t = corpus
    err = _fails(capsys, tmp_path, "--train-src", s, "--train-tgt", t, "--builtin-pairs", "100")
    assert "--builtin-pairs sizes the built-in corpus; with --train-src/--train-tgt leave it out" in err
    for size in ("0", "5", "1", "-3"):  # (1 and -3 listed three special ids' problems before this one)
        err = _fails(capsys, tmp_path, "--train-src", tmp_path / "not-read.src", "--train-tgt", t, "--vocab-size", size)
        assert err.startswith(f"error: --vocab-size must be in 8..{1 << 20} (got {size})") and "bos_id" not in err


def test_a_side_given_as_its_own_target_or_validation_on_the_training_set_is_warned_of(corpus, tmp_path, caplog):
    """The same file as source and target (a model that learns to copy), validation files that are the training
    files (BLEU and checkpoint_best.pt of text trained on): trained without a word."""
    s, t = corpus
    with caplog.at_level(logging.WARNING, logger="pipeline.training.trainer"):
        assert run_cli("train", "--save-dir", tmp_path / "run", "--train-src", s, "--train-tgt", s,
                       "--valid-src", s, "--valid-tgt", s, *TINY, "--max-steps", "1") == 0
    said = [r.getMessage() for r in caplog.records if "same contents" in r.getMessage()]
    assert said == ["--train-src and --train-tgt have the same contents: the model learns to copy its input",
                    "--valid-src and --valid-tgt have the same contents: validation BLEU measures copying",
                    "--train-src and --valid-src have the same contents: validation BLEU and checkpoint_best.pt "
                    "measure text trained on, not held out"]
    empty = tmp_path / "empty.txt"  # two empty validation files: refused as empty, with no word of copying first
    empty.write_text("")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipeline.training.trainer"):
        assert run_cli("train", "--save-dir", tmp_path / "run2", "--train-src", s, "--train-tgt", t,
                       "--valid-src", empty, "--valid-tgt", empty, *TINY, "--max-steps", "1") == 2
    assert not [r for r in caplog.records if "same contents" in r.getMessage()]


@pytest.mark.slow
def test_resuming_with_a_different_config_is_refused(corpus, tmp_path, capsys):
    s, t = corpus
    run = tmp_path / "run"
    assert run_cli("train", "--save-dir", run, "--train-src", s, "--train-tgt", t, *TINY, "--max-steps", "1") == 0
    before = step_checkpoints(run)
    capsys.readouterr()
    code = run_cli("train", "--save-dir", run, "--train-src", s, "--train-tgt", t, *TINY, "--max-steps", "2",
                   "--d-model", "64")
    err = capsys.readouterr().err
    assert code == 2 and "different config" in err and "--d-model 32 -> 64" in err
    assert step_checkpoints(run) == before
    # without --preset (the base preset's fields differ): the refusal names the preset the run was trained with
    without = [a for a in TINY if a not in ("--preset", "tiny")]
    code = run_cli("train", "--save-dir", run, "--train-src", s, "--train-tgt", t, *without, "--max-steps", "2")
    err = capsys.readouterr().err
    assert code == 2 and "--d-model 32 -> 512" in err and "rerun with the original options (its run's --preset: " \
        "tiny)" in err, err


def test_help_explains_every_option(capsys):
    assert run_cli("train", "--help") == 0
    out = capsys.readouterr().out
    for option in ("--train-src", "--save-dir", "--preset", "--batch-tokens", "--update-freq", "--warmup",
                   "--label-smoothing", "--keep-last", "--precision", "torchrun"):
        assert option in out


@pytest.mark.slow
def test_non_finite_loss_skips_updates_then_stops_with_a_clear_error(corpus, tmp_path, capsys, monkeypatch):
    """A NaN loss (injected into the real loss function) never reaches the weights: the update
    is skipped, and after --max-nonfinite in a row training stops naming what to change."""
    import pipeline.training.step as step_module

    real = step_module.token_losses

    def poisoned(logits, target, label_smoothing):
        loss, nll = real(logits, target, label_smoothing)
        return loss * float("nan"), nll

    s, t = corpus
    run = tmp_path / "run"
    assert run_cli("train", "--save-dir", run, "--train-src", s, "--train-tgt", t, *TINY, "--max-steps", "2") == 0
    before = weights(run)
    monkeypatch.setattr(step_module, "token_losses", poisoned)
    capsys.readouterr()
    code = run_cli("train", "--save-dir", run, "--train-src", s, "--train-tgt", t, *TINY, "--max-steps", "50",
                   "--max-nonfinite", "3", "--save-every", "1")
    err = capsys.readouterr().err
    assert code == 2 and "the loss was not finite for 3 updates in a row at step 3" in err
    assert last_step(run) == 2  # nothing was saved from the poisoned updates
    assert all(torch.equal(before[k], weights(run)[k]) for k in before)


@pytest.mark.slow
def test_progress_bar_only_on_a_terminal(corpus, tmp_path, capsys):
    """The bar is on by default, but stderr redirected to a log (here captured: not a terminal) gets no
    carriage-return redraws, which would grow a long run's log by megabytes; the log lines stay."""
    src, tgt = corpus
    args = [a for a in TINY if a != "--no-progress"]
    assert run_cli("train", "--save-dir", tmp_path / "run", "--train-src", src, "--train-tgt", tgt, *args,
                   "--max-steps", "2") == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "step/s" not in err and "2/2" not in err, err
    assert last_step(tmp_path / "run") == 2


def test_average_best_says_why_there_is_no_best_and_counts_up_to_it(random_checkpoint, tmp_path, capsys, caplog):
    """A run with a validation set stopped (--max-time) before its first --valid-every: "--best needs a run with
    validation (--valid-src/--valid-tgt)", which it had (scripts/multi30k.sh with a short TIME failed so). Five
    checkpoints with the best at the fourth: "only 4 checkpoint(s) in DIR", which held five."""
    import json
    import logging

    from model.checkpoint import BEST

    run = tmp_path / "run"
    _run_of(random_checkpoint, run, {f"checkpoint_0000000{s}.pt": s for s in (1, 2, 3, 4, 5)})
    (run / "config.json").write_text(json.dumps({"training": {"valid_src": "val.de"},
                                                 "resolved_options": {"valid_every": 400}}))
    code, _, err = run_cli_captured(capsys, "average", run, "--best", 1)
    assert_one_line_error(code, err, "the run stopped before its first validation (every 400 updates)", "--last")
    (run / "config.json").write_text(json.dumps({"training": {"valid_src": None}, "resolved_options": {}}))
    code, _, err = run_cli_captured(capsys, "average", run, "--best", 1)
    assert_one_line_error(code, err, "--best needs a run with validation (--valid-src/--valid-tgt)")
    _run_of(random_checkpoint, tmp_path / "b", {BEST: 4})
    (tmp_path / "b" / BEST).rename(run / BEST)
    with caplog.at_level(logging.WARNING):
        assert run_cli("average", run, "--best", 5, "--out", tmp_path / "avg.pt") == 0
    assert "only 4 checkpoint(s) in" in caplog.text and "up to the best (step 4)" in caplog.text


def test_numbers_that_failed_late_or_with_a_traceback_are_refused_first(corpus, tmp_path, capsys):
    """An audit's findings: a --valid-beam the vocabulary cannot feed failed with a reshape traceback at the first
    validation (the updates before it lost); --spm-nbest past SentencePiece's 512, --lr-scale 1e308 and a --warmup of
    309 digits were tracebacks after the corpus was prepared; a --decay-time shorter than --max-time trained the
    rest of the run at a learning rate of zero."""
    s, t = corpus
    files = ("--train-src", s, "--train-tgt", t)
    valid = ("--valid-src", s, "--valid-tgt", t)
    err = _fails(capsys, tmp_path, *files, *valid, "--valid-beam", "64")
    assert "--valid-beam 64 needs 128 candidates a step, more than the vocabulary's" in err, err
    assert "--spm-nbest must be at most 512 (got 513)" in _fails(capsys, tmp_path, *files, "--spm-alpha", "0.1",
                                                                 "--spm-nbest", "513")
    assert "--lr-scale must be in (0, 1e+06] (got 1e+308)" in _fails(capsys, tmp_path, *files, "--lr-scale", "1e308")
    assert "--warmup must be at most 1e+12" in _fails(capsys, tmp_path, *files, "--warmup", "1" + "0" * 320)
    err = _fails(capsys, tmp_path, *files, "--lr-schedule", "linear", "--max-time", "8s", "--decay-time", "1s")
    assert "--decay-time 1s is shorter than --max-time 8s: the learning rate would be zero" in err, err


def test_a_decay_time_shorter_than_the_run_is_warned_of(corpus, tmp_path, caplog):
    """--decay-time alone (no --max-time): the run went on to --max-steps at a learning rate of zero, without a word."""
    s, t = corpus
    with caplog.at_level(logging.WARNING, logger="pipeline.training.loop"):
        assert run_cli("train", "--save-dir", tmp_path / "run", "--train-src", s, "--train-tgt", t, *TINY,
                       "--warmup", "2", "--max-steps", "60", "--lr-schedule", "linear", "--decay-time", "0.01s") == 0
    said = [r.getMessage() for r in caplog.records if "--decay-time" in r.getMessage()]
    assert said and "but the run goes on to --max-steps 60 at a learning rate of zero" in said[0], said


def test_a_save_dir_holding_someone_elses_config_json_is_refused(corpus, tmp_path, capsys):
    """`--save-dir .` in a project replaced the project's config.json without a word."""
    s, t = corpus
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.json").write_text('{"name": "my-app"}\n')
    code = run_cli("train", "--save-dir", project, "--train-src", s, "--train-tgt", t, *TINY, "--max-steps", "1")
    assert code == 2 and "config.json: a config.json that no `pipeline train` wrote" in capsys.readouterr().err
    assert (project / "config.json").read_text() == '{"name": "my-app"}\n' and not step_checkpoints(project)

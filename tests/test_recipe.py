"""The recipe levers of `pipeline train`: --max-time over resumes, subword sampling (training
only, exact on resume and across ranks), the best checkpoint and averaging its window,
TensorBoard events, per-preset regularisation, and decoding options chosen on validation."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import TINY, cli_env, make_parallel, run_cli, train_until_sigterm, weights, write_parallel

from model.checkpoint import BEST, read_checkpoint, step_checkpoints
from model.errors import UserError
from pipeline.corpus.data import ShardedBatches, iter_eval_batches, prepare_data
from pipeline.corpus.sampling import SubwordSampler
from pipeline.training import TrainOptions, learning_rate, resolve_options, train
from pipeline.training.checkpointing import prune
from pipeline.training.options import parse_duration
from runtime.torch_backend import open_checkpoint
from runtime.translate import translate_lines


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    src, tgt = make_parallel(120, seed=3)
    return write_parallel(tmp_path_factory.mktemp("corpus"), "train", src, tgt)


def tiny_opts(save_dir: Path, corpus: tuple[Path, Path], **changes) -> TrainOptions:
    values = dict(save_dir=save_dir, train_src=corpus[0], train_tgt=corpus[1], preset="tiny", vocab_size=64,
                  batch_tokens=256, warmup=20, threads=1, progress=False, max_steps=100000,
                  save_every=100000, log_every=1)
    return TrainOptions(**{**values, **changes})


def train_state(save_dir: Path) -> dict:
    return read_checkpoint(step_checkpoints(save_dir)[-1])["train_state"]


# -- --max-time ------------------------------------------------------------------------------

def test_durations_parse_and_bad_ones_are_named():
    assert parse_duration("90s") == 90 and parse_duration("60m") == 3600
    assert parse_duration("1h30m") == 5400 and parse_duration("1.5h") == 5400 and parse_duration("45") == 45
    for bad in ("", "soon", "10x", "0s", "-5"):
        with pytest.raises(ValueError, match="--max-time"):
            parse_duration(bad)


@pytest.mark.slow
def test_time_budget_stops_with_a_checkpoint_and_resume_spends_only_the_rest(corpus, tmp_path):
    run = tmp_path / "run"
    started = time.time()
    train(tiny_opts(run, corpus, max_time="8s"), started=started)
    took = time.time() - started
    first = train_state(run)
    assert first["step"] > 0 and 8 <= first["elapsed_s"] <= took
    # The same budget again: already spent, so nothing is trained and nothing rewritten.
    before = [p.stat().st_mtime_ns for p in step_checkpoints(run)]
    train(tiny_opts(run, corpus, max_time="8s"), started=time.time())
    assert train_state(run)["step"] == first["step"]
    assert [p.stat().st_mtime_ns for p in step_checkpoints(run)] == before
    # A larger budget continues for the remainder only, and the time adds up over runs.
    started = time.time()
    train(tiny_opts(run, corpus, max_time="12s"), started=started)
    second = train_state(run)
    assert second["step"] > first["step"]
    assert 12 <= second["elapsed_s"] <= first["elapsed_s"] + (time.time() - started)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in metrics if m["event"] == "train"]
    assert steps == list(range(1, second["step"] + 1))


@pytest.mark.slow
def test_time_budget_exits_0_with_a_clear_line_counting_from_process_start(corpus, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipeline", "train", "--save-dir", str(run), "--train-src", str(corpus[0]),
           "--train-tgt", str(corpus[1]), *TINY, "--max-steps", "100000", "--max-time", "4s"]
    done = subprocess.run(cmd, env=cli_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "time budget reached" in done.stderr
    # Python and torch start-up count too: the recorded time covers the whole process.
    assert train_state(run)["elapsed_s"] >= 4
    assert run_cli("train", "--save-dir", run, "--train-src", corpus[0], "--train-tgt", corpus[1], *TINY,
                   "--max-time", "1h2", "--max-steps", "9") == 2


@pytest.mark.slow
def test_time_budget_validates_the_last_update_within_the_budget(corpus, tmp_path):
    """A run that validated on its schedule validates its last update too when --max-time stops
    it (keeping back the time a validation takes), so the updates after the last scheduled
    validation can become checkpoint_best.pt; a run that never validated in this process does
    not (it has no measure of how long that takes)."""
    run = tmp_path / "run"
    valid = dict(valid_src=corpus[0], valid_tgt=corpus[1], valid_max_sentences=20)
    train(tiny_opts(run, corpus, max_time="8s", valid_every=7, **valid), started=time.time())
    state = train_state(run)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    validated = [m["step"] for m in metrics if m["event"] == "valid"]
    assert len(validated) >= 2 and validated[-1] == state["step"]
    assert all(step % 7 == 0 for step in validated[:-1])
    assert state["best_step"] in validated and read_checkpoint(run / BEST)["extra"]["step"] == state["best_step"]
    # Resumed with a larger budget but no validation before it ends: nothing validated at the end.
    train(tiny_opts(run, corpus, max_time="10s", valid_every=100000, **valid), started=time.time())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert train_state(run)["step"] > state["step"]
    assert [m["step"] for m in metrics if m["event"] == "valid"] == validated


# -- --lr-schedule linear ------------------------------------------------------------------

def test_linear_schedule_warms_up_like_the_papers_then_falls_straight_to_zero():
    d, warmup, end = 256, 100, 1100
    peak = learning_rate(warmup, d, warmup)
    for step in (1, 50, warmup):  # warmup: identical to rsqrt
        assert learning_rate(step, d, warmup, 0.8, "linear", end) == learning_rate(step, d, warmup, 0.8)
    assert learning_rate(600, d, warmup, 1.0, "linear", end) == pytest.approx(peak / 2)
    assert learning_rate(1050, d, warmup, 1.0, "linear", end) == pytest.approx(peak / 20)
    assert learning_rate(end, d, warmup, 1.0, "linear", end) == 0.0
    assert learning_rate(end + 50, d, warmup, 1.0, "linear", end) == 0.0  # stays at zero
    assert learning_rate(500, d, warmup, 1.0, "linear", None) == peak  # horizon not known yet
    assert learning_rate(4 * warmup, d, warmup) == pytest.approx(peak / 2)  # rsqrt untouched


def lrs(run: Path) -> dict[int, float]:
    return {m["step"]: m["lr"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if m["event"] == "train"}


@pytest.mark.slow
def test_linear_schedule_under_a_time_budget_is_estimated_once_and_kept_on_resume(corpus, tmp_path):
    run, d_model, warmup = tmp_path / "run", 32, 2
    opts = dict(lr_schedule="linear", decay_time="60s", warmup=warmup)
    # Stop early (--max-time 8s) while decaying over 60s: the horizon is estimated after warmup
    # and 20 measured updates, and recorded in the checkpoint.
    train(tiny_opts(run, corpus, max_time="8s", **opts), started=time.time())
    first = train_state(run)
    assert first["step"] > 20, "too slow to measure its speed in 8 s"
    horizon = first["decay_steps"]
    assert first["decay_time_s"] == 60 and horizon > first["step"]
    # Resuming with the same --decay-time keeps it: the schedule is the uninterrupted run's.
    train(tiny_opts(run, corpus, max_time="12s", **opts), started=time.time())
    second = train_state(run)
    assert second["step"] > first["step"] and second["decay_steps"] == horizon
    logged = lrs(run)
    assert sorted(logged) == list(range(1, second["step"] + 1))
    for step, lr in logged.items():  # the peak holds until 20 updates measured the speed
        assert lr == learning_rate(step, d_model, warmup, 1.0, "linear", horizon if step > 20 else None)
    after = [logged[s] for s in sorted(logged) if s >= warmup]
    assert after == sorted(after, reverse=True) and after[-1] < after[0]
    # A different budget is a new estimate, from the speed recorded so far.
    train(tiny_opts(run, corpus, max_time="20s", lr_schedule="linear", decay_time="20s", warmup=warmup),
          started=time.time())
    third = train_state(run)
    assert third["decay_time_s"] == 20 and third["decay_steps"] < horizon


@pytest.mark.slow
def test_linear_schedule_resumes_bit_exactly_after_sigterm(corpus, tmp_path):
    """Without a time budget the horizon is --max-steps, so the same command rerun after a stop
    gives the uninterrupted run: weights and every step's learning rate."""
    common = ["--train-src", str(corpus[0]), "--train-tgt", str(corpus[1]), *TINY, "--dropout", "0.1",
              "--save-every", "100000", "--log-every", "1", "--lr-schedule", "linear", "--max-steps", "150"]
    run, straight = tmp_path / "run", tmp_path / "straight"
    train_until_sigterm(run, common, tmp_path)
    assert 3 <= train_state(run)["step"] < 150
    assert run_cli("train", "--save-dir", run, *common) == 0
    assert run_cli("train", "--save-dir", straight, *common) == 0
    a, b = weights(straight), weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert lrs(straight) == lrs(run) and lrs(run)[150] == 0.0


def test_a_linear_schedule_resumed_with_another_max_steps_says_how_it_changes(corpus, tmp_path, caplog):
    """--lr-schedule linear decays over --max-steps: a run done at 4 steps rerun with --max-steps 8 jumped from a
    learning rate of 0 back up, in silence (--warmup and --lr-scale changes are refused, --max-time's said)."""
    common = ["--train-src", str(corpus[0]), "--train-tgt", str(corpus[1]), *TINY, "--warmup", "2",
              "--save-every", "100000", "--lr-schedule", "linear"]
    run = tmp_path / "run"
    assert run_cli("train", "--save-dir", run, *common, "--max-steps", "4") == 0
    assert "decayed to zero" not in caplog.text
    assert run_cli("train", "--save-dir", run, *common, "--max-steps", "8") == 0
    assert re.search(r"--lr-schedule linear decayed to zero at --max-steps 4 when this run started; it now decays to "
                     r"step 8: the learning rate moves from 0 to \S+ at step 5", caplog.text), caplog.text


@pytest.mark.slow
def test_schedule_options_are_checked_and_change_the_experiment(corpus, tmp_path, capsys):
    common = ["--train-src", corpus[0], "--train-tgt", corpus[1], *TINY, "--max-steps", "2"]
    assert run_cli("train", "--save-dir", tmp_path / "a", *common, "--decay-time", "10m") == 2
    assert "needs --lr-schedule linear" in capsys.readouterr().err
    assert run_cli("train", "--save-dir", tmp_path / "a", *common, "--lr-schedule", "linear",
                   "--decay-time", "soon") == 2
    assert "--decay-time 'soon' is not a duration" in capsys.readouterr().err
    # SentencePiece's lattice sampling draws differently in each process: refused, with what a run begun so does
    assert run_cli("train", "--save-dir", tmp_path / "a", *common, "--spm-alpha", "0.1", "--spm-nbest", "-1") == 2
    assert "a run started with -1 cannot resume exactly either" in capsys.readouterr().err
    run = tmp_path / "b"
    assert run_cli("train", "--save-dir", run, *common) == 0
    assert run_cli("train", "--save-dir", run, *common, "--lr-schedule", "linear") == 2
    assert "--lr-schedule rsqrt -> linear" in capsys.readouterr().err


# -- subword sampling ------------------------------------------------------------------------

def prepared(corpus, tmp_path, keep_text=True):
    return prepare_data(tmp_path / "prep", corpus[0], corpus[1], corpus[0], corpus[1], vocab_size=64,
                        max_len=256, keep_train_text=keep_text)


def test_sampling_varies_between_epochs_and_is_a_function_of_the_key(corpus, tmp_path):
    data = prepared(corpus, tmp_path)
    sampler = SubwordSampler(data.spm_bytes, data.train, data.train_lines, alpha=0.5, nbest=64, max_len=256)
    indices = torch.arange(len(data.train)).numpy()
    epoch1, epoch2 = sampler(indices, (1, 1, 0)), sampler(indices, (1, 2, 0))
    assert epoch1 != epoch2  # the same sentences, segmented differently
    assert sampler(indices, (1, 1, 0)) == epoch1  # the key alone decides
    # Every sampled segmentation spells the same text as the deterministic one.
    tok = data.tokenizer
    assert tok.decode(epoch2[0]) == tok.decode([list(data.train.src(i)) for i in indices])
    deterministic = [list(data.train.src(i)) for i in indices]
    assert epoch1[0] != deterministic



def test_sampling_draws_the_same_in_another_process(corpus, tmp_path):
    """SentencePiece's own sampler, seeded alike, drew differently in each process (sentencepiece 0.2.3): a resumed
    run and each DDP rank trained on other segmentations than a straight run, for all the "exact" resume."""
    data = prepared(corpus, tmp_path)
    indices = torch.arange(len(data.train)).numpy()
    here = SubwordSampler(data.spm_bytes, data.train, data.train_lines, 0.5, 64, 256)(indices, (1, 2, 3))
    assert here != [[list(data.train.src(i)) for i in indices], [list(data.train.tgt(i)) for i in indices]]
    script = (f"import json, numpy as np\n"
              f"from pipeline.corpus.data import prepare_data\n"
              f"from pipeline.corpus.sampling import SubwordSampler\n"
              f"data = prepare_data({str(tmp_path / 'prep')!r}, {str(corpus[0])!r}, {str(corpus[1])!r}, "
              f"{str(corpus[0])!r}, {str(corpus[1])!r}, vocab_size=64, max_len=256, keep_train_text=True)\n"
              f"s = SubwordSampler(data.spm_bytes, data.train, data.train_lines, 0.5, 64, 256)\n"
              f"print(json.dumps(s(np.arange({len(indices)}), (1, 2, 3))))\n")
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=cli_env(), timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout.splitlines()[-1]) == [[list(map(int, ids)) for ids in side] for side in here]

def test_validation_batches_never_sample(corpus, tmp_path):
    data = prepared(corpus, tmp_path)
    sampler = SubwordSampler(data.spm_bytes, data.train, data.train_lines, alpha=0.5, nbest=64, max_len=256)
    sampler(torch.arange(10).numpy(), (1, 1, 0))  # sampling leaves no state behind in the tokenizer
    assert data.valid is not None
    expected = data.tokenizer.encode(data.valid_src_lines)
    got = {}
    for batch in iter_eval_batches(data.valid, 256):
        for row in batch.src.tolist():
            ids = [t for t in row if t not in (0, 3)]
            got[tuple(ids)] = True
    assert all(tuple(e) in got for e in expected if e)
    assert data.tokenizer.encode(data.valid_src_lines) == expected


def test_sampled_batches_are_the_same_on_any_number_of_ranks(corpus, tmp_path):
    data = prepared(corpus, tmp_path)

    def stream(world: int, rank: int) -> ShardedBatches:
        sampler = SubwordSampler(data.spm_bytes, data.train, data.train_lines, 0.5, 64, 256)
        return ShardedBatches(data.train, 128, 1, world, rank, 1, sampler)

    one, r0, r1 = stream(1, 0), stream(2, 0), stream(2, 1)
    for _ in range(3):
        a, b = one.next_group(), one.next_group()
        (c,), (d,) = r0.next_group(), r1.next_group()
        assert torch.equal(a[0].src, c.src) and torch.equal(b[0].tgt_out, d.tgt_out)


def test_a_resume_with_another_batches_per_update_says_which_update_freq_keeps_it(corpus, tmp_path):
    """The docs say the error says so; it said "resume with the same product" and named no --update-freq."""
    data = prepared(corpus, tmp_path)
    saved = ShardedBatches(data.train, 64, 1, 2, 0, 2, None).state_dict()  # 2 processes x --update-freq 2
    for world, freq, says in ((1, 1, "; here: --update-freq 4"), (3, 1, "; 3 processes cannot make it")):
        with pytest.raises(UserError, match=f"this run has {world * freq} .*{re.escape(says)}$"):
            ShardedBatches(data.train, 64, 1, world, 0, freq, None).load_state_dict(saved)


@pytest.mark.slow
def test_resume_is_bit_exact_with_sampling_on(corpus, tmp_path):
    common = ["--train-src", corpus[0], "--train-tgt", corpus[1], *TINY, "--dropout", "0.1", "--save-every", "100",
              "--spm-alpha", "0.3"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_cli("train", "--save-dir", straight, *common, "--max-steps", "12") == 0
    assert run_cli("train", "--save-dir", resumed, *common, "--max-steps", "5") == 0
    assert run_cli("train", "--save-dir", resumed, *common, "--max-steps", "12") == 0
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Sampling is part of the experiment: the same save dir without it is refused.
    assert run_cli("train", "--save-dir", resumed, *common[:-2], "--max-steps", "13") == 2
    off = tmp_path / "off"
    assert run_cli("train", "--save-dir", off, *common[:-2], "--max-steps", "12") == 0
    c = weights(off)
    assert not all(torch.equal(a[k], c[k]) for k in a)  # sampling changed what was trained on


# -- best checkpoint and averaging its window ------------------------------------------------

def test_pruning_keeps_the_last_and_the_best_window(tmp_path):
    for step in range(1, 10):
        (tmp_path / f"checkpoint_{step:08d}.pt").write_bytes(b"x")
    (tmp_path / BEST).write_bytes(b"x")
    prune(tmp_path, keep_last=2, best_step=4)
    assert [int(p.name[11:19]) for p in step_checkpoints(tmp_path)] == [3, 4, 8, 9]
    assert (tmp_path / BEST).is_file()
    prune(tmp_path, keep_last=2, best_step=None)
    assert [int(p.name[11:19]) for p in step_checkpoints(tmp_path)] == [8, 9]


def test_a_bleu_tie_makes_the_later_step_the_best(tmp_path, monkeypatch):
    """BLEU 0.00 at every early validation (or equal scores rounded to 2 decimals) kept the first validated step as
    checkpoint_best.pt, so `average --best` and export took the least-trained weights; the later step wins a tie."""
    from pipeline.training import loop

    monkeypatch.setattr(loop, "validate", lambda *args: {"loss": 1.0, "nll": 1.0, "ppl": 2.7, "bleu": 0.0,
                                                         "bleu_signature": "tie", "sentences": 1, "beam": 1})
    src, tgt = make_parallel(40, seed=7)
    files = write_parallel(tmp_path / "data", "train", src, tgt)
    run = tmp_path / "run"
    train(tiny_opts(run, files, valid_src=files[0], valid_tgt=files[1], max_steps=6, warmup=2, save_every=2,
                    valid_every=2))
    assert read_checkpoint(run / BEST)["extra"]["step"] == 6 and train_state(run)["best_step"] == 6


@pytest.mark.slow
def test_best_checkpoint_follows_validation_bleu_and_average_best_uses_its_window(tmp_path):
    src, tgt = make_parallel(40, seed=7)
    files = write_parallel(tmp_path / "data", "train", src, tgt)
    run = tmp_path / "run"
    train(tiny_opts(run, files, valid_src=files[0], valid_tgt=files[1], max_steps=40, warmup=10,
                    batch_tokens=512, save_every=4, valid_every=4, keep_last=2, log_every=4))
    valid = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["event"] == "valid"]
    best_bleu = max(v["bleu"] for v in valid)
    best_step = [v["step"] for v in valid if v["bleu"] == best_bleu][-1]  # the last to reach it: a tie is won by
    # the step trained longer (the first kept BLEU 0.00 from the first validation on, averaged alone by --best)
    extra = read_checkpoint(run / BEST)["extra"]
    assert (extra["step"], extra["bleu"]) == (best_step, best_bleu)
    assert train_state(run)["best_step"] == best_step and train_state(run)["best_bleu"] == best_bleu
    kept = [read_checkpoint(p)["train_state"]["step"] for p in step_checkpoints(run)]
    assert best_step in kept and kept[-2:] == [36, 40]
    best_weights = read_checkpoint(run / BEST)["model"]
    at_best = read_checkpoint(run / f"checkpoint_{best_step:08d}.pt")["model"]
    assert all(torch.equal(best_weights[k], at_best[k]) for k in at_best)
    assert run_cli("average", run, "--best", "2", "--out", tmp_path / "avg.pt") == 0
    window = [s for s in kept if s <= best_step][-2:]
    assert read_checkpoint(tmp_path / "avg.pt")["extra"]["steps"] == window
    assert run_cli("average", tmp_path / "data", "--best", "2") == 2  # no checkpoint_best.pt there


# -- TensorBoard -----------------------------------------------------------------------------

def scalars(run: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


@pytest.mark.slow
def test_tensorboard_events_are_written_and_not_duplicated_on_resume(corpus, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    opts = dict(valid_src=corpus[0], valid_tgt=corpus[1], valid_every=3, save_every=3, valid_max_sentences=5)
    train(tiny_opts(run, corpus, max_steps=6, **opts))
    lines = len(corpus[0].read_text().splitlines())  # the BLEU line says it scored 5 of them (it did not say)
    said = capsys.readouterr()  # on stderr: stdout is a calling script's own
    assert "BLEU " in said.err and f" of the first 5 of {lines} lines (" in said.err and "BLEU" not in said.out
    for tag in ("train/loss", "train/lr", "train/tokens_per_s", "train/grad_norm"):
        assert scalars(run, tag) == [1, 2, 3, 4, 5, 6]
    assert scalars(run, "valid/bleu") == [3, 6] and scalars(run, "valid/loss") == [3, 6]
    # A run killed after logging steps 4-6 but before their checkpoint: resume from step 3.
    (run / "checkpoint_00000006.pt").unlink()
    train(tiny_opts(run, corpus, max_steps=8, **opts))
    assert scalars(run, "train/loss") == list(range(1, 9))
    assert scalars(run, "valid/bleu") == [3, 6, 8]  # 6 once (purged, then redone), 8 as the last step
    for checkpoint in step_checkpoints(run):  # killed (-9) before its first checkpoint: the rerun starts afresh
        checkpoint.unlink()
    train(tiny_opts(run, corpus, max_steps=4, **opts))
    assert scalars(run, "train/loss") == [1, 2, 3, 4]  # each step was there twice: no purge on a fresh start
    quiet = tmp_path / "quiet"
    train(tiny_opts(quiet, corpus, max_steps=2, tensorboard=False))
    assert not (quiet / "tensorboard").exists()


# -- per-preset regularisation and decoding tuned on validation ------------------------------

def test_dropout_and_label_smoothing_default_per_preset_and_can_be_overridden(tmp_path):
    base = dict(save_dir=tmp_path, train_src=tmp_path / "s", train_tgt=tmp_path / "t")
    big = resolve_options(TrainOptions(**base, preset="big"))
    assert (big.dropout, big.label_smoothing, big.warmup) == (0.3, 0.1, 4000)
    mine = resolve_options(TrainOptions(**base, preset="big", dropout=0.2, label_smoothing=0.2, warmup=99))
    assert (mine.dropout, mine.label_smoothing, mine.warmup) == (0.2, 0.2, 99)


@pytest.mark.slow
def test_tune_decoding_scores_every_combination_on_validation(trained_save_dir, memorise_corpus, capsys, caplog):
    src, tgt = memorise_corpus
    with caplog.at_level(logging.INFO):
        assert run_cli("tune-decoding", trained_save_dir, "--src", src, "--ref", tgt, "--beams", "1,2",
                       "--alphas", "0.6,1.0") == 0
    assert f"{trained_save_dir}: tuning checkpoint_" in caplog.text  # which checkpoint of the save dir
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[1:5]]
    assert sorted((int(r[0]), float(r[1])) for r in rows) == [(1, 0.6), (1, 1.0), (2, 0.6), (2, 1.0)]
    import sacrebleu

    backend, tokenizer = open_checkpoint(trained_save_dir)
    lines, refs = src.read_text().splitlines(), tgt.read_text().splitlines()
    greedy = sacrebleu.corpus_bleu(translate_lines(backend, tokenizer, lines, beam_size=1), [refs]).score
    assert any(int(r[0]) == 1 and float(r[2]) == round(greedy, 2) for r in rows)
    best = max(float(r[2]) for r in rows)
    assert f"(BLEU {best:.2f})" in out.splitlines()[5]
    chosen = out.splitlines()[5].split(": ", 1)[1].split(" (BLEU")[0]  # --beam-size B --alpha A
    assert out.splitlines()[6].endswith(f"pipeline export {trained_save_dir} --out NEW_DIR {chosen}")
    assert run_cli("tune-decoding", trained_save_dir, "--src", src, "--ref", tgt, "--beams", "x") == 2


def test_cpu_training_keeps_freed_memory_unless_the_user_tuned_malloc(monkeypatch):
    from pipeline.training.allocator import keep_freed_memory

    monkeypatch.setenv("MALLOC_MMAP_MAX_", "65536")
    assert keep_freed_memory() is False  # the user's own glibc setting wins
    monkeypatch.delenv("MALLOC_MMAP_MAX_")
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    assert keep_freed_memory() is sys.platform.startswith("linux")

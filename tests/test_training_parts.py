"""The training package's parts on their own: one preset table, one checkpoint name,
the single-process distributed context, and the tokenizer parsed once."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
from typing import Any

import pytest
import torch
from helpers import make_parallel, run_cli, write_parallel

from model.checkpoint import checkpoint_step, step_checkpoint_path, step_checkpoints
from model.config import PRESETS, Preset, preset
from model.errors import UserError
from pipeline.corpus.data import prepare_data
from pipeline.distributed import DistContext, dist_context, init_distributed, on_main, rank0_first, rank_device
from pipeline.training import TrainOptions, describe_defaults, resolve_options


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_has_a_shape_and_training_defaults(name, tmp_path):
    row = PRESETS[name]
    opts = resolve_options(TrainOptions(save_dir=tmp_path, train_src=tmp_path / "s", train_tgt=tmp_path / "t",
                                        preset=name))
    for key, value in row.training_defaults().items():
        assert getattr(opts, key) == value
    cfg = preset(name, vocab_size=100)
    assert (cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.n_enc_layers, cfg.n_dec_layers, cfg.dropout) == \
        (row.d_model, row.n_heads, row.d_ff, row.layers, row.decoder_layers or row.layers, row.dropout)
    assert f"{name}: batch_tokens {row.batch_tokens}, warmup {row.warmup}" in describe_defaults()


def test_help_says_what_the_builtin_corpus_uses_over_any_preset(tmp_path):
    """Without --train-src the built-in corpus' defaults replace the preset's; --help says which."""
    from pipeline.training.options import BUILTIN_DEFAULTS

    opts = resolve_options(TrainOptions(save_dir=tmp_path, preset="tiny"))
    assert (opts.batch_tokens, opts.vocab_size) == (BUILTIN_DEFAULTS["batch_tokens"], BUILTIN_DEFAULTS["vocab_size"])
    assert (f"Without --train-src/--train-tgt (the built-in corpus), whatever the preset (default demo): "
            f"batch_tokens {opts.batch_tokens}, warmup {opts.warmup}, max_steps {opts.max_steps}, "
            f"vocab_size {opts.vocab_size}") in describe_defaults()
    # --valid-every's default is --save-every, a given one too: the built-in 400 kept validating every 400 steps
    assert resolve_options(TrainOptions(save_dir=tmp_path, save_every=10)).valid_every == 10
    assert resolve_options(TrainOptions(save_dir=tmp_path, save_every=10, valid_every=5)).valid_every == 5
    assert resolve_options(TrainOptions(save_dir=tmp_path)).valid_every == BUILTIN_DEFAULTS["valid_every"]


def test_shallow_decoder_preset_and_option():
    """small-fast is small with 1 decoder layer; --decoder-layers overrides the decoder alone, --layers both
    unless --decoder-layers is given too."""
    from pipeline.training.options import model_config

    fast, small = preset("small-fast", vocab_size=100), preset("small", vocab_size=100)
    assert (fast.d_model, fast.n_enc_layers, fast.n_dec_layers) == (small.d_model, small.n_enc_layers, 1)
    base = dict(save_dir="x", preset="small")
    cfg = model_config(TrainOptions(**base, decoder_layers=1), 100)
    assert (cfg.n_enc_layers, cfg.n_dec_layers) == (3, 1)
    cfg = model_config(TrainOptions(**base, layers=4, decoder_layers=2), 100)
    assert (cfg.n_enc_layers, cfg.n_dec_layers) == (4, 2)
    assert model_config(TrainOptions(**base, layers=4), 100).n_dec_layers == 4


def test_a_preset_row_cannot_lack_training_defaults():
    shape_only = dict(d_model=8, n_heads=2, d_ff=16, layers=1, dropout=0.0)
    with pytest.raises(TypeError, match="batch_tokens"):
        Preset(**shape_only)  # type: ignore[call-arg]
    assert {f.name for f in dataclasses.fields(Preset)} >= {"batch_tokens", "warmup", "max_steps", "vocab_size"}


def test_explicit_options_beat_preset_defaults(tmp_path):
    opts = resolve_options(TrainOptions(save_dir=tmp_path, train_src=tmp_path / "s", train_tgt=tmp_path / "t",
                                        preset="tiny", warmup=7, max_steps=30))
    assert (opts.warmup, opts.max_steps, opts.batch_tokens) == (7, 30, PRESETS["tiny"].batch_tokens)
    assert opts.save_every == 30 and opts.valid_every == 30


def test_step_checkpoint_name_round_trips(tmp_path):
    path = step_checkpoint_path(tmp_path, 12)
    assert path == tmp_path / "checkpoint_00000012.pt" and checkpoint_step(path) == 12
    for other in ("checkpoint_best.pt", "averaged.pt", "checkpoint_12.pt.tmp", "checkpoint_.pt"):
        assert checkpoint_step(tmp_path / other) is None
    for name in ("checkpoint_9.pt", "checkpoint_00000010.pt", "checkpoint_best.pt", "averaged.pt"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in step_checkpoints(tmp_path)] == ["checkpoint_9.pt", "checkpoint_00000010.pt"]


def test_single_process_context_runs_everything_locally(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    ctx = init_distributed("cpu")
    assert (ctx.rank, ctx.world_size, ctx.is_main, ctx.distributed, ctx.owns_group) == (0, 1, True, False, False)
    assert ctx.device == torch.device("cpu")
    assert ctx.all_reduce([1.5, 2.0]) == [1.5, 2.0] and ctx.broadcast({"a": 1}) == {"a": 1}
    assert rank0_first(ctx, lambda writer: writer) is True
    assert on_main(ctx, lambda: 5) == 5
    with pytest.raises(UserError, match="--device 'tpu'"):
        init_distributed("tpu")


def test_on_main_keeps_a_user_error_one_line():
    def fail() -> None:
        raise UserError("data.txt: no such file")

    with pytest.raises(UserError, match="^data.txt: no such file$"):
        on_main(DistContext(), fail)


def test_tokenizer_is_parsed_once(tmp_path):
    src, tgt = make_parallel(40, seed=5)
    s, t = write_parallel(tmp_path, "train", src, tgt)
    data = prepare_data(tmp_path / "run", s, t, None, None, vocab_size=40, max_len=64)
    assert data.tokenizer is data.tokenizer
    assert data.tokenizer.vocab_size <= 40


def test_single_process_gather_and_rank_device(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    ctx = DistContext()
    assert ctx.gather("mine") == ["mine"]
    assert rank_device(ctx, None) is None and rank_device(ctx, "cpu") == "cpu"
    assert str(init_distributed(None).device) == "cpu"  # no device picked: no torch needed


def test_train_device_takes_one_gpu_by_number(monkeypatch, tmp_path, capsys):
    """`--device cuda:1` (one GPU of several, as serve-batch takes it) was "invalid choice". It names one GPU for one
    process; under torchrun each rank takes its own. The GPUs are faked here (this machine may have none): what is
    checked is which one is picked and what is refused."""
    from pipeline import distributed

    picked: list[int] = []
    assert run_cli("train", "--save-dir", tmp_path / "r", "--device", "gpu1") == 2
    assert "--device 'gpu1': choose auto, cpu, cuda or cuda:N" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--device cuda:0: no CUDA device is available; use --device cpu"):
        distributed.pick_device("cuda:0", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    assert distributed.pick_device("cuda:1", 0) == torch.device("cuda", 1) and picked == [1]
    assert distributed.pick_device("cuda", 1) == torch.device("cuda", 1)  # torchrun's LOCAL_RANK
    with pytest.raises(UserError, match=r"this machine has 2 CUDA devices \(cuda:0 to cuda:1\)"):
        distributed.pick_device("cuda:2", 0)
    with pytest.raises(UserError, match="each of the 2 processes takes its own GPU"):
        distributed.pick_device("cuda:1", 0, world=2)
    for bad in ("cuda:", "cuda:-1", "cuda:x", "cuda:\u0661"):
        with pytest.raises(UserError, match="choose auto, cpu, cuda or cuda:N"):
            distributed.pick_device(bad, 0)


def _two_ranks(rank: int, port: int, results: Any) -> None:
    """One rank of test_two_ranks_share_rank0s_result_and_error (gloo, CPU)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    calls = []

    def fail() -> None:
        raise UserError("rank 0 could not read data.txt")

    with dist_context("cpu") as ctx:
        shared = on_main(ctx, lambda: calls.append("main") or {"from": ctx.rank})
        order = rank0_first(ctx, lambda writer: (calls.append(f"first:{writer}"), ctx.rank)[1])
        try:
            on_main(ctx, fail)
            error = None
        except UserError as e:
            error = str(e)
        gathered = ctx.gather(ctx.rank * 10)
        total = ctx.all_reduce([ctx.rank + 1.0])
    results.put((rank, shared, order, error, gathered, total, calls))


@pytest.mark.slow
def test_two_ranks_share_rank0s_result_and_error():
    """Rank 0's result and its one-line error reach rank 1, which never runs the work."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = 29500 + os.getpid() % 2000
    procs = [ctx.Process(target=_two_ranks, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (r0, shared0, order0, err0, gathered0, total0, calls0), (r1, shared1, order1, err1, gathered1, total1, calls1) = got
    assert shared0 == shared1 == {"from": 0}
    assert (order0, order1) == (0, 1)
    assert err0 == err1 == "rank 0 could not read data.txt"
    assert gathered0 == [0, 10] and gathered1 is None
    assert total0 == total1 == [3.0]
    assert calls0 == ["main", "first:True"] and calls1 == ["first:False"]


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_token_losses_equal_cross_entropy_in_value_and_gradient(smoothing):
    """The fused loss is F.cross_entropy(label_smoothing, ignore_index=pad, sum) and its NLL."""
    import torch.nn.functional as F

    from model.config import PAD_ID
    from pipeline.training.step import token_losses
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11, dtype=torch.float64, requires_grad=True)
    target = torch.randint(1, 11, (4, 6))
    target[0, 2:] = PAD_ID
    target[3, 5] = PAD_ID
    loss, nll = token_losses(logits, target, smoothing)
    (loss * 0.7).backward()
    flat, flat_target = logits.reshape(-1, 11), target.reshape(-1)
    ref = F.cross_entropy(flat, flat_target, ignore_index=PAD_ID, label_smoothing=smoothing, reduction="sum")
    ref_nll = F.cross_entropy(flat, flat_target, ignore_index=PAD_ID, reduction="sum")
    grad = logits.grad
    logits.grad = None
    (ref * 0.7).backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(nll, ref_nll.detach())
    torch.testing.assert_close(grad, logits.grad)
    assert not nll.requires_grad


def test_train_refuses_more_threads_than_the_machine_takes(tmp_path, capsys):
    from helpers import run_cli

    assert run_cli("train", "--save-dir", tmp_path / "run", "--threads", 10**6) == 2
    assert "--threads 1000000 is more than this machine takes" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_sentencepieces_log_counts_the_lines_it_trained_on(caplog):
    """The log said SentencePiece trained on every line, the ones over its 4192 bytes (which it leaves out) too:
    they are counted apart (a line of 1,100 three-byte characters is one; 4,000 one-byte ones are not)."""
    import logging

    from pipeline.corpus.spm import SPM_MAX_LINE_BYTES, train_sentencepiece

    lines = ["ein kleiner hund", "die katze", "ä" * 2100, "x" * SPM_MAX_LINE_BYTES, "€" * 1400, "der hund"]
    with caplog.at_level(logging.INFO, logger="pipeline.corpus.spm"):
        train_sentencepiece(lines, vocab_size=40)
    assert "on 4 lines:" in caplog.text and f"; 2 line(s) over {SPM_MAX_LINE_BYTES} bytes left out" in caplog.text


def test_a_corpus_sentencepiece_cannot_use_and_a_looping_link_are_one_line(tmp_path, capsys):
    """SentencePiece leaves lines over 4192 bytes out of training: a corpus of only such lines was its INTERNAL
    error; a --train-src that is a symlink loop was a RuntimeError from Path.resolve."""
    from helpers import run_cli

    from model.errors import UserError
    from pipeline.corpus.spm import SPM_MAX_LINE_BYTES, train_sentencepiece

    with pytest.raises(UserError, match=f"no non-empty line of at most {SPM_MAX_LINE_BYTES} bytes"):
        train_sentencepiece(["x" * (SPM_MAX_LINE_BYTES + 1)] * 3, vocab_size=16)
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "t.txt").write_text("x y\n")
    assert run_cli("train", "--save-dir", tmp_path / "run", "--train-src", tmp_path / "a", "--train-tgt",
                   tmp_path / "t.txt", "--preset", "tiny", "--max-steps", 1) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'a'}: no such file" in err and "Traceback" not in err, err
    assert run_cli("train", "--save-dir", tmp_path / "run", "--train-src", "/dev/null", "--train-tgt",
                   tmp_path / "t.txt", "--preset", "tiny", "--max-steps", 1) == 2  # it said "is a directory"
    assert "/dev/null: is not a regular file (a device or pipe)" in capsys.readouterr().err


def test_the_sentencepiece_log_says_the_pieces_it_made(caplog):
    """It said "vocab 600" for a model of 468 pieces (the vocabulary is a soft limit on a small corpus)."""
    import logging

    from pipeline.corpus.spm import train_sentencepiece

    with caplog.at_level(logging.INFO):
        data = train_sentencepiece(["der hund sieht die katze", "ein mann geht"] * 20, vocab_size=100)
    import sentencepiece as spm

    pieces = spm.SentencePieceProcessor(model_proto=data).get_piece_size()
    assert pieces < 100
    assert f"on 40 lines: {pieces} pieces, fewer than --vocab-size 100" in caplog.text


def test_train_refuses_a_corpus_its_run_would_write_over_and_leaves_no_refused_save_dir(tmp_path, capsys):
    """--train-src RUN/config.json was replaced by the run's config (exit 0); a run refused after SentencePiece
    (no pair left under --max-len) or at its device left spm.model, cache/ or an empty save dir behind; CR-only
    line ends made the corpus one pair; --max-time nan or inf was taken (ignored, or a crash of the linear
    schedule)."""
    from helpers import TINY, run_cli

    src, tgt = make_parallel(60)
    run = tmp_path / "run"
    a, b = write_parallel(run, "x", src, tgt)
    a.rename(run / "config.json")
    b.rename(run / "metrics.jsonl")
    before = (run / "config.json").read_bytes()
    assert run_cli("train", "--save-dir", run, "--train-src", run / "config.json", "--train-tgt",
                   run / "metrics.jsonl", *TINY, "--max-steps", 2) == 2
    assert "config.json (--train-src): the run writes its own files there" in capsys.readouterr().err
    assert (run / "config.json").read_bytes() == before
    a, b = write_parallel(tmp_path / "c", "train", src, tgt)
    for option in (("--max-len", 2), ("--device", "cuda:99"), ("--max-time", "nan"), ("--max-time", "inf")):
        fresh = tmp_path / f"refused{option[1]}"
        assert run_cli("train", "--save-dir", fresh, "--train-src", a, "--train-tgt", b, *TINY,
                       "--max-steps", 2, *option) == 2, option
        assert "Traceback" not in capsys.readouterr().err
        assert not fresh.exists(), (option, sorted(p.name for p in fresh.rglob("*")))
    cr = tmp_path / "cr"
    cr.mkdir()
    for n in (8, 2):
        for path, lines in ((cr / "a.src", src[:n]), (cr / "a.tgt", tgt[:n])):
            path.write_bytes("\r".join(lines).encode() + b"\r")
        assert run_cli("train", "--save-dir", tmp_path / "crrun", "--train-src", cr / "a.src", "--train-tgt",
                       cr / "a.tgt", *TINY, "--max-steps", 2) == 2
        assert f"{n - 1} carriage returns inside its 1 line(s): are its lines ended by CR alone" in \
            capsys.readouterr().err
    mine = tmp_path / "mine"  # a corpus of the user's in RUN/data/ is no file of the run (only the built-in one's)
    a, b = write_parallel(mine / "data", "train", src, tgt)
    assert run_cli("train", "--save-dir", mine, "--train-src", a, "--train-tgt", b, *TINY, "--max-steps", 2) == 0


def test_a_run_refused_after_its_corpus_was_encoded_leaves_no_save_dir(tmp_path, capsys):
    """Every validation pair past --max-len is refused after the training corpus was encoded into cache/*.pt, which
    the clean-up took for a checkpoint: the refused run's save dir stayed (spm.model, cache/)."""
    from helpers import TINY, make_parallel, run_cli, write_parallel

    src, tgt = make_parallel(40, seed=3)
    train_files = write_parallel(tmp_path / "data", "train", src, tgt)
    long = [" ".join([line] * 12) for line in src[:5]]
    valid_files = write_parallel(tmp_path / "data", "valid", long, long)
    code = run_cli("train", "--save-dir", tmp_path / "run", "--train-src", train_files[0], "--train-tgt",
                   train_files[1], "--valid-src", valid_files[0], "--valid-tgt", valid_files[1], *TINY,
                   "--max-len", 20, "--max-steps", 2)
    err = capsys.readouterr().err  # named by its options, and why a set the help says BLEU translates is refused
    assert code == 2 and f"valid ({valid_files[0]} and {valid_files[1]}): no sentence pair left after filtering (0 " \
        "empty, 5 longer than --max-len 20) (the validation loss needs one; BLEU translates every line)" in err, err
    assert not (tmp_path / "run").exists()


def test_two_runs_cannot_write_one_save_dir(tmp_path, capsys):
    """The same command started twice (or rerun while torchrun's workers, torchrun killed with -9, went on): both ran,
    the second resumed from the first's checkpoint and truncated its metrics. The writer holds a lock."""
    from helpers import TINY, make_parallel, run_cli, write_parallel

    from pipeline.training.trainer import _lock_save_dir

    src, tgt = make_parallel(40, seed=3)
    files = write_parallel(tmp_path / "data", "train", src, tgt)
    run = tmp_path / "run"
    run.mkdir()
    args = ("train", "--save-dir", run, "--train-src", files[0], "--train-tgt", files[1], *TINY, "--max-steps", 2)
    held = _lock_save_dir(run)  # as a live run holds it
    try:
        assert run_cli(*args) == 2
        assert f"{run}: another training run is writing it (pid {os.getpid()})" in capsys.readouterr().err
    finally:
        held.close()
    assert run_cli(*args) == 0  # released: the next run goes ahead


def test_average_names_the_run_that_pruned_a_checkpoint_it_was_reading(tmp_path, capsys, monkeypatch):
    """`pipeline average` while the run trains: the run pruned a listed checkpoint before it was read, and average
    said "no such checkpoint file" of a file the user had just seen. It names the run writing the dir now."""
    from helpers import TINY, make_parallel, run_cli, write_parallel

    from pipeline.training import averaging
    from pipeline.training.trainer import _lock_save_dir

    files = write_parallel(tmp_path / "data", "train", *make_parallel(40, seed=3))
    run = tmp_path / "run"
    assert run_cli("train", "--save-dir", run, "--train-src", files[0], "--train-tgt", files[1], *TINY,
                   "--max-steps", 3, "--save-every", 1) == 0
    real, oldest = averaging.read_checkpoint, step_checkpoints(run)[0]

    def pruned_first(path: Any) -> Any:  # the run's pruning, between average's listing and its reading
        oldest.unlink(missing_ok=True)
        return real(path)

    monkeypatch.setattr(averaging, "read_checkpoint", pruned_first)
    held = _lock_save_dir(run)  # as the live run holds it
    try:
        assert run_cli("average", run, "--last", 3) == 2
        err = capsys.readouterr().err
        assert f"{oldest}: removed while it was averaged, by the training run writing {run} (pid {os.getpid()})" \
            in err, err
    finally:
        held.close()


def test_a_run_started_with_ctrl_c_ignored_keeps_it_ignored():
    """A shell script's `pipeline train ... &` starts with SIGINT ignored (the terminal's Ctrl-C is for the script):
    it was ignored while the data was prepared, then obeyed once training began (a checkpoint and exit 0)."""
    import signal

    from pipeline.training.metrics import StopFlag

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopFlag():
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL  # SIGTERM still stops it with a checkpoint
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with StopFlag() as flag:  # a foreground run: Ctrl-C stops after the update
            assert signal.getsignal(signal.SIGINT) == flag._handle
    finally:
        signal.signal(signal.SIGINT, before)

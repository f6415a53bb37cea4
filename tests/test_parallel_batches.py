"""Batches decoded side by side (`--parallel-batches`, runtime/translate.py decode_batches): the same
translations in the same order, never more batches at once than asked, an error that stops the batches
not yet started, and a clear refusal where the backend cannot."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from helpers import run_cli, run_cli_captured

from runtime.decoding import PAPER
from runtime.errors import RuntimeUserError
from runtime.model_dir import LoadOptions, load
from runtime.translate import decode_batches, encode_sources, length_batches, translate_ids


class _Batches:
    """The one thing decode_batches asks of a backend: how many batches it decodes at once."""

    def __init__(self, parallel_batches: int):
        self.parallel_batches = parallel_batches


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_batches_come_back_in_order_and_never_more_at_once_than_asked(workers):
    running = most = 0
    lock = threading.Lock()

    def decode(i: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.03 if i % 3 == 0 else 0.002)  # some batches slow: later ones end first
        with lock:
            running -= 1
        return i * 10

    out = list(decode_batches(_Batches(workers), iter(range(12)), decode))
    assert out == [(i, i * 10) for i in range(12)]
    assert most == workers


def test_an_error_in_one_batch_is_raised_and_stops_the_batches_not_started():
    started: list[int] = []
    taken = 0

    def batches():
        nonlocal taken
        for i in range(100):
            taken += 1
            yield i

    def decode(i: int) -> int:
        started.append(i)
        if i == 1:
            raise ValueError("batch 1 is bad")
        time.sleep(0.01)
        return i

    got = []
    with pytest.raises(ValueError, match="batch 1 is bad"):
        for batch, result in decode_batches(_Batches(2), batches(), decode):
            got.append((batch, result))
    assert got == [(0, 0)]  # what came before the bad batch, in order
    assert taken <= 6 and len(started) <= 6, (taken, started)  # 2 running + 2 waiting, not the 100


def _lines(memorise_corpus: tuple[Path, Path]) -> list[str]:
    src, _ = memorise_corpus
    lines = src.read_text(encoding="utf-8").splitlines()
    return lines[:15] + ["", "   "] + lines[15:]  # blank lines keep their place


def test_onnxruntime_int8_shortlist_two_batches_at_a_time_gives_the_same_hypotheses(
        memorised_shortlist_int8_dir, memorise_corpus):
    """Real sessions, several batches (a small budget): hypotheses, scores and order as one at a time."""
    one = load(memorised_shortlist_int8_dir, LoadOptions(backend="onnxruntime", threads=2, shortlist=True))
    two = load(memorised_shortlist_int8_dir, LoadOptions(backend="onnxruntime", threads=2, shortlist=True,
                                                          parallel_batches=2))
    assert two.backend.parallel_batches == 2 and one.backend.parallel_batches == 1
    # each batch runs on its share of the threads
    assert two.backend.decoder.get_session_options().intra_op_num_threads == 1
    assert one.backend.decoder.get_session_options().intra_op_num_threads == 2
    ids = encode_sources(one.tokenizer, _lines(memorise_corpus), one.backend.max_src_len).ids
    options = PAPER.replace(batch_tokens=60)
    todo = [len(s) for s in ids if s]
    assert len(list(length_batches(todo, options.batch_tokens, options.beam_size))) >= 6
    expected = translate_ids(one.backend, ids, options)
    assert translate_ids(two.backend, ids, options) == expected
    assert expected[15] == [] and expected[16] == [] and all(expected[i] for i in range(15))


def test_serve_batch_parallel_batches_writes_the_same_file(memorised_fp32_dir, memorise_corpus, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(_lines(memorise_corpus)) + "\n", encoding="utf-8")
    outs = []
    for n in (1, 2):
        out = tmp_path / f"out{n}.txt"
        assert run_cli("serve-batch", memorised_fp32_dir, src, "-o", out, "--backend", "onnxruntime",
                       "--threads", 2, "--parallel-batches", n, "--batch-tokens", 60, "--no-progress") == 0
        outs.append(out.read_text(encoding="utf-8"))
    assert outs[1] == outs[0]
    assert len(outs[0].splitlines()) == len(_lines(memorise_corpus))


def test_serve_batch_decodes_two_batches_at_once_by_default_on_two_threads(memorised_fp32_dir, memorise_corpus,
                                                                          tmp_path, capsys):
    """serve-batch's default on a CPU of 2 threads: two batches side by side, each on one thread, the same file as
    one at a time; on one thread, one at a time (the summary line says which)."""
    src = tmp_path / "in.txt"
    src.write_text("\n".join(_lines(memorise_corpus)) + "\n", encoding="utf-8")
    runs = {}
    for name, args in {"default": ["--threads", 2], "one": ["--threads", 2, "--parallel-batches", 1],
                       "one thread": ["--threads", 1]}.items():
        out = tmp_path / f"{name}.txt"
        code, _, err = run_cli_captured(capsys, "serve-batch", memorised_fp32_dir, src, "-o", out, "--backend",
                                        "onnxruntime", "--batch-tokens", 60, "--no-progress", *args)
        assert code == 0, err
        runs[name] = (out.read_text(encoding="utf-8"), err.strip().splitlines()[-1])
    assert runs["default"][1].endswith(", up to 2 batches at once")
    assert "at once" not in runs["one"][1] and "at once" not in runs["one thread"][1]
    assert runs["default"][0] == runs["one"][0] == runs["one thread"][0]


def test_only_files_of_many_batches_default_to_two_at_once(memorised_fp32_dir):
    """Ray and every other loader keep one batch at a time on every thread unless told (LoadOptions.many_batches
    is serve-batch's and the HTTP server's); the torch backend takes the default without complaint."""
    from runtime.machine import default_parallel_batches

    assert default_parallel_batches(1) == 1 and default_parallel_batches(2) == 2 and default_parallel_batches(16) == 2
    ort = LoadOptions(backend="onnxruntime", threads=2)
    assert load(memorised_fp32_dir, ort).backend.parallel_batches == 1
    files = load(memorised_fp32_dir, LoadOptions(backend="onnxruntime", threads=2, many_batches=True))
    assert files.backend.parallel_batches == 2
    assert files.backend.decoder.get_session_options().intra_op_num_threads == 1
    assert load(memorised_fp32_dir, LoadOptions(backend="onnxruntime", threads=1,
                                                many_batches=True)).backend.parallel_batches == 1
    assert load(memorised_fp32_dir, LoadOptions(backend="torch", many_batches=True)).backend.parallel_batches == 1


@pytest.mark.parametrize("args, message", [
    (["--backend", "torch", "--parallel-batches", "2"], "only the onnxruntime backend"),
    (["--backend", "onnxruntime", "--threads", "1", "--parallel-batches", "2"],
     "--parallel-batches 2 needs at least as many --threads (got 1)"),
])
def test_parallel_batches_is_refused_where_it_cannot_run(memorised_fp32_dir, memorise_corpus, tmp_path, capsys,
                                                         args, message):
    src, _ = memorise_corpus
    out = tmp_path / "out.txt"
    code, _, err = run_cli_captured(capsys, "serve-batch", memorised_fp32_dir, src, "-o", out, "--no-progress",
                                    *args)
    assert code != 0 and message in err, err
    assert not out.exists()


def test_bench_refuses_fewer_threads_than_batches_before_measuring(memorised_fp32_dir, capsys):
    code, _, err = run_cli_captured(capsys, "bench", memorised_fp32_dir, "--compare", "ctranslate2", "--threads", 1,
                                    "--parallel-batches", 2)
    assert code == 2 and "--parallel-batches 2 needs at least as many --threads (got 1)" in err, err


def test_load_refuses_parallel_batches_on_cuda(memorised_fp32_dir):
    from runtime.ort_backend import OrtBackend

    opened = load(memorised_fp32_dir, LoadOptions(backend="onnxruntime", threads=1)).model_dir
    with pytest.raises(RuntimeUserError, match="is for the CPU"):
        OrtBackend(opened.path, opened.manifest, device="cuda", parallel_batches=2)


def test_bench_measures_parallel_batches_against_ctranslate2_inter_threads(memorised_fp32_dir, tmp_path):
    pytest.importorskip("ctranslate2")
    out = tmp_path / "cmp.json"
    code = run_cli("bench", memorised_fp32_dir, "--backends", "onnxruntime", "--compare", "ctranslate2",
                   "--batch-size", 2, "--beam-size", 2, "--fixed-length", 3, "--sentences", 8, "--threads", 2,
                   "--parallel-batches", 2, "--rounds", 1, "--json", out)
    assert code == 0
    report = json.loads(out.read_text())
    assert report["parallel_batches"] == 2
    for r in report["results"]:  # every engine did the whole work, batches at once or not
        assert r["target_tokens"] == r["sentences"] * 3 and r["target_tokens_per_s"] > 0
    one = tmp_path / "one.json"
    assert run_cli("bench", memorised_fp32_dir, "--backends", "onnxruntime", "--batch-size", 2, "--beam-size", 2,
                   "--fixed-length", 3, "--sentences", 8, "--threads", 2, "--parallel-batches", 2,
                   "--json", one) == 0
    [row] = json.loads(one.read_text())["results"]
    assert row["parallel_batches"] == 2 and row["target_tokens"] == 8 * 3


def test_http_service_with_parallel_batches_answers_what_serve_batch_writes(memorised_fp32_dir, memorise_corpus,
                                                                          tmp_path):
    """`pipeline serve --parallel-batches 2`: a request of several batches (the budget is small) decoded two at a
    time, answered line for line as serve-batch one batch at a time writes it."""
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from pipeline.serve.app import create_app
    from pipeline.serve.metrics import Metrics
    from pipeline.serve.options import RequestLimits, ServeHttpOptions
    from pipeline.serve.runner import load_model
    from pipeline.serve.state import ServerState

    lines = _lines(memorise_corpus)
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    assert run_cli("serve-batch", memorised_fp32_dir, src, "-o", out, "--backend", "onnxruntime", "--threads", 2,
                   "--batch-tokens", 60, "--no-progress") == 0
    metrics, limits = Metrics(), RequestLimits()
    opts = ServeHttpOptions(load=LoadOptions(backend="onnxruntime", threads=2, parallel_batches=2))
    model = load_model("m", str(memorised_fp32_dir), opts, PAPER.replace(batch_tokens=60), metrics)
    assert model.loaded.backend.parallel_batches == 2
    state = ServerState({"m": model}, limits, {}, metrics, warmed_up=True)
    with TestClient(create_app(state)) as client:
        r = client.post("/translate", json={"text": lines})
        assert r.status_code == 200, r.text
        assert r.json()["translations"] == out.read_text(encoding="utf-8").split("\n")[:-1]


@pytest.mark.parametrize("threads, at_once", [(2, 2), (1, 1)])
def test_the_http_server_decodes_two_batches_at_once_on_two_threads(memorised_fp32_dir, monkeypatch, threads,
                                                                     at_once):
    """`pipeline serve` loads its model dirs for a queue of many batches: on two threads, onnxruntime decodes
    two at once, each on one (its batcher then runs two: tests/test_serve_hostile.py); on one thread, one."""
    pytest.importorskip("starlette")
    from pipeline.serve import runner
    from runtime.model_dir import Loaded, load

    served: list[Loaded] = []
    monkeypatch.setattr(runner, "serve_http", lambda models, opts, *a: served.extend(
        load(str(path), opts.load) for _, path in models))
    assert run_cli("serve", memorised_fp32_dir, "--backend", "onnxruntime", "--threads", threads) == 0
    (loaded,) = served
    assert loaded.backend.parallel_batches == at_once and runner.summary(loaded)["batches_at_once"] == at_once
    assert loaded.backend.decoder.get_session_options().intra_op_num_threads == threads // at_once


def test_serve_says_the_precision_that_runs_and_takes_dtype(fp16_dir, monkeypatch):
    """/info said the model dir's precision: an fp16 dir on the CPU's torch backend "fp16" while it ran fp32 (as
    bench's torch rows said fp32 on a GPU that ran fp16). It says what the backend computes in now, and serve
    takes --dtype as serve-batch does (refused, naming it, for a backend that runs its graphs' own)."""
    pytest.importorskip("starlette")
    from model.errors import UserError
    from pipeline.serve import runner
    from pipeline.serve.metrics import Metrics
    from pipeline.serve.options import ServeHttpOptions
    from runtime.model_dir import LoadOptions

    def info(**load: object) -> object:
        opts = ServeHttpOptions(load=LoadOptions(threads=1, **load))  # type: ignore[arg-type]
        return runner.load_model("m", str(fp16_dir), opts, PAPER, Metrics()).info["precision"]

    assert info(backend="onnxruntime") == "fp16"
    assert info(backend="torch") == "fp32"  # fp16 asked of a CPU: model.pt in fp32
    assert info(backend="torch", precision="fp32") == "fp32"
    given: list[LoadOptions] = []
    monkeypatch.setattr(runner, "serve_http", lambda models, opts, *a: given.append(opts.load))
    assert run_cli("serve", fp16_dir, "--backend", "torch", "--dtype", "fp32") == 0
    assert given[-1].precision == "fp32"
    with pytest.raises(UserError, match="--dtype"):  # (onnxruntime runs the graphs' precision)
        info(backend="onnxruntime", precision="fp32")

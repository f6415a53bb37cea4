"""`--shortlist` on the commands that decode: serve-batch, serve, bench (in-process, compared, whole
process) and parity (its label, gate and coverage), on the memorised model exported with a shortlist
counted on its own corpus (conftest's memorised_shortlist_*_dir)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import assert_one_line_error, run_cli_captured

from pipeline.evaluation.parity import DEFAULT_GATES, Gate, gate_for

# Greedy: the memorised model's full-vocabulary output is its corpus's references, every token of which the
# shortlist (counted on that corpus) lists, so the shortlisted argmax is the full one. At the default beam
# 4 the renormalised candidates re-rank some finished hypotheses of this 40-line corpus (a few points of
# BLEU each), which says nothing about the flag being passed.
GREEDY = ["--beam-size", "1", "--threads", "1", "--no-progress"]


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def serve_batch(capsys, model_dir: Path, src: Path, out: Path, *extra: object) -> tuple[list[str], str]:
    """serve-batch's output lines and its summary line."""
    code, _, err = run_cli_captured(capsys, "serve-batch", model_dir, src, "-o", out, *extra)
    assert code == 0, err
    return lines(out), err.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_serve_batch_shortlist_translates_the_memorised_corpus(backend, memorised_shortlist_fp32_dir,
                                                               memorise_corpus, tmp_path, capsys):
    src, ref = memorise_corpus
    d = memorised_shortlist_fp32_dir
    short, summary = serve_batch(capsys, d, src, tmp_path / "short.txt", "--backend", backend, "--shortlist", *GREEDY)
    full, full_summary = serve_batch(capsys, d, src, tmp_path / "full.txt", "--backend", backend, *GREEDY)
    assert f"backend {backend} with shortlist" in summary and "shortlist" not in full_summary
    assert short == full
    assert sum(a == b for a, b in zip(short, lines(ref))) >= 0.95 * len(lines(ref))


@pytest.mark.slow
def test_serve_batch_shortlist_needs_a_model_dir_with_one(memorised_fp32_dir, memorised_shortlist_fp32_dir,
                                                          memorise_corpus, tmp_path, capsys):
    src, _ = memorise_corpus
    code, _, err = run_cli_captured(capsys, "serve-batch", memorised_fp32_dir, src, "-o", tmp_path / "o.txt",
                                    "--backend", "onnxruntime", "--shortlist", *GREEDY)
    assert_one_line_error(code, err, str(memorised_fp32_dir), "--shortlist-src")
    # TensorRT: refused in one line (whatever this machine has: no engine runs the shortlisted step yet)
    code, _, err = run_cli_captured(capsys, "serve-batch", memorised_shortlist_fp32_dir, src, "-o",
                                    tmp_path / "o.txt", "--backend", "tensorrt", "--shortlist", *GREEDY)
    assert_one_line_error(code, err, "--shortlist")
    assert not (tmp_path / "o.txt").exists()


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_a_glossary_with_the_shortlist_is_refused_for_the_shortlist(memorised_shortlist_fp32_dir, memorise_corpus,
                                                                    tmp_path, capsys, backend):
    """The refusal told to export again with this version (the dir was), the cause (--shortlist) last."""
    src, _ = memorise_corpus
    glossary = tmp_path / "g.tsv"
    glossary.write_text("a\tb\n")
    code, _, err = run_cli_captured(capsys, "serve-batch", memorised_shortlist_fp32_dir, src, "-o",
                                    tmp_path / "o.txt", "--backend", backend, "--shortlist", "--glossary", glossary,
                                    *GREEDY)
    assert_one_line_error(code, err, "the shortlisted step (--shortlist) does not compute: leave out --shortlist")
    assert "exported by this version" not in err and not (tmp_path / "o.txt").exists()


@pytest.mark.slow
def test_serve_shortlist_answers_as_serve_batch_and_says_so_in_info(memorised_shortlist_fp32_dir, memorise_corpus,
                                                                    tmp_path, capsys):
    """The server's path in-process (runner.load_model, as serve_http loads each model, and the app
    under starlette's TestClient): every line as serve-batch --shortlist writes it, and /info says so."""
    pytest.importorskip("starlette")
    pytest.importorskip("prometheus_client")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from pipeline.serve.app import create_app
    from pipeline.serve.metrics import Metrics
    from pipeline.serve.options import RequestLimits, ServeHttpOptions
    from pipeline.serve.runner import load_model, server_info
    from pipeline.serve.state import ServerState
    from runtime.decoding import PAPER
    from runtime.model_dir import LoadOptions

    src, _ = memorise_corpus
    expected, _ = serve_batch(capsys, memorised_shortlist_fp32_dir, src, tmp_path / "sb.txt", "--backend",
                              "onnxruntime", "--shortlist", "--threads", "1", "--no-progress")  # beam 4
    opts, limits, metrics = ServeHttpOptions(load=LoadOptions(backend="onnxruntime", threads=1)), RequestLimits(), \
        Metrics()
    decoding = PAPER.replace(batch_tokens=limits.max_batch_tokens)
    shortlisted = replace(opts, load=replace(opts.load, shortlist=True))
    model = load_model("m", str(memorised_shortlist_fp32_dir), shortlisted, decoding, metrics)
    assert model.loaded.backend.shortlist is not None
    state = ServerState({"m": model}, limits, server_info(limits, opts), metrics, warmed_up=True)
    with TestClient(create_app(state)) as client:
        r = client.post("/translate", json={"text": lines(src)})
        assert r.status_code == 200, r.text
        assert r.json()["translations"] == expected
        assert client.get("/info").json()["models"]["m"]["shortlist"] is True
    plain = load_model("p", str(memorised_shortlist_fp32_dir), opts, decoding, metrics)
    assert plain.info["shortlist"] is False


@pytest.mark.slow
def test_serve_shortlist_refuses_a_served_model_dir_without_one(memorised_shortlist_fp32_dir, memorised_fp32_dir,
                                                                monkeypatch, capsys):
    """--shortlist reaches every --model: the first loads with its shortlist, the second has none."""
    pytest.importorskip("uvicorn")
    from pipeline.serve import runner

    def never(state):  # had every model loaded, the server would start (and this test wait for ever)
        raise AssertionError("serve --shortlist loaded a model dir without a shortlist")

    monkeypatch.setattr(runner, "create_app", never)
    code, _, err = run_cli_captured(capsys, "serve", "--model", f"a={memorised_shortlist_fp32_dir}", "--model",
                                    f"b={memorised_fp32_dir}", "--shortlist", "--backend", "onnxruntime",
                                    "--threads", "1", "--port", "0")
    assert_one_line_error(code, err, "model b", str(memorised_fp32_dir), "--shortlist-src")


@pytest.mark.slow
def test_parity_shortlist_gates_and_reports_coverage(memorised_shortlist_fp32_dir, memorised_shortlist_int8_dir,
                                                     memorise_corpus, tmp_path, capsys):
    src, ref = memorise_corpus
    out = tmp_path / "parity.json"
    code, stdout, err = run_cli_captured(capsys, "parity", memorised_shortlist_fp32_dir, "--src", src, "--ref", ref,
                                         "--backends", "torch,onnxruntime", "--shortlist", "--beam-size", "1",
                                         "--threads", "1", "--json", out)
    assert code == 0, stdout + err
    report = json.loads(out.read_text())
    assert report["passed"] and report["shortlist"] is True
    for row in report["results"]:
        assert row["precision"] == "fp32+shortlist"
        assert 0.9 <= row["shortlist_coverage"] <= 1.0
        assert f"{row['backend']} fp32+shortlist: shortlist coverage" in stdout
    # torch decoded over the shortlist too (its own run, not the full-vocabulary reference's)
    assert [r["backend"] for r in report["results"]] == ["torch", "onnxruntime"]
    code, stdout, err = run_cli_captured(capsys, "parity", memorised_shortlist_int8_dir, "--src", src, "--ref", ref,
                                         "--backends", "onnxruntime", "--shortlist", "--beam-size", "1",
                                         "--threads", "1", "--json", out)
    assert code == 0, stdout + err
    (row,) = json.loads(out.read_text())["results"]
    assert row["precision"] == "int8+shortlist" and row["passed"] and 0.9 <= row["shortlist_coverage"] <= 1.0
    # without --shortlist: the plain label, no coverage
    code, stdout, _ = run_cli_captured(capsys, "parity", memorised_shortlist_fp32_dir, "--src", src, "--ref", ref,
                                       "--backends", "onnxruntime", "--beam-size", "1", "--threads", "1",
                                       "--json", out)
    (row,) = json.loads(out.read_text())["results"]
    assert code == 0 and row["precision"] == "fp32" and row["shortlist_coverage"] is None
    assert "coverage" not in stdout


@pytest.mark.slow
def test_parity_shortlist_needs_a_model_dir_with_one(memorised_fp32_dir, memorise_corpus, capsys):
    src, ref = memorise_corpus
    code, _, err = run_cli_captured(capsys, "parity", memorised_fp32_dir, "--src", src, "--ref", ref, "--backends",
                                    "onnxruntime", "--shortlist", "--beam-size", "1", "--threads", "1")
    assert_one_line_error(code, err, "--shortlist-src")


def test_shortlist_gates():
    gates = {**DEFAULT_GATES, "fp16": Gate(0.9, 0.2)}
    assert gate_for("fp32", gates) == DEFAULT_GATES["fp32"]
    assert gate_for("fp32+shortlist", gates) == DEFAULT_GATES["shortlist"] == Gate(None, 0.3)
    assert gate_for("int8+shortlist", gates) == Gate(None, 0.5)    # int8's own delta is the larger
    assert gate_for("fp16+shortlist", gates) == Gate(None, 0.3)    # the shortlist's is the larger
    assert gate_for("int8+shortlist", {**gates, "int8": Gate(None, None)}) == Gate(None, None)


def bench_json(capsys, out: Path, *args: object) -> dict:
    code, stdout, err = run_cli_captured(capsys, "bench", *args, "--threads", "1", "--json", out)
    assert code == 0, stdout + err
    return {"report": json.loads(out.read_text()), "table": stdout}


@pytest.mark.slow
def test_bench_shortlist_rows_say_so(memorised_shortlist_fp32_dir, tmp_path, capsys):
    small = ["--backends", "torch,onnxruntime", "--batch-size", "4", "--beam-size", "2", "--sentences", "8",
             "--src-len", "6"]
    short = bench_json(capsys, tmp_path / "s.json", memorised_shortlist_fp32_dir, *small, "--shortlist")
    full = bench_json(capsys, tmp_path / "f.json", memorised_shortlist_fp32_dir, *small)
    assert short["report"]["shortlist"] is True and full["report"]["shortlist"] is False
    assert [r["shortlist"] for r in short["report"]["results"]] == [True, True]
    assert [r["shortlist"] for r in full["report"]["results"]] == [False, False]
    assert " shortlist " in short["table"] and " shortlist " not in full["table"]
    code, _, err = run_cli_captured(capsys, "bench", memorised_shortlist_fp32_dir, "--serve", Path(__file__),
                                    "--backends", "onnxruntime", "--shortlist")
    assert_one_line_error(code, err, "--serve", "--shortlist")


@pytest.mark.slow
def test_bench_shortlist_in_subprocesses(memorised_shortlist_fp32_dir, memorised_shortlist_int8_dir,
                                         memorised_fp32_dir, memorise_corpus, tmp_path, capsys):
    """--whole-process runs serve-batch --shortlist; the comparison measures every engine over the whole
    vocabulary and over the shortlist (CTranslate2, where installed, over its vmap of the same lists)."""
    src, _ = memorise_corpus
    whole = bench_json(capsys, tmp_path / "w.json", memorised_shortlist_fp32_dir, "--whole-process", src,
                       "--rounds", "1", "--beam-size", "1", "--shortlist")["report"]
    assert whole["shortlist"] is True and [r["shortlist"] for r in whole["results"]] == [True]
    row = whole["results"][0]  # serve-batch's own log splits its wall time: loading, then translating
    assert 0 < row["load_s"] and 0 < row["translate_s"] and row["load_s"] + row["translate_s"] < row["wall_s"]
    # ... as serve-batch --shortlist, which a model dir without one refuses
    code, _, err = run_cli_captured(capsys, "bench", memorised_fp32_dir, "--whole-process", src, "--rounds", "1",
                                    "--threads", "1", "--shortlist")
    assert_one_line_error(code, err, "serve-batch", "--shortlist-src")
    try:
        import ctranslate2  # noqa: F401
        compare = ["--compare", "ctranslate2"]
    except ImportError:
        compare = []
    report = bench_json(capsys, tmp_path / "c.json", memorised_shortlist_fp32_dir, memorised_shortlist_int8_dir,
                        "--backends", "onnxruntime", *compare, "--batch-size", "4", "--beam-size", "2",
                        "--fixed-length", "3", "--sentences", "4", "--rounds", "1", "--shortlist")["report"]
    assert report["shortlist"] is True
    for r in report["results"]:
        assert r["target_tokens"] == r["sentences"] * 3
    rows = [(r["engine"], r["model_dir"], r["precision"], r["batch_size"], r["shortlist"]) for r in report["results"]]
    assert len(set(rows)) == len(rows)
    for engine, model_dir, precision, batch, shortlist in rows:
        assert (engine, model_dir, precision, batch, not shortlist) in rows
    assert {r[0] for r in rows} == {"onnxruntime", *(["ctranslate2"] if compare else [])}

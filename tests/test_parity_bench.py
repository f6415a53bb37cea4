"""`pipeline parity` and `pipeline bench` on a tiny trained model exported to ONNX (fp32, fp16, int8)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import MEMORISED_LIMITS, run_cli, run_cli_captured

from model import build_model
from model.checkpoint import load_model, save_checkpoint
from model.manifest import CHECKPOINT_FILE, read_manifest, write_manifest
from pipeline.evaluation.bench import run_bench
from pipeline.evaluation.divergence import first_divergence
from pipeline.evaluation.parity import DEFAULT_GATES, BackendResult, Gate, check_gate, run_parity
from runtime.decoding import PAPER
from runtime.model_dir import LoadOptions, load


@pytest.fixture()
def model_dirs(memorised_fp32_dir, memorised_fp16_dir, memorised_int8_dir) -> dict[str, Path]:
    """The memorised tiny model exported fp32, fp16 and int8 (conftest, shared read-only)."""
    return {"fp32": memorised_fp32_dir, "fp16": memorised_fp16_dir, "int8": memorised_int8_dir}


@pytest.fixture(scope="module")
def test_files(memorise_corpus) -> tuple[Path, Path]:
    """The training pairs the tiny model learned (so BLEU is meaningful), as src/ref files."""
    return memorise_corpus


def test_first_divergence():
    assert first_divergence([5, 6, 7], [5, 6, 7]) is None
    assert first_divergence([5, 6, 7], [5, 9, 7]) == 1
    assert first_divergence([5, 6], [5, 6, 7]) == 2  # one ended (EOS) where the other went on


def test_gate_logic():
    r = BackendResult("onnxruntime", "fp32", "cpu", 1.0, 30.0, 50.0, 99.0, identical=0.98, n_different=2,
                      bleu_delta=-0.2, max_log_prob_gap=0.5, median_divergence_step=3)
    check_gate(r, DEFAULT_GATES["fp32"])
    assert not r.passed and len(r.failures) == 2
    r2 = BackendResult("onnxruntime", "fp16", "cpu", 1.0, 30.0, 50.0, 99.0, identical=0.9, n_different=10,
                       bleu_delta=-0.3, max_log_prob_gap=0.01, median_divergence_step=3)
    check_gate(r2, DEFAULT_GATES["fp16"])
    assert r2.passed


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_parity_gate_passes_on_onnxruntime(model_dirs, test_files, precision, tmp_path):
    """fp32 at the default gate; fp16 allowing two changed sentences (below). int8 at a wider
    BLEU gate: the memorising model is
    fragile to 8-bit rounding and differs from CPU to CPU (a chaotic run, conftest.py), and on its
    40 sentences one changed translation moves BLEU by 2-4 points, so its int8 BLEU moves either way
    by chance (on an AVX2-only CPU: int8 activations emulated +1.94 with 90% identical, weights-only
    rounding -4.03 with 92.5% identical and closer to PyTorch's output, qdq -4.0; within 0.5 on an
    AVX-512 VNNI CPU). The identical fraction is what tells broken int8 arithmetic apart (the
    saturating u8 x s8 kernel of runtime/cpu_int8.py: -15.1 BLEU, 70% identical)."""
    src, ref = test_files
    int8_gate = Gate(min_identical=0.85, max_bleu_delta=6.0)
    # fp16: at most two of the 40 sentences may change. On this model one changed translation
    # moves BLEU by about 1 point, past the default 0.5 that a real test set's thousands of
    # lines are held to. Measured: the beam-cache graphs (model/cache.py) flip one sentence
    # on an AVX-512 VNNI CPU, towards the reference (+0.91 BLEU; the graphs before them flipped
    # none), with the same verification maxima (0.019 against 0.021).
    fp16_gate = Gate(min_identical=0.95, max_bleu_delta=3.0)
    report = run_parity(model_dirs[precision], src, ref, ["torch", "onnxruntime"],
                        gates={**DEFAULT_GATES, "int8": int8_gate, "fp16": fp16_gate})
    assert report.passed, report.results
    torch_row, ort_row = report.results
    assert torch_row.identical == 1.0
    assert torch_row.bleu > 50, "the tiny model should translate its training sentences"
    if precision == "fp32":
        assert ort_row.identical == 1.0 and ort_row.bleu_delta == 0.0
    assert ort_row.precision == precision
    # The CLI: table on stdout, JSON on disk, exit 0.
    out = tmp_path / "parity.json"
    gate_options = {"int8": ["--int8-max-bleu-delta", int8_gate.max_bleu_delta, "--int8-min-identical",
                             int8_gate.min_identical],
                    "fp16": ["--fp16-max-bleu-delta", fp16_gate.max_bleu_delta, "--fp16-min-identical",
                             fp16_gate.min_identical]}.get(precision, [])
    assert run_cli("parity", model_dirs[precision], "--src", src, "--ref", ref, "--json", out, *gate_options) == 0
    data = json.loads(out.read_text())
    assert data["passed"] and {r["backend"] for r in data["results"]} == {"torch", "onnxruntime"}
    assert "nrefs:1" in data["bleu_signature"]


@pytest.mark.slow
def test_parity_catches_graphs_out_of_sync_with_weights(model_dirs, test_files, tmp_path, capsys):
    """A model dir whose ONNX graphs came from other weights than model.pt must fail the gate."""
    bad = tmp_path / "bad"
    shutil.copytree(model_dirs["fp32"], bad)
    model, spm_bytes, _ = load_model(bad / CHECKPOINT_FILE)
    torch.manual_seed(123)
    save_checkpoint(bad / CHECKPOINT_FILE, build_model(model.cfg), spm_bytes)
    write_manifest(bad, read_manifest(bad, verify=False))
    src, ref = test_files
    assert run_cli("parity", bad, "--src", src, "--ref", ref) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.slow
def test_parity_rejects_misaligned_reference(model_dirs, test_files, tmp_path, capsys):
    src, _ = test_files
    short = tmp_path / "short.txt"
    short.write_text("one line\n")
    assert run_cli("parity", model_dirs["fp32"], "--src", src, "--ref", short) == 2
    assert "must be line-aligned" in capsys.readouterr().err


def test_parity_refuses_a_backend_it_cannot_run_before_translating_anything(model_dirs, test_files, monkeypatch,
                                                                           capsys):
    """--device cuda without CUDA, engines an export did not build, and --shortlist on a dir without one were said
    once the reference had translated every line (3,000 lines: 10 s), or after the backends before them had
    translated too (their results thrown away)."""
    from pipeline.evaluation import parity

    monkeypatch.setattr(parity, "translate_as_served", lambda *a, **k: pytest.fail("translated before refusing"))
    src, ref = test_files
    fp32 = model_dirs["fp32"]
    cases = [(("--backends", "torch,onnxruntime,tensorrt"), "tensorrt"), (("--shortlist",), "shortlist"),
             (("--backends", "tensorrt", "--shortlist"), "no TensorRT engine is built")]
    if not torch.cuda.is_available():
        cases.append((("--device", "cuda"), "CUDA is not available"))
    for args, said in cases:
        for files in (("--src", src, "--ref", ref), ()):  # live, and against the recorded references
            code, _, err = run_cli_captured(capsys, "parity", fp32, *files, *args)
            assert code == 2 and err.startswith("error: ") and said in err, (args, files, err)
            assert "--backend " not in err, err  # parity's option is --backends (it said "use --backend onnxruntime")
    code, _, err = run_cli_captured(capsys, "parity", fp32, "--backends", "onnxruntime,onnxruntime")
    assert code == 2 and "onnxruntime given more than once" in err, err


@pytest.mark.slow
def test_bench_fixed_length_counts_exact_tokens(model_dirs, tmp_path):
    report = run_bench(model_dirs["fp32"], ["torch", "onnxruntime"], [4], decoding=PAPER.replace(beam_size=2),
                       fixed_length=6,
                       sentences=8, src_len=7)
    assert [r["backend"] for r in report["results"]] == ["torch", "onnxruntime"]
    for r in report["results"]:
        assert r["target_tokens"] == 8 * 6
        assert r["target_tokens_per_s"] > 0 and r["peak_rss_mb"] > 0
    out = tmp_path / "bench.json"
    code = run_cli("bench", model_dirs["fp32"], "--backends", "onnxruntime", "--batch-size", 4,
                   "--beam-size", 1, "--fixed-length", 3, "--sentences", 4, "--json", out)
    assert code == 0
    assert json.loads(out.read_text())["results"][0]["target_tokens"] == 4 * 3


def test_a_fixed_length_past_the_output_limit_is_refused_in_every_mode(fp32_dir, tmp_path, capsys):
    """--whole-process took --fixed-length 400 on a model dir that stops at 39: serve-batch stopped there while
    CTranslate2 went on, and the report said "exactly 400 target tokens per sentence" for both."""
    src = tmp_path / "src.txt"
    src.write_text("ab cd\n")
    for mode in (["--whole-process", src], ["--batch-size", 1, "--sentences", 2]):
        code, _, err = run_cli_captured(capsys, "bench", fp32_dir, *mode, "--fixed-length", 400)
        assert code == 2 and "--fixed-length 400 is longer than the model dir's output limit of 39" in err, err


@pytest.mark.slow
def test_parity_measures_exactly_what_serve_batch_writes(model_dirs, test_files, tmp_path):
    """Blank, whitespace-only and over-long lines: each backend's hypotheses as parity saw
    them (--save-hyps) are byte for byte what serve-batch writes with the same options."""
    model_dir = model_dirs["fp32"]
    src_lines = test_files[0].read_text(encoding="utf-8").splitlines()[:6]
    ref_lines = test_files[1].read_text(encoding="utf-8").splitlines()[:6]
    long_line = " ".join(["der hund sieht die katze"] * 20)
    tok = load(model_dir, LoadOptions(backend="torch")).tokenizer
    assert len(tok.encode_source([long_line])[0]) > MEMORISED_LIMITS["max_src_len"]
    src_lines[1:1] = ["", "  \t ", long_line]
    ref_lines[1:1] = ["", "", "the dog sees the cat"]
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("".join(x + "\n" for x in src_lines), encoding="utf-8")
    ref.write_text("".join(x + "\n" for x in ref_lines), encoding="utf-8")
    decoding = ["--beam-size", 3, "--max-len-a", 0, "--max-len-b", 12, "--threads", 1]
    hyps, report = tmp_path / "hyps", tmp_path / "parity.json"
    assert run_cli("parity", model_dir, "--src", src, "--ref", ref, "--backends", "torch,onnxruntime",
                   "--save-hyps", hyps, "--json", report, *decoding) == 0
    assert sorted(p.name for p in hyps.iterdir()) == ["onnxruntime.fp32.txt", "torch.fp32.txt"]
    for backend in ("torch", "onnxruntime"):
        served = tmp_path / f"served.{backend}.txt"
        assert run_cli("serve-batch", model_dir, src, "-o", served, "--backend", backend, "--no-progress",
                       *decoding) == 0
        assert (hyps / f"{backend}.fp32.txt").read_bytes() == served.read_bytes()
    out = (hyps / "torch.fp32.txt").read_text(encoding="utf-8").split("\n")
    assert len(out) == len(src_lines) + 1 and out[1] == out[2] == "" and out[3] and out[0]
    data = json.loads(report.read_text())
    assert data["sentences"] == sum(1 for line in src_lines if line.strip())  # as serve-batch counts: not blank
    assert [r["identical"] for r in data["results"]] == [1.0, 1.0]


@pytest.mark.slow
def test_int8_gate_is_bleu_only_and_configurable(model_dirs, test_files, capsys):
    assert DEFAULT_GATES["int8"].min_identical is None and DEFAULT_GATES["int8"].max_bleu_delta == 0.5
    src, ref = test_files
    # A gate no backend can meet (|dBLEU| <= -1) must fail: the option reaches the int8 gate.
    assert run_cli("parity", model_dirs["int8"], "--src", src, "--ref", ref, "--backends", "onnxruntime",
                   "--int8-max-bleu-delta", -1) == 1
    out = capsys.readouterr().out
    assert "int8" in out and "FAIL: |dBLEU|" in out


@pytest.mark.slow
def test_bench_rows_carry_engine_precision_and_latency(model_dirs):
    report = run_bench(model_dirs["int8"], ["torch", "onnxruntime"], [4], decoding=PAPER.replace(beam_size=2),
                       fixed_length=3, sentences=4, src_len=5)
    rows = {(r["engine"], r["precision"]): r for r in report["results"]}
    assert set(rows) == {("torch", "fp32"), ("onnxruntime", "int8")}
    assert all(r["latency_ms_per_sentence"] > 0 for r in rows.values())


def test_comparison_tables_name_the_model_dir_of_each_row_when_there_are_several():
    """Two int8 exports of one checkpoint (say two weight forms) give rows alike in engine and
    precision: the first column of both comparison tables (bench --compare, --whole-process) tells
    them apart; with one dir there is no such column."""
    from pipeline.evaluation.bench_compare import format_comparison
    from pipeline.evaluation.whole_process import format_whole_process

    def row(model_dir, engine, precision, tok_s):
        return {"engine": engine, "precision": precision, "quantization": None, "shortlist": False,
                "model_dir": model_dir, "batch_size": 32, "beam_size": 4, "target_tokens_per_s": tok_s,
                "latency_ms_per_sentence": 10.0, "peak_rss_mb": 100.0}

    results = [row("runs/a-int8", "onnxruntime", "int8", 150.0), row("runs/b-int8", "onnxruntime", "int8", 120.0),
               row("runs/a-int8", "ctranslate2", "int8", 100.0)]
    lines = format_comparison({"model_dirs": ["runs/a-int8", "runs/b-int8"], "results": results}).splitlines()
    assert lines[0].split()[:3] == ["model", "engine", "prec"]
    assert [line.split()[0] for line in lines[2:]] == ["a-int8", "b-int8", "a-int8"]
    assert lines[2].split()[-2] == "1.50" and lines[3].split()[-2] == "1.20"  # x CTranslate2 int8
    assert lines[2].split()[-1] == "-"  # % peak: rows measured without the CPU's peak have none
    single = format_comparison({"model_dirs": ["runs/a-int8"], "results": results[:1] + results[2:]})
    assert single.splitlines()[0].split()[0] == "engine"
    whole = [{**r, "file": "in.de", "lines": 3, "wall_s": 1.0} for r in results]
    lines = format_whole_process({"model_dirs": ["runs/a-int8", "runs/b-int8"], "results": whole, "rounds": 1,
                                  "threads": 2, "beam_size": 4, "fixed_length": None}).splitlines()
    assert lines[0].split()[:2] == ["model", "engine"]
    assert [line.split()[0] for line in lines[2:5]] == ["a-int8", "b-int8", "a-int8"]


def test_ratios_are_against_ctranslate2_rows_of_the_same_work():
    """Batch 1's 16-sentence latency rows have the main rows' batch size: the ratios of the 256-sentence rows
    were taken against them (CTranslate2 fp32 against itself: 0.01)."""
    from pipeline.evaluation.bench_compare import format_comparison

    def row(engine, precision, sentences, tok_s):
        return {"engine": engine, "precision": precision, "quantization": None, "shortlist": False,
                "batch_size": 1, "beam_size": 4, "sentences": sentences, "target_tokens_per_s": tok_s,
                "latency_ms_per_sentence": 10.0, "peak_rss_mb": 100.0}

    results = [row("ctranslate2", "fp32", 256, 100.0), row("onnxruntime", "fp32", 256, 150.0),
               row("ctranslate2", "fp32", 16, 9000.0), row("onnxruntime", "fp32", 16, 4500.0)]
    lines = format_comparison({"model_dirs": ["runs/a"], "results": results}).splitlines()[2:]
    assert [line.split()[-3] for line in lines] == ["1.00", "1.50", "1.00", "0.50"]


def test_whole_process_phases_come_from_serve_batch_log():
    from pipeline.evaluation.whole_process import phases

    log = ("12:28:35 INFO runtime.model_dir: backend onnxruntime on cpu, loaded in 0.06 s\n"
           "translated 1 sentences (47 source tokens, 31 target tokens) in 0.07 s: 416.6 target tokens/s; "
           "backend onnxruntime, device cpu\n"
           "translated 2 sentences (9 source tokens, 12 target tokens) in 0.10 s: 120.0 target tokens/s; "
           "backend onnxruntime, device cpu\n")
    assert phases(log) == {"load_s": 0.06, "translate_s": pytest.approx(0.17)}
    assert phases("a CTranslate2 script logs nothing\n") == {}


def test_whole_process_runs_keep_bytecode_outside_the_tree(tmp_path, monkeypatch):
    """A machine that sets PYTHONDONTWRITEBYTECODE would make every timed run compile our modules again,
    which no installed user pays; the timed processes keep bytecode, in a cache under the run's tmp."""
    from pipeline.evaluation.whole_process import user_env

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    env = user_env(tmp_path)
    assert "PYTHONDONTWRITEBYTECODE" not in env and env["OMP_NUM_THREADS"] == "2"
    assert env["PYTHONPYCACHEPREFIX"] == str(tmp_path / "pycache")


@pytest.mark.slow
def test_bench_compares_dirs_and_ctranslate2_in_one_table(model_dirs, tmp_path):
    pytest.importorskip("ctranslate2")
    out = tmp_path / "cmp.json"
    code = run_cli("bench", model_dirs["fp32"], model_dirs["int8"], "--backends", "onnxruntime",
                   "--compare", "ctranslate2", "--batch-size", 4, "--beam-size", 2, "--fixed-length", 3,
                   "--sentences", 4, "--threads", 1, "--rounds", 1, "--json", out)
    assert code == 0
    report = json.loads(out.read_text())
    rows = [(r["engine"], r["precision"], r["batch_size"]) for r in report["results"]]
    engines = [("onnxruntime", "fp32"), ("onnxruntime", "int8"), ("ctranslate2", "fp32"), ("ctranslate2", "int8")]
    assert rows == [(e, p, 4) for e, p in engines] + [(e, p, 1) for e, p in engines]
    assert report["ctranslate2_greedy_agreement"] == "4/4"
    for r in report["results"]:
        assert r["target_tokens"] == r["sentences"] * 3 and r["peak_rss_mb"] > 0
        assert r["target_tokens_per_s"] > 0 and r["latency_ms_per_sentence"] > 0


def test_gpu_memory_is_read_only_for_the_torch_backend_on_cuda():
    """bench's GPU MiB column: PyTorch's allocator sees all of the torch backend's device memory, and
    none of ONNX Runtime's arena, so only torch on CUDA gets a figure (and torch is never imported for it)."""
    import types

    import torch

    from pipeline.evaluation.bench import torch_cuda

    def backend(name: str, device: str) -> object:
        return types.SimpleNamespace(name=name, device=torch.device(device))

    assert torch_cuda(backend("torch", "cuda:0")) is torch
    assert torch_cuda(backend("torch", "cpu")) is None
    assert torch_cuda(backend("onnxruntime", "cuda:0")) is None
    assert torch_cuda(types.SimpleNamespace(name="onnxruntime", device="cpu")) is None


def test_the_serve_bench_table_of_a_serve_batch_rate_it_could_not_time():
    """serve-batch printed "in 0.00 s" for a file it translated in under 5 ms (or whose lines are numbers, copied):
    `bench --serve` ran every level, then crashed formatting None with a traceback and wrote no JSON."""
    from pipeline.evaluation.serve_bench import format_serve_bench

    level = {"api": "native", "concurrency": 1, "sentences_per_s": 50.0, "latency_p50_s": 0.02,
             "latency_p99_s": 0.03, "errors": 0, "mismatched_lines": 0}
    report = {"serve_batch": {"sentences": 2, "target_tokens": 0, "seconds": 0.0, "sentences_per_s": None,
                              "target_tokens_per_s": None},
              "paragraph": 1, "lines": 2, "backend": "onnxruntime", "server_peak_rss_mib": 300.0, "levels": [level]}
    table = format_serve_bench(report).splitlines()
    assert table[0].startswith("serve-batch: - documents of 1 lines/s on 2 documents of 1 lines")
    assert table[2].split()[:4] == ["native", "1", "50.0", "-"]

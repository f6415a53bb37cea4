"""`pipeline demo` end to end (small settings) and the README's promises about it."""

from __future__ import annotations

import json
import re

import pytest
from helpers import ROOT, make_parallel, run_cli

pytest.importorskip("onnxruntime")


@pytest.mark.slow
def test_demo_runs_every_stage(tmp_path, capsys):
    out = tmp_path / "demo"
    code = run_cli("demo", "--out", out, "--preset", "tiny", "--builtin-pairs", "600", "--max-steps", "40",
                   "--no-progress", "--threads", "1")
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    for name in ("model-fp32/encoder.onnx", "model-fp32/decoder.onnx", "model-fp16/decoder.onnx",
                 "model-fp32/manifest.json", "train/averaged.pt", "parity-fp32.json", "parity-fp16.json",
                 "model-int8/decoder.onnx", "parity-int8.json"):
        assert (out / name).is_file(), name
    recorded = json.loads((out / "train" / "config.json").read_text())["builtin_files"]  # export checks them
    assert set(recorded) == {"valid.src", "valid.tgt"} and all(len(f["sha256"]) == 64 for f in recorded.values())
    test_lines = (out / "train" / "data" / "test.src").read_text().count("\n")
    assert (out / "test.hyp").read_text().count("\n") == test_lines > 0
    for precision in ("fp32", "fp16", "int8"):
        report = json.loads((out / f"parity-{precision}.json").read_text())
        assert report["passed"] and report["sentences"] == test_lines
        assert [r["backend"] for r in report["results"]] == ["torch", "onnxruntime"]
        assert report["results"][1]["precision"] == precision
    assert "== parity, fp16 model" in stdout and "parity: passed" in stdout
    # what this machine cannot run is listed with its reason (here: TensorRT, at least)
    import torch

    from pipeline.demo.plan import plan_demo
    from pipeline.environment import gather_facts

    skipped = plan_demo(gather_facts()).skipped
    assert all(f"not run: {backend}: {why}" in stdout for backend, why in skipped)
    if not torch.cuda.is_available():
        assert "tensorrt" in dict(skipped)
    assert re.search(r"serve-batch: translated \d+ sentences .* target tokens/s; backend onnxruntime", stdout)
    # each model dir holds its held-out translations, as `pipeline export` records them: parity gates it alone
    for precision in ("fp32", "int8"):
        assert json.loads((out / f"model-{precision}" / "references.json").read_text())["sources"]
        assert run_cli("parity", out / f"model-{precision}", "--threads", "1") == 0, precision
    # Rerunning resumes training (already finished) and replaces the exports.
    assert run_cli("demo", "--out", out, "--preset", "tiny", "--builtin-pairs", "600", "--max-steps", "40",
                   "--no-progress", "--threads", "1") == 0


def test_readme_quick_start_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "pip install torch==2.13.0" in quick and "pipeline demo" in quick
    test_command = "python -m pytest -q"
    assert test_command in quick
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install torch==2.13.0" in ci and test_command in ci
    assert ci.index("torch==2.13.0") < ci.index("pip install -e")


@pytest.mark.slow
def test_multi30k_recipe_script_runs_end_to_end(tmp_path):
    """scripts/multi30k.sh on a tiny stand-in for the Multi30k files (tiny model, 3 steps):
    train, average (how many checkpoints chosen on val), export, serve-batch both test sets,
    score with sacreBLEU."""
    import os
    import subprocess

    data = tmp_path / "multi30k"
    data.mkdir()
    for split, n, seed in (("train", 150, 1), ("val", 10, 2), ("test_2016_flickr", 8, 3), ("test_2017_flickr", 8, 4)):
        src, tgt = make_parallel(n, seed=seed)
        (data / f"{split}.de").write_text("\n".join(src) + "\n")
        (data / f"{split}.en").write_text("\n".join(tgt) + "\n")
    env = dict(os.environ, DATA=str(data), RUN=str(tmp_path / "run"), MODEL=str(tmp_path / "model"), STEPS="3",
               AVERAGES="1,2", EXTRA="--preset tiny --vocab-size 64 --batch-tokens 256 --save-every 1 "
                                  "--threads 1 --no-progress")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "multi30k.sh")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for split in ("test_2016_flickr", "test_2017_flickr"):
        assert re.search(rf"{split}: BLEU [\d.]+ \(nrefs:1\|case:mixed", proc.stdout), proc.stdout
        assert (tmp_path / "run" / f"{split}.hyp").read_text().count("\n") == 8
    assert (tmp_path / "model" / "manifest.json").is_file() and (tmp_path / "run" / "averaged.pt").is_file()
    # the number of checkpoints averaged is chosen on val among AVERAGES
    assert re.search(r"average of 1 checkpoint\(s\) .*val BLEU [\d.]+", proc.stdout), proc.stdout
    assert re.search(r"average of 2 checkpoint\(s\) .*val BLEU [\d.]+", proc.stdout), proc.stdout


@pytest.mark.slow
def test_demo_stopped_by_sigterm_during_training_is_one_line_like_train(tmp_path):
    """SIGTERM while the demo trains: a checkpoint, then the one line `pipeline train` prints for the same
    stop and exit 143, never a traceback ending in TrainingInterrupted."""
    import signal
    import subprocess
    import time

    from helpers import cli_env, pipeline_cmd

    out = tmp_path / "demo"
    proc = subprocess.Popen(pipeline_cmd("demo", "--out", out, "--preset", "tiny", "--builtin-pairs", "600",
                                         "--max-steps", "100000", "--no-progress", "--threads", "1"),
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = out / "train" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and (not metrics.is_file() or len(metrics.read_text().splitlines()) < 2):
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "TrainingInterrupted" not in err, err
    logged = re.compile(r"\d\d:\d\d:\d\d (DEBUG|INFO|WARNING) ")  # the log lines of the run itself
    lines = [line for line in err.strip().splitlines() if line.strip() and not logged.match(line)]
    assert len(lines) == 1 and lines[0].startswith("stopped by SIGTERM at step "), err
    assert "rerun the same command to resume" in lines[0]


def test_what_would_fail_after_training_is_refused_before_it(tmp_path, capsys, monkeypatch, fp32_dir):
    """A beam the model dirs cannot serve, a precision without a backend to check it, a non-model dir in model-int8/
    and a directory named test.hyp each failed after training and the exports (up to ten minutes); now before."""
    from helpers import assert_one_line_error, run_cli_captured

    from pipeline.demo import run as demo_run
    from pipeline.demo.plan import plan_demo
    from pipeline.environment import gather_facts

    def never(*args, **kwargs):
        raise AssertionError("trained")

    monkeypatch.setattr(demo_run, "train", never)
    base = ["demo", "--preset", "tiny", "--max-steps", "2", "--builtin-pairs", "10", "--no-progress"]
    stray, hyp = tmp_path / "stray", tmp_path / "hyp"
    (stray / "model-int8").mkdir(parents=True)
    (stray / "model-int8" / "notes.txt").write_text("mine\n")
    (hyp / "test.hyp").mkdir(parents=True)
    (tmp_path / "file").mkdir()
    (tmp_path / "file" / "model-fp16").write_text("x\n")  # a file there: it failed after two exports
    import shutil

    other = tmp_path / "other"  # a model dir exported from another checkpoint was replaced in silence, exit 0
    shutil.copytree(fp32_dir, other / "model-fp32")
    for args, says in ((["--out", tmp_path / "a", "--beam-size", "9"], "serve beams up to 8"),
                       (["--out", other], f"model-fp32: was exported from {random_checkpoint_path(fp32_dir)}, not "
                                          f"from this demo's {other / 'train'}"),
                       # a model dir as --out took the demo's files, and no export could replace it after
                       (["--out", fp32_dir], "is an exported model dir; the demo's --out is its working directory"),
                       (["--out", tmp_path / "b", "--backends", "tensorrt"], "no backend to check the fp32"),
                       (["--out", stray], "model-int8: exists and is not a model directory"),
                       (["--out", hyp], "test.hyp: is a directory"),
                       (["--out", tmp_path / "file"], "model-fp16: exists and is not a directory")):
        if "tensorrt" in args and "tensorrt" not in dict(plan_demo(gather_facts()).skipped):
            continue  # TensorRT runs here: a plan, not a refusal
        code, _, err = run_cli_captured(capsys, *base, *args)
        assert_one_line_error(code, err, says)
    assert (stray / "model-int8" / "notes.txt").read_text() == "mine\n"
    assert sorted(p.name for p in other.iterdir()) == ["model-fp32"]
    # a demo dir moved or copied since (its manifests record where it was) is still the demo's own
    import json

    moved = tmp_path / "moved"
    shutil.copytree(fp32_dir, moved / "model-fp32")
    manifest = json.loads((moved / "model-fp32" / "manifest.json").read_text())
    manifest["source_checkpoint"]["path"] = "/where/it/was/train/averaged.pt"
    (moved / "model-fp32" / "manifest.json").write_text(json.dumps(manifest))
    (moved / "train").mkdir()
    (moved / "train" / "averaged.pt").write_bytes(b"x")
    assert demo_run._foreign(moved / "model-fp32", moved / "train") is None
    assert "not from this demo's" in demo_run._foreign(other / "model-fp32", other / "train")


def random_checkpoint_path(model_dir) -> str:
    import json

    return json.loads((model_dir / "manifest.json").read_text())["source_checkpoint"]["path"]

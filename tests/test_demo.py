"""`pipeline demo` end to end (small settings) and the README's promises about it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import run_cli

pytest.importorskip("onnxruntime")

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs_every_stage(tmp_path, capsys):
    out = tmp_path / "demo"
    code = run_cli("demo", "--out", out, "--preset", "tiny", "--builtin-pairs", "600", "--max-steps", "40",
                   "--no-progress", "--threads", "1")
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    for name in ("model-fp32/encoder.onnx", "model-fp32/decoder.onnx", "model-fp16/decoder.onnx",
                 "model-fp32/manifest.json", "train/averaged.pt", "parity-fp32.json", "parity-fp16.json"):
        assert (out / name).is_file(), name
    test_lines = (out / "train" / "data" / "test.src").read_text().count("\n")
    assert (out / "test.hyp").read_text().count("\n") == test_lines > 0
    for precision in ("fp32", "fp16"):
        report = json.loads((out / f"parity-{precision}.json").read_text())
        assert report["passed"] and report["sentences"] == test_lines
        assert [r["backend"] for r in report["results"]] == ["torch", "onnxruntime"]
        assert report["results"][1]["precision"] == precision
    assert "== parity, fp16 model" in stdout and "parity: passed" in stdout
    assert re.search(r"serve-batch: translated \d+ sentences .* target tokens/s; backend onnxruntime", stdout)
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

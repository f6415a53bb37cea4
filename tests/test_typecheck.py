"""mypy checks the GPU code paths no CI machine can run: the TensorRT builder and backend
against tensorrt-stubs, the onnxruntime backend against onnxruntime's Python sources.

The second test proves the check has teeth: copies of the modules with one wrong TensorRT
call each (a misspelled method, tuples where TensorRT wants Dims, an API TensorRT 10 removed)
must each be reported."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

if importlib.util.find_spec("mypy") is None:
    pytest.skip("mypy is not installed (pip install -e '.[dev]')", allow_module_level=True)
try:
    from importlib import metadata

    metadata.distribution("tensorrt-stubs")
except metadata.PackageNotFoundError:
    pytest.skip("tensorrt-stubs is not installed (pip install --no-deps tensorrt-stubs==10.13.0.35.1)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    """The parseable copy of the stubs that `mypy` reads (what .ci/run makes before it)."""
    out = tmp_path_factory.mktemp("typings")
    subprocess.run([sys.executable, str(REPO / "scripts" / "tensorrt_stubs.py"), str(out)], check=True)
    return out


def run_mypy(stubs: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MYPYPATH": str(stubs), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=600)


@pytest.mark.slow
def test_gpu_paths_typecheck(stubs):
    result = run_mypy(stubs)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success" in result.stdout


MISTAKES = {
    "export/tensorrt_build.py": [
        ("config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)",
         "config.set_memory_pool_limits(trt.MemoryPoolType.WORKSPACE, workspace_bytes)",
         'has no attribute "set_memory_pool_limits"'),
        ("opt_profile.set_shape(name, trt.Dims(list(lo)), trt.Dims(list(opt)), trt.Dims(list(hi)))",
         "opt_profile.set_shape(name, lo, opt, hi)", '"set_shape" of "IOptimizationProfile" has incompatible type'),
    ],
    "runtime/trt_backend.py": [
        ("ctx.execute_async_v3(stream.cuda_stream)", "ctx.execute_async_v2(stream.cuda_stream)",
         'has no attribute "execute_async_v2"'),
    ],
}


@pytest.mark.slow
def test_wrong_tensorrt_calls_are_reported(stubs, tmp_path):
    copies = []
    for rel, edits in MISTAKES.items():
        text = (REPO / rel).read_text(encoding="utf-8")
        for right, wrong, _ in edits:
            assert text.count(right) == 1, f"{rel} no longer contains {right!r}: update this test"
            text = text.replace(right, wrong)
        copy = tmp_path / Path(rel).name
        copy.write_text(text, encoding="utf-8")
        copies.append(str(copy))
    result = run_mypy(stubs, "--config-file", str(REPO / "pyproject.toml"), *copies)
    assert result.returncode == 1, result.stdout + result.stderr
    for rel, edits in MISTAKES.items():
        for _, _, message in edits:
            assert any(Path(rel).name in line and message in line for line in result.stdout.splitlines()), \
                f"mypy did not report {message!r} in {rel}:\n{result.stdout}"

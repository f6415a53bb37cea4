"""The model-dir seam (runtime/model_dir.py, the generated options, ExportPlan) moved how every command opens
a model dir and takes its options, and was to change nothing a user gets: this runs the same commands with the
code of d3a47ad (the last commit before it) and with this checkout, on the same inputs, and compares what
they write. Translations and parity reports must be identical apart from timings; export writes the same
weights, tokenizer and checkpoint, and the same manifest apart from the .onnx files, which record the path of
the code that traced them.

Skipped where the checkout has no history to take d3a47ad from (a shallow clone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, git_tree, write_lines

from export.constrained import HOW
from model import io_names

pytestmark = pytest.mark.slow

BEFORE = "d3a47ad"
SOURCES = ["ab cd ef", "", "gh ij", "kl mn op qr", "st"]
FAST = ["--max-len-a", "0", "--max-len-b", "8", "--threads", "1", "--no-progress"]
VOLATILE = {"seconds", "export_seconds", "target_tokens_per_s", "created", "elapsed_s", "timestamp",
            "command"}  # and the command line a report records since, with its own output paths


@pytest.fixture(scope="module")
def before(tmp_path_factory) -> Path:
    """The tree of BEFORE, unpacked (the repository itself is not touched)."""
    return git_tree(BEFORE, tmp_path_factory.mktemp("before"))


def pipeline(code: Path, *args: object) -> None:
    """`pipeline ARGS` with the code at `code` (its own modules first on the path)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(code), PIPELINE_HASH_CACHE="off")
    done = subprocess.run([sys.executable, "-m", "pipeline", *map(str, args)], cwd=code, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


def without(data: object) -> object:
    """JSON without the fields that measure time."""
    if isinstance(data, dict):
        return {k: without(v) for k, v in data.items() if k not in VOLATILE}
    if isinstance(data, list):
        return [without(v) for v in data]
    return data


def test_export_writes_what_it_wrote_before(before, random_checkpoint, tmp_path):
    for code, out in ((before, tmp_path / "old"), (ROOT, tmp_path / "new")):
        pipeline(code, "export", random_checkpoint, "--out", out, "--no-tensorrt", "--max-src-len", 32,
                 "--max-tgt-len", 40, "--reference-lines", 0)
    old, new = (json.loads((d / "manifest.json").read_text()) for d in (tmp_path / "old", tmp_path / "new"))
    for manifest in (old, new):  # the .onnx files hold the traced code's path: their size and digest differ
        manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.endswith(".onnx")}
        manifest["graphs"]["bytes"] = {k: v for k, v in manifest["graphs"]["bytes"].items() if not k.endswith(".onnx")}
    # what came since, on purpose: decoder_constrained.onnx (glossaries), verified beside decoder.onnx
    ver = new["verification"]
    del ver["constrained_step"], ver["onnxruntime_vs_torch_fp32"]["max_abs_diff"][io_names.WANT_LOG_PROBS]
    ver["how"] = ver["how"].removesuffix(HOW)
    assert without(new) == without(old)
    for name in ("encoder.data", "decoder.data", "spm.model", "model.pt"):
        assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "old" / name).read_bytes(), name


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_serve_batch_and_parity_write_what_they_wrote_before(before, fp32_dir, tmp_path, backend):
    src = write_lines(tmp_path / "in.txt", SOURCES)
    for code, tag in ((before, "old"), (ROOT, "new")):
        pipeline(code, "serve-batch", fp32_dir, src, "-o", tmp_path / f"{tag}.txt", "--backend", backend, *FAST)
        pipeline(code, "serve-batch", fp32_dir, src, "-o", tmp_path / f"{tag}.nbest.txt", "--backend", backend,
                 "--nbest", 2, *FAST)
        backends = ",".join(dict.fromkeys(("torch", backend)))  # (each once: torch,torch is refused)
        pipeline(code, "parity", fp32_dir, "--src", src, "--ref", src, "--backends", backends,
                 "--max-len-a", 0, "--max-len-b", 8, "--threads", 1, "--min-identical", 0, "--max-bleu-delta", 100,
                 "--json", tmp_path / f"{tag}.json")
    assert (tmp_path / "new.txt").read_text() == (tmp_path / "old.txt").read_text()
    # on purpose: a blank line of an n-best file is one empty hypothesis with its score, as the HTTP API has it
    nbest = [line if line != " ||| 0.0000" else "" for line in (tmp_path / "new.nbest.txt").read_text().split("\n")]
    assert "\n".join(nbest) == (tmp_path / "old.nbest.txt").read_text()
    old, new = (json.loads((tmp_path / f"{tag}.json").read_text()) for tag in ("old", "new"))
    # on purpose since 8a89676: parity counts the lines the model translates, not the blank one
    assert new["sentences"] == sum(1 for line in SOURCES if line.strip())
    assert new.pop("lines") == len(SOURCES)  # and since, every line (its BLEU scores the blank one too)
    new = {**new, "sentences": len(SOURCES),
           "results": [{**r, "identical": 1 - r["n_different"] / len(SOURCES)} for r in new["results"]]}
    assert without(new) == without(old)

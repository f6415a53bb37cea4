"""A model dir that a careless or hostile hand has changed, and the deploy install asked for what it
lacks: one `error:` line naming the file (or the package and the extra that installs it), never a
traceback, and nothing opened outside the named directory (issue: no input reads outside its dir).

The manifest's checksums only prove that the files are the ones hashed; these dirs are rehashed after
the damage, so every check here is the loader's own, with and without PyTorch."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from model.manifest import MANIFEST, ModelDirError, read_manifest
from tests.helpers import FAST, ROOT, assert_one_line_error, run_cli_captured, write_lines

GARBAGE = b"\x08\x96\x01 not what export wrote " * 40


def damaged_copy(model_dir: Path, tmp: Path, name: str, content: bytes = GARBAGE) -> Path:
    """A copy of model_dir with `name` replaced by `content` and the manifest rehashed to match."""
    copy = tmp / f"damaged-{name}"
    shutil.copytree(model_dir, copy)
    (copy / name).write_bytes(content)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["files"][name] = hashlib.sha256(content).hexdigest()
    (copy / MANIFEST).write_text(json.dumps(manifest))
    return copy


def with_manifest_entry(model_dir: Path, tmp: Path, entry: str, digest: str) -> Path:
    copy = tmp / "listed"
    shutil.copytree(model_dir, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["files"][entry] = digest
    (copy / MANIFEST).write_text(json.dumps(manifest))
    return copy


def run_without(blocked: list[str], *args: object) -> tuple[int, str]:
    """`pipeline ARGS` in a fresh process where importing any of `blocked` fails, as in a deploy install."""
    code = ("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
            + f"from pipeline.cli import main\nmain({[str(a) for a in args]!r})\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("name, backend", [("spm.model", "onnxruntime"), ("spm.model", "torch"),
                                           ("encoder.onnx", "onnxruntime"), ("decoder.onnx", "onnxruntime"),
                                           ("decoder.data", "onnxruntime"), ("model.pt", "torch")])
def test_a_damaged_file_that_matches_the_manifest_is_one_line(fp32_dir, tmp_path, capsys, name, backend):
    src = write_lines(tmp_path / "in.txt", ["ab cd", "ef"])
    damaged = damaged_copy(fp32_dir, tmp_path, name)
    code, _, err = run_cli_captured(capsys, "serve-batch", damaged, src, "-o", tmp_path / "out.txt",
                                    *FAST[:-1], backend)
    assert_one_line_error(code, err, str(damaged / name))
    assert not (tmp_path / "out.txt").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["spm.model", "decoder.onnx", "encoder.data"])
def test_a_damaged_file_is_one_line_without_torch(fp32_dir, tmp_path, name):
    src = write_lines(tmp_path / "in.txt", ["ab cd"])
    damaged = damaged_copy(fp32_dir, tmp_path, name)
    code, err = run_without(["torch"], "serve-batch", damaged, src, "-o", tmp_path / "out.txt", *FAST)
    assert_one_line_error(code, err, str(damaged / name))


def test_a_tokenizer_bundle_with_garbage_inside_is_one_line(fp32_dir, tmp_path, capsys):
    from runtime.tokenizer import BUNDLE_MAGIC

    header = {"vocab": {"a": None}, "specials": {}, "source_bytes": 3, "target_bytes": 3}
    bundle = BUNDLE_MAGIC + json.dumps(header).encode() + b"\nxyzxyz"
    damaged = damaged_copy(fp32_dir, tmp_path, "spm.model", bundle)
    code, _, err = run_cli_captured(capsys, "serve-batch", damaged, write_lines(tmp_path / "in.txt", ["ab"]),
                                    "-o", tmp_path / "out.txt", *FAST)
    assert_one_line_error(code, err, "spm.model")


@pytest.mark.parametrize("entry", ["../outside.txt", "{abs}", "sub/../../outside.txt", "..", ""])
def test_a_manifest_entry_outside_the_dir_is_refused_before_it_is_opened(fp32_dir, tmp_path, capsys, entry):
    outside = tmp_path / "outside.txt"
    outside.write_text("not the model's\n")
    entry = entry.replace("{abs}", str(outside))
    listed = with_manifest_entry(fp32_dir, tmp_path, entry, hashlib.sha256(outside.read_bytes()).hexdigest())
    with pytest.raises(ModelDirError, match="not a file name inside the model directory"):
        read_manifest(listed, verify=False)  # refused when parsed: never opened, even unverified
    code, _, err = run_cli_captured(capsys, "serve-batch", listed, write_lines(tmp_path / "in.txt", ["ab"]),
                                    "-o", tmp_path / "out.txt", *FAST)
    assert_one_line_error(code, err, "not a file name inside the model directory")


@pytest.mark.parametrize("name", ["spm.model", MANIFEST])  # the manifest, unlisted, was read wherever it led
def test_a_link_out_of_the_model_dir_is_refused(fp32_dir, tmp_path, capsys, name):
    linked = tmp_path / "linked"
    shutil.copytree(fp32_dir, linked)
    elsewhere = tmp_path / f"elsewhere-{name}"
    shutil.move(linked / name, elsewhere)
    (linked / name).symlink_to(elsewhere)
    code, _, err = run_cli_captured(capsys, "serve-batch", linked, write_lines(tmp_path / "in.txt", ["ab"]),
                                    "-o", tmp_path / "out.txt", *FAST)
    assert_one_line_error(code, err, str(linked / name), "outside the model directory")


def test_a_link_inside_the_model_dir_still_loads(fp32_dir, tmp_path):
    linked = tmp_path / "linked"
    shutil.copytree(fp32_dir, linked)
    (linked / "spm.model").rename(linked / ".spm.real")
    (linked / "spm.model").symlink_to(".spm.real")
    assert read_manifest(linked).files["spm.model"]


@pytest.mark.slow
@pytest.mark.parametrize("args, package, extra", [
    (["import", "marian", "{tmp}", "--out", "{tmp}/x.pt"], "torch", "import"),
    (["tune-decoding", "{ckpt}", "--src", "{src}", "--ref", "{src}"], "torch", "train"),
    (["bench", "{model}", "--compare", "ctranslate2", "--backends", "onnxruntime"], "torch", "train"),
])
def test_the_deploy_install_says_what_a_command_lacks_in_one_line(fp32_dir, random_checkpoint, tmp_path, args,
                                                                   package, extra):
    src = write_lines(tmp_path / "in.txt", ["ab cd"])
    (tmp_path / "config.json").write_text("{}")
    filled = [a.format(tmp=tmp_path, ckpt=random_checkpoint, src=src, model=fp32_dir) for a in args]
    code, err = run_without(["torch", "ctranslate2", "transformers", "safetensors"], *filled)
    assert code == 2
    assert_one_line_error(code, err, f"needs {package}", f'pip install -e ".[{extra}]"', f"pipeline {args[0]}")


def test_a_missing_module_of_our_own_keeps_its_traceback():
    from pipeline.cli import missing_package

    assert missing_package(ModuleNotFoundError("x", name="pipeline.nothing"), ["serve"]) is None
    line = missing_package(ModuleNotFoundError("x", name="ctranslate2.converters"), ["bench", "DIR"])
    assert line is not None and "ctranslate2" in line and ".[bench]" in line


@pytest.mark.parametrize("manifest", [b'{"format": "pipeline-mo', b"[1, 2]", b'{"format": "x", "files": {}}', None,
                                      b'{"format": "pipeline-model-dir-v2"}'])  # our format, its fields gone
def test_a_dir_whose_manifest_cannot_be_read_is_told_a_fix_export_takes(fp32_dir, random_checkpoint, tmp_path,
                                                                       capsys, manifest):
    """`re-run pipeline export CHECKPOINT --out DIR --force`, which export refuses for a dir whose manifest it cannot
    read (it replaces only its own): the advice is a new --out, and that export runs."""
    broken = tmp_path / "broken"
    shutil.copytree(fp32_dir, broken)
    if manifest is None:
        (broken / MANIFEST).unlink()
    else:
        (broken / MANIFEST).write_bytes(manifest)
    with pytest.raises(ModelDirError) as info:
        read_manifest(broken)
    assert "--force" not in str(info.value) and "into a new --out" in str(info.value), info.value
    code, _, err = run_cli_captured(capsys, "export", random_checkpoint, "--out", broken, "--force", "--no-tensorrt")
    assert_one_line_error(code, err, "--force only replaces a model directory an export wrote")


@pytest.mark.parametrize("key, change", [("n_dec_layers", 1), ("d_model", 2), ("n_heads", 4), ("eos_id", 1),
                                         ("vocab_size", 8)])
@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_a_hand_edited_model_config_is_one_line_naming_the_manifest(fp32_dir, tmp_path, capsys, key, change, backend):
    """The manifest is the one file no digest covers. Edited, onnxruntime failed mid-batch (KeyError 'cross_k.2',
    invalid dimensions) or, with another eos_id, translated every line to the length limit; torch (reading
    model.pt's config) and doctor said nothing; a vocab_size edit blamed spm.model."""
    copy = tmp_path / "edited"
    shutil.copytree(fp32_dir, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    config = manifest["model_config"]
    config[key] += change if key != "d_model" else config["n_heads"] * change  # (d_model 32: divisible by 8)
    (copy / MANIFEST).write_text(json.dumps(manifest))
    src = write_lines(tmp_path / "in.txt", ["ab cd", "ef"])
    code, _, err = run_cli_captured(capsys, "serve-batch", copy, src, "-o", tmp_path / "out.txt", "--backend",
                                    backend)
    assert_one_line_error(code, err, f"model_config.{key} is {config[key]}")
    assert ("manifest.json" in err or "encoder.onnx" in err) and "export" in err, err
    assert not (tmp_path / "out.txt").exists()

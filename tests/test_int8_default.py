"""`pipeline export --int8` (rowwise, the CPU default) calibrates static activation scales by default (issue 62): on
the held-out set's sources (--reference-src, else the checkpoint's save dir validation set), per-row dynamic scales
only without any (a bare .pt: an imported model without --reference-src) or with --no-int8-calibrate, and one
line on stderr says which; --int8-calibrate FILE still chooses the lines. The manifest records which was used."""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import onnx
import pytest
from helpers import SMALL_LIMITS, run_cli_captured

from export import quantize
from export.errors import ExportError
from export.options import CALIBRATION_LINES, Calibration, ExportOptions
from export.plan import NO_SENTENCES, activation_scales

LIMITS = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL_LIMITS.items()]
HINT = "(--int8-calibrate FILE to choose others; --no-int8-calibrate for per-row dynamic scales)"
VALID = ["ab cd", "", "ef gh ij", "kl"]  # 3 non-blank lines


@pytest.fixture
def save_dir(random_checkpoint, tmp_path) -> tuple[Path, Path]:
    """(checkpoint, validation sources): a save dir whose config.json names a validation set, as training writes."""
    save = tmp_path / "run"
    save.mkdir()
    shutil.copy(random_checkpoint, save / "checkpoint_3.pt")
    src, tgt = tmp_path / "valid.de", tmp_path / "valid.en"
    src.write_text("\n".join(VALID) + "\n")
    tgt.write_text("AB\nBLANK\nEF\nKL\n")
    (save / "config.json").write_text(json.dumps({"resolved_options": {
        "builtin_pairs": None, "valid_src": str(src), "valid_tgt": str(tgt)}}))
    return save / "checkpoint_3.pt", src


def _export(capsys, checkpoint: Path, out: Path, *args: object) -> str:
    """`pipeline export CHECKPOINT --int8 ARGS` with the default int8 bound (no references recorded, which changes
    nothing calibration reads); its stderr."""
    code, _, err = run_cli_captured(capsys, "export", checkpoint, "--out", out, "--int8", "--no-tensorrt",
                                    "--reference-lines", 0, *LIMITS, *args)
    assert code == 0, err
    return err


def _scales_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("int8: ")]


def _verification(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())["verification"]


def _reduce_maxes(out: Path) -> int:
    """Per-row quantizations left in the decoder graph (one per per-row GEMM)."""
    graph = onnx.load(str(out / "decoder.onnx"), load_external_data=False).graph
    return collections.Counter(n.op_type for n in graph.node)["ReduceMax"]


def test_default_calibrates_on_the_save_dirs_validation_set(save_dir, tmp_path, capsys):
    checkpoint, valid = save_dir
    out = tmp_path / "m"
    err = _export(capsys, checkpoint, out)
    assert _scales_lines(err) == [f"int8: static activation scales calibrated on 3 lines of {valid} {HINT}"]
    ver = _verification(out)
    assert ver["int8_activation_scales"] == {"kind": "static", "calibrated_on": str(valid), "lines": 3,
                                             "chosen": "default", "note": _scales_lines(err)[0]}
    static = ver["int8_static_scales"]
    assert static["calibration_lines"] == 3
    assert static["decoder.onnx"]["static"] > 0 and static["decoder.onnx"]["per_row"] == 1  # the first layers
    assert _reduce_maxes(out) == 1


def test_without_held_out_sentences_the_scales_stay_per_row(random_checkpoint, tmp_path, capsys):
    """A bare .pt (no save dir) whose languages are unknown has nothing to calibrate on, the built-in sample
    included (tests/test_int8_sample.py)."""
    out = tmp_path / "m"
    err = _export(capsys, random_checkpoint, out)
    line = f"int8: per-row dynamic activation scales ({NO_SENTENCES}; this model's languages are unknown (export " \
           "--src-lang/--tgt-lang name them))"
    assert line == ("int8: per-row dynamic activation scales (no held-out sentences to calibrate on: give "
                    "--int8-calibrate FILE or --reference-src/--reference-tgt; this model's languages are unknown "
                    "(export --src-lang/--tgt-lang name them))")
    assert _scales_lines(err) == [line]
    ver = _verification(out)
    assert ver["int8_activation_scales"] == {"kind": "per-row", "note": line} and "int8_static_scales" not in ver
    assert _reduce_maxes(out) > 1


def test_reference_src_is_calibrated_on(random_checkpoint, save_dir, tmp_path, capsys):
    """An imported model (a bare .pt) calibrates on the sentences given with --reference-src."""
    _, valid = save_dir
    out = tmp_path / "m"
    err = _export(capsys, random_checkpoint, out, "--reference-src", valid, "--reference-tgt",
                  valid.with_suffix(".en"))
    assert _scales_lines(err) == [f"int8: static activation scales calibrated on 3 lines of {valid} {HINT}"]
    assert _verification(out)["int8_static_scales"]["calibration_lines"] == 3


def test_opting_out_and_choosing_the_lines(save_dir, tmp_path, capsys, monkeypatch):
    checkpoint, _ = save_dir
    out = tmp_path / "per-row"
    assert _scales_lines(_export(capsys, checkpoint, out, "--no-int8-calibrate")) == [
        "int8: per-row dynamic activation scales (--no-int8-calibrate)"]
    assert _verification(out)["int8_activation_scales"]["kind"] == "per-row" and _reduce_maxes(out) > 1

    chosen = tmp_path / "chosen.txt"
    chosen.write_text("mn op\nqr\n")
    out = tmp_path / "chosen"
    assert _scales_lines(_export(capsys, checkpoint, out, "--int8-calibrate", chosen)) == [
        f"int8: static activation scales calibrated on 2 lines of {chosen} (--int8-calibrate)"]
    ver = _verification(out)
    assert ver["int8_activation_scales"]["chosen"] == "given" and ver["int8_static_scales"]["calibration_lines"] == 2
    monkeypatch.chdir(tmp_path)  # given relative, recorded absolute (it was recorded as typed: "chosen.txt")
    _export(capsys, checkpoint, tmp_path / "relative", "--int8-calibrate", "chosen.txt")
    assert _verification(tmp_path / "relative")["int8_activation_scales"]["calibrated_on"] == str(chosen)

    code, _, err = run_cli_captured(capsys, "export", checkpoint, "--out", tmp_path / "x", "--int8", "--no-tensorrt",
                                    "--int8-calibrate", chosen, "--no-int8-calibrate")
    assert code != 0 and "contradict" in err and not (tmp_path / "x").exists()


def test_what_each_flavour_does_with_the_default_lines():
    """The held-out lines serve rowwise only: qdq (fp32 activations) and ort-dynamic skip them without a word,
    and fp32 too; lines asked for are refused there. export_model's references are calibrated on like the
    command's held-out set, CALIBRATION_LINES at most."""
    held_out = Calibration(["ab", "cd"], "valid.de", default=True)
    for flavour in (None, quantize.QDQ, quantize.ORT_DYNAMIC):
        assert activation_scales(ExportOptions(out=Path("m"), calibration=held_out), flavour) == (None, None)
        with pytest.raises(ExportError, match="rowwise"):
            activation_scales(ExportOptions(out=Path("m"), calibration=["ab"]), flavour)
    sources = [f"line {i}" for i in range(CALIBRATION_LINES + 5)]
    got, line = activation_scales(ExportOptions(out=Path("m"), references=(sources, sources)), quantize.ROWWISE)
    assert got is not None and got.lines == sources[:CALIBRATION_LINES] and got.default
    assert line == f"int8: static activation scales calibrated on {CALIBRATION_LINES} lines of the held-out " \
                   f"set's sources {HINT}"
    got, line = activation_scales(ExportOptions(out=Path("m"), calibration=["ab"]), quantize.ROWWISE)
    assert got == Calibration(["ab"], "the calibration lines") and line is not None and line.endswith(
        "(--int8-calibrate)")
    opted_out = ExportOptions(out=Path("m"), calibration=held_out, no_int8_calibrate=True)
    assert activation_scales(opted_out, quantize.ROWWISE) == (
        None, "int8: per-row dynamic activation scales (--no-int8-calibrate)")

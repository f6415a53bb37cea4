"""The model dir's manifest: one typed reader that names any field of the wrong shape,
and the training steps of the exported checkpoint (averaged or not)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli

from export import api
from model import preset
from model.checkpoint import load_model, save_checkpoint
from model.manifest import (
    MANIFEST,
    PRECISIONS,
    Engines,
    Graphs,
    Limits,
    Manifest,
    ModelDirError,
    SourceCheckpoint,
    read_manifest,
    write_manifest,
)


def small_manifest(**changes) -> Manifest:
    fields = dict(
        model_config=preset("tiny", vocab_size=64), precision="fp32", opset=18, topk=16,
        limits=Limits(max_batch=4, max_src_len=32, max_tgt_len=40, max_beam=2),
        source_checkpoint=SourceCheckpoint(path="/ckpt/averaged.pt", sha256="ab" * 32, steps=[20, 30]),
        versions={"torch": "2.13.0", "tensorrt": None},
        graphs=Graphs(export_seconds=1.5, bytes={"encoder.onnx": 10}),
        verification={"atol": 1e-4, "rtol": 0.0},
    )
    return Manifest(**{**fields, **changes})


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    (d / "encoder.onnx").write_bytes(b"graph")
    write_manifest(d, small_manifest())
    return d


def rewrite(model_dir: Path, edit) -> None:
    """Edit the manifest JSON in place (valid JSON, possibly of the wrong shape)."""
    data = json.loads((model_dir / MANIFEST).read_text())
    edit(data)
    (model_dir / MANIFEST).write_text(json.dumps(data))


def test_round_trip_is_typed_and_hashes_files(model_dir):
    m = read_manifest(model_dir)
    assert m == write_manifest(model_dir, small_manifest())
    assert m.limits.max_hyps == 8 and m.model_config.d_head == m.model_config.d_model // m.model_config.n_heads
    assert m.source_checkpoint.steps == [20, 30] and m.tensorrt is None
    assert m.lists("encoder.onnx") and not m.lists("encoder.onnx", "decoder.onnx")
    with_engines = small_manifest(tensorrt=Engines("10.9.0", "NVIDIA H100", "9.0", "fp32", 4.0, "/c"))
    written = write_manifest(model_dir, with_engines)
    assert read_manifest(model_dir) == written and written.tensorrt.gpu == "NVIDIA H100"


def _set(path: str, value):
    def edit(data):
        *parents, last = path.split(".")
        for p in parents:
            data = data[p]
        data[last] = value
    return edit


def _drop(path: str):
    def edit(data):
        *parents, last = path.split(".")
        for p in parents:
            data = data[p]
        del data[last]
    return edit


@pytest.mark.parametrize("edit, field, says", [
    (_drop("topk"), "topk", "is missing"),
    (_set("topk", "16"), "topk", "must be an integer"),
    (_set("topk", True), "topk", "must be an integer"),
    (_set("opset", None), "opset", "must be an integer"),
    (_drop("limits.max_beam"), "limits.max_beam", "is missing"),
    (_set("limits", [4, 32, 40, 2]), "limits", "must be an object"),
    (_set("limits.max_src_len", -1), "limits", "max_src_len must be at least 1, got -1"),  # blamed the source
    (_set("limits.max_beam", 0), "limits", "max_beam must be at least 1, got 0"),
    (_set("source_checkpoint.steps", 20), "source_checkpoint.steps", "must be a list"),
    (_set("source_checkpoint.steps", [20, "30"]), "source_checkpoint.steps[1]", "must be an integer"),
    (_drop("source_checkpoint"), "source_checkpoint", "is missing"),
    (_set("model_config.d_model", "32"), "model_config.d_model", "must be an integer"),
    (_set("model_config.n_heads", 3), "model_config", "divisible by n_heads"),
    (_set("precision", "int4"), "precision", "expected one of fp32, fp16"),
    (_set("quantization", "int4"), "quantization", "expected one of qdq, rowwise, ort-dynamic"),
    (_set("tensorrt", 5), "tensorrt", "must be an object or null"),
    (_set("graphs.bytes", {"encoder.onnx": "10"}), "graphs.bytes.encoder.onnx", "must be an integer"),
    (_set("files", ["encoder.onnx"]), "files", "must be an object"),
])
def test_wrong_shape_names_the_field(model_dir, edit, field, says):
    rewrite(model_dir, edit)
    with pytest.raises(ModelDirError) as e:
        read_manifest(model_dir, verify=False)
    msg = str(e.value)
    assert f"'{field}'" in msg and says in msg and str(model_dir / MANIFEST) in msg
    assert "pipeline export" in msg and "\n" not in msg


@pytest.mark.parametrize("edit", [
    _set("topk", 100000),            # the graph's top-K is 16: ONNX Runtime's shape error and a traceback
    _set("topk", 1),                 # "use a beam of at most 0"
    _set("limits.max_src_len", 100000),  # a long line: GatherND's invalid index, a traceback
    _set("model_config.eos_id", 0),  # equal to pad: accepted, and every source's EOS masked as padding
])
def test_fields_that_disagree_are_one_line(model_dir, tmp_path, capsys, edit):
    """A hand-edited manifest whose fields disagree (what export refuses together) reached the runtime."""
    rewrite(model_dir, edit)
    with pytest.raises(ModelDirError, match="manifest fields disagree") as e:
        read_manifest(model_dir, verify=False)
    assert "pipeline export" in str(e.value) and "\n" not in str(e.value)
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    assert run_cli("serve-batch", model_dir, src, "-o", tmp_path / "out.txt") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "manifest fields disagree" in err and "Traceback" not in err


def test_a_manifest_nested_too_deeply_is_one_line(model_dir):
    """json's RecursionError was a traceback (only its decode errors were caught)."""
    (model_dir / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ModelDirError, match=r"unreadable manifest \(nested too deeply\)"):
        read_manifest(model_dir, verify=False)


def test_wrong_shape_is_one_line_at_the_cli(model_dir, tmp_path, capsys):
    rewrite(model_dir, _drop("limits.max_src_len"))
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    assert run_cli("serve-batch", model_dir, src, "-o", tmp_path / "out.txt", "--backend", "torch") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'limits.max_src_len' is missing" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_old_format_is_told_to_re_export(model_dir):
    rewrite(model_dir, _set("format", "pipeline-model-dir-v1"))
    with pytest.raises(ModelDirError, match=r"older pipeline \(pipeline-model-dir-v1\); re-export it"):
        read_manifest(model_dir)


def test_precisions_are_one_extendable_tuple():
    assert PRECISIONS[:2] == ("fp32", "fp16")
    for p in PRECISIONS:
        assert small_manifest(precision=p).precision == p
    with pytest.raises(ModelDirError, match="'precision'"):
        small_manifest(precision="bf16")


# -- which training steps the exported weights come from ------------------------------------

def test_checkpoint_steps_from_every_checkpoint_kind():
    assert api.checkpoint_steps({"train_state": {"step": 400}, "extra": {}}) == [400]
    assert api.checkpoint_steps({"train_state": None, "extra": {"steps": [300, 400]}}) == [300, 400]
    # averaged.pt as `pipeline average` wrote it before it recorded extra["steps"]
    old = {"train_state": None, "extra": {"averaged": ["checkpoint_00000400.pt", "checkpoint_00000300.pt"],
                                          "step": None}}
    assert api.checkpoint_steps(old) == [300, 400]
    assert api.checkpoint_steps({"train_state": None, "extra": {}}) == []
    # checkpoint_best.pt keeps no training state, only the step it was validated at (its export recorded none)
    assert api.checkpoint_steps({"train_state": None, "extra": {"step": 160, "bleu": 12.5}}) == [160]


@pytest.mark.slow
def test_export_of_an_averaged_checkpoint_records_its_steps(random_checkpoint, tmp_path, capsys):
    save_dir = tmp_path / "run"
    model, spm, _ = load_model(random_checkpoint)
    for step in (10, 20, 30):
        save_checkpoint(save_dir / f"checkpoint_{step:08d}.pt", model, spm, train_state={"step": step})
    assert run_cli("average", save_dir, "--last", "2") == 0
    out = tmp_path / "m"
    manifest = api.export_model(save_dir / "averaged.pt", out, tensorrt=False, max_batch=2, max_src_len=16,
                                max_tgt_len=20, max_beam=2, topk=4)
    assert manifest.source_checkpoint.steps == [20, 30] == read_manifest(out).source_checkpoint.steps
    assert manifest.source_checkpoint.path == str((save_dir / "averaged.pt").resolve())


def test_a_training_save_dir_given_as_a_model_dir_is_told_to_export(tmp_path):
    """It said "no manifest.json ... re-run `pipeline export ... --force`", though nothing had been exported."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint_00000100.pt").write_bytes(b"x")
    with pytest.raises(ModelDirError, match=r"a training save dir, not a model directory; export it first: "
                                            r"`pipeline export .*run --out MODEL_DIR`"):
        read_manifest(run)


def test_a_graph_weights_file_the_manifest_does_not_list_is_refused(model_dir):
    """decoder.data taken out of the manifest's files was loaded unchecked (zeroed half of it: empty
    translations, exit 0): a file of the kinds backends read must be listed, so it is verified."""
    (model_dir / "decoder.data").write_bytes(b"weights")
    write_manifest(model_dir, small_manifest())
    read_manifest(model_dir)
    rewrite(model_dir, lambda data: data["files"].pop("decoder.data"))
    with pytest.raises(ModelDirError, match=r"decoder\.data: not listed in the manifest, so never checked"):
        read_manifest(model_dir)
    read_manifest(model_dir, verify=False)  # what a dir records is still readable

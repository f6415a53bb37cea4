"""The model-dir seam (runtime/model_dir.py, runtime/registry.py): a dir is opened once, its manifest
read once per load whatever the caller, the model's decoding defaults applied in one place, and the
backends declared in one table."""

from __future__ import annotations

import json
import pathlib
from pathlib import Path

import pytest

from model.manifest import MANIFEST
from runtime import registry
from runtime.decoding import PAPER
from runtime.errors import RuntimeUserError
from runtime.model_dir import LoadOptions, ModelDir, load
from tests.helpers import FAST, run_cli_captured, write_lines


@pytest.fixture
def manifest_reads(monkeypatch) -> list[str]:
    """Every read of a manifest.json in this test, by path."""
    reads: list[str] = []
    read_text = pathlib.Path.read_text

    def counting(self: Path, *args, **kwargs):
        if self.name == MANIFEST:
            reads.append(str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", counting)
    return reads


def test_a_load_reads_the_manifest_once(fp32_dir, manifest_reads):
    loaded = load(fp32_dir, LoadOptions(backend="onnxruntime", threads=1))
    assert loaded.backend.name == "onnxruntime"
    assert len(manifest_reads) == 1


def test_an_open_dir_loads_every_backend_without_reading_it_again(fp32_dir, manifest_reads):
    opened = ModelDir.open(fp32_dir)
    for name in ("onnxruntime", "torch"):
        assert load(opened, LoadOptions(backend=name, threads=1)).backend.name == name
    assert len(manifest_reads) == 1


def test_serve_batch_reads_the_manifest_once(fp32_dir, tmp_path, capsys, manifest_reads):
    src = write_lines(tmp_path / "in.txt", ["ab cd", "ef"])
    code, _, err = run_cli_captured(capsys, "serve-batch", fp32_dir, src, "-o", tmp_path / "out.txt", *FAST)
    assert code == 0, err
    assert len(manifest_reads) == 1


def test_parity_of_two_backends_reads_the_manifest_once(fp32_dir, tmp_path, manifest_reads):
    from pipeline.evaluation.parity import run_parity
    from pipeline.serve_batch.translation import ServeBatchOptions

    src = write_lines(tmp_path / "in.txt", ["ab cd", "ef gh ij"])
    report = run_parity(fp32_dir, src, src, ["torch", "onnxruntime"], threads=1,
                        opts=ServeBatchOptions(decoding=PAPER.replace(max_len_a=0.0, max_len_b=6)))
    assert [r.backend for r in report.results] == ["torch", "onnxruntime"]
    assert len(manifest_reads) == 1


def test_the_models_own_decoding_defaults_apply_under_what_the_user_gave(fp32_dir, tmp_path):
    import shutil

    imported = tmp_path / "imported"
    shutil.copytree(fp32_dir, imported)
    manifest = json.loads((imported / MANIFEST).read_text())
    manifest["decoding"] = {"beam_size": 2, "alpha": 1.0, "rules": "transformers"}
    (imported / MANIFEST).write_text(json.dumps(manifest))

    assert load(imported, LoadOptions(backend="onnxruntime")).decoding.beam_size == 2
    given = PAPER.replace(beam_size=3, explicit=frozenset({"beam_size"}))
    decoding = load(imported, LoadOptions(backend="onnxruntime"), given).decoding
    assert (decoding.beam_size, decoding.alpha, decoding.rules) == (3, 1.0, "transformers")


def test_the_registry_is_the_one_list_of_backends():
    from runtime.registry import BACKENDS, backend_names

    assert backend_names() == tuple(e.name for e in registry.ENTRIES)
    assert BACKENDS == ("auto", *backend_names())


def test_auto_picks_the_first_backend_the_machine_and_dir_allow(fp32_dir):
    manifest = ModelDir.open(fp32_dir).manifest
    expected = "onnxruntime" if registry.installed("onnxruntime") else "torch"
    assert registry.choose_backend(manifest) == expected


def test_a_backend_that_cannot_decode_over_a_shortlist_says_so(fp32_dir):
    manifest = ModelDir.open(fp32_dir).manifest
    with pytest.raises(registry.RuntimeUserError, match="--shortlist runs on the torch and onnxruntime"):
        registry.entry("tensorrt").needs(manifest, True, fp32_dir)
    assert registry.entry("onnxruntime").needs(manifest, False, fp32_dir) == registry.entry("onnxruntime").files


def test_load_options_problems_name_each_field_as_the_front_end_calls_it(tmp_path):
    """Every impossible setting at once, as the CLI's flags (precision's is --dtype), or as another front end
    names the fields; load() refuses with them before the model dir is read."""
    bad = LoadOptions(backend="nope", threads=2, precision="fp64", parallel_batches=3)
    assert bad.problems() == [
        "--backend 'nope': choose one of " + ", ".join(registry.BACKENDS),
        "--dtype 'fp64': choose fp32 or fp16",
        "--parallel-batches 3 needs at least as many --threads (got 2): each batch runs on --threads / "
        "--parallel-batches of them"]
    assert bad.problems(name=str)[1:] == [
        "precision 'fp64': choose fp32 or fp16",
        "parallel_batches 3 needs at least as many threads (got 2): each batch runs on threads / parallel_batches "
        "of them"]
    assert LoadOptions(threads=0, parallel_batches=0).problems() == [
        "--threads must be at least 1 (got 0)", "--parallel-batches must be at least 1 (got 0)"]
    assert LoadOptions(threads=4, parallel_batches=2).problems() == []
    # more than 4 threads per usable core (at least 64 allowed): 100,000 started ~32k threads, the PIDs ran out
    from runtime.machine import usable_cores

    most = max(64, 4 * usable_cores())
    assert LoadOptions(threads=most).problems() == []
    assert LoadOptions(threads=most + 1).problems() == [
        f"--threads {most + 1} is more than this machine takes ({most}: 4 per usable core of its {usable_cores()}, "
        "or 64); more threads than cores only add switching: leave it out to use every core"]
    with pytest.raises(Exception) as e:
        load(tmp_path / "missing", bad)
    assert str(e.value).startswith("--backend 'nope'") and "--dtype" in str(e.value)


def test_the_registry_says_which_load_options_each_backend_takes(fp32_dir):
    """--step is the torch backend's, --parallel-batches onnxruntime's: load refuses either for another backend
    in the registry's words, and for_backend leaves out what a backend does not take (bench, parity)."""
    assert registry.takers("step") == ("torch",) and registry.takers("parallel_batches") == ("onnxruntime",)
    given = LoadOptions(threads=2, step="eager", parallel_batches=2)
    assert given.only_some() == {"step": "eager", "parallel_batches": 2}
    assert given.for_backend("torch") == LoadOptions(backend="torch", threads=2, step="eager")
    assert given.for_backend("onnxruntime") == LoadOptions(backend="onnxruntime", threads=2, parallel_batches=2)
    with pytest.raises(registry.RuntimeUserError) as e:
        load(fp32_dir, LoadOptions(backend="torch", threads=2, parallel_batches=2))
    assert str(e.value) == ("--parallel-batches 2: only the onnxruntime backend (on the CPU) decodes batches side by "
                            "side, and the backend here is torch; add --backend onnxruntime or leave "
                            "--parallel-batches out")
    with pytest.raises(registry.RuntimeUserError, match="only the torch backend chooses its decoder step"):
        load(fp32_dir, LoadOptions(backend="onnxruntime", step="eager"))
    # --dtype fp16 on onnxruntime ran the fp32 graphs in silence, where --step was refused
    with pytest.raises(registry.RuntimeUserError, match="^--dtype fp16: only the torch backend runs in a precision"):
        load(fp32_dir, LoadOptions(backend="onnxruntime", precision="fp16"))


def test_loaded_carries_the_options_it_runs_with(fp32_dir):
    """`auto` and the torch backend's default step resolved; every backend answers the protocol's questions
    (batch limit, parallel batches, step, compile time) without a getattr."""
    auto = load(fp32_dir, LoadOptions(threads=1))
    assert auto.options.backend == auto.backend.name == registry.choose_backend(auto.manifest)
    torch_loaded = load(fp32_dir, LoadOptions(backend="torch", threads=1, device="cpu"))
    assert torch_loaded.options == LoadOptions(backend="torch", device="cpu", threads=1, step="eager")
    for loaded in (auto, torch_loaded):
        b = loaded.backend
        assert (b.max_batch, b.parallel_batches, b.compile_seconds) == (None, 1, 0.0)
        assert b.step_mode == loaded.options.step


def test_more_batches_at_once_than_cores_is_said(fp32_dir, caplog):
    """--parallel-batches 8 without --threads on 2 cores ran 8 single-thread batches in silence (with --threads
    fewer than the batches it is refused): it is said, with the most that fits."""
    import logging

    from runtime.machine import usable_cores
    from runtime.model_dir import load

    cores = usable_cores()
    with caplog.at_level(logging.WARNING, logger="runtime.ort_backend"):
        load(fp32_dir, LoadOptions(backend="onnxruntime", parallel_batches=cores + 1))
    assert f"--parallel-batches {cores + 1} on {cores} usable core(s)" in caplog.text
    assert f"pass --parallel-batches {cores} or fewer" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="runtime.ort_backend"):
        load(fp32_dir, LoadOptions(backend="onnxruntime", parallel_batches=min(2, cores)))
    assert "usable core" not in caplog.text


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_loaded_translate_refuses_ids_outside_the_vocabulary_alike_on_every_backend(fp32_dir, backend):
    """-1 was the vocabulary's last row on onnxruntime (a translation) and an IndexError on torch; an id past the
    vocabulary an engine's red log line and a RuntimeError 12 frames deep; first_tokens of another length an
    IndexError."""
    loaded = load(fp32_dir, LoadOptions(backend=backend, threads=1))
    vocab = loaded.backend.cfg.vocab_size
    for bad in (-1, vocab):
        with pytest.raises(RuntimeUserError, match=rf"^source id {bad} is not in this model's vocabulary "
                                                    rf"\(ids 0..{vocab - 1}\)$"):
            loaded.translate([[5, 6, 3], [5, bad, 3]])
    with pytest.raises(RuntimeUserError, match=r"^first_tokens has 1 ids for 2 sources"):
        loaded.translate([[5, 3], [6, 3]], first_tokens=[2])
    assert len(loaded.translate([[5, 3], []])) == 2


def test_options_of_the_wrong_type_from_python_are_named():
    """LoadOptions(threads="2") was a TypeError in os.sched_getaffinity's arithmetic, threads=1.5 onnxruntime's
    "incompatible function arguments"; TrainOptions(max_steps="3") and ExportOptions(max_src_len="64") failed as
    deep (or "can't multiply sequence")."""
    from export.options import ExportOptions, check_given
    from model.errors import UserError
    from pipeline.training import TrainOptions
    from pipeline.training.options import resolve_options

    with pytest.raises(RuntimeUserError, match=r"^--threads must be an integer or None \(got '2'\)$"):
        LoadOptions(threads="2").validate()
    with pytest.raises(RuntimeUserError, match=r"^--threads must be an integer or None \(got 1.5\)$"):
        LoadOptions(threads=1.5).validate()
    with pytest.raises(UserError, match=r"^--max-steps must be an integer or None \(got '3'\)$"):
        resolve_options(TrainOptions(save_dir=Path("run"), max_steps="3"))
    with pytest.raises(Exception, match=r"^max_src_len must be an integer or None \(got '64'\)$"):
        check_given(ExportOptions(out=Path("m"), max_src_len="64"))
    import numpy as np

    LoadOptions(threads=2, device="cpu").validate()  # the right types pass, numpy's integers too
    LoadOptions(threads=np.int64(2)).validate()
    check_given(ExportOptions(out="m"))  # (a path may be a str)

"""`pipeline doctor`: the machine's facts, and which backend can serve a model dir here and why not."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import run_cli

from model import io_names
from model.manifest import Engines, Manifest, read_manifest
from pipeline.environment import Facts, Gpu, OrtFacts, TorchFacts, TrtFacts, cpu_facts, gather_facts, model_dir_verdicts

ort = pytest.importorskip("onnxruntime")


@pytest.fixture()
def model_dir(fp32_dir) -> Path:
    """The random checkpoint exported fp32 with --no-tensorrt (conftest, shared read-only)."""
    return fp32_dir


def test_doctor_prints_this_machine(capsys):
    assert run_cli("doctor") == 0
    out = capsys.readouterr().out
    assert f"torch         {torch.__version__}" in out
    assert f"onnxruntime   {ort.__version__}; providers {', '.join(ort.get_available_providers())}" in out
    assert "tensorrt" in out and "sentencepiece" in out and "ctranslate2" in out and "cpu " in out


def test_doctor_json_has_every_fact(capsys):
    assert run_cli("doctor", "--json") == 0
    facts = json.loads(capsys.readouterr().out)
    assert set(facts) == {"python", "platform", "torch", "onnxruntime", "tensorrt", "packages", "cpu"}
    assert set(facts["torch"]) >= {"version", "cuda", "cudnn", "gpus", "bf16", "nccl"}
    assert facts["torch"]["version"] == torch.__version__
    assert facts["torch"]["cuda"] == torch.version.cuda
    assert len(facts["torch"]["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert facts["onnxruntime"]["providers"] == ort.get_available_providers()
    assert set(facts["packages"]) == {"sentencepiece", "sacrebleu", "ctranslate2"}
    assert facts["tensorrt"]["usable"] or facts["tensorrt"]["reason"]
    assert set(facts["cpu"]["features"]) >= {"AVX2", "AVX-512", "AMX"}


def test_model_dir_without_engines_says_why_not_tensorrt(model_dir, capsys):
    assert run_cli("doctor", model_dir, "--json") == 0
    report = json.loads(capsys.readouterr().out)["model_dir"]
    by = {(v["backend"], v["device"]): v for v in report["backends"]}
    assert by[("torch", "cpu")]["ok"] and by[("onnxruntime", "cpu")]["ok"]
    trt = by[("tensorrt", "cuda")]
    assert not trt["ok"] and "no TensorRT engines (export skipped them: --no-tensorrt)" in trt["reason"]
    assert "--tensorrt --force" in trt["reason"]
    if not torch.cuda.is_available():
        assert not by[("torch", "cuda")]["ok"] and "no CUDA GPU" in by[("torch", "cuda")]["reason"]

    assert run_cli("doctor", model_dir) == 0
    out = capsys.readouterr().out
    assert "torch         " in out and f"model dir {model_dir}:" in out
    assert "  tensorrt     fp32  cuda  no: the model dir has no TensorRT engines" in out
    assert "  onnxruntime  fp32  cpu   yes" in out


def test_tampered_model_dir_is_one_line(model_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in model_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / io_names.ENCODER_FILE).write_bytes(b"not onnx")
    assert run_cli("doctor", bad) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("error: ") and "SHA-256" in err and err.count("\n") == 1
    # the machine's facts all the same (they were left out: a broken dir is when a bug report asks for them)
    assert f"torch         {torch.__version__}" in captured.out
    assert run_cli("doctor", bad, "--json") == 2
    report = json.loads(capsys.readouterr().out)  # JSON, not the text error alone
    assert report["torch"]["version"] == torch.__version__ and "SHA-256" in report["model_dir"]["error"]


def test_a_dir_whose_graph_cannot_run_is_a_no(model_dir, tmp_path, capsys):
    """doctor said "onnxruntime fp32 cpu yes" for a dir whose decoder.data was cut short with the manifest's
    digest recomputed (or whose decoder was another model's): it read the manifest only, and serve-batch then
    failed. Each backend that could serve the dir translates a line now; a no says what failed."""
    from model.manifest import write_manifest

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in model_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    weights = bad / io_names.weights_file(io_names.DECODER_FILE)
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    write_manifest(bad, read_manifest(bad, verify=False))
    assert run_cli("doctor", bad) == 0
    out = capsys.readouterr().out
    assert "  onnxruntime  fp32  cpu   no: cannot translate a line: " in out, out
    assert "  torch        fp32  cpu   yes" in out  # model.pt is whole
    assert run_cli("doctor", model_dir) == 0
    assert "  onnxruntime  fp32  cpu   yes" in capsys.readouterr().out
    # no backend at all: the deploy image's build step (`RUN pipeline doctor /model`) passed with exit 0 and every
    # row a no, and the container then failed at every start
    (bad / "model.pt").write_bytes(b"")
    write_manifest(bad, read_manifest(bad, verify=False))
    assert run_cli("doctor", bad) == 2
    captured = capsys.readouterr()
    assert "  torch        fp32  cpu   no: " in captured.out, captured.out
    assert captured.err == f"error: {bad}: no backend can translate with it on this machine (each row above says " \
                           "why)\n", captured.err
    assert run_cli("doctor", bad, "--json") == 2  # no rows printed: the JSON says why
    captured = capsys.readouterr()
    assert "(the JSON's model_dir.backends say why)" in captured.err and json.loads(captured.out)["model_dir"]


def _gpu_facts(trt_version: str | None = "10.13.0.35", providers: tuple[str, ...] = (
        "CUDAExecutionProvider", "CPUExecutionProvider")) -> Facts:
    real = gather_facts()
    gpu = TorchFacts("2.13.0+cu130", "13.0", 91000, (Gpu(0, "NVIDIA H100 80GB HBM3", 79.1, "9.0"),), True, True)
    trt = TrtFacts(trt_version, usable=True) if trt_version else TrtFacts(None, reason="tensorrt is not installed")
    return Facts(real.python, real.platform, gpu, OrtFacts("1.31.1", providers), trt, real.packages, real.cpu)


def _manifest_with_engines(model_dir: Path, version: str, gpu: str) -> Manifest:
    manifest = read_manifest(model_dir)
    files = dict(manifest.files, **{io_names.ENCODER_ENGINE: "x", io_names.DECODER_ENGINE: "x"})
    engines = Engines(version=version, gpu=gpu, compute_capability="9.0", precision="fp32", workspace_gib=4.0,
                      timing_cache="timing.cache")
    return dataclasses.replace(manifest, files=files, tensorrt=engines)


def test_verdicts_on_a_gpu_machine(model_dir):
    facts = _gpu_facts()
    ok = {(v.backend, v.precision, v.device): v for v in
          model_dir_verdicts(_manifest_with_engines(model_dir, "10.13.0.35", "NVIDIA H100 80GB HBM3"), facts)}
    assert all(v.ok for v in ok.values()), ok
    assert set(ok) == {("torch", "fp32", "cpu"), ("torch", "fp32", "cuda"), ("torch", "fp16", "cuda"),
                       ("onnxruntime", "fp32", "cpu"), ("onnxruntime", "fp32", "cuda"), ("tensorrt", "fp32", "cuda")}

    other_gpu = model_dir_verdicts(_manifest_with_engines(model_dir, "10.13.0.35", "NVIDIA A100"), facts)
    trt = next(v for v in other_gpu if v.backend == "tensorrt")
    assert not trt.ok and "built for NVIDIA A100, this GPU is NVIDIA H100 80GB HBM3" in trt.reason

    old_trt = model_dir_verdicts(_manifest_with_engines(model_dir, "10.9.0", "NVIDIA H100 80GB HBM3"), facts)
    assert "TensorRT 10.9.0, this is 10.13.0.35" in next(v for v in old_trt if v.backend == "tensorrt").reason

    cpu_ort = model_dir_verdicts(read_manifest(model_dir),
                                 _gpu_facts(None, providers=("CPUExecutionProvider",)))
    ort_cuda = next(v for v in cpu_ort if v.backend == "onnxruntime" and v.device == "cuda")
    assert not ort_cuda.ok and "install onnxruntime-gpu" in ort_cuda.reason
    trt = next(v for v in cpu_ort if v.backend == "tensorrt")
    assert not trt.ok and "no TensorRT engines" in trt.reason


def test_cpu_features_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse avx2 avx512f amx_tile\n\n"
                    "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse avx2 avx512f amx_tile\n")
    cpu = cpu_facts(info)
    assert cpu.model == "Test CPU 9000" and cpu.cores >= 1
    assert cpu.features["AVX2"] and cpu.features["AVX-512"] and cpu.features["AMX"]
    assert cpu.features["AVX512-VNNI"] is False and cpu.int8_dot_product is False
    info.write_text("processor\t: 0\nmodel name\t: Test CPU 9001\nflags\t\t: fpu avx2 avx512f avx512_vnni\n")
    assert cpu_facts(info).int8_dot_product is True and cpu_facts(info).model == "Test CPU 9001"
    elsewhere = cpu_facts(tmp_path / "missing")
    assert set(elsewhere.features.values()) == {None}


def test_the_engines_fix_for_an_int8_dir_exports_int8_for_tensorrt(rowwise_dir, capsys):
    """It said `--tensorrt --force`, which exports fp32: an int8 dir's engines need --int8 --int8-flavour qdq."""
    assert run_cli("doctor", rowwise_dir, "--json") == 0
    report = json.loads(capsys.readouterr().out)["model_dir"]
    [trt] = [v for v in report["backends"] if v["backend"] == "tensorrt"]
    assert "--tensorrt --int8 --int8-flavour qdq --force" in trt["reason"]


def test_a_json_file_given_to_the_json_flag_is_explained(capsys, tmp_path):
    """`pipeline doctor --json facts.json` (--json takes a FILE elsewhere) said "facts.json: no such model
    directory (create one with `pipeline export`)"."""
    assert run_cli("doctor", "--json", tmp_path / "facts.json") == 2
    err = capsys.readouterr().err
    assert "--json is a flag, not a file" in err and f"--json > {tmp_path / 'facts.json'}" in err, err
    assert not (tmp_path / "facts.json").exists()

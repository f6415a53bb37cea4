"""`pipeline export`: graphs, axis names, verification, fp16, model dir, bad input.

All on the tiny random checkpoint of conftest (CPU, seconds). The exported dirs (conftest's
fp32_dir and fp16_dir) are built once per session and shared by the read-only tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
import torch
from helpers import ROOT, SMALL_LIMITS, hidden, run_cli_captured

from export import api, tensorrt_build, verify
from export.errors import ExportError, VerificationError
from model import build_model, io_names, preset
from model.cache import BeamCache
from model.checkpoint import CheckpointError, load_model, save_checkpoint
from model.manifest import CHECKPOINT_FILE, MANIFEST, SPM_FILE, Limits, read_manifest
from model.transformer import select_candidates
from runtime import graph_files

HAVE_TRT = tensorrt_build.installed()  # find_spec would also find tensorrt-stubs alone


def ort_session(path: Path):
    import onnxruntime as ort
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


# -- the model dir ------------------------------------------------------------------------

def test_model_dir_is_complete_and_verified(fp32_dir, random_checkpoint):
    manifest = read_manifest(fp32_dir, verify=True, need=(io_names.ENCODER_FILE, io_names.DECODER_FILE,
                                                          CHECKPOINT_FILE, SPM_FILE))
    assert manifest.precision == "fp32" and manifest.opset == 18 and manifest.topk == 16
    assert manifest.limits == Limits(**SMALL_LIMITS)
    assert set(manifest.versions) >= {"pipeline", "torch", "onnx", "onnxruntime", "tensorrt"}
    assert manifest.versions["torch"] == torch.__version__
    _, spm, _ = load_model(random_checkpoint)
    assert (fp32_dir / SPM_FILE).read_bytes() == spm
    model, spm2, _ = load_model(fp32_dir / CHECKPOINT_FILE)
    assert spm2 == spm and model.cfg == manifest.model_config
    ver = manifest.verification["onnxruntime_vs_torch_fp32"]
    assert ver["steps"] >= 10 and ver["topk_ids_checked"] > 0
    assert 0 < ver["max_abs_diff"][io_names.TOPK_LOG_PROBS] <= 1e-4
    assert ver["max_abs_diff"][io_names.EOS_LOG_PROBS] <= 1e-4
    assert manifest.source_checkpoint.path == str(random_checkpoint.resolve())


@pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed here")
def test_engines_skipped_without_tensorrt(fp16_dir):
    """Exported with the default tensorrt=None (conftest's fp16_dir; its fp32_dir says --no-tensorrt)."""
    manifest = read_manifest(fp16_dir)
    assert manifest.tensorrt is None
    assert "tensorrt is not installed" in manifest.tensorrt_skipped
    assert not (fp16_dir / io_names.ENCODER_ENGINE).exists()


def test_tampered_model_dir_is_refused(fp32_dir, tmp_path):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(fp32_dir, copy)
    with open(copy / io_names.DECODER_FILE, "ab") as f:
        f.write(b"\0")
    with pytest.raises(Exception, match="SHA-256 does not match"):
        read_manifest(copy)


# -- graph interface -------------------------------------------------------------------------

def _dims(value: onnx.ValueInfoProto) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def test_graph_names_and_shared_axes(fp32_dir):
    cfg = read_manifest(fp32_dir).model_config.to_dict()
    n, h, dh = cfg["n_dec_layers"], cfg["n_heads"], cfg["d_model"] // cfg["n_heads"]
    enc = onnx.load(str(fp32_dir / io_names.ENCODER_FILE))
    dec = onnx.load(str(fp32_dir / io_names.DECODER_FILE))
    assert [v.name for v in enc.graph.input] == io_names.encoder_inputs()
    assert [v.name for v in enc.graph.output] == io_names.encoder_outputs(n)
    assert [v.name for v in dec.graph.input] == io_names.decoder_inputs(n)
    assert [v.name for v in dec.graph.output] == io_names.decoder_outputs(n)
    enc_dims = {v.name: _dims(v) for v in list(enc.graph.input) + list(enc.graph.output)}
    dec_dims = {v.name: _dims(v) for v in list(dec.graph.input) + list(dec.graph.output)}
    assert enc_dims[io_names.SRC_IDS] == [io_names.BATCH, io_names.SRC_LEN]
    assert enc_dims[io_names.cross_k(1)] == [io_names.BATCH, h, io_names.SRC_LEN, dh]
    assert dec_dims[io_names.TOKENS] == [io_names.HYPS]
    assert dec_dims[io_names.SELF_INDEX] == [io_names.HYPS, h, io_names.PAST]
    assert dec_dims[io_names.SELF_BIAS] == [io_names.HYPS, io_names.PAST]
    assert dec_dims[io_names.STEP] == [1]
    assert dec_dims[io_names.self_v(0)] == [io_names.BATCH, h, io_names.CACHE_ROWS, dh]  # per sentence
    assert dec_dims[io_names.cross_k(0)] == [io_names.BATCH, h, io_names.SRC_LEN, dh]  # per sentence
    assert dec_dims[io_names.SRC_BIAS] == [io_names.BATCH, io_names.SRC_LEN]
    assert dec_dims[io_names.step_k(1)] == [io_names.HYPS, h * dh]
    assert dec_dims[io_names.TOPK_IDS] == [io_names.HYPS, 16]
    # Shape inference agrees with the names we set (strict mode raises on conflicts).
    onnx.shape_inference.infer_shapes(dec, strict_mode=True)


def test_first_step_with_one_hypothesis_and_capacity_one(fp32_dir):
    """hyps = 1, past = 1, cache_rows = 1, src_len = 1: the dims the exporter never saw."""
    model, _, _ = load_model(fp32_dir / CHECKPOINT_FILE)
    cfg = model.cfg
    enc, dec = ort_session(fp32_dir / io_names.ENCODER_FILE), ort_session(fp32_dir / io_names.DECODER_FILE)
    src = np.array([[cfg.eos_id]], dtype=np.int64)
    enc_out = dict(zip(io_names.encoder_outputs(cfg.n_dec_layers), enc.run(None, {io_names.SRC_IDS: src})))
    with torch.inference_mode():
        memory, src_bias = model.encode(torch.from_numpy(src))
        ck, cv = model.cross_kv(memory)
        cache = BeamCache(cfg, 1, torch.float32, initial_capacity=1)
        cache_feeds = cache.advance(torch.tensor([0]), 1)
        tokens, step = torch.tensor([cfg.bos_id]), torch.tensor([0])
        lp, _, _ = model.decode_step(tokens, step, cache_feeds[io_names.SELF_INDEX],
                                     cache_feeds[io_names.SELF_BIAS], cache.k, cache.v, ck, cv, src_bias)
        ref_lp, ref_ids, ref_eos = select_candidates(lp, 16, cfg.eos_id)
    assert np.abs(enc_out[io_names.cross_k(0)] - ck[0].numpy()).max() < 1e-5
    feeds = {io_names.TOKENS: tokens.numpy(), io_names.STEP: step.numpy(),
             io_names.SRC_BIAS: enc_out[io_names.SRC_BIAS], **{name: t.numpy() for name, t in cache_feeds.items()}}
    assert feeds[io_names.self_k(0)].shape == (1, cfg.n_heads, 1, cfg.d_head)
    for i in range(cfg.n_dec_layers):
        feeds[io_names.cross_k(i)] = enc_out[io_names.cross_k(i)]
        feeds[io_names.cross_v(i)] = enc_out[io_names.cross_v(i)]
    out = dict(zip(io_names.decoder_outputs(cfg.n_dec_layers), dec.run(None, feeds)))
    assert out[io_names.step_k(0)].shape == (1, cfg.d_model)
    assert np.abs(out[io_names.TOPK_LOG_PROBS] - ref_lp.numpy()).max() < 1e-4
    assert np.abs(out[io_names.EOS_LOG_PROBS] - ref_eos.numpy()).max() < 1e-4
    assert (out[io_names.TOPK_IDS][:, :3] == ref_ids.numpy()[:, :3]).all()


def test_beam_decoding_with_reorder_matches_torch(fp32_dir):
    """12 beam-like steps, independent of export's own verification run: ORT and torch
    each write their own caches, which grow twice; a sentence finishes midway."""
    model, _, _ = load_model(fp32_dir / CHECKPOINT_FILE)
    report = verify.compare_engines(
        model, verify.ort_runner(fp32_dir / io_names.ENCODER_FILE), verify.ort_runner(fp32_dir / io_names.DECODER_FILE),
        verify.torch_encoder(model), verify.torch_decoder(model, 16), 1e-4, 0.0, "test")
    assert report.steps == verify.N_STEPS >= 10
    assert report.max_abs[io_names.TOPK_LOG_PROBS] <= 1e-4
    assert report.ids_checked > 100


def test_verification_catches_a_wrong_graph(fp32_dir, tmp_path):
    """Perturb one decoder FFN weight by ~1e-2: verification must fail with a typed error."""
    d_ff = read_manifest(fp32_dir).model_config.d_ff
    proto = onnx.load(str(fp32_dir / io_names.DECODER_FILE))
    init = next(i for i in proto.graph.initializer if list(i.dims)[-1:] == [d_ff] and len(i.dims) == 2)
    arr = onnx.numpy_helper.to_array(init).copy()
    # Random signs: a constant shift would vanish against the zero-mean LayerNorm output.
    arr += np.random.default_rng(0).normal(0.0, 1e-2, arr.shape).astype(np.float32)
    init.CopyFrom(onnx.numpy_helper.from_array(arr, init.name))
    bad = tmp_path / "decoder.onnx"
    onnx.save(proto, str(bad))
    model, _, _ = load_model(fp32_dir / CHECKPOINT_FILE)
    with pytest.raises(VerificationError) as info:
        verify.verify_export(model, fp32_dir / io_names.ENCODER_FILE, bad, fp16=False, topk=16)
    assert info.value.diff > info.value.bound >= info.value.atol and "decoder step" in info.value.where


def test_fp16_tolerance_grows_with_the_log_prob_magnitude():
    """Unlikely candidates (log-prob -20) may differ by 0.05 in fp16; likely ones may not."""
    ref = np.array([[-0.1, -20.0]])
    report = verify.Report()
    verify._check(report, "lp", "here", ref + np.array([[0.01, 0.05]]), ref, verify.FP16_ATOL, verify.FP16_RTOL)
    with pytest.raises(VerificationError, match=r"lp at here: abs difference 0\.05 exceeds tolerance 0\.02"):
        verify._check(report, "lp", "here", ref + np.array([[0.05, 0.0]]), ref, verify.FP16_ATOL,
                      verify.FP16_RTOL)
    with pytest.raises(VerificationError):
        verify._check(report, "lp", "here", ref + np.array([[0.0, np.nan]]), ref, verify.FP16_ATOL,
                      verify.FP16_RTOL)


# -- fp16 --------------------------------------------------------------------------------

def _tensor_types(proto: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(proto)
    types = {v.name: v.type.tensor_type.elem_type for v in
             list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)}
    types.update({i.name: i.data_type for i in proto.graph.initializer})
    return types


@pytest.mark.parametrize("graph", [io_names.ENCODER_FILE, io_names.DECODER_FILE])
def test_fp16_graph_carries_its_precision(fp16_dir, graph):
    proto = onnx.load(str(fp16_dir / graph))
    types = _tensor_types(proto)
    f16, f32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    matmuls = [n for n in proto.graph.node if n.op_type in ("MatMul", "Gemm")]
    assert matmuls and all(types[i] == f16 for n in matmuls for i in n.input)
    fp32_ops = [n for n in proto.graph.node if n.op_type in ("LayerNormalization", "Softmax", "LogSoftmax")]
    assert fp32_ops and all(types[n.input[0]] == f32 for n in fp32_ops)
    assert all(types[n.input[1]] == f32 for n in fp32_ops if n.op_type == "LayerNormalization")
    big = [i for i in proto.graph.initializer if len(i.dims) == 2]
    assert big and all(i.data_type == f16 for i in big)
    if graph == io_names.DECODER_FILE:
        assert types[io_names.self_k(0)] == types[io_names.cross_v(1)] == types[io_names.step_v(0)] == f16
        assert types[io_names.SRC_BIAS] == types[io_names.TOPK_LOG_PROBS] == types[io_names.EOS_LOG_PROBS] == f32
    else:
        assert types[io_names.SRC_BIAS] == f32 and types[io_names.cross_k(0)] == f16


def test_fp16_model_dir_verified_two_ways(fp16_dir, fp32_dir):
    manifest = read_manifest(fp16_dir)
    assert manifest.precision == "fp16"
    ver = manifest.verification
    assert ver["atol"] == verify.FP16_ATOL
    for key in ("onnxruntime_vs_torch_fp16", "torch_fp16_vs_torch_fp32"):
        diffs = ver[key]["max_abs_diff"]
        assert 0 < diffs[io_names.TOPK_LOG_PROBS] <= verify.FP16_ATOL, key
    # Half precision is really half: its error against fp32 is far above fp32's own.
    fp32_diff = read_manifest(fp32_dir).verification["onnxruntime_vs_torch_fp32"]["max_abs_diff"]
    assert ver["torch_fp16_vs_torch_fp32"]["max_abs_diff"][io_names.TOPK_LOG_PROBS] > \
        10 * fp32_diff[io_names.TOPK_LOG_PROBS]
    weights = [sum(len(i.raw_data) for i in onnx.load(str(d / io_names.DECODER_FILE)).graph.initializer)
               for d in (fp16_dir, fp32_dir)]
    assert weights[0] < 0.6 * weights[1]


# -- bad input ------------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_export_of_a_save_dir_prints_summary(random_checkpoint, tmp_path, capsys):
    """A save dir resolves to its latest step checkpoint; options reach the graphs."""
    save_dir = tmp_path / "run"
    save_dir.mkdir()
    model, spm, _ = load_model(random_checkpoint)
    save_checkpoint(save_dir / "checkpoint_00000010.pt", model, spm, train_state={"step": 10})
    save_checkpoint(save_dir / "checkpoint_00000020.pt", model, spm, train_state={"step": 20})
    out = tmp_path / "m"
    code, stdout, stderr = run_cli_captured(capsys, "export", save_dir, "--out", out, "--max-batch", 2,
                                            "--max-src-len", 16, "--max-tgt-len", 20, "--max-beam", 2,
                                            "--topk", 4, "--opset", 17, "--no-tensorrt")
    assert code == 0, stderr
    assert "exported fp32 model to" in stdout and "max abs log-prob difference" in stdout
    assert "TensorRT engines skipped: --no-tensorrt" in stderr
    manifest = read_manifest(out)
    assert manifest.source_checkpoint.path.endswith("checkpoint_00000020.pt")
    assert manifest.source_checkpoint.steps == [20]
    assert manifest.opset == 17 and manifest.topk == 4 and manifest.limits.max_tgt_len == 20
    dec = onnx.load(str(out / io_names.DECODER_FILE))
    assert {o.domain: o.version for o in dec.opset_import}[""] == 17
    assert _dims(dec.graph.output[0]) == [io_names.HYPS, 4]


def test_cli_help_documents_every_option(capsys):
    code, stdout, _ = run_cli_captured(capsys, "export", "--help")
    assert code == 0
    for opt in ("--out", "--fp16", "--opset", "--topk", "--max-batch", "--max-src-len", "--max-tgt-len",
                "--max-beam", "--tensorrt / --no-tensorrt", "--force", "--atol", "--fp16-atol",
                "--workspace-gib", "--timing-cache"):
        assert opt in stdout, opt


@pytest.mark.parametrize("make", ["text_file", "empty_dir", "missing"])
def test_not_a_checkpoint(tmp_path, capsys, make):
    path = tmp_path / "thing"
    if make == "text_file":
        path.write_text("hello\n")
    elif make == "empty_dir":
        path.mkdir()
    out = tmp_path / "out"
    code, _, stderr = run_cli_captured(capsys, "export", str(path), "--out", str(out))
    assert code == 2 and stderr.startswith("error: ") and str(path) in stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1
    assert not out.exists() and hidden(tmp_path) == []
    with pytest.raises(CheckpointError):
        api.export_model(path, out)


@pytest.mark.slow
def test_existing_out_needs_force_and_is_replaced_only_when_complete(fp32_dir, random_checkpoint,
                                                                   tmp_path, capsys):
    import shutil
    out = tmp_path / "m"
    shutil.copytree(fp32_dir, out)
    before = (out / MANIFEST).read_text()
    code, _, stderr = run_cli_captured(capsys, "export", str(random_checkpoint), "--out", str(out))
    assert code == 2 and "--force" in stderr and (out / MANIFEST).read_text() == before
    # A failing export with --force leaves the old dir as it was.
    with pytest.raises(VerificationError):
        api.export_model(random_checkpoint, out, force=True, atol=1e-12, **SMALL_LIMITS)
    assert (out / MANIFEST).read_text() == before and hidden(tmp_path) == []
    manifest = api.export_model(random_checkpoint, out, force=True, topk=8, **SMALL_LIMITS)
    assert read_manifest(out).topk == 8 == manifest.topk and hidden(tmp_path) == []


def test_force_never_deletes_a_directory_that_is_not_a_model_dir(random_checkpoint, tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not a model directory"):
        api.export_model(random_checkpoint, out, force=True)
    assert (out / "notes.txt").read_text() == "keep me"


def test_what_appears_at_out_while_an_export_runs_is_never_replaced(fp32_dir, random_checkpoint, tmp_path,
                                                                     monkeypatch):
    """--out was checked when the export began and replaced at its end whatever it had become: a directory a user
    made there meanwhile was deleted (exit 0), and of two exports to one new --out the last silently won."""
    import shutil

    real = api.write_model_dir

    def and_meanwhile(make):  # the model dir is written, then something appears at --out before the commit
        def write(plan, tmp, *args, **kwargs):
            manifest = real(plan, tmp, *args, **kwargs)
            make(plan.out)
            return manifest
        return write

    def user_dir(out):
        out.mkdir(exist_ok=True)
        (out / "notes.txt").write_text("keep me")

    out = tmp_path / "late"
    monkeypatch.setattr(api, "write_model_dir", and_meanwhile(user_dir))
    with pytest.raises(ExportError, match="appeared while this export ran"):
        api.export_model(random_checkpoint, out, **SMALL_LIMITS)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and hidden(tmp_path) == []
    # --force over a model dir that became something else meanwhile: refused, as it is when the export begins
    model = tmp_path / "model"
    shutil.copytree(fp32_dir, model)
    with pytest.raises(ExportError, match=r"holds 'notes\.txt'.*changed while this export ran"):
        api.export_model(random_checkpoint, model, force=True, **SMALL_LIMITS)
    assert (model / "notes.txt").read_text() == "keep me" and hidden(tmp_path) == []
    monkeypatch.setattr(api, "write_model_dir", real)
    api.export_model(random_checkpoint, tmp_path / "fresh", **SMALL_LIMITS)  # nothing appeared: placed as before


def test_force_never_deletes_a_directory_because_it_holds_a_manifest_json(fp32_dir, random_checkpoint, tmp_path):
    """Any directory with a file named manifest.json was replaced, whatever else it held (a web extension's
    src/, notes): only a directory an export wrote is, our manifest and the files it lists alone."""
    import shutil

    web = tmp_path / "webext"
    (web / "src").mkdir(parents=True)
    (web / MANIFEST).write_text('{"manifest_version": 3}')
    (web / "src" / "app.js").write_text("keep me")
    with pytest.raises(ExportError, match=r"its manifest\.json is not a model directory's"):
        api.export_model(random_checkpoint, web, force=True)
    assert (web / "src" / "app.js").read_text() == "keep me"
    model = tmp_path / "model"
    shutil.copytree(fp32_dir, model)
    (model / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match=r"holds 'notes\.txt', which its manifest\.json does not list"):
        api.export_model(random_checkpoint, model, force=True)
    assert (model / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
def test_verification_failure_leaves_nothing(random_checkpoint, tmp_path, capsys):
    out = tmp_path / "m"
    code, _, stderr = run_cli_captured(capsys, "export", random_checkpoint, "--out", out, "--atol", "1e-12",
                                       "--max-batch", 2, "--max-src-len", 16, "--max-tgt-len", 20, "--max-beam", 2)
    assert code == 2 and "verification failed" in stderr and "exceeds tolerance 1e-12" in stderr
    assert "; a small or briefly trained model can differ this much: raise --atol, then check" in stderr  # the fix
    assert not out.exists() and hidden(tmp_path) == []


def test_unsupported_config_and_options(spm_bytes, tmp_path, capsys):
    from runtime.tokenizer import Tokenizer
    cfg = preset("tiny", vocab_size=Tokenizer(spm_bytes).vocab_size, max_positions=64)
    ckpt = tmp_path / "short.pt"
    save_checkpoint(ckpt, build_model(cfg), spm_bytes)
    out = tmp_path / "m"
    # limits given explicitly are checked against the model (unset ones default within its positions)
    code, _, stderr = run_cli_captured(capsys, "export", ckpt, "--out", out, "--max-beam", 12, "--opset", 13,
                                       "--max-src-len", 256, "--max-tgt-len", 306)
    assert code == 2 and not out.exists()
    for fragment in ("--max-src-len 256 exceeds the model's max_positions (64)", "--max-tgt-len 306",
                     "--max-beam 12 needs --topk >= 24", "--opset 13 is not supported"):
        assert fragment in stderr
    # Weights that do not fit the recorded config.
    payload = torch.load(ckpt, weights_only=False)
    payload["model_config"]["d_ff"] = 128
    torch.save(payload, tmp_path / "mismatch.pt")
    code, _, stderr = run_cli_captured(capsys, "export", str(tmp_path / "mismatch.pt"), "--out", str(out))
    assert code == 2 and "cannot be loaded into its model config" in stderr and not out.exists()


@pytest.mark.slow
def test_interrupted_export_leaves_nothing(random_checkpoint, tmp_path):
    """A real SIGINT in the middle of an export (once its temp dir exists)."""
    out = tmp_path / "m"
    code = (f"from export.api import export_model; export_model({str(random_checkpoint)!r}, {str(out)!r}, "
            "max_batch=2, max_src_len=16, max_tgt_len=20, max_beam=2)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not hidden(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hidden(tmp_path), "export never created its temp dir"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and b"KeyboardInterrupt" in err, err.decode(errors="replace")[-3000:]
    assert not out.exists() and hidden(tmp_path) == []


@pytest.mark.slow
def test_ctrl_c_that_a_library_swallows_still_stops_the_export(random_checkpoint, tmp_path, monkeypatch):
    """Ctrl-C lands in library code that catches BaseException: the export must not commit."""
    verify_export = verify.verify_export

    def swallowing(*args, **kwargs):
        report = verify_export(*args, **kwargs)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the KeyboardInterrupt is raised here...
        except KeyboardInterrupt:
            pass  # ...and lost, as inside a careless library
        return report

    monkeypatch.setattr(verify, "verify_export", swallowing)
    out = tmp_path / "m"
    with pytest.raises(KeyboardInterrupt, match="SIGINT received: export to .* not done"):
        api.export_model(random_checkpoint, out, max_batch=2, max_src_len=16, max_tgt_len=20, max_beam=2)
    assert not out.exists() and hidden(tmp_path) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the latch is gone again


def test_ctrl_c_that_the_exporter_wraps_in_its_own_error_is_an_interrupt(random_checkpoint, tmp_path, monkeypatch,
                                                                         capsys):
    """Ctrl-C during torch.onnx.export came out as "torch.onnx.export of encoder.onnx failed: TorchExportError"
    and exit 2 (the exporter catches the KeyboardInterrupt and raises its own error): it is the interrupt, exit
    130, as anywhere else."""
    import torch

    def wrapping(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the KeyboardInterrupt is raised here...
        except KeyboardInterrupt as e:  # ...and wrapped, as torch.export does
            raise RuntimeError("Failed to export the model with torch.export. This is step 1/3") from e

    monkeypatch.setattr(torch.onnx, "export", wrapping)
    out = tmp_path / "m"
    with pytest.raises(KeyboardInterrupt, match="SIGINT received: export to .* not done"):
        api.export_model(random_checkpoint, out, max_batch=2, max_src_len=16, max_tgt_len=20, max_beam=2)
    assert not out.exists() and hidden(tmp_path) == []
    code, _, err = run_cli_captured(capsys, "export", random_checkpoint, "--out", out)
    assert code == 130 and "interrupted" in err and "failed" not in err, err


def test_manifest_is_json_with_files_hashed(fp32_dir):
    data = json.loads((fp32_dir / MANIFEST).read_text())
    graphs, constrained = (io_names.ENCODER_FILE, io_names.DECODER_FILE), io_names.DECODER_CONSTRAINED_FILE
    assert set(data["files"]) == {*graphs, *map(io_names.weights_file, graphs), CHECKPOINT_FILE, SPM_FILE, constrained}


@pytest.mark.parametrize("graph", [io_names.ENCODER_FILE, io_names.DECODER_FILE])
def test_graph_weights_live_in_the_file_beside_the_graph(fp32_dir, graph):
    """Every initializer of 1 KiB or more is external data in encoder.data / decoder.data
    (what lets ONNX Runtime load them without a parsed copy of the whole graph); the graph
    file itself holds only the structure and small constants."""
    proto = onnx.load(str(fp32_dir / graph), load_external_data=False)
    weights = io_names.weights_file(graph)
    external = [i for i in proto.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    assert external and all({e.key: e.value for e in i.external_data}["location"] == weights for i in external)
    assert all(len(i.raw_data) < 1024 for i in proto.graph.initializer if i.data_location != onnx.TensorProto.EXTERNAL)


def test_missing_weights_file_is_refused(fp32_dir, tmp_path):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(fp32_dir, copy)
    (copy / io_names.weights_file(io_names.DECODER_FILE)).unlink()
    with pytest.raises(Exception, match=r"decoder\.data: listed in the manifest but missing"):
        read_manifest(copy)


def test_save_graph_replaces_an_earlier_weights_file(fp32_dir, tmp_path):
    """onnx appends external data to an existing file; saving over a graph must not grow it."""
    proto = onnx.load(str(fp32_dir / io_names.DECODER_FILE))
    weights = [onnx.numpy_helper.to_array(i).tobytes() for i in proto.graph.initializer]
    path = tmp_path / io_names.DECODER_FILE
    graph_files.save_graph(proto, path)
    size = (tmp_path / "decoder.data").stat().st_size
    graph_files.externalize(path)
    assert (tmp_path / "decoder.data").stat().st_size == size
    reloaded = onnx.load(str(path))
    assert [onnx.numpy_helper.to_array(i).tobytes() for i in reloaded.graph.initializer] == weights


def test_a_default_beam_above_max_beam_is_cut_to_it(random_checkpoint, tmp_path, capsys):
    """`export --max-beam 1 --topk 2` wrote a dir whose default beam (the paper's 4) it cannot serve:
    serve-batch said "beam size 4 needs 8 candidates per step". The dir's default beam is --max-beam then."""
    out = tmp_path / "m"
    code, _, err = run_cli_captured(capsys, "export", random_checkpoint, "--out", out, "--max-beam", 1, "--topk", 2,
                                    "--max-batch", 2, "--max-src-len", 16, "--max-tgt-len", 20, "--no-tensorrt")
    assert code == 0, err
    assert read_manifest(out).decoding["beam_size"] == 1
    src = tmp_path / "in.txt"
    src.write_text("ab cd\n", encoding="utf-8")
    code, _, err = run_cli_captured(capsys, "serve-batch", out, src, "-o", tmp_path / "out.txt")
    assert code == 0, err


@pytest.mark.parametrize("flags, says", [
    (["--int8", "--int8-flavour", "qdq", "--no-int8-calibrate"], "--no-int8-calibrate turns off static activation"),
    (["--int8", "--int8-flavour", "ort-dynamic", "--no-int8-calibrate"], "flavour is ort-dynamic"),
    (["--fp16-atol", "0.5"], "--fp16-atol bounds an fp16 export's verification: add --fp16"),
    (["--fp16", "--atol", "0"], "this fp16 export's is --fp16-atol"),
    (["--int8", "--atol", "0"], "this int8 export's is --int8-atol"),
    (["--shortlist-per-source", "10", "--shortlist-frequent", "20"],
     "--shortlist-per-source and --shortlist-frequent shape a shortlist: add --shortlist-src"),
])
def test_options_that_would_change_nothing_are_refused(random_checkpoint, tmp_path, capsys, flags, says):
    """Each was accepted and did nothing (a qdq export 'without calibration', an fp32 export with an fp16 bound,
    --atol unread by fp16 and int8 verification, a shortlist's shape without a shortlist)."""
    out = tmp_path / "m"
    code, _, err = run_cli_captured(capsys, "export", random_checkpoint, "--out", out, "--no-tensorrt", *flags)
    assert code == 2 and says in err and "Traceback" not in err, err
    assert not out.exists()


def test_the_current_directory_as_out_is_refused_before_any_work(fp32_dir, random_checkpoint, tmp_path, capsys,
                                                                   monkeypatch):
    """`cd MODEL_DIR && pipeline export CKPT --out . --force` exported for its whole length, then failed with
    "Device or resource busy" renaming the directory the process stood in."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(fp32_dir, model)
    monkeypatch.chdir(model)
    code, _, err = run_cli_captured(capsys, "export", random_checkpoint, "--out", ".", "--force")
    assert code == 2 and "is the current directory or holds it" in err, err
    assert "export finished" not in err and (model / MANIFEST).is_file()


@pytest.mark.parametrize("options, error, says", [
    ({"int8": True, "int8_calibrate": Path("calib.txt")}, TypeError, r"reads no files \(int8_calibrate\)"),  # ignored
    ({"references": ["a", "b"]}, TypeError, r"^references must be \(sources, references\)"),  # recorded as text
    ({"references": (["a"], ["a", "b"])}, ExportError, r"^references: 1 sources but 2 references"),  # after 14 s
    ({"calibration": "text"}, TypeError, r"^calibration must be a list of source lines"),  # an AttributeError
    ({"atol": -1}, ExportError, r"^atol must be at least 0 \(got -1\)"),  # a VerificationError after the export
    ({"max_beam": 0}, ExportError, r"^max_beam must be at least 1 \(got 0\)"),
])
def test_export_model_from_python_checks_what_the_command_line_would(random_checkpoint, tmp_path, monkeypatch,
                                                                     options, error, says):
    monkeypatch.setattr(api, "export", lambda *a, **k: pytest.fail("exported before refusing"))
    with pytest.raises(error, match=says):
        api.export_model(random_checkpoint, tmp_path / "m", **options)
    assert not (tmp_path / "m").exists()

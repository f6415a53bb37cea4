"""Backends: ONNX Runtime translates exactly as the PyTorch model on a tiny trained model;
the loader refuses tampered dirs and missing backends with clear messages."""

from __future__ import annotations

import importlib.util
import shutil

import numpy as np
import pytest
import torch
from helpers import make_parallel, to_old_decoder_interface

from model import io_names
from model.manifest import ModelDirError, read_manifest
from runtime.backend import ExportedGraphBackend
from runtime.errors import RuntimeUserError
from runtime.model_dir import LoadOptions, load
from runtime.ort_backend import OrtBackend
from runtime.registry import choose_backend
from runtime.tokenizer import Tokenizer
from runtime.torch_backend import open_checkpoint
from runtime.translate import pad_batch, translate_ids, translate_lines

onnxruntime = pytest.importorskip("onnxruntime")


def test_trained_model_learnt_something(trained_model_dir, tiny_corpus):
    loaded = load(trained_model_dir, LoadOptions(backend="torch"))
    backend, tok = loaded.backend, loaded.tokenizer
    src, tgt = tiny_corpus
    out = translate_lines(backend, tok, src[:20], beam_size=4)
    assert sum(o == t for o, t in zip(out, tgt[:20])) >= 5, out


def test_torch_and_onnxruntime_translate_identically(trained_model_dir, tiny_corpus):
    src, _ = make_parallel(40, seed=7)  # unseen sentences of the same language
    src[3] = ""
    loaded = load(trained_model_dir, LoadOptions(backend="torch"))
    torch_backend, tok = loaded.backend, loaded.tokenizer
    ort_backend = load(trained_model_dir, LoadOptions(backend="onnxruntime", threads=1)).backend
    assert ort_backend.name == "onnxruntime" and ort_backend.providers[0] == "CPUExecutionProvider"
    ids = [tok.encode_source([s])[0] if s else [] for s in src]
    ref = translate_ids(torch_backend, ids, beam_size=4, nbest=2, batch_tokens=400)
    got = translate_ids(ort_backend, ids, beam_size=4, nbest=2, batch_tokens=400)
    assert got[3] == [] and ref[3] == []
    for r, g in zip(ref, got):
        assert [h.tokens for h in g] == [h.tokens for h in r]
        for hr, hg in zip(r, g):
            assert hg.log_prob == pytest.approx(hr.log_prob, abs=1e-4)
            assert hg.score == pytest.approx(hr.score, abs=1e-4)
    assert translate_lines(ort_backend, tok, src) == translate_lines(torch_backend, tok, src)


def test_onnxruntime_greedy_and_spinning_option(trained_model_dir):
    from runtime.ort_backend import OrtBackend

    manifest = read_manifest(trained_model_dir)
    spinning = OrtBackend(trained_model_dir, manifest, device="cpu", threads=1, spinning=True)
    loaded = load(trained_model_dir, LoadOptions(backend="onnxruntime", threads=1))
    quiet, tok = loaded.backend, loaded.tokenizer
    src = pad_batch(tok.encode_source(["der hund sieht eine katze", "ein kind"]))
    from runtime.search import greedy_search
    a = greedy_search(spinning, src)
    b = greedy_search(quiet, src)
    assert [h[0].tokens for h in a] == [h[0].tokens for h in b]
    assert all(h[0].tokens for h in a)
    # CPU sessions keep ORT's BFC arena: without it, the step's gathered histories (a little
    # larger every step) were mapped fresh by glibc every step (measured in ort_backend.py).
    for session in (quiet.encoder, quiet.decoder):
        assert session.get_session_options().enable_cpu_mem_arena is True
    # ... but the encoder's arena is released after each encoding, so its high-water mark is not
    # held through the decoding; the next encoding allocates afresh and computes the same
    shrink = quiet._encoder_run_options.get_run_config_entry("memory.enable_memory_arena_shrinkage")
    assert shrink == "cpu:0"
    first, again = quiet.encode(src), quiet.encode(src)
    assert all(np.array_equal(first.tensors[k], again.tensors[k]) for k in first.tensors)


def test_limits_come_from_the_manifest(trained_model_dir):
    for name in ("torch", "onnxruntime"):
        loaded = load(trained_model_dir, LoadOptions(backend=name))
        backend, manifest = loaded.backend, loaded.manifest
        assert backend.max_src_len == 48 and backend.max_tgt_len == 64
        assert backend.topk == manifest.topk == 16


def test_auto_prefers_onnxruntime_here(trained_model_dir):
    loaded = load(trained_model_dir, LoadOptions(backend="auto"))
    backend, manifest = loaded.backend, loaded.manifest
    assert choose_backend(manifest) == "onnxruntime" == backend.name


def test_tampered_and_missing_model_dirs_are_refused(trained_model_dir, tmp_path):
    bad = tmp_path / "copy"
    shutil.copytree(trained_model_dir, bad)
    with open(bad / "decoder.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ModelDirError, match=r"decoder\.onnx.*SHA-256.*pipeline export"):
        load(bad, LoadOptions(backend="onnxruntime"))
    with pytest.raises(ModelDirError, match="no such model directory"):
        load(tmp_path / "nope", LoadOptions(backend="torch"))
    missing = tmp_path / "missing"
    shutil.copytree(trained_model_dir, missing)
    (missing / "model.pt").unlink()
    with pytest.raises(ModelDirError, match=r"model\.pt.*missing"):
        load(missing, LoadOptions(backend="torch"))


def test_older_decoder_interface_is_a_clear_error(trained_model_dir, tmp_path):
    """A model dir exported before the beam cache (its decoder takes `reorder`) asks for re-export."""
    old = tmp_path / "old"
    shutil.copytree(trained_model_dir, old)
    to_old_decoder_interface(old)
    with pytest.raises(RuntimeUserError, match="older decoder interface.*export the model again"):
        OrtBackend(old, read_manifest(old, verify=False), device="cpu")
    # the TensorRT backend runs the same check on its engine's inputs (no engine can be built here)
    with pytest.raises(RuntimeUserError, match=r"decoder\.plan has an older decoder interface"):
        ExportedGraphBackend.check_decoder_inputs(["tokens", "step", "reorder"], old / io_names.DECODER_ENGINE)
    ExportedGraphBackend.check_decoder_inputs(io_names.decoder_inputs(2), old / io_names.DECODER_ENGINE)


def test_tensorrt_missing_is_a_clear_error(trained_model_dir):
    pytest.importorskip("torch")
    from runtime.registry import installed

    if installed("tensorrt"):  # an `import tensorrt` would also succeed with only tensorrt-stubs
        pytest.skip("tensorrt is installed here")
    # The export skipped engines (no TensorRT): the manifest lists none, and the
    # backend itself refuses to start without the library.
    # it said "the manifest lists no encoder.plan; re-run `pipeline export`", which skips them again here
    with pytest.raises(ModelDirError, match=r"no TensorRT engines \(export skipped them: .*\); re-run .*--tensorrt"
                                            r".* on the serving machine"):
        load(trained_model_dir, LoadOptions(backend="tensorrt"))
    from runtime.trt_backend import import_tensorrt
    with pytest.raises(RuntimeUserError, match="tensorrt is not installed.*use the onnxruntime or torch backend"):
        import_tensorrt()


def test_onnxruntime_cuda_without_cuda_build_is_a_clear_error():
    from runtime.ort_backend import choose_providers

    with pytest.raises(RuntimeUserError, match="onnxruntime-gpu"):
        choose_providers(torch.device("cuda"), ["CPUExecutionProvider"])
    assert choose_providers(torch.device("cuda"), ["TensorrtExecutionProvider", "CUDAExecutionProvider",
                                                   "CPUExecutionProvider"])[0] == "TensorrtExecutionProvider"
    # onnxruntime-gpu lists its TensorRT provider without TensorRT installed: not asked for then
    assert choose_providers(torch.device("cuda"), ["TensorrtExecutionProvider", "CUDAExecutionProvider",
                                                   "CPUExecutionProvider"], use_tensorrt=False) == [
        "CUDAExecutionProvider", "CPUExecutionProvider"]


def test_tensorrt_loadable_matches_the_library(monkeypatch):
    import ctypes

    from runtime.ort_backend import tensorrt_loadable

    try:
        ctypes.CDLL("libnvinfer.so.10")
        present = True
    except OSError:
        present = False
    assert tensorrt_loadable() is present or importlib.util.find_spec("tensorrt_libs") is not None
    loaded = []

    def cdll(name, *args, **kwargs):
        loaded.append(name)
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert tensorrt_loadable() is False and loaded[0] == "libnvinfer.so.10"


def test_torch_backend_from_save_dir(trained_checkpoint, tmp_path):
    save_dir = tmp_path / "run"
    save_dir.mkdir()
    shutil.copy(trained_checkpoint, save_dir / "checkpoint_00000300.pt")
    backend, tok = open_checkpoint(save_dir, "cpu")
    assert backend.name == "torch" and tok.vocab_size == backend.cfg.vocab_size
    with pytest.raises(RuntimeUserError, match="--backend"):
        load(save_dir, LoadOptions(backend="onnx"))


def test_tokenizer_with_other_special_ids_is_a_user_error(tiny_corpus):
    """SentencePiece's own defaults (unk 0, bos 1, eos 2, no pad) are not the project's ids."""
    import io

    import sentencepiece as spm

    from model.errors import UserError
    from runtime.tokenizer import TokenizerError

    model = io.BytesIO()
    src, tgt = tiny_corpus
    spm.SentencePieceTrainer.train(sentence_iterator=iter(src + tgt), model_writer=model, vocab_size=40)
    with pytest.raises(TokenizerError, match=r"special ids \(-1, 0, 1, 2\)") as e:
        Tokenizer(model.getvalue())
    assert isinstance(e.value, UserError)


@pytest.mark.parametrize("rows", [[0, 2, 3], [1], [], [3, 1], [1, 0], [0, 0, 2], [1, 4]],
                         ids=["ascending", "one", "none", "tail-filled", "swapped", "repeated", "past-the-end"])
def test_select_rows_moves_live_sentences_up_or_copies(rows):
    """Finished sentences leave the encoder state: rows that can move in place do (ascending, or search's
    tail_filled order: no copy of the cross K/V), any other order is copied, and a row past the end is refused,
    never read out of bounds."""
    from model.cache import moves_in_place
    from runtime.backend import EncoderState, select_rows

    k = np.arange(4 * 2 * 3 * 5, dtype=np.float32).reshape(4, 2, 3, 5)
    bias = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)
    before = {"k": k.copy(), "bias": bias.copy()}
    state = EncoderState({"k": k, "bias": bias}, 4)
    chosen = np.array(rows, dtype=np.int64)
    if rows and max(rows) >= 4:
        with pytest.raises(IndexError):
            select_rows(state, chosen)
        return
    out = select_rows(state, chosen)
    assert out.n_rows == len(rows)
    for name, tensor in out.tensors.items():
        np.testing.assert_array_equal(tensor, before[name][chosen])
        in_place = moves_in_place(chosen, 4)
        assert in_place == (rows in ([0, 2, 3], [1], [], [3, 1]))
        assert np.shares_memory(tensor, state.tensors[name]) == (in_place and bool(rows))

"""The ONNX Runtime int8 decoder's self-attention as one DecoderMaskedMultiHeadAttention per layer
(export/self_attention.py), its cache per hypothesis (runtime/indirect_cache.py), its cross-attention as one
MultiHeadAttention per layer (export/cross_attention.py), and what they serve."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import INT8_LOOSE_ATOL, MEMORISED_LIMITS, run_cli

from export import cross_attention, self_attention, verify
from export.api import export_model
from export.errors import ExportError
from model import io_names
from model.cache import CacheError
from model.checkpoint import load_model, resolve_checkpoint
from model.config import preset
from model.manifest import read_manifest
from runtime.indirect_cache import IndirectCache
from runtime.model_dir import LoadOptions, load

DMMHA = "DecoderMaskedMultiHeadAttention"
MHA = "MultiHeadAttention"


def kernels(path, op: str = DMMHA) -> int:
    return sum(n.op_type == op for n in onnx.load(str(path), load_external_data=False).graph.node)


def test_the_onnxruntime_int8_decoders_have_one_attention_kernel_a_layer(memorised_int8_dir,
                                                                        ort_dynamic_flavour_dir, fp32_dir):
    for model_dir in (memorised_int8_dir, ort_dynamic_flavour_dir):
        manifest = read_manifest(model_dir)
        layers = manifest.model_config.n_dec_layers
        assert manifest.verification["self_attention"]["kind"] == io_names.DECODER_MASKED
        assert manifest.verification["cross_attention"]["kind"] == io_names.MULTI_HEAD
        for name in (io_names.DECODER_FILE, io_names.DECODER_CONSTRAINED_FILE):
            graph = onnx.load(str(model_dir / name), load_external_data=False).graph
            assert kernels(model_dir / name) == layers and kernels(model_dir / name, MHA) == layers
            inputs = {x.name for x in graph.input}
            assert io_names.CACHE_INDIRECTION in inputs and io_names.SELF_INDEX not in inputs
            assert {o.name for o in graph.output} >= {io_names.present_k(i) for i in range(layers)}
            assert not any(o.name.startswith("step_k.") for o in graph.output)
        assert load(model_dir, LoadOptions(backend="onnxruntime", threads=1)).backend.indirect
    # graphs TensorRT builds from, and fp32 / fp16, keep the gathered cache (model/cache.py)
    assert not {"self_attention", "cross_attention"} & set(read_manifest(fp32_dir).verification)
    assert kernels(fp32_dir / io_names.DECODER_FILE) == kernels(fp32_dir / io_names.DECODER_FILE, MHA) == 0
    assert not load(fp32_dir, LoadOptions(backend="onnxruntime", threads=1)).backend.indirect


def test_it_translates_as_the_gathered_decoder(memorised_int8_dir, trained_save_dir, memorise_corpus, tmp_path,
                                               monkeypatch):
    """The same checkpoint exported without either rewrite: serve-batch writes the same file, with a glossary too
    (decoder_constrained.onnx made from the rewritten decoder)."""
    monkeypatch.setattr(self_attention, "rewrite_file", lambda path, cfg: False)
    monkeypatch.setattr(cross_attention, "rewrite_file", lambda path, cfg: False)
    gathered = tmp_path / "gathered"
    export_model(trained_save_dir, gathered, int8=True, int8_atol=INT8_LOOSE_ATOL, tensorrt=False,
                 **MEMORISED_LIMITS)
    assert kernels(gathered / io_names.DECODER_FILE) == kernels(gathered / io_names.DECODER_FILE, MHA) == 0
    src = tmp_path / "in.txt"
    lines = memorise_corpus[0].read_text(encoding="utf-8").splitlines()[:40]
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    word = lines[0].split()[0]
    terms = tmp_path / "terms.tsv"
    terms.write_text(f"{word}\t{word}\n", encoding="utf-8")
    for extra in ((), ("--glossary", terms)):
        outs = []
        for model_dir in (memorised_int8_dir, gathered):
            out = tmp_path / f"{model_dir.name}-{len(extra)}.txt"
            assert run_cli("serve-batch", model_dir, src, "-o", out, "--backend", "onnxruntime", "--threads", "1",
                           *extra) == 0
            outs.append(out.read_text(encoding="utf-8"))
        assert outs[0] == outs[1] and outs[0].count("\n") == 40


def test_verification_reads_the_history_through_the_indirection(memorised_int8_dir, trained_save_dir,
                                                                 monkeypatch):
    """Verification runs the rewritten decoder as served: with each hypothesis reading beam row 0's history
    instead of its own ancestors' (cache_indirection all zeros) the differences to PyTorch grow past twice the
    correct graph's and fail the bound."""
    model, _, _ = load_model(resolve_checkpoint(trained_save_dir))
    model = model.float().eval()
    enc, dec = memorised_int8_dir / io_names.ENCODER_FILE, memorised_int8_dir / io_names.DECODER_FILE
    report = verify.verify_int8(model, enc, dec, topk=16, atol=INT8_LOOSE_ATOL)
    correct = report["onnxruntime_int8_vs_torch_fp32"]["max_abs_diff"][io_names.TOPK_LOG_PROBS]
    real_bind = IndirectCache.bind

    def row_zero(self, binding):
        alive = real_bind(self, binding)
        zeros = np.zeros_like(alive)
        binding.bind_cpu_input(io_names.CACHE_INDIRECTION, zeros)
        return alive, zeros

    monkeypatch.setattr(IndirectCache, "bind", row_zero)
    with pytest.raises(ExportError, match="verification failed"):
        verify.verify_int8(model, enc, dec, topk=16, atol=max(2 * correct, 1e-3))


def test_the_cache_follows_the_beam_and_refuses_what_search_never_does():
    cfg = preset("tiny", 32)
    cache = IndirectCache(cfg, 6, max_steps=20, initial_capacity=2)
    assert cache.advance(np.arange(6), 2).shape == (2, 3, 2)
    cache.wrote()
    ancestry = cache.advance(np.array([0, 0, 2, 4, 3, 3]), 2)  # sentence 0 continues rows 0, 0, 2
    assert ancestry[0, :, 0].tolist() == [0, 0, 2] and ancestry[1, :, 0].tolist() == [1, 0, 0]
    cache.wrote()
    for layer in cache.kv:
        layer[3:, :, :2] = 7.0  # sentence 1's rows
    generation = cache.generation
    ancestry = cache.advance(np.array([3, 5, 5]), 1)  # sentence 0 finished: sentence 1's rows move up, grown
    assert cache.generation > generation and cache.capacity == 4 and ancestry.shape == (1, 3, 4)
    assert ancestry[0, :, :2].tolist() == [[1, 0], [0, 2], [0, 2]]
    assert all(float(layer[:, :, :2].min()) == 7.0 for layer in cache.kv)
    with pytest.raises(CacheError, match="own sentence"):
        cache.advance(np.array([0, 1, 3]), 1)
    with pytest.raises(CacheError, match="hypotheses per sentence"):
        cache.advance(np.arange(4), 1)


def test_cache_indirection_is_bound_once_and_written_in_place_until_the_buffers_change():
    """The decoder reads cache_indirection from the buffer bound when the buffers last changed; each step's
    ancestry is written into it, and a change of the buffers (sentences leave, the cache grows, another binding)
    binds again."""
    class Binding:
        def __init__(self):
            self.inputs: dict[str, np.ndarray] = {}

        def bind_cpu_input(self, name, array):
            self.inputs[name] = array

        def bind_output(self, *args):
            pass

    cfg = preset("tiny", 32)
    cache, binding = IndirectCache(cfg, 6, max_steps=20, initial_capacity=4), Binding()
    cache.advance(np.arange(6), 2)
    first = cache.bind(binding)
    assert binding.inputs[io_names.CACHE_INDIRECTION] is first
    cache.wrote()
    binding.inputs.clear()
    ancestry = cache.advance(np.array([0, 0, 2, 4, 3, 3]), 2)  # nothing leaves: the bound buffer, rewritten
    assert cache.bind(binding) is not None and io_names.CACHE_INDIRECTION not in binding.inputs
    assert np.shares_memory(first, cache.ancestry) and first.tolist() == ancestry.tolist()
    assert first[0, :, 0].tolist() == [0, 0, 2] and first[1, :, 0].tolist() == [1, 0, 0]
    cache.wrote()
    cache.advance(np.array([3, 5, 5]), 1)  # sentence 0 finished: new buffers, bound again
    assert cache.bind(binding) is binding.inputs[io_names.CACHE_INDIRECTION]
    assert binding.inputs[io_names.CACHE_INDIRECTION].shape == (1, 3, 4)
    other = Binding()
    assert cache.bind(other) is other.inputs[io_names.CACHE_INDIRECTION]


def test_the_cross_attention_kernel_is_the_exported_arithmetic(fp32_dir, random_checkpoint, tmp_path, caplog):
    """Rewritten, the fp32 decoder still verifies against PyTorch at fp32's bound (the kernel computes what the
    ten nodes did); with the kernel's scale doubled it fails verification; a decoder whose pattern differs is left
    as it was, with a warning."""
    model = load_model(resolve_checkpoint(random_checkpoint))[0].float().eval()
    manifest = read_manifest(fp32_dir)
    cfg, topk = manifest.model_config, manifest.topk
    proto = onnx.load(str(fp32_dir / io_names.DECODER_FILE))
    assert cross_attention.rewrite(proto, cfg) and not cross_attention.rewrite(proto, cfg)
    assert sum(n.op_type == MHA for n in proto.graph.node) == cfg.n_dec_layers
    rewritten = tmp_path / "decoder.onnx"
    onnx.save(proto, str(rewritten))
    assert cross_attention.describe(rewritten)["kind"] == io_names.MULTI_HEAD
    report = verify.verify_export(model, fp32_dir / io_names.ENCODER_FILE, rewritten, fp16=False, topk=topk)
    assert report["precision"] == "fp32"
    for node in proto.graph.node:
        if node.op_type == MHA:
            next(a for a in node.attribute if a.name == "scale").f *= 2
    onnx.save(proto, str(rewritten))
    with pytest.raises(ExportError, match="verification failed"):
        verify.verify_export(model, fp32_dir / io_names.ENCODER_FILE, rewritten, fp16=False, topk=topk)
    # another scale than 1 / sqrt(d_head) on the scores: not the pattern this kernel replaces
    other = onnx.load(str(fp32_dir / io_names.DECODER_FILE))
    mul = next(n for n in other.graph.node if n.op_type == "Mul" and any(
        r.op_type == "MatMul" and n.output[0] == r.input[0] for r in other.graph.node))
    scale = next(x for x in other.graph.initializer if x.name in mul.input)
    scale.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(scale) * 2, scale.name))
    with pytest.raises(ValueError, match="not 1 / sqrt"):
        cross_attention.rewrite(other, cfg)
    odd = tmp_path / "odd.onnx"
    onnx.save(other, str(odd))
    before = odd.read_bytes()
    assert not cross_attention.rewrite_file(odd, cfg)
    assert odd.read_bytes() == before and "keeps its exported cross-attention" in caplog.text

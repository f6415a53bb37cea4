"""The two-stage top-K of the ONNX Runtime-only int8 decoders (export/topk_split.py): the same values and ids as
one TopK over the whole vocabulary, the constrained step's log-probs still found, and an exported rowwise model
that translates exactly as the same export without the split."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import run_cli
from onnx import TensorProto, helper

from export import topk_split
from export.constrained import add_want
from model import io_names
from runtime.model_dir import LoadOptions, load
from runtime.translate import translate_ids

EOS = 2


def _step_tail(vocab: int, k: int, opset: int) -> onnx.ModelProto:
    """logits -> LogSoftmax -> TopK(k) and the EOS column: the decoder step's last nodes, with its output names."""
    nodes = [helper.make_node("LogSoftmax", ["logits"], ["log_probs"], axis=-1),
             helper.make_node("TopK", ["log_probs", "k"], [io_names.TOPK_LOG_PROBS, io_names.TOPK_IDS], axis=-1),
             helper.make_node("Gather", ["log_probs", "eos"], [io_names.EOS_LOG_PROBS], axis=1)]
    graph = helper.make_graph(
        nodes, "tail", [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["hyps", vocab])],
        [helper.make_tensor_value_info(io_names.TOPK_LOG_PROBS, TensorProto.FLOAT, ["hyps", k]),
         helper.make_tensor_value_info(io_names.TOPK_IDS, TensorProto.INT64, ["hyps", k]),
         helper.make_tensor_value_info(io_names.EOS_LOG_PROBS, TensorProto.FLOAT, ["hyps"])],
        [helper.make_tensor("k", TensorProto.INT64, [1], [k]), helper.make_tensor("eos", TensorProto.INT64, [], [EOS])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    onnx.checker.check_model(proto, full_check=True)
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("vocab,k,opset", [(1000, 16, 18), (512, 16, 17), (8000, 8, 18), (300, 16, 18)])
def test_the_split_gives_the_whole_vocabularys_top_k(vocab, k, opset):
    """Values and ids equal to one TopK's, sorted the same, padded vocabularies (1000, 300) included; rows where
    the best ids crowd into one block and rows of -inf (suppressed ids) too."""
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((37, vocab)) * 4).astype(np.float32)
    logits[0, 16:40] += 30  # the best 16 in two neighbouring blocks
    logits[1, :] = -1e30  # everything equal but a few
    logits[1, [5, 700 % vocab, vocab - 1]] = 0
    logits[2, :vocab // 2] = -np.inf
    whole = _step_tail(vocab, k, opset)
    split = _step_tail(vocab, k, opset)
    assert topk_split.split_topk(split, vocab, k) and topk_split.topk_nodes(split) == 2
    want, got = _run(whole, {"logits": logits}), _run(split, {"logits": logits})
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a[3:], b[3:])  # rows without ties: bit for bit
    np.testing.assert_array_equal(want[0], got[0])  # values everywhere (ties only swap equal values' ids)
    assert set(got[1][1][:3]) == {5, 700 % vocab, vocab - 1}


@pytest.mark.parametrize("hyps,sentences,width", [(6, 2, 6), (2, 2, 2), (20, 2, 16), (8, 1, 16)])
def test_in_a_decoder_step_k_follows_the_beam(hyps, sentences, width):
    """With the step's tokens and src_bias among its inputs, the split graph returns min(topk, 2 x hyps /
    sentences) candidates a row, the first of the whole vocabulary's top-K, and says so in its metadata."""
    vocab, k = 1000, 16
    whole, split = _step_tail(vocab, k, 18), _step_tail(vocab, k, 18)
    for proto in (whole, split):
        proto.graph.input.extend([helper.make_tensor_value_info(io_names.TOKENS, TensorProto.INT64, ["hyps"]),
                                  helper.make_tensor_value_info(io_names.SRC_BIAS, TensorProto.FLOAT, ["b", "s"])])
    assert topk_split.split_topk(split, vocab, k)
    assert {m.key: m.value for m in split.metadata_props} == {io_names.TOPK_FOLLOWS_BEAM: "1"}
    logits = (np.random.default_rng(2).standard_normal((hyps, vocab)) * 4).astype(np.float32)
    feeds = {"logits": logits, io_names.TOKENS: np.zeros(hyps, np.int64),
             io_names.SRC_BIAS: np.zeros((sentences, 3), np.float32)}
    want, got = _run(whole, feeds), _run(split, feeds)
    assert got[0].shape == got[1].shape == (hyps, width)
    np.testing.assert_array_equal(got[0], want[0][:, :width])
    np.testing.assert_array_equal(got[1], want[1][:, :width])
    np.testing.assert_array_equal(got[2], want[2])


def test_a_vocabulary_of_fewer_than_k_blocks_is_left_whole():
    proto = _step_tail(200, 16, 18)
    before = proto.SerializeToString()
    assert not topk_split.split_topk(proto, 200, 16)
    assert proto.SerializeToString() == before


def test_the_constrained_step_finds_the_log_probs_of_a_split_graph():
    """decoder_constrained.onnx's want_log_probs gather from the log-softmax, not from the split's candidates."""
    vocab, k = 640, 16
    proto = _step_tail(vocab, k, 18)
    assert topk_split.split_topk(proto, vocab, k)
    add_want(proto)
    logits = np.random.default_rng(1).standard_normal((5, vocab)).astype(np.float32)
    want = np.array([[3, 600, -1]] * 5, dtype=np.int64)
    out = _run(proto, {"logits": logits, io_names.WANT_IDS: want})
    log_probs = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(out[-1][:, :2], log_probs[:, [3, 600]], atol=1e-5)
    assert np.isneginf(out[-1][:, 2]).all()


@pytest.mark.slow
def test_a_rowwise_export_translates_exactly_as_without_the_split(tmp_path, monkeypatch):
    """A 600-piece model exported as the CPU's default int8 gets the split (and says so in its graph); the same
    export without it gives the same hypotheses and scores, bit for bit, on the onnxruntime backend."""
    checkpoint = tmp_path / "random.pt"
    run_cli("random-checkpoint", checkpoint, "--preset", "tiny", "--vocab-size", "600")
    limits = ["--max-batch", "8", "--max-src-len", "32", "--max-tgt-len", "40", "--max-beam", "4"]
    split, whole = tmp_path / "split", tmp_path / "whole"
    run_cli("export", checkpoint, "--out", split, "--int8", "--no-tensorrt", *limits)
    monkeypatch.setattr(topk_split, "split_topk", lambda *a, **k: False)
    run_cli("export", checkpoint, "--out", whole, "--int8", "--no-tensorrt", *limits)
    vocab = json.loads((split / "manifest.json").read_text())["model_config"]["vocab_size"]
    assert vocab >= topk_split.BLOCK * 16
    counts = [topk_split.topk_nodes(onnx.load(str(d / io_names.DECODER_FILE), load_external_data=False))
              for d in (split, whole)]
    assert counts == [2, 1]
    metadata = [{m.key: m.value for m in onnx.load(str(d / io_names.DECODER_FILE), load_external_data=False)
                 .metadata_props} for d in (split, whole)]
    assert metadata[0].get(io_names.TOPK_FOLLOWS_BEAM) == "1" and io_names.TOPK_FOLLOWS_BEAM not in metadata[1]
    results, widths = [], []
    for model_dir in (split, whole):
        loaded = load(model_dir, LoadOptions(backend="onnxruntime", threads=1))
        step, seen = loaded.backend.step, set()

        def spy(*args, step=step, seen=seen, **kwargs):  # the candidates each step returns a row
            out = step(*args, **kwargs)
            seen.add(out[0].topk_ids.shape[1])
            return out

        loaded.backend.step = spy
        ids = [s[-20:] for s in loaded.tokenizer.encode_source([f"a {i} " + "b " * (i % 7) for i in range(12)])]
        runs = [translate_ids(loaded.backend, ids, beam_size=beam, nbest=min(2, beam)) for beam in (4, 2, 1)]
        results.append([[[(h.tokens, h.score) for h in row] for row in hyps] for hyps in runs])
        widths.append(seen)
    assert results[0] == results[1]
    assert widths == [{8, 4, 2}, {16}]  # 2 x the beam where K follows it (greedy reads 2), --topk otherwise

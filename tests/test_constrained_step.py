"""The constrained step (glossaries): decoder_constrained.onnx written by every export beside decoder.onnx,
sharing its weights, and each backend's step(want=...): any id's log-prob from the step's own log-softmax,
-inf for -1; a step without `want` exactly as before; a model dir exported before it still serves."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx.external_data_helper import uses_external_data

from export import trt_compat
from export.constrained import add_want
from export.errors import ExportError
from model import io_names
from model.manifest import read_manifest, write_manifest
from runtime.errors import RuntimeUserError
from runtime.model_dir import LoadOptions, load
from runtime.ort_constrained import why_not
from runtime.translate import pad_batch

pytest.importorskip("onnxruntime")

SOURCES = [[5, 9, 12, 7, 2], [30, 41, 2]]  # ids of the tiny vocabulary (64), EOS (2) last
BEAM = 2


def _want(n: int, step: int, vocab: int, topk_ids: np.ndarray) -> np.ndarray:
    """1-4 ids per hypothesis (the count changes with the step): ids outside the row's previous top-K (mostly
    outside this step's too), one of its previous top-K, the last id of the vocabulary, and -1."""
    rng = np.random.default_rng(step)
    width = 1 + step % 4
    want = np.empty((n, width), dtype=np.int64)
    for row in range(n):
        outside = np.setdiff1d(np.arange(vocab), topk_ids[row])
        want[row] = rng.choice(outside, width)
    want[0, -1] = -1
    want[-1, 0] = topk_ids[-1, 0]
    if width > 1:
        want[n // 2, 1] = vocab - 1
    return want


def _decode(backend, steps: int, want_at=lambda step: True, driver=None):
    """`steps` beam-like steps of SOURCES (BEAM rows each); each step's want ids from `_want` where
    want_at(step), chosen from the previous step's top-K (the driver's, when given: the same tokens and
    reorders for several backends). Returns each step's (StepOutput, want)."""
    src = pad_batch(SOURCES)
    state = backend.encode(src)
    n = len(SOURCES) * BEAM
    cache = backend.initial_cache(n)
    tokens = np.full(n, backend.cfg.bos_id, dtype=np.int64)
    reorder = np.arange(n, dtype=np.int64)
    top_ids = np.zeros((n, backend.topk), dtype=np.int64)
    outs = []
    for step in range(steps):
        want = _want(n, step, backend.cfg.vocab_size, top_ids) if want_at(step) else None
        out, cache = backend.step(state, tokens, step, cache, reorder, want=want)
        outs.append((out, want))
        chosen = (driver[step][0] if driver else out).topk_ids
        first = reorder[::BEAM].repeat(BEAM) if step % 2 else np.arange(n) // BEAM * BEAM
        reorder = first.astype(np.int64)
        tokens = chosen[reorder, np.arange(n) % BEAM].astype(np.int64)
        top_ids = chosen
    return outs


# -- the export -------------------------------------------------------------------------------------

def test_every_export_writes_the_constrained_step_sharing_the_decoders_weights(fp32_dir):
    path = fp32_dir / io_names.DECODER_CONSTRAINED_FILE
    manifest = read_manifest(fp32_dir)
    assert manifest.lists(io_names.DECODER_CONSTRAINED_FILE)
    assert manifest.graphs.bytes[io_names.DECODER_CONSTRAINED_FILE] == path.stat().st_size
    assert not (fp32_dir / io_names.weights_file(path.name)).exists()  # no weights file of its own
    decoder = onnx.load(str(fp32_dir / io_names.DECODER_FILE), load_external_data=False)
    proto = onnx.load(str(path), load_external_data=False)
    # every weight read from decoder.data where decoder.onnx reads it: the file is the structure only
    where = {t.name: [(e.key, e.value) for e in t.external_data] for t in decoder.graph.initializer}
    external = [t for t in proto.graph.initializer if uses_external_data(t)]
    assert external and all([(e.key, e.value) for e in t.external_data] == where[t.name] for t in external)
    assert {dict(where[t.name])["location"] for t in external} == {io_names.weights_file(io_names.DECODER_FILE)}
    assert path.stat().st_size < (fp32_dir / io_names.DECODER_FILE).stat().st_size + 4096
    assert [i.name for i in proto.graph.input] == [i.name for i in decoder.graph.input] + [io_names.WANT_IDS]
    assert [o.name for o in proto.graph.output] == [o.name for o in decoder.graph.output] + [io_names.WANT_LOG_PROBS]
    assert trt_compat.check_model(proto) == []  # GatherElements, Where, Max, Less: TensorRT parses them
    report = manifest.verification["onnxruntime_vs_torch_fp32"]["max_abs_diff"]
    assert report[io_names.WANT_LOG_PROBS] < 1e-4
    assert manifest.verification["constrained_step"]["file"] == path.name


def test_the_surgery_refuses_a_graph_without_the_log_probs_it_gathers_from(fp32_dir):
    proto = onnx.load(str(fp32_dir / io_names.DECODER_CONSTRAINED_FILE), load_external_data=False)
    with pytest.raises(ExportError, match="already"):
        add_want(proto)
    proto = onnx.load(str(fp32_dir / io_names.DECODER_FILE), load_external_data=False)
    for node in proto.graph.node:
        if io_names.EOS_LOG_PROBS in node.output:
            node.op_type = "Identity"  # the EOS column no longer gathered from the log-probs
            del node.attribute[:]
    with pytest.raises(ExportError, match="not a column of the log-probs"):
        add_want(proto)


@pytest.mark.parametrize("name", ["fp16_dir", "int8_dir", "rowwise_dir"])
def test_fp16_and_every_int8_flavour_get_the_constrained_step(name, request):
    """Made from the finished (quantized) decoder.onnx and verified at export; its gather reads the very
    values the top-K is taken from: asked for a step's top-K ids, it returns the top-K log-probs bit for bit."""
    model_dir = request.getfixturevalue(name)
    manifest = read_manifest(model_dir)
    assert manifest.lists(io_names.DECODER_CONSTRAINED_FILE)
    decoder = onnx.load(str(model_dir / io_names.DECODER_FILE), load_external_data=False)
    proto = onnx.load(str(model_dir / io_names.DECODER_CONSTRAINED_FILE), load_external_data=False)
    assert list(proto.graph.node)[:len(decoder.graph.node)] == list(decoder.graph.node)  # int8 nodes included
    reports = [v for v in manifest.verification.values() if isinstance(v, dict) and "max_abs_diff" in v]
    assert any(io_names.WANT_LOG_PROBS in r["max_abs_diff"] for r in reports)
    backend = load(model_dir, LoadOptions(backend="onnxruntime", threads=1)).backend
    assert backend.gathers
    n = len(SOURCES) * BEAM
    plain, asked = (backend.encode(pad_batch(SOURCES)) for _ in range(2))  # two states, two bindings
    caches = [backend.initial_cache(n) for _ in range(2)]
    tokens, reorder = np.full(n, backend.cfg.bos_id, dtype=np.int64), np.arange(n, dtype=np.int64)
    for step in range(4):
        a, caches[0] = backend.step(plain, tokens, step, caches[0], reorder)
        want = a.topk_ids[:, :1 + step].copy()
        want[0, -1] = -1
        b, caches[1] = backend.step(asked, tokens, step, caches[1], reorder, want=want)
        for name in ("topk_log_probs", "topk_ids", "eos_log_probs"):
            assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), (step, name)
        top = a.topk_log_probs[:, :1 + step]
        assert np.array_equal(b.want_log_probs[want >= 0], top[want >= 0]) and np.isneginf(b.want_log_probs[0, -1])
        tokens = a.topk_ids[:, 0].copy()


# -- ONNX Runtime ------------------------------------------------------------------------------------

def test_onnxruntime_gathers_any_id_as_the_torch_step_computes_it(fp32_dir):
    ort = load(fp32_dir, LoadOptions(backend="onnxruntime", threads=1)).backend
    torch_backend = load(fp32_dir, LoadOptions(backend="torch")).backend
    assert ort.gathers and torch_backend.gathers
    assert ort.constrained._session is None  # opened on the first step given `want`, not before
    ref = _decode(_AllIds(torch_backend), 6)
    got = _decode(ort, 6, driver=ref)  # the same tokens and reorders, and the same ids asked for
    assert ort.constrained._session is not None
    outside = 0
    for step, ((out, want), (full, _)) in enumerate(zip(got, ref)):
        expected = np.where(want < 0, -np.inf, np.take_along_axis(full.want_log_probs, np.maximum(want, 0), axis=1))
        np.testing.assert_allclose(out.want_log_probs, expected, atol=1e-5, rtol=0, err_msg=f"step {step}")
        assert out.want_log_probs.dtype == np.float32 and np.isneginf(out.want_log_probs[0, -1])
        outside += int(sum(np.isin(w, t, invert=True).sum() for w, t in zip(want, out.topk_ids)))
        np.testing.assert_allclose(out.topk_log_probs, full.topk_log_probs, atol=1e-5)
    assert outside > 20  # most ids asked for are outside the step's top-K
    assert full.want_log_probs.shape[1] == ort.cfg.vocab_size


class _AllIds:
    """A torch backend asked for every id of the vocabulary at every step (its full log-softmax), whatever
    `want` the caller gives (kept in the returned StepOutput's place for the comparison)."""

    def __init__(self, backend):
        self.backend = backend
        self.cfg, self.topk = backend.cfg, backend.topk

    def encode(self, src):
        return self.backend.encode(src)

    def initial_cache(self, n):
        return self.backend.initial_cache(n)

    def step(self, state, tokens, step, cache, reorder, want=None):
        every = np.tile(np.arange(self.cfg.vocab_size, dtype=np.int64), (len(tokens), 1))
        return self.backend.step(state, tokens, step, cache, reorder, want=every)


def test_a_step_without_want_is_the_plain_decoders_step_bit_for_bit(fp32_dir):
    plain = load(fp32_dir, LoadOptions(backend="onnxruntime", threads=1)).backend
    mixed = load(fp32_dir, LoadOptions(backend="onnxruntime", threads=1)).backend
    ref = _decode(plain, 7, lambda step: False)
    # want at some steps only: bindings switch graphs and the ids per hypothesis change
    got = _decode(mixed, 7, lambda step: step in (1, 2, 4, 5), driver=ref)
    assert plain.constrained._session is None  # never opened: serving without glossaries pays nothing
    for step, ((a, _), (b, want)) in enumerate(zip(ref, got)):
        for name in ("topk_log_probs", "topk_ids", "eos_log_probs"):
            assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), (step, name)
        assert a.want_log_probs is None
        assert (b.want_log_probs is None) == (want is None)
    state = plain.encode(pad_batch(SOURCES))
    out, _ = plain.step(state, np.full(4, plain.cfg.bos_id), 0, plain.initial_cache(4), np.arange(4),
                        want=np.zeros((4, 0), np.int64))
    assert out.want_log_probs.shape == (4, 0)
    with pytest.raises(ValueError, match="outside"):
        plain.step(state, np.full(4, plain.cfg.bos_id), 0, plain.initial_cache(4), np.arange(4),
                   want=np.full((4, 1), plain.cfg.vocab_size))


def test_an_old_model_dir_without_the_constrained_step_still_serves(fp32_dir, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(fp32_dir, old)
    (old / io_names.DECODER_CONSTRAINED_FILE).unlink()
    data = json.loads((old / "manifest.json").read_text())
    del data["graphs"]["bytes"][io_names.DECODER_CONSTRAINED_FILE], data["verification"]["constrained_step"]
    (old / "manifest.json").write_text(json.dumps(data))
    write_manifest(old, read_manifest(old, verify=False))  # its files as an export before glossaries listed them
    loaded = load(old, LoadOptions(backend="onnxruntime", threads=1))
    backend, manifest = loaded.backend, loaded.manifest
    assert not manifest.lists(io_names.DECODER_CONSTRAINED_FILE) and not backend.gathers
    outs = _decode(backend, 3, lambda step: False)
    assert all(out.want_log_probs is None for out, _ in outs)
    state = backend.encode(pad_batch(SOURCES))
    cache = backend.initial_cache(4)
    with pytest.raises(RuntimeUserError, match="export the model again"):
        backend.step(state, np.full(4, backend.cfg.bos_id), 0, cache, np.arange(4), want=np.zeros((4, 1), np.int64))


def test_a_shortlisted_step_does_not_gather_and_says_why(fp32_dir):
    manifest = read_manifest(fp32_dir)
    assert why_not(fp32_dir, manifest, shortlisted=False) is None
    assert "without --shortlist" in why_not(fp32_dir, manifest, shortlisted=True)


# -- PyTorch ----------------------------------------------------------------------------------------

def test_the_torch_backend_gathers_from_its_eager_step_only(fp32_dir):
    from runtime.torch_backend import TorchBackend

    eager = load(fp32_dir, LoadOptions(backend="torch")).backend
    assert eager.step_mode == "eager" and eager.gathers
    full = _decode(_AllIds(eager), 3)
    for out, _ in full:
        lp = out.want_log_probs
        assert lp.shape == (len(SOURCES) * BEAM, eager.cfg.vocab_size)
        np.testing.assert_allclose(np.exp(lp).sum(axis=1), 1.0, atol=1e-5)  # the whole log-softmax
        assert np.array_equal(np.take_along_axis(lp, out.topk_ids, axis=1), out.topk_log_probs)
        assert np.array_equal(lp[:, eager.cfg.eos_id], out.eos_log_probs)
    for out, want in _decode(eager, 3):
        assert np.all(np.isneginf(out.want_log_probs[want < 0]))
    static = TorchBackend(eager.model, "cpu", topk=eager.topk, max_tgt_len=eager.max_tgt_len, step_mode="static",
                          fuse=False)
    assert not static.gathers
    with pytest.raises(RuntimeUserError, match="--step eager"):
        _decode(static, 1)

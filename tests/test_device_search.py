"""Beam search on the device, K steps per replay (runtime/device_search.py): search.py's hypotheses.

On the CPU the body runs uncaptured (the same tensors and arithmetic a CUDA graph replays); the CUDA tests
run where a GPU is (the device tool's machine: `python -m pytest tests/test_device_search.py`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.config import preset
from model.transformer import build_model
from runtime.decoding import PAPER
from runtime.device_search import capacity_for
from runtime.errors import RuntimeUserError
from runtime.search import search
from runtime.torch_backend import TorchBackend
from runtime.translate import pad_batch

VOCAB = 48  # small: EOS comes on its own, so hypotheses finish at many lengths and steps

OPTIONS = {
    "paper, beam 4": PAPER.replace(beam_size=4),
    "min_len, 3-best": PAPER.replace(beam_size=3, min_len=4, max_len_a=0.0, max_len_b=12, nbest=3),
    "alpha 0, long (the cache grows twice)": PAPER.replace(beam_size=2, alpha=0.0, max_len_a=0.0, max_len_b=40),
    "every sentence at its limit": PAPER.replace(beam_size=4, max_len_a=0.0, max_len_b=9, min_len=9),
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(preset("tiny", VOCAB)).eval()


def sources(n: int = 9, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    return pad_batch([[int(x) for x in g.integers(4, VOCAB, size=int(g.integers(1, 14)))] + [2] for _ in range(n)])


def assert_same(ref, got, exact: bool) -> None:
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        for h, q in zip(a, b):
            if exact:
                assert (h.score, h.log_prob, h.step_log_probs) == (q.score, q.log_prob, q.step_log_probs)
            else:  # another cache capacity at some steps: sums over its masked padding round differently
                assert h.score == pytest.approx(q.score, abs=1e-5) and h.log_prob == pytest.approx(q.log_prob, abs=1e-4)
                assert np.allclose(h.step_log_probs, q.step_log_probs, atol=1e-5)


@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("k", [2, 3, 8])
def test_device_search_gives_search_hypotheses(model, name, k):
    options, src = OPTIONS[name], sources()
    ref = search(TorchBackend(model, step_mode="static"), src, options)
    backend = TorchBackend(model, step_mode="static", steps_per_replay=k)
    got = search(backend, src, options)
    assert backend.device_search.replays > 0
    # k = 2 and 8 grow the cache at the same steps as the one-step path (16, 32...): bit for bit
    assert_same(ref, got, exact=k in (2, 8))
    lengths = {len(h.tokens) for hyps in got for h in hyps}
    assert len(lengths) > 2 or name == "every sentence at its limit"  # finished at many steps, not only the limit


def test_a_batch_ends_at_the_first_replay_after_its_last_sentence(model):
    options = PAPER.replace(beam_size=4, max_len_a=0.0, max_len_b=9, min_len=9)  # 10 steps, EOS forced at 9
    backend = TorchBackend(model, step_mode="static", steps_per_replay=4)
    search(backend, sources(3), options)
    assert backend.device_search.replays == 3  # steps 0-11: two steps run for nothing, never a fourth replay
    assert capacity_for(4) == 16 and capacity_for(17) == 32 and capacity_for(33) == 64


def test_finished_sentences_keep_their_slots_until_the_batch_ends(model):
    """40 sentences finishing at many steps stay in their bucket of 48 (a smaller bucket would be a new graph to
    capture: 232 captures and half the speed on an H200), and every sentence's hypotheses stay search's, bit for
    bit, in input order."""
    src, options = sources(40, seed=5), PAPER.replace(beam_size=4, nbest=2)
    backend = TorchBackend(model, step_mode="static", steps_per_replay=4)
    got = search(backend, src, options)
    assert_same(search(TorchBackend(model, step_mode="static"), src, options), got, exact=True)
    assert {key[0] for key in backend.static.batches} == {48}  # its bucket only, never a smaller one
    assert not any(b.busy for b in backend.static.batches.values())  # given back
    assert len({len(h.tokens) for hyps in got for h in hyps}) > 3  # they did finish at many steps


def test_storage_is_reused_and_batches_of_other_shapes_agree(model):
    backend = TorchBackend(model, step_mode="static", steps_per_replay=4)
    plain = TorchBackend(model, step_mode="static")
    for n, seed in ((9, 0), (5, 1), (9, 2), (1, 3)):  # the second 9 reuses the first's storage and state
        src = sources(n, seed)
        assert_same(search(plain, src, PAPER), search(backend, src, PAPER), exact=True)
    assert search(backend, np.zeros((0, 3), dtype=np.int64), PAPER) == []


@pytest.mark.parametrize("case", ["greedy", "transformers rules", "first tokens"])
def test_searches_it_does_not_run_go_step_by_step(model, case):
    options = {"greedy": PAPER.replace(beam_size=1), "transformers rules": PAPER.replace(rules="transformers")
               }.get(case, PAPER)
    first = np.full(9, 7, dtype=np.int64) if case == "first tokens" else None
    backend = TorchBackend(model, step_mode="static", steps_per_replay=4)
    got = search(backend, sources(), options, first_tokens=first)
    assert backend.device_search.replays == 0
    ref = search(TorchBackend(model, step_mode="static"), sources(), options, first_tokens=first)
    assert_same(ref, got, exact=True)


def test_steps_per_replay_needs_a_fixed_shape_step(model):
    with pytest.raises(ValueError, match="fixed-shape step"):
        TorchBackend(model, step_mode="eager", steps_per_replay=4)
    with pytest.raises(ValueError, match="at least 1"):
        TorchBackend(model, step_mode="static", steps_per_replay=0)
    assert TorchBackend(model, step_mode="static").device_search is None  # one step per call: search drives it


def test_load_options_refuse_steps_per_replay_where_it_cannot_run(tmp_path):
    from runtime.model_dir import LoadOptions, ModelDir
    from runtime.torch_backend import open_model_dir

    assert any("--steps-per-replay" in p and "--step graph or compiled" in p
               for p in LoadOptions(step="eager", steps_per_replay=4).problems())
    assert any("--steps-per-replay must be at least 1" in p for p in LoadOptions(steps_per_replay=0).problems())
    with pytest.raises(RuntimeUserError, match="needs --step compiled"):
        open_model_dir(ModelDir.__new__(ModelDir), LoadOptions(backend="torch", device="cpu", steps_per_replay=4),
                       None)


@pytest.mark.slow
def test_compiled_device_search_on_the_cpu(model):
    """torch.compile's step (inductor's C++ kernels here) called K times per replay: the same hypotheses."""
    options = PAPER.replace(beam_size=4, max_len_a=0.0, max_len_b=20, min_len=3)
    src = sources(5)
    ref = search(TorchBackend(model, step_mode="static"), src, options)
    backend = TorchBackend(model, step_mode="compiled", steps_per_replay=4)
    assert_same(ref, search(backend, src, options), exact=False)
    assert backend.compile_seconds > 0


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("mode,k", [("graph", 4), ("graph", 8), ("compiled", 4)])
def test_on_cuda_the_replayed_search_is_the_one_step_graphs_in_fp32(model, mode, k):
    dev = torch.device("cuda")
    ref_backend = TorchBackend(model, dev, step_mode="graph", steps_per_replay=1)
    backend = TorchBackend(model, dev, step_mode=mode, steps_per_replay=k)
    for name, options in OPTIONS.items():
        src = sources(9, seed=len(name))
        ref = search(ref_backend, src, options)
        got = search(backend, src, options)
        assert [[h.tokens for h in a] for a in ref] == [[h.tokens for h in b] for b in got], name
        for a, b in zip(ref, got):
            assert np.allclose([h.score for h in a], [h.score for h in b], atol=1e-4), name
    assert backend.device_search.replays > 0 and backend.static.captures > 0 and backend.static.capture
    assert {key[0] for key in backend.static.batches} == {12}  # 9 sentences' bucket, never a smaller one


@pytest.mark.slow
def test_serve_batch_with_steps_per_replay_writes_the_same_file(memorised_fp32_dir, memorise_corpus, tmp_path):
    """As a user runs it: `serve-batch --backend torch --step compiled --steps-per-replay 4` (the CPU's way to
    run it) writes the file the default torch step writes; without --step compiled it is refused in one line."""
    from helpers import run_cli

    src = tmp_path / "in.txt"
    src.write_text("".join(memorise_corpus[0].read_text().splitlines(keepends=True)[:12]))
    plain, device = tmp_path / "plain.txt", tmp_path / "device.txt"
    assert run_cli("serve-batch", memorised_fp32_dir, src, "-o", plain, "--backend", "torch") == 0
    assert run_cli("serve-batch", memorised_fp32_dir, src, "-o", device, "--backend", "torch", "--step", "compiled",
                   "--steps-per-replay", "4") == 0
    assert device.read_bytes() == plain.read_bytes() and plain.read_text().count("\n") == 12
    assert run_cli("serve-batch", memorised_fp32_dir, src, "-o", tmp_path / "x.txt", "--backend", "torch",
                   "--steps-per-replay", "4") != 0

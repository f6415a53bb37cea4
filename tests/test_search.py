"""Beam and greedy search against a scripted decoder whose per-step probabilities are
written here, with exact expected tokens and scores; then the same search on the tiny
PyTorch model, checked against teacher-forced scoring."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import numpy as np
import pytest
import torch

from model.checkpoint import load_model
from model.config import BOS_ID, EOS_ID, ModelConfig
from runtime.backend import EncoderState, StepOutput
from runtime.constrained import constrained_beam_search
from runtime.search import SearchError, beam_search, greedy_search
from runtime.torch_backend import TorchBackend
from runtime.translate import length_batches, pad_batch, translate_ids

A, B = 4, 5  # two word ids; EOS_ID is 3
VOCAB = 8
KEY0 = 10  # source token of table 0 (never PAD, so every source has 2 real tokens)
Table = Callable[[tuple[int, ...]], dict[int, float]]


class ScriptedBackend:
    """A real Backend whose 'model' is a table: probabilities of the next token given the
    sentence (src_ids[:, 0] - KEY0 picks the table) and the tokens generated so far.

    The cache holds each row's generated prefix, grown and reordered by the step exactly
    as KV caches are, so a search that passes wrong `reorder` rows or steps gets other
    probabilities and fails the expected scores."""

    name = "scripted"
    gathers = True  # it has every id's log-prob: it hands out any (constrained search)
    cfg = ModelConfig(vocab_size=VOCAB, d_model=8, n_heads=1, d_ff=8, n_enc_layers=1, n_dec_layers=1)

    def __init__(self, tables: dict[int, Table], topk: int = VOCAB, max_tgt_len: int = 100):
        self.tables = tables
        self.device = "cpu"
        self.topk = topk
        self.max_src_len = 64
        self.max_tgt_len = max_tgt_len
        self.steps_run = 0
        self.rows_seen: list[int] = []
        self.state_rows_seen: list[int] = []

    def encode(self, src_ids: np.ndarray) -> EncoderState:
        assert isinstance(src_ids, np.ndarray) and src_ids.dtype == np.int64
        return EncoderState({"table": src_ids[:, 0] - KEY0}, src_ids.shape[0])

    def select(self, state: EncoderState, rows: np.ndarray) -> EncoderState:
        return EncoderState({k: np.take(v, rows, axis=0) for k, v in state.tensors.items()},
                            int(rows.shape[0]))

    def initial_cache(self, n_rows: int) -> np.ndarray:
        return np.zeros((n_rows, 0), dtype=np.int64)

    def search_on_device(self, src_ids, options, first_tokens=None):
        return None  # search drives the table step by step

    def step(self, state, tokens, step, cache, reorder, want=None):
        assert cache.shape[1] == step, "step index must equal the tokens fed so far"
        # One state row per sentence, shared by its consecutive hypothesis rows.
        assert tokens.shape[0] == reorder.shape[0] and tokens.shape[0] % state.n_rows == 0
        rows = tokens.shape[0] // state.n_rows
        cache = np.concatenate([cache[reorder], tokens[:, None]], axis=1)
        lp = np.full((tokens.shape[0], VOCAB), float("-inf"), dtype=np.float32)
        keys = np.repeat(state.tensors["table"], rows).tolist()
        for i, (key, row) in enumerate(zip(keys, cache.tolist())):
            assert row[0] == BOS_ID
            for tok, p in self.tables[key](tuple(row[1:])).items():
                lp[i, tok] = math.log(p)
        self.steps_run += 1
        self.rows_seen.append(tokens.shape[0])
        self.state_rows_seen.append(state.n_rows)
        top_ids = np.argsort(-lp, axis=1, kind="stable")[:, :self.topk]
        want_lp = None
        if want is not None:
            gathered = np.take_along_axis(lp, np.maximum(want, 0), axis=1)
            want_lp = np.where(want < 0, -np.inf, gathered).astype(np.float32)
        return StepOutput(np.take_along_axis(lp, top_ids, axis=1), top_ids, lp[:, EOS_ID].copy(), want_lp), cache


def table(entries: dict[tuple[int, ...], dict[int, float]],
          default: dict[int, float] | None = None) -> Table:
    def lookup(prefix: tuple[int, ...]) -> dict[int, float]:
        if prefix in entries:
            return entries[prefix]
        if default is None:
            raise AssertionError(f"search asked for an unscripted prefix {prefix}")
        return default
    return lookup


def src(*keys: int) -> np.ndarray:
    """One source row per key: [KEY0 + key, EOS]; the key selects the scripted table."""
    return np.array([[KEY0 + k, EOS_ID] for k in keys], dtype=np.int64)


def lp_len(length: int, alpha: float = 0.6) -> float:
    return ((5 + length) / 6) ** alpha


# Sentence 0: the longer hypothesis wins only through the length penalty.
#   step 0: A .7, B .2 continue (EOS .1 is third: not among the first `beam`, dropped)
#   step 1: A-B .42, A-EOS .28 (finalised, len 2), B-B .12 ; B-EOS .08 dropped
#   step 2: A-B-A .378, B-B-A .108, A-B-EOS .042, B-B-EOS .012: nothing finalised
#   step 3: A-B-A-EOS .2457 finalised (len 4) -> 2 finished = beam: done.
LENGTH_PENALTY = table({
    (): {A: .7, B: .2, EOS_ID: .1},
    (A,): {B: .6, EOS_ID: .4},
    (B,): {B: .6, EOS_ID: .4},
    (A, B): {A: .9, EOS_ID: .1},
    (B, B): {A: .9, EOS_ID: .1},
    (A, B, A): {EOS_ID: .65, B: .35},
    (B, B, A): {EOS_ID: .6, B: .4},
})


def test_beam_length_penalty_exact_scores():
    backend = ScriptedBackend({0: LENGTH_PENALTY})
    [hyps] = beam_search(backend, src(0), beam_size=2, alpha=0.6, nbest=2)
    assert [h.tokens for h in hyps] == [[A, B, A], [A]]
    long_lp = math.log(.7 * .6 * .9 * .65)
    short_lp = math.log(.7 * .4)
    assert hyps[0].log_prob == pytest.approx(long_lp, rel=1e-6)
    assert hyps[0].score == pytest.approx(long_lp / lp_len(4), rel=1e-6)
    assert hyps[1].log_prob == pytest.approx(short_lp, rel=1e-6)
    assert hyps[1].score == pytest.approx(short_lp / lp_len(2), rel=1e-6)
    assert hyps[0].step_log_probs == pytest.approx([math.log(p) for p in (.7, .6, .9, .65)], rel=1e-6)
    assert hyps[1].step_log_probs == pytest.approx([math.log(.7), math.log(.4)], rel=1e-6)
    assert backend.steps_run == 4  # stopped as soon as `beam` hypotheses were finished


def test_beam_alpha_zero_ranks_by_log_prob():
    [hyps] = beam_search(ScriptedBackend({0: LENGTH_PENALTY}), src(0), beam_size=2, alpha=0.0, nbest=2)
    assert [h.tokens for h in hyps] == [[A], [A, B, A]]
    assert hyps[0].score == pytest.approx(math.log(.28), rel=1e-6)


def test_beam_nbest_one_returns_best():
    [hyps] = beam_search(ScriptedBackend({0: LENGTH_PENALTY}), src(0), beam_size=2, nbest=1)
    assert len(hyps) == 1 and hyps[0].tokens == [A, B, A]


# Depends on the last token only, EOS never likely: the length limit decides.
def _last_token(prefix: tuple[int, ...]) -> dict[int, float]:
    if not prefix:
        return {A: .6, B: .3, EOS_ID: .1}
    return {A: .7, B: .2, EOS_ID: .1} if prefix[-1] == A else {A: .5, B: .3, EOS_ID: .2}


def test_beam_max_length_forces_eos():
    # step 0: A .6, B .3; step 1: A-A .42, B-A .15 (A-B .12, B-B .09 fall out);
    # step 2 = limit (0 * src_len + 2): EOS forced with its own log-prob.
    [hyps] = beam_search(ScriptedBackend({0: _last_token}), src(0), beam_size=2, max_len_a=0.0,
                         max_len_b=2, nbest=2)
    assert [h.tokens for h in hyps] == [[A, A], [B, A]]
    assert hyps[0].log_prob == pytest.approx(math.log(.6 * .7 * .1), rel=1e-6)
    assert hyps[1].log_prob == pytest.approx(math.log(.3 * .5 * .1), rel=1e-6)
    assert hyps[0].score == pytest.approx(math.log(.042) / lp_len(3), rel=1e-6)


def test_max_length_follows_source_length_and_model_limit():
    backend = ScriptedBackend({0: _last_token})
    # max_len = 1.0 * src_len (2 tokens: key + EOS) + 1 = 3 tokens before the forced EOS
    [[hyp]] = beam_search(backend, src(0), beam_size=2, max_len_a=1.0, max_len_b=1)
    assert len(hyp.tokens) == 3
    capped = ScriptedBackend({0: _last_token}, max_tgt_len=3)  # BOS + 2 tokens + no room: EOS at 2
    [[hyp]] = beam_search(capped, src(0), beam_size=2, max_len_a=1.0, max_len_b=50)
    assert len(hyp.tokens) == 2
    [[g]] = greedy_search(capped, src(0), max_len_b=50)
    assert g.tokens == [A, A]


EAGER_EOS = table({
    (): {EOS_ID: .5, A: .3, B: .2},
    (A,): {EOS_ID: .9, A: .05, B: .05},
    (B,): {EOS_ID: .8, A: .1, B: .1},
})


def test_min_len_masks_eos():
    backend = ScriptedBackend({0: EAGER_EOS})
    [[free]] = beam_search(backend, src(0), beam_size=2)
    assert free.tokens == [] and free.log_prob == pytest.approx(math.log(.5), rel=1e-6)
    [hyps] = beam_search(backend, src(0), beam_size=2, min_len=1, nbest=2)
    assert [h.tokens for h in hyps] == [[A], [B]]
    assert hyps[0].log_prob == pytest.approx(math.log(.3 * .9), rel=1e-6)
    assert hyps[1].log_prob == pytest.approx(math.log(.2 * .8), rel=1e-6)
    [[g]] = greedy_search(backend, src(0), min_len=1)
    assert g.tokens == [A] and g.log_prob == pytest.approx(math.log(.27), rel=1e-6)


def test_batch_equals_sentences_alone_and_finished_rows_leave():
    tables = {0: LENGTH_PENALTY, 1: EAGER_EOS, 2: _last_token}
    alone = [beam_search(ScriptedBackend(tables), src(k), beam_size=2, nbest=2, max_len_a=0.0,
                         max_len_b=5) for k in (0, 1, 2)]
    backend = ScriptedBackend(tables)
    batch = beam_search(backend, src(0, 1, 2), beam_size=2, nbest=2, max_len_a=0.0, max_len_b=5)
    for one, [ref] in zip(batch, alone):
        assert [h.tokens for h in one] == [h.tokens for h in ref]
        assert [h.score for h in one] == pytest.approx([h.score for h in ref], rel=1e-6)
    # EAGER_EOS finishes at step 1, LENGTH_PENALTY at step 3: the step shrinks 6 -> 4 -> 2.
    assert backend.rows_seen[:3] == [6, 6, 4] and backend.rows_seen[4] == 2
    # The encoder state keeps one row per live sentence (never a copy per beam).
    assert backend.state_rows_seen[:3] == [3, 3, 2] and backend.state_rows_seen[4] == 1


def test_beam_wider_than_topk_is_refused():
    with pytest.raises(SearchError, match="top-4"):
        beam_search(ScriptedBackend({0: LENGTH_PENALTY}, topk=4), src(0), beam_size=3)
    with pytest.raises(SearchError, match="nbest"):
        beam_search(ScriptedBackend({0: LENGTH_PENALTY}), src(0), beam_size=2, nbest=3)


def _random_table(seed: int) -> Table:
    """Random but fixed next-token distributions over A, B, 6, 7 and EOS, per prefix."""
    cache: dict[tuple[int, ...], dict[int, float]] = {}

    def lookup(prefix):
        if prefix not in cache:
            rng = random.Random(hash((seed, prefix)))
            w = [rng.random() ** 2 for _ in range(5)]
            cache[prefix] = {tok: x / sum(w) for tok, x in zip((A, B, 6, 7, EOS_ID), w)}
        return cache[prefix]
    return lookup


def test_beam_one_equals_greedy_on_scripted_tables():
    tables = {k: _random_table(k) for k in range(8)}
    keys = tuple(range(8))
    beam = beam_search(ScriptedBackend(tables), src(*keys), beam_size=1, max_len_a=0.0, max_len_b=6)
    greedy = greedy_search(ScriptedBackend(tables), src(*keys), max_len_a=0.0, max_len_b=6)
    for [b], [g] in zip(beam, greedy):
        assert b.tokens == g.tokens
        assert b.log_prob == pytest.approx(g.log_prob, rel=1e-6)
        assert b.score == pytest.approx(g.score, rel=1e-6)


# -- the tiny PyTorch model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_backend(random_checkpoint):
    model, _, _ = load_model(random_checkpoint)
    return TorchBackend(model)


def _sources(n: int, vocab: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 9))] + [EOS_ID] for _ in range(n)]


def _teacher_forced(model, src_row: list[int], tokens: list[int]) -> list[float]:
    """Per-token log-probs of tokens + EOS under the full (non-incremental) forward."""
    s = torch.tensor([src_row])
    tgt_in = torch.tensor([[BOS_ID] + tokens])
    with torch.no_grad():
        lp = model(s, tgt_in).log_softmax(-1)[0]
    return [lp[i, t].item() for i, t in enumerate(tokens + [EOS_ID])]


def test_torch_beam_hypotheses_match_teacher_forcing(tiny_backend):
    """Each returned hypothesis' log-probs equal the full forward's: catches wrong cache
    reordering, wrong steps or mixed-up rows when sentences leave the batch."""
    sources = _sources(6, tiny_backend.cfg.vocab_size)
    hyps = beam_search(tiny_backend, pad_batch(sources), beam_size=3, nbest=3, max_len_a=0.0,
                       max_len_b=7)
    for row, nbest in zip(sources, hyps):
        assert len(nbest) == 3
        assert [h.score for h in nbest] == sorted((h.score for h in nbest), reverse=True)
        for h in nbest:
            ref = _teacher_forced(tiny_backend.model, row, h.tokens)
            assert h.step_log_probs == pytest.approx(ref, abs=1e-4)
            assert h.log_prob == pytest.approx(sum(ref), abs=1e-3)


def test_torch_beam_one_equals_greedy_and_padding_invariance(tiny_backend):
    sources = _sources(7, tiny_backend.cfg.vocab_size, seed=2)
    beam = beam_search(tiny_backend, pad_batch(sources), beam_size=1, max_len_b=8, max_len_a=0.0)
    greedy = greedy_search(tiny_backend, pad_batch(sources), max_len_b=8, max_len_a=0.0)
    assert [b[0].tokens for b in beam] == [g[0].tokens for g in greedy]
    alone = [greedy_search(tiny_backend, pad_batch([s]), max_len_b=8, max_len_a=0.0)[0][0] for s in sources]
    assert [g[0].tokens for g in greedy] == [a.tokens for a in alone]


def test_translate_ids_restores_order_and_handles_empty(tiny_backend):
    sources = _sources(9, tiny_backend.cfg.vocab_size, seed=3)
    sources.insert(4, [])
    opts = dict(beam_size=2, max_len_a=0.0, max_len_b=6)
    # A budget this small forces many batches, each sorted by length.
    out = translate_ids(tiny_backend, sources, batch_tokens=30, **opts)
    assert out[4] == []
    for s, hyps in zip(sources, out):
        if s:
            [ref] = beam_search(tiny_backend, pad_batch([s]), **opts)
            assert [h.tokens for h in hyps] == [h.tokens for h in ref]


def test_length_batches_budget_and_order():
    lengths = [3, 10, 1, 7, 7, 2, 10]
    batches = list(length_batches(lengths, batch_tokens=40, beam_size=2))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) * 2 <= 40
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat, reverse=True)
    assert all(len(b) <= 2 for b in length_batches(lengths, 10_000, 4, max_batch=2))



# transformers' rules (rules="transformers"): score = log_prob / length ** alpha, the best `beam`
# finished kept, and the search goes on while the best live hypothesis could still beat the worst.
#   step 0: A .6, B .4
#   step 1: A-EOS .33 (finished, -0.554), B-B .32, A-A .27; B-EOS .08 not among the first `beam`
#   step 2: B-B-B .288, A-A-EOS .243 (finished, -0.472): two finished = beam. fairseq stops here;
#           transformers goes on: the live B-B-B scores log(.288) / 3 = -0.415 > the worst, -0.554
#   step 3: B-B-B-EOS .2736 (-0.324) replaces A-EOS; the live ones (.0144) cannot beat -0.472: done
KEEP_BEST = table({
    (): {A: .6, B: .4},
    (A,): {EOS_ID: .55, A: .45},
    (B,): {B: .8, EOS_ID: .2},
    (A, A): {EOS_ID: .9, A: .1},
    (B, B): {B: .9, EOS_ID: .1},
    (A, A, A): {EOS_ID: .5, A: .5},
    (B, B, B): {EOS_ID: .95, B: .05},
})


def test_transformers_rules_keep_the_best_finished_until_none_live_can_beat_them():
    backend = ScriptedBackend({0: KEEP_BEST})
    [hyps] = beam_search(backend, src(0), beam_size=2, alpha=1.0, nbest=2, rules="transformers")
    assert [h.tokens for h in hyps] == [[B, B, B], [A, A]]
    assert hyps[0].score == pytest.approx(math.log(.4 * .8 * .9 * .95) / 4, rel=1e-6)
    assert hyps[1].score == pytest.approx(math.log(.6 * .45 * .9) / 3, rel=1e-6)
    assert backend.steps_run == 4
    [fairseq] = beam_search(ScriptedBackend({0: KEEP_BEST}), src(0), beam_size=2, alpha=1.0, nbest=2)
    assert [h.tokens for h in fairseq] == [[A], [A, A]]  # the first two to finish; GNMT's penalty


def test_transformers_rules_score_a_forced_eos_zero():
    [[hyp]] = beam_search(ScriptedBackend({0: _last_token}), src(0), beam_size=2, max_len_a=0.0, max_len_b=2,
                          nbest=1, alpha=1.0, rules="transformers")
    assert hyp.tokens == [A, A]
    assert hyp.log_prob == pytest.approx(math.log(.6 * .7), rel=1e-6)  # the forced EOS adds 0
    assert hyp.score == pytest.approx(math.log(.6 * .7) / 3, rel=1e-6)


# Top-beam against fairseq's rule (alpha 1):
#   step 1: A-EOS .42 is the best candidate (finalised); B-B .38 and A-A .18 go on
#   step 2: B-B-EOS .3762 and A-A-EOS .108 finalised: fairseq's rule has its beam (3 >= 2) and ranks B-B first
#           (log .3762 / (8/6) = -0.734 against log .42 / (7/6) = -0.744); top-beam stopped a step before.
TOP_BEAM = {
    (): {A: .6, B: .4},
    (A,): {EOS_ID: .7, A: .3},
    (B,): {B: .95, EOS_ID: .05},
    (A, A): {EOS_ID: .6, A: .4},
}


@pytest.mark.parametrize("search", ["beam", "constrained"])
def test_top_beam_ends_a_sentence_once_its_best_candidate_ends(search):
    """Beam search, and constrained beam search on a sentence without phrases, under both rules."""
    def run(rules: str) -> tuple[list, int]:
        backend = ScriptedBackend({0: table({**TOP_BEAM, (B, B): {EOS_ID: .99, B: .01}})})
        kw = dict(beam_size=2, alpha=1.0, nbest=1, rules=rules)
        [hyps] = (beam_search(backend, src(0), **kw) if search == "beam"
                  else constrained_beam_search(backend, src(0), [[]], **kw))
        return hyps, backend.steps_run

    fairseq, fairseq_steps = run("fairseq")
    assert fairseq[0].tokens == [B, B] and fairseq_steps == 3
    top, top_steps = run("top-beam")
    assert top[0].tokens == [A] and top_steps == 2
    assert top[0].score == pytest.approx(math.log(.42) / (7 / 6), rel=1e-6)


def test_top_beam_remembers_the_best_ended_until_nbest_have_ended():
    """nbest 2: the best ended at step 1 with one hypothesis; at step 2 the best (B-B-B) goes on, but B-B-EOS makes
    two, so the sentence ends there. B-B-B's continuation is not scripted: a rule that forgot step 1's best would
    ask for it and fail."""
    backend = ScriptedBackend({0: table({**TOP_BEAM, (B, B): {B: .6, EOS_ID: .4}})})
    [hyps] = beam_search(backend, src(0), beam_size=2, alpha=1.0, nbest=2, rules="top-beam")
    assert [h.tokens for h in hyps] == [[A], [B, B]] and backend.steps_run == 3


def test_top_beam_and_fairseq_agree_sentence_by_sentence_in_a_batch():
    """A batch under top-beam gives each sentence what it gets alone; sentences leave as their best ends."""
    tables = {k: _random_table(k) for k in range(4)}
    batch = beam_search(ScriptedBackend(tables), src(0, 1, 2, 3), beam_size=3, nbest=1, rules="top-beam",
                        max_len_a=0.0, max_len_b=6)
    for k in range(4):
        [alone] = beam_search(ScriptedBackend(tables), src(k), beam_size=3, nbest=1, rules="top-beam",
                              max_len_a=0.0, max_len_b=6)
        assert [(h.tokens, h.score) for h in batch[k]] == [(h.tokens, h.score) for h in alone]

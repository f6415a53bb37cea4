"""Constrained beam search (runtime/constrained.py) on the real torch backend: every phrase appears in every
hypothesis, the scores are the model's own log-probs, sentences without phrases decode exactly as beam search
decodes them, and the constraint state follows phrases that are started, broken off and restarted."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from model.checkpoint import load_model
from model.config import BOS_ID, EOS_ID
from runtime.constrained import _advance, constrained_beam, constrained_beam_search
from runtime.errors import RuntimeUserError
from runtime.search import beam_search
from runtime.torch_backend import TorchBackend
from runtime.translate import pad_batch, translate_ids

LIMITS = dict(max_len_a=0.0, max_len_b=14)


@pytest.fixture(scope="module")
def model(trained_checkpoint):
    return load_model(trained_checkpoint)[0]


@pytest.fixture(scope="module")
def backend(model):
    return TorchBackend(model)


def _sources(n: int, vocab: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(2, 8))] + [EOS_ID] for _ in range(n)]


def _phrases(n: int, vocab: int, seed: int = 5) -> list[list[list[int]]]:
    """Per sentence 0-3 phrases of 1-3 tokens the model would rarely choose by itself."""
    rng = random.Random(seed)
    return [[[rng.randrange(4, vocab) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(0, 3))]
            for _ in range(n)]


def _contains(tokens: list[int], phrase: list[int]) -> bool:
    return any(tokens[i:i + len(phrase)] == phrase for i in range(len(tokens) - len(phrase) + 1))


def _teacher_forced(model, src_row: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        lp = model(torch.tensor([src_row]), torch.tensor([[BOS_ID] + tokens])).log_softmax(-1)[0]
    return [lp[i, t].item() for i, t in enumerate(tokens + [EOS_ID])]


def test_every_hypothesis_holds_every_phrase_with_the_models_own_log_probs(backend, model):
    sources = _sources(12, model.cfg.vocab_size)
    phrases = _phrases(12, model.cfg.vocab_size)
    assert sum(map(bool, phrases)) >= 6
    results = constrained_beam_search(backend, pad_batch(sources), phrases, beam_size=6, nbest=3, **LIMITS)
    for src, wanted, hyps in zip(sources, phrases, results):
        assert len(hyps) == 3
        for hyp in hyps:
            for phrase in wanted:
                assert _contains(hyp.tokens, phrase), (hyp.tokens, phrase)
            assert hyp.step_log_probs == pytest.approx(_teacher_forced(model, src, hyp.tokens), abs=1e-4)
            assert hyp.log_prob == pytest.approx(sum(hyp.step_log_probs), abs=1e-4)


@pytest.mark.parametrize("rules,nbest", [("fairseq", 4), ("top-beam", 1), ("top-beam", 2)])
def test_sentences_without_phrases_decode_exactly_as_beam_search(backend, model, rules, nbest):
    """In a batch beside sentences with phrases: the same tokens, scores and log-probs, to the bit."""
    sources = _sources(8, model.cfg.vocab_size, seed=9)
    phrases = [[] if i % 2 else [[7, 8]] for i in range(8)]
    src = pad_batch(sources)
    plain = beam_search(backend, src, beam_size=4, nbest=nbest, rules=rules, **LIMITS)
    mixed = constrained_beam_search(backend, src, phrases, beam_size=4, nbest=nbest, rules=rules, **LIMITS)
    for i in range(1, 8, 2):
        assert [(h.tokens, h.score, h.log_prob) for h in mixed[i]] == [(h.tokens, h.score, h.log_prob)
                                                                       for h in plain[i]]
    assert any(mixed[i][0].tokens != plain[i][0].tokens for i in range(0, 8, 2))


def test_translate_ids_leaves_lines_without_terms_as_they_were(backend, model):
    sources = _sources(10, model.cfg.vocab_size, seed=11) + [[]]
    phrases = [[[9, 10, 11]] if i in (2, 5) else [] for i in range(len(sources))]
    before = translate_ids(backend, sources, beam_size=4, **LIMITS)
    after = translate_ids(backend, sources, beam_size=4, constraints=phrases, **LIMITS)
    for i, (b, a) in enumerate(zip(before, after)):
        if phrases[i]:
            assert _contains(a[0].tokens, [9, 10, 11])
        else:
            assert [(h.tokens, h.score) for h in a] == [(h.tokens, h.score) for h in b]
    assert after[-1] == []


def test_a_phrase_that_does_not_fit_the_length_limit_ends_at_the_limit(backend, model):
    """EOS is forbidden until every phrase is met, up to the length limit, where it is forced."""
    phrase = list(range(20, 26))
    [hyps] = constrained_beam_search(backend, pad_batch([[5, 6, EOS_ID]]), [[phrase]], beam_size=4,
                                     max_len_a=0.0, max_len_b=4)
    assert hyps and all(len(h.tokens) == 4 for h in hyps)


def test_beam_grows_for_constrained_batches_within_the_backends_top_k():
    assert constrained_beam(4, 16) == 8
    assert constrained_beam(1, 16) == 4
    assert constrained_beam(8, 16) == 8
    assert constrained_beam(2, 4) == 2


def test_a_backend_that_cannot_gather_is_refused_in_one_line(model):
    backend = TorchBackend(model)
    backend.gathers = False
    with pytest.raises(RuntimeUserError, match="cannot apply glossaries"):
        constrained_beam_search(backend, pad_batch([[5, EOS_ID]]), [[[7]]], beam_size=2, **LIMITS)


def test_the_constraint_state_follows_progress_breaks_and_restarts():
    # one sentence, phrases [7, 8, 9] and [4]; hypotheses: fresh, in [7, 8, 9] after 7, in it after 7 8
    ids = np.array([[[7, 8, 9], [4, -1, -1]]])
    lengths = np.array([[3, 1]])
    met = np.zeros((1, 3, 2), dtype=bool)
    prog_c = np.array([[-1, 0, 0]])
    prog_j = np.array([[0, 1, 2]])
    row = np.array([[0, 0, 1, 1, 2, 2, 2]])
    tok = np.array([[7, 4, 8, 5, 9, 7, 4]])
    new_met, new_c, new_j, ended = _advance(ids, lengths, met, prog_c, prog_j, row, tok)
    assert ended.tolist() == [[False, True, False, False, True, False, True]]
    assert new_c.tolist() == [[0, -1, 0, -1, -1, 0, -1]]  # started; one-token phrase; advanced; broken; done
    assert new_j.tolist() == [[1, 0, 2, 0, 0, 1, 0]]      # 7 after "7 8" restarts the phrase
    assert new_met[0, :, 0].tolist() == [False, False, False, False, True, False, False]
    assert new_met[0, :, 1].tolist() == [False, True, False, False, False, False, True]


def test_a_completed_phrase_ends_its_word():
    """With the tokenizer's continuation pieces (runtime/tokenizer.py word_continuations), nothing glues onto a
    term's end: on a scripted model that follows the term 6 with the continuation piece 7 ("hound" + "s"), the
    forced 6 is followed by a word start or EOS instead, and without the mask it would not be."""
    from test_search import VOCAB, A, ScriptedBackend, src

    after_term = {7: 0.9, EOS_ID: 0.05, A: 0.05}
    elsewhere = {A: 0.5, 6: 0.02, 7: 0.08, EOS_ID: 0.4}

    def lookup(prefix: tuple[int, ...]) -> dict[int, float]:
        return after_term if prefix and prefix[-1] == 6 else elsewhere

    joins = np.zeros(VOCAB, dtype=bool)
    joins[7] = True
    options = dict(beam_size=4, nbest=4, max_len_a=0.0, max_len_b=6)
    glued = constrained_beam_search(ScriptedBackend({0: lookup}), src(0), [[[6]]], **options)[0]
    assert _contains(glued[0].tokens, [6, 7])  # what the model wants: "hounds"
    whole = constrained_beam_search(ScriptedBackend({0: lookup}), src(0), [[[6]]], joins=joins, **options)[0]
    holding = [hyp for hyp in whole if 6 in hyp.tokens]  # the others ended at the limit: ranked after them
    assert holding and whole[:len(holding)] == holding
    for hyp in holding:
        assert not _contains(hyp.tokens, [6, 7]), hyp.tokens


def test_no_term_starts_right_after_a_bare_space():
    """A model that writes a bare "▁" (piece 7 here) where a number it cannot spell starts, then had the term
    "▁guret" (6) forced, wrote "feze  guret" with two spaces (the demo model on "u posa 2024 kinisa" with
    2024 -> guret). With the pieces' kinds (runtime/tokenizer.py word_continuations), a term's word start never
    follows a bare space; without them it does."""
    from test_search import VOCAB, A, ScriptedBackend, src

    from runtime.tokenizer import SPACE, WORD

    after_space = {6: 0.6, A: 0.2, EOS_ID: 0.2}
    elsewhere = {7: 0.6, A: 0.2, 6: 0.05, EOS_ID: 0.15}

    def lookup(prefix: tuple[int, ...]) -> dict[int, float]:
        return after_space if prefix and prefix[-1] == 7 else elsewhere

    kinds = np.zeros(VOCAB, dtype=np.int8)
    kinds[7], kinds[6], kinds[A] = SPACE, WORD, WORD
    options = dict(beam_size=4, nbest=4, max_len_a=0.0, max_len_b=5)
    spaced = constrained_beam_search(ScriptedBackend({0: lookup}), src(0), [[[6]]], **options)[0]
    assert _contains(spaced[0].tokens, [7, 6])  # what the model wants: "▁" then "▁guret"
    kept = constrained_beam_search(ScriptedBackend({0: lookup}), src(0), [[[6]]], joins=kinds, **options)[0]
    holding = [hyp for hyp in kept if 6 in hyp.tokens]
    assert holding and kept[:len(holding)] == holding
    for hyp in holding:  # the term (its first 6; once met, a 6 is the model's own word) after no bare space
        first = hyp.tokens.index(6)
        assert first == 0 or hyp.tokens[first - 1] != 7, hyp.tokens


def test_no_term_starts_inside_a_word_the_model_has_not_ended():
    """A term started right after a piece the model would have continued ("jeza" of "jezai": piece B here, whose
    best next piece is the continuation 7, "i") left a fragment: "loro jeza zorro jezai" (18 of 58 lines holding a
    term, on the demo model). A term's word start now waits for a step whose best piece is not a continuation;
    without the pieces' kinds it starts at once."""
    from test_search import VOCAB, A, B, ScriptedBackend, src

    from runtime.tokenizer import GLUES, WORD

    after_b = {7: 0.6, 6: 0.3, EOS_ID: 0.1}  # "jeza": "i" next, the term likelier here than anywhere else
    after_7 = {EOS_ID: 0.8, A: 0.15, 6: 0.05}
    elsewhere = {B: 0.8, A: 0.15, 6: 0.01, EOS_ID: 0.04}

    def lookup(prefix: tuple[int, ...]) -> dict[int, float]:
        return after_b if prefix and prefix[-1] == B else after_7 if prefix and prefix[-1] == 7 else elsewhere

    kinds = np.zeros(VOCAB, dtype=np.int8)
    kinds[7], kinds[6], kinds[A], kinds[B] = GLUES, WORD, WORD, WORD
    options = dict(beam_size=4, nbest=4, max_len_a=0.0, max_len_b=5)
    cut = constrained_beam_search(ScriptedBackend({0: lookup}), src(0), [[[6]]], **options)[0]
    assert _contains(cut[0].tokens, [B, 6])  # "jeza zorro": the term inside the word
    kept = constrained_beam_search(ScriptedBackend({0: lookup}), src(0), [[[6]]], joins=kinds, **options)[0]
    holding = [hyp for hyp in kept if 6 in hyp.tokens]
    assert holding and kept[:len(holding)] == holding
    for hyp in holding:
        first = hyp.tokens.index(6)
        assert first == 0 or hyp.tokens[first - 1] != B, hyp.tokens


def test_top_beam_ends_a_sentence_with_phrases_when_its_best_that_may_end_ends(backend, model):
    """Under top-beam a sentence ended only once the step's best candidate was an EOS; with phrases that one is
    short of them (it cannot end), so sentences decoded to the length limit: 212-220 steps where fairseq took
    15-46 (the demo model, 32 terms). Its rule looks at the best hypothesis that has met every phrase."""
    sources = _sources(8, model.cfg.vocab_size, seed=21)
    phrases = [[[9, 10]] for _ in sources]
    limits = dict(max_len_a=0.0, max_len_b=120)
    steps: dict[str, int] = {}
    calls: list[int] = []
    step = backend.step

    def counted(*args, **kwargs):
        calls.append(1)
        return step(*args, **kwargs)

    backend.step = counted
    try:
        for rules in ("fairseq", "top-beam"):
            calls.clear()
            hyps = constrained_beam_search(backend, pad_batch(sources), phrases, beam_size=4, rules=rules, **limits)
            steps[rules] = len(calls)
            assert all(_contains(h[0].tokens, [9, 10]) for h in hyps)
    finally:
        del backend.step
    assert steps["top-beam"] <= steps["fairseq"] < 120, steps

"""Constrained beam search: each sentence's target-token phrases (a glossary's terms) must appear in its output.

Lexically constrained decoding as Post & Vilar (2018) built it, vectorised as Hu et al. (2019) did:

- every hypothesis tracks which of its sentence's phrases it has met, and the phrase it is in the middle of
  (which one, how many of its tokens so far); a token that breaks off a phrase loses that progress;
- each step's candidates are the rows' top-K (as beam search's) plus, per row, the next token of the phrase
  it is in and the first token of every phrase it has not met, with their true log-probs (the backend's
  `want` gather: runtime/backend.py), however unlikely the model finds them;
- a candidate's bank is the number of phrase tokens it has produced (met phrases in full, plus its
  progress); the beam is dealt round-robin over the banks, from the highest down, each bank giving its best
  candidate in turn (dynamic beam allocation), so hypotheses that have produced the terms are kept beside
  the fluent ones that have not yet;
- EOS is allowed only to a hypothesis that has met every phrase, up to the sentence's length limit, where it
  is forced as in beam search.

Sentences without phrases decode as beam search does them (one bank: the best `beam` non-EOS candidates,
EOS finalised among the first `beam`; top-beam's early end when the best candidate that has met every
phrase, which is the best overall without phrases, is an EOS), and `translate_ids` keeps them out of
constrained batches anyway, so a glossary changes nothing for a line that holds none of its terms. The
scores, the length penalty, the stopping rules and the forced first token are beam search's
(runtime/search.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from runtime.backend import Backend, host
from runtime.decoding import PAPER, RULES
from runtime.errors import RuntimeUserError
from runtime.search import (
    NEG_INF,
    Hypothesis,
    SearchError,
    _extend,
    _finalise,
    _Finished,
    _first_tokens,
    _source,
    _start,
    _step_candidates,
    _stopped,
    hf_rules,
    max_output_lengths,
)
from runtime.tokenizer import GLUES, SPACE, WORD

Phrases = list[list[int]]  # one sentence's constraints: target token sequences, each non-empty


def constrained_beam(beam_size: int, topk: int) -> int:
    """The beam a constrained batch runs with: twice the user's, at least 4, at most what the backend's
    top-K allows (2 x beam candidates per row). Banks share the beam, so a narrow one would leave the fluent
    hypotheses no room beside those that force the terms."""
    return max(beam_size, min(max(2 * beam_size, 4), topk // 2))


class _Phrases:
    """The batch's phrases as padded arrays: ids (n, C, L) with -1 padding, lengths (n, C) (0: no phrase)."""

    def __init__(self, constraints: list[Phrases], n_sent: int):
        if len(constraints) != n_sent:
            raise SearchError(f"constraints are given for {len(constraints)} sentences, not {n_sent}")
        width = max([len(c) for c in constraints] + [1])
        longest = max([len(p) for c in constraints for p in c] + [1])
        self.ids = np.full((n_sent, width, longest), -1, dtype=np.int64)
        self.lengths = np.zeros((n_sent, width), dtype=np.int64)
        for s, phrases in enumerate(constraints):
            for c, phrase in enumerate(phrases):
                if not phrase:
                    raise SearchError(f"sentence {s}: constraint {c} is empty")
                self.ids[s, c, :len(phrase)] = phrase
                self.lengths[s, c] = len(phrase)
        self.totals = self.lengths.sum(axis=1)  # phrase tokens per sentence: its highest bank

    @property
    def width(self) -> int:
        return int(self.lengths.shape[1])


def constrained_beam_search(backend: Backend, src_ids: Any, constraints: list[Phrases], *,
                            beam_size: int = PAPER.beam_size, alpha: float = PAPER.alpha,
                            max_len_a: float = PAPER.max_len_a, max_len_b: int = PAPER.max_len_b,
                            min_len: int = PAPER.min_len, nbest: int = PAPER.nbest, rules: str = PAPER.rules,
                            first_tokens: Any = None, joins: np.ndarray | None = None) -> list[list[Hypothesis]]:
    """beam_search (runtime/search.py) with constraints[s], the phrases sentence s must contain. Returns, per
    sentence, `nbest` hypotheses best first, those that hold every phrase before those that do not (ended at
    the length limit first; callers check which terms made it into the text). joins (vocab,) int8: each piece's
    kind (runtime/tokenizer.py word_continuations): none that glues onto the word before it may follow a completed
    phrase, so a term ends its word ("hound", never "hounds" or "houndn"); no phrase's word start may follow a bare
    "▁" (two spaces), nor a piece the model would go on with a continuation (its best next piece glues: "jeza zorro"
    inside "jezai")."""
    if not backend.gathers:
        raise RuntimeUserError(f"the {backend.name} backend cannot apply glossaries here (its decoder step cannot "
                               "return the log-probs of given ids): use the onnxruntime backend on a model dir "
                               "exported by this version, or the torch backend with --step eager, without "
                               "--shortlist")
    src_ids = _source(backend, src_ids)
    first = _first_tokens(first_tokens, src_ids.shape[0])
    if rules not in RULES:
        raise SearchError(f"search rules {rules!r}: choose one of {', '.join(RULES)}")
    if not 1 <= nbest <= beam_size:
        raise SearchError(f"nbest ({nbest}) must be between 1 and the beam size ({beam_size})")
    beam, n_cand = beam_size, 2 * beam_size
    if n_cand > backend.topk:
        raise SearchError(f"beam size {beam} needs {n_cand} candidates per step but the {backend.name} backend "
                          f"returns only top-{backend.topk}")
    n_sent = src_ids.shape[0]
    if n_sent == 0:
        return []
    phrases = _Phrases(constraints, n_sent)
    n_c = phrases.width
    finished = _Finished(n_sent, beam, keep_best=hf_rules(rules))
    eos = backend.cfg.eos_id
    max_len = max_output_lengths(src_ids, backend, max_len_a, max_len_b)

    state, cache, tokens, reorder, scores, history, history_lp = _start(backend, src_ids, beam)
    # per hypothesis: the phrases met (absent ones count as met), the phrase in progress (-1: none), its tokens
    met = np.broadcast_to((phrases.lengths == 0)[:, None, :], (n_sent, beam, n_c)).copy()
    prog_c = np.full((n_sent, beam), -1, dtype=np.int64)
    prog_j = np.zeros((n_sent, beam), dtype=np.int64)
    ended = np.zeros((n_sent, beam), dtype=bool)  # the hypothesis' last token completed a phrase
    sent_ids = np.arange(n_sent, dtype=np.int64)
    live_max = max_len
    t = 0
    while sent_ids.size > 0:
        b = sent_ids.size
        ids_s, len_s, total_s = phrases.ids[sent_ids], phrases.lengths[sent_ids], phrases.totals[sent_ids]
        want = _wanted(ids_s, met, prog_c, prog_j)  # (b, beam, W)
        width = want.shape[2]
        out, cache = backend.step(state, tokens, t, cache, reorder, want=want.reshape(b * beam, width))
        if out.want_log_probs is None:
            raise RuntimeUserError(f"the {backend.name} backend returned no log-probs for the glossary's tokens")
        limit_rows = np.repeat(live_max, beam)
        lp, ids = _step_candidates(out.topk_log_probs, out.topk_ids, out.eos_log_probs, n_cand, t, min_len,
                                   limit_rows, eos, rules, None if first is None else np.repeat(first, beam))
        want_lp = host(out.want_log_probs).astype(np.float32).reshape(b * beam, width)
        flat_want = want.reshape(b * beam, width)
        shut = (limit_rows <= t)[:, None] | (flat_want < 0) | _seen(flat_want, ids)
        if t == 0 and first is not None:
            shut[:] = True
        want_lp = np.where(shut, np.float32(NEG_INF), want_lp)
        pool_ids = np.concatenate([ids, flat_want], axis=1)  # (N, P): the row's candidates, then its phrase tokens
        pool_lp = np.concatenate([lp, want_lp], axis=1)
        if joins is not None:
            kinds = joins[np.clip(pool_ids, 0, joins.size - 1)]
            if ended.any():  # a term is a whole word: nothing glued onto its end
                pool_lp = np.where(ended.reshape(-1, 1) & (kinds == GLUES), np.float32(NEG_INF), pool_lp)
            best = kinds[np.arange(kinds.shape[0]), lp.argmax(axis=1)]  # the model's own next piece
            if (best == GLUES).any():  # a term starts a word only where the model ends one: its best piece glues
                # onto the word in progress ("jeza" of "jezai"), and a term started there left "jeza zorro"
                starts = (pool_ids[:, :, None] == flat_want[:, None, 1:]).any(axis=2)  # a phrase's first token,
                # among the model's candidates too (not the next token of the phrase in progress)
                pool_lp = np.where((best == GLUES)[:, None] & starts & (kinds == WORD), np.float32(NEG_INF), pool_lp)
            spaced = joins[np.clip(host(tokens).reshape(-1), 0, joins.size - 1)] == SPACE
            if spaced.any():  # no term's word start right after a bare space: "feze  guret"
                term = (pool_ids[:, :, None] == flat_want[:, None, :]).any(axis=2)
                pool_lp = np.where(spaced[:, None] & term & (kinds == WORD), np.float32(NEG_INF), pool_lp)
        p = pool_ids.shape[1]
        cum = (scores.reshape(-1, 1) + pool_lp).reshape(b, beam * p)
        cand_tok = pool_ids.reshape(b, beam * p)
        cand_row = np.repeat(np.arange(beam), p)[None, :]  # (1, beam*P): the row within its sentence
        new_met, new_c, new_j, new_end = _advance(ids_s, len_s, met, prog_c, prog_j, cand_row, cand_tok)
        bank = (len_s[:, None, :] * new_met).sum(axis=2) + np.where(new_c >= 0, new_j, 0)  # (b, beam*P)
        is_eos = cand_tok == eos
        at_limit = (live_max <= t)[:, None]
        cum = np.where(is_eos & ~new_met.all(axis=2) & ~at_limit, np.float32(NEG_INF), cum)

        order = np.argsort(-cum, axis=1, kind="stable")  # (b, beam*P) best first
        top_scores = np.take_along_axis(cum, order, axis=1)
        top_eos = np.take_along_axis(is_eos, order, axis=1)
        top_bank = np.take_along_axis(bank, order, axis=1)
        finite = np.isfinite(top_scores)
        # EOS candidates the allocation would keep are finalised: a hypothesis that has met its phrases sits in
        # the highest bank, however far below the fluent ones its score is (with one bank: the first `beam`)
        first_pos = _allocate(top_bank, finite, total_s, beam)
        final = np.take_along_axis(top_eos & finite, first_pos, axis=1)
        if final.any():
            first_order = np.take_along_axis(order, first_pos, axis=1)
            _finalise(finished, final, sent_ids, first_order // p, np.take_along_axis(top_scores, first_pos, axis=1),
                      np.take_along_axis(pool_lp.reshape(b, beam * p), first_order, axis=1),
                      history, history_lp, t, alpha, rules)
        if rules == "top-beam":  # its rule over the hypotheses that may end: the best that has met every phrase
            # (always allocated, so finalised) is an EOS; the step's best overall, short of a phrase, cannot end,
            # and waiting for it to decoded to the length limit
            complete = finite & (top_bank == total_s[:, None])
            best = complete.argmax(axis=1)
            finished.top_ended[sent_ids[complete.any(axis=1) & top_eos[np.arange(b), best]]] = True
        counts = finished.counts[sent_ids]

        keep = _allocate(top_bank, finite & ~top_eos, total_s, beam)
        chosen = np.take_along_axis(order, keep, axis=1)  # (b, beam): flat pool indices, best first
        scores = np.take_along_axis(cum, chosen, axis=1)
        next_beam = chosen // p
        next_tok = np.take_along_axis(cand_tok, chosen, axis=1)
        next_lp = np.take_along_axis(pool_lp.reshape(b, beam * p), chosen, axis=1)
        met = np.take_along_axis(new_met, chosen[:, :, None], axis=1)
        prog_c = np.take_along_axis(new_c, chosen, axis=1)
        prog_j = np.take_along_axis(new_j, chosen, axis=1)
        ended = np.take_along_axis(new_end, chosen, axis=1)
        src_rows = np.arange(0, b * beam, beam)[:, None] + next_beam
        history = _extend(history, src_rows, next_tok)
        history_lp = _extend(history_lp, src_rows, next_lp)
        done = (live_max <= t) | _stopped(finished, sent_ids, counts, scores, beam, t, alpha, rules, nbest)
        if done.any():
            live = np.flatnonzero(~done)
            sent_ids, live_max = sent_ids[live], live_max[live]
            scores, history, history_lp = scores[live], history[live], history_lp[live]
            met, prog_c, prog_j, ended = met[live], prog_c[live], prog_j[live], ended[live]
            next_tok, src_rows = next_tok[live], src_rows[live]
            if live.size == 0:
                break
            state = backend.select(state, live)
        tokens = next_tok.reshape(-1)
        reorder = src_rows.reshape(-1)
        t += 1
    return [sorted(hyps, key=lambda h: (not _holds(h.tokens, wanted), -h.score))[:nbest]
            for hyps, wanted in zip(finished.hyps, constraints)]


def _holds(tokens: list[int], phrases: Phrases) -> bool:
    """Whether every phrase is in `tokens` (a hypothesis ended at its length limit may lack one: it ranks
    after every hypothesis that holds them all, whatever its score)."""
    return all(any(tokens[i:i + len(p)] == p for i in range(len(tokens) - len(p) + 1)) for p in phrases)


def _wanted(ids: np.ndarray, met: np.ndarray, prog_c: np.ndarray, prog_j: np.ndarray) -> np.ndarray:
    """(b, beam, 1 + C): per hypothesis, the next token of the phrase in progress, then the first token of
    each phrase not met (-1: nothing)."""
    b, beam, _ = met.shape
    sent = np.arange(b)[:, None]
    nxt = np.where(prog_c >= 0, ids[sent, np.maximum(prog_c, 0), prog_j], -1)  # (b, beam)
    firsts = np.where(met, np.int64(-1), ids[:, None, :, 0])  # (b, beam, C)
    return np.concatenate([nxt[:, :, None], firsts], axis=2)


def _seen(want: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """(N, W): wanted ids already among the row's candidates, or earlier in its own list (one entry each)."""
    dup = (want[:, :, None] == ids[:, None, :]).any(axis=2)
    earlier = np.tril(np.ones((want.shape[1], want.shape[1]), dtype=bool), k=-1)  # [i, j]: j before i
    dup |= ((want[:, :, None] == want[:, None, :]) & earlier[None]).any(axis=2)
    return dup


def _advance(ids: np.ndarray, lengths: np.ndarray, met: np.ndarray, prog_c: np.ndarray, prog_j: np.ndarray,
             row: np.ndarray, tok: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The constraint state after each candidate (row of its sentence, token): (b, M, C) met, (b, M) phrase in
    progress and its tokens, (b, M) whether the token completed a phrase. The next token of the phrase in
    progress advances it (completing it at its length); any other token ends it, and may start (or, for a
    one-token phrase, complete) the first phrase not met that it begins."""
    b, m = tok.shape
    sent = np.arange(b)[:, None]
    cur_met = met[sent, row]  # (b, M, C)
    cur_c, cur_j = prog_c[sent, row], prog_j[sent, row]  # (b, M)
    expected = np.where(cur_c >= 0, ids[sent, np.maximum(cur_c, 0), np.minimum(cur_j, ids.shape[2] - 1)], -1)
    advance = (cur_c >= 0) & (tok == expected)
    adv_j = cur_j + 1
    adv_len = lengths[sent, np.maximum(cur_c, 0)]
    starts = ~cur_met & (ids[:, None, :, 0] == tok[:, :, None])  # (b, M, C)
    start_any = starts.any(axis=2) & ~advance
    start_c = starts.argmax(axis=2)
    start_len = lengths[sent, start_c]
    new_c = np.where(advance, np.where(adv_j >= adv_len, -1, cur_c),
                     np.where(start_any & (start_len > 1), start_c, -1))
    new_j = np.where(advance, np.where(adv_j >= adv_len, 0, adv_j), np.where(start_any & (start_len > 1), 1, 0))
    completed = np.where(advance & (adv_j >= adv_len), cur_c, np.where(start_any & (start_len == 1), start_c, -1))
    new_met = cur_met | (np.arange(ids.shape[1])[None, None, :] == completed[:, :, None])
    return new_met, new_c, new_j, completed >= 0


def _allocate(top_bank: np.ndarray, eligible: np.ndarray, totals: np.ndarray, beam: int) -> np.ndarray:
    """Positions (in score order, best first) of `beam` eligible candidates dealt round-robin over the banks,
    highest bank first, each bank giving its best remaining candidate in turn. With one bank (a sentence
    without phrases) that is the best `beam`, as beam search takes them. Returned in score order; when fewer
    are eligible, the best of the others fill the rest."""
    b, m = top_bank.shape
    n_banks = int(totals.max()) + 1 if totals.size else 1
    onehot = (top_bank[:, :, None] == np.arange(n_banks)[None, None, :]) & eligible[:, :, None]
    rank = np.cumsum(onehot, axis=1) - 1  # (b, M, banks): rank within its bank, by score
    rank_in_bank = np.take_along_axis(rank, np.clip(top_bank, 0, n_banks - 1)[:, :, None], axis=2)[:, :, 0]
    key = rank_in_bank * n_banks + (totals[:, None] - top_bank)
    key = np.where(eligible, key, np.iinfo(np.int64).max // 2 + np.arange(m)[None, :])
    keep = np.argsort(key, axis=1, kind="stable")[:, :beam]
    keep.sort(axis=1)
    return keep

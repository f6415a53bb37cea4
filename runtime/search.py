"""Beam search and greedy search, written once over the Backend protocol.

The search is fairseq's, vectorised over batch x beam: every step asks the backend for its rows' top-K
candidates, adds them to the hypotheses' cumulative log-probs (fp32), takes each sentence's best 2 * beam,
finalises the EOS candidates among the first `beam` of them with the GNMT length penalty (Wu et al., 2016)

    score = log_prob / ((5 + length) / 6) ** alpha      (length counts the EOS)

and continues with the best `beam` non-EOS candidates. A sentence is finished when it
holds `beam` finalised hypotheses or reaches its length limit, where EOS is forced with
the step's EOS log-probs. Finished sentences leave the batch (backend.select on the
encoder state, a shorter `reorder` on the cache), so steps shrink as sentences end.
Every live sentence keeps exactly `beam` rows (at step 0 too, where only beam 0 scores),
because the encoder state has one row per sentence, shared by its beam's rows.

Search never touches cache tensors: it hands the backend, for each hypothesis of the next step, the row of
the previous cache it continues (`reorder`). The only Python loop per step runs over the hypotheses finalised
in that step. Search works on numpy arrays (the step's candidates are a few numbers per hypothesis), so it
runs the same whatever the backend and never needs torch.

Models imported from Hugging Face were tuned with transformers' `generate`, whose beam search
differs in three rules; `rules="transformers"` (DecodingOptions.rules) follows them, so that an
imported model translates token for token as `generate` does (pipeline/importers):

    score = log_prob / length ** alpha                   (length counts the EOS)

a sentence keeps its best `beam` finalised hypotheses (a better one replaces the worst) and ends
when it holds `beam` and its best live hypothesis, scored at its current length, cannot beat the
worst of them (transformers' `early_stopping=False` heuristic); an EOS forced at the length limit
scores 0, as transformers' ForcedEOSTokenLogitsProcessor sets it. `rules="transformers-early"` is
generate's early_stopping=True: a sentence ends as soon as it holds `beam` finalised hypotheses. The
special ids (start, EOS, padding) are the model's own (backend.cfg).

`rules="top-beam"` keeps fairseq's scores but ends a sentence once a step's best candidate (by cumulative log-prob)
is an EOS and it holds `nbest` finalised hypotheses, as OpenNMT-py and CTranslate2 (`allow_early_exit`) do: fewer
steps, but a longer hypothesis that the length penalty would have ranked first can be missed.

A multilingual model (M2M-100, NLLB) is told the target language by its first generated token:
`first_tokens` gives one per sentence, forced at step 0 with log-prob 0 (transformers'
ForcedBOSTokenLogitsProcessor); it is part of the hypothesis' tokens and length, as in generate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from model.cache import tail_filled
from runtime.backend import Backend, host
from runtime.decoding import PAPER, RULES, DecodingOptions
from runtime.errors import RuntimeUserError

NEG_INF = float("-inf")


class SearchError(RuntimeUserError):
    """Search options that this backend cannot honour (e.g. a beam wider than its top-K)."""


@dataclass
class Hypothesis:
    """One finished translation of one sentence."""

    tokens: list[int]  # generated ids, without BOS and without the final EOS
    score: float  # what ranks hypotheses: log_prob / ((5 + len) / 6) ** alpha (len incl. EOS)
    log_prob: float  # sum of the token log-probs, EOS included (fp32 accumulation)
    step_log_probs: list[float] = field(default_factory=list)  # per generated token, EOS included


def hf_rules(rules: str) -> bool:
    """Whether `rules` are transformers' generate's (with either early_stopping)."""
    return rules.startswith("transformers")


def length_penalty(length: Any, alpha: float, rules: str = "fairseq") -> Any:
    """GNMT's lp(Y) = ((5 + |Y|) / 6) ** alpha, or transformers' |Y| ** alpha; alpha 0 turns
    normalisation off."""
    if hf_rules(rules):
        return length ** alpha
    return ((5.0 + length) / 6.0) ** alpha


def max_output_lengths(src_ids: np.ndarray, backend: Backend, max_len_a: float, max_len_b: int) -> np.ndarray:
    """Per sentence, the most tokens (EOS excluded) it may generate: a * src_len + b, where
    src_len counts the source's non-pad tokens (its EOS included), capped so that the
    forced EOS still fits the backend's decoder positions (max_tgt_len)."""
    src_len = (src_ids != backend.cfg.pad_id).sum(axis=1).astype(np.float64)
    limit = np.floor(max_len_a * src_len + max_len_b).astype(np.int64)
    cap = int(backend.max_tgt_len) - 1  # positions 0..max_len: BOS + max_len tokens; EOS at max_len
    return np.clip(limit, 0, cap)


def _source(backend: Backend, src_ids: Any) -> np.ndarray:
    """src_ids as a (batch, src_len) int64 numpy array (torch tensors are accepted too)."""
    array = host(src_ids)
    if array.ndim != 2 or array.dtype != np.int64:
        raise SearchError(f"src_ids must be a (batch, src_len) int64 array, got {tuple(array.shape)} {array.dtype}")
    if not hasattr(backend, "cfg"):
        raise SearchError(f"the {backend.name} backend has no model config (cfg) to take the special ids from")
    if array.shape[1] > backend.max_src_len:
        raise SearchError(f"source of {array.shape[1]} tokens is longer than the {backend.name} "
                          f"backend's limit of {backend.max_src_len}; truncate it first")
    return array


@dataclass
class _Finished:
    """The finalised hypotheses of every sentence, best first once `ranked` is called: the
    first `want` (fairseq), or the best `want` so far (keep_best, transformers)."""

    n_sentences: int
    want: int
    keep_best: bool = False
    hyps: list[list[Hypothesis]] = field(default_factory=list)
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # per sentence, how many held
    top_ended: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # per sentence: a step's best was EOS

    def __post_init__(self) -> None:
        self.hyps = [[] for _ in range(self.n_sentences)]
        self.counts = np.zeros(self.n_sentences, np.int64)
        self.top_ended = np.zeros(self.n_sentences, bool)

    def add(self, sentence: int, hyp: Hypothesis) -> None:
        held = self.hyps[sentence]
        if len(held) < self.want:
            held.append(hyp)
            self.counts[sentence] += 1
        elif self.keep_best:
            worst = min(range(len(held)), key=lambda i: held[i].score)
            if hyp.score > held[worst].score:
                held[worst] = hyp

    def worst(self, sentence: int) -> float:
        return min(h.score for h in self.hyps[sentence])

    def ranked(self, nbest: int) -> list[list[Hypothesis]]:
        return [sorted(h, key=lambda x: -x.score)[:nbest] for h in self.hyps]


def _step_candidates(out_lp: Any, out_ids: Any, eos_lp: Any, n_cand: int, t: int, min_len: int,
                     max_len_rows: np.ndarray, eos: int, rules: str,
                     forced: np.ndarray | None = None, limits: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The rows' first n_cand candidates with min/max length applied: EOS masked before
    min_len, and only EOS at a row's length limit (its true log-prob; 0 under transformers' rules).
    At step 0, `forced` (one id per row) replaces every candidate: that id, log-prob 0. `limits` False: the
    caller knows that no row is at its limit yet."""
    lp = host(out_lp)[:, :n_cand].astype(np.float32, copy=False)  # the step's own arrays: nothing else writes
    ids = host(out_ids)[:, :n_cand].astype(np.int64, copy=False)
    if t == 0 and forced is not None:
        lp = np.full_like(lp, NEG_INF)
        lp[:, 0] = 0.0
        ids = np.where(np.arange(ids.shape[1])[None, :] == 0, forced[:, None], np.int64(eos))
        return lp, ids
    if t < min_len:
        lp = np.where(ids == eos, np.float32(NEG_INF), lp)
    at_limit = max_len_rows <= t if limits else None  # (N,)
    if at_limit is not None and np.count_nonzero(at_limit):  # (count_nonzero: a C call; .any() goes via Python)
        forced_lp = np.full_like(lp, NEG_INF)
        forced_lp[:, 0] = 0.0 if hf_rules(rules) else host(eos_lp).astype(np.float32)
        lp = np.where(at_limit[:, None], forced_lp, lp)
        ids = np.where(at_limit[:, None], np.int64(eos), ids)
    return lp, ids


def _best(values: np.ndarray, k: int) -> np.ndarray:
    """Per row, the indices of the k largest values, largest first (ties: the lower index first)."""
    return (-values).argsort(axis=1, kind="stable")[:, :k]


def beam_search(backend: Backend, src_ids: Any, *, beam_size: int = PAPER.beam_size,
                alpha: float = PAPER.alpha, max_len_a: float = PAPER.max_len_a,
                max_len_b: int = PAPER.max_len_b, min_len: int = PAPER.min_len,
                nbest: int = PAPER.nbest, rules: str = PAPER.rules,
                first_tokens: Any = None) -> list[list[Hypothesis]]:
    """Batched beam search (defaults: runtime.decoding.PAPER).

    src_ids (B, S) int64 padded with the model's pad id, each row pieces + EOS. Returns, per
    sentence, `nbest` hypotheses best first. first_tokens (B,): each sentence's forced first token.
    """
    src_ids = _source(backend, src_ids)
    first = _first_tokens(first_tokens, src_ids.shape[0])
    if rules not in RULES:
        raise SearchError(f"search rules {rules!r}: choose one of {', '.join(RULES)}")
    if beam_size < 1:
        raise SearchError(f"beam size must be at least 1, got {beam_size}")
    if not 1 <= nbest <= beam_size:
        raise SearchError(f"nbest ({nbest}) must be between 1 and the beam size ({beam_size})")
    n_cand = 2 * beam_size
    if n_cand > backend.topk:
        raise SearchError(f"beam size {beam_size} needs {n_cand} candidates per step but the "
                          f"{backend.name} backend returns only top-{backend.topk}; use a beam of at "
                          f"most {backend.topk // 2} or re-export with a larger --topk")
    n_sent = src_ids.shape[0]
    transformers = hf_rules(rules)
    finished = _Finished(n_sent, beam_size, keep_best=transformers)
    if n_sent == 0:
        return []
    eos = backend.cfg.eos_id
    beam = beam_size
    max_len = max_output_lengths(src_ids, backend, max_len_a, max_len_b)  # (B,)

    state, cache, tokens, reorder, scores, history, history_lp = _start(backend, src_ids, beam)
    sent_ids = np.arange(n_sent, dtype=np.int64)  # original index of each live sentence
    rows_for = 0  # the batch size the row offsets below are for

    live_max = max_len  # (b,) of the live sentences
    row_max, soonest = np.repeat(live_max, beam), int(live_max.min())  # per hypothesis; the first step at a limit
    first_rows = None if first is None else np.repeat(first, beam)
    t = 0
    while sent_ids.size > 0:
        b = sent_ids.size
        out, cache = backend.step(state, tokens, t, cache, reorder)
        lp, ids = _step_candidates(out.topk_log_probs, out.topk_ids, out.eos_log_probs, n_cand, t,
                                   min_len, row_max, eos, rules, first_rows, limits=t >= soonest)
        cum = (scores.reshape(-1, 1) + lp).reshape(b, beam * n_cand)  # fp32
        top_idx = _best(cum, 2 * beam)  # (b, 2beam), best first
        if b != rows_for:  # each sentence's flat row offsets in the candidates, their best and the hypotheses
            rows_for, sentence = b, np.arange(b, dtype=np.int64)[:, None]
            cand_rows, top_rows, sent_rows = sentence * (beam * n_cand), sentence * (2 * beam), sentence * beam
        # Flat indices (row offset added) take in one call what take_along_axis takes in several.
        flat = top_idx + cand_rows
        top_scores, top_tok, top_lp = cum.take(flat), ids.take(flat), lp.take(flat)
        top_beam = top_idx // n_cand
        eos_cand = top_tok == eos
        if not (transformers or np.count_nonzero(eos_cand)):  # the usual step: no EOS among any sentence's best
            # 2 x beam (a sentence at its length limit has only EOS), so nothing is finalised, no sentence ends
            # and the first `beam` go on: what the full path below finds, without its work
            scores, next_beam, next_tok, next_lp = top_scores[:, :beam], top_beam[:, :beam], top_tok[:, :beam], \
                top_lp[:, :beam]
            done = None
        else:
            # Finalise EOS among the first `beam` candidates (the only Python loop, over them); > -inf: finite
            final = eos_cand[:, :beam] & (top_scores[:, :beam] > NEG_INF)
            done = live_max <= t  # at the length limit: finished whatever it holds
            if np.count_nonzero(final):
                _finalise(finished, final, sent_ids, top_beam, top_scores, top_lp, history, history_lp,
                          t, alpha, rules)
            # Continue with the best `beam` non-EOS candidates (a stable sort puts EOS behind all others).
            keep = eos_cand.argsort(axis=1, kind="stable")[:, :beam]
            keep.sort(axis=1)
            keep += top_rows  # (b, beam), flat
            scores, next_beam, next_tok, next_lp = top_scores.take(keep), top_beam.take(keep), top_tok.take(keep), \
                top_lp.take(keep)
            done |= _stopped(finished, sent_ids, finished.counts[sent_ids], scores, beam, t, alpha, rules, nbest)
        # Cache rows (in this step's layout) that each continuing hypothesis extends.
        src_rows = sent_rows + next_beam  # (b, beam)
        history = _extend(history, src_rows, next_tok)
        history_lp = _extend(history_lp, src_rows, next_lp)

        if done is not None and np.count_nonzero(done):
            live = tail_filled(~done)  # holes filled from the end: the caches move the fewest rows
            sent_ids, live_max = sent_ids[live], live_max[live]
            scores, history, history_lp = scores[live], history[live], history_lp[live]
            next_tok, src_rows = next_tok[live], src_rows[live]
            if live.size == 0:
                break
            state = backend.select(state, live)
            row_max, soonest = np.repeat(live_max, beam), int(live_max.min())
        tokens = next_tok.reshape(-1)
        reorder = src_rows.reshape(-1)
        t += 1
    return finished.ranked(nbest)


def _stopped(finished: _Finished, sent_ids: np.ndarray, counts: np.ndarray, scores: np.ndarray, beam: int, t: int,
             alpha: float, rules: str, nbest: int) -> np.ndarray:
    """(b,) the live sentences the stopping rule ends after step t: `beam` finalised hypotheses (fairseq,
    transformers-early), or under transformers' rules those and a best live hypothesis (`scores`, at its
    length now) that cannot beat the worst kept, or under top-beam a step's best candidate ended and `nbest`
    finalised."""
    if rules == "top-beam":
        return finished.top_ended[sent_ids] & (counts >= nbest)
    if rules == "transformers":
        best_live = scores.max(axis=1) / np.float32(length_penalty(float(t + 1), alpha, rules))
        worst = np.array([finished.worst(s) if c else NEG_INF for s, c in zip(sent_ids.tolist(), counts)])
        return (counts >= beam) & (best_live <= worst)
    return counts >= beam


def _start(backend: Backend, src_ids: np.ndarray, beam: int) -> tuple[Any, ...]:
    """A beam search's first state: the encoder state (one row per sentence, shared by its `beam` rows), an
    empty cache, BOS tokens, the identity reorder, scores with only beam 0 live (so step 0's candidates are
    distinct), and empty histories of tokens and their log-probs."""
    n_sent = src_ids.shape[0]
    n_rows = n_sent * beam
    scores = np.full((n_sent, beam), NEG_INF, dtype=np.float32)
    scores[:, 0] = 0.0
    return (backend.encode(src_ids), backend.initial_cache(n_rows),
            np.full(n_rows, backend.cfg.bos_id, dtype=np.int64), np.arange(n_rows, dtype=np.int64), scores,
            np.empty((n_sent, beam, 0), dtype=np.int64), np.empty((n_sent, beam, 0), dtype=np.float32))


def _first_tokens(first_tokens: Any, n_sent: int) -> np.ndarray | None:
    """first_tokens as (n_sent,) int64, or None when no token is forced."""
    if first_tokens is None:
        return None
    first = np.asarray(first_tokens, dtype=np.int64).reshape(-1)
    if first.shape != (n_sent,):
        raise SearchError(f"first_tokens has {first.size} ids for {n_sent} sentences")
    return first


def _extend(history: np.ndarray, src_rows: np.ndarray, new: np.ndarray) -> np.ndarray:
    """(b, beam, t) histories of the rows continued (src_rows, flat over this step's b x beam),
    each extended by its new entry: (b, beam, t + 1)."""
    b, beam, t = history.shape
    grown = np.empty((b, beam, t + 1), dtype=history.dtype)
    grown[:, :, :t] = history.reshape(b * beam, t)[src_rows]
    grown[:, :, t] = new
    return grown


def _finalise(finished: _Finished, final: np.ndarray, sent_ids: np.ndarray, top_beam: np.ndarray,
              top_scores: np.ndarray, top_lp: np.ndarray, history: np.ndarray, history_lp: np.ndarray,
              t: int, alpha: float, rules: str) -> None:
    """Record the EOS candidates marked in `final` (b, beam; column 0 the step's best) as finished hypotheses."""
    finished.top_ended[sent_ids[final[:, 0]]] = True  # top-beam's rule: the step's best candidate ended
    length = t + 1  # generated tokens, EOS included
    norm = (top_scores / np.float32(length_penalty(float(length), alpha, rules))).astype(np.float32)
    for i, j in zip(*np.nonzero(final)):  # row-major: within a sentence, best candidate first
        k = top_beam[i, j]
        hyp = Hypothesis(tokens=history[i, k].tolist(), score=float(norm[i, j]), log_prob=float(top_scores[i, j]),
                         step_log_probs=history_lp[i, k].tolist() + [float(top_lp[i, j])])
        finished.add(int(sent_ids[i]), hyp)


def greedy_search(backend: Backend, src_ids: Any, *, max_len_a: float = PAPER.max_len_a,
                  max_len_b: int = PAPER.max_len_b, min_len: int = PAPER.min_len,
                  alpha: float = PAPER.alpha, rules: str = PAPER.rules,
                  first_tokens: Any = None) -> list[list[Hypothesis]]:
    """Greedy decoding: each step takes the best candidate (the best non-EOS one before
    min_len). One hypothesis per sentence; `score` uses the same length penalty as beam
    search, so beam 1 and greedy agree on everything. first_tokens as beam_search's."""
    src_ids = _source(backend, src_ids)
    first = _first_tokens(first_tokens, src_ids.shape[0])
    if min_len > 0 and backend.topk < 2:
        raise SearchError("min_len needs at least 2 candidates per step; re-export with --topk >= 2")
    n_sent = src_ids.shape[0]
    if n_sent == 0:
        return []
    eos = backend.cfg.eos_id
    max_len = max_output_lengths(src_ids, backend, max_len_a, max_len_b)
    state = backend.encode(src_ids)
    cache = backend.initial_cache(n_sent)
    tokens = np.full(n_sent, backend.cfg.bos_id, dtype=np.int64)
    reorder = np.arange(n_sent, dtype=np.int64)
    sent_ids = np.arange(n_sent, dtype=np.int64)
    total = np.zeros(n_sent, dtype=np.float32)
    history = np.empty((n_sent, 0), dtype=np.int64)
    history_lp = np.empty((n_sent, 0), dtype=np.float32)
    results: list[list[Hypothesis]] = [[] for _ in range(n_sent)]
    t = 0
    while sent_ids.size > 0:
        out, cache = backend.step(state, tokens, t, cache, reorder)
        n_cand = min(2, host(out.topk_ids).shape[1])
        lp, ids = _step_candidates(out.topk_log_probs, out.topk_ids, out.eos_log_probs, n_cand, t,
                                   min_len, max_len[sent_ids], eos, rules, first)
        best = lp.argmax(axis=1)[:, None]  # first maximum: the backend's own order
        tok = np.take_along_axis(ids, best, axis=1)[:, 0]
        tok_lp = np.take_along_axis(lp, best, axis=1)[:, 0]
        total = total + tok_lp
        history = np.concatenate([history, tok[:, None]], axis=1)
        history_lp = np.concatenate([history_lp, tok_lp[:, None]], axis=1)
        done = tok == eos
        if done.any():
            norm = total / np.float32(length_penalty(float(t + 1), alpha, rules))
            for i in np.flatnonzero(done).tolist():
                results[int(sent_ids[i])] = [Hypothesis(
                    tokens=history[i, :-1].tolist(), score=float(norm[i]), log_prob=float(total[i]),
                    step_log_probs=history_lp[i].tolist())]
            live = np.flatnonzero(~done)
            sent_ids, total = sent_ids[live], total[live]
            history, history_lp, tok = history[live], history_lp[live], tok[live]
            if live.size == 0:
                break
            state = backend.select(state, live)
            reorder = live
        else:
            reorder = np.arange(sent_ids.size, dtype=np.int64)
        tokens = tok
        t += 1
    return results


def search(backend: Backend, src_ids: Any, options: DecodingOptions = PAPER,
           first_tokens: Any = None) -> list[list[Hypothesis]]:
    """One padded batch decoded as `options` says: greedy search for beam 1 (same results,
    less work), beam search otherwise. options.batch_tokens is the caller's business;
    first_tokens: each sentence's forced first token (a multilingual model's target language)."""
    src_ids = _source(backend, src_ids)  # checked once: what follows takes it as it is
    on_device = backend.search_on_device(src_ids, options, first_tokens)
    if on_device is not None:
        return on_device  # the same hypotheses, several steps per device round trip (runtime/device_search.py)
    if options.beam_size == 1:
        return greedy_search(backend, src_ids, max_len_a=options.max_len_a, max_len_b=options.max_len_b,
                             min_len=options.min_len, alpha=options.alpha, rules=options.rules,
                             first_tokens=first_tokens)
    return beam_search(backend, src_ids, **options.search_kwargs(), first_tokens=first_tokens)

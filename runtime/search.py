"""Beam search and greedy search, written once over the Backend protocol.

The search is fairseq's, vectorised over batch x beam: every step asks the backend for
its rows' top-K candidates, adds them to the hypotheses' cumulative log-probs (fp32),
takes each sentence's best 2 * beam, finalises the EOS candidates among the first
`beam` of them with the GNMT length penalty (Wu et al., 2016)

    score = log_prob / ((5 + length) / 6) ** alpha      (length counts the EOS)

and continues with the best `beam` non-EOS candidates. A sentence is finished when it
holds `beam` finalised hypotheses or reaches its length limit, where EOS is forced with
the step's EOS log-probs. Finished sentences leave the batch (backend.select on the
encoder state, a shorter `reorder` on the cache), so steps shrink as sentences end.
Every live sentence keeps exactly `beam` rows (at step 0 too, where only beam 0 scores),
because the encoder state has one row per sentence, shared by its beam's rows.

Search never touches cache tensors: it hands the backend, for each hypothesis of the
next step, the row of the previous cache it continues (`reorder`). The only Python
loop per step runs over the hypotheses finalised in that step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor

from model.config import BOS_ID, EOS_ID, PAD_ID
from runtime.backend import Backend
from runtime.decoding import PAPER, DecodingOptions
from runtime.errors import RuntimeUserError

log = logging.getLogger(__name__)

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


def length_penalty(length: float | Tensor, alpha: float) -> float | Tensor:
    """GNMT's lp(Y) = ((5 + |Y|) / 6) ** alpha; alpha 0 turns normalisation off."""
    return ((5.0 + length) / 6.0) ** alpha


def max_output_lengths(src_ids: Tensor, backend: Backend, max_len_a: float, max_len_b: int) -> Tensor:
    """Per sentence, the most tokens (EOS excluded) it may generate: a * src_len + b, where
    src_len counts the source's non-pad tokens (its EOS included), capped so that the
    forced EOS still fits the backend's decoder positions (max_tgt_len)."""
    src_len = src_ids.ne(PAD_ID).sum(dim=1).double()
    limit = (max_len_a * src_len + max_len_b).floor().long()
    cap = int(backend.max_tgt_len) - 1  # positions 0..max_len: BOS + max_len tokens; EOS at max_len
    return limit.clamp(min=0, max=cap)


def _check_source(backend: Backend, src_ids: Tensor) -> None:
    if src_ids.dim() != 2 or src_ids.dtype != torch.int64:
        raise SearchError(f"src_ids must be a (batch, src_len) int64 tensor, got "
                          f"{tuple(src_ids.shape)} {src_ids.dtype}")
    if src_ids.shape[1] > backend.max_src_len:
        raise SearchError(f"source of {src_ids.shape[1]} tokens is longer than the {backend.name} "
                          f"backend's limit of {backend.max_src_len}; truncate it first")


@dataclass
class _Finished:
    """The finalised hypotheses of every sentence, best first once `ranked` is called."""

    n_sentences: int
    want: int
    hyps: list[list[Hypothesis]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.hyps = [[] for _ in range(self.n_sentences)]

    def add(self, sentence: int, hyp: Hypothesis) -> None:
        if len(self.hyps[sentence]) < self.want:
            self.hyps[sentence].append(hyp)

    def count(self, sentence: int) -> int:
        return len(self.hyps[sentence])

    def ranked(self, nbest: int) -> list[list[Hypothesis]]:
        return [sorted(h, key=lambda x: -x.score)[:nbest] for h in self.hyps]


def _step_candidates(out_lp: Tensor, out_ids: Tensor, eos_lp: Tensor, n_cand: int, t: int,
                     min_len: int, max_len_rows: Tensor) -> tuple[Tensor, Tensor]:
    """The rows' first n_cand candidates with min/max length applied: EOS masked before
    min_len, and only EOS (with its true log-prob) at a row's length limit."""
    lp = out_lp[:, :n_cand].float()
    ids = out_ids[:, :n_cand].long()
    if t < min_len:
        lp = lp.masked_fill(ids.eq(EOS_ID), NEG_INF)
    at_limit = max_len_rows.le(t)  # (N,)
    if bool(at_limit.any()):
        forced_lp = torch.full_like(lp, NEG_INF)
        forced_lp[:, 0] = eos_lp.float()
        forced_ids = torch.full_like(ids, EOS_ID)
        lp = torch.where(at_limit[:, None], forced_lp, lp)
        ids = torch.where(at_limit[:, None], forced_ids, ids)
    return lp, ids


@torch.inference_mode()
def beam_search(backend: Backend, src_ids: Tensor, *, beam_size: int = PAPER.beam_size,
                alpha: float = PAPER.alpha, max_len_a: float = PAPER.max_len_a,
                max_len_b: int = PAPER.max_len_b, min_len: int = PAPER.min_len,
                nbest: int = PAPER.nbest) -> list[list[Hypothesis]]:
    """Batched beam search (defaults: runtime.decoding.PAPER).

    src_ids (B, S) int64 padded with PAD_ID, each row pieces + EOS. Returns, per sentence,
    `nbest` hypotheses best first.
    """
    _check_source(backend, src_ids)
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
    finished = _Finished(n_sent, beam_size)
    if n_sent == 0:
        return []
    dev = backend.device
    beam = beam_size
    max_len = max_output_lengths(src_ids, backend, max_len_a, max_len_b).to(dev)  # (B,)

    state = backend.encode(src_ids)  # one row per sentence, shared by its `beam` rows
    n_rows = n_sent * beam
    cache = backend.initial_cache(n_rows)
    tokens = torch.full((n_rows,), BOS_ID, dtype=torch.long, device=dev)
    reorder = torch.arange(n_rows, device=dev)
    # Step 0: only beam 0 of each sentence is live, so the first candidates are distinct.
    scores = torch.full((n_sent, beam), NEG_INF, dtype=torch.float32, device=dev)
    scores[:, 0] = 0.0
    history = torch.empty((n_sent, beam, 0), dtype=torch.long, device=dev)
    history_lp = torch.empty((n_sent, beam, 0), dtype=torch.float32, device=dev)
    sent_ids = torch.arange(n_sent, device=dev)  # original index of each live sentence
    cand_pos = torch.arange(2 * beam, device=dev)

    t = 0
    while sent_ids.numel() > 0:
        b = sent_ids.numel()
        out, cache = backend.step(state, tokens, t, cache, reorder)
        rows_max = max_len[sent_ids].repeat_interleave(beam)
        lp, ids = _step_candidates(out.topk_log_probs, out.topk_ids, out.eos_log_probs, n_cand, t,
                                   min_len, rows_max)
        cum = (scores.view(-1, 1) + lp).view(b, beam * n_cand)  # fp32
        top_scores, top_idx = cum.topk(2 * beam, dim=1)  # (b, 2beam), best first
        top_beam = torch.div(top_idx, n_cand, rounding_mode="floor")
        top_tok = ids.reshape(b, beam * n_cand).gather(1, top_idx)
        top_lp = lp.reshape(b, beam * n_cand).gather(1, top_idx)
        is_eos = top_tok.eq(EOS_ID) & torch.isfinite(top_scores)

        # Finalise EOS among the first `beam` candidates (the only Python loop, over them).
        final = is_eos & cand_pos.lt(beam)
        done = max_len[sent_ids].le(t)  # at the length limit: finished whatever it holds
        if bool(final.any()):
            _finalise(finished, final, sent_ids, top_beam, top_scores, top_lp, history, history_lp,
                      t, alpha)
            counts = torch.tensor([finished.count(s) for s in sent_ids.tolist()], device=dev)
            done = done | counts.ge(beam)

        # Continue with the best `beam` non-EOS candidates (EOS pushed behind all others).
        rank = top_tok.eq(EOS_ID).long() * (2 * beam) + cand_pos
        keep_pos = rank.topk(beam, dim=1, largest=False).indices.sort(dim=1).values  # (b, beam)
        scores = top_scores.gather(1, keep_pos)
        next_beam = top_beam.gather(1, keep_pos)
        next_tok = top_tok.gather(1, keep_pos)
        next_lp = top_lp.gather(1, keep_pos)
        history = torch.cat([history.gather(1, next_beam[..., None].expand(-1, -1, t)),
                             next_tok[..., None]], dim=2)
        history_lp = torch.cat([history_lp.gather(1, next_beam[..., None].expand(-1, -1, t)),
                                next_lp[..., None]], dim=2)
        # Cache rows (in this step's layout) that each continuing hypothesis extends.
        src_rows = torch.arange(b, device=dev)[:, None] * beam + next_beam  # (b, beam)

        if bool(done.any()):
            live = (~done).nonzero().squeeze(1)
            sent_ids = sent_ids[live]
            scores, history, history_lp = scores[live], history[live], history_lp[live]
            next_tok, src_rows = next_tok[live], src_rows[live]
            if live.numel() == 0:
                break
            state = backend.select(state, live)
        tokens = next_tok.reshape(-1)
        reorder = src_rows.reshape(-1)
        t += 1
    return finished.ranked(nbest)


def _finalise(finished: _Finished, final: Tensor, sent_ids: Tensor, top_beam: Tensor,
              top_scores: Tensor, top_lp: Tensor, history: Tensor, history_lp: Tensor,
              t: int, alpha: float) -> None:
    """Record the EOS candidates marked in `final` (b, 2beam) as finished hypotheses."""
    length = t + 1  # generated tokens, EOS included
    norm = (top_scores / length_penalty(float(length), alpha)).float()
    where = final.nonzero().tolist()  # row-major: within a sentence, best candidate first
    beams = top_beam.tolist()
    raw, normed, eos_lp = top_scores.tolist(), norm.tolist(), top_lp.tolist()
    for i, j in where:
        k = beams[i][j]
        hyp = Hypothesis(tokens=history[i, k].tolist(), score=normed[i][j], log_prob=raw[i][j],
                         step_log_probs=history_lp[i, k].tolist() + [eos_lp[i][j]])
        finished.add(int(sent_ids[i]), hyp)


@torch.inference_mode()
def greedy_search(backend: Backend, src_ids: Tensor, *, max_len_a: float = PAPER.max_len_a,
                  max_len_b: int = PAPER.max_len_b, min_len: int = PAPER.min_len,
                  alpha: float = PAPER.alpha) -> list[list[Hypothesis]]:
    """Greedy decoding: each step takes the best candidate (the best non-EOS one before
    min_len). One hypothesis per sentence; `score` uses the same length penalty as beam
    search, so beam 1 and greedy agree on everything."""
    _check_source(backend, src_ids)
    if min_len > 0 and backend.topk < 2:
        raise SearchError("min_len needs at least 2 candidates per step; re-export with --topk >= 2")
    n_sent = src_ids.shape[0]
    if n_sent == 0:
        return []
    dev = backend.device
    max_len = max_output_lengths(src_ids, backend, max_len_a, max_len_b).to(dev)
    state = backend.encode(src_ids)
    cache = backend.initial_cache(n_sent)
    tokens = torch.full((n_sent,), BOS_ID, dtype=torch.long, device=dev)
    reorder = torch.arange(n_sent, device=dev)
    sent_ids = torch.arange(n_sent, device=dev)
    total = torch.zeros(n_sent, dtype=torch.float32, device=dev)
    history = torch.empty((n_sent, 0), dtype=torch.long, device=dev)
    history_lp = torch.empty((n_sent, 0), dtype=torch.float32, device=dev)
    results: list[list[Hypothesis]] = [[] for _ in range(n_sent)]
    t = 0
    while sent_ids.numel() > 0:
        out, cache = backend.step(state, tokens, t, cache, reorder)
        n_cand = min(2, out.topk_ids.shape[1])
        lp, ids = _step_candidates(out.topk_log_probs, out.topk_ids, out.eos_log_probs, n_cand, t,
                                   min_len, max_len[sent_ids])
        best = lp.argmax(dim=1, keepdim=True)  # first maximum: the backend's own order
        tok = ids.gather(1, best).squeeze(1)
        tok_lp = lp.gather(1, best).squeeze(1)
        total = total + tok_lp
        history = torch.cat([history, tok[:, None]], dim=1)
        history_lp = torch.cat([history_lp, tok_lp[:, None]], dim=1)
        done = tok.eq(EOS_ID)
        if bool(done.any()):
            norm = total / length_penalty(float(t + 1), alpha)
            for i in done.nonzero().squeeze(1).tolist():
                results[int(sent_ids[i])] = [Hypothesis(
                    tokens=history[i, :-1].tolist(), score=float(norm[i]), log_prob=float(total[i]),
                    step_log_probs=history_lp[i].tolist())]
            live = (~done).nonzero().squeeze(1)
            sent_ids, total = sent_ids[live], total[live]
            history, history_lp, tok = history[live], history_lp[live], tok[live]
            if live.numel() == 0:
                break
            state = backend.select(state, live)
            reorder = live
        else:
            reorder = torch.arange(sent_ids.numel(), device=dev)
        tokens = tok
        t += 1
    return results


def search(backend: Backend, src_ids: Tensor, options: DecodingOptions = PAPER) -> list[list[Hypothesis]]:
    """One padded batch decoded as `options` says: greedy search for beam 1 (same results,
    less work), beam search otherwise. options.batch_tokens is the caller's business."""
    if options.beam_size == 1:
        return greedy_search(backend, src_ids, max_len_a=options.max_len_a, max_len_b=options.max_len_b,
                             min_len=options.min_len, alpha=options.alpha)
    return beam_search(backend, src_ids, **options.search_kwargs())

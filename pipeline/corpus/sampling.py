"""SentencePiece subword regularisation (Kudo 2018) for training batches only.

Each training batch's raw sentences are re-encoded by sampling one of their n best segmentations
(SentencePiece's deterministic n-best), with probability in proportion to exp(alpha * log-probability),
as SentencePiece's own n-best sampling draws. The draw is ours, from a generator seeded with
(seed, epoch, batch number) alone, so a batch gets the same segmentation in whichever process makes it
and however often the run was resumed: exact resume and "N processes == one process" hold with
sampling on. SentencePiece's own sampler does not give that: seeded alike, two processes draw
differently (sentencepiece 0.2.3), so it is not used, and neither is its sampling from the whole
lattice (nbest -1), which has no deterministic counterpart. Validation, export and serving never
sample: they use the tokenizer's deterministic encoding.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

import numpy as np
import sentencepiece as spm

from model.errors import UserError
from pipeline.corpus.data import EncodedCorpus


class SubwordSampler:
    """Makes a batch's (source, target) piece ids by sampling segmentations of its text."""

    def __init__(self, spm_bytes: bytes, corpus: EncodedCorpus, lines: tuple[list[str], list[str]],
                 alpha: float, nbest: int, max_len: int):
        if corpus.rows is None:
            raise UserError("the encoded-corpus cache predates subword sampling; delete the save dir's "
                            "cache/ folder and rerun")
        if nbest < 1:
            raise UserError(f"--spm-nbest {nbest}: sampling needs a number of segmentations, 1 or more (such as 64)")
        self.sp = spm.SentencePieceProcessor(model_proto=spm_bytes)
        self.scores = [self.sp.get_score(i) for i in range(self.sp.get_piece_size())]  # log-probabilities
        self.corpus, self.lines, self.alpha, self.nbest = corpus, lines, alpha, nbest
        self.max_pieces = max_len - 1  # EOS / BOS take the last place, as in the length filter

    def __call__(self, indices: np.ndarray, key: tuple[int, int, int]) -> tuple[list[Any], list[Any]]:
        assert self.corpus.rows is not None
        rows = self.corpus.rows[indices]
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(key))))
        sides = []
        for text, fallback in ((self.lines[0], self.corpus.src), (self.lines[1], self.corpus.tgt)):
            sampled = [self._draw(candidates, rng) for candidates in
                       self.sp.nbest_encode([text[r] for r in rows], out_type=int, nbest_size=self.nbest)]
            # A sampled segmentation is longer than the best one; one past --max-len (or empty)
            # falls back to the deterministic encoding the length filter accepted.
            sides.append([ids if 0 < len(ids) <= self.max_pieces else fallback(i)
                          for ids, i in zip(sampled, indices)])
        return sides[0], sides[1]

    def _draw(self, candidates: list[list[int]], rng: np.random.Generator) -> list[int]:
        """One of a sentence's n best segmentations, drawn in proportion to exp(alpha * its log-probability)
        (plain Python: per sentence, numpy's overhead is most of the work)."""
        if len(candidates) < 2:
            return candidates[0] if candidates else []
        score, alpha = self.scores.__getitem__, self.alpha
        logp = [alpha * sum(map(score, ids)) for ids in candidates]
        top, total, cumulative = max(logp), 0.0, []
        for value in logp:
            total += math.exp(value - top)
            cumulative.append(total)
        return candidates[min(bisect.bisect_right(cumulative, rng.random() * total), len(candidates) - 1)]

"""SentencePiece subword regularisation (Kudo 2018) for training batches only.

Each training batch's raw sentences are re-encoded with SentencePiece sampling when the
batch is made. The sampler is seeded from (seed, epoch, batch number) alone, so a batch
gets the same segmentation whichever rank makes it and however often the run was resumed:
exact resume and "N processes == one process" hold with sampling on. Validation, export
and serving never sample: they use the tokenizer's deterministic encoding.
"""

from __future__ import annotations

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
        self.sp = spm.SentencePieceProcessor(model_proto=spm_bytes)
        self.corpus, self.lines, self.alpha, self.nbest = corpus, lines, alpha, nbest
        self.max_pieces = max_len - 1  # EOS / BOS take the last place, as in the length filter

    def __call__(self, indices: np.ndarray, key: tuple[int, int, int]) -> tuple[list[Any], list[Any]]:
        assert self.corpus.rows is not None
        rows = self.corpus.rows[indices]
        # SentencePiece draws from one global generator; one thread keeps the draws in order.
        spm.set_random_generator_seed(int(np.random.SeedSequence(list(key)).generate_state(1)[0]))
        sides = []
        for text, fallback in ((self.lines[0], self.corpus.src), (self.lines[1], self.corpus.tgt)):
            sampled = self.sp.encode([text[r] for r in rows], out_type=int, enable_sampling=True,
                                     alpha=self.alpha, nbest_size=self.nbest, num_threads=1)
            # A sampled segmentation is longer than the best one; one past --max-len (or empty)
            # falls back to the deterministic encoding the length filter accepted.
            sides.append([ids if 0 < len(ids) <= self.max_pieces else fallback(i)
                          for ids, i in zip(sampled, indices)])
        return sides[0], sides[1]

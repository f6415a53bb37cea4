"""Subword sampling's cost: SentencePiece's own n-best sampling against pipeline's (SentencePiece's deterministic
n-best, then our seeded draw: pipeline/corpus/sampling.py), one side of a corpus, alternating, one thread.

    python scripts/sampler_speed.py SPM_MODEL TEXT_FILE [--lines 4000] [--nbest 64] [--alpha 0.1]

Prints microseconds a sentence for each and their ratio, three rounds."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import sentencepiece as spm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline.corpus.sampling import SubwordSampler  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("text")
    ap.add_argument("--lines", type=int, default=4000)
    ap.add_argument("--nbest", type=int, default=64)
    ap.add_argument("--alpha", type=float, default=0.1)
    args = ap.parse_args()
    sp = spm.SentencePieceProcessor(model_file=args.model)
    lines = Path(args.text).read_text(encoding="utf-8").splitlines()[:args.lines]
    ours = SubwordSampler.__new__(SubwordSampler)  # only what _draw reads: no corpus needed
    ours.scores, ours.alpha = [sp.get_score(i) for i in range(sp.get_piece_size())], args.alpha
    print(f"{len(lines)} lines, {sp.get_piece_size()} pieces, nbest {args.nbest}, alpha {args.alpha}")
    for _ in range(3):
        started = time.perf_counter()
        spm.set_random_generator_seed(1)
        sp.encode(lines, out_type=int, enable_sampling=True, alpha=args.alpha, nbest_size=args.nbest, num_threads=1)
        theirs = time.perf_counter() - started
        started = time.perf_counter()
        rng = np.random.Generator(np.random.PCG64(1))
        for candidates in sp.nbest_encode(lines, out_type=int, nbest_size=args.nbest):
            ours._draw(candidates, rng)
        mine = time.perf_counter() - started
        print(f"sentencepiece {theirs * 1e6 / len(lines):.0f} us/sentence, pipeline {mine * 1e6 / len(lines):.0f} "
              f"us/sentence: {mine / theirs:.1f}x")


if __name__ == "__main__":
    main()

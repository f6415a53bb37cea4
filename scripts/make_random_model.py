#!/usr/bin/env python
"""A random-weight checkpoint of a preset shape with a real SentencePiece model of the asked
vocabulary, for speed measurements of a shape (no training): export it, then bench it.

    python scripts/make_random_model.py base.pt --preset base --vocab-size 32000
    pipeline export base.pt --out models/base-fp32 --no-tensorrt
    pipeline export base.pt --out models/base-int8 --int8 --no-tensorrt
    pipeline bench models/base-fp32 models/base-int8 --compare ctranslate2 --batch-size 32 \
        --beam-size 4 --fixed-length 30 --threads 2 --json bench-base.json
"""

from __future__ import annotations

import argparse
import random
import string
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import build_model, preset  # noqa: E402
from model.checkpoint import save_checkpoint  # noqa: E402
from pipeline.corpus.spm import train_sentencepiece  # noqa: E402
from runtime.tokenizer import Tokenizer  # noqa: E402


def made_up_text(vocab_size: int, seed: int = 0) -> list[str]:
    """Sentences over ~2 x vocab_size distinct made-up words: enough for the pieces asked."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 9))) for _ in range(2 * vocab_size)]
    return [" ".join(rng.choices(words, k=12)) for _ in range(max(20_000, 4 * vocab_size))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", default="base")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    spm_bytes = train_sentencepiece(made_up_text(args.vocab_size, args.seed), args.vocab_size)
    torch.manual_seed(args.seed)
    model = build_model(preset(args.preset, vocab_size=Tokenizer(spm_bytes).vocab_size)).eval()
    save_checkpoint(args.out, model, spm_bytes)
    print(f"{args.out}: random {args.preset} model, vocab {model.cfg.vocab_size}")


if __name__ == "__main__":
    main()

"""A random-weight checkpoint of any preset shape, with a real SentencePiece model of the asked
vocabulary: speed and memory of a shape can be measured without training it
(`pipeline random-checkpoint`, then `pipeline export` and `pipeline bench`)."""

from __future__ import annotations

import random
import string
from pathlib import Path

import torch

from model import build_model, preset
from model.checkpoint import save_checkpoint
from pipeline.corpus.spm import train_sentencepiece
from runtime.tokenizer import Tokenizer


def made_up_text(vocab_size: int, seed: int = 0) -> list[str]:
    """Sentences over ~2 x vocab_size distinct made-up words: enough for the pieces asked."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 9))) for _ in range(2 * vocab_size)]
    return [" ".join(rng.choices(words, k=12)) for _ in range(max(20_000, 4 * vocab_size))]


def make_random_checkpoint(out: Path, preset_name: str, vocab_size: int, seed: int = 0,
                           decoder_layers: int | None = None) -> int:
    """Write the checkpoint (atomically, checksummed like any other); returns its vocabulary size.
    The seed fixes the weights for a given shape; export one checkpoint several times to compare precisions.
    `decoder_layers`: the preset's decoder that many layers deep instead (a student's shape)."""
    spm_bytes = train_sentencepiece(made_up_text(vocab_size, seed), vocab_size)
    torch.manual_seed(seed)
    model = build_model(preset(preset_name, vocab_size=Tokenizer(spm_bytes).vocab_size,
                               n_dec_layers=decoder_layers)).eval()
    save_checkpoint(out, model, spm_bytes)
    return model.cfg.vocab_size

"""Shared fixtures: tiny corpora, tokenizers and checkpoints made in tmp, never downloaded."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from model import build_model, preset
from model.checkpoint import save_checkpoint
from pipeline.spm import train_sentencepiece

WORDS_SRC = "der die das ein eine katze hund mann frau kind sieht hat rot blau gross klein".split()
WORDS_TGT = "the a cat dog man woman child sees has red blue big small house tree car".split()


def make_parallel(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """A small made-up parallel corpus (word-for-word with reversal), for tokenizer fixtures."""
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        k = rng.randint(2, 6)
        idx = [rng.randrange(len(WORDS_SRC)) for _ in range(k)]
        src.append(" ".join(WORDS_SRC[i] for i in idx))
        tgt.append(" ".join(WORDS_TGT[i] for i in reversed(idx)))
    return src, tgt


@pytest.fixture(scope="session")
def tiny_corpus() -> tuple[list[str], list[str]]:
    return make_parallel(200)


@pytest.fixture(scope="session")
def spm_bytes(tiny_corpus) -> bytes:
    src, tgt = tiny_corpus
    return train_sentencepiece(src + tgt, vocab_size=64)


@pytest.fixture(scope="session")
def random_checkpoint(tmp_path_factory, spm_bytes) -> Path:
    """A tiny untrained model saved as a checkpoint file (for export/runtime mechanics)."""
    from runtime.tokenizer import Tokenizer

    torch.manual_seed(0)
    cfg = preset("tiny", vocab_size=Tokenizer(spm_bytes).vocab_size)
    model = build_model(cfg).eval()
    path = tmp_path_factory.mktemp("ckpt") / "random.pt"
    save_checkpoint(path, model, spm_bytes)
    return path

"""A random-weight checkpoint of any preset shape, with a real SentencePiece model of the asked
vocabulary: speed and memory of a shape can be measured without training it
(`pipeline random-checkpoint`, then `pipeline export` and `pipeline bench`)."""

from __future__ import annotations

import contextlib
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from model import build_model, preset
from model.checkpoint import save_checkpoint
from model.config import MAX_VOCAB, PRESETS
from model.errors import UserError
from pipeline.corpus.spm import train_sentencepiece
from runtime.fields import Checked, at_least, opt
from runtime.tokenizer import Tokenizer

# the made-up text's 26 letters and the word boundary are each a piece, with the 4 special ones
MIN_VOCAB = 31


@dataclass(frozen=True)
class RandomCheckpointOptions(Checked):
    """`pipeline random-checkpoint`'s options (its command line is generated from these fields): the shape, the
    vocabulary and the seed of the random model, and whether to replace OUT."""

    error = UserError

    preset: str = opt("base", "Model shape (model/config.py's preset table).", choices=tuple(PRESETS))
    vocab_size: int = opt(32000, "Vocabulary of the SentencePiece model trained on made-up text (a soft limit).",
                          min=MIN_VOCAB, max=MAX_VOCAB)
    seed: int = opt(0, "Seed of the made-up text and of the weights (the same seed and shape give the same weights).",
                    min=0, max=2 ** 32 - 1)
    decoder_layers: int | None = opt(None, "Decoder layers instead of the preset's (e.g. a 1-layer student's shape).",
                                     min=1)
    force: bool = opt(False, "Replace OUT if it exists.")

    def problems(self, name: Callable[[str], str] | None = None) -> list[str]:
        n = name or self.flag
        out = [] if self.preset in PRESETS else [f"{n('preset')} {self.preset!r}: choose one of {', '.join(PRESETS)}"]
        return out + at_least(self.vocab_size, MIN_VOCAB, "vocab_size", n) + at_least(self.decoder_layers, 1,
                                                                                       "decoder_layers", n)


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
    shape = preset(preset_name, vocab_size=vocab_size, n_dec_layers=decoder_layers)  # its checks before SentencePiece
    need, free = 5 * shape.approx_parameters(), available_memory()  # fp32 weights (saving streams them), + 25%
    if free is not None and need > free:  # else it allocated until the kernel's OOM killer, or a traceback
        raise UserError(f"the {preset_name} shape{f' with {decoder_layers} decoder layers' if decoder_layers else ''}"
                        f" has about {shape.approx_parameters():.3g} parameters, {need / 1e9:.1f} GB to build and "
                        f"save in fp32, more than the {free / 1e9:.1f} GB of memory available; choose a smaller one")
    spm_bytes = train_sentencepiece(made_up_text(vocab_size, seed), vocab_size)
    torch.manual_seed(seed)
    model = build_model(preset(preset_name, vocab_size=Tokenizer(spm_bytes).vocab_size,
                               n_dec_layers=decoder_layers)).eval()
    save_checkpoint(out, model, spm_bytes)
    return model.cfg.vocab_size


def available_memory() -> int | None:
    """The bytes a new allocation may take: Linux's MemAvailable, within the cgroup's memory.max less its use (a
    container's limit, which MemAvailable does not see); None where neither is known."""
    found = []
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    return min(found) if found else None

"""SentencePiece in and out, with the project's fixed special ids (model.config)."""

from __future__ import annotations

from pathlib import Path

import sentencepiece as spm

from model.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from runtime.errors import RuntimeUserError


class TokenizerError(RuntimeUserError):
    """A SentencePiece model this project cannot use (wrong special ids)."""


class Tokenizer:
    """A joint SentencePiece model. Sources are pieces + EOS; targets start from BOS."""

    def __init__(self, model_bytes: bytes):
        self.model_bytes = model_bytes
        self.sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        ids = (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id())
        if ids != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise TokenizerError(f"SentencePiece model has special ids {ids}, expected "
                             f"{(PAD_ID, UNK_ID, BOS_ID, EOS_ID)} (pad, unk, bos, eos)")

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        return cls(Path(path).read_bytes())

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Piece ids without BOS/EOS."""
        return self.sp.encode(texts, out_type=int)

    def encode_source(self, texts: list[str]) -> list[list[int]]:
        """Piece ids + EOS, whole (runtime.translate.encode_sources applies the line policy)."""
        return [ids + [EOS_ID] for ids in self.encode(texts)]

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Text from piece ids; special ids (pad/bos/eos) are dropped."""
        special = {PAD_ID, BOS_ID, EOS_ID}
        return self.sp.decode([[i for i in seq if i not in special] for seq in ids])

"""Text in and out: SentencePiece with the model's special ids.

Two kinds, one interface (vocab_size, encode_source, decode, model_bytes):

- `Tokenizer`: one joint SentencePiece model whose ids are the model's (what `pipeline train`
  makes, with the project's fixed special ids, model.config);
- `VocabTokenizer`: Marian's and M2M-100's (pipeline/importers): a source and a target SentencePiece model
  (M2M-100: one model for both) whose pieces are looked up in one shared vocabulary (vocab.json), as
  transformers' MarianTokenizer and M2M100Tokenizer do. Sources are pieces + EOS with no BOS; a piece missing
  from the vocabulary is UNK; Marian's leading language code such as `>>fra<<` is one token (`code_prefix`;
  M2M-100's and NLLB's tokenizers read it as text). `hidden` tokens (M2M-100's language tokens, <s>) are never
  text: decoding drops them.

A checkpoint and a model dir hold a tokenizer as bytes (`model_bytes`, the model dir's spm.model):
a SentencePiece model, or a bundle of the two models and the vocabulary; `load_tokenizer` tells
them apart by the bundle's first line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import sentencepiece as spm

from model.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from runtime.errors import RuntimeUserError, first_line

BUNDLE_MAGIC = b"pipeline-vocab-tokenizer-v1\n"


class TokenizerError(RuntimeUserError):
    """A SentencePiece model or vocabulary this project cannot use."""


class Tokenizer:
    """A joint SentencePiece model. Sources are pieces + EOS; targets start from BOS."""

    def __init__(self, model_bytes: bytes):
        self.model_bytes = model_bytes
        self.sp = _processor(model_bytes)
        ids = (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id())
        if ids != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise TokenizerError(f"SentencePiece model has special ids {ids}, expected "
                                 f"{(PAD_ID, UNK_ID, BOS_ID, EOS_ID)} (pad, unk, bos, eos)")

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        return cls(Path(path).read_bytes())

    eos_id = EOS_ID
    unk_id = UNK_ID  # what a piece the vocabulary cannot spell becomes (glossaries refuse such terms)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def piece_ids(self) -> list[int]:
        """The ids that are text pieces (no special id)."""
        return [i for i in range(self.vocab_size) if i not in (PAD_ID, UNK_ID, BOS_ID, EOS_ID)]

    def piece(self, i: int) -> str:
        return str(self.sp.id_to_piece(i))

    def piece_id(self, piece: str) -> int:
        return int(self.sp.piece_to_id(piece))

    # One SentencePiece call per text: its list form costs 0.05-0.15 ms a call (a thread pool) however short the
    # list, and surfaces encode and decode a text or a request at a time.
    def encode(self, texts: list[str]) -> list[list[int]]:
        """Piece ids without BOS/EOS."""
        if isinstance(texts, str):  # iterated, it would encode each character as a text
            raise TypeError("Tokenizer.encode takes a list of texts, not one string")
        return [self.sp.encode(text, out_type=int) for text in texts]

    def encode_source(self, texts: list[str]) -> list[list[int]]:
        """Piece ids + EOS, whole (runtime.translate.encode_sources applies the line policy)."""
        return [ids + [EOS_ID] for ids in self.encode(texts)]

    def source_cut(self, text: str, pieces: int) -> int:
        """Where in `text` its first `pieces` source pieces end (what truncation keeps of it): a character offset."""
        return _pieces_end(self.sp, text, pieces)

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Text from piece ids; special ids (pad/bos/eos) are dropped."""
        special = {PAD_ID, BOS_ID, EOS_ID}
        return [self.sp.decode([i for i in seq if i not in special]) for seq in ids]


class VocabTokenizer:
    """Source and target SentencePiece models over one shared piece vocabulary (Marian's; M2M-100's and NLLB's,
    the same model twice). `code_prefix`: a source starting ">>" up to its first "<<" is one token, as
    MarianTokenizer reads a target language's >>fr<<; M2M-100's and NLLB's tokenizers have no such rule (their
    language tokens are put there by runtime/languages.py), and ">>Zitat<<" is text. Unsaid (None): Marian's,
    the tokenizer with no `hidden` tokens (the others hide their language tokens)."""

    def __init__(self, source_spm: bytes, target_spm: bytes, vocab: dict[str, int], *, eos: str = "</s>",
                 unk: str = "<unk>", pad: str = "<pad>", hidden: list[str] | tuple[str, ...] = (),
                 code_prefix: bool | None = None):
        self.source = _processor(source_spm, "source: ")
        self.target = _processor(target_spm, "target: ")
        self.source_spm, self.target_spm = source_spm, target_spm
        self.vocab = dict(vocab)
        wrong = [(piece, i) for piece, i in self.vocab.items()
                 if not isinstance(piece, str) or not isinstance(i, int) or isinstance(i, bool)]
        if wrong:
            raise TokenizerError(f"the vocabulary maps {wrong[0][0]!r} to {wrong[0][1]!r}; every entry must map a "
                                 f"piece to an integer id ({len(wrong)} do not)")
        self.specials = {"eos": eos, "unk": unk, "pad": pad}
        missing = [token for token in (eos, unk, pad) if token not in self.vocab]
        if missing:
            raise TokenizerError(f"the vocabulary has no {', '.join(missing)}")
        gap = id_gap(self.vocab.values())
        if gap:
            raise TokenizerError(f"the vocabulary's ids are not 0..{len(self.vocab) - 1} without gaps or repeats "
                                 f"({gap})")
        self.pieces = {i: piece for piece, i in self.vocab.items()}
        self.eos_id, self.unk_id, self.pad_id = (self.vocab[t] for t in (eos, unk, pad))
        unknown = [token for token in hidden if token not in self.vocab]
        if unknown:
            raise TokenizerError(f"the vocabulary has no {unknown[0]!r} (a token decoding must drop)")
        self.hidden = tuple(hidden)
        self.code_prefix = not self.hidden if code_prefix is None else code_prefix
        self.dropped = {self.eos_id, self.pad_id, self.unk_id} | {self.vocab[t] for t in self.hidden}
        self.language_codes = {p for p in self.vocab if p.startswith(">>") and p.endswith("<<")}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def piece_ids(self) -> list[int]:
        """The ids that are text pieces (no special id)."""
        return [i for i in range(self.vocab_size) if i not in self.dropped]

    def piece(self, i: int) -> str:
        return self.pieces[i]

    def piece_id(self, piece: str) -> int:
        return self.vocab.get(piece, self.unk_id)

    @property
    def model_bytes(self) -> bytes:
        """The bundle: a header line of JSON (vocabulary, special tokens, model sizes), then the
        source and the target SentencePiece models."""
        header: dict[str, Any] = {"vocab": self.vocab, "specials": self.specials}
        if self.hidden:  # absent for Marian's bundles, which stay byte for byte what they were
            header["hidden"] = list(self.hidden)
        if self.code_prefix != (not self.hidden):  # only where it is not what the bundle's hidden tokens say
            header["code_prefix"] = self.code_prefix
        header.update(source_bytes=len(self.source_spm), target_bytes=len(self.target_spm))
        return BUNDLE_MAGIC + json.dumps(header, ensure_ascii=False).encode() + b"\n" + self.source_spm \
            + self.target_spm

    @classmethod
    def from_bundle(cls, data: bytes) -> VocabTokenizer:
        body = data[len(BUNDLE_MAGIC):]
        line_end = body.find(b"\n")
        try:
            header: dict[str, Any] = json.loads(body[:line_end])
            start = line_end + 1
            middle = start + int(header["source_bytes"])
            end = middle + int(header["target_bytes"])
        except (ValueError, KeyError, TypeError) as e:
            raise TokenizerError(f"unreadable tokenizer bundle ({e})") from None
        if end != len(body):
            raise TokenizerError(f"tokenizer bundle of {len(body)} bytes, its header says {end}: truncated?")
        try:
            return cls(body[start:middle], body[middle:end], header["vocab"], **header["specials"],
                       hidden=header.get("hidden", []), code_prefix=header.get("code_prefix"))
        except (RuntimeError, TypeError, AttributeError) as e:  # SentencePiece's parse error; a header of wrong types
            raise TokenizerError(f"unusable tokenizer bundle ({first_line(e)})") from None

    def _ids(self, pieces: list[str]) -> list[int]:
        return [self.vocab.get(p, self.unk_id) for p in pieces]

    def encode_source(self, texts: list[str]) -> list[list[int]]:
        """Piece ids + EOS (MarianTokenizer: a leading >>code<< is one token, then the source pieces)."""
        out = []
        for text in texts:
            code: list[str] = []
            end = text.find("<<") if self.code_prefix and text.startswith(">>") else -1
            if end != -1:
                code, text = [text[: end + 2]], text[end + 2:]
            out.append(self._ids(code + self.source.encode(text, out_type=str)) + [self.eos_id])
        return out

    def source_cut(self, text: str, pieces: int) -> int:
        """Where in `text` its first `pieces` source pieces end (a leading >>code<< is one): a character offset."""
        end = text.find("<<") + 2 if self.code_prefix and text.startswith(">>") and "<<" in text else 0
        if end and pieces > 0:
            return end + _pieces_end(self.source, text[end:], pieces - 1)
        return _pieces_end(self.source, text, pieces)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Target-side piece ids without EOS (references)."""
        return [self._ids(self.target.encode(text, out_type=str)) for text in texts]

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Text by the target model from the pieces of the ids; special tokens (EOS, padding, UNK, the hidden
        ones) are dropped, as MarianTokenizer.decode(skip_special_tokens=True) drops them."""
        out = []
        for seq in ids:
            pieces = [self.pieces[i] for i in seq if i not in self.dropped and i in self.pieces]
            out.append(self.target.decode_pieces(pieces).replace("\u2581", " ").strip())
        return out


AnyTokenizer = Tokenizer | VocabTokenizer


GLUES, SPACE, WORD = 1, 2, 3  # word_continuations' kinds of piece; 0: any other (punctuation, specials)


def word_continuations(tokenizer: AnyTokenizer) -> Any:
    """(vocab,) int8 numpy array, computed once per tokenizer, each piece's kind for constrained search: GLUES
    onto the word before it (no leading "▁", a letter or digit first): none may follow a glossary term, so the
    term ends its word; SPACE, the bare "▁" piece, and WORD, a word start ("▁" and more): no term may start with
    a word start right after a bare space (the text would hold two spaces)."""
    cached = getattr(tokenizer, "_continuations", None)
    if cached is None:
        import numpy as np

        def kind(p: str) -> int:
            if p == "\u2581":
                return SPACE
            if p.startswith("\u2581"):
                return WORD
            return GLUES if p and p[0].isalnum() else 0

        cached = np.fromiter((kind(tokenizer.piece(i)) for i in range(tokenizer.vocab_size)), dtype=np.int8,
                             count=tokenizer.vocab_size)
        tokenizer._continuations = cached  # type: ignore[union-attr]
    return cached


def load_tokenizer(data: bytes) -> AnyTokenizer:
    """The tokenizer a checkpoint or model dir holds: a SentencePiece model, or a vocabulary bundle."""
    if data.startswith(BUNDLE_MAGIC):
        return VocabTokenizer.from_bundle(data)
    return Tokenizer(data)


def tokenizer_from_file(path: str | Path) -> AnyTokenizer:
    """The tokenizer of a model dir's file; one that cannot be used is a TokenizerError naming it."""
    try:
        return load_tokenizer(Path(path).read_bytes())
    except TokenizerError as e:
        raise TokenizerError(f"{path}: {e}; export the model again") from None


def _pieces_end(sp: spm.SentencePieceProcessor, text: str, pieces: int) -> int:
    """The character offset of `text` where its first `pieces` pieces by `sp` end, len(text) when it has no more
    (SentencePiece's piece offsets count the UTF-8 bytes of the text as given, before normalisation)."""
    try:
        found = sp.encode(text, return_type="proto").pieces
    except TypeError:  # sentencepiece before return_type (0.2.0): its immutable proto has the same offsets
        found = sp.encode(text, out_type="immutable_proto").pieces  # type: ignore[arg-type]
    if pieces >= len(found):
        return len(text)
    if pieces <= 0:
        return 0
    return len(text.encode("utf-8")[:found[pieces - 1].end].decode("utf-8", errors="ignore"))


def _processor(model_bytes: bytes, which: str = "") -> spm.SentencePieceProcessor:
    """SentencePiece's processor, or a TokenizerError: its own parse error is a multi-line C++ message, and
    empty bytes load no model without an error (every later call then fails), so they are refused here.
    `which`: "source: " or "target: " of a bundle."""
    if not model_bytes:
        raise TokenizerError(f"{which}not a SentencePiece model (0 bytes)")
    try:
        return spm.SentencePieceProcessor(model_proto=model_bytes)
    except (RuntimeError, TypeError, OSError) as e:
        raise TokenizerError(f"{which}not a SentencePiece model ({len(model_bytes)} bytes; {first_line(e)})") from None


def id_gap(values: Iterable[int]) -> str | None:
    """What keeps a vocabulary's ids from being 0..N-1, each once ("id 7 twice", "no id 10"), else None."""
    ids = sorted(values)
    if ids == list(range(len(ids))):
        return None
    repeated = next((i for i, j in zip(ids, ids[1:]) if i == j), None)
    if repeated is not None:
        return f"id {repeated} twice"
    present = set(ids)
    missing = next(i for i in range(len(ids)) if i not in present)  # (an id past the end is implied; not so one
    return f"no id {missing}" + (f", and a negative id {ids[0]}" if ids[0] < 0 else "")  # below 0)

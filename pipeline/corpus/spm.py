"""Train the joint SentencePiece model (source + target) with the project's special ids."""

from __future__ import annotations

import logging
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

from model.config import BOS_ID, EOS_ID, MIN_VOCAB, PAD_ID, UNK_ID
from model.errors import UserError

SPM_MAX_LINE_BYTES = 4192  # SentencePiece's max_sentence_length: it leaves longer lines out of training

log = logging.getLogger(__name__)


def train_sentencepiece(lines: Iterable[str], vocab_size: int, model_type: str = "unigram",
                        character_coverage: float = 1.0, max_sentences: int = 2_000_000,
                        seed_sentencepiece_size: int = 1_000_000) -> bytes:
    """A SentencePiece model trained on `lines` (both sides of the corpus), as bytes.

    The vocabulary is a soft limit: tiny corpora get fewer pieces rather than an error.
    """
    if vocab_size < MIN_VOCAB:
        raise UserError(f"--vocab-size {vocab_size} is too small (at least {MIN_VOCAB})")
    with tempfile.TemporaryDirectory(prefix="spm-") as tmp:
        text = Path(tmp) / "text.txt"
        n, long = 0, 0  # long: lines SentencePiece leaves out (a line of fewer characters than 1/4 of the limit
        with open(text, "w", encoding="utf-8") as f:  # is never one: only longer ones are encoded to count)
            for line in lines:
                line = line.strip()
                if line:
                    f.write(line + "\n")
                    n += 1
                    long += len(line) > SPM_MAX_LINE_BYTES // 4 and len(line.encode("utf-8")) > SPM_MAX_LINE_BYTES
        if long == n:
            raise UserError("cannot train SentencePiece: the training text has no non-empty line of at most "
                            f"{SPM_MAX_LINE_BYTES} bytes (SentencePiece skips longer ones)")
        prefix = Path(tmp) / "spm"
        try:
            spm.SentencePieceTrainer.train(
                input=str(text), model_prefix=str(prefix), vocab_size=vocab_size,
                model_type=model_type, character_coverage=character_coverage,
                pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
                hard_vocab_limit=False, input_sentence_size=max_sentences,
                shuffle_input_sentence=True, seed_sentencepiece_size=seed_sentencepiece_size,
                minloglevel=2, num_threads=2,
            )
        except RuntimeError as e:  # every character is a piece: a corpus of more characters needs more pieces
            needed = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(e))
            if needed is None:
                raise
            raise UserError(f"--vocab-size {vocab_size} is too small for the {int(needed.group(1)) - 4} characters of "
                            f"the corpus (each is a piece) and 4 special pieces: give --vocab-size "
                            f"{needed.group(1)} or more (a CJK corpus: several thousand)") from None
        data = (prefix.with_suffix(".model")).read_bytes()
    pieces = spm.SentencePieceProcessor(model_proto=data).get_piece_size()
    fewer = f", fewer than --vocab-size {vocab_size}: the corpus has too little text for more" \
        if pieces < vocab_size else ""
    used = n - long
    sampled = f" (a sample of {max_sentences} of them)" if used > max_sentences else ""
    skipped = f"; {long} line(s) over {SPM_MAX_LINE_BYTES} bytes left out, as SentencePiece does" if long else ""
    log.info("trained SentencePiece (%s) on %d lines%s: %d pieces%s%s", model_type, used, sampled, pieces, fewer,
             skipped)
    return data

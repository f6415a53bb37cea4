"""A random-weight M2M-100-shaped directory for speed comparisons
(benchmarks/2026-11-27_amd-epyc-avx2_m2m100-ctranslate2.md).

Written by transformers' own classes, as `save_pretrained` writes facebook/m2m100_*: M2M100ForConditionalGeneration
(random init, seed 0) and M2M100Tokenizer over a SentencePiece BPE model trained on Multi30k's English and German
training sides, with M2M-100's 100 language codes. vocab.json holds the SentencePiece pieces, then filler pieces
(never produced by the SentencePiece model, as many of a real 128k dictionary's rare pieces are not) up to the
requested vocabulary, so that the output projection has the size asked for.

    python benchmarks/make_random_m2m100.py OUT --d-model 512 --layers 6 --ffn 2048 --heads 8 --vocab 32000
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import shutil
import tempfile
from pathlib import Path

CORPUS = Path("/work/shared/corpora/multi30k")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000, help="model vocabulary, language tokens included")
    ap.add_argument("--spm-pieces", type=int, default=8000)
    args = ap.parse_args()

    import sentencepiece as spm
    import torch
    from transformers import GenerationConfig, M2M100Config, M2M100ForConditionalGeneration, M2M100Tokenizer

    lines = [line.strip() for side in ("en", "de")
             for line in gzip.open(CORPUS / f"train.{side}.gz", "rt", encoding="utf-8") if line.strip()]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=args.spm_pieces,
                                   model_type="bpe", character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   num_threads=2, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(sp.get_piece_size()):
        if not (sp.is_control(i) or sp.is_unknown(i)):
            vocab.setdefault(sp.id_to_piece(i), len(vocab))
    languages, madeup = 100, 8
    filler = args.vocab - languages - madeup - len(vocab)
    if filler < 0:
        raise SystemExit(f"--vocab {args.vocab} is below the {len(vocab) + languages + madeup} ids the tokenizer has")
    for k in range(filler):
        vocab[f"\u2581fill{k:06d}"] = len(vocab)
    args.out.mkdir(parents=True, exist_ok=False)
    work = Path(tempfile.mkdtemp(prefix="m2m-random-"))
    try:
        (work / "sentencepiece.bpe.model").write_bytes(buf.getvalue())
        (work / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        tokenizer = M2M100Tokenizer(vocab_file=str(work / "vocab.json"), spm_file=str(work / "sentencepiece.bpe.model"),
                                    src_lang="en", tgt_lang="de", language_codes="m2m100", model_max_length=1024)
        tokenizer.save_pretrained(args.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    config = M2M100Config(
        vocab_size=len(vocab) + languages + madeup, d_model=args.d_model, encoder_layers=args.layers,
        decoder_layers=args.layers, encoder_attention_heads=args.heads, decoder_attention_heads=args.heads,
        encoder_ffn_dim=args.ffn, decoder_ffn_dim=args.ffn, activation_function="relu", max_position_embeddings=1024,
        dropout=0.1, attention_dropout=0.1, activation_dropout=0.0, scale_embedding=True, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, tie_word_embeddings=True,
        architectures=["M2M100ForConditionalGeneration"])
    torch.manual_seed(0)
    model = M2M100ForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=0, decoder_start_token_id=2, eos_token_id=2, pad_token_id=1,
                                               forced_eos_token_id=2, num_beams=5, max_length=200, early_stopping=True)
    model.save_pretrained(args.out)
    print(f"{args.out}: vocabulary {config.vocab_size}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()

"""A tiny M2M-100 directory built locally with transformers' own classes, for testing `pipeline import m2m100`.

`make_m2m100_dir(out)` writes what `M2M100ForConditionalGeneration.save_pretrained` and
`M2M100Tokenizer.save_pretrained` write for facebook/m2m100_418M, with no network:

    config.json              M2M100Config: pre-LN blocks, a final LayerNorm per stack, fairseq's sinusoids
                             offset by the padding id + 1, scaled and shared embeddings; eos 2 = decoder start
    generation_config.json   num_beams, max_length, early_stopping, forced eos
    model.safetensors
    sentencepiece.bpe.model  one SentencePiece BPE model for every language, trained here on the built-in
                             synthetic pair (pipeline/corpus/synthetic.py)
    vocab.json               fairseq's dictionary: <s> 0, <pad> 1, </s> 2, <unk> 3, then the pieces
    tokenizer_config.json    its language codes (the language tokens `__xx__` follow vocab.json's ids,
                             then 8 "madeup" ids pad the embedding)

`family="nllb"` writes NLLB-200's form instead: NllbTokenizer's tokenizer.json (fairseq's ids: the pieces
shifted by one, the language codes such as eng_Latn as added tokens) beside the sentencepiece.bpe.model the
hub's NLLB directories ship, and generate's default early_stopping (false).

The built-in pair's two sides play two languages of the wmt21 code list ("en" and "de"), and the model is
trained briefly in both directions with its language tokens (transformers' own loss), so that it stops at
varied lengths and its forced first token matters. Shapes are parameters: asymmetric depth, per-side FFN
width and head count.
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from pathlib import Path

LANGS = ("en", "de")  # the synthetic pair's source and target sides
NLLB_LANGS = ("eng_Latn", "deu_Latn")
LANGUAGE_CODES = "wmt21"  # transformers' 8-language list (m2m100's own has 100): a small embedding
N_PAIRS = 400
CORPUS_SEED = 7


def _train_spm(sentences: list[str], vocab_pieces: int) -> bytes:
    """A SentencePiece BPE model as fairseq's M2M-100 uses: unk 0, bos 1, eos 2 (vocab.json renumbers them)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=buf, vocab_size=vocab_pieces, model_type="bpe",
        character_coverage=1.0, hard_vocab_limit=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1, minloglevel=2)
    return buf.getvalue()


def _vocab(model: bytes) -> dict[str, int]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model)
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(sp.get_piece_size()):
        if not (sp.is_control(i) or sp.is_unknown(i)):
            vocab.setdefault(sp.id_to_piece(i), len(vocab))
    return vocab


def make_m2m100_dir(out: Path, *, d_model: int = 32, encoder_layers: int = 2, decoder_layers: int = 2,
                    encoder_heads: int = 4, decoder_heads: int = 4, encoder_ffn: int = 64, decoder_ffn: int = 64,
                    vocab_pieces: int = 160, seed: int = 0, train_steps: int = 300, num_beams: int = 4,
                    max_length: int = 48, early_stopping: bool | None = None, max_position_embeddings: int = 128,
                    family: str = "m2m100") -> Path:
    """Write a briefly trained M2M-100 (or NLLB) model dir into `out` (created; must be empty or absent);
    return `out`. early_stopping: the family's (M2M-100 ships true, NLLB transformers' default false)."""
    import torch
    from transformers import GenerationConfig, M2M100Config, M2M100ForConditionalGeneration, M2M100Tokenizer

    from pipeline.corpus.synthetic import generate

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    src, tgt = generate(N_PAIRS, seed=CORPUS_SEED)
    model_bytes = _train_spm(src + tgt, vocab_pieces)
    vocab = _vocab(model_bytes)
    work = Path(tempfile.mkdtemp(prefix="m2m100-fixture-"))
    try:
        (work / "sentencepiece.bpe.model").write_bytes(model_bytes)
        (work / "vocab.json").write_text(json.dumps(vocab, indent=2, ensure_ascii=False), encoding="utf-8")
        if family == "nllb":
            tokenizer = _nllb_tokenizer(work / "sentencepiece.bpe.model", max_position_embeddings)
            (out / "sentencepiece.bpe.model").write_bytes(model_bytes)  # as the hub's NLLB directories hold it
            vocab_size = len(tokenizer)
        else:
            tokenizer = M2M100Tokenizer(vocab_file=str(work / "vocab.json"),
                                        spm_file=str(work / "sentencepiece.bpe.model"), src_lang=LANGS[0],
                                        tgt_lang=LANGS[1], language_codes=LANGUAGE_CODES,
                                        model_max_length=max_position_embeddings)
            vocab_size = len(vocab) + len(tokenizer.lang_code_to_id) + tokenizer.num_madeup_words
        tokenizer.save_pretrained(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if early_stopping is None:
        early_stopping = family != "nllb"
    config = M2M100Config(
        vocab_size=vocab_size, d_model=d_model,
        encoder_layers=encoder_layers, decoder_layers=decoder_layers, encoder_attention_heads=encoder_heads,
        decoder_attention_heads=decoder_heads, encoder_ffn_dim=encoder_ffn, decoder_ffn_dim=decoder_ffn,
        activation_function="relu", max_position_embeddings=max_position_embeddings, dropout=0.1,
        attention_dropout=0.0, activation_dropout=0.0, scale_embedding=True, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
        tie_word_embeddings=True, architectures=["M2M100ForConditionalGeneration"])
    torch.manual_seed(seed)
    model = M2M100ForConditionalGeneration(config)
    _train(model, tokenizer, src, tgt, train_steps, seed, NLLB_LANGS if family == "nllb" else LANGS)
    model.generation_config = GenerationConfig(
        bos_token_id=0, decoder_start_token_id=2, eos_token_id=2, pad_token_id=1, forced_eos_token_id=2,
        num_beams=num_beams, max_length=max_length, early_stopping=early_stopping)
    model.save_pretrained(out)
    return out


def _nllb_tokenizer(spm_path: Path, max_length: int):
    """NllbTokenizer over a SentencePiece BPE model, numbered as fairseq numbers NLLB's dictionary: <s> 0,
    <pad> 1, </s> 2, <unk> 3, each other piece its SentencePiece id + 1 (transformers builds its own
    NLLB tokenizers from the same pieces and merges)."""
    from tokenizers.models import BPE
    from transformers import NllbTokenizer
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    extracted = SentencePieceExtractor(str(spm_path)).extract(BPE)
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for piece, i in sorted(extracted["vocab"].items(), key=lambda item: item[1]):
        if i >= 3:  # SentencePiece's own <unk>, <s>, </s> are fairseq's specials above
            vocab[piece] = i + 1
    return NllbTokenizer(vocab=vocab, merges=extracted["merges"], src_lang=NLLB_LANGS[0], tgt_lang=NLLB_LANGS[1],
                         _spm_precompiled_charsmap=extracted["_spm_precompiled_charsmap"],
                         model_max_length=max_length)


def _train(model, tokenizer, src: list[str], tgt: list[str], steps: int, seed: int, langs: tuple[str, str]) -> None:
    """Teacher-forced training in both directions, each batch one direction with its language tokens
    (the corpus tokenized once per direction: the tokenizer is slow Python)."""
    import torch

    directions = []
    for (a, b), pair in (((src, tgt), langs), ((tgt, src), langs[::-1])):
        tokenizer.src_lang, tokenizer.tgt_lang = pair
        batch = tokenizer(a, text_target=b, return_tensors="pt", padding=True)
        batch["labels"][batch["labels"] == tokenizer.pad_token_id] = -100
        directions.append(batch)
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small: 10x faster than 2 threads on a busy 2-core machine
    try:
        _steps(model, optimizer, directions, steps, gen, len(src))
    finally:
        torch.set_num_threads(threads)
    model.eval()


def _steps(model, optimizer, directions, steps: int, gen, n: int) -> None:
    import torch

    for step in range(steps):
        data = directions[step % 2]
        idx = torch.randint(0, n, (32,), generator=gen)
        loss = model(input_ids=data["input_ids"][idx], attention_mask=data["attention_mask"][idx],
                     labels=data["labels"][idx]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _load(hf_dir: Path):
    from transformers import M2M100ForConditionalGeneration, M2M100Tokenizer, NllbTokenizer

    nllb = json.loads((Path(hf_dir) / "tokenizer_config.json").read_text())["tokenizer_class"].startswith("Nllb")
    tokenizer = (NllbTokenizer if nllb else M2M100Tokenizer).from_pretrained(str(hf_dir), local_files_only=True)
    model = M2M100ForConditionalGeneration.from_pretrained(str(hf_dir), local_files_only=True).eval()
    return tokenizer, model


def _token(tokenizer, lang: str) -> str:
    """The language's token: M2M-100's __xx__, NLLB's code itself."""
    return tokenizer.get_lang_token(lang) if hasattr(tokenizer, "get_lang_token") else lang


def m2m100_generate(hf_dir: Path, texts: list[str], src_lang: str, tgt_lang: str, num_beams: int = 4,
                    max_length: int = 48) -> tuple[list[list[int]], list[str]]:
    """transformers' output ids for each text (without the decoder start, cut before the first EOS) and its
    translations (batch_decode, special tokens skipped)."""
    import torch

    tokenizer, model = _load(hf_dir)
    tokenizer.src_lang = src_lang
    batch = tokenizer(list(texts), return_tensors="pt", padding=True)
    with torch.no_grad():
        rows = model.generate(**batch, num_beams=num_beams, max_length=max_length, do_sample=False,
                              forced_bos_token_id=tokenizer.convert_tokens_to_ids(_token(tokenizer, tgt_lang)))
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    ids = []
    for row in rows.tolist():
        row = row[1:]
        row = row[:row.index(eos)] if eos in row else row
        while row and row[-1] == pad:
            row = row[:-1]
        ids.append(row)
    return ids, tokenizer.batch_decode(rows, skip_special_tokens=True)

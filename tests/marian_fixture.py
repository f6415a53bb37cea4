"""A tiny, random-weight OPUS-MT (MarianMTModel) directory built locally, for testing the Marian importer.

`make_marian_dir(out)` writes exactly what `MarianMTModel.save_pretrained` and
`MarianTokenizer.save_pretrained` write for a Helsinki-NLP/opus-mt-* model, with no network:

    config.json              MarianConfig as OPUS-MT ships it (swish, scaled embeddings, static
                             sinusoidal positions, shared embeddings, eos 0, pad = decoder start = last id)
    generation_config.json   bad_words_ids [[pad]], bos 0, eos 0, forced eos 0, num_beams, max_length
    model.safetensors        (or pytorch_model.bin with safe_serialization=False)
    source.spm, target.spm   two SentencePiece models, trained here on the built-in synthetic pair
                             (pipeline/corpus/synthetic.py) the way Marian trains them (eos 0, unk 1, no bos)
    vocab.json               one shared piece -> id dict: "</s>" 0, "<unk>" 1, the pieces of both
                             models, "<pad>" last
    tokenizer_config.json, special_tokens_map.json (whatever this transformers version writes)

Every weight is random and non-trivial (layer norms and biases too, and final_logits_bias), so an
importer that drops, transposes or swaps a tensor changes the output. The EOS logit gets a positive
offset, chosen per model on calibration sentences, so that search ends at varied lengths. Measured
(20 held-out sentences, seed 0, max_length 64): greedy is bimodal (most outputs end at once or run
to max_length, a few in between); beam 4 spreads wider (0, 19-42, 62). A random decoder falls into
a loop whose EOS margin hardly changes, so per-step EOS is rare: expect some empty and some
max_length outputs in any batch.

`marian_generate` / `marian_translate` run the reference (transformers) side on such a dir.
"""

from __future__ import annotations

import io
import json
import math
import shutil
import tempfile
from pathlib import Path

SOURCE_LANG, TARGET_LANG = "src", "tgt"
EOS, UNK, PAD = "</s>", "<unk>", "<pad>"
# Candidate offsets added to final_logits_bias[eos] (on top of its random value); the one giving
# the most varied greedy lengths on calibration sentences is kept (_calibrate_eos).
EOS_OFFSETS = tuple(0.25 * i for i in range(17))
N_CALIBRATION = 24
EMBED_SCALE = 1.0  # token embeddings ~ N(0, (EMBED_SCALE / sqrt(d_model))^2)
LINEAR_GAIN = 1.0  # nn.Linear weights ~ N(0, (LINEAR_GAIN / sqrt(fan_in))^2)
# The decoder's self-attention output projections get a larger gain, so that its state follows what it
# has generated (a random decoder otherwise settles in a loop: a constant state, EOS never or at once).
LINEAR_GAINS: dict[str, float] = {"decoder.layers.0.self_attn.out_proj": 3.0,
                                  "decoder.layers.1.self_attn.out_proj": 3.0}
BIAS_STD = 0.5  # final_logits_bias ~ N(0, (BIAS_STD * EMBED_SCALE)^2)
N_PAIRS = 400
CORPUS_SEED = 7


def _corpus(corpus: list[str] | None) -> tuple[list[str], list[str]]:
    """(source sentences, target sentences) to train the SentencePiece models on. `corpus`, when
    given, is used for both sides; otherwise N_PAIRS pairs of the built-in synthetic language pair."""
    if corpus is not None:
        return list(corpus), list(corpus)
    from pipeline.corpus.synthetic import generate

    return generate(N_PAIRS, seed=CORPUS_SEED)


def _train_spm(sentences: list[str], vocab_pieces: int, model_type: str) -> bytes:
    """A SentencePiece model as Marian's built-in trainer makes one: eos 0, unk 1, no bos, no pad."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=buf, vocab_size=vocab_pieces,
        model_type=model_type, character_coverage=1.0, hard_vocab_limit=False,
        eos_id=0, unk_id=1, bos_id=-1, pad_id=-1, num_threads=1, minloglevel=2,
    )
    return buf.getvalue()


def _pieces(model: bytes) -> list[str]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model)
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())
            if not (sp.is_control(i) or sp.is_unknown(i))]


def build_vocab(source_pieces: list[str], target_pieces: list[str], size: int | None = None) -> dict[str, int]:
    """OPUS-MT's vocab.json: "</s>" 0, "<unk>" 1, the union of both models' pieces (source
    order, then target pieces not seen yet), "<pad>" last (= vocab_size - 1). `size`: filler pieces
    the SentencePiece models never produce make it that long (a real model's vocabulary size, to bench)."""
    vocab = {EOS: 0, UNK: 1}
    for piece in (*source_pieces, *target_pieces):
        vocab.setdefault(piece, len(vocab))
    while size is not None and len(vocab) < size - 1:
        vocab.setdefault(f"\u2581filler{len(vocab)}", len(vocab))
    vocab[PAD] = len(vocab)
    return vocab


def _randomize(model, seed: int, eos_id: int, pad_id: int, final_logits_bias: bool) -> None:
    """Replace transformers' init (std 0.02, zero biases, unit layer norms, zero final_logits_bias)
    by weights whose every tensor matters to the output (the sinusoidal positions are left alone)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    d_model = model.config.d_model
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied embeddings appear once
            if "embed_positions" in name:  # sinusoidal, not saved: from_pretrained recomputes them
                continue
            if name.endswith("layer_norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("shared.weight") or name.endswith("embed_tokens.weight"):
                p.copy_(EMBED_SCALE * torch.randn(p.shape, generator=gen) / math.sqrt(d_model))
            elif p.dim() == 2:  # nn.Linear: (out, in)
                gain = next((g for key, g in LINEAR_GAINS.items() if key in name), LINEAR_GAIN)
                p.copy_(gain * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        # The converter appends <pad> as a zero embedding row (and zero bias): OPUS-MT has no pad piece.
        model.model.shared.weight[pad_id].zero_()
        bias = torch.zeros_like(model.final_logits_bias)
        if final_logits_bias:
            bias = BIAS_STD * EMBED_SCALE * torch.randn(bias.shape, generator=gen)
            bias[0, pad_id] = 0.0
        model.final_logits_bias.copy_(bias)


def _lengths(model, batch, num_beams: int, max_length: int) -> list[int]:
    import torch

    eos = model.config.eos_token_id
    with torch.no_grad():
        rows = model.generate(**batch, num_beams=num_beams, max_length=max_length, do_sample=False).tolist()
    return [row[1:].index(eos) if eos in row[1:] else len(row) - 1 for row in rows]


def _calibrate_eos(model, tokenizer, sentences: list[str], max_length: int) -> float:
    """Add to final_logits_bias[eos] the offset (from EOS_OFFSETS) under which greedy search on
    `sentences` ends at the most varied lengths, few at once (length 0) and few at max_length.
    Returns the offset."""
    batch = tokenizer(sentences, return_tensors="pt", padding=True)
    eos = model.config.eos_token_id
    base = model.final_logits_bias[0, eos].item()
    cap = max_length - 2  # the longest output: decoder start + tokens + forced EOS

    def score(offset: float) -> float:
        model.final_logits_bias[0, eos] = base + offset
        lengths = _lengths(model, batch, 1, max_length)
        ended = [n for n in lengths if 0 < n < cap]
        return len(set(ended)) + 0.5 * len(ended) - 0.5 * abs(lengths.count(0) - lengths.count(cap))

    best = max(EOS_OFFSETS, key=score)
    model.final_logits_bias[0, eos] = base + best
    return best


def make_marian_config(vocab_size: int, *, d_model: int = 32, layers: int = 2, heads: int = 4, ffn: int = 64,
                       activation: str = "swish", max_position_embeddings: int = 128, num_beams: int = 4,
                       max_length: int = 64, decoder_layers: int | None = None, decoder_ffn: int | None = None,
                       decoder_heads: int | None = None):
    """A MarianConfig shaped like a real opus-mt-* config.json (legacy keys included); `decoder_layers`,
    `decoder_ffn`, `decoder_heads` other than the encoder's: a deep-encoder, shallow-decoder student's shape."""
    from transformers import MarianConfig

    pad = vocab_size - 1
    config = MarianConfig(
        vocab_size=vocab_size, decoder_vocab_size=vocab_size, d_model=d_model,
        encoder_layers=layers, decoder_layers=layers if decoder_layers is None else decoder_layers,
        encoder_attention_heads=heads, decoder_attention_heads=decoder_heads or heads,
        encoder_ffn_dim=ffn, decoder_ffn_dim=decoder_ffn or ffn, activation_function=activation,
        max_position_embeddings=max_position_embeddings, dropout=0.1, attention_dropout=0.0,
        activation_dropout=0.0, init_std=0.02, scale_embedding=True, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, pad_token_id=pad, eos_token_id=0, bos_token_id=0,
        decoder_start_token_id=pad, forced_eos_token_id=0, is_encoder_decoder=True, use_cache=True,
        architectures=["MarianMTModel"],
    )
    # Keys the converted OPUS-MT configs carry from the BART-era config (read by nothing today).
    legacy = {"add_bias_logits": False, "add_final_layer_norm": False, "classif_dropout": 0.0,
              "classifier_dropout": 0.0, "normalize_before": False, "normalize_embedding": False,
              "static_position_embeddings": True, "extra_pos_embeddings": vocab_size, "gradient_checkpointing": False}
    for key, value in legacy.items():
        setattr(config, key, value)
    return config


def make_generation_config(pad: int, *, num_beams: int = 4, max_length: int = 64):
    from transformers import GenerationConfig

    return GenerationConfig(bad_words_ids=[[pad]], bos_token_id=0, decoder_start_token_id=pad, eos_token_id=0,
                            forced_eos_token_id=0, max_length=max_length, num_beams=num_beams, pad_token_id=pad)


def make_marian_dir(out: Path, *, d_model: int = 32, layers: int = 2, heads: int = 4, ffn: int = 64,
                    vocab_pieces: int = 200, activation: str = "swish", seed: int = 0,
                    final_logits_bias: bool = True, max_position_embeddings: int = 128,
                    corpus: list[str] | None = None, num_beams: int = 4, max_length: int = 64,
                    safe_serialization: bool = True, spm_model_type: str = "unigram",
                    vocab_size: int | None = None, calibrate: bool = True, train_steps: int = 0,
                    decoder_layers: int | None = None, decoder_ffn: int | None = None,
                    decoder_heads: int | None = None) -> Path:
    """Write a random-weight OPUS-MT model dir into `out` (created; must be empty or absent)
    and return `out`. `vocab_pieces` is each SentencePiece model's vocab size (a soft limit).
    `safe_serialization=False` writes pytorch_model.bin instead of model.safetensors. `vocab_size` pads
    vocab.json to a real model's size (OPUS-MT: ~58k); `calibrate=False` skips tuning the EOS bias
    (slow on large shapes; benchmarks fix the output length anyway). `train_steps` > 0 then trains it
    with transformers' own loss on the built-in pair (batches of 32, AdamW 3e-3), so that its
    distributions are peaked as a real model's are (int8 parity means little on random weights)."""
    import torch
    from transformers import MarianMTModel, MarianTokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    src_text, tgt_text = _corpus(corpus)
    src_model = _train_spm(src_text, vocab_pieces, spm_model_type)
    tgt_model = _train_spm(tgt_text, vocab_pieces, spm_model_type)
    vocab = build_vocab(_pieces(src_model), _pieces(tgt_model), vocab_size)

    work = Path(tempfile.mkdtemp(prefix="marian-fixture-"))
    try:
        (work / "source.spm").write_bytes(src_model)
        (work / "target.spm").write_bytes(tgt_model)
        (work / "vocab.json").write_text(json.dumps(vocab, indent=2, ensure_ascii=False), encoding="utf-8")
        tokenizer = MarianTokenizer(source_spm=str(work / "source.spm"), target_spm=str(work / "target.spm"),
                                    vocab=str(work / "vocab.json"), source_lang=SOURCE_LANG,
                                    target_lang=TARGET_LANG, model_max_length=512)
        tokenizer.save_pretrained(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    config = make_marian_config(len(vocab), d_model=d_model, layers=layers, heads=heads, ffn=ffn,
                                activation=activation, max_position_embeddings=max_position_embeddings,
                                num_beams=num_beams, max_length=max_length, decoder_layers=decoder_layers,
                                decoder_ffn=decoder_ffn, decoder_heads=decoder_heads)
    torch.manual_seed(seed)
    model = MarianMTModel(config).eval()
    _randomize(model, seed, eos_id=0, pad_id=config.pad_token_id, final_logits_bias=final_logits_bias)
    model.generation_config = make_generation_config(config.pad_token_id, num_beams=num_beams,
                                                     max_length=max_length)
    if final_logits_bias and calibrate and not train_steps:
        _calibrate_eos(model, tokenizer, src_text[:N_CALIBRATION], max_length)
    if train_steps:
        _train(model, tokenizer, train_steps, seed)
    model.save_pretrained(out)
    if not safe_serialization:
        # transformers 5 always writes safetensors: rewrite the same tensors as a pytorch_model.bin,
        # what transformers 4's save_pretrained(safe_serialization=False) wrote.
        from safetensors.torch import load_file

        weights = out / "model.safetensors"
        torch.save(load_file(str(weights)), out / "pytorch_model.bin")
        weights.unlink()
    return out


def _train(model, tokenizer, steps: int, seed: int) -> None:
    """A few hundred steps of teacher-forced training, as a user of transformers would run them."""
    import torch

    from pipeline.corpus.synthetic import generate

    src, tgt = generate(2000, seed=CORPUS_SEED + 1)
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(src), (32,), generator=gen).tolist()
        batch = tokenizer([src[i] for i in idx], text_target=[tgt[i] for i in idx], return_tensors="pt",
                          padding=True)
        batch["labels"][batch["labels"] == tokenizer.pad_token_id] = -100
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():  # as in OPUS-MT models: the decoder starts from a zero <pad> embedding
        model.get_input_embeddings().weight[tokenizer.pad_token_id].zero_()
    model.eval()


def _load(hf_dir: Path):
    from transformers import MarianMTModel, MarianTokenizer

    tokenizer = MarianTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    model = MarianMTModel.from_pretrained(str(hf_dir), local_files_only=True).eval()
    return tokenizer, model


def _generate(tokenizer, model, texts: list[str], num_beams: int, max_length: int):
    import torch

    batch = tokenizer(list(texts), return_tensors="pt", padding=True)
    with torch.no_grad():
        return model.generate(**batch, num_beams=num_beams, max_length=max_length, do_sample=False)


def marian_generate(hf_dir: Path, texts: list[str], num_beams: int = 4, max_length: int = 64) -> list[list[int]]:
    """transformers' output ids for each text: without the decoder start token, cut before the first EOS."""
    tokenizer, model = _load(hf_dir)
    eos = model.config.eos_token_id
    start = model.config.decoder_start_token_id
    result = []
    for row in _generate(tokenizer, model, texts, num_beams, max_length).tolist():
        if row and row[0] == start:
            row = row[1:]
        row = row[:row.index(eos)] if eos in row else row
        while row and row[-1] == model.config.pad_token_id:
            row = row[:-1]
        result.append(row)
    return result


def marian_translate(hf_dir: Path, texts: list[str], num_beams: int = 4, max_length: int = 64) -> list[str]:
    """transformers' translations (batch_decode, special tokens skipped)."""
    tokenizer, model = _load(hf_dir)
    ids = _generate(tokenizer, model, texts, num_beams, max_length)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)

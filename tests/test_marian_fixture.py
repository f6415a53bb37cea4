"""The local OPUS-MT fixture: the files save_pretrained writes, OPUS-MT's vocab ids, and generation."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

from pipeline.corpus.synthetic import generate  # noqa: E402
from tests.marian_fixture import make_marian_dir, marian_generate  # noqa: E402


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory):
    return make_marian_dir(tmp_path_factory.mktemp("marian") / "opus-mt")


def test_files_and_vocab(marian_dir):
    names = {p.name for p in marian_dir.iterdir()}
    required = {"config.json", "generation_config.json", "model.safetensors", "source.spm", "target.spm",
                "vocab.json", "tokenizer_config.json"}
    assert required <= names <= required | {"special_tokens_map.json"}
    vocab = json.loads((marian_dir / "vocab.json").read_text(encoding="utf-8"))
    assert vocab["</s>"] == 0 and vocab["<unk>"] == 1 and vocab["<pad>"] == len(vocab) - 1
    assert sorted(vocab.values()) == list(range(len(vocab)))
    config = json.loads((marian_dir / "config.json").read_text())
    pad = len(vocab) - 1
    assert (config["vocab_size"], config["pad_token_id"], config["decoder_start_token_id"]) == (len(vocab), pad, pad)
    assert config["eos_token_id"] == 0 and config["activation_function"] == "swish" and config["scale_embedding"]
    gen = json.loads((marian_dir / "generation_config.json").read_text())
    assert gen["bad_words_ids"] == [[pad]] and gen["num_beams"] == 4 and gen["forced_eos_token_id"] == 0


def test_tokenizer_ids_are_vocab_pieces_plus_eos(marian_dir):
    from transformers import MarianTokenizer

    tok = MarianTokenizer.from_pretrained(str(marian_dir), local_files_only=True)
    vocab = json.loads((marian_dir / "vocab.json").read_text(encoding="utf-8"))
    sentence = generate(1, seed=99)[0][0]
    pieces = tok.spm_source.encode(sentence, out_type=str)
    assert tok(sentence)["input_ids"] == [vocab[p] for p in pieces] + [0]


def test_generate_lengths_vary(marian_dir):
    texts = generate(20, seed=12345)[0]
    lengths = [len(ids) for beam in (1, 4) for ids in marian_generate(marian_dir, texts, num_beams=beam)]
    assert len(set(lengths)) >= 3
    assert all(0 <= n <= 62 for n in lengths)

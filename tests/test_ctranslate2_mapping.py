"""The CTranslate2 comparison compares the same model: its weight mapping must reproduce our
PyTorch model's greedy output token for token (skipped where ctranslate2 is not installed:
it is a benchmark extra, `pip install -e .[bench]`)."""

from __future__ import annotations

import pytest

from model.checkpoint import load_model, resolve_checkpoint
from pipeline.evaluation import ctranslate2_compare
from runtime.tokenizer import Tokenizer

pytest.importorskip("ctranslate2")


@pytest.mark.slow
def test_ctranslate2_greedy_equals_pytorch(trained_save_dir, memorise_corpus, tmp_path):
    model, spm_bytes, _ = load_model(resolve_checkpoint(trained_save_dir))
    tokenizer = Tokenizer(spm_bytes)
    src_lines = memorise_corpus[0].read_text().splitlines()
    sources = tokenizer.encode_source(src_lines[:12])
    translator = ctranslate2_compare.ct2_translator(model, tokenizer, tmp_path / "ct2", threads=1)
    assert ctranslate2_compare.greedy_agreement(model, tokenizer, translator, sources) == len(sources)


@pytest.mark.slow
def test_a_wrong_mapping_is_caught(trained_save_dir, memorise_corpus, tmp_path):
    """The agreement check can fail: a model whose weights differ from the mapped ones."""
    import torch

    model, spm_bytes, _ = load_model(resolve_checkpoint(trained_save_dir))
    tokenizer = Tokenizer(spm_bytes)
    sources = tokenizer.encode_source(memorise_corpus[0].read_text().splitlines()[:12])
    translator = ctranslate2_compare.ct2_translator(model, tokenizer, tmp_path / "ct2", threads=1)
    with torch.no_grad():
        model.decoder[0].ffn.w1.weight.mul_(-1.0)
    assert ctranslate2_compare.greedy_agreement(model, tokenizer, translator, sources) < len(sources)


def test_missing_ctranslate2_is_one_line(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_ct2(name, *args, **kwargs):
        if name == "ctranslate2":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ct2)
    with pytest.raises(ctranslate2_compare.UserError, match=r"pip install -e \.\[bench\]"):
        ctranslate2_compare.import_ctranslate2()

"""The CTranslate2 benchmark compares the same model: its weight mapping must reproduce our
PyTorch model's greedy output token for token (skipped where ctranslate2 is not installed:
it is a benchmark extra, `pip install -e .[bench]`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from model.checkpoint import load_model, resolve_checkpoint
from runtime.tokenizer import Tokenizer

pytest.importorskip("ctranslate2")
ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("bench_ctranslate2", ROOT / "scripts" / "bench_ctranslate2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ctranslate2_greedy_equals_pytorch(trained_save_dir, memorise_corpus, tmp_path):
    script = load_script()
    model, spm_bytes, _ = load_model(resolve_checkpoint(trained_save_dir))
    tokenizer = Tokenizer(spm_bytes)
    src_lines = memorise_corpus[0].read_text().splitlines()
    sources = tokenizer.encode_source(src_lines[:12])
    translator = script.ct2_translator(model, tokenizer, tmp_path / "ct2", threads=1)
    assert script.greedy_agreement(model, tokenizer, translator, sources) == len(sources)

"""`pipeline bench --compare ctranslate2` on an M2M-100 import: CTranslate2's own TransformersConverter on the
directory the model was imported from, both engines given the same source ids (the source language token first)
and the target language's token forced first (ours: first_tokens; CTranslate2: target_prefix), checked token for
token before anything is timed; in-process and whole process."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.evaluation.bench import make_sources
from pipeline.evaluation.ctranslate2_compare import _ListedLanguageTokens

SHAPE = dict(encoder_layers=2, decoder_layers=1, encoder_ffn=96, decoder_ffn=64, encoder_heads=4, decoder_heads=4)


def test_language_tokens_are_listed_for_ctranslate2s_loader():
    """transformers 5's M2M100Tokenizer lists no additional_special_tokens; CTranslate2's M2M-100 loader appends
    exactly those after the vocabulary, so they are given in id order; the rest is the tokenizer's own."""
    tokenizer = SimpleNamespace(special_tokens_map={"eos_token": "</s>"}, lang_token_to_id={"__de__": 9, "__en__": 8},
                                num_madeup_words=8)
    listed = _ListedLanguageTokens(tokenizer)
    assert listed.special_tokens_map == {"eos_token": "</s>", "additional_special_tokens": ["__en__", "__de__"]}
    assert listed.num_madeup_words == 8 and tokenizer.special_tokens_map == {"eos_token": "</s>"}


def test_random_sources_start_with_the_language_token():
    tokenizer = SimpleNamespace(piece_ids=[5, 6, 7], eos_id=2)
    sources = make_sources(tokenizer, None, 3, 6, 128, prefix=(40,))  # type: ignore[arg-type]
    assert all(len(s) == 6 and s[0] == 40 and s[-1] == 2 and set(s[1:-1]) <= {5, 6, 7} for s in sources)
    assert all(len(s) == 6 and s[0] in {5, 6, 7} for s in make_sources(tokenizer, None, 3, 6, 128))  # type: ignore[arg-type]


@pytest.mark.slow
def test_bench_compares_an_m2m100_import_with_ctranslate2(tmp_path):
    """Trained fixture: CTranslate2 (its converter named in the report) agrees on every check sentence in the
    direction asked for, does the same work at a fixed length, and the whole-process script translates the
    same direction as serve-batch."""
    pytest.importorskip("ctranslate2")
    pytest.importorskip("transformers")
    from click.testing import CliRunner

    from pipeline.cli import cli
    from pipeline.importers.m2m100 import import_m2m100
    from tests.m2m100_fixture import make_m2m100_dir

    hf_dir = make_m2m100_dir(tmp_path / "hf", train_steps=150, **SHAPE)
    import_m2m100(hf_dir, tmp_path / "m2m.pt")
    runner = CliRunner()
    model_dir = tmp_path / "fp32"
    result = runner.invoke(cli, ["export", str(tmp_path / "m2m.pt"), "--out", str(model_dir), "--no-tensorrt"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "bench.json"
    common = ["--compare", "ctranslate2", "--src-lang", "en", "--tgt-lang", "de", "--threads", "1", "--rounds", "1",
              "--beam-size", "2", "--fixed-length", "6"]
    result = runner.invoke(cli, ["bench", str(model_dir), "--backends", "onnxruntime", "--batch-size", "4",
                                 "--sentences", "8", "--json", str(out), *common])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["ctranslate2_converter"].startswith(f"ctranslate2.converters.TransformersConverter({hf_dir})")
    assert report["ctranslate2_greedy_agreement"] == "8/8"
    assert (report["src_lang"], report["tgt_lang"]) == ("en", "de")
    rows = {(r["engine"], r["precision"], r["batch_size"]) for r in report["results"]}
    assert {("onnxruntime", "fp32", 4), ("ctranslate2", "fp32", 4), ("ctranslate2", "int8", 4)} <= rows
    assert {r["target_tokens"] for r in report["results"] if r["batch_size"] == 4} == {8 * 6}
    assert "direction en -> de" in result.output

    lines = tmp_path / "lines.en"
    lines.write_text("ba ko\n\nmuro se ju\n", encoding="utf-8")
    result = runner.invoke(cli, ["bench", str(model_dir), "--whole-process", str(lines), "--json", str(out), *common])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["ctranslate2_greedy_agreement"] == "8/8"
    assert {(r["engine"], r["precision"]) for r in report["results"]} == {
        ("onnxruntime", "fp32"), ("ctranslate2", "fp32"), ("ctranslate2", "int8")}


@pytest.mark.slow
def test_different_head_counts_are_refused_with_the_reason(tmp_path):
    """CTranslate2's converter gives both stacks the encoder's head count: such a model is refused, not timed."""
    pytest.importorskip("ctranslate2")
    pytest.importorskip("transformers")
    from model.errors import UserError
    from pipeline.evaluation.ctranslate2_compare import for_model_dir
    from pipeline.importers.m2m100 import import_m2m100
    from tests.m2m100_fixture import make_m2m100_dir

    hf_dir = make_m2m100_dir(tmp_path / "hf", train_steps=0, **{**SHAPE, "decoder_heads": 2})
    import_m2m100(hf_dir, tmp_path / "m2m.pt")
    model_dir = tmp_path / "dir"
    model_dir.mkdir()
    (model_dir / "model.pt").write_bytes((tmp_path / "m2m.pt").read_bytes())
    with pytest.raises(UserError, match="4 encoder heads and 2 decoder heads"):
        for_model_dir(Path(model_dir), tmp_path / "ct2")

"""`pipeline export --int8` on a model with no held-out sentences (an imported one without --reference-src) calibrates
static activation scales on the built-in sample in its languages, and keeps them only if the int8 graphs pass
parity's int8 gate on it against the fp32 PyTorch model (issue 62); otherwise, and for models whose languages
the sample lacks, the graphs keep per-row scales, and the export and the manifest say which and why."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import run_cli, run_cli_captured
from m2m100_fixture import make_m2m100_dir
from marian_fixture import make_marian_dir

from export import sample
from export.plan import load
from model.config import ModelConfig
from model.manifest import Languages
from runtime import references

CODES = ["en", "de", "fr", "es", "it", "pt", "nl", "pl", "cs", "ru"]


def test_the_sample_is_a_line_aligned_table_of_ten_languages():
    text = (Path(sample.__file__).parent / sample.SAMPLE_FILE).read_text(encoding="utf-8")
    assert text.endswith("\n") and "\r" not in text
    table = sample.read_sample()
    assert list(table) == CODES
    for code, lines in table.items():
        assert len(lines) == 100, code
        assert all(line and line == line.strip() and "\t" not in line for line in lines), code
    assert len(set(table["en"])) == 100
    assert sum(len(x.split()) for x in table["en"]) / 100 >= 8  # sentences, not words
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert re.search(r'\nexport = \[[^]]*"\*\.tsv"', pyproject), "pyproject's package-data misses the sample"


def test_a_models_codes_name_the_samples_languages():
    assert [sample.sample_language(c) for c in ("de", "de-DE", "deu", "ger", "eng_Latn", "pt_BR", "zho_Hans")] == \
        ["de", "de", "de", "de", "en", "pt", "zho"]


def _cfg(languages: tuple[tuple[str, int], ...] = ()) -> ModelConfig:
    return ModelConfig(vocab_size=80, d_model=16, n_heads=2, d_ff=32, n_enc_layers=1, n_dec_layers=1,
                       languages=languages)


def test_a_one_pair_model_calibrates_on_its_source_language():
    table = sample.read_sample()
    (way,), said = sample.sample_for(_cfg(), Languages(("deu",), ("en",)))
    assert said == "the built-in sample (de -> en)"
    assert way.codes is None and way.lines == table["de"] and way.references == table["en"]
    for pair, why in ((None, "languages are unknown"), (Languages(("zh",), ("en",)), "zh -> en is not among")):
        ways, said = sample.sample_for(_cfg(), pair)
        assert ways == () and why in said


def test_a_multilingual_model_calibrates_into_english_and_out_of_it():
    """Every sample language the model has into English, English into German; each direction its own rows, the
    references the same rows' translations; MULTILINGUAL_LINES in all."""
    table = sample.read_sample()
    cfg = _cfg((("cs", 60), ("de", 61), ("en", 62), ("ja", 63), ("ru", 64)))
    ways, said = sample.sample_for(cfg, None)
    assert [w.codes for w in ways] == [("cs", "en"), ("de", "en"), ("ru", "en"), ("en", "de")]
    assert said == "the built-in sample (3 languages -> en, en -> de)"
    assert sum(len(w.lines) for w in ways) == sample.MULTILINGUAL_LINES
    seen = []
    for way in ways:
        src, tgt = (sample.sample_language(c) for c in way.codes)
        rows = [table[src].index(line) for line in way.lines]
        assert [table[tgt][r] for r in rows] == way.references
        seen += rows
    assert len(set(seen)) == len(seen)  # each direction its own rows
    nllb = _cfg((("deu_Latn", 60), ("eng_Latn", 61)))
    assert [w.codes for w in sample.sample_for(nllb, None)[0]] == [("deu_Latn", "eng_Latn"), ("eng_Latn", "deu_Latn")]
    ways, said = sample.sample_for(_cfg((("de", 60), ("ja", 61))), None)
    assert ways == () and "too few" in said


def _export(capsys, checkpoint: Path, out: Path, *args: object) -> tuple[str, dict]:
    code, _, err = run_cli_captured(capsys, "export", checkpoint, "--out", out, "--int8", "--no-tensorrt",
                                    "--reference-lines", 0, *args)
    assert code == 0, err
    return err, json.loads((out / "manifest.json").read_text())["verification"]


def _scales_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("int8: ")]


@pytest.fixture(scope="module")
def marian_checkpoint(tmp_path_factory) -> Path:
    """An imported OPUS-MT-shaped model (random weights) whose tokenizer names no real languages."""
    pytest.importorskip("transformers")  # builds the Hugging Face directory (not in the quick start's extra)
    root = tmp_path_factory.mktemp("sample")
    hf = make_marian_dir(root / "opus-mt-src-tgt", vocab_pieces=60)
    assert run_cli("import", hf, "--out", root / "imported.pt") == 0
    return root / "imported.pt"


def test_an_imported_pair_calibrates_on_the_sample_and_passes_the_gate(marian_checkpoint, tmp_path, capsys):
    """--src-lang de --tgt-lang en name the pair: its static scales are calibrated on the sample's German and
    gated against its English; the manifest records the gate's BLEU. A random model scores BLEU 0 either way,
    which passes: the export says the gate told nothing (it said "passed" alone). In the codes its
    tokenizer_config gives (src, tgt): per row, and why."""
    out = tmp_path / "de-en"
    err, ver = _export(capsys, marian_checkpoint, out, "--src-lang", "de", "--tgt-lang", "en")
    first, told = _scales_lines(err)
    assert first == (
        "int8: static activation scales calibrated on 100 lines of the built-in sample (de -> en), kept if they "
        "pass the int8 parity gate on it (--int8-calibrate FILE to choose others; --no-int8-calibrate for per-row "
        "dynamic scales)")
    assert re.fullmatch(
        r"int8: the fp32 model scores BLEU 0\.00 on the built-in sample \(de -> en\) \(int8 0\.00, \d+% of its "
        r"lines as fp32 translates them\), too low for the int8 gate to tell what the static scales cost: they are "
        r"kept; calibrate on text of your own with --reference-src/--reference-tgt or --int8-calibrate FILE, or "
        r"choose --no-int8-calibrate", told), told
    scales = ver["int8_activation_scales"]
    assert scales["kind"] == "static" and scales["calibrated_on"] == "the built-in sample (de -> en)"
    gate = scales["sample_gate"]
    assert gate["passed"] and gate["lines"] == 100 and gate["max_bleu_delta"] == references.INT8_MAX_BLEU_DELTA
    assert abs(gate["bleu_int8"] - gate["bleu_fp32"]) <= gate["max_bleu_delta"]
    assert ver["int8_static_scales"]["decoder.onnx"]["static"] > 0

    err, ver = _export(capsys, marian_checkpoint, tmp_path / "unknown")
    assert _scales_lines(err) == [
        "int8: per-row dynamic activation scales (no held-out sentences to calibrate on: give --int8-calibrate FILE "
        "or --reference-src/--reference-tgt; src -> tgt is not among the built-in sample's languages (en, de, fr, es, "
        "it, pt, nl, pl, cs, ru))"]
    assert ver["int8_activation_scales"]["kind"] == "per-row" and "int8_static_scales" not in ver


def test_scales_that_miss_the_gate_leave_per_row_graphs(marian_checkpoint, tmp_path, capsys, monkeypatch):
    """A gate the sample's scales cannot pass (a negative BLEU delta) leaves the graphs per row: the export says
    so, the manifest records the missed gate, and the model dir serves as a per-row export does."""
    monkeypatch.setattr(references, "INT8_MAX_BLEU_DELTA", -1.0)
    out = tmp_path / "missed"
    err, ver = _export(capsys, marian_checkpoint, out, "--src-lang", "de", "--tgt-lang", "en")
    assert "missed the int8 parity gate" in err and "per-row dynamic scales" in err
    scales = ver["int8_activation_scales"]
    assert scales["kind"] == "per-row" and not scales["sample_gate"]["passed"]
    assert "int8_static_scales" not in ver

    per_row = tmp_path / "per-row"
    _export(capsys, marian_checkpoint, per_row, "--src-lang", "de", "--tgt-lang", "en", "--no-int8-calibrate")
    src = tmp_path / "in.txt"
    src.write_text("Das ist ein Test.\nGuten Morgen!\n")
    outputs = []
    for model_dir in (out, per_row):
        hyp = tmp_path / f"{model_dir.name}.txt"
        code, _, err = run_cli_captured(capsys, "serve-batch", model_dir, src, "--output", hyp,
                                        "--backend", "onnxruntime")
        assert code == 0, err
        outputs.append(hyp.read_text())
    assert outputs[0] == outputs[1]


@pytest.fixture(scope="module")
def m2m_checkpoint(tmp_path_factory) -> Path:
    """An imported M2M-100 (random weights) with en, de, cs and ru among its languages."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("m2m")
    hf = make_m2m100_dir(root / "m2m100-tiny", train_steps=0, vocab_pieces=80)
    assert run_cli("import", hf, "--out", root / "imported.pt") == 0
    return root / "imported.pt"


def test_a_multilingual_import_calibrates_with_its_language_tokens(m2m_checkpoint, tmp_path, capsys):
    """An imported M2M-100 calibrates on the sample into English and out of it, each source with its language
    token and each output forced to its target's."""
    checkpoint = m2m_checkpoint
    model, _, _, tokenizer = load(checkpoint)
    calibration, _ = sample.sample_calibration(model.cfg, None)
    assert calibration is not None
    ids, first = sample.encoded(tokenizer, model.cfg, calibration, 256)
    tokens = model.cfg.language_ids
    assert [d.codes for d in calibration.directions][-1] == ("en", "de") and first is not None
    assert (ids[0][0], first[0]) == (tokens[calibration.directions[0].codes[0]], tokens["en"])
    assert (ids[-1][0], first[-1]) == (tokens["en"], tokens["de"])
    err, ver = _export(capsys, checkpoint, tmp_path / "int8")
    scales = ver["int8_activation_scales"]
    assert scales["calibrated_on"].startswith("the built-in sample (") and scales["lines"] == sample.MULTILINGUAL_LINES
    assert scales["sample_gate"]["lines"] == sample.MULTILINGUAL_LINES
    assert scales["kind"] == ("static" if scales["sample_gate"]["passed"] else "per-row")


def test_a_multilingual_models_own_lines_are_decoded_in_the_languages_given(m2m_checkpoint, tmp_path, capsys):
    """--reference-src/--int8-calibrate lines of a multilingual model need --src-lang/--tgt-lang: calibration and
    the recorded references decode them with those language tokens, and `pipeline parity MODEL_DIR` (the recorded
    references, no --src) translates them in the same direction."""
    table = sample.read_sample()
    src, ref = tmp_path / "held.de", tmp_path / "held.en"
    src.write_text("\n".join(table["de"][:8]) + "\n")
    ref.write_text("\n".join(table["en"][:8]) + "\n")
    files = ["--reference-src", src, "--reference-tgt", ref]
    code, _, err = run_cli_captured(capsys, "export", m2m_checkpoint, "--out", tmp_path / "x", "--int8",
                                    "--no-tensorrt", *files)
    assert code != 0 and "--src-lang is required" in err and "--reference-src" in err
    code, _, err = run_cli_captured(capsys, "export", m2m_checkpoint, "--out", tmp_path / "x", "--int8",
                                    "--no-tensorrt", *files, "--src-lang", "de", "--tgt-lang", "xx")
    assert code != 0 and "--tgt-lang 'xx' is not a language of this model" in err
    code, _, err = run_cli_captured(capsys, "export", m2m_checkpoint, "--out", tmp_path / "x", "--int8",
                                    "--no-tensorrt", "--src-lang", "de", "--tgt-lang", "en")
    assert code != 0 and "there are none" in err and not (tmp_path / "x").exists()

    out = tmp_path / "m"
    code, _, err = run_cli_captured(capsys, "export", m2m_checkpoint, "--out", out, "--int8", "--no-tensorrt",
                                    *files, "--src-lang", "de", "--tgt-lang", "en")
    assert code == 0, err
    scales = json.loads((out / "manifest.json").read_text())["verification"]["int8_activation_scales"]
    assert scales["kind"] == "static" and scales["lines"] == 8 and "sample_gate" not in scales
    recorded = json.loads((out / "references.json").read_text())
    tokens = load(m2m_checkpoint)[0].cfg.language_ids
    assert (recorded["source_lang"], recorded["target_lang"]) == ("de", "en")
    assert all(h[0] == tokens["en"] for h in recorded["hypotheses"] if h)  # each forced into English
    code, said, err = run_cli_captured(capsys, "parity", out, "--backends", "torch,onnxruntime")
    assert code == 0, err
    assert "parity: passed" in said

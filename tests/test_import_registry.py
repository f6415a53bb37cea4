"""The importers as registered families (issue 59): `pipeline import DIR` takes the family config.json's
model_type names and writes the very checkpoint `pipeline import marian|m2m100|nllb DIR` writes; an unknown
model_type is one line naming it and the families known; a new family is one module and one table entry."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from helpers import run_cli_captured  # noqa: E402

from model.checkpoint import load_model  # noqa: E402
from pipeline.importers import registry  # noqa: E402
from pipeline.importers.family import Family  # noqa: E402
from tests.m2m100_fixture import make_m2m100_dir  # noqa: E402
from tests.marian_fixture import make_marian_dir  # noqa: E402
from tests.test_import_hostile import one_error_line  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """A tiny directory of each named form, shared read-only."""
    root = tmp_path_factory.mktemp("families")
    return {"marian": make_marian_dir(root / "opus-mt-tiny", vocab_pieces=60, calibrate=False),
            "m2m100": make_m2m100_dir(root / "m2m100-tiny", train_steps=0, vocab_pieces=80),
            "nllb": make_m2m100_dir(root / "nllb-tiny", family="nllb", train_steps=0, vocab_pieces=80)}


def imported(capsys, tmp_path: Path, *args: Any) -> tuple[bytes, str]:
    out = tmp_path / f"{'-'.join(str(a) for a in args[:-1]) or 'auto'}.pt"
    capsys.readouterr()
    code, said, err = run_cli_captured(capsys, "import", *args, "--out", out)
    assert code == 0, err
    return out.read_bytes(), said


@pytest.mark.parametrize("named, fmt", [("marian", "marian"), ("m2m100", "m2m100"), ("nllb", "nllb")])
def test_import_dir_writes_the_named_forms_checkpoint(dirs, tmp_path, capsys, named, fmt):
    """`pipeline import DIR` and `pipeline import NAME DIR`: the same bytes (weights, config, tokenizer and extra:
    decoding defaults, provenance, languages) and the same summary line."""
    auto, auto_said = imported(capsys, tmp_path, dirs[named])
    by_name, named_said = imported(capsys, tmp_path, named, dirs[named])
    assert hashlib.sha256(auto).hexdigest() == hashlib.sha256(by_name).hexdigest()
    assert auto_said.replace("auto.pt", "X") == named_said.replace(f"{named}.pt", "X")
    extra = load_model(tmp_path / "auto.pt", "cpu")[2]["extra"]
    assert extra["imported"]["format"] == fmt and set(extra) >= {"decoding", "imported"}


@pytest.mark.parametrize("model_type, said", [("bert", 'model_type "bert" is not a family'),
                                              (None, "no 'model_type'"), (["marian"], 'model_type ["marian"]')])
def test_an_unknown_model_type_is_one_line_naming_the_families_known(dirs, tmp_path, capsys, model_type, said):
    hf = tmp_path / "hf"
    shutil.copytree(dirs["marian"], hf)
    config = json.loads((hf / "config.json").read_text())
    config.pop("model_type")
    (hf / "config.json").write_text(json.dumps(config if model_type is None else {**config, "model_type": model_type}))
    capsys.readouterr()
    code, _, err = run_cli_captured(capsys, "import", hf, "--out", tmp_path / "o.pt")
    one_error_line(code, err, str(hf / "config.json"), said, "marian (Marian), m2m_100 (M2M-100, NLLB)")
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize("named, other", [("marian", "m2m100"), ("m2m100", "marian")])
def test_a_family_named_on_another_models_directory_says_its_model_type_first(dirs, tmp_path, capsys, named,
                                                                             other):
    """`pipeline import marian M2M_DIR` said "source.spm: missing", naming a file the family has and never the
    model type that tells the user what went wrong."""
    code, _, err = run_cli_captured(capsys, "import", named, dirs[other], "--out", tmp_path / "o.pt")
    wanted = registry.family(registry.COMMANDS[named]).model_type
    one_error_line(code, err, "config.json: model_type", f'not "{wanted}"', "takes the family model_type names")
    assert not (tmp_path / "o.pt").exists()


def test_a_family_named_on_a_directory_of_no_family_does_not_suggest_naming_none(dirs, tmp_path, capsys):
    """`pipeline import marian BERT_DIR` suggested `pipeline import BERT_DIR`, which then failed on "bert"; a
    config.json without model_type was "model_type is None" (Python's spelling)."""
    for model_type, said in (("bert", 'model_type "bert", not "marian"; pipeline import knows marian (Marian)'),
                             (None, 'no "model_type" (this family\'s config.json says "model_type": "marian")')):
        hf = tmp_path / f"hf-{model_type}"
        shutil.copytree(dirs["marian"], hf)
        config = json.loads((hf / "config.json").read_text())
        config.pop("model_type")
        (hf / "config.json").write_text(json.dumps(config if model_type is None else {**config,
                                                                                      "model_type": model_type}))
        code, _, err = run_cli_captured(capsys, "import", "marian", hf, "--out", tmp_path / "o.pt")
        one_error_line(code, err, said)
        assert "takes the family" not in err and not (tmp_path / "o.pt").exists()


def test_the_registry_lists_its_families():
    families = registry.families()
    assert set(families) == {"marian", "m2m_100"}
    assert all(isinstance(f, Family) and f.model_type == t for t, f in families.items())
    assert [v.name for v in families["m2m_100"].variants] == ["NLLB"]
    assert {registry.family(t).model_type for t in registry.COMMANDS.values()} <= set(families)
    assert registry.known() == "marian (Marian), m2m_100 (M2M-100, NLLB)"


def test_a_new_family_is_one_module_and_one_table_entry(dirs, tmp_path, capsys, monkeypatch):
    """A made-up BART-family model_type, mapped as Marian is: one Family and one registry line."""
    from pipeline.importers import marian

    hf = tmp_path / "hf"
    shutil.copytree(dirs["marian"], hf)
    (hf / "config.json").write_text(json.dumps({**json.loads((hf / "config.json").read_text()),
                                                "model_type": "made_up_bart"}))
    module = types.ModuleType("made_up_family")  # what the new module would hold
    module.FAMILY = dataclasses.replace(  # type: ignore[attr-defined]
        marian.MARIAN, model_type="made_up_bart", name="Made-up", format="made_up",
        model_config=lambda config, path: marian.model_config({**config, "model_type": "marian"}, path))
    monkeypatch.setitem(sys.modules, "made_up_family", module)
    monkeypatch.setitem(registry.FAMILIES, "made_up_bart", "made_up_family:FAMILY")
    _, said = imported(capsys, tmp_path, hf)
    assert "Made-up model" in said
    assert load_model(tmp_path / "auto.pt", "cpu")[2]["extra"]["imported"]["format"] == "made_up"

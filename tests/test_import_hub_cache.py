"""`pipeline import marian ORG/NAME`: a hub id (or a cache repository dir) resolved through a Hugging Face cache
laid out as huggingface_hub lays it (models--ORG--NAME/refs/main, snapshots/REV/* linking to ../../blobs/SHA),
offline, with one line naming where it looked."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from helpers import run_cli_captured  # noqa: E402

from tests.marian_fixture import make_marian_dir  # noqa: E402

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A hub cache holding Helsinki-NLP/opus-mt-src-tgt, as `huggingface-cli download` leaves it."""
    saved = make_marian_dir(tmp_path_factory.mktemp("saved") / "opus-mt-src-tgt", vocab_pieces=60, calibrate=False)
    root = tmp_path_factory.mktemp("hf") / "hub"
    repo = root / "models--Helsinki-NLP--opus-mt-src-tgt"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / REV).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    for f in saved.iterdir():
        if f.is_file():
            data = f.read_bytes()
            sha = hashlib.sha256(data).hexdigest()
            (repo / "blobs" / sha).write_bytes(data)
            os.symlink(f"../../blobs/{sha}", repo / "snapshots" / REV / f.name)
    return root


@pytest.mark.parametrize("env", ["HF_HUB_CACHE", "HF_HOME", "HUGGINGFACE_HUB_CACHE", "~"])
def test_a_hub_id_imports_from_the_cache(cache, tmp_path, monkeypatch, capsys, caplog, env):
    """As huggingface_hub finds its cache: the older HUGGINGFACE_HUB_CACHE, and ~ expanded, were missed."""
    for name in ("HF_HUB_CACHE", "HF_HOME", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    if env == "~":
        monkeypatch.setenv("HOME", str(cache.parent))
        monkeypatch.setenv("HF_HUB_CACHE", "~/hub")
    else:
        monkeypatch.setenv(env, str(cache.parent if env == "HF_HOME" else cache))
    monkeypatch.chdir(tmp_path)  # no directory of that name here
    with caplog.at_level(logging.INFO):
        code, out, err = run_cli_captured(capsys, "import", "marian", "Helsinki-NLP/opus-mt-src-tgt",
                                          "--out", tmp_path / "m.pt")
    assert code == 0, err
    assert (tmp_path / "m.pt").is_file() and "Marian model" in out
    said = [r.getMessage() for r in caplog.records if "Hugging Face cache" in r.getMessage()]
    assert said == [f"Helsinki-NLP/opus-mt-src-tgt: the Hugging Face cache's snapshot "
                    f"{cache / 'models--Helsinki-NLP--opus-mt-src-tgt' / 'snapshots' / REV} (refs/main)"]


def test_a_cache_repository_dir_imports_its_main_snapshot(cache, tmp_path, capsys):
    code, _, err = run_cli_captured(capsys, "import", "marian", cache / "models--Helsinki-NLP--opus-mt-src-tgt",
                                    "--out", tmp_path / "m.pt")
    assert code == 0, err


def test_an_id_not_in_the_cache_is_one_line_naming_where_it_looked(cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli_captured(capsys, "import", "marian", "Helsinki-NLP/opus-mt-de-en", "--out", "m.pt")
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        f"error: Helsinki-NLP/opus-mt-de-en: no such directory, nor a model in the Hugging Face cache (looked for "
        f"{cache / 'models--Helsinki-NLP--opus-mt-de-en'}); download it once with `hf download "
        "Helsinki-NLP/opus-mt-de-en` (`huggingface-cli download` before huggingface_hub 0.34; or save_pretrained), "
        "or give its directory"]
    # a path as typed is no hub id (click's Path dropped "./": "download it once with ... nope")
    code, _, err = run_cli_captured(capsys, "import", "./nope", "--out", "m.pt")
    assert code == 2 and "nope" in err and "Hugging Face cache" not in err and len(err.strip().splitlines()) == 1
    # import.md's local folder name, absent: `hf download opus-mt-de-en` was the advice, and no hub id
    code, _, err = run_cli_captured(capsys, "import", "opus-mt-de-en", "--out", "m.pt")
    assert code == 2 and "hf download" not in err and "a hub id names its owner (Helsinki-NLP/opus-mt-de-en)" in err
    code, _, err = run_cli_captured(capsys, "import", "nllb-200-distilled-600M", "--out", "m.pt")  # the README's
    assert code == 2 and "a hub id names its owner (facebook/nllb-200-distilled-600M)" in err, err
    # a family's name as the directory ("Marian", "NLLB") was a hub id of Helsinki-NLP's; another name is ORG's
    for name, family in (("Marian", "marian"), ("NLLB", "nllb")):
        code, _, err = run_cli_captured(capsys, "import", name, "--out", "m.pt")
        assert code == 2 and f"{name}: no such directory; {name} is a model family: `pipeline import {family} DIR " \
            "--out X`" in err and "Helsinki-NLP" not in err, err
    code, _, err = run_cli_captured(capsys, "import", "my-model", "--out", "m.pt")
    assert code == 2 and "a hub id names its owner (ORG/my-model)" in err, err
    # a web address was "https:/huggingface.co/...: no such directory"
    code, _, err = run_cli_captured(capsys, "import", "https://huggingface.co/Helsinki-NLP/opus-mt-de-en", "--out",
                                    "m.pt")
    assert code == 2 and "a web address; give a hub id, ORG/NAME (here Helsinki-NLP/opus-mt-de-en)" in err, err


def test_a_broken_ref_is_one_line(cache, tmp_path, monkeypatch, capsys):
    broken = tmp_path / "hub"
    repo = broken / "models--x--y"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots").mkdir()
    (repo / "refs" / "main").write_text("f" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(broken))
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli_captured(capsys, "import", "m2m100", "x/y", "--out", "m.pt")
    assert code == 2 and "refs/main: names revision" in err and "download x/y again" in err


@pytest.mark.parametrize("given", ["Helsinki-NLP/opus-mt-src-tgt", "models--Helsinki-NLP--opus-mt-src-tgt"])
def test_a_hub_id_imports_without_the_family_named(cache, tmp_path, monkeypatch, capsys, given):
    """`pipeline import ORG/NAME` (no family): the cached snapshot's config.json names it."""
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    path = given if "/" in given else cache / given
    code, out, err = run_cli_captured(capsys, "import", path, "--out", tmp_path / "m.pt")
    assert code == 0, err
    assert (tmp_path / "m.pt").is_file() and "Marian model" in out


def test_a_huge_ref_is_refused_unread(tmp_path, monkeypatch, capsys):
    """refs/main of 3 GB (sparse) was read whole: 12 s and 6.5 GB before its one line."""
    repo = tmp_path / "hub" / "models--x--y"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots").mkdir()
    with open(repo / "refs" / "main", "wb") as f:
        f.truncate(3 << 30)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli_captured(capsys, "import", "m2m100", "x/y", "--out", "m.pt")
    assert code == 2 and "refs/main: larger than" in err and "Traceback" not in err, err


def test_a_cache_blob_is_never_the_output(cache, tmp_path, monkeypatch, capsys):
    """--out naming a blob of the snapshot being imported, with --force, replaced the cache's vocabulary."""
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    blob = next((cache / "models--Helsinki-NLP--opus-mt-src-tgt" / "blobs").iterdir())
    before = blob.read_bytes()
    code, _, err = run_cli_captured(capsys, "import", "marian", "Helsinki-NLP/opus-mt-src-tgt", "--out", blob,
                                    "--force")
    assert code == 2 and "lies inside the input directory" in err, err
    assert blob.read_bytes() == before

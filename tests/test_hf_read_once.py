"""`pipeline import m2m100`/`nllb`: each JSON file of the directory is opened and read once (issue 59 item 3),
the provenance digest hashed from the bytes read; the provenance values stay every file's SHA-256."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("transformers")

from model.checkpoint import load_model  # noqa: E402
from pipeline.importers.hf_dir import HfDir  # noqa: E402
from pipeline.importers.hf_files import ImportRefused  # noqa: E402
from pipeline.importers.m2m100 import import_m2m100  # noqa: E402
from tests.m2m100_fixture import make_m2m100_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def profile_walks() -> ModuleType:
    """scripts/profile_walks.py, whose json_opens counts the opens (builtins.open, io.open, os.open) of a dir's
    JSON files and names who opened them."""
    spec = importlib.util.spec_from_file_location("profile_walks", ROOT / "scripts" / "profile_walks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("profile_walks", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=["m2m100", "nllb"])
def hf_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random M2M-100 (or NLLB) directory of the import tests, untrained."""
    return make_m2m100_dir(tmp_path_factory.mktemp(request.param) / f"{request.param}-tiny",
                           family=request.param, train_steps=0)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_each_json_file_is_opened_once_and_provenance_is_every_files_sha256(hf_dir: Path, tmp_path: Path) -> None:
    json_files = sorted(p.name for p in hf_dir.iterdir() if p.suffix == ".json")
    assert "config.json" in json_files and "generation_config.json" in json_files
    out = tmp_path / "imported.pt"
    with profile_walks().json_opens(hf_dir) as opens:
        import_m2m100(hf_dir, out)
    by_file: dict[str, int] = {}
    for (name, _who), n in opens.items():
        by_file[name] = by_file.get(name, 0) + n
    vocabulary = "tokenizer.json" if hf_dir.name.startswith("nllb") else "vocab.json"
    read = {"config.json", "generation_config.json", "tokenizer_config.json", vocabulary}
    assert read <= set(json_files)
    assert by_file == dict.fromkeys(read, 1), opens  # special_tokens_map.json is not read
    assert {who for _name, who in opens} == {"read_bounded"}, opens
    imported = load_model(out)[2]["extra"]["imported"]
    assert imported["skipped"] == []
    assert imported["files"] == {p.name: sha256(p) for p in sorted(hf_dir.iterdir()) if p.is_file()}


def test_digest_of_a_file_read_is_of_the_bytes_read_and_of_any_other_the_files(hf_dir: Path) -> None:
    opened = HfDir.open(hf_dir, "an M2M-100 directory")
    opened.config()
    config, weights = hf_dir / "config.json", hf_dir / "model.safetensors"
    assert opened.digest_of(config) == sha256(config) and opened.digest_of(weights) == sha256(weights)
    assert opened.provenance("m2m100")["files"]["config.json"] == sha256(config)


def test_refusals_stay_when_the_digest_comes_from_the_read(hf_dir: Path, tmp_path: Path) -> None:
    """A JSON file over its limit, a FIFO, a link out of the directory: still one line naming the file."""
    import os
    import shutil

    for case in ("large", "fifo", "link"):
        copy = tmp_path / case
        shutil.copytree(hf_dir, copy)
        target = copy / "generation_config.json"
        target.unlink()
        if case == "large":
            target.write_bytes(b" " * (4 * (1 << 20) + 1))
        elif case == "fifo":
            os.mkfifo(target)
        else:
            (tmp_path / f"outside-{case}.json").write_text("{}")
            target.symlink_to(tmp_path / f"outside-{case}.json")
        files = HfDir.open(copy, "an M2M-100 directory")
        with pytest.raises(ImportRefused, match="generation_config.json"):
            files.json("generation_config.json")

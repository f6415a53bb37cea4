"""`pipeline import marian` on hostile directories: every mistake in a Marian directory is one `error:`
line naming the file and field, exit 2, before anything large is allocated; no output destroys an
input (import or export); nothing outside the named directory is read."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from helpers import cli_env, run_cli  # noqa: E402

from tests.marian_fixture import make_marian_dir  # noqa: E402

Edit = Callable[[Path], Any]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny random OPUS-MT directory, shared read-only: every test edits its own copy."""
    return make_marian_dir(tmp_path_factory.mktemp("hostile") / "opus-mt-src-tgt", vocab_pieces=60,
                           calibrate=False)


def copy_of(hf_dir: Path, tmp_path: Path, edit: Edit | None = None) -> Path:
    hf = tmp_path / "hf"
    shutil.copytree(hf_dir, hf)
    if edit is not None:
        edit(hf)
    return hf


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def one_error_line(code: int, err: str, *needles: str) -> str:
    """The single `error:` line of a refused command, which holds every needle."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def import_cli(capsys, hf: Path, out: Path, *extra: str) -> tuple[int, str]:
    code = run_cli("import", "marian", hf, "--out", out, *extra)
    return code, capsys.readouterr().err


def edit_json(name: str, **changes: Any) -> Edit:
    def edit(hf: Path) -> None:
        data = json.loads((hf / name).read_text())
        data.update(changes)
        (hf / name).write_text(json.dumps(data))
    return edit


def rewrite_weights(change: Callable[[dict[str, Any]], None]) -> Edit:
    """Rewrite model.safetensors with `change` applied to its tensors."""
    def edit(hf: Path) -> None:
        from safetensors.torch import load_file, save_file

        state = load_file(str(hf / "model.safetensors"))
        change(state)
        save_file(state, str(hf / "model.safetensors"))
    return edit


class _Reduced:
    """Pickles as a call of os.system, which no import may make (weights_only refuses it before)."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return os.system, ("exit 3",)


def as_pytorch_bin(extra: dict[str, Any] | None = None) -> Edit:
    """model.safetensors rewritten as pytorch_model.bin (plus `extra` entries)."""
    def edit(hf: Path) -> None:
        import torch
        from safetensors.torch import load_file

        state: dict[str, Any] = dict(load_file(str(hf / "model.safetensors")))
        state.update(extra or {})
        torch.save(state, hf / "pytorch_model.bin")
        (hf / "model.safetensors").unlink()
    return edit


# -- 1. no output destroys an input -------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["model.safetensors", "sub/../vocab.json", "new.pt", "alias"])
def test_import_output_inside_the_marian_dir_is_refused(hf_dir, tmp_path, capsys, spelling):
    hf = copy_of(hf_dir, tmp_path)
    (hf / "sub").mkdir()
    (tmp_path / "alias").symlink_to(hf / "config.json")
    before, modified = snapshot(hf), hf.stat().st_mtime_ns
    out = tmp_path / spelling if spelling == "alias" else hf / spelling
    code, err = import_cli(capsys, hf, out, "--force")
    one_error_line(code, err, str(out), "inside the input directory", str(hf))
    assert snapshot(hf) == before and (tmp_path / "alias").is_symlink()
    # untouched: the output check wrote a probe file there first (a read-only input was "cannot write --out here")
    assert hf.stat().st_mtime_ns == modified
    assert not (hf / "new.pt").exists()


@pytest.fixture(scope="module")
def imported(hf_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("imported") / "marian.pt"
    assert run_cli("import", "marian", hf_dir, "--out", out) == 0
    return out


@pytest.mark.parametrize("inside", ["reference", "checkpoint-link"])
def test_export_force_never_replaces_a_dir_holding_an_input(imported, tmp_path, capsys, inside):
    """`export --force` replaces the whole --out dir: one that holds an input (a held-out file, the
    checkpoint under a symlinked name) is refused before anything is read."""
    out = tmp_path / "model-dir"
    out.mkdir()
    (out / "manifest.json").write_text("{}")  # a model dir, as far as --force is concerned
    (out / "val.src").write_text("a b c\n")
    (out / "val.tgt").write_text("a b c\n")
    checkpoint = imported
    args: list[object] = []
    if inside == "reference":
        args = ["--reference-src", out / "val.src", "--reference-tgt", out / "val.tgt"]
    else:
        checkpoint = out / "link.pt"
        checkpoint.symlink_to(imported)
    before = snapshot(out)
    code = run_cli("export", checkpoint, "--out", out, "--force", "--no-tensorrt", *args)
    one_error_line(code, capsys.readouterr().err, str(out), "holds the input")
    assert snapshot(out) == before


# -- 2. memory bombs: refused from the weights file's header, before allocating ----------------


@pytest.mark.parametrize("field, needle", [("d_model", "d_model"),
                                           ("max_position_embeddings", "max_position_embeddings"),
                                           ("encoder_layers", "n_enc_layers 1000000000")])  # the size cap
def test_absurd_sizes_are_refused_before_allocating(hf_dir, tmp_path, field, needle):
    """Under a 3 GiB address-space cap, in a few seconds: the model is never built for a config.json whose
    sizes the weights do not have."""
    changes: dict[str, Any] = {field: 10 ** 9}
    if field == "encoder_layers":
        changes["decoder_layers"] = 10 ** 9
    hf = copy_of(hf_dir, tmp_path, edit_json("config.json", **changes))
    script = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
              "from pipeline.cli import main; main(sys.argv[1:])")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script, "import", "marian", str(hf), "--out", str(tmp_path / "o.pt")],
                          capture_output=True, text=True, env=cli_env(), timeout=120)
    one_error_line(proc.returncode, proc.stderr, "config.json", needle)
    assert time.monotonic() - started < 60
    assert not (tmp_path / "o.pt").exists()


# -- 3. each mistake one line naming the file and field ------------------------------------------


def _drop(name: str) -> Callable[[dict[str, Any]], None]:
    return lambda state: state.pop(name)


def _add(name: str) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        import torch

        state[name] = torch.zeros(32)
    return change


def _vocab(change: Callable[[dict[str, Any]], None]) -> Edit:
    def edit(hf: Path) -> None:
        vocab = json.loads((hf / "vocab.json").read_text())
        change(vocab)
        (hf / "vocab.json").write_text(json.dumps(vocab))
    return edit


def _first_piece(vocab: dict[str, Any]) -> str:
    return next(p for p in vocab if p not in ("</s>", "<unk>", "<pad>"))


def _set_piece(value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda vocab: vocab.__setitem__(_first_piece(vocab), value)


HOSTILE: dict[str, tuple[Edit, tuple[str, ...]]] = {
    # weights that config.json does not describe
    "ffn-dim": (edit_json("config.json", encoder_ffn_dim=128, decoder_ffn_dim=128),
                ("model.safetensors", "fc1.", "ffn_dim 128")),
    "d_model": (edit_json("config.json", d_model=64), ("config.json", "d_model 64")),
    "layers-fewer": (edit_json("config.json", encoder_layers=1, decoder_layers=1),
                     ("model.safetensors", "layers.1", "encoder_layers")),
    "layers-more": (edit_json("config.json", encoder_layers=3, decoder_layers=3), ("encoder_layers 3",)),
    "missing-tensor": (rewrite_weights(_drop("model.encoder.layers.0.fc1.weight")),
                       ("model.safetensors", "model.encoder.layers.0.fc1.weight")),
    "no-embedding": (rewrite_weights(_drop("model.shared.weight")), ("model.safetensors", "embedding")),
    # wrong JSON types
    "pad-str": (edit_json("config.json", pad_token_id="106"), ("config.json", "pad_token_id", "integer")),
    "d_model-float": (edit_json("config.json", d_model=32.0), ("config.json", "d_model", "integer")),
    "layers-bool": (edit_json("config.json", encoder_layers=True), ("config.json", "encoder_layers")),
    "layers-list": (edit_json("config.json", encoder_layers=[2]), ("config.json", "encoder_layers")),
    "eos-null": (edit_json("config.json", eos_token_id=None), ("config.json", "eos_token_id")),
    "pad-out-of-range": (edit_json("config.json", pad_token_id=5000), ("config.json", "pad_token_id")),
    "scale-str": (edit_json("config.json", scale_embedding="false"), ("config.json", "scale_embedding")),
    "dropout-str": (edit_json("config.json", dropout="0.1"), ("config.json", "dropout")),
    "activation-list": (edit_json("config.json", activation_function=["swish"]),
                        ("config.json", "activation_function")),
    "beams-str": (edit_json("generation_config.json", num_beams="four"), ("generation_config.json", "num_beams")),
    "beams-float": (edit_json("generation_config.json", num_beams=4.5), ("generation_config.json", "num_beams")),
    "max-length-bool": (edit_json("generation_config.json", max_length=True),
                        ("generation_config.json", "max_length")),
    "penalty-str": (edit_json("generation_config.json", length_penalty="1.0"),
                    ("generation_config.json", "length_penalty")),
    "bad-words-bool": (edit_json("generation_config.json", bad_words_ids=[[True]]),
                       ("generation_config.json", "bad_words_ids")),
    "bad-words-str": (edit_json("generation_config.json", bad_words_ids="106"),
                      ("generation_config.json", "bad_words_ids")),
    "bad-words-range": (edit_json("generation_config.json", bad_words_ids=[[10 ** 6]]),
                        ("generation_config.json", "bad_words_ids")),
    "forced-eos-list": (edit_json("generation_config.json", forced_eos_token_id=[0, 1]),
                        ("generation_config.json", "forced_eos_token_id")),
    # impossible decoding defaults, named as generation_config.json names them (never --beam-size)
    "beams-negative": (edit_json("generation_config.json", num_beams=-3), ("generation_config.json", "num_beams")),
    "beams-zero": (edit_json("generation_config.json", num_beams=0), ("generation_config.json", "num_beams")),
    "penalty-negative": (edit_json("generation_config.json", length_penalty=-1.0),
                         ("generation_config.json", "length_penalty")),
    "penalty-nan": (lambda hf: (hf / "generation_config.json").write_text(
        (hf / "generation_config.json").read_text().rstrip()[:-1] + ', "length_penalty": NaN}'),
        ("generation_config.json", "length_penalty")),
    "max-length-negative": (edit_json("generation_config.json", max_length=-5),
                            ("generation_config.json", "max_length")),
    "min-length-above": (edit_json("generation_config.json", min_length=100),
                         ("generation_config.json", "min_length")),
    # vocab.json ids
    "vocab-null": (_vocab(_set_piece(None)), ("vocab.json",)),
    "vocab-str": (_vocab(_set_piece("3")), ("vocab.json",)),
    "vocab-float": (_vocab(_set_piece(3.0)), ("vocab.json",)),
    "vocab-duplicate": (_vocab(_set_piece(0)), ("vocab.json", "(id 0 twice)")),
    # a gap: it said "not 0..N without gaps or repeats", never which id
    "vocab-gap": (_vocab(lambda v: v.update({k: i + 1 for k, i in v.items() if i >= 10})),
                  ("vocab.json", "(no id 10)")),
    "vocab-negative": (_vocab(_set_piece(-1)), ("vocab.json",)),
    "vocab-list": (lambda hf: (hf / "vocab.json").write_text("[1, 2]"), ("vocab.json", "JSON object")),
    # tensor names with no place
    "name-x": (rewrite_weights(_add("model.encoder.layers.x")), ("model.safetensors", "'model.encoder.layers.x'")),
    "name-no-dot": (rewrite_weights(_add("model.encoder.layers.0")), ("'model.encoder.layers.0'",)),
    "name-no-leaf": (rewrite_weights(_add("model.encoder.layers.0.weight")), ("'model.encoder.layers.0.weight'",)),
    "name-bad-index": (rewrite_weights(_add("model.encoder.layers.99.fc1.weight")),
                       ("'model.encoder.layers.99.fc1.weight'", "encoder_layers")),
    "name-unknown-module": (rewrite_weights(_add("model.decoder.layers.0.fc3.weight")),
                            ("'model.decoder.layers.0.fc3.weight'",)),
    "int-tensor": (rewrite_weights(lambda s: s.__setitem__("final_logits_bias", s["final_logits_bias"].long())),
                   ("final_logits_bias", "float")),
    # pickles that are not plain tensors
    "pickle-object": (as_pytorch_bin({"extra": __import__("datetime").date(2020, 1, 1)}),
                      ("pytorch_model.bin", "refused for safety", "safe_serialization=True")),
    # a blocked module's callable (torch's words: "unsupported GLOBAL posix.system"): never run, and not "damaged"
    "pickle-os-system": (as_pytorch_bin({"x": _Reduced()}),
                         ("pytorch_model.bin", "refused for safety", "safe_serialization=True")),
    "pickle-int-key": (lambda hf: as_pytorch_bin({1: __import__("torch").zeros(3)})(hf),
                       ("pytorch_model.bin", "key 1 is not a tensor name")),
    # damaged, not unsafe: they were "refused for safety" and "unreadable weights (EOFError: )"
    "pickle-garbage": (lambda hf: (as_pytorch_bin()(hf), (hf / "pytorch_model.bin").write_bytes(
        bytes(range(256)) * 12)), ("pytorch_model.bin", "damaged, or not a PyTorch file", "download it again")),
    "pickle-empty": (lambda hf: (as_pytorch_bin()(hf), (hf / "pytorch_model.bin").write_bytes(b"")),
                     ("pytorch_model.bin", "ends early")),
    # cut in half: torch's message was five lines of miniz's advice in one
    "pickle-cut": (lambda hf: (as_pytorch_bin()(hf), (hf / "pytorch_model.bin").write_bytes(
        (hf / "pytorch_model.bin").read_bytes()[:4000])), ("pytorch_model.bin", "damaged or cut short", "download")),
    "torn-safetensors": (lambda hf: (hf / "model.safetensors").write_bytes(
        (hf / "model.safetensors").read_bytes()[:1000]), ("model.safetensors",)),
    "lying-header": (lambda hf: (hf / "model.safetensors").write_bytes(_header_only(10 ** 9)),
                     ("model.safetensors",)),
    # a model transformers would load differently, or damaged weights (both were imported: exit 0)
    "untied-head": (edit_json("config.json", tie_word_embeddings=False), ("config.json", "tie_word_embeddings")),
    "few-positions": (edit_json("config.json", max_position_embeddings=8),  # export failed with a traceback
                      ("config.json", "max_position_embeddings 8 is below 32")),
    "nan-weight": (rewrite_weights(lambda s: s["model.encoder.layers.0.fc1.weight"].__setitem__((0, 0), float("nan"))),
                   ("model.safetensors", "model.encoder.layers.0.fc1.weight", "1 NaN or infinite")),
    "inf-weight": (rewrite_weights(lambda s: s["final_logits_bias"].fill_(float("inf"))),
                   ("model.safetensors", "final_logits_bias", "NaN or infinite")),
}


def _header_only(rows: int) -> bytes:
    header = json.dumps({"model.shared.weight": {"dtype": "F32", "shape": [rows, 32], "data_offsets": [0, 128]}})
    return struct.pack("<Q", len(header)) + header.encode() + bytes(128)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_directory_is_one_line_naming_file_and_field(hf_dir, tmp_path, capsys, case):
    edit, needles = HOSTILE[case]
    hf = copy_of(hf_dir, tmp_path, edit)
    out = tmp_path / "out.pt"
    code, err = import_cli(capsys, hf, out)
    line = one_error_line(code, err, *needles)
    assert "--beam-size" not in line and "weights_only=False" not in line
    assert not out.exists()


def test_pytorch_bin_imports_like_safetensors(hf_dir, tmp_path, capsys):
    """The .bin path reads shapes through mmap and imports the same model."""
    hf = copy_of(hf_dir, tmp_path, as_pytorch_bin())
    code, err = import_cli(capsys, hf, tmp_path / "bin.pt")
    assert code == 0, err


def test_pytorch_bin_with_absurd_config_is_refused(hf_dir, tmp_path, capsys):
    hf = copy_of(hf_dir, tmp_path, as_pytorch_bin())
    edit_json("config.json", d_model=10 ** 9)(hf)
    code, err = import_cli(capsys, hf, tmp_path / "bin.pt")
    one_error_line(code, err, "config.json", "d_model")


# -- 4. nothing outside the named directory is read ----------------------------------------------


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "vocab.json", "source.spm",
                                  "generation_config.json"])
def test_needed_file_linked_outside_the_dir_is_refused(hf_dir, tmp_path, capsys, name):
    hf = copy_of(hf_dir, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (hf / name).rename(elsewhere / name)
    (hf / name).symlink_to(elsewhere / name)
    code, err = import_cli(capsys, hf, tmp_path / "out.pt")
    one_error_line(code, err, str(hf / name), "outside")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "vocab.json", "source.spm"])
def test_a_needed_file_that_links_nowhere_is_said_so(hf_dir, tmp_path, capsys, name):
    """A link to nothing (a loop; a cache's blob whose download did not finish) was reported "missing"."""
    for kind in ("dangling", "loop"):
        hf = copy_of(hf_dir, tmp_path / kind)
        (hf / name).unlink()
        (hf / name).symlink_to(hf / name if kind == "loop" else hf / "blobs" / "not-downloaded")
        code, err = import_cli(capsys, hf, tmp_path / kind / "out.pt")
        one_error_line(code, err, str(hf / name), "a symbolic link that leads nowhere, or back to itself")


def test_other_files_linked_outside_are_skipped_and_counted(hf_dir, tmp_path, capsys, caplog):
    """A README linked to a file elsewhere is neither read nor hashed: a warning names it, and the
    checkpoint records it as skipped."""
    from model.checkpoint import load_model

    hf = copy_of(hf_dir, tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("not the model's\n")
    (hf / "README.md").symlink_to(secret)
    (hf / "inside.md").symlink_to(hf / "config.json")
    out = tmp_path / "out.pt"
    code, err = import_cli(capsys, hf, out)
    assert code == 0, err
    warned = err + caplog.text
    assert "README.md" in warned and "1 file" in warned
    imported = load_model(out)[2]["extra"]["imported"]
    assert "README.md" not in imported["files"] and imported["skipped"] == ["README.md"]
    assert "inside.md" in imported["files"]


def test_a_large_file_the_import_never_reads_is_not_hashed(hf_dir, tmp_path, capsys, monkeypatch):
    """OPUS-MT clones carry tf_model.h5, rust_model.ot, flax_model.msgpack: each was hashed whole (4 GiB: 17 s) though
    the import reads none of them. Their sizes are recorded; the files it reads, the weights included, are hashed."""
    from model.checkpoint import load_model
    from pipeline.importers import hf_dir as hf_dir_module

    monkeypatch.setattr(hf_dir_module, "UNREAD_HASHED", 100_000)  # below the weights' and SentencePiece's sizes
    hf = copy_of(hf_dir, tmp_path)
    with open(hf / "tf_model.h5", "wb") as f:
        f.truncate(3 << 20)  # sparse
    code, err = import_cli(capsys, hf, tmp_path / "out.pt")
    assert code == 0, err
    imported = load_model(tmp_path / "out.pt")[2]["extra"]["imported"]
    assert imported["unhashed"] == {"tf_model.h5": 3 << 20} and "tf_model.h5" not in imported["files"]
    assert {"model.safetensors", "source.spm", "config.json"} <= set(imported["files"])  # read: hashed


def test_hugging_face_cache_snapshot_imports(hf_dir, tmp_path, capsys):
    """The hub cache's layout: snapshots/REV/NAME -> ../../blobs/HASH, within the same repo folder."""
    repo = tmp_path / "models--Helsinki-NLP--opus-mt-src-tgt"
    snap = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(hf_dir.iterdir())):
        shutil.copy(f, repo / "blobs" / f"blob{i}")
        (snap / f.name).symlink_to(Path("../../blobs") / f"blob{i}")
    code, err = import_cli(capsys, snap, tmp_path / "out.pt")
    assert code == 0, err


def test_symlinked_directory_itself_imports(hf_dir, tmp_path, capsys):
    (tmp_path / "link").symlink_to(hf_dir)
    code, err = import_cli(capsys, tmp_path / "link", tmp_path / "out.pt")
    assert code == 0, err


def test_generate_settings_the_import_cannot_keep_are_named(hf_dir, tmp_path, capsys, caplog):
    """Each changes what transformers' generate writes; they were dropped without a word (only three were named,
    then seven: renormalize_logits, which OPUS-MT directories ship, min_new_tokens, beam groups and the rest were
    not)."""
    hf = copy_of(hf_dir, tmp_path, edit_json("generation_config.json", suppress_tokens=[5], max_new_tokens=5,
                                             forced_bos_token_id=5, no_repeat_ngram_size=3, pad_token_id=7,
                                             renormalize_logits=True, min_new_tokens=4, num_beam_groups=2,
                                             diversity_penalty=0.5, encoder_no_repeat_ngram_size=2,
                                             exponential_decay_length_penalty=[5, 1.5], num_return_sequences=2,
                                             top_k=10))
    with caplog.at_level(logging.WARNING):
        code, err = import_cli(capsys, hf, tmp_path / "out.pt")
    assert code == 0, err
    [said] = [r.getMessage() for r in caplog.records if "not imported" in r.getMessage()]
    for setting in ("no_repeat_ngram_size=3", "suppress_tokens=[5]", "max_new_tokens=5", "forced_bos_token_id=5",
                    "pad_token_id=7", "renormalize_logits=True", "min_new_tokens=4", "num_beam_groups=2",
                    "diversity_penalty=0.5", "encoder_no_repeat_ngram_size=2",
                    "exponential_decay_length_penalty=[5, 1.5]"):
        assert setting in said, said
    assert "num_return_sequences" not in said and "top_k" not in said  # the best hypothesis, sampling: unchanged


def test_a_file_the_import_does_not_need_and_cannot_open_is_skipped_and_counted(hf_dir, tmp_path, capsys, caplog,
                                                                               monkeypatch):
    """An unreadable README.md failed the whole import at its very end ("permission denied"). Root reads any
    file, so the refusal is the operating system's answer, given here as it gives it (EACCES)."""
    from pipeline.importers import hf_files

    hf = copy_of(hf_dir, tmp_path)
    (hf / "README.md").write_text("model card")
    real = hf_files.digest

    def refused(path: Path) -> str:
        if path.name == "README.md":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(hf_files, "digest", refused)
    with caplog.at_level(logging.WARNING):
        code, err = import_cli(capsys, hf, tmp_path / "out.pt")
    assert code == 0, err
    assert "cannot open (not hashed): README.md" in caplog.text


def test_a_device_as_out_is_written_through(hf_dir, capsys):
    """`--out /dev/null` (a dry run) said "exists; pass --force"; devices are written through, never replaced."""
    import stat

    code, err = import_cli(capsys, hf_dir, Path("/dev/null"))
    assert code == 0, err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def sharded(bin_format: bool = False, index_edit: Callable[[dict[str, Any]], None] | None = None) -> Edit:
    """The weights split in two shards with their index, as save_pretrained writes a large model's (NLLB-200
    3.3B's): `bin_format` as pytorch_model-0000N-of-00002.bin; `index_edit` changes the index."""
    def edit(hf: Path) -> None:
        import torch
        from safetensors.torch import load_file, save_file

        state = load_file(str(hf / "model.safetensors"))
        (hf / "model.safetensors").unlink()
        names = sorted(state)
        index: dict[str, Any] = {"metadata": {}, "weight_map": {}}
        for k, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
            shard = f"{'pytorch_model' if bin_format else 'model'}-0000{k + 1}-of-00002." + (
                "bin" if bin_format else "safetensors")
            tensors = {name: state[name] for name in part}
            torch.save(tensors, hf / shard) if bin_format else save_file(tensors, str(hf / shard),
                                                                         metadata={"format": "pt"})
            index["weight_map"].update({name: shard for name in part})
        if index_edit is not None:
            index_edit(index)
        name = "pytorch_model.bin.index.json" if bin_format else "model.safetensors.index.json"
        (hf / name).write_text(json.dumps(index))
    return edit


@pytest.mark.parametrize("bin_format", [False, True])
def test_sharded_weights_import_as_the_single_file_does(hf_dir, tmp_path, capsys, bin_format):
    """A sharded checkpoint (model.safetensors.index.json and its shards) was refused as "model.safetensors:
    missing" with the weights beside it; it imports to the same weights as the single file."""
    import torch

    from model.checkpoint import load_model

    code, err = import_cli(capsys, hf_dir, tmp_path / "one.pt")
    assert code == 0, err
    code, err = import_cli(capsys, copy_of(hf_dir, tmp_path, sharded(bin_format)), tmp_path / "sharded.pt")
    assert code == 0, err
    one, sharded_model = (load_model(tmp_path / name)[0].state_dict() for name in ("one.pt", "sharded.pt"))
    assert one.keys() == sharded_model.keys()
    assert all(torch.equal(one[k], sharded_model[k]) for k in one)


def test_with_both_indexes_the_one_whose_shards_are_there_is_read(hf_dir, tmp_path, capsys):
    """A download of *.json and *.bin holds both indexes and the .bin shards only: the safetensors index was
    tried alone and its shards named missing."""
    hf = copy_of(hf_dir, tmp_path, sharded(bin_format=True))
    index = json.loads((hf / "pytorch_model.bin.index.json").read_text())
    index["weight_map"] = {k: v.replace("pytorch_model", "model").replace(".bin", ".safetensors")
                           for k, v in index["weight_map"].items()}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    code, err = import_cli(capsys, hf, tmp_path / "o.pt")
    assert code == 0, err


def test_a_bin_beside_sharded_safetensors_is_not_what_is_read(hf_dir, tmp_path, capsys):
    """A hub repository that gained safetensors later holds pytorch_model.bin beside model.safetensors.index.json:
    the import read the .bin while transformers reads the shards first (parity then failed, 16.7% identical, as
    if our backends were wrong). The import reads what transformers reads: here a changed tensor in a shard."""
    import torch
    from safetensors.torch import load_file, save_file

    from model.checkpoint import load_model

    code, err = import_cli(capsys, hf_dir, tmp_path / "bin.pt")
    assert code == 0, err
    hf = copy_of(hf_dir, tmp_path, sharded())
    torch.save(load_file(str(hf_dir / "model.safetensors")), hf / "pytorch_model.bin")  # the original, as .bin
    shard = hf / "model-00002-of-00002.safetensors"
    tensors = load_file(str(shard))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(shard), metadata={"format": "pt"})
    code, err = import_cli(capsys, hf, tmp_path / "both.pt")
    assert code == 0, err
    read = load_model(tmp_path / "both.pt")[0].state_dict()
    original = load_model(tmp_path / "bin.pt")[0].state_dict()
    assert [k for k in read if not torch.equal(read[k], original[k])]  # the shards' changed tensor, not the .bin


@pytest.mark.parametrize("index_edit, needles", [
    (lambda index: index["weight_map"].update({k: "model-00003-of-00002.safetensors"
                                               for k in list(index["weight_map"])[:1]}),
     ["model-00003-of-00002.safetensors: missing; model.safetensors.index.json names it"]),
    (lambda index: index["weight_map"].update({"extra.weight": "model-00001-of-00002.safetensors"}),
     ["model-00001-of-00002.safetensors: lacks 'extra.weight'"]),
    (lambda index: index["weight_map"].pop(sorted(index["weight_map"])[0]),
     ["which model.safetensors.index.json places in no shard"]),
    (lambda index: index.update(weight_map=[]), ["no weight_map of tensor names to shard files"]),
    (lambda index: index["weight_map"].update({k: "../model-00001-of-00002.safetensors"
                                               for k in list(index["weight_map"])[:1]}),
     ["is not a .safetensors file of the directory"]),
])
def test_a_damaged_shard_index_is_one_line(hf_dir, tmp_path, capsys, index_edit, needles):
    code, err = import_cli(capsys, copy_of(hf_dir, tmp_path, sharded(index_edit=index_edit)), tmp_path / "o.pt")
    one_error_line(code, err, *needles)



def test_a_sharded_models_damaged_tensor_is_named_with_its_shard(hf_dir, tmp_path, capsys):
    """A NaN or a wrong shape in a sharded model was refused naming the index file, not the shard that holds
    the tensor (the file to fetch again)."""
    import torch
    from safetensors.torch import load_file, save_file

    hf = copy_of(hf_dir, tmp_path, sharded())
    shard = hf / "model-00002-of-00002.safetensors"
    tensors = load_file(str(shard))
    name = sorted(k for k, v in tensors.items() if v.is_floating_point() and v.dim() == 2)[0]
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    code, err = import_cli(capsys, hf, tmp_path / "o.pt")
    one_error_line(code, err, f"{shard}: {name} holds 1 NaN or infinite value(s)")
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    code, err = import_cli(capsys, hf, tmp_path / "o.pt")
    one_error_line(code, err, f"{shard}: {name} has shape (3, 3)")

def test_a_checkpoint_is_never_written_to_a_file_named_dash(hf_dir, tmp_path, capsys, monkeypatch):
    """`--out -` took '-' for standard output, skipped its checks and wrote a checkpoint named '-' in the
    current directory (import, average, random-checkpoint alike): refused in one line."""
    monkeypatch.chdir(tmp_path)
    code, err = import_cli(capsys, hf_dir, Path("-"))
    one_error_line(code, err, "--out -: a checkpoint is a file, not standard output")
    code = run_cli("random-checkpoint", "-", "--preset", "tiny", "--vocab-size", "64")
    one_error_line(code, capsys.readouterr().err, "OUT -: a checkpoint is a file")
    (tmp_path / "run").mkdir()
    code = run_cli("average", tmp_path / "run", "--out", "-")
    one_error_line(code, capsys.readouterr().err, "--out -: a checkpoint is a file")
    assert not (tmp_path / "-").exists()


def test_a_directory_named_like_a_family_and_a_misspelt_family(hf_dir, tmp_path, capsys, monkeypatch):
    """`pipeline import marian --out m.pt` with the model in ./marian said "Missing argument 'HF_DIR|HUB_ID'"
    (marian was taken for the command); `pipeline import marain DIR` said "unexpected extra argument (DIR)"."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(hf_dir, tmp_path / "marian")
    assert run_cli("import", "marian", "--out", "a.pt") == 0, capsys.readouterr().err
    assert run_cli("import", "marian", "marian", "--out", "b.pt") == 0, capsys.readouterr().err
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()
    assert run_cli("import", "marain", "marian", "--out", "c.pt") == 2
    assert "no family 'marain': did you mean 'marian'?" in capsys.readouterr().err
    assert not (tmp_path / "c.pt").exists()
    # a family in capitals is that family; an unknown one said "unexpected extra argument (DIR)"
    assert run_cli("import", "Marian", "marian", "--out", "d.pt") == 0, capsys.readouterr().err
    assert (tmp_path / "d.pt").read_bytes() == (tmp_path / "a.pt").read_bytes()
    assert run_cli("import", "bogus", "marian", "--out", "e.pt") == 2
    assert "no family 'bogus': the families are marian, m2m100, nllb" in capsys.readouterr().err
    assert run_cli("import", "marian", "--help") == 0  # the command's help, not auto's
    assert "Usage: pipeline import marian" in capsys.readouterr().out
    # a usage error of `pipeline import DIR` pointed at `pipeline import auto --help`, a command never typed
    assert run_cli("import", "marian", "--out", "f.pt", "--bogus") == 2
    assert capsys.readouterr().err.strip().endswith("(see `pipeline import --help`)")
    assert run_cli("import", "marian", "marian", "--bogus") == 2
    assert capsys.readouterr().err.strip().endswith("(see `pipeline import marian --help`)")


def test_a_vocabularys_bad_ids_are_named_as_they_are():
    from runtime.tokenizer import id_gap

    assert id_gap([0, 1, 2]) is None
    assert id_gap([0, 1, 1, 3]) == "id 1 twice"
    assert id_gap([0, 2, 3]) == "no id 1"
    assert id_gap([-1, 0, 1, 2, 4]) == "no id 3, and a negative id -1"  # it said "no id 0"

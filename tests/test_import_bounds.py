"""`pipeline import m2m100 | nllb | marian` on directories whose files are too large, empty, of the wrong kind
or linked out (issue 58): one `error:` line naming the file and the fix, exit 2, before anything of the
hostile size is read or allocated; each JSON file read once per import; nothing outside the directory opened.
Marian's per-field cases are in test_import_hostile.py."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from helpers import cli_env, run_cli  # noqa: E402

from pipeline.importers import hf_files  # noqa: E402
from pipeline.importers.hf_files import CONFIG_LIMIT, VOCABULARY_LIMIT, ImportRefused, read_bounded  # noqa: E402
from tests.m2m100_fixture import make_m2m100_dir  # noqa: E402
from tests.marian_fixture import make_marian_dir  # noqa: E402
from tests.test_import_hostile import one_error_line  # noqa: E402


@pytest.fixture(scope="module")
def m2m_dir(tmp_path_factory) -> Path:
    """A tiny untrained M2M-100 directory (8 languages), shared read-only: every test edits its own copy."""
    return make_m2m100_dir(tmp_path_factory.mktemp("m2m") / "m2m100-tiny", train_steps=0, vocab_pieces=80)


@pytest.fixture(scope="module")
def nllb_dir(tmp_path_factory) -> Path:
    return make_m2m100_dir(tmp_path_factory.mktemp("nllb") / "nllb-tiny", family="nllb", train_steps=0,
                           vocab_pieces=80)


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory) -> Path:
    return make_marian_dir(tmp_path_factory.mktemp("marian") / "opus-mt-tiny", vocab_pieces=60, calibrate=False)


FAMILY_DIRS = {"m2m100": "m2m_dir", "nllb": "nllb_dir", "marian": "marian_dir"}


def copy_of(source: Path, tmp_path: Path) -> Path:
    hf = tmp_path / "hf"
    shutil.copytree(source, hf)
    return hf


def import_cli(capsys, family: str, hf: Path, out: Path) -> tuple[int, str]:
    capsys.readouterr()  # what building a fixture printed (transformers' progress bars)
    code = run_cli("import", family, hf, "--out", out)
    return code, capsys.readouterr().err


def edit_json(path: Path, **changes: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def capped_import(family: str, hf: Path, out: Path, cap: int = 3 << 30) -> tuple[subprocess.CompletedProcess, float]:
    """`pipeline import FAMILY HF --out OUT` in a subprocess whose address space is capped at `cap` bytes:
    (the process, its peak resident memory in MiB)."""
    script = (f"import resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))\n"
              "try:\n"
              "    from pipeline.cli import main; main(sys.argv[1:])\n"
              "finally:\n"
              "    print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
              )
    proc = subprocess.run([sys.executable, "-c", script, "import", family, str(hf), "--out", str(out)],
                          capture_output=True, text=True, env=cli_env(), timeout=180)
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("maxrss "), proc.stderr
    proc.stderr = "\n".join(lines[:-1]) + "\n"
    return proc, int(lines[-1].split()[1]) / 1024  # ru_maxrss: KiB on Linux


# -- 1. vocab_size against the weights' header before any table of its size ----------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", ["m2m100", "nllb"])
def test_vocab_size_the_weights_do_not_have_is_refused_before_any_table_of_it(request, tmp_path, family):
    """config.json's vocab_size 10^9: the tokenizer's filler ids ("madeupword") were a list of 10^9 strings,
    a MemoryError traceback at 5.7 GB; now one line from the weights' header, in a small process."""
    hf = copy_of(request.getfixturevalue(FAMILY_DIRS[family]), tmp_path)
    edit_json(hf / "config.json", vocab_size=10 ** 9)
    started = time.monotonic()
    proc, peak_mib = capped_import(family, hf, tmp_path / "o.pt")
    one_error_line(proc.returncode, proc.stderr, "config.json", "vocab_size 1000000000", "model.safetensors")
    assert peak_mib < 1500, peak_mib  # torch and transformers imported: ~0.5 GB; the table alone was 5.7 GB
    assert time.monotonic() - started < 90
    assert not (tmp_path / "o.pt").exists()


def test_m2m100_checks_the_weights_header_before_the_tokenizer(m2m_dir, tmp_path, capsys, monkeypatch):
    """In-process, the order itself: with vocab_size 10^9 the tokenizer (whose filler table is of vocab_size)
    is never reached."""
    from pipeline.importers import m2m100

    def tokenizer(*args: Any) -> Any:
        raise AssertionError("the tokenizer was built before config.json's sizes were checked")

    monkeypatch.setattr(m2m100, "tokenizer", tokenizer)
    hf = copy_of(m2m_dir, tmp_path)
    edit_json(hf / "config.json", vocab_size=10 ** 9)
    with pytest.raises(ImportRefused, match="vocab_size 1000000000"):
        m2m100.import_m2m100(hf, tmp_path / "o.pt")


# -- 2. every file read whole has a size limit, checked by reading at most limit + 1 bytes ------------


def sparse(path: Path, size: int) -> None:
    """`path` replaced by a sparse file of `size` bytes (instant, whatever the size)."""
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


CASES = [("m2m100", "config.json", CONFIG_LIMIT), ("m2m100", "generation_config.json", CONFIG_LIMIT),
         ("m2m100", "tokenizer_config.json", CONFIG_LIMIT), ("m2m100", "vocab.json", VOCABULARY_LIMIT),
         ("m2m100", "sentencepiece.bpe.model", 64 << 20), ("nllb", "tokenizer.json", VOCABULARY_LIMIT),
         ("nllb", "tokenizer_config.json", CONFIG_LIMIT), ("marian", "config.json", CONFIG_LIMIT),
         ("marian", "vocab.json", VOCABULARY_LIMIT), ("marian", "source.spm", 64 << 20)]


@pytest.mark.parametrize("family, name, limit", CASES, ids=[f"{f}-{n}" for f, n, _ in CASES])
def test_a_file_over_its_limit_is_one_line_naming_it_and_the_limit(request, tmp_path, capsys, family, name, limit):
    hf = copy_of(request.getfixturevalue(FAMILY_DIRS[family]), tmp_path)
    sparse(hf / name, limit + 1)
    code, err = import_cli(capsys, family, hf, tmp_path / "o.pt")
    one_error_line(code, err, str(hf / name), f"larger than {limit >> 20} MiB, the limit for {name}")
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.slow
def test_a_5_gb_config_json_is_refused_unread(m2m_dir, tmp_path):
    """A 5 GB config.json (sparse): refused by its size, in a process capped at 3 GiB, at once."""
    hf = copy_of(m2m_dir, tmp_path)
    sparse(hf / "config.json", 5 << 30)
    started = time.monotonic()
    proc, peak_mib = capped_import("m2m100", hf, tmp_path / "o.pt")
    one_error_line(proc.returncode, proc.stderr, str(hf / "config.json"), "limit")
    assert peak_mib < 1500 and time.monotonic() - started < 60


def test_the_bounded_read_never_waits_on_a_fifo_nor_reads_a_device(tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        with pytest.raises(ImportRefused, match="not a regular file"):
            read_bounded(path, 1024)
    grows = tmp_path / "vocab.json"  # the limit holds on the bytes read, whatever the size said
    grows.write_bytes(b"x" * 2048)
    with pytest.raises(ImportRefused, match="larger than 1024 bytes"):
        read_bounded(grows, 1024)
    assert read_bounded(grows, 2048) == b"x" * 2048


@pytest.mark.parametrize("name, make", [
    ("config.json", os.mkfifo),  # said "missing"
    ("model.safetensors", os.mkdir),  # said "missing (nor is there a pytorch_model.bin)"
    ("vocab.json", os.mkfifo),
])
def test_a_needed_file_that_is_a_pipe_or_directory_is_named_as_such(m2m_dir, tmp_path, capsys, name, make):
    hf = copy_of(m2m_dir, tmp_path)
    (hf / name).unlink()
    make(hf / name)
    code, err = import_cli(capsys, "m2m100", hf, tmp_path / "o.pt")
    one_error_line(code, err, str(hf / name), "not a regular file")
    assert "missing" not in err and not (tmp_path / "o.pt").exists()


# -- 3. each file read once per import -------------------------------------------------------------------


@pytest.mark.parametrize("family", ["m2m100", "nllb", "marian"])
def test_each_file_is_read_once_per_import(request, tmp_path, capsys, monkeypatch, family):
    reads: Counter[str] = Counter()
    real = hf_files.read_bounded

    def counted(path: Path, limit: int | None = None) -> bytes:
        reads[path.name] += 1
        return real(path, limit)

    monkeypatch.setattr(hf_files, "read_bounded", counted)
    hf = request.getfixturevalue(FAMILY_DIRS[family])
    code, err = import_cli(capsys, family, hf, tmp_path / "o.pt")
    assert code == 0, err
    assert reads and max(reads.values()) == 1, reads
    assert "config.json" in reads and "generation_config.json" in reads


# -- 4. a SentencePiece model that is empty, garbage or of another vocabulary ---------------------------


def foreign_spm() -> bytes:
    """A SentencePiece model whose pieces are in no vocabulary of these fixtures (Greek letters)."""
    import sentencepiece as spm

    words = ["αβγ δεζ ηθι κλμ", "νξο πρσ τυφ χψω", "αβγδ εζηθ ικλμ νξοπ"] * 50
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(words), model_writer=buf, vocab_size=40,
                                   model_type="unigram", hard_vocab_limit=False, minloglevel=2, num_threads=1)
    return buf.getvalue()


SPM_CASES = [("m2m100", "sentencepiece.bpe.model"), ("nllb", "sentencepiece.bpe.model"), ("marian", "source.spm"),
             ("marian", "target.spm")]


@pytest.mark.parametrize("content", ["empty", "garbage", "foreign"])
@pytest.mark.parametrize("family, name", SPM_CASES, ids=[f"{f}-{n}" for f, n in SPM_CASES])
def test_a_sentencepiece_model_that_is_not_the_vocabularys_is_one_line(request, tmp_path, capsys, family, name,
                                                                       content):
    """An empty sentencepiece.bpe.model was imported, exported and verified; serve then died with a traceback."""
    hf = copy_of(request.getfixturevalue(FAMILY_DIRS[family]), tmp_path)
    data = {"empty": b"", "garbage": b"\x08\x96\x01 not a model " * 20, "foreign": None}[content]
    (hf / name).write_bytes(foreign_spm() if data is None else data)
    code, err = import_cli(capsys, family, hf, tmp_path / "o.pt")
    line = one_error_line(code, err, str(hf / name))
    assert ("are not in" in line) if content == "foreign" else ("not a SentencePiece model" in line), line
    assert not (tmp_path / "o.pt").exists()


def bundle_with_empty_source(tokenizer_bytes: bytes) -> bytes:
    """A VocabTokenizer bundle (what an import stores) whose source SentencePiece model is empty, as the
    importers stored an empty sentencepiece.bpe.model before they checked it."""
    from runtime.tokenizer import BUNDLE_MAGIC

    body = tokenizer_bytes[len(BUNDLE_MAGIC):]
    end = body.index(b"\n")
    header = json.loads(body[:end])
    rest = body[end + 1:]
    target = rest[header["source_bytes"]:]
    header["source_bytes"] = 0
    return BUNDLE_MAGIC + json.dumps(header).encode() + b"\n" + target


def test_export_refuses_a_checkpoint_whose_tokenizer_does_not_load(marian_dir, tmp_path, capsys):
    from model.checkpoint import load_model, save_checkpoint

    good = tmp_path / "good.pt"
    assert run_cli("import", "marian", marian_dir, "--out", good) == 0
    model, tokenizer_bytes, payload = load_model(good, "cpu")
    bad = tmp_path / "bad.pt"
    save_checkpoint(bad, model, bundle_with_empty_source(tokenizer_bytes), extra=payload.get("extra") or {})
    capsys.readouterr()
    code = run_cli("export", bad, "--out", tmp_path / "model-dir", "--no-tensorrt")
    one_error_line(code, capsys.readouterr().err, str(bad), "source: not a SentencePiece model (0 bytes)")
    assert not (tmp_path / "model-dir").exists()


def test_a_model_dir_whose_spm_model_holds_an_empty_model_is_one_line(fp32_dir, marian_dir, tmp_path, capsys):
    """The model dir's spm.model, matching its manifest, with an empty SentencePiece model inside the bundle:
    one line naming spm.model (it loaded, and the first sentence died with a traceback)."""
    from model.checkpoint import load_model
    from runtime.tokenizer import TokenizerError, tokenizer_from_file
    from tests.helpers import FAST, assert_one_line_error, run_cli_captured, write_lines
    from tests.test_model_dir_hostile import damaged_copy

    good = tmp_path / "good.pt"
    assert run_cli("import", "marian", marian_dir, "--out", good) == 0
    bundle = bundle_with_empty_source(load_model(good, "cpu")[1])
    (tmp_path / "spm.model").write_bytes(bundle)
    with pytest.raises(TokenizerError, match="spm.model: source: not a SentencePiece model"):
        tokenizer_from_file(tmp_path / "spm.model")
    damaged = damaged_copy(fp32_dir, tmp_path, "spm.model", bundle)
    code, _, err = run_cli_captured(capsys, "serve-batch", damaged, write_lines(tmp_path / "in.txt", ["ab"]),
                                    "-o", tmp_path / "out.txt", *FAST)
    assert_one_line_error(code, err, str(damaged / "spm.model"), "not a SentencePiece model")


# -- 5 (m2m100 too): a pickle whose keys are not tensor names ---------------------------------------------


def test_a_pytorch_bin_with_an_integer_key_is_one_line(m2m_dir, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file

    hf = copy_of(m2m_dir, tmp_path)
    state: dict[Any, Any] = dict(load_file(str(hf / "model.safetensors")))
    state[1] = torch.zeros(3)
    torch.save(state, hf / "pytorch_model.bin")
    (hf / "model.safetensors").unlink()
    code, err = import_cli(capsys, "m2m100", hf, tmp_path / "o.pt")
    one_error_line(code, err, str(hf / "pytorch_model.bin"), "key 1 is not a tensor name")


# -- 7. a file linked out of the directory is refused before it is opened ---------------------------------


@pytest.mark.parametrize("content", ["{not json", '{"tokenizer_class": "NllbTokenizer", "legacy_behaviour": true}'],
                         ids=["garbage", "valid"])
@pytest.mark.parametrize("family", ["m2m100", "nllb"])
def test_tokenizer_config_linked_outside_is_refused_before_it_is_read(request, tmp_path, capsys, monkeypatch,
                                                                      family, content):
    """tokenizer_config.json was read (to tell NLLB from M2M-100) before the directory's files were checked to
    lie inside it: the outside file's garbage was the error. Now the link is refused, and no file outside the
    directory is opened."""
    hf = copy_of(request.getfixturevalue(FAMILY_DIRS[family]), tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "tokenizer_config.json").write_text(content)
    (hf / "tokenizer_config.json").unlink()
    (hf / "tokenizer_config.json").symlink_to(outside / "tokenizer_config.json")
    opened: list[str] = []
    real_open = os.open

    def watched(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(os.path.realpath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(hf_files.os, "open", watched)
    code, err = import_cli(capsys, family, hf, tmp_path / "o.pt")
    line = one_error_line(code, err, str(hf / "tokenizer_config.json"), "outside", "copy the file in")
    assert "unreadable" not in line and "legacy_behaviour" not in line
    assert not any(p.startswith(str(outside.resolve())) for p in opened), opened


@pytest.mark.parametrize("change", ["one more", "one less"])
def test_an_m2m100_vocab_json_off_by_one_is_refused(m2m_dir, tmp_path, capsys, change):
    """Every language token is numbered after vocab.json's ids: one id more moved `en` onto `ha`'s embedding row,
    and the import said nothing."""
    hf = copy_of(m2m_dir, tmp_path)
    vocab = json.loads((hf / "vocab.json").read_text())
    if change == "one more":
        vocab["zzz"] = len(vocab)
    else:
        vocab.pop(max(vocab, key=vocab.__getitem__))
    (hf / "vocab.json").write_text(json.dumps(vocab))
    code, err = import_cli(capsys, "m2m100", hf, tmp_path / "o.pt")
    one_error_line(code, err, str(hf / "vocab.json"), "madeup ids", "not config.json's vocab_size")
    assert not (tmp_path / "o.pt").exists()

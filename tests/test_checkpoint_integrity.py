"""Checkpoints carry their own SHA-256 (model/checkpoint.py): a few flipped bits anywhere
are refused by every loader (resume, average, export, load_model), with one line naming
the file; files written before the checksum load with a warning; damaged caches re-encode."""

from __future__ import annotations

import hashlib
import io
import logging
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import TINY, cli_env, make_parallel, pipeline_cmd, run_cli, write_parallel

from model import build_model, preset
from model.checkpoint import (
    FORMAT,
    CheckpointError,
    atomic_torch_save,
    load_model,
    read_checkpoint,
    save_checkpoint,
    step_checkpoints,
    torch_load_verified,
)


def flip_bits(path: Path, offset: int, mask: int = 0b1001) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def largest_weight(path: Path) -> str:
    weights = torch.load(path, weights_only=False)["model"]
    return max(weights, key=lambda k: weights[k].numel())


def weight_offset(path: Path, name: str) -> int:
    """Where a weight's bytes lie in the file (so the flip hits tensor data, not metadata)."""
    tensor = torch.load(path, weights_only=False)["model"][name]
    offset = path.read_bytes().find(tensor.numpy().tobytes())
    assert offset > 0
    return offset + tensor.numel() * tensor.element_size() // 2


@pytest.fixture()
def checkpoint(tmp_path, spm_bytes) -> Path:
    torch.manual_seed(0)
    model = build_model(preset("tiny", vocab_size=64))
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model, spm_bytes, extra={"note": "x"})
    return path


def test_the_checksum_covers_every_byte_and_the_file_stays_a_torch_zip(checkpoint):
    data = checkpoint.read_bytes()
    comment = zipfile.ZipFile(io.BytesIO(data)).comment
    assert comment.startswith(b"pipeline-sha256:")
    assert comment[len(b"pipeline-sha256:"):].decode() == hashlib.sha256(data[:-len(comment)]).hexdigest()
    assert torch.load(checkpoint, weights_only=False)["format"] == FORMAT  # any tool can still read it
    assert read_checkpoint(checkpoint)["extra"] == {"note": "x"}


def test_a_few_flipped_bits_anywhere_are_refused(checkpoint, tmp_path):
    """In the weights (what torch.load would accept silently), the pickle, the zip end
    record and the digest itself."""
    size = checkpoint.stat().st_size
    name = largest_weight(checkpoint)
    weights_at = weight_offset(checkpoint, name)
    for offset in (weights_at, 40, size - 90, size - 70, size - 1):
        bad = tmp_path / f"bad-{offset}.pt"
        bad.write_bytes(checkpoint.read_bytes())
        flip_bits(bad, offset)
        with pytest.raises(CheckpointError) as e:
            load_model(bad)
        assert str(bad) in str(e.value) and len(str(e.value).splitlines()) == 1
    flipped = tmp_path / f"bad-{weights_at}.pt"
    assert "checksum mismatch" in str(pytest.raises(CheckpointError, read_checkpoint, flipped).value)
    # Without the checksum torch would have loaded different weights without a word.
    assert not torch.equal(torch.load(flipped, weights_only=False)["model"][name],
                           torch.load(checkpoint, weights_only=False)["model"][name])


def test_truncated_and_foreign_files_are_refused(checkpoint, tmp_path):
    cut = tmp_path / "cut.pt"
    cut.write_bytes(checkpoint.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="damaged"):
        read_checkpoint(cut)
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    with pytest.raises(CheckpointError, match="not a pipeline checkpoint") as refused:
        read_checkpoint(text)
    assert "move it out" not in str(refused.value)
    # a save dir's step checkpoint cut short says the fix, as a damaged one does: the ones before it may be whole
    step = tmp_path / "checkpoint_00000020.pt"
    step.write_bytes(checkpoint.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"damaged one \(no checksum at its end\); move it out of its save dir "
                       r"\(training resumes, and export reads, the newest one left\), or retrain"):
        read_checkpoint(step)


def test_a_checkpoint_from_before_checksums_loads_with_a_warning(checkpoint, tmp_path, caplog):
    """Why not refuse: such files hold days of training and were written atomically; they
    are unverifiable, not suspect. The warning says so, every time."""
    legacy = tmp_path / "legacy.pt"
    torch.save(torch.load(checkpoint, weights_only=False), legacy)  # the old writer: plain torch.save
    with caplog.at_level(logging.WARNING):
        model, _, payload = load_model(legacy)
    assert payload["extra"] == {"note": "x"}
    assert any("cannot be verified" in r.getMessage() and str(legacy) in r.getMessage() for r in caplog.records)


def test_a_damaged_encoded_corpus_cache_is_encoded_again(tmp_path, caplog):
    from pipeline.corpus.data import CACHE_DIR, prepare_data

    src, tgt = write_parallel(tmp_path, "c", *make_parallel(60, seed=2))
    first = prepare_data(tmp_path / "run", src, tgt, None, None, vocab_size=40, max_len=64)
    (cached,) = (tmp_path / "run" / CACHE_DIR).glob("train-*.pt")
    flip_bits(cached, cached.stat().st_size // 2)
    with caplog.at_level(logging.WARNING):
        again = prepare_data(tmp_path / "run", src, tgt, None, None, vocab_size=40, max_len=64)
    assert any("checksum mismatch" in r.getMessage() for r in caplog.records)
    assert (again.train.src_ids == first.train.src_ids).all()
    assert torch_load_verified(cached)["src_ids"].shape == first.train.src_ids.shape  # rewritten, verified


def test_a_damaged_spm_model_in_a_save_dir_is_trained_again_or_written_back(tmp_path, caplog):
    """A truncated SAVE_DIR/spm.model was `error: not a SentencePiece model (100 bytes; ...)`, naming no file, on
    every rerun before the first checkpoint; a resumed run kept it as it was."""
    from model.errors import UserError
    from pipeline.corpus.data import prepare_data

    src, tgt = write_parallel(tmp_path, "c", *make_parallel(60, seed=2))
    run = tmp_path / "run"
    first = prepare_data(run, src, tgt, None, None, vocab_size=40, max_len=64)
    (run / "spm.model").write_bytes(first.spm_bytes[:100])
    with pytest.raises(UserError, match=rf"^{run / 'spm.model'}: not a SentencePiece model \(100 bytes"):
        prepare_data(run, src, tgt, None, None, vocab_size=40, max_len=64, write=False)  # torchrun's other ranks
    with caplog.at_level(logging.WARNING):
        again = prepare_data(run, src, tgt, None, None, vocab_size=40, max_len=64)
    assert f"{run / 'spm.model'}: not a SentencePiece model (100 bytes" in caplog.text and "training it again" in \
        caplog.text
    assert again.spm_bytes == (run / "spm.model").read_bytes() and len(again.spm_bytes) > 100  # a model again
    (run / "spm.model").write_bytes(b"damaged")
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # resumed: the checkpoints' tokenizer is the run's
        prepare_data(run, src, tgt, None, None, vocab_size=40, max_len=64, spm_bytes=first.spm_bytes)
    assert "differs from the tokenizer the run's checkpoints hold" in caplog.text
    assert (run / "spm.model").read_bytes() == first.spm_bytes


def test_checksum_digest_is_returned_and_written(tmp_path):
    path = tmp_path / "x.pt"
    digest = atomic_torch_save({"a": torch.arange(10)}, path)
    assert path.read_bytes().endswith(digest.encode())


# -- the real command line: resume, average and export refuse a bit-flipped checkpoint -------

def _cli(*args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(pipeline_cmd(*args), env=cli_env(), cwd=cwd, capture_output=True, text=True, timeout=300)


def _one_error_line(proc: subprocess.CompletedProcess[str], path: Path) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(path) in errors[0] and "checksum mismatch" in errors[0], proc.stderr
    return errors[0]


@pytest.mark.slow
def test_resume_average_and_export_refuse_a_bit_flipped_checkpoint(tmp_path):
    src, tgt = write_parallel(tmp_path, "train", *make_parallel(80, seed=4))
    run = tmp_path / "run"
    common = ["--save-dir", run, "--train-src", src, "--train-tgt", tgt, *TINY, "--save-every", "1"]
    assert run_cli("train", *common, "--max-steps", "2") == 0
    latest = step_checkpoints(run)[-1]
    flip_bits(latest, weight_offset(latest, largest_weight(latest)))
    before = latest.read_bytes()

    _one_error_line(_cli("train", *common, "--max-steps", "3", cwd=tmp_path), latest)
    assert [p.name for p in step_checkpoints(run)][-1] == latest.name and latest.read_bytes() == before
    _one_error_line(_cli("average", run, "--last", "2", cwd=tmp_path), latest)
    assert not (run / "averaged.pt").exists()
    _one_error_line(_cli("export", latest, "--out", tmp_path / "model", cwd=tmp_path), latest)
    assert not (tmp_path / "model").exists()


def test_export_says_it_passed_over_an_average_older_than_the_runs_newest_checkpoint(tmp_path, caplog):
    """A save dir whose averaged.pt was made before its newest step checkpoint exports that checkpoint (the average
    is stale); export said so at info level only, so the user who averaged got the last step without a word."""
    src, tgt = write_parallel(tmp_path, "train", *make_parallel(80, seed=4))
    run = tmp_path / "run"
    common = ["--save-dir", run, "--train-src", src, "--train-tgt", tgt, *TINY, "--save-every", "1"]
    assert run_cli("train", *common, "--max-steps", "1") == 0
    assert run_cli("average", run, "--last", "1") == 0
    assert run_cli("train", *common, "--max-steps", "2") == 0  # one step more: the average is older
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="export.plan"):
        assert run_cli("export", run, "--out", tmp_path / "model", "--no-tensorrt") == 0
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"exporting {step_checkpoints(run)[-1].name} (the latest step checkpoint: averaged.pt there does not "
               "average up to it; run `pipeline average` again" in m for m in said), said

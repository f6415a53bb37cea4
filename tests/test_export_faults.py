"""export never leaves its target missing or half-written: an atomic swap (or a backup put
back by the next run), SIGTERM handled like Ctrl-C, temps of killed runs removed, and a full
disk or read-only parent reported as one line naming --out."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_one_line_error, cli_env, dead_pid, hidden, pipeline_cmd, run_pipeline, small_tmpfs

from model import atomic
from model.manifest import MANIFEST
from pipeline.cli import describe_os_error

SMALL = ["--max-batch", "2", "--max-src-len", "16", "--max-tgt-len", "20", "--max-beam", "2", "--no-tensorrt"]


def export(ckpt: Path, out: Path, *extra: str) -> None:
    from export.api import export_model

    export_model(ckpt, out, tensorrt=False, max_batch=2, max_src_len=16, max_tgt_len=20, max_beam=2,
                 force="--force" in extra)


@pytest.fixture()
def exported(fp32_dir) -> Path:
    """An fp32 model dir of the random checkpoint (conftest, shared read-only: copy it to change it)."""
    return fp32_dir


# -- replacing a model dir -------------------------------------------------------------------


def test_replace_dir_swaps_in_one_step_where_possible(tmp_path):
    old, new = tmp_path / "m", tmp_path / "new"
    old.mkdir()
    (old / "f").write_text("old")
    new.mkdir()
    (new / "f").write_text("new")
    swapped = atomic.exchange(new, old)
    if not swapped:
        pytest.skip("renameat2(RENAME_EXCHANGE) is not supported on this file system")
    assert (old / "f").read_text() == "new" and (new / "f").read_text() == "old"


@pytest.mark.parametrize("where", [pytest.param("export", marks=pytest.mark.slow), "load"])
def test_crash_between_the_two_renames_is_undone_by_the_next_run(exported, random_checkpoint, tmp_path, where):
    """Where no atomic swap exists, replace_dir parks the old dir first; a process killed
    right then leaves no target. The next export or load puts the old one back."""
    import shutil

    from runtime.model_dir import LoadOptions, load

    out = tmp_path / "m"
    shutil.copytree(exported, out)
    parked = tmp_path / f".m.~pipeline-{dead_pid()}-old-x1y2z3"  # the state the killed process left
    parked.mkdir()
    os.replace(out, parked / "m")
    assert not out.exists()
    if where == "load":
        manifest = load(out, LoadOptions(backend="torch", device="cpu")).manifest
        assert manifest.precision == "fp32"
    else:
        export(random_checkpoint, out, "--force")
    assert (out / MANIFEST).is_file() and hidden(tmp_path) == []


def test_fallback_replacement_keeps_the_old_dir_when_the_second_rename_fails(tmp_path, monkeypatch):
    target, new = tmp_path / "m", tmp_path / "new"
    target.mkdir()
    (target / "f").write_text("old")
    new.mkdir()
    monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    real_replace = os.replace

    def failing(src, dst):
        if Path(src) == new:
            raise OSError(errno.EIO, "I/O error", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", failing)
    with pytest.raises(OSError):
        atomic.replace_dir(new, target)
    assert (target / "f").read_text() == "old" and hidden(tmp_path) == []


def test_a_live_exports_backup_is_left_alone(tmp_path):
    parked = tmp_path / f".m.~pipeline-{os.getpid()}-old-abc"
    (parked / "m").mkdir(parents=True)
    assert not atomic.restore_replaced_dir(tmp_path / "m") and atomic.remove_stale_temps(tmp_path) == []
    assert (parked / "m").is_dir()


# -- leftovers and signals ---------------------------------------------------------------------


@pytest.mark.slow
def test_partial_dirs_of_a_killed_export_are_removed(random_checkpoint, tmp_path):
    stale = tmp_path / f".m.~pipeline-{dead_pid()}-partial-abc"
    (stale / "sub").mkdir(parents=True)
    (stale / "encoder.onnx").write_bytes(b"x" * 1000)
    export(random_checkpoint, tmp_path / "m")
    assert hidden(tmp_path) == [] and (tmp_path / "m" / MANIFEST).is_file()


@pytest.mark.slow
def test_sigterm_during_export_exits_143_leaving_nothing(random_checkpoint, tmp_path):
    out = tmp_path / "m"
    proc = subprocess.Popen(pipeline_cmd("export", random_checkpoint, "--out", out, *SMALL), env=cli_env(),
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not hidden(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hidden(tmp_path), "export never created its temp dir"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "terminated (SIGTERM)" in err
    assert not out.exists() and hidden(tmp_path) == []


# -- full disk, read-only parent ----------------------------------------------------------------


@pytest.mark.slow
def test_full_disk_during_export_is_one_line_naming_out(random_checkpoint, tmp_path):
    with small_tmpfs(tmp_path / "disk", "256k") as disk:
        code, err = run_pipeline("export", random_checkpoint, "--out", disk / "m", *SMALL)
        assert_one_line_error(code, err, f"{disk / 'm'}: no space left on device; free space and rerun")
        assert list(disk.iterdir()) == []


@pytest.mark.slow
def test_read_only_parent_fails_before_exporting(random_checkpoint, tmp_path):
    with small_tmpfs(tmp_path / "ro", "1m", readonly=True) as ro:
        started = time.monotonic()
        code, err = run_pipeline("export", random_checkpoint, "--out", ro / "m", *SMALL)
        assert_one_line_error(code, err, f"{ro}: cannot write --out here (Read-only file system)")
        assert time.monotonic() - started < 60


def test_average_on_a_read_only_save_dir_names_its_default_output(tmp_path):
    """`pipeline average RUN` without --out on a save dir it cannot write said "cannot write --out here": an
    option the user never gave. It names the default output it means now."""
    from helpers import TINY, make_parallel, run_cli, write_parallel

    src, tgt = write_parallel(tmp_path, "train", *make_parallel(80, seed=4))
    with small_tmpfs(tmp_path / "run", "64m") as run:
        assert run_cli("train", "--save-dir", run, "--train-src", src, "--train-tgt", tgt, *TINY, "--max-steps",
                       "1") == 0
        subprocess.run(["mount", "-o", "remount,ro", str(run)], check=True)
        code, err = run_pipeline("average", run, "--last", "1")
        assert_one_line_error(code, err, f"{run}: cannot write averaged.pt (the default --out) here (Read-only file "
                                          "system)")


def test_torch_save_on_a_full_disk_is_an_oserror_naming_the_file(tmp_path):
    """torch.save reports a full disk as RuntimeError('... unexpected pos ...'): atomic_write
    turns it into ENOSPC on the target, and leaves neither file nor temp."""
    with small_tmpfs(tmp_path / "disk", "64k") as disk:
        with pytest.raises(OSError) as caught:
            with atomic.atomic_write(disk / "ckpt.pt") as f:
                torch.save({"w": torch.zeros(100_000)}, f)
        assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(disk / "ckpt.pt")
        assert list(disk.iterdir()) == []


@pytest.mark.parametrize("code, says", [
    (errno.ENOSPC, "out.en: no space left on device; free space and rerun"),
    (errno.EROFS, "out.en: read-only file system"),
    (errno.EACCES, "out.en: permission denied"),
    (errno.EISDIR, "out.en: is a directory"),
    (errno.ENOENT, "out.en: no such file or directory"),
])
def test_os_errors_read_as_path_and_fix(code, says):
    assert describe_os_error(OSError(code, os.strerror(code), "out.en")).startswith(says)


def test_a_checkpoint_whose_tokenizer_is_another_models_is_refused_by_export(random_checkpoint, tmp_path, capsys):
    """Export wrote a "verified" model dir that every command then refused (`spm.model: 200 pieces but the model has
    468; re-run pipeline export`, which wrote the same dir again)."""
    from helpers import run_cli_captured

    from model.checkpoint import load_model, save_checkpoint
    from model.config import ModelConfig
    from model.transformer import Transformer

    model, spm_bytes, _ = load_model(random_checkpoint, "cpu")
    bigger = Transformer(ModelConfig.from_dict({**model.cfg.to_dict(), "vocab_size": model.cfg.vocab_size + 8}))
    save_checkpoint(tmp_path / "mixed.pt", bigger, spm_bytes)
    code, _, err = run_cli_captured(capsys, "export", tmp_path / "mixed.pt", "--out", tmp_path / "dir", "--no-tensorrt")
    assert_one_line_error(code, err, f"pieces but the model's vocabulary {model.cfg.vocab_size + 8}")
    assert not (tmp_path / "dir").exists()


def test_the_verification_line_states_the_whole_tolerance(caplog):
    """An int8 export logged 'max abs log-prob difference 0.337 (tolerance 0.3)', a pass that read as a failure:
    its bound is 0.3 + 0.05 x |log-prob|, as the summary says."""
    import logging

    from export import verify
    from model import io_names

    with caplog.at_level(logging.INFO, logger="export.verify"):
        verify._summary("int8", 0.3, 0.05, {"int8": verify.Report({io_names.TOPK_LOG_PROBS: 0.337})}, "how")
    assert "difference 0.337 (tolerance 0.3 + 0.05 x |log-prob|)" in caplog.text

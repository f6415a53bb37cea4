"""Atomic writes: complete or absent, with the permissions a plain open() would give."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from model.checkpoint import atomic_torch_save
from model.errors import UserError
from pipeline.textio import atomic_output, refuse_overwriting_inputs


@pytest.fixture()
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_outputs_get_umask_permissions_not_owner_only(tmp_path, umask_022):
    with atomic_output(tmp_path / "out.txt") as f:
        f.write("line\n")
    atomic_torch_save({"x": torch.zeros(2)}, tmp_path / "ckpt.pt")
    for name in ("out.txt", "ckpt.pt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name


def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old\n")
    with pytest.raises(RuntimeError):
        with atomic_output(target) as f:
            f.write("half")
            raise RuntimeError("crash")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_refuse_overwriting_inputs_understands_directories(tmp_path):
    """An output inside a directory read whole, or a directory replaced whole that holds or lies in an
    input, is refused under any spelling; a neighbour whose name merely starts alike is not."""
    (tmp_path / "hf" / "sub").mkdir(parents=True)
    (tmp_path / "hf" / "vocab.json").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "hf")
    for out in ("hf/vocab.json", "hf/sub/../new.pt", "link/x.pt", "hf"):
        with pytest.raises(UserError, match="inside the input directory"):
            refuse_overwriting_inputs([], [tmp_path / out], input_dirs=[tmp_path / "hf"])
    refuse_overwriting_inputs([], [tmp_path / "hf2" / "x.pt", tmp_path / "x.pt"], input_dirs=[tmp_path / "hf"])
    for out_dir in ("hf", "link", "."):
        with pytest.raises(UserError, match="holds the input"):
            refuse_overwriting_inputs([tmp_path / "hf" / "vocab.json"], [], output_dirs=[tmp_path / out_dir])
        with pytest.raises(UserError, match="overlaps the input directory"):
            refuse_overwriting_inputs([], [], input_dirs=[tmp_path / "hf" / "sub"], output_dirs=[tmp_path / out_dir])
    refuse_overwriting_inputs([tmp_path / "hf" / "vocab.json"], [], output_dirs=[tmp_path / "hf" / "sub"])

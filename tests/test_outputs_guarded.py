"""No output option destroys what a command reads: an input file, a file of the model dir it serves, a
checkpoint or corpus of the run it averages, or anything outside --output-dir; a model dir is no training
save dir. Each refusal is one line before any work, and the thing it protects is left as it was."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from helpers import assert_one_line_error, run_cli_captured, write_lines

from model.manifest import MANIFEST


def _refused(capsys: pytest.CaptureFixture[str], *args: object, says: str) -> None:
    code, _, err = run_cli_captured(capsys, *args)
    assert_one_line_error(code, err, says)


def test_outputs_inside_the_model_dir_are_refused(capsys, fp32_dir, tmp_path):
    """The shared fixture's model dir is checked unchanged (names and digests) at the end of the session."""
    src = write_lines(tmp_path / "in.txt", ["ab cd", "ef"])
    ref = write_lines(tmp_path / "ref.txt", ["x", "y"])
    inside = "lies inside the input directory"
    _refused(capsys, "serve-batch", fp32_dir, src, "-o", fp32_dir / "spm.model", says=inside)
    _refused(capsys, "parity", fp32_dir, "--src", src, "--ref", ref, "--json", fp32_dir / MANIFEST, says=inside)
    _refused(capsys, "bench", fp32_dir, "--sentences", 2, "--rounds", 1, "--json", fp32_dir / MANIFEST, says=inside)
    _refused(capsys, "tune-decoding", fp32_dir, "--src", src, "--ref", ref, "--json", fp32_dir / "t.json",
             says=inside)


def test_a_wrong_model_dir_is_named_so_before_its_outputs_are_checked(capsys, tmp_path):
    """serve-batch given a folder of texts as MODEL_DIR and an output in it said the output "lies inside the
    input directory", not that the folder is no model dir."""
    src = write_lines(tmp_path / "in.txt", ["ab cd"])
    _refused(capsys, "serve-batch", tmp_path, src, "-o", tmp_path / "out.txt",
             says=f"{tmp_path}: no manifest.json; not a model directory")
    assert not (tmp_path / "out.txt").exists()


def test_a_model_dir_an_interrupted_export_left_parked_is_put_back_and_served(capsys, fp32_dir, tmp_path):
    """The check that MODEL_DIR is a model dir ran before the dir an interrupted `export --force` left parked
    was put back (ModelDir.open does it): serve-batch said "no such model directory"."""
    import shutil

    parked = tmp_path / ".m1.~pipeline-999999-old-x"  # (no process 999999: the export is dead)
    parked.mkdir()
    shutil.copytree(fp32_dir, parked / "m1")
    src = write_lines(tmp_path / "in.txt", ["ab cd"])
    code, out, err = run_cli_captured(capsys, "serve-batch", tmp_path / "m1", src, "-o", tmp_path / "out.txt",
                                      "--threads", 1)
    assert code == 0, err
    assert (tmp_path / "m1" / MANIFEST).is_file() and (tmp_path / "out.txt").read_text().count("\n") == 1


def test_tune_decoding_json_is_not_an_input(capsys, fp32_dir, tmp_path):
    src = write_lines(tmp_path / "in.txt", ["ab cd"])
    ref = write_lines(tmp_path / "ref.txt", ["x"])
    for target in (src, ref):
        _refused(capsys, "tune-decoding", fp32_dir, "--src", src, "--ref", ref, "--json", target,
                 says="this --json file is the input")
    assert src.read_text() == "ab cd\n" and ref.read_text() == "x\n"


def test_suffix_cannot_leave_the_output_dir(capsys, fp32_dir, tmp_path):
    src = write_lines(tmp_path / "in.txt", ["ab cd"])
    _refused(capsys, "serve-batch", fp32_dir, src, "--output-dir", tmp_path / "out" / "sub", "--suffix",
             "/../../escaped", says="--suffix '/../../escaped': a file name ending like .en, without a path")
    assert not list(tmp_path.rglob("*escaped*")) and not (tmp_path / "out").exists()
    for odd in ("..", ". ", "-", ".", ".e n"):  # named files 'x..', 'x. ' (a trailing space), 'x.-'
        _refused(capsys, "serve-batch", fp32_dir, src, "--output-dir", tmp_path / "out", "--suffix", odd,
                 says=f"--suffix {odd!r}: ")
    assert not (tmp_path / "out").exists()


def test_average_out_cannot_replace_a_file_of_the_run(capsys, tmp_path):
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    files = {name: f"{name}\n" for name in ("checkpoint_00000004.pt", "checkpoint_best.pt", "config.json",
                                             "data/train.src")}
    for name, text in files.items():
        (run / name).write_text(text)
    for name in files:
        _refused(capsys, "average", run, "--last", 2, "--out", run / name, says="--out would replace a file of the run")
    assert {name: (run / name).read_text() for name in files} == files
    # a new file named as a step checkpoint would be the run's newest: resume refused it, export took it
    _refused(capsys, "average", run, "--last", 2, "--out", run / "checkpoint_00009999.pt",
             says="or be taken for one of its checkpoints")
    assert not (run / "checkpoint_00009999.pt").exists()
    # under a directory named like a checkpoint: it made run/averaged.pt a directory, and plain `average` then failed
    _refused(capsys, "average", run, "--last", 2, "--out", run / "averaged.pt" / "x",
             says="would make a directory")
    assert not (run / "averaged.pt").exists()


def test_average_out_cannot_replace_the_runs_corpus_outside_its_save_dir(capsys, tmp_path, monkeypatch):
    """`average RUN --out train.de` replaced the training corpus (outside the save dir) with a checkpoint."""
    corpus = {name: write_lines(tmp_path / name, ["ab cd"]) for name in ("train.de", "train.en", "val.de", "val.en")}
    run = tmp_path / "run"
    run.mkdir()
    # as training records them: the options as typed (relative to where it ran), the fingerprints absolute
    (run / "config.json").write_text(json.dumps({
        "resolved_options": {"train_src": "train.de", "train_tgt": "train.en", "valid_src": "val.de",
                             "valid_tgt": "val.en"},
        "data_files": {name: {"path": str(path.resolve()), "size": 6, "sha256": "0" * 64}
                       for name, path in zip(("train_src", "train_tgt", "valid_src", "valid_tgt"), corpus.values())}}))
    monkeypatch.chdir(run)  # elsewhere than where training ran
    for path in corpus.values():
        _refused(capsys, "average", ".", "--out", path, says="--out")
        assert path.read_text() == "ab cd\n"


def test_average_never_writes_through_a_link_to_a_checkpoint_nor_into_a_model_dir(capsys, tmp_path, fp32_dir):
    """averaged.pt linked to checkpoint_best.pt (so that export takes it): `average RUN` wrote the average over the
    best checkpoint, or over one of its own inputs; `--out MODEL_DIR/model.pt --force` broke the model dir."""
    run = tmp_path / "run"
    run.mkdir()
    files = {name: f"{name}\n" for name in ("checkpoint_00000004.pt", "checkpoint_00000008.pt", "checkpoint_best.pt")}
    for name, text in files.items():
        (run / name).write_text(text)
    for target in files:
        (run / "averaged.pt").unlink(missing_ok=True)
        (run / "averaged.pt").symlink_to(target)
        _refused(capsys, "average", run, "--last", 2, says=f"is the input {run / target}")
    assert {name: (run / name).read_text() for name in files} == files
    model = fp32_dir / "model.pt" if (fp32_dir / "model.pt").exists() else fp32_dir / "x.pt"
    _refused(capsys, "average", run, "--last", 2, "--out", model, "--force", says="--out lies in a model dir")
    # a model dir given as the save dir: said so (it blamed an --out the user never gave)
    _refused(capsys, "average", fp32_dir, says="is an exported model dir, not a `pipeline train` --save-dir")


def test_a_model_dir_is_no_save_dir_and_train_numbers_are_checked(capsys, fp32_dir, tmp_path):
    _refused(capsys, "train", "--save-dir", fp32_dir, "--max-steps", 1, says="is an exported model dir")
    for option, value, says in (("--seed", -1, "--seed must be in 0..4294967295"),
                                ("--seed", 10 ** 21, "--seed must be in 0..4294967295"),
                                ("--lr-scale", 0, "--lr-scale must be in (0, 1e+06] (got 0.0)")):
        _refused(capsys, "train", "--save-dir", tmp_path / "run", option, value, says=says)
    assert not Path(tmp_path / "run").exists()


def test_an_empty_output_path_is_refused(capsys, fp32_dir, tmp_path):
    """'' (an unset shell variable) became the current directory: "error: : is a directory"."""
    src = write_lines(tmp_path / "in.txt", ["ab cd"])
    _refused(capsys, "serve-batch", fp32_dir, src, "-o", "", says="--output is empty; give a file path")


@pytest.mark.parametrize("args", [
    ("train", "--save-dir", "", "--max-steps", "1"),  # trained into the current directory
    ("random-checkpoint", ""),
    ("import", "m2m100", "", "--out", "x.pt"),
    ("average", ""),
    ("serve-batch", "", "in.txt", "-o", "out.txt"),
    ("serve-batch", "m", "", "-o", "out.txt"),  # an input: it read the current directory
    ("ray-translate", "m", "", "--output-dir", "out"),
    ("ray-translate", "m", "in.txt", "--output-dir", ""),  # it translated into the current directory
    ("parity", "m", "--src", "in.txt", "--ref", "in.txt", "--json", ""),
])
def test_an_empty_path_is_never_the_current_directory(capsys, tmp_path, monkeypatch, args):
    """click turns '' (an unset shell variable) into '.'; GivenPath refuses it where it is typed."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli_captured(capsys, *args)
    assert code == 2 and "is an empty path (is a shell variable unset?)" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_file_option_ending_with_a_slash_is_refused(capsys, tmp_path, monkeypatch):
    """`--out runs/new/` wrote a checkpoint file named `new` (Path drops the slash before our code sees it)."""
    monkeypatch.chdir(tmp_path)
    for args in (("random-checkpoint", "new/"), ("import", "m2m100", "hf", "--out", "new/")):
        code, _, err = run_cli_captured(capsys, *args)
        assert code == 2 and "'new/' ends with / (a directory); give a file path" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_missing_input_is_named_before_the_model_is_loaded(capsys, caplog, fp32_dir, tmp_path):
    caplog.set_level("INFO")
    _refused(capsys, "serve-batch", fp32_dir, tmp_path / "nosuch.txt", "-o", tmp_path / "out.txt",
             says="nosuch.txt: no such file")
    assert not [r for r in caplog.records if "loaded in" in r.getMessage()]  # the backend was never loaded


def test_average_out_replaces_another_file_only_with_force(capsys, tmp_path, trained_save_dir):
    """`average --out F` replaced any existing F in silence: another run's average, a model dir's model.pt. It
    needs --force, as export and random-checkpoint do; the save dir's own averaged.pt is replaced on each run, as
    before."""
    import shutil

    from model.checkpoint import read_checkpoint

    run = tmp_path / "run"
    shutil.copytree(trained_save_dir, run)
    other = tmp_path / "other" / "model.pt"  # (a name a run takes for a checkpoint is refused whatever exists)
    other.parent.mkdir()
    other.write_text("another run's average\n")
    _refused(capsys, "average", run, "--last", 2, "--out", other, says="exists; pass --force to replace it")
    assert other.read_text() == "another run's average\n"
    for _ in range(2):
        code, _, err = run_cli_captured(capsys, "average", run, "--last", 2)
        assert code == 0, err
    (run / "sub").mkdir()  # only the save dir's own averaged.pt goes unasked
    (run / "sub" / "averaged.pt").write_text("mine\n")
    _refused(capsys, "average", run, "--last", 2, "--out", run / "sub" / "averaged.pt", says="pass --force")
    code, _, err = run_cli_captured(capsys, "average", run, "--last", 2, "--out", other, "--force")
    assert code == 0, err
    assert read_checkpoint(other)["extra"]["averaged"]


def test_tune_decoding_json_dash_is_standard_output(capsys, fp32_dir, tmp_path, monkeypatch):
    """`--json -` wrote a file named '-' in the working directory (parity's writes standard output); a beam or
    alpha given twice was decoded twice."""
    src = write_lines(tmp_path / "in.txt", ["ab cd", "ef"])
    ref = write_lines(tmp_path / "ref.txt", ["x", "y"])
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli_captured(capsys, "tune-decoding", fp32_dir, "--src", src, "--ref", ref, "--beams",
                                      "1,1", "--alphas", "0.6,0.60", "--json", "-")
    assert code == 0, err
    assert not (tmp_path / "-").exists()
    report = json.loads(out)  # standard output holds the JSON alone (the table came first: `| jq` failed)
    assert [(t["beam_size"], t["alpha"]) for t in report["trials"]] == [(1, 0.6)]
    # what was tuned, on what and where (it was a bare list of trials), as bench and parity record it
    assert report["command"].startswith("pipeline tune-decoding ") and report["model"] == str(fp32_dir)
    assert (report["src"], report["ref"], report["best"]) == (str(src), str(ref), report["trials"][0])
    assert report["host"]["cpu_flags"] is not None and "--beam-size 1 --alpha 0.6" in report["export"]
    assert err.startswith("beam  alpha   BLEU   chrF")
    for command in (["parity", fp32_dir, "--src", src, "--ref", ref, "--backends", "torch", "--min-identical", "0",
                     "--max-bleu-delta", "100"], ["bench", fp32_dir, "--backends", "torch", "--batch-size", "1",
                                                  "--sentences", "2"]):
        code, out, err = run_cli_captured(capsys, *command, "--json", "-")
        assert code == 0 and isinstance(json.loads(out), dict), (out, err)
        assert json.loads(out)["command"] == shlex.join(["pipeline", *map(str, command), "--json", "-"])
        assert "backend" in err  # the table
        code, _, err = run_cli_captured(capsys, *command, "--json", f"{tmp_path}/newdir/")  # wrote a file "newdir"
        assert code == 2 and "ends with / (a directory); give a file path" in err and not (tmp_path / "newdir").exists()


def test_tune_decoding_suggests_the_export_of_the_model_dir_it_tuned(capsys, int8_dir, tmp_path):
    """Tuning an int8 model dir suggested `pipeline export CHECKPOINT --out NEW_DIR --beam-size ..`: an fp32 dir.
    The suggestion is the dir's own checkpoint and precision; stdin as both --src and --ref is refused (the
    references read an exhausted stdin: "- has 8 lines but - has 0")."""
    from model.manifest import read_manifest

    src = write_lines(tmp_path / "in.txt", ["ab cd", "ef"])
    ref = write_lines(tmp_path / "ref.txt", ["x", "y"])
    code, out, err = run_cli_captured(capsys, "tune-decoding", int8_dir, "--src", src, "--ref", ref, "--beams", "1",
                                      "--alphas", "0.6")
    assert code == 0, err
    manifest = read_manifest(int8_dir)
    checkpoint = manifest.source_checkpoint.path if Path(manifest.source_checkpoint.path).is_file() else "CHECKPOINT"
    shapes = "--max-batch 8 --max-src-len 32 --max-tgt-len 40 --max-beam 4"  # SMALL_LIMITS, not export's defaults
    want = (f"pipeline export {checkpoint} --int8 --int8-flavour {manifest.quantization} {shapes} --out NEW_DIR "
            "--beam-size 1")
    assert want in out, out
    _refused(capsys, "tune-decoding", int8_dir, "--src", "-", "--ref", "-", says="both standard input")
    # a checkpoint file that no longer holds what was exported (a later `average` replaced averaged.pt) is not
    # named, and a dir's language pair is kept (without it the new dir had no LibreTranslate route)
    from helpers import with_language_pair

    moved = with_language_pair(int8_dir, tmp_path / "pair", "de", "en")
    data = json.loads((moved / "manifest.json").read_text())
    data["source_checkpoint"]["sha256"] = "0" * 64
    (moved / "manifest.json").write_text(json.dumps(data))
    code, out, err = run_cli_captured(capsys, "tune-decoding", moved, "--src", src, "--ref", ref, "--beams", "1",
                                      "--alphas", "0.6")
    assert code == 0, err
    assert (f"pipeline export CHECKPOINT --int8 --int8-flavour {manifest.quantization} --src-lang de --tgt-lang en "
            f"{shapes} --out NEW_DIR") in out, out
    # the export options it was made with: a --max-beam 12 dir tuned at 12 was suggested an export refusing
    # "--beam-size 12 is above --max-beam 8"; a calibration file given, or none, became the default's
    for scales, flag in (({"kind": "static", "calibrated_on": "/data/cal.src", "chosen": "given"},
                          "--int8-calibrate /data/cal.src"), ({"kind": "per-row"}, "--no-int8-calibrate")):
        data["verification"]["int8_activation_scales"] = scales
        data["limits"]["max_beam"] = 6
        (moved / "manifest.json").write_text(json.dumps(data))
        code, out, err = run_cli_captured(capsys, "tune-decoding", moved, "--src", src, "--ref", ref, "--beams",
                                          "1", "--alphas", "0.6")
        assert code == 0 and f"--max-tgt-len 40 --max-beam 6 {flag} --out NEW_DIR" in out, out


def test_average_refuses_another_vocabulary_and_an_out_named_as_a_runs_checkpoint(capsys, tmp_path,
                                                                                   random_checkpoint):
    """A checkpoint of another run (same shapes, another SentencePiece model) copied into the save dir was
    averaged in (its ids are other pieces); `--out other_run/checkpoint_00000099.pt` planted an average that
    other run then refused to resume from, and exported as its latest step."""
    from model.checkpoint import read_checkpoint, save_checkpoint
    from model.config import ModelConfig
    from model.transformer import Transformer

    payload = read_checkpoint(random_checkpoint)
    model = Transformer(ModelConfig.from_dict(payload["model_config"]))
    model.load_state_dict(payload["model"])
    run, other = tmp_path / "run", tmp_path / "other"
    run.mkdir()
    other.mkdir()
    save_checkpoint(run / "checkpoint_00000002.pt", model, payload["spm_model"], extra={"step": 2})
    save_checkpoint(run / "checkpoint_00000004.pt", model, payload["spm_model"] + b"\0", extra={"step": 4})
    _refused(capsys, "average", run, "--last", 2,
             says="checkpoint_00000004.pt: its SentencePiece model differs from")
    assert not (run / "averaged.pt").exists()
    for name in ("checkpoint_00000099.pt", "checkpoint_best.pt"):
        _refused(capsys, "average", run, "--last", 1, "--out", other / name,
                 says="--out is named as a training run's own checkpoint")
    assert not list(other.iterdir())

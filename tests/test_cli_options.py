"""One home per fact: every CLI default and help comes from the dataclass that owns it, every user
error has one root, and the benchmark tools that ship in the package (random-checkpoint,
bench --serve) work as a user runs them."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest

from export.errors import ExportError, TensorRTUnavailable, VerificationError
from export.options import ExportOptions
from model.checkpoint import CheckpointError, CheckpointWriteError, load_model
from model.config import ConfigError, preset
from model.errors import UserError
from model.manifest import ModelDirError
from pipeline.cli import all_commands
from pipeline.evaluation.serve_bench import ServeBenchOptions
from pipeline.serve.options import RequestLimits, ServeHttpOptions
from pipeline.training.options import TrainOptions
from runtime.decoding import DecodingError
from runtime.errors import RuntimeUserError
from runtime.search import SearchError
from runtime.tokenizer import TokenizerError

COMMANDS = all_commands()


def command(name: str) -> click.Command:
    return COMMANDS[name]


def params(name: str) -> dict[str, click.Parameter]:
    return {p.name: p for p in command(name).params if p.name}


@pytest.mark.parametrize("cmd, classes", [
    ("train", (TrainOptions,)),
    ("serve", (ServeHttpOptions, RequestLimits)),
    ("bench", (ServeBenchOptions,)),
    ("export", (ExportOptions,)),
])
def test_every_option_takes_default_and_help_from_its_dataclass(cmd, classes):
    options = params(cmd)
    for cls in classes:
        for f in dataclasses.fields(cls):
            if "help" not in f.metadata:
                continue
            p = options[f.name]
            assert p.help == f.metadata["help"], (cmd, f.name)
            if f.default is not dataclasses.MISSING:
                assert p.default == f.default, (cmd, f.name, p.default, f.default)
            else:
                assert p.required, (cmd, f.name)


def test_train_has_no_option_outside_its_dataclass():
    """A new flag must be a TrainOptions field first, or the command would drop it."""
    names = {f.name for f in dataclasses.fields(TrainOptions)}
    assert set(params("train")) - {"help"} == names


def test_export_has_no_option_outside_its_dataclass():
    """Every `pipeline export` flag is an ExportOptions field (export_model's keywords) or one of DecodingOptions'
    search settings (recorded as ExportOptions.decoding), none written by hand; the other fields without a help
    text are what the command reads from its files."""
    from pipeline.commands.export import SEARCH

    options = {f.name for f in dataclasses.fields(ExportOptions) if "help" in f.metadata}
    assert set(params("export")) - {"help", "checkpoint"} == options | set(SEARCH)
    assert {f.name for f in dataclasses.fields(ExportOptions)} - options == {"references", "shortlist", "calibration",
                                                                             "decoding"}


def test_export_flags_keep_their_click_types():
    """What the hand-written options checked, the generated ones check: files that must exist, an --out
    that may be a directory, the tri-state --tensorrt/--no-tensorrt, ranges and choices."""
    options = params("export")
    for name in ("reference_src", "reference_tgt", "shortlist_src", "shortlist_tgt"):
        t = options[name].type
        assert isinstance(t, click.Path) and t.exists and t.file_okay and not t.dir_okay, name
    for name in ("out", "timing_cache"):
        t = options[name].type
        assert isinstance(t, click.Path) and not t.exists and t.file_okay and t.dir_okay, name
    assert options["out"].required
    trt = options["tensorrt"]
    assert trt.opts == ["--tensorrt"] and trt.secondary_opts == ["--no-tensorrt"] and trt.default is None
    assert options["fp16"].is_flag and not options["fp16"].secondary_opts
    assert options["reference_lines"].type.min == 0 and options["shortlist_frequent"].type.min == 1
    assert list(options["int8_flavour"].type.choices) == ["auto", "qdq", "rowwise", "ort-dynamic"]
    assert [p.name for p in command("export").params][:3] == ["checkpoint", "out", "fp16"]


def test_serve_decoding_flags_are_the_shared_ones():
    from runtime.decoding import PAPER, DecodingOptions

    options = params("serve")
    for name in ("beam_size", "alpha", "max_len_a", "max_len_b", "min_len", "nbest"):
        assert options[name].default == getattr(PAPER, name)
        assert options[name].help.startswith(DecodingOptions.help(name))
    from pipeline.serve.options import SERVE_BATCH_TOKENS  # the server's own: its batches wait on requests

    assert options["max_batch_tokens"].default == SERVE_BATCH_TOKENS <= PAPER.batch_tokens


@pytest.mark.parametrize("cls", [ConfigError, CheckpointError, CheckpointWriteError, ModelDirError, ExportError,
                                 VerificationError, TensorRTUnavailable, RuntimeUserError, TokenizerError,
                                 DecodingError, SearchError])
def test_every_user_error_has_the_one_root(cls):
    assert issubclass(cls, UserError)


def test_a_layer_error_is_one_line_and_exit_2(tmp_path, capsys):
    from pipeline.cli import main

    bad = tmp_path / "not-a-checkpoint.pt"
    bad.write_bytes(b"garbage")
    with pytest.raises(SystemExit) as e:
        main(["export", str(bad), "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith("error: ") and "Traceback" not in err and str(bad) in err


@pytest.mark.slow
def test_bench_serve_refuses_several_backends_before_any_work(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("a\n")
    result = subprocess.run([sys.executable, "-m", "pipeline", "bench", str(tmp_path), "--serve", str(src),
                             "--backends", "torch,onnxruntime"], capture_output=True, text=True)
    assert result.returncode == 2 and "one MODEL_DIR on one backend" in result.stderr


def test_serve_bench_concurrency_must_be_counts():
    assert ServeBenchOptions(concurrency="1, 4").levels() == [1, 4]
    for bad in ("", "0,2", "a"):
        with pytest.raises(UserError, match="--concurrency"):
            ServeBenchOptions(concurrency=bad).levels()


def _pipeline(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd)


@pytest.mark.slow
def test_random_checkpoint_then_export_then_bench_serve(tmp_path):
    """The benchmark recipe as a user runs it: a random-weight checkpoint (weights fixed by the seed,
    never overwriting), exported, then `pipeline serve` loaded and checked against serve-batch."""
    pytest.importorskip("httpx")
    ckpt = tmp_path / "r.pt"
    made = _pipeline("random-checkpoint", ckpt, "--preset", "tiny", "--vocab-size", "120", "--seed", "3")
    assert made.returncode == 0, made.stderr
    model, _, _ = load_model(ckpt)
    assert model.cfg.vocab_size <= 120

    again = _pipeline("random-checkpoint", ckpt, "--preset", "tiny", "--vocab-size", "120")
    assert again.returncode == 2 and "--force" in again.stderr
    from pipeline.evaluation.random_model import make_random_checkpoint

    twin = tmp_path / "twin.pt"
    make_random_checkpoint(twin, "tiny", 120, seed=3)
    twin_model, _, _ = load_model(twin)
    assert twin_model.cfg == model.cfg
    for (name, a), (_, b) in zip(model.state_dict().items(), twin_model.state_dict().items()):
        assert a.equal(b), name

    exported = _pipeline("export", ckpt, "--out", tmp_path / "m", "--no-tensorrt", "--max-src-len", "16",
                         "--max-tgt-len", "24", "--max-batch", "8", "--max-beam", "4")
    assert exported.returncode == 0, exported.stderr
    src = tmp_path / "src.txt"
    src.write_text("".join(f"{w} {w}{i} x{i}\n" for i, w in enumerate(["ab", "cd", "ef", "gh"] * 3)))
    out = tmp_path / "serve.json"
    bench = _pipeline("bench", tmp_path / "m", "--serve", src, "--threads", "1",
                      "--concurrency", "1,3", "--requests", "6", "--lines-per-request", "2",
                      "--beam-size", "2", "--json", out)
    assert bench.returncode == 0, bench.stderr
    report = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 3]
    for level in report["levels"]:
        assert level["requests"] == 6 and level["errors"] == 0
        assert level["mismatched_lines"] == 0  # the server answers exactly what serve-batch writes
        assert level["sentences_per_s"] > 0 and level["latency_p50_s"] <= level["latency_p99_s"]
    assert report["server_exit_code"] == 0 and report["serve_batch"]["sentences"] == 12
    assert report["beam_size"] == 2
    assert report["backend"] == "onnxruntime"  # the one that served, not "auto"
    # serve-batch's target tokens as bench counts them in-process (EOS left out): the --serve report set
    # serve-batch's count with one EOS per line beside bench's without
    counted = _pipeline("bench", tmp_path / "m", "--src", src, "--sentences", "12", "--batch-size", "12",
                        "--backends", "onnxruntime", "--threads", "1", "--beam-size", "2", "--json", "-")
    assert counted.returncode == 0, counted.stderr
    [row] = json.loads(counted.stdout)["results"]
    assert report["serve_batch"]["target_tokens"] == row["target_tokens"]
    assert "clients" in bench.stdout  # the table

    docs = tmp_path / "docs.txt"  # --paragraph 3: three sentences a document, sent with "split": "sentences"
    docs.write_text("".join(f"{w} {w}{i}.\n" for i, w in enumerate(["ab", "cd", "ef"] * 3)))
    bench = _pipeline("bench", tmp_path / "m", "--serve", docs, "--backends", "onnxruntime", "--threads", "1",
                      "--concurrency", "2", "--requests", "3", "--lines-per-request", "1", "--paragraph", "3",
                      "--beam-size", "2", "--json", out)
    assert bench.returncode == 0, bench.stderr
    report = json.loads(out.read_text())
    assert report["lines"] == 3 and report["paragraph"] == 3
    assert report["levels"][0]["errors"] == 0 and report["levels"][0]["mismatched_lines"] == 0

    # --api both: the same levels in LibreTranslate's form too, to the model served as de-en (documents)
    bench = _pipeline("bench", tmp_path / "m", "--serve", docs, "--backends", "onnxruntime", "--threads", "1",
                      "--concurrency", "2", "--requests", "3", "--lines-per-request", "1", "--api", "both",
                      "--pair", "de-en", "--beam-size", "2", "--json", out)
    assert bench.returncode == 0, bench.stderr
    report = json.loads(out.read_text())
    assert [lv["api"] for lv in report["levels"]] == ["native", "libretranslate"] and report["pair"] == "de-en"
    assert all(lv["requests"] == 3 and lv["errors"] == 0 and lv["mismatched_lines"] == 0 for lv in report["levels"])

    # What a user waits for: our serve-batch and CTranslate2's script on the same weights, whole processes.
    pytest.importorskip("ctranslate2")
    whole = tmp_path / "whole.json"
    timed = _pipeline("bench", tmp_path / "m", "--whole-process", src, "--compare", "ctranslate2", "--rounds", "1",
                      "--threads", "1", "--beam-size", "2", "--fixed-length", "3", "--json", whole)
    assert timed.returncode == 0, timed.stderr
    rows = json.loads(whole.read_text())["results"]
    assert sorted((r["engine"], r["precision"]) for r in rows) == [
        ("ctranslate2", "fp32"), ("ctranslate2", "int8"), ("onnxruntime", "fp32")]
    assert all(r["lines"] == 12 and r["wall_s"] > 0 and r["peak_rss_mb"] > 10 for r in rows)
    assert {r["model_dir"] for r in rows} == {str(tmp_path / "m")}  # CTranslate2's: converted from it
    assert "whole process" in timed.stdout


def test_validation_files_from_a_save_dir(tmp_path):
    from pipeline.training.trainer import validation_files

    save = tmp_path / "run"
    (save / "data").mkdir(parents=True)
    ckpt = save / "checkpoint_5.pt"
    assert validation_files(ckpt) is None  # no config.json
    (save / "config.json").write_text(json.dumps({"resolved_options": {"builtin_pairs": 100}}))
    assert validation_files(save) is None  # the built-in corpus' files are gone
    for name in ("valid.src", "valid.tgt"):
        (save / "data" / name).write_text("x\n")
    assert validation_files(ckpt) == (save / "data" / "valid.src", save / "data" / "valid.tgt")
    # as training records the built-in split now: a line edited or added since is not the run's held-out set (it
    # was recorded as the references, or failed export as "has 501 lines but ... 500")
    from pipeline.corpus.data import file_fingerprint

    (save / "config.json").write_text(json.dumps({"resolved_options": {"builtin_pairs": 100}, "builtin_files": {
        name: file_fingerprint([save / "data" / name])[0] for name in ("valid.src", "valid.tgt")}}))
    assert validation_files(ckpt) == (save / "data" / "valid.src", save / "data" / "valid.tgt")
    (save / "data" / "valid.src").write_text("x\ny\n")
    assert validation_files(ckpt) is None
    src, tgt = tmp_path / "v.de", tmp_path / "v.en"
    src.write_text("a\n")
    tgt.write_text("b\n")
    (save / "config.json").write_text(json.dumps({"resolved_options": {
        "builtin_pairs": None, "valid_src": str(src), "valid_tgt": str(tgt)}}))
    assert validation_files(ckpt) == (src, tgt)
    src.unlink()  # gone since: none to read, but export names what the run recorded
    assert validation_files(ckpt) is None and validation_files(ckpt, existing=False) == (src, tgt)


def test_a_save_dirs_validation_files_are_the_ones_it_trained_on_wherever_export_runs(tmp_path, monkeypatch):
    """config.json's options hold the paths as typed: export from another directory said a run's validation set
    was gone, or recorded that directory's own val.de / val.en as the run's held-out set (and calibrated int8 on
    it). The fingerprints' absolute paths are used, and a file changed since training is not."""
    from pipeline.corpus.data import file_fingerprint
    from pipeline.training.trainer import validation_files

    project, elsewhere, save = tmp_path / "proj", tmp_path / "elsewhere", tmp_path / "proj" / "run"
    save.mkdir(parents=True)
    elsewhere.mkdir()
    for folder, words in ((project, "Haus"), (elsewhere, "rot")):
        (folder / "val.de").write_text(f"{words}\n")
        (folder / "val.en").write_text(f"{words}\n")
    (save / "config.json").write_text(json.dumps({
        "resolved_options": {"builtin_pairs": None, "valid_src": "val.de", "valid_tgt": "val.en"},
        "data_files": {name: file_fingerprint([project / f"val.{lang}"])[0]
                       for name, lang in (("valid_src", "de"), ("valid_tgt", "en"))}}))
    for cwd in (tmp_path, elsewhere):
        monkeypatch.chdir(cwd)
        assert validation_files(save) == (project / "val.de", project / "val.en")
    (project / "val.de").write_text("Haus\nund mehr\n")  # changed since the run trained on it
    assert validation_files(save) is None
    assert validation_files(save, existing=False) == (project / "val.de", project / "val.en")


def _save_dir_validated_on(tmp_path: Path, src_text: str, tgt_text: str, fingerprinted: bool = False
                           ) -> tuple[Path, Path, Path]:
    """A save dir of one random `tiny` checkpoint whose config.json names a validation pair of these texts (with
    their fingerprints, as training records them, where `fingerprinted`)."""
    from pipeline.corpus.data import file_fingerprint
    from pipeline.evaluation.random_model import make_random_checkpoint

    save = tmp_path / "run"
    save.mkdir()
    make_random_checkpoint(save / "checkpoint_3.pt", "tiny", 120, seed=2)
    src, tgt = tmp_path / "v.de", tmp_path / "v.en"
    src.write_text(src_text)
    tgt.write_text(tgt_text)
    config: dict[str, Any] = {"resolved_options": {"builtin_pairs": None, "valid_src": str(src), "valid_tgt": str(tgt)}}
    if fingerprinted:
        config["data_files"] = {"valid_src": file_fingerprint([src])[0], "valid_tgt": file_fingerprint([tgt])[0]}
    (save / "config.json").write_text(json.dumps(config))
    return save, src, tgt


def test_an_int8_export_says_once_that_the_runs_validation_set_changed(tmp_path):
    """The held-out set and int8's calibration both look for the run's validation set: a changed one was warned
    of twice in one export."""
    save, src, _ = _save_dir_validated_on(tmp_path, "ab cd\n", "AB\n", fingerprinted=True)
    src.write_text("ab cd ef\n")  # changed since the run trained
    done = _pipeline("export", save / "checkpoint_3.pt", "--out", tmp_path / "m", "--no-tensorrt", "--int8",
                     "--max-src-len", "16", "--max-tgt-len", "24")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("changed since it trained: not used") == 1, done.stderr


@pytest.mark.slow
def test_export_records_the_save_dirs_held_out_translations(tmp_path):
    """`pipeline export` on a checkpoint of a save dir records the fp32 model's translations of its
    validation set, as the torch backend serves them; --reference-lines 0 records none."""
    from model.checkpoint import load_model
    from runtime.model_dir import LoadOptions, load
    from runtime.translate import translate_lines

    save, src, tgt = _save_dir_validated_on(tmp_path, "ab cd\n\nef gh ij\nkl\n", "AB\nBLANK SOURCE\nEF\nKL\n")
    done = _pipeline("export", save / "checkpoint_3.pt", "--out", tmp_path / "m", "--no-tensorrt",
                     "--max-src-len", "16", "--max-tgt-len", "24", "--reference-lines", "2")
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "m" / "references.json").read_text())
    assert record["sources"] == ["ab cd", "ef gh ij"] and record["references"] == ["AB", "EF"]
    loaded = load(tmp_path / "m", LoadOptions(backend="torch"))
    backend, tokenizer = loaded.backend, loaded.tokenizer
    assert record["lines"] == translate_lines(backend, tokenizer, record["sources"], beam_size=4)
    assert load_model(save / "checkpoint_3.pt")[0].cfg.vocab_size <= 120

    from pipeline.commands.export import reference_set

    assert reference_set(save / "checkpoint_3.pt", None, None, 0) is None  # --reference-lines 0: none
    assert reference_set(save / "checkpoint_3.pt", src, tgt, 1) == (["ab cd"], ["AB"])
    with pytest.raises(click.UsageError, match="both"):
        reference_set(save / "checkpoint_3.pt", src, None, 5)


def test_help_lists_every_command_without_importing_any():
    """`pipeline --help` lists each command's own first sentence (SUMMARIES, kept equal here) without
    importing the commands: torch alone made it take seconds."""
    from pipeline.cli import SUMMARIES

    assert SUMMARIES == {name: c.get_short_help_str(limit=1000) for name, c in COMMANDS.items()}
    code = ("import sys\nfrom pipeline.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('pipeline.commands.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1], env={"COLUMNS": "100", "PATH": ""})
    assert done.returncode == 0, done.stderr
    listing = done.stdout.splitlines()
    assert listing[-1] == "[]"
    for name in COMMANDS:
        assert any(line.strip().startswith(name + " ") for line in listing), name


def test_random_checkpoint_takes_a_students_decoder_depth(tmp_path):
    """`random-checkpoint --decoder-layers N`: the preset's shape with an N-layer decoder (a student's, to bench)."""
    from helpers import run_cli

    out = tmp_path / "student.pt"
    assert run_cli("random-checkpoint", out, "--preset", "tiny", "--vocab-size", 64, "--decoder-layers", 1) == 0
    model, _, _ = load_model(out)
    assert model.cfg.n_dec_layers == 1 and model.cfg.n_enc_layers == preset("tiny", 64).n_enc_layers
    assert len(model.decoder) == 1


def test_help_says_a_model_dirs_own_decoding_defaults_come_first(capsys):
    """An imported model decodes with its own defaults (alpha 1.0, transformers' rules) where the user gives
    none, so --help of a command that decodes a model dir says so; the demo decodes its own model."""
    from helpers import run_cli

    assert run_cli("serve-batch", "--help") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "the model dir's, else 0.6" in out and "the model dir's, else 4" in out
    assert run_cli("demo", "--help") == 0
    assert "the model dir's" not in capsys.readouterr().out


@pytest.mark.slow
def test_bench_serve_says_why_the_server_failed_in_one_line(fp32_dir, tmp_path):
    """A server that would not start was "see /tmp/serve-bench-XXXX/serve.log", a log deleted with its temporary
    dir before the message was read; a level whose every request was refused printed latencies (of the quick
    refusals) and exited 0."""
    pytest.importorskip("httpx")
    src = tmp_path / "src.txt"
    src.write_text("ab cd\nef gh\n")
    common = ["bench", fp32_dir, "--serve", src, "--backends", "onnxruntime", "--threads", "1", "--concurrency",
              "1", "--requests", "2", "--beam-size", "1"]
    bogus = _pipeline(*common, "--server-arg=--bogus")
    assert bogus.returncode == 2, bogus.stderr
    assert bogus.stderr.strip().splitlines()[-1] == ("error: the server exited with status 2 before it was ready; "
                                                     "it said: error: No such option '--bogus'. Did you mean "
                                                     "'--host'? (see `pipeline serve --help`)")
    keys = tmp_path / "keys.txt"
    keys.write_text("k3y-for-tests-0001\n")
    refused = _pipeline(*common, f"--server-arg=--api-keys={keys}", "--server-arg=--require-api-key")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith(
        "error: every request at 1 clients was refused (2; the first 401: "), refused.stderr[-500:]

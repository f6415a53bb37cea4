"""What parity, tune-decoding, bench, random-checkpoint and train's tokenizer refuse before the work, each in one
line: inputs that cannot be read twice, a source with nothing to compare, outputs that would replace each other,
a grid with a trial that cannot run, a fixed length past the model's limit, model dirs of two tokenizers, a
vocabulary smaller than the corpus' characters. Each once passed in silence, ran for minutes first, or ended in a
traceback."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from helpers import assert_one_line_error, run_cli, run_cli_captured, write_lines

from model.errors import UserError
from pipeline.textio import read_lines


@pytest.fixture()
def pair(tmp_path):
    return write_lines(tmp_path / "s.txt", ["ab cd", "ef gh"]), write_lines(tmp_path / "r.txt", ["x y", "z"])


def test_parity_reads_its_source_once_per_backend_so_it_must_be_a_file(capsys, fp32_dir, tmp_path, pair,
                                                                        monkeypatch):
    """stdin was a ValueError traceback, <(...) an IndexError in sacrebleu, a named pipe a hang."""
    src, ref = pair
    fifo = tmp_path / "src.fifo"
    os.mkfifo(fifo)
    for given in ("-", fifo):
        code, _, err = run_cli_captured(capsys, "parity", fp32_dir, "--src", given, "--ref", ref)
        assert_one_line_error(code, err, "parity translates --src once per backend and reads it again each time")
    # a missing file or a directory is said so (they were blamed on stdin and pipes)
    for given, says in ((tmp_path / "nope.src", "nope.src: no such file"), (tmp_path, "is a directory")):
        code, _, err = run_cli_captured(capsys, "parity", fp32_dir, "--src", given, "--ref", ref)
        assert_one_line_error(code, err, says)


def test_parity_of_a_source_without_text_fails_instead_of_passing(capsys, fp32_dir, tmp_path):
    """Five blank lines: "parity: passed", BLEU 0.00, identical 100%: a gate that compared nothing."""
    blank = write_lines(tmp_path / "blank.txt", ["", " ", "", "", ""])
    code, _, err = run_cli_captured(capsys, "parity", fp32_dir, "--src", blank, "--ref", blank)
    assert_one_line_error(code, err, "no line with text to translate; parity would pass having compared nothing")


def test_parity_json_may_not_be_a_file_save_hyps_writes(capsys, fp32_dir, tmp_path, pair, monkeypatch):
    src, ref = pair
    monkeypatch.chdir(tmp_path)  # --save-hyps - made a directory named "-" here
    code, _, err = run_cli_captured(capsys, "parity", fp32_dir, "--src", src, "--ref", ref, "--save-hyps", "-")
    assert_one_line_error(code, err, "--save-hyps -: give a directory")
    assert not (tmp_path / "-").exists()
    hyps = tmp_path / "hyps"
    code, _, err = run_cli_captured(capsys, "parity", fp32_dir, "--src", src, "--ref", ref, "--backends",
                                    "onnxruntime", "--save-hyps", hyps, "--json", hyps / "onnxruntime.fp32.txt")
    assert code == 2 and "is a file --save-hyps writes" in err
    assert not hyps.exists()


def test_parity_warns_of_lines_min_len_cannot_hold_for_as_serve_batch_does(capsys, caplog, fp32_dir, pair):
    """The search stops a line at its maximum output length (a * source tokens + b) even below --min-len:
    serve-batch counted those lines in a warning, parity (translating the same way) said nothing."""
    src, ref = pair
    with caplog.at_level(logging.WARNING):
        for min_len in (1, 2):  # two short lines: at most floor(0.1 * tokens + 1) = 1 token each
            code, _, err = run_cli_captured(capsys, "parity", fp32_dir, "--src", src, "--ref", ref, "--backends",
                                            "torch", "--max-len-a", "0.1", "--max-len-b", "1", "--min-len", min_len)
            assert code in (0, 1) and "Traceback" not in err
    warnings = [r.getMessage() for r in caplog.records if "below --min-len" in r.getMessage()]
    assert len(warnings) == 1 and "2 line(s)" in warnings[0] and "--min-len 2" in warnings[0], warnings


def test_tune_decoding_checks_every_trial_before_the_first_runs(capsys, caplog, fp32_dir, pair):
    """A bad beam or alpha late in the grid was found after the trials before it had run, and they were lost."""
    src, ref = pair
    for grid, says in ((("--beams", "1,9"), "--beams 9: this model's backend takes beams up to 8"),
                       (("--beams", "1", "--alphas", "0.6,nan"), "--alphas must be a number from 0 to 20")):
        with caplog.at_level(logging.INFO, logger="pipeline.evaluation.tuning"):
            caplog.clear()
            code, _, err = run_cli_captured(capsys, "tune-decoding", fp32_dir, "--src", src, "--ref", ref, *grid)
        assert_one_line_error(code, err, says)
        assert "BLEU" not in caplog.text  # no trial ran
    # a beam of 0 or a negative alpha is wrong for any model: refused before one loads (it was after)
    with caplog.at_level(logging.INFO):
        caplog.clear()
        code, _, err = run_cli_captured(capsys, "tune-decoding", fp32_dir, "--src", src, "--ref", ref, "--beams", "0")
    assert_one_line_error(code, err, "--beams must be at least 1 (got 0)")
    assert "loaded in" not in caplog.text + err


def test_bench_refuses_a_fixed_length_past_the_model_dirs_limit(capsys, fp32_dir):
    """--fixed-length 100000 was capped at the model's limit while the JSON recorded 100000."""
    code, _, err = run_cli_captured(capsys, "bench", fp32_dir, "--backends", "onnxruntime", "--sentences", 2,
                                    "--batch-size", 2, "--fixed-length", 100000)
    assert_one_line_error(code, err, "--fixed-length 100000 is longer than the model dir's output limit of 39")


def test_bench_refuses_what_a_backend_cannot_run_before_measuring_any(capsys, caplog, fp32_dir):
    """--backends onnxruntime,tensorrt measured onnxruntime in full, then refused tensorrt and threw the row
    away (exit 2, no --json); --sentences 1000000000 was a MemoryError traceback."""
    import logging

    with caplog.at_level(logging.INFO):
        code, _, err = run_cli_captured(capsys, "bench", fp32_dir, "--backends", "onnxruntime,tensorrt",
                                        "--sentences", 2, "--batch-size", 2)
    assert code == 2 and "tensorrt" in err.lower() and "Traceback" not in err, err
    assert "loaded in" not in caplog.text + err  # nothing loaded, nothing measured
    code, _, err = run_cli_captured(capsys, "bench", fp32_dir, "--sentences", 10 ** 9)
    assert code == 2 and "--sentences" in err and "1<=x<=1000000" in err, err


@pytest.mark.slow
def test_bench_refuses_model_dirs_of_two_tokenizers(capsys, fp32_dir, tmp_path):
    """The second model dir was timed on the first's token ids: a Gather traceback, or numbers of noise."""
    from export.api import export_model
    from pipeline.evaluation.random_model import make_random_checkpoint

    make_random_checkpoint(tmp_path / "other.pt", "tiny", 200, seed=5)
    export_model(tmp_path / "other.pt", tmp_path / "other", tensorrt=False, max_batch=2, max_src_len=16,
                 max_tgt_len=20, max_beam=2)
    code, _, err = run_cli_captured(capsys, "bench", fp32_dir, tmp_path / "other", "--backends", "onnxruntime",
                                    "--sentences", 2, "--batch-size", 2, "--rounds", 1)
    assert_one_line_error(code, err, "its spm.model differs from")


def test_a_vocabulary_smaller_than_the_corpus_characters_is_one_line(capsys, tmp_path):
    """A CJK corpus at tiny's vocabulary was SentencePiece's RuntimeError traceback; random-checkpoint's
    --vocab-size 16 was within its range and failed the same way."""
    from pipeline.corpus.spm import train_sentencepiece

    with pytest.raises(UserError, match=r"--vocab-size 100 is too small for the 301 characters of the corpus .* "
                                        r"give --vocab-size 305 or more"):
        train_sentencepiece([" ".join(chr(0x4E00 + i) * 2 for i in range(300))] * 3, 100)
    code, _, err = run_cli_captured(capsys, "random-checkpoint", tmp_path / "r.pt", "--preset", "tiny",
                                    "--vocab-size", 16)
    assert code == 2 and "16 is not in the range 31<=x" in err and not (tmp_path / "r.pt").exists()


def test_random_checkpoint_will_not_be_named_as_a_run_s_checkpoint(capsys, tmp_path):
    """`random-checkpoint runs/x/checkpoint_00009999.pt` was written, and export and tune-decoding of runs/x then
    took the random weights as the run's latest step checkpoint."""
    for name in ("checkpoint_00009999.pt", "checkpoint_best.pt", "averaged.pt"):
        code, _, err = run_cli_captured(capsys, "random-checkpoint", tmp_path / name, "--preset", "tiny",
                                        "--vocab-size", 60)
        assert_one_line_error(code, err, f"{name} is how a training run names its checkpoints")
        assert not (tmp_path / name).exists()


def test_bench_records_the_batch_it_ran(capsys, fp32_dir, tmp_path):
    """The batch and the host a row holds on (--batch-size 8 over 2 sentences, which recorded 8, is refused:
    test_bench_refuses_options_the_measurement_would_ignore)."""
    import json

    code, out, err = run_cli_captured(capsys, "bench", fp32_dir, "--backends", "onnxruntime", "--sentences", 2,
                                      "--batch-size", 2, "--json", tmp_path / "b.json")
    assert code == 0, err
    report = json.loads((tmp_path / "b.json").read_text())
    assert [r["batch_size"] for r in report["results"]] == [2]
    # what the figure holds only on (the CPU's model was "processor": "" on Linux; no flags, no engine version)
    from pipeline.environment import cpu_facts

    host = report["host"]
    assert host["cpu"] == cpu_facts().model and host["cpu"] not in ("", "x86_64", "aarch64")
    assert host["cpu_flags"] == [name for name, on in cpu_facts().features.items() if on]
    assert host["onnxruntime"] and host["threads"] >= 1
    assert f"host: {host['cpu']} (" in out and f"onnxruntime {host['onnxruntime']}" in out
    assert "peak MiB: this process's" not in out  # one backend: its own peak
    # two backends in one process: the second's peak held the first's libraries and model (onnxruntime after
    # torch read 3.5x its own), said under the table
    from pipeline.evaluation.bench import format_table

    two = {**report, "results": [report["results"][0], {**report["results"][0], "backend": "torch"}]}
    assert "a backend measured after another counts what that one left loaded" in format_table(two)
    # each row's precision: an int8 dir's torch row runs model.pt in fp32 beside its int8 onnxruntime row, and the
    # two rows were told apart by nothing
    int8 = {**two, "results": [two["results"][1], {**two["results"][0], "precision": "int8"}]}
    lines = format_table(int8).splitlines()
    assert lines[0].split()[:2] == ["backend", "prec"] and [line.split()[:2] for line in lines[2:4]] == [
        ["torch", "fp32"], ["onnxruntime", "int8"]]


def test_benchmarks_refuse_files_without_text_and_compare_rows_are_one_round(tmp_path, fp32_dir):
    """--whole-process and --serve timed a file of blank lines (a request of "." against nothing); a comparison
    row took each figure's own median, so over two rounds it paired 4,667 tok/s with 282 ms a sentence."""
    from pipeline.evaluation.bench_compare import _row
    from pipeline.evaluation.serve_bench import ServeBenchOptions, run_serve_bench
    from pipeline.evaluation.whole_process import run_whole_process

    blank = write_lines(tmp_path / "blank.txt", ["", "  "])
    with pytest.raises(UserError, match="blank.txt: has no non-blank line to translate"):
        run_whole_process([fp32_dir], [blank], compare=[], threads=1, beam_size=2, fixed_length=None, rounds=1)
    with pytest.raises(UserError, match="blank.txt: has no non-blank line to translate"):
        run_serve_bench(str(fp32_dir), str(blank), "onnxruntime", 1, 2, ServeBenchOptions())
    job = {"engine": "ctranslate2", "precision": "fp32", "quantization": None, "model_dir": "m", "batch_size": 1,
           "beam_size": 4, "sources": [[5, 2]] * 10}
    runs = [{"target_tokens_per_s": tps, "sentences_per_s": tps / 16, "latency_ms_mean": ms,
             "latency_ms_per_sentence": ms, "peak_rss_mb": 80.0, "device": "cpu", "target_tokens": 160}
            for tps, ms in ((9315.6, 2.1), (17.8, 281.9))]
    row = _row(job, runs)
    assert (row["target_tokens_per_s"], row["latency_ms_per_sentence"]) == (17.8, 281.9)  # one round's, both
    assert row["rounds_target_tokens_per_s"] == [9315.6, 17.8]


def test_tune_decodings_export_line_carries_every_search_setting_it_ran_with():
    """A model dir exported with --rules transformers --max-len-b 5 was tuned under them, but the export line printed
    only beam and alpha: a model dir made from it decoded otherwise than tuned."""
    from pipeline.evaluation.tuning import Trial

    assert Trial(4, 0.6, 30.0, 50.0).export_flags() == "--beam-size 4 --alpha 0.6"
    assert Trial(2, 1.0, 30.0, 50.0, max_len_a=0.0, max_len_b=5, rules="transformers").export_flags() == (
        "--beam-size 2 --alpha 1 --max-len-a 0 --max-len-b 5 --rules transformers")


def test_export_of_an_exported_model_dir_names_its_checkpoint(capsys, fp32_dir, tmp_path):
    """"no checkpoint_<step>.pt or averaged.pt in this directory; is it a `pipeline train --save-dir`?" for a
    model dir, whose model.pt is the checkpoint the user meant."""
    code, _, err = run_cli_captured(capsys, "export", fp32_dir, "--out", tmp_path / "again")
    assert_one_line_error(code, err, "an exported model dir, not a save dir; its checkpoint is", "model.pt")
    assert not (tmp_path / "again").exists()


def test_bench_says_when_its_sources_were_cut(tmp_path, fp32_dir, caplog):
    """A --src line over the model's limit was measured cut, in silence (one dir; two dirs refused it)."""
    from pipeline.evaluation.bench import make_sources
    from runtime.model_dir import ModelDir

    opened = ModelDir.open(fp32_dir)
    src = write_lines(tmp_path / "long.src", ["der hund " * 400, "ein kind"])
    with caplog.at_level(logging.WARNING):
        ids = make_sources(opened.tokenizer, src, 4, 20, 64)
    assert max(map(len, ids)) == 64
    assert "long.src: 2 of the 4 sentences measured were cut to the model's source limit of 64 tokens" in caplog.text


def test_parity_shares_are_of_the_lines_the_model_translates_not_blank_ones():
    """Blank lines never reach a model and are equal in every run: counted, 500 of them beside 500 lines turned a
    failed 99.9% identical gate (99.8%) into a pass (99.9%), and the report said 1000 sentences."""
    from types import SimpleNamespace

    from pipeline.evaluation.parity import Served, _compare, _live
    from pipeline.evaluation.parity_options import Gate

    sources = ["ab", "cd", "ef", "gh", "", "  ", "", ""]  # 4 lines with text, 4 blank
    ref = Served(["A", "C", "E", "G", "", "", "", ""], [[1]] * 4 + [[]] * 4, [[5], [6], [7], [8]] + [[]] * 4,
                 0.0, 0)
    run = Served(["A", "X", "E", "G", "", "", "", ""], ref.sources, [[5], [9], [7], [8]] + [[]] * 4, 0.0, 0)
    backend = SimpleNamespace(device="cpu", shortlist=None)
    assert _live(sources) == 4
    results, _ = _compare([("onnxruntime", backend, run, "int8")], ref, ref.lines, None,
                          {"int8": Gate(min_identical=0.8, max_bleu_delta=None)}, None, 3, _live(sources))
    assert results[0].identical == 0.75 and results[0].n_different == 1  # of 4, not of 8 (0.875)
    assert not results[0].passed


def test_bench_refuses_a_missing_src_before_loading_the_model(capsys, fp32_dir, tmp_path):
    """A missing --src was found after the model loaded (seconds later, past its log line)."""
    code, _, err = run_cli_captured(capsys, "bench", fp32_dir, "--src", tmp_path / "missing.txt")
    assert_one_line_error(code, err, "--src", "does not exist")
    assert "loaded in" not in err, err
    code, _, err = run_cli_captured(capsys, "bench", fp32_dir, "--src", "-")  # read once per measurement
    assert_one_line_error(code, err, "--src", "'-' (standard input) cannot be read here; give a file")


def test_bench_refuses_options_its_mode_would_leave_out(capsys, fp32_dir, tmp_path):
    """--serve with --whole-process ran the whole-process table only; --fixed-length with --serve was not applied
    (nor recorded); --concurrency or --paragraph without --serve were dropped: each in silence, exit 0."""
    src = write_lines(tmp_path / "s.txt", ["ab cd"])
    for args, says in ((["--serve", src, "--whole-process", src], "--whole-process and --serve are two measurements"),
                       (["--serve", src, "--fixed-length", "5"], "--fixed-length is measured in-process"),
                       (["--concurrency", "1,64"], "--concurrency: only with --serve INPUT"),
                       (["--paragraph", "3", "--lang", "de"], "--paragraph, --lang: only with --serve INPUT"),
                       # the measured processes picked their own device and took none of these
                       (["--whole-process", src, "--device", "cuda", "--backends", "torch"],
                        "--device, --backends: not used by --whole-process"),
                       (["--serve", src, "--batch-size", "8", "--rounds", "3"],
                        "--batch-size, --rounds: not used by --serve")):
        code, _, err = run_cli_captured(capsys, "bench", fp32_dir, *args)
        assert_one_line_error(code, err, says)


def test_parity_against_the_recorded_references_refuses_languages_it_would_ignore(capsys, fp32_dir):
    """Without --src, --src-lang zz --tgt-lang qq passed ("parity: passed", exit 0): the references' own direction
    was translated, the languages ignored, as --beam-size is refused for."""
    code, _, err = run_cli_captured(capsys, "parity", fp32_dir, "--src-lang", "de", "--tgt-lang", "en")
    assert_one_line_error(code, err, "--src-lang, --tgt-lang: parity against the recorded references uses the "
                                     "decoding and languages they were recorded with")


@pytest.mark.parametrize("command", ["serve-batch", "serve", "ray-translate"])
def test_a_checkpoint_given_as_model_dir_is_told_how_to_make_one(capsys, tmp_path, command):
    """A checkpoint file given as MODEL_DIR got click's "Directory 'averaged.pt' is a file." (parity, bench and
    doctor said what a model dir is and how to make one)."""
    checkpoint = tmp_path / "averaged.pt"
    checkpoint.write_bytes(b"x")
    code, _, err = run_cli_captured(capsys, command, checkpoint, *([] if command == "serve" else [checkpoint]))
    assert_one_line_error(code, err, "is a file, not a model directory", "pipeline export CHECKPOINT --out DIR")


@pytest.mark.parametrize("family", ["auto", "marian", "m2m100", "nllb"])
def test_import_help_shows_its_example_commands_one_per_line(capsys, family):
    """click re-wrapped the example block: "... --out de-en.pt     pipeline export de-en.pt ..." on one line."""
    code, out, _ = run_cli_captured(capsys, "import", family, "--help")
    examples = [line.strip() for line in out.splitlines() if line.strip().startswith("pipeline ")]
    assert code == 0 and examples and all(line.count("pipeline ") == 1 for line in examples), out


def test_random_checkpoint_help_shows_its_example_commands_one_per_line(capsys):
    """Its three commands ran together ("... --compare" / "ctranslate2" at 80 columns: copied, a usage error)."""
    code, out, _ = run_cli_captured(capsys, "random-checkpoint", "--help")
    examples = [line.strip() for line in out.splitlines() if line.strip().startswith("pipeline ")]
    assert code == 0 and len(examples) == 3 and all(line.count("pipeline ") == 1 for line in examples), out
    assert examples[-1] == "pipeline bench models/base-fp32 --backends onnxruntime --compare ctranslate2"


def test_a_list_of_alphas_is_explained_with_alphas(capsys, fp32_dir, pair):
    """--alphas x: "give comma-separated numbers, e.g. 1,4,6", a list of beams."""
    src, ref = pair
    code, _, err = run_cli_captured(capsys, "tune-decoding", fp32_dir, "--src", src, "--ref", ref, "--alphas", "x")
    assert_one_line_error(code, err, "--alphas 'x': give comma-separated numbers, e.g. 0.6,1.0")


def test_parity_says_its_scores_cover_the_blank_lines_its_sentence_count_leaves_out(capsys, fp32_dir, tmp_path):
    """"39 sentences" beside a BLEU over all 40 lines (a blank source against its reference) read as if the blank
    line had been left out of BLEU."""
    import json

    src = write_lines(tmp_path / "s.txt", ["ab cd", "", "ef gh"])
    ref = write_lines(tmp_path / "r.txt", ["x y", "z", "w"])
    code, out, err = run_cli_captured(capsys, "parity", fp32_dir, "--src", src, "--ref", ref, "--backends",
                                      "onnxruntime", "--threads", "1", "--json", "-")
    report = json.loads(out)
    assert (report["sentences"], report["lines"]) == (2, 3), err
    assert "2 sentences of 3 lines (blank ones: BLEU and chrF score all 3)" in err


@pytest.mark.parametrize("command, where", [("train", "--save-dir"), ("demo", "--out")])
def test_resume_is_explained_not_answered_with_a_near_option(capsys, command, where):
    """`pipeline train ... --resume` said "Did you mean '--preset'?"."""
    code, _, err = run_cli_captured(capsys, command, "--resume")
    assert_one_line_error(code, err, f"a run resumes by itself; rerun the same command (the same {where})")


@pytest.mark.slow
def test_bench_interrupted_in_a_measurement_ends_it_and_exits(fp32_dir, tmp_path):
    """Ctrl-C to bench alone (timeout -s INT) while a measurement ran in its subprocess: "interrupted (Ctrl-C)",
    then bench waited at exit, sometimes for ever, on a ProcessPoolExecutor worker that never ended."""
    import signal
    import subprocess
    import time

    from helpers import cli_env, pipeline_cmd

    proc = subprocess.Popen(pipeline_cmd("bench", fp32_dir, fp32_dir, "--backends", "onnxruntime", "--sentences",
                                         100_000, "--batch-size", 4, "--rounds", 1, "--threads", 1),
                            env=cli_env(), cwd=tmp_path, stderr=subprocess.PIPE, text=True, start_new_session=True)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    try:
        deadline = time.monotonic() + 120
        measuring: list[str] = []
        while not measuring and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)  # the measurement's process (the spawn's resource tracker may come first)
            measuring = [c for c in children.read_text().split()
                         if b"multiprocessing.spawn" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert measuring, "no measurement started"
        time.sleep(2)
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130, proc.stderr.read() if proc.stderr else ""
        assert not any(Path(f"/proc/{c}").exists() for c in measuring)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_steps_per_replay_reaches_the_bench_and_parity_offers_none(capsys, fp32_dir):
    """bench and parity took --steps-per-replay and dropped it: parity passed and bench timed the default, where
    serve-batch refuses it on the CPU. bench's --rules refusal named --serve and --compare for two MODEL_DIRs."""
    code, _, err = run_cli_captured(capsys, "bench", fp32_dir, "--backends", "torch", "--steps-per-replay", 4,
                                    "--sentences", 2, "--batch-size", 2)
    assert_one_line_error(code, err, "--steps-per-replay 4 runs beam search in a CUDA graph: on cpu it needs --step "
                                     "compiled")
    code, _, err = run_cli_captured(capsys, "parity", fp32_dir, "--steps-per-replay", 4)
    assert code == 2 and "No such option '--steps-per-replay'" in err, err
    code, _, err = run_cli_captured(capsys, "bench", fp32_dir, fp32_dir, "--rules", "top-beam", "--sentences", 2)
    assert_one_line_error(code, err, "--rules is measured in-process (one MODEL_DIR) and with --whole-process; leave "
                                     "it out of runs of several MODEL_DIRs, --serve and --compare")


def test_tune_decoding_takes_threads_as_every_command_that_decodes(capsys, fp32_dir, pair, monkeypatch):
    """It had no --threads: a model dir's trials ran on every core, beside the other decoding commands' one."""
    from pipeline.evaluation import tuning

    seen = []
    load = tuning.load
    monkeypatch.setattr(tuning, "load", lambda model, options, *rest: seen.append(options) or load(model, options,
                                                                                                    *rest))
    src, ref = pair
    code, _, err = run_cli_captured(capsys, "tune-decoding", fp32_dir, "--src", src, "--ref", ref, "--beams", "1",
                                    "--alphas", "0.6", "--threads", 1)
    assert code == 0 and [o.threads for o in seen] == [1], err
    code, _, err = run_cli_captured(capsys, "tune-decoding", fp32_dir, "--src", src, "--ref", ref, "--threads", 0)
    assert code == 2 and "--threads" in err and "x>=1" in err, err


def test_translations_cut_at_the_model_s_target_limit_are_counted(trained_save_dir, memorised_fp32_dir, memorise_corpus,
                                                                  tmp_path, caplog, capsys):
    """An export's --max-tgt-len cut every translation (3 tokens of "a b c d e ...") and serve-batch said it had
    translated them all: the search caps the output length there without a word. They are counted now, on
    serve-batch and the Ray/Spark Translator; lines that end before the limit are not."""
    from model.checkpoint import resolve_checkpoint
    from pipeline.integrations import Translator

    out = tmp_path / "short"
    assert run_cli("export", resolve_checkpoint(trained_save_dir), "--out", out, "--no-tensorrt", "--max-tgt-len", 3,
                   "--max-src-len", 64, "--max-batch", 8, "--max-beam", 4) == 0
    src = tmp_path / "in.txt"
    lines = read_lines(memorise_corpus[0])[:6]
    src.write_text("".join(f"{line}\n" for line in lines) + "\n")
    with caplog.at_level(logging.WARNING):
        code, _, err = run_cli_captured(capsys, "serve-batch", out, src, "-o", tmp_path / "out.txt", "--threads", 1)
    assert code == 0, err
    said = [r.getMessage() for r in caplog.records if "target limit" in r.getMessage()]
    assert said == [f"{src}: 6 line(s) were translated up to the model's target limit (export --max-tgt-len) and "
                    "stopped there: their translations may be cut"], said
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        Translator(out).translate(lines + [""])
    assert "6 row(s) were translated up to the model's target limit" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the usual limit: nothing cut, nothing said
        code, _, err = run_cli_captured(capsys, "serve-batch", memorised_fp32_dir, src, "-o", tmp_path / "full.txt",
                                        "--threads", 1)
    assert code == 0 and "target limit" not in caplog.text, caplog.text
    cut, full = read_lines(tmp_path / "out.txt"), read_lines(tmp_path / "full.txt")
    assert all(len(a) < len(b) for a, b in zip(cut[:6], full[:6])) and cut[6] == full[6] == "", (cut, full)


def test_bench_loads_every_backend_with_the_decoding_it_was_given(fp32_dir, monkeypatch):
    """The loop kept the first backend's loaded decoding for the next load: after a CUDA backend (batch_sentences
    0, no limit) a CPU backend ran without its limit."""
    import dataclasses

    from pipeline.evaluation import bench
    from runtime.decoding import DecodingOptions

    given, real = [], bench.load

    def recording(opened, options, decoding):  # each load's own decoding differs from what it was given (a GPU's)
        given.append(decoding)
        loaded = real(opened, options, decoding)
        return dataclasses.replace(loaded, decoding=loaded.decoding.replace(batch_sentences=0))

    monkeypatch.setattr(bench, "load", recording)
    asked = DecodingOptions(beam_size=2)
    bench.run_bench(fp32_dir, ["onnxruntime", "torch"], [2], decoding=asked, sentences=2, threads=1)
    assert len(given) == 2 and all(d is asked for d in given), given


def test_bench_s_subprocess_modes_decode_with_the_model_dir_s_beam(fp32_dir, tmp_path, monkeypatch, capsys):
    """A model dir exported with --beam-size 2: in-process bench measured beam 2, --compare and --whole-process the
    paper's 4 (and the comparison's JSON said the model's decoding, beam 2), --serve too; --beam-size still wins."""
    import json
    import shutil

    from pipeline.commands import bench

    model = tmp_path / "beam2"
    shutil.copytree(fp32_dir, model)
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["decoding"] = {"beam_size": 2, "alpha": 1.0}
    (model / "manifest.json").write_text(json.dumps(manifest))
    src = write_lines(tmp_path / "s.txt", ["ab cd"])
    beams: list[tuple[str, int]] = []

    def recording(name: str, at: int):
        def run(*args, **kwargs):
            beams.append((name, kwargs["beam_size"] if "beam_size" in kwargs else args[at]))
            return {}
        return run

    monkeypatch.setattr(bench, "run_whole_process", recording("whole", -1))
    monkeypatch.setattr(bench, "run_comparison", recording("compare", -1))
    monkeypatch.setattr(bench, "run_serve_bench", recording("serve", 4))
    for fmt in ("format_whole_process", "format_comparison", "format_serve_bench"):
        monkeypatch.setattr(bench, fmt, lambda report: "")
    modes = {"whole": ["--whole-process", src], "compare": [model], "serve": ["--serve", src]}
    for beam, extra in ((2, []), (3, ["--beam-size", "3"])):
        beams.clear()
        for args in modes.values():
            code, _, err = run_cli_captured(capsys, "bench", model, *args, *extra)
            assert code == 0, err
        assert beams == [("whole", beam), ("compare", beam), ("serve", beam)], beams


def test_bench_refuses_options_the_measurement_would_ignore(capsys, fp32_dir, monkeypatch):
    """--rounds and --min-agreement in-process, --min-agreement with --whole-process alone, --step with no torch
    row and a batch above --sentences all ran (exit 0) and were left out in silence."""
    from pipeline.commands import bench

    for name in ("run_bench", "run_comparison", "run_whole_process"):
        monkeypatch.setattr(bench, name, lambda *a, **k: pytest.fail("measured"))
    for args, says in ((["--rounds", "5"], "--rounds 5: one MODEL_DIR without --compare is measured once"),
                       (["--min-agreement", "0.5"], "--min-agreement checks CTranslate2's output"),
                       (["--whole-process", fp32_dir / "manifest.json", "--min-agreement", "0.5"],
                        "only with --compare ctranslate2"),
                       (["--backends", "onnxruntime", "--step", "compiled"], "add torch to --backends"),
                       (["--backends", "onnxruntime", "--steps-per-replay", "2"], "add torch to --backends"),
                       (["--batch-size", "8", "--batch-size", "32", "--sentences", "4"],
                        "--batch-size 8 is more than the 4 sentences measured")):
        code, _, err = run_cli_captured(capsys, "bench", fp32_dir, *args)
        assert_one_line_error(code, err, says)


def test_bench_latency_p50_is_the_median_and_a_failed_process_is_one_readable_line(fp32_dir, tmp_path):
    """Two batches' p50 was the slower one (p50 = p90); a timed serve-batch that failed was said as a Python list
    (`failed with status 2: ['error: ...']`)."""
    import shutil

    from pipeline.evaluation.bench import run_bench
    from pipeline.evaluation.whole_process import run_whole_process

    row = run_bench(fp32_dir, ["onnxruntime"], [2], sentences=4, threads=1)["results"][0]
    assert row["latency_ms_p50"] <= row["latency_ms_mean"] + 0.01 <= row["latency_ms_p90"] + 0.01, row
    broken = tmp_path / "broken"
    shutil.copytree(fp32_dir, broken)
    (broken / "decoder.data").write_bytes(b"x")  # serve-batch refuses it by its digest; the driver reads no graph
    src = write_lines(tmp_path / "s.txt", ["ab cd"])
    with pytest.raises(UserError) as refused:
        run_whole_process([broken], [src], compare=[], threads=1, beam_size=1, fixed_length=None, rounds=1)
    said = str(refused.value)
    assert "failed with status 2: " in said and "['" not in said and ": error:" not in said, said
    assert "decoder.data" in said, said


def test_a_measurement_child_is_started_with_interrupts_held(monkeypatch):
    """Ctrl-C or SIGTERM while a measurement's process was started (its job, MBs of sources, written to it) cut
    the job short: the child printed a traceback (UnpicklingError: pickle data was truncated) under bench's own
    exit 130. Both are held while it starts (the child inherits the mask and lifts it once SIGINT is ignored),
    and an interrupt held is raised once it has started, which stops the child."""
    import multiprocessing
    import signal

    from pipeline.evaluation import bench_compare

    seen: dict[str, object] = {}
    ctx = multiprocessing.get_context("spawn")

    class Child:
        def __init__(self, target, args, daemon):
            self.exitcode = self.pid = None

        def start(self):
            self.pid = 1
            seen["held"] = signal.pthread_sigmask(signal.SIG_BLOCK, [])
            signal.raise_signal(signal.SIGINT)  # a Ctrl-C while it starts

        def terminate(self):
            seen["terminated"] = True

        def join(self, timeout=None):
            pass

    monkeypatch.setattr(ctx, "Process", Child)
    with pytest.raises(KeyboardInterrupt):
        bench_compare._in_fresh_process(ctx, {"engine": "x"})
    assert {signal.SIGINT, signal.SIGTERM} <= set(seen["held"]) and seen["terminated"]  # raised after start
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # and no longer held here


def test_bench_takes_its_batch_sizes_as_a_list_as_well(capsys, fp32_dir, monkeypatch):
    """--backends, --beams and --alphas take comma lists; --batch-size 1,32 was "'1,32' is not a valid integer
    range". Repeated, listed or both, each size checked against its range."""
    from pipeline.commands import bench

    seen: list[list[int]] = []
    monkeypatch.setattr(bench, "run_bench", lambda model_dir, names, sizes, **k: seen.append(sizes) or {})
    monkeypatch.setattr(bench, "format_table", lambda report: "")
    for args, sizes in ((["--batch-size", "1,4"], [1, 4]), (["--batch-size", "1", "--batch-size", "2,4"], [1, 2, 4]),
                        (["--batch-size", "4"], [4])):
        code, _, err = run_cli_captured(capsys, "bench", fp32_dir, "--sentences", "4", *args)
        assert code == 0 and seen.pop() == sizes, err
    code, _, err = run_cli_captured(capsys, "bench", fp32_dir, "--batch-size", "1,0")
    assert code == 2 and "'--batch-size': 0 is not in the range x>=1" in err, err
    code, _, err = run_cli_captured(capsys, "bench", fp32_dir, "--batch-size", ",")  # an empty report, exit 0
    assert code == 2 and "',' holds no number" in err, err

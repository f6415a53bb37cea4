"""`pipeline bench --whole-process`: source pieces per line and where each engine's wall time went."""

from __future__ import annotations

import json
import re
import statistics

import pytest

from pipeline.evaluation.process_split import pieces_summary, run_split, split, split_line
from tests.helpers import make_parallel, run_cli_captured

OURS_LINE = re.compile(r"^ours fp32: \d+\.\d source pieces/line \(p50 \d+, p95 \d+\); load \d+\.\d\d s \(\d+%\), "
                       r"encoder \d+\.\d\d s \(\d+%\), decoder \d+\.\d\d s \(\d+%\), "
                       r"I/O and the rest -?\d+\.\d\d s \(-?\d+%\)$", re.M)
CT2_LINE = re.compile(r"^ctranslate2 (fp32|int8): \d+\.\d source pieces/line \(p50 \d+, p95 \d+\); "
                      r"load \d+\.\d\d s \(\d+%\), translating, I/O and the rest \d+\.\d\d s \(\d+%\)$", re.M)


def test_split_adds_up_to_the_wall_time():
    """Medians of each phase over the runs; the rest is what they leave of the row's wall time."""
    runs = [{"load_s": 0.4, "encoder_s": 0.2, "decoder_s": 1.0, "encoder_calls": 2, "decoder_steps": 30},
            {"load_s": 0.6, "encoder_s": 0.4, "decoder_s": 1.4, "encoder_calls": 2, "decoder_steps": 30}, {}]
    s = split(2.5, runs)
    assert s is not None
    assert (s["load_s"], s["encoder_s"], s["decoder_s"], s["rest_s"]) == pytest.approx((0.5, 0.3, 1.2, 0.5))
    assert (s["load_pct"], s["encoder_pct"], s["decoder_pct"], s["rest_pct"]) == (20.0, 12.0, 48.0, 20.0)
    assert (s["encoder_calls"], s["decoder_steps"]) == (2, 30)
    ct2 = split(2.0, [{"load_s": 0.5}])  # CTranslate2's script records only when it was loaded
    assert ct2 is not None and ct2["encoder_s"] is None and ct2["rest_s"] == 1.5 and ct2["rest_pct"] == 75.0
    assert split(2.0, [{}]) is None


def test_a_run_split_needs_the_parents_clock():
    recorded = {"loaded_at": 100.5, "encoder_s": 0.1, "decoder_s": 0.7, "encoder_calls": 1, "decoder_steps": 9}
    assert run_split(100.0, 2.0, recorded) == {
        "load_s": 0.5, "encoder_s": 0.1, "decoder_s": 0.7, "encoder_calls": 1.0, "decoder_steps": 9.0}
    # two batches at once: the sums over both batch threads, halved (a batch thread's mean), and said so
    assert run_split(100.0, 2.0, recorded, batches=2) == pytest.approx({
        "load_s": 0.5, "encoder_s": 0.05, "decoder_s": 0.35, "encoder_calls": 1.0, "decoder_steps": 9.0,
        "batches_at_once": 2.0})
    assert run_split(200.0, 2.0, recorded) == {}  # another clock
    assert run_split(100.0, 2.0, {}) == {}


def test_pieces_summary_and_the_printed_line():
    assert pieces_summary([3, 5, 4, 10]) == {"source_pieces_per_line": 5.5, "source_pieces_p50": 4.5,
                                             "source_pieces_p95": 10.0}
    assert pieces_summary([])["source_pieces_per_line"] is None
    row = {"engine": "onnxruntime", "precision": "fp32", "model_dir": "runs/a", "file": "in.de",
           **pieces_summary([15, 15, 16]), "split": split(5.08, [{"load_s": 0.41, "encoder_s": 0.62,
                                                                   "decoder_s": 3.5}])}
    assert split_line(row, False, False) == ("ours fp32: 15.3 source pieces/line (p50 15, p95 16); load 0.41 s (8%), "
                                             "encoder 0.62 s (12%), decoder 3.50 s (69%), I/O and the rest 0.55 s "
                                             "(11%)")
    ct2 = {**row, "engine": "ctranslate2", "precision": "int8", "split": split(2.0, [{"load_s": 0.5}])}
    assert split_line(ct2, True, True) == ("ctranslate2 int8 in.de: 15.3 source pieces/line (p50 15, p95 16); "
                                           "load 0.50 s (25%), translating, I/O and the rest 1.50 s (75%)")
    assert split_line({**row, "split": None}, True, False).startswith("ours fp32 a: 15.3 source pieces/line")
    two = {**row, "split": split(5.08, [{"load_s": 0.41, "encoder_s": 0.31, "decoder_s": 1.75, "batches_at_once": 2}])}
    assert two["split"]["batches_at_once"] == 2
    assert split_line(two, False, False).endswith("I/O and the rest 2.61 s (51%) (encoder, decoder: a batch thread's "
                                                  "mean, 2 batches at once)")


@pytest.mark.slow
def test_whole_process_reports_pieces_per_line_and_the_split(fp32_dir, tmp_path, capsys):
    """One round over a 20-line file (a blank line among them): pieces per line as the model dir's tokenizer
    counts them (pieces + EOS of the non-blank lines), for every engine; ours' wall time split into load,
    encoder, decoder and the rest, adding up to it and consistent with serve-batch's own log; CTranslate2's
    (where installed) into load and the rest; one line per engine saying so."""
    from runtime.decoding import PAPER
    from runtime.tokenizer import tokenizer_from_file
    from runtime.translate import length_batches

    lines = make_parallel(19)[0]
    lines.insert(7, "")
    src = tmp_path / "in.txt"
    src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    tokenizer = tokenizer_from_file(fp32_dir / "spm.model")
    counts = [len(tokenizer.encode_source([line])[0]) for line in lines if line.strip()]
    try:
        import ctranslate2  # noqa: F401
        compare = ["--compare", "ctranslate2", "--min-agreement", "0"]  # random weights: near-ties may differ
    except ImportError:
        compare = []
    out = tmp_path / "whole.json"
    code, stdout, err = run_cli_captured(capsys, "bench", fp32_dir, "--whole-process", src, "--rounds", "1",
                                         "--threads", "1", "--beam-size", "2", "--rules", "top-beam", *compare,
                                         "--json", out)
    assert code == 0, stdout + err
    report = json.loads(out.read_text())
    assert report["rules"] == "top-beam"
    if compare:
        assert "search rules: ours top-beam, CTranslate2 top-beam" in stdout, stdout
    rows = {r["engine"] + " " + r["precision"]: r for r in report["results"]}
    assert set(rows) == {"onnxruntime fp32", *(["ctranslate2 fp32", "ctranslate2 int8"] if compare else [])}
    if compare:  # the table's x ct2 columns are the JSON's too, and CTranslate2 int8 says its quantization as
        ours = rows["onnxruntime fp32"]  # in-process
        assert ours["x_ct2"] == {p: round(rows[f"ctranslate2 {p}"]["wall_s"] / ours["wall_s"], 3)
                                 for p in ("fp32", "int8")}
        assert rows["ctranslate2 int8"]["quantization"] == "ctranslate2"
    assert "pieces + EOS" in report["source_pieces"] and "wall_s" in report["split_measures"]
    for r in rows.values():
        assert r["source_pieces_per_line"] == pytest.approx(statistics.fmean(counts), abs=0.005)
        assert r["source_pieces_p50"] == statistics.median(counts)
        assert r["source_pieces_p95"] in counts
        s = r["split"]
        assert s["load_s"] > 0 and s["rest_s"] >= 0
        assert s["load_s"] + (s["encoder_s"] or 0) + (s["decoder_s"] or 0) + s["rest_s"] == pytest.approx(
            r["wall_s"], abs=0.005)
        assert s["load_pct"] + (s["encoder_pct"] or 0) + (s["decoder_pct"] or 0) + s["rest_pct"] == pytest.approx(
            100, abs=0.3)
    ours = rows["onnxruntime fp32"]["split"]
    assert ours["encoder_s"] > 0 and ours["decoder_s"] > 0
    # one encoder call per search batch, as serve-batch cuts them; each batch at least one decoder step and at most
    # its longest allowed output (max_len_a x longest source + max_len_b, the paper's limits)
    batches = list(length_batches(counts, PAPER.batch_tokens, 2))
    assert ours["encoder_calls"] == len(batches)
    longest = [max(counts[i] for i in b) for b in batches]
    assert len(batches) <= ours["decoder_steps"] <= sum(int(PAPER.max_len_a * n + PAPER.max_len_b) for n in longest)
    # consistent with serve-batch's log: loading is within start-to-loaded, encoder and decoder within translating
    assert ours["load_s"] >= rows["onnxruntime fp32"]["load_s"]
    assert ours["encoder_s"] + ours["decoder_s"] <= rows["onnxruntime fp32"]["translate_s"] + 0.01
    assert len(OURS_LINE.findall(stdout)) == 1, stdout
    if compare:
        assert all(rows[k]["split"]["encoder_s"] is None for k in ("ctranslate2 fp32", "ctranslate2 int8"))
        assert len(CT2_LINE.findall(stdout)) == 2, stdout


def test_ours_runs_serve_batch_with_the_rules_given_and_bench_refuses_them_where_unmeasured(tmp_path, capsys):
    """--rules reaches ours' serve-batch command (and only when given: else the model dir's own rule); the
    comparison and --serve modes, which would not honour it, refuse it before measuring anything."""
    from pipeline.evaluation.whole_process import ours_command

    (tmp_path / "in.txt").write_text("Hallo\n", encoding="utf-8")
    given = ours_command(tmp_path / "m", tmp_path / "in.txt", tmp_path / "out.txt", 1, 4, None, rules="top-beam")
    assert given[given.index("--rules") + 1] == "top-beam"
    assert "--rules" not in ours_command(tmp_path / "m", tmp_path / "in.txt", tmp_path / "out.txt", 1, 4, None)
    for mode in (["--compare", "ctranslate2"], ["--serve", tmp_path / "in.txt"]):
        code, stdout, err = run_cli_captured(capsys, "bench", tmp_path / "m", *mode, "--rules", "top-beam")
        assert code != 0 and "--rules is measured in-process" in stdout + err, stdout + err


def test_the_report_names_both_engines_search_rules():
    from pipeline.evaluation.whole_process import format_whole_process

    report = {"model_dirs": ["m"], "results": [], "rounds": 1, "threads": 1, "beam_size": 4, "fixed_length": None,
              "ctranslate2_converter": "x", "ctranslate2_greedy_agreement": "8/8"}
    assert ("search rules: ours fairseq, CTranslate2 top-beam (its early exit, the only rule its Python API runs); "
            "--rules top-beam compares like for like") in format_whole_process({**report, "rules": "fairseq"})
    assert format_whole_process({**report, "rules": "top-beam"}).endswith("CTranslate2 top-beam (its early exit, "
                                                                          "the only rule its Python API runs)")
    assert "search rules" not in format_whole_process({**report, "fixed_length": 30})


def test_ctranslate2s_script_cuts_a_long_source_as_serve_batch_does(fp32_dir, tmp_path):
    """The CTranslate2 script translated a line over the model dir's source limit whole, where serve-batch cuts
    it (its first max_src - 1 pieces + EOS): on a file of long lines the two engines did different work. It now
    gets the limit and cuts as encode_sources does (it records the source tokens it gave CTranslate2)."""
    pytest.importorskip("ctranslate2")
    import os
    import subprocess
    import sys

    from pipeline.evaluation import ctranslate2_compare
    from pipeline.evaluation.whole_process import CT2_SCRIPT, sentencepiece_files
    from runtime.model_dir import ModelDir
    from runtime.translate import encode_sources

    opened = ModelDir.open(fp32_dir, verify=False)
    ct2_dir = ctranslate2_compare.for_model_dir(fp32_dir, tmp_path / "ct2")[0]
    spms = sentencepiece_files(opened, tmp_path)
    long = " ".join(f"wort{i} satz{i}" for i in range(40))

    def run(text: str, max_src: int) -> int:  # the source tokens the script gave CTranslate2
        (tmp_path / "in.txt").write_text(text + "\n", encoding="utf-8")
        subprocess.run([sys.executable, "-c", CT2_SCRIPT, str(ct2_dir), *spms, str(tmp_path / "in.txt"),
                        str(tmp_path / "out.txt"), "1", "1", "float32", "0", "1.0", "20", "", "", "1", str(max_src)],
                       check=True, env={**os.environ, "PIPELINE_TIMINGS": str(tmp_path / "t.json")})
        return int(json.loads((tmp_path / "t.json").read_text())["source_tokens"])

    for limit in (6, 1024):  # what serve-batch's encoding gives the model, cut or whole
        assert run(long, limit) == len(encode_sources(opened.tokenizer, [long], limit).ids[0])
    assert run(long, 6) == 6 < run(long, 1024)


def test_the_whole_process_table_gives_each_row_against_ctranslate2():
    """The table had no ratio column: a reader divided wall times by hand. Each row now shows CTranslate2's
    wall time on the same file (fp32, int8) over its own."""
    from pipeline.evaluation.whole_process import format_whole_process

    def row(engine: str, precision: str, wall: float, file: str = "a.txt") -> dict[str, object]:
        return {"engine": engine, "precision": precision, "quantization": None, "file": file, "lines": 10,
                "wall_s": wall, "peak_rss_mb": 100.0, "model_dir": "m"}

    report = {"model_dirs": ["m"], "rounds": 1, "threads": 2, "beam_size": 4, "fixed_length": None,
              "results": [row("onnxruntime", "int8", 2.0), row("ctranslate2", "fp32", 5.0),
                          row("ctranslate2", "int8", 3.0), row("onnxruntime", "int8", 4.0, "b.txt")]}
    lines = format_whole_process(report).splitlines()
    assert lines[0].endswith("x ct2 fp32 x ct2 int8")
    ours = next(line for line in lines if line.startswith("onnxruntime") and " a.txt " in line)
    assert ours.split()[-2:] == ["2.50", "1.50"]
    assert next(line for line in lines if " b.txt " in line).split()[-2:] == ["-", "-"]  # no CTranslate2 row there
    assert "x ct2: CTranslate2's wall time" in format_whole_process(report)
    assert "x ct2" not in format_whole_process({**report, "results": [row("onnxruntime", "int8", 2.0)]})


def test_a_timed_process_goes_with_an_interrupted_bench(tmp_path):
    """Ctrl-C or SIGTERM to `bench --whole-process` left the timed serve-batch running to its end (minutes of
    CPU on a large file); it is killed with bench now. Its standard error goes to a file, which no amount fills."""
    import os
    import signal
    import sys

    from pipeline.evaluation.whole_process import run_timed

    pidfile = tmp_path / "pid"
    child = (f"import os, sys, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
             "sys.stderr.write('x' * (1 << 20)); sys.stderr.flush(); time.sleep(60)")

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 2.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_timed([sys.executable, "-c", child])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    pid = int(pidfile.read_text())
    alive = os.path.exists(f"/proc/{pid}") and "zombie" not in open(f"/proc/{pid}/status").read()
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive
    wall, _, err = run_timed([sys.executable, "-c", "import sys; sys.stderr.write('y' * (1 << 20))"])
    assert len(err) == 1 << 20 and wall < 60

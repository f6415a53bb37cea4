"""`pipeline serve-batch --glossary FILE` as a user runs it, on the trained tiny model: every term found in a
line is in its translation (a target the model would not choose, and a do-not-translate term), lines without
terms are translated exactly as without the glossary, torch and ONNX Runtime write the same lines, and bad
glossaries and backends that cannot apply one are refused in one line."""

from __future__ import annotations

import re
import shutil

import pytest
from helpers import assert_one_line_error, make_parallel, run_cli, run_cli_captured, write_lines

from runtime.glossary import find_terms
from runtime.glossary_file import load_glossary

GLOSSARY = "hund\ttree\nkatze\t\n"  # "hund" as "tree" (never its translation), "katze" kept as it is


@pytest.fixture(scope="module")
def lines() -> list[str]:
    src, _ = make_parallel(40, seed=21)
    return src + ["", "Der Hund sieht die Katze", "hundekatze klein"]  # capitalised; not whole words


def _translate(capsys, model_dir, tmp_path, lines, *extra) -> tuple[list[str], str]:
    src = write_lines(tmp_path / "in.txt", lines)
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}.txt"
    code, _, err = run_cli_captured(capsys, "serve-batch", model_dir, src, "--output", out, "--no-progress",
                                    "--threads", "1", *extra)
    assert code == 0, err
    return out.read_text(encoding="utf-8").split("\n")[:-1], err


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_every_term_found_is_in_its_lines_translation(capsys, caplog, trained_model_dir, tmp_path, lines, backend):
    glossary = tmp_path / "terms.tsv"
    glossary.write_text(GLOSSARY, encoding="utf-8")
    plain, _ = _translate(capsys, trained_model_dir, tmp_path, lines, "--backend", backend)
    forced, _ = _translate(capsys, trained_model_dir, tmp_path, lines, "--backend", backend,
                             "--glossary", glossary)
    assert len(forced) == len(lines)
    terms = load_glossary(glossary)
    with_terms = 0
    for src, before, after in zip(lines, plain, forced):
        found = find_terms(terms, src)
        if not found:
            assert after == before, src  # untouched, to the byte
            continue
        with_terms += 1
        for match in found:
            if match.found == "Katze":  # do not translate "Katze": a capital the tiny vocabulary cannot spell
                continue
            want = "tree" if match.entry.source == "hund" else match.found
            assert re.search(rf"\b{want}\b", after), (src, after)
    assert with_terms >= 8
    assert "tree" not in " ".join(b for s, b in zip(lines, plain) if "hund" in s.lower().split())
    counted = re.search(r"glossary's terms: (\d+) found in the input, (\d+) of them", caplog.text)
    found, applied = map(int, counted.groups())
    assert applied == found - 1  # all but the unspellable "Katze", counted


def test_torch_and_onnxruntime_write_the_same_lines_with_a_glossary(capsys, trained_model_dir, tmp_path, lines):
    glossary = tmp_path / "terms.tsv"
    glossary.write_text(GLOSSARY, encoding="utf-8")
    ort, _ = _translate(capsys, trained_model_dir, tmp_path, lines, "--backend", "onnxruntime", "--glossary",
                        glossary)
    torch, _ = _translate(capsys, trained_model_dir, tmp_path, lines, "--backend", "torch", "--glossary", glossary)
    assert ort == torch


def test_sentence_split_documents_keep_their_terms(capsys, trained_model_dir, tmp_path):
    glossary = tmp_path / "terms.tsv"
    glossary.write_text(GLOSSARY, encoding="utf-8")
    docs = ["der hund sieht. die frau hat ein kind.", "eine katze. ein mann!"]
    out, _ = _translate(capsys, trained_model_dir, tmp_path, docs, "--split", "sentences", "--glossary", glossary)
    assert "tree" in out[0] and "katze" in out[1]


def test_bad_glossaries_are_refused_in_one_line_naming_the_line(capsys, trained_model_dir, tmp_path):
    src = write_lines(tmp_path / "in.txt", ["der hund"])
    bad = tmp_path / "bad.tsv"
    bad.write_text("hund\ttree\nHund\tcar\n", encoding="utf-8")
    code, _, err = run_cli_captured(capsys, "serve-batch", trained_model_dir, src, "--output", tmp_path / "o.txt",
                                    "--glossary", bad)
    assert_one_line_error(code, err, "bad.tsv:2", "bad.tsv:1")
    assert not (tmp_path / "o.txt").exists()
    unspellable = tmp_path / "unspellable.tsv"
    unspellable.write_text("# terms\nhund\ttree\n\nkatze\t\u0416\u0417\n", encoding="utf-8")
    code, _, err = run_cli_captured(capsys, "serve-batch", trained_model_dir, src, "--output", tmp_path / "o.txt",
                                    "--glossary", unspellable)
    assert_one_line_error(code, err, f"{unspellable}:4: 'katze' -> '\u0416\u0417'", "cannot spell")
    too_long = tmp_path / "long.tsv"
    too_long.write_text("hund\t" + "a " * 40 + "\n", encoding="utf-8")
    code, _, err = run_cli_captured(capsys, "serve-batch", trained_model_dir, src, "--output", tmp_path / "o.txt",
                                    "--glossary", too_long)
    assert_one_line_error(code, err, f"{too_long}:1: 'hund'", "MAX_TERM_TOKENS (32)")


def test_a_model_dir_without_the_constrained_step_refuses_a_glossary(capsys, trained_model_dir, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(trained_model_dir, old)
    (old / "decoder_constrained.onnx").unlink()
    manifest = (old / "manifest.json").read_text(encoding="utf-8")
    import json

    data = json.loads(manifest)
    data["files"] = {k: v for k, v in data["files"].items() if k != "decoder_constrained.onnx"}
    (old / "manifest.json").write_text(json.dumps(data), encoding="utf-8")
    glossary = tmp_path / "terms.tsv"
    glossary.write_text(GLOSSARY, encoding="utf-8")
    src = write_lines(tmp_path / "in.txt", ["der hund"])
    code, _, err = run_cli_captured(capsys, "serve-batch", old, src, "--output", tmp_path / "o.txt", "--backend",
                                    "onnxruntime", "--glossary", glossary)
    assert_one_line_error(code, err, "cannot apply a glossary to this model dir: it has no decoder_constrained.onnx")
    assert "use the onnxruntime backend" not in err  # said to a user on it
    assert run_cli("serve-batch", old, src, "--output", tmp_path / "o.txt", "--backend", "onnxruntime") == 0


def test_the_ray_and_spark_translator_applies_a_glossary_as_serve_batch_does(capsys, trained_model_dir, tmp_path,
                                                                              lines):
    """Translator(glossary=...) (pipeline/integrations): the same lines serve-batch --glossary writes, and a
    `terms` column saying per row which terms were applied."""
    import json

    from pipeline.integrations.translator import Translator

    glossary = tmp_path / "terms.tsv"
    glossary.write_text(GLOSSARY, encoding="utf-8")
    expected, _ = _translate(capsys, trained_model_dir, tmp_path, lines, "--glossary", glossary)
    translator = Translator(trained_model_dir, glossary=glossary)
    done = translator.translate(lines)
    assert done.translation == expected
    assert done.rows_terms is not None
    rows = [json.loads(t) for t in done.rows_terms]
    assert done.terms == sum(map(len, rows)) > 0 and done.terms_applied == sum(t["applied"] for r in rows for t in r)
    hund = [r for src, r in zip(lines, rows) if "hund" in src.split()]
    assert hund and all({"source": "hund", "target": "tree", "applied": True, "constrained": True} in r for r in hund)
    assert all(r == [] for src, r in zip(lines, rows) if not find_terms(load_glossary(glossary), src))
    columns = translator({"text": __import__("numpy").array(lines[:3], dtype=object)})
    assert "terms" in columns and len(columns["terms"]) == 3
    assert "terms" not in Translator(trained_model_dir).translate(lines[:2]).columns()


def test_the_glossary_is_read_once_for_every_input_and_may_be_given_twice(capsys, trained_model_dir, tmp_path):
    """A pipe (`--glossary <(...)`) served only the first input: the file was read again per input, and the
    second read found the pipe empty. A second --glossary replaced the first in silence; now they are one."""
    import os
    import threading

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    inputs = [write_lines(a / "x.de", ["der hund sieht"]), write_lines(b / "y.de", ["der hund sieht"])]
    fifo = tmp_path / "terms.fifo"
    os.mkfifo(fifo)

    def writer() -> None:
        with open(fifo, "w", encoding="utf-8") as f:
            f.write("hund\ttree\n")
        for _ in range(120):  # a second reader finds nothing more (as the shell's pipe gives nothing more)
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # no reader waiting
                threading.Event().wait(0.5)
                continue
            os.close(fd)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    code, _, err = run_cli_captured(capsys, "serve-batch", trained_model_dir, *inputs, "--output-dir", tmp_path / "o",
                                    "--glossary", fifo, "--no-progress", "--threads", "1")
    assert code == 0, err
    assert ["tree" in (tmp_path / "o" / name).read_text() for name in ("x.de", "y.de")] == [True, True]
    more = tmp_path / "more.tsv"
    more.write_text("sieht\tcar\n", encoding="utf-8")
    first = tmp_path / "first.tsv"
    first.write_text("hund\ttree\n", encoding="utf-8")
    out, _ = _translate(capsys, trained_model_dir, tmp_path, ["der hund sieht"], "--glossary", first,
                        "--glossary", more)
    assert "tree" in out[0] and "car" in out[0]


def test_a_sentence_without_letters_gets_its_terms_target_whichever_way_it_is_split(capsys, caplog,
                                                                                      trained_model_dir, tmp_path):
    """A sentence without letters is copied, not translated (a model invents words for numbers): with
    `--split sentences` that held even when the glossary gave it a target, so "2024" -> "tree" was applied to a
    whole line and silently not to the same text split into sentences (nor over HTTP, which splits)."""
    import logging

    glossary = tmp_path / "terms.tsv"
    glossary.write_text("2024\ttree\n", encoding="utf-8")
    lines = ["2024", "der hund sieht die katze. 2024", "123"]
    with caplog.at_level(logging.INFO):
        whole, _ = _translate(capsys, trained_model_dir, tmp_path, lines, "--glossary", glossary)
        split, _ = _translate(capsys, trained_model_dir, tmp_path, lines, "--glossary", glossary,
                              "--split", "sentences")
    assert "tree" in whole[0].split() and "tree" in split[0].split() and "tree" in split[1].split(), (whole, split)
    assert split[2] == "123"  # no term: still copied
    counts = [r.getMessage() for r in caplog.records if "the glossary's terms" in r.getMessage()]
    assert len(counts) == 2 and all("2 found in the input, 2 of them" in c for c in counts), counts


def test_a_glossary_that_matches_nothing_is_said(capsys, caplog, trained_model_dir, tmp_path, lines):
    """With no term found, serve-batch said nothing of the glossary: one of another language or a mistyped term
    went unnoticed. "0 found" is a warning."""
    import logging

    glossary = tmp_path / "terms.tsv"
    glossary.write_text("zzzzq\tmarun\n", encoding="utf-8")
    with caplog.at_level(logging.INFO):
        plain, _ = _translate(capsys, trained_model_dir, tmp_path, lines[:4])
        forced, _ = _translate(capsys, trained_model_dir, tmp_path, lines[:4], "--glossary", glossary)
    assert forced == plain
    said = [r for r in caplog.records if "glossary's terms" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "0 found in the input, 0 of them in the translations" in said[0].getMessage()

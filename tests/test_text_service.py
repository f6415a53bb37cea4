"""One text service (runtime/texts.py) under every surface was to change nothing a user gets: serve-batch, the
native HTTP API, LibreTranslate's and the Ray / Spark Translator answer byte for byte what they answered at
BEFORE (the last commit before the service), on plain lines with blanks and a long one, n-best, documents, HTML
and a multilingual model, refusals of long lines included. tests/text_surfaces.py asks every surface, once with
BEFORE's tree (git archive, the repository untouched) and once with this checkout.

Skipped where the checkout has no history to take BEFORE from (a shallow clone)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, git_tree

pytestmark = pytest.mark.slow
pytest.importorskip("starlette")
pytest.importorskip("sentencex")
pytest.importorskip("pyarrow", reason="pyarrow is not installed (the ray extra)")

BEFORE = "2f719b7"
SURFACES = Path(__file__).with_name("text_surfaces.py")


@pytest.fixture(scope="module")
def before(tmp_path_factory) -> Path:
    """The tree of BEFORE, unpacked (the repository itself is not touched)."""
    return git_tree(BEFORE, tmp_path_factory.mktemp("before"))


@pytest.fixture(scope="module")
def m2m_dir(tmp_path_factory) -> Path:
    """A tiny multilingual model dir (M2M-100, imported and exported), as test_serve_multilingual's."""
    pytest.importorskip("transformers")
    from click.testing import CliRunner

    from pipeline.cli import cli
    from pipeline.importers.m2m100 import import_m2m100
    from tests.m2m100_fixture import make_m2m100_dir

    tmp = tmp_path_factory.mktemp("m2m-texts")
    hf = make_m2m100_dir(tmp / "m2m100-tiny", max_length=48, encoder_layers=2, decoder_layers=1, encoder_ffn=96,
                         decoder_ffn=64, encoder_heads=4, decoder_heads=2)
    import_m2m100(hf, tmp / "m2m.pt")
    result = CliRunner().invoke(cli, ["export", str(tmp / "m2m.pt"), "--out", str(tmp / "fp32"), "--no-tensorrt"])
    assert result.exit_code == 0, result.output
    return tmp / "fp32"


def surfaces(code: Path, out: Path, *model_dirs: Path) -> dict:
    """Every surface's answers with the code at `code` (its modules first on the path)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(code), PIPELINE_HASH_CACHE="off")
    args = [model_dirs[0], out, *model_dirs[1:]]
    done = subprocess.run([sys.executable, str(SURFACES), *map(str, args)], cwd=code, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text(encoding="utf-8"))


# Counts whose meaning changed after BEFORE, on purpose: serve-batch's summary counts the sentences sent to the
# model (not blank lines, nor sentences without letters, which are copied), its warnings and /metrics' truncated
# lines count lines (a line of three cut sentences is one). Each can only have fallen; everything else is equal.
RECOUNTED = ("sentences", "truncated", "min_len_over")
RECOUNTED_METRICS = ("pipeline_truncated_lines_total",)


def recounted(answer: object) -> tuple[object, dict[str, float]]:
    """(the answer without the recounted counts, those counts)."""
    if isinstance(answer, dict) and isinstance(answer.get("stats"), dict):
        stats = dict(answer["stats"])
        counts = {k: float(stats.pop(k)) for k in RECOUNTED if k in stats}
        return {**answer, "stats": stats}, counts
    if isinstance(answer, list) and all(isinstance(line, str) for line in answer):  # /metrics lines
        # the series of no model are listed once one moves (they were listed at 0 from the start)
        answer = [line for line in answer if not ('model=""' in line and float(line.rsplit(" ", 1)[1]) == 0)]
        counts = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in answer
                  if line.startswith(RECOUNTED_METRICS)}
        return [line for line in answer if not line.startswith(RECOUNTED_METRICS)], counts
    return answer, {}


# Answers changed after BEFORE, on purpose (each undone in the new answer before the comparison): an empty line's
# n-best is one empty hypothesis with score 0, not none (a client reading [0] failed); a long line refused over
# HTTP is named `text[k]` as the request lists it, not `request line:k+1`, and LibreTranslate's as `q[k]` (each
# text of these cases goes to the model: k was the same); a refused row names the Translator's option, not the
# command line's; an HTML text node is named by its number in its text (`text node 2`; it was `text node`).
EMPTY_HYPOTHESIS = re.compile(r'("hypotheses":\s*)\[\{"text":\s*"",\s*"score":\s*0\.0\}\]')
LISTED = re.compile(r"text\[(\d+)\]: (\d+ tokens)")
LIBRE_LISTED = re.compile(r"\bq\[(\d+)\]( (?:text node )?sentence:)")
ROW_OPTION = (" (options with long_lines='truncate')", "")
NODE_NUMBER = re.compile(r"( text node) \d+( sentence:)")
BLANK_NBEST = " ||| 0.0000"  # and a blank line of an n-best file is that one hypothesis too (it was a bare "")


def as_before(answer: object) -> object:
    """An answer with the changes on purpose undone."""
    if isinstance(answer, dict) and isinstance(answer.get("body"), str):
        body = NODE_NUMBER.sub(r"\1\2", EMPTY_HYPOTHESIS.sub(r"\1[]", answer["body"]))
        body = LIBRE_LISTED.sub(r"text[\1]\2", body)
        return {**answer, "body": LISTED.sub(lambda m: f"request line:{int(m[1]) + 1}: {m[2]}", body)}
    if isinstance(answer, dict) and isinstance(answer.get("message"), str):
        return {**answer, "message": NODE_NUMBER.sub(r"\1\2", answer["message"].replace(*ROW_OPTION))}
    for column in ("lines", "translation"):  # serve-batch's lines, the Translator's rows
        if isinstance(answer, dict) and isinstance(answer.get(column), list):
            return {**answer, column: ["" if line == BLANK_NBEST else line for line in answer[column]]}
    return answer


NODE_NAMED = re.compile(r"\b(?:q|text)\[\d+\](?: text node)? sentence:")


def node_unnamed(answer: object, case: str) -> object:
    """An HTML refusal over HTTP without the name of its text: BEFORE named the m-th text node of all the texts
    `text[m]`, now the text as the request lists it (`text[k] text node`), a change no count can undo."""
    if "html" in case and isinstance(answer, dict) and isinstance(answer.get("body"), str):
        return {**answer, "body": NODE_NAMED.sub("TEXT sentence:", answer["body"])}
    return answer


def test_every_surface_answers_what_it_answered_before(before, trained_model_dir, m2m_dir, tmp_path):
    old = surfaces(before, tmp_path / "old.json", trained_model_dir, m2m_dir)
    new = surfaces(ROOT, tmp_path / "new.json", trained_model_dir, m2m_dir)
    assert set(new) == set(old) == {"one_pair", "multilingual"}
    for model in old:
        for surface in old[model]:
            for case in old[model][surface]:
                (ours, our_counts), (theirs, their_counts) = (recounted(node_unnamed(answer, case)) for answer in (
                    as_before(new[model][surface][case]), old[model][surface][case]))
                assert ours == theirs, (model, surface, case)
                assert our_counts.keys() == their_counts.keys(), (model, surface, case)
                assert all(our_counts[k] <= their_counts[k] for k in our_counts), (model, surface, case)
    # the cases do what they are for: translations that differ, long lines cut or refused, a 413
    pair = new["one_pair"]
    assert len(set(pair["serve_batch"]["plain"]["lines"])) > 4
    assert pair["serve_batch"]["plain"]["stats"]["truncated"] == 1
    plain = pair["serve_batch"]["plain"]["stats"]  # blank lines are not sentences sent
    assert plain["sentences"] == old["one_pair"]["serve_batch"]["plain"]["stats"]["sentences"] - plain["empty"]
    assert " ||| " in pair["serve_batch"]["nbest"]["lines"][0]
    for case in ("plain_error", "sentences_error", "html_error"):
        assert "more than the model's limit" in pair["serve_batch"][case]["message"]
        assert "more than the model's limit" in pair["rows"][case]["message"]
    assert pair["rows"]["html_error_origins"]["message"].startswith("shard.txt:12 text node 2 sentence:1: ")
    assert '"error":"q[1] text node 2 sentence:1: ' in pair["http_error"]["libre_html"]["body"]
    assert {pair["http_error"][case]["status"] for case in ("plain", "sentences", "libre", "libre_html")} == {413}

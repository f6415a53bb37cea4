"""The Translator class (Ray Data's map_batches, Spark's predict_batch_udf) translates as serve-batch does, byte
for byte, without torch; the shard plan refuses bad input before any work and resumes; the shard writer puts
rows back in line order and writes each output whole or not at all. No Ray cluster here: test_ray_translate.py
runs the jobs."""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyarrow", reason="pyarrow is not installed (the ray extra)")
from helpers import ROOT, assert_one_line_error, dead_pid, hidden, run_cli_captured, write_lines  # noqa: E402

from model.errors import UserError  # noqa: E402
from pipeline.integrations import Translator  # noqa: E402
from pipeline.integrations.shards import RECORD, ShardWriter, job_record, plan  # noqa: E402
from pipeline.serve_batch.files import ServeStats, serve_files  # noqa: E402
from pipeline.serve_batch.translation import ServeBatchOptions  # noqa: E402
from runtime.decoding import PAPER  # noqa: E402
from runtime.model_dir import LoadOptions, load  # noqa: E402


def corpus_lines(n: int, seed: int = 3) -> list[str]:
    """Rows as users have them: blank and whitespace-only lines, short ones, and lines far over the
    export's 32-token source limit (helpers.SMALL_LIMITS)."""
    rng = random.Random(seed)
    words = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op", "x1", "y22"]
    out = []
    for i in range(n):
        length = rng.choice([0, 1, 2, 4, 7, 12, 60])
        out.append("   " if i % 17 == 5 else " ".join(rng.choices(words, k=length)))
    return out


def serve_batch_lines(model_dir: Path, lines: list[str], tmp: Path, opts: ServeBatchOptions
                      ) -> tuple[list[str], ServeStats]:
    """What serve-batch writes for `lines` (its own files path, one process), and what it counts."""
    src = write_lines(tmp / "src.txt", lines)
    loaded = load(model_dir, LoadOptions(backend="onnxruntime", threads=1), opts.decoding)
    out = tmp / "served.txt"
    stats = serve_files(loaded.backend, loaded.tokenizer, [str(src)], [str(out)],
                        dataclasses.replace(opts, decoding=loaded.decoding), progress=False)
    return out.read_text(encoding="utf-8").split("\n")[:-1], stats


NBEST2 = PAPER.replace(nbest=2, explicit=frozenset({"nbest"}))


@pytest.mark.parametrize("decoding, split, fmt", [(PAPER, "none", "text"), (NBEST2, "none", "text"),
                                                  (PAPER, "sentences", "text"), (PAPER, "none", "html")])
def test_translator_is_serve_batch_byte_for_byte(fp32_dir, tmp_path, decoding, split, fmt):
    """Blank rows, long rows (truncated, or cut into sentences), n-best, documents and HTML: the rows in batches
    of any size give the lines serve-batch writes, and the repair columns count what serve-batch counts."""
    lines = corpus_lines(90)
    if split == "sentences":
        lines = [f"{a}. {b}?  {c}" if a else a for a, b, c in zip(lines, lines[1:] + [""], lines[2:] + ["", ""])]
    if fmt == "html":
        lines = [f"<p>{a} <b>{b}</b></p>" if a.strip() else a for a, b in zip(lines, lines[1:] + [""])]
    opts = ServeBatchOptions(decoding=decoding, split=split, format=fmt)
    expected, stats = serve_batch_lines(fp32_dir, lines, tmp_path, opts)
    translator = Translator(fp32_dir, column="src", load_options=LoadOptions(backend="onnxruntime"),
                            decoding=decoding, options=opts)
    rows: dict[str, list] = {"translation": [], "score": [], "empty": [], "truncated": []}
    start = 0
    for size in (1, 7, 30, 52):  # batches unlike serve-batch's one window
        batch = translator({"src": lines[start:start + size], "id": list(range(start, start + size))})
        assert list(batch["id"]) == list(range(start, start + size))  # the other columns pass through
        for name in rows:
            rows[name] += list(batch[name])
        start += size
    assert rows["translation"] == expected
    assert rows["empty"] == [not line.strip() for line in lines]
    assert sum(rows["empty"]) == stats.empty and sum(n > 0 for n in rows["truncated"]) == stats.truncated  # lines
    # a long line is truncated; a document's long sentence is cut into sentences that fit, none truncated
    assert (stats.truncated > 0) == (split == "none" and fmt == "text")
    if split == "none" and fmt == "text":
        assert [bool(n) for n in rows["truncated"]] == [len(translator.loaded.tokenizer.encode_source([t])[0]) > 32
                                                        for t in lines]
        scores = [s for s, e in zip(rows["score"], rows["empty"]) if not e]
        assert all(s < 0 for s in scores) and all(math.isnan(s) for s, e in zip(rows["score"], rows["empty"]) if e)
    if decoding.nbest == 2:
        assert all(" ||| " in t for t, e in zip(rows["translation"], rows["empty"]) if not e)


def test_translator_takes_pandas_and_nulls(fp32_dir):
    import pandas as pd

    translator = Translator(fp32_dir, load_options=LoadOptions(backend="onnxruntime"))
    frame = translator(pd.DataFrame({"text": ["ab cd", None, "ef"]}))
    assert list(frame["empty"]) == [False, True, False]
    assert frame["translation"][1] == ""
    assert list(frame["translation"]) == translator.translate(["ab cd", "", "ef"]).translation


def test_search_options_given_inside_options_are_the_ones_used(fp32_dir):
    """options=ServeBatchOptions(decoding=...) was dropped in silence: beam_size=1 and max_len_b=3 ran the
    model's own search, and split="sentences" with nbest=2 (refused on the command line) ran nbest=1."""
    short = PAPER.replace(beam_size=1, max_len_a=0, max_len_b=3)
    onnx = LoadOptions(backend="onnxruntime")
    inside = Translator(fp32_dir, load_options=onnx, options=ServeBatchOptions(decoding=short))
    given = Translator(fp32_dir, load_options=onnx, decoding=short)
    lines = ["ab cd ef gh ij kl", "mn op qr"]
    assert inside.options.decoding == given.options.decoding
    assert inside.translate(lines).translation == given.translate(lines).translation
    with pytest.raises(UserError, match="--split sentences"):
        Translator(fp32_dir, load_options=onnx, options=ServeBatchOptions(split="sentences",
                                                                           decoding=PAPER.replace(nbest=2)))
    with pytest.raises(UserError, match=r"^the search options are given twice, as decoding= and as "
                       r"options.decoding, and differ"):
        Translator(fp32_dir, load_options=onnx, decoding=PAPER.replace(beam_size=2),
                   options=ServeBatchOptions(decoding=short))


def test_repairs_serve_batch_says_are_counted_and_said_by_the_translator(fp32_dir, caplog):
    """A sentence over the source limit translated in pieces (split sentences) and an HTML row leaving a tag open
    (its rest copied untranslated): serve-batch warns of each, the Translator (and so ray-translate) said
    nothing, and its `truncated` was 0 for the row."""
    import logging

    onnx = LoadOptions(backend="onnxruntime")
    long_sentence = " ".join(["ab cd ef gh"] * 20)  # no sentence end: one sentence of 80 words, over 32 tokens
    split = Translator(fp32_dir, load_options=onnx, options=ServeBatchOptions(split="sentences"))
    with caplog.at_level(logging.WARNING, logger="pipeline.integrations.translator"):
        out = split.translate([long_sentence, "ab. cd."])
    assert (out.pieced, out.unclosed) == (1, 0)
    assert "1 row(s) held a sentence longer than the model's source limit, translated in pieces" in caplog.text
    html = Translator(fp32_dir, load_options=onnx, options=ServeBatchOptions(format="html"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipeline.integrations.translator"):
        out = html.translate(["<b>ab</b> cd", "ab <i cd", "ef <!-- gh"])
    assert (out.pieced, out.unclosed) == (0, 2)
    assert "2 row(s) leave a tag, a comment or a <script> open" in caplog.text


def test_a_column_the_translator_adds_is_never_replaced_unseen(fp32_dir):
    """A batch's own "score" (a QA score) or "translation" (a reference) was replaced by the Translator's."""
    import pyarrow as pa

    translator = Translator(fp32_dir, load_options=LoadOptions(backend="onnxruntime"))
    for batch in ({"text": np.array(["ab cd"], dtype=object), "score": np.array([0.97])},
                  pa.table({"text": ["ab cd"], "translation": ["human reference"]})):
        with pytest.raises(UserError, match=r"^the rows already have '(score|translation)', a column the "
                           r"Translator adds \(translation, score, empty, truncated\); rename or drop it first"):
            translator(batch)


def test_one_string_is_refused_where_rows_belong(fp32_dir):
    """translate("ab cd ef") translated each character as a row (8 translations), and {"text": "ab cd"} set 5-row
    columns beside the scalar."""
    translator = Translator(fp32_dir, load_options=LoadOptions(backend="onnxruntime"))
    with pytest.raises(TypeError, match=r"takes a list of texts, not one string: translate\(\[text\]\)"):
        translator.translate("ab cd ef")
    with pytest.raises(TypeError, match=r"the column 'text' is one string; a batch holds a list"):
        translator({"text": "ab cd"})
    assert len(translator.translate(["ab cd ef"]).translation) == 1


def test_every_kind_of_null_is_a_blank_row_and_what_is_not_text_is_refused(fp32_dir):
    """Ray's pandas batches hold pd.NA (a string[pyarrow] column's null): "<NA>" was translated as text, and so
    were NaT, a float32 NaN ("nan") and a null Arrow scalar ("None"); a number or a list was made text in
    silence, and a pyarrow batch (batch_format="pyarrow") was a TypeError."""
    import pandas as pd
    import pyarrow as pa

    translator = Translator(fp32_dir, load_options=LoadOptions(backend="onnxruntime"))
    nulls = [pd.NA, pd.NaT, np.float32("nan"), float("nan"), None, pa.scalar(None, pa.string())]
    done = translator.translate(["ab cd", *nulls, pa.scalar("ef"), b"ab"])
    assert done.translation[1:7] == [""] * 6 and done.empty == [False] + [True] * 6 + [False, False]
    assert done.translation[7] == translator.translate(["ef"]).translation[0]
    column = pd.array(["ab cd", None], dtype="string")
    assert translator({"text": column})["empty"].tolist() == [False, True]
    for value, says in ((7, "row:2 of this batch of 2: int '7', not text"), (["ab"], "row:2 of this batch of 2: list"),
                        (b"\xff", "row:2 of this batch of 2 (b'\\xff'): invalid UTF-8")):
        with pytest.raises(UserError, match=re.escape(says)):
            translator.translate(["ab", value])
    with pytest.raises(UserError, match=r"^f\.parquet:12: int '5', not text"):  # named by its origin, as lines are
        translator.translate(["ab", 5], [["f.parquet", "f.parquet"], [11, 12]])
    replacing = Translator(fp32_dir, load_options=LoadOptions(backend="onnxruntime"),
                           options=ServeBatchOptions(invalid_utf8="replace"))
    assert not replacing.translate([b"ab \xff"]).empty[0]
    table = translator(pa.table({"text": ["ab cd", None]}))
    assert table.column("translation").to_pylist() == [done.translation[0], ""]
    assert table.column("empty").to_pylist() == [False, True]


def test_translator_errors_are_one_line_naming_the_row(fp32_dir):
    translator = Translator(fp32_dir, column="src", load_options=LoadOptions(backend="onnxruntime"),
                            options=ServeBatchOptions(long_lines="error"), origin_columns=("path", "line"))
    with pytest.raises(UserError, match=r"no column 'src' in the rows \(they have: text\)"):
        translator({"text": ["ab"]})
    import pyarrow as pa  # an Arrow batch has no keys(): an AttributeError; origin columns missing: a KeyError

    with pytest.raises(UserError, match=r"no column 'src' in the rows \(they have: x\)"):
        translator(pa.table({"x": ["ab"]}))
    with pytest.raises(UserError, match=r"no column 'path' in the rows \(they have: src\); .*origin_columns"):
        translator({"src": ["ab"]})
    long = " ".join(["ab"] * 80)
    with pytest.raises(UserError, match=r"^shard\.txt:12: \d+ tokens, more than the model's limit of 32; pass "
                                        r"--long-lines truncate \(options with long_lines='truncate'\)"):
        translator({"src": ["ab", long], "path": ["shard.txt", "shard.txt"], "line": [11, 12]})


def test_a_row_that_is_no_text_is_refused_as_serve_batch_and_the_apis_refuse_it(fp32_dir):
    """A NUL was translated (serve-batch and both HTTP APIs refuse it), a lone surrogate was SentencePiece's
    RuntimeError naming no row, a row of two lines became one sentence with its second line mostly lost (the
    native API refuses it), and an invalid byte was counted from 1 where serve-batch counts from 0."""
    translator = Translator(fp32_dir, load_options=LoadOptions(backend="onnxruntime"))
    # named by its place in the batch and how it begins: Spark's and Ray's batches are slices of the data
    for value, says in (("ab\x00cd", "row:2 of this batch of 2 ('ab\\x00cd'): holds a NUL character (U+0000, "
                                     "character 2)"),
                        ("ab \udcff", "row:2 of this batch of 2 ('ab \\udcff'): holds a lone surrogate"),
                        ("ab\ncd", "row:2 of this batch of 2 ('ab\\ncd'): holds a newline; give one line per row, "
                                   "or pass --split sentences (options with split='sentences')"),
                        (b"ab\xff", "row:2 of this batch of 2 (b'ab\\xff'): invalid UTF-8 (byte 2: b'\\xff')")):
        with pytest.raises(UserError, match="^" + re.escape(says)):
            translator.translate(["ab", value])
    replacing = Translator(fp32_dir, load_options=LoadOptions(backend="onnxruntime"),
                           options=ServeBatchOptions(invalid_utf8="replace"))
    assert replacing.translate(["ab\x00cd", "ab \udcff"]).translation == replacing.translate(
        ["ab\ufffdcd", "ab \ufffd"]).translation
    documents = Translator(fp32_dir, load_options=LoadOptions(backend="onnxruntime"),
                           options=ServeBatchOptions(split="sentences"))
    two = documents.translate(["ab cd\nef"]).translation[0]
    assert two.count("\n") == 1 and two.split("\n")[1] == documents.translate(["ef"]).translation[0]


BLOCKED = """
import sys
sys.modules['torch'] = None
from pipeline.integrations import Translator
from pipeline.integrations.spark import make_predict_fn
from runtime.model_dir import LoadOptions
import numpy as np
rows = Translator(sys.argv[1], load_options=LoadOptions(backend='onnxruntime')).translate(['ab cd', '', 'ef'])
predicted = make_predict_fn(sys.argv[1])()(np.array(['ab cd', '', 'ef'], dtype=object))
assert list(predicted['translation']) == rows.translation, (predicted, rows)
assert list(predicted['empty']) == [0, 1, 0], predicted
loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'torch' and sys.modules[m] is not None)
assert not loaded, loaded
print(rows.translation)
"""


def test_translator_and_spark_predict_fn_need_no_torch(fp32_dir):
    proc = subprocess.run([sys.executable, "-c", BLOCKED, str(fp32_dir)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("''") == 1


def test_spark_return_type_without_pyspark_names_the_extra(monkeypatch):
    """return_type() without pyspark was a bare "No module named 'pyspark'" where the CLI names the extra."""
    from pipeline.integrations.spark import return_type

    monkeypatch.setitem(sys.modules, "pyspark", None)
    with pytest.raises(ModuleNotFoundError, match=r'^return_type\(\) is a pyspark type, and pyspark is not installed '
                                                  r'here: pip install -e "\.\[spark\]"') as e:
        return_type()
    assert e.value.name == "pyspark"


# -- the shard plan -----------------------------------------------------------------------------------


def write_parquet(path: Path, columns: dict[str, list]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def test_plan_reads_files_globs_and_directories(tmp_path, caplog):
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("b.txt", "a.txt.gz", "_part.txt", ".a.crc"):
        (shards / name).write_bytes(gzip.compress(b"x\n") if name.endswith(".gz") else b"x\n")
    (shards / "_SUCCESS").touch()
    (shards / "_common_metadata").write_bytes(b"PAR1 a dataset's schema")  # not a shard, nor worth a warning
    write_parquet(tmp_path / "p.parquet", {"src": ["x"]})
    write_lines(tmp_path / "c1.txt", ["x"])
    write_lines(tmp_path / "c2.txt", ["x"])
    job = plan([str(shards), str(tmp_path / "c*.txt"), str(tmp_path / "p.parquet")], tmp_path / "out", "src", {})
    assert [s.output.name for s in job.shards] == ["a.txt", "b.txt", "c1.txt", "c2.txt", "p.txt"]
    assert [s.index for s in job.todo] == [0, 1, 2, 3, 4] and not job.skipped
    assert job.shards[4].parquet and not job.shards[0].parquet
    # a file of text named as Spark's markers are was left out in silence
    assert "left out 1 file(s) named with a leading _ as Spark's markers are (_part.txt)" in caplog.text
    # a file whose own name holds glob characters is that file (it was "no file matches this pattern")
    literal = write_lines(tmp_path / "br[1].txt", ["x"])
    assert [s.path for s in plan([str(literal)], tmp_path / "out2", "src", {}).shards] == [str(literal)]


@pytest.mark.parametrize("case, needles", [
    ("missing column", ["p.parquet", "no column 'text'", "(it has: src)", "--column"]),
    ("not parquet", ["bad.parquet", "cannot read as Parquet"]),
    ("missing shard", ["nope.txt", "no such file"]),
    ("empty glob", ["none*.txt", "no file matches"]),
    ("output is input dir", ["this output is the input", "choose another path"]),
    ("output inside input dir", ["the input directory", "choose a"]),
    ("same output name", ["would both be written to"]),
    ("stdin", ["input '-'"]),
])
def test_plan_refuses_bad_input_in_one_line(tmp_path, capsys, fp32_dir, case, needles):
    shards = tmp_path / "shards"
    shards.mkdir()
    write_lines(shards / "a.txt", ["x"])
    inputs, out = [str(shards)], tmp_path / "out"
    if case == "missing column":
        inputs = [str(write_parquet(tmp_path / "p.parquet", {"src": ["x"]}))]
    elif case == "not parquet":
        inputs = [str(write_lines(tmp_path / "bad.parquet", ["x"]))]
    elif case == "missing shard":
        inputs = [str(tmp_path / "nope.txt")]
    elif case == "empty glob":
        inputs = [str(tmp_path / "none*.txt")]
    elif case == "output is input dir":
        out = shards
    elif case == "output inside input dir":
        out = shards / "sub"
    elif case == "same output name":
        inputs = [str(shards / "a.txt"), str(write_lines(tmp_path / "a.txt", ["y"]))]
    elif case == "stdin":
        inputs = ["-"]
    code, _, err = run_cli_captured(capsys, "ray-translate", fp32_dir, *inputs, "--output-dir", out)
    assert_one_line_error(code, err, *needles)
    assert not (shards / "sub").exists()


def test_plan_takes_dictionary_and_null_text_columns_and_refuses_others_before_any_work(tmp_path):
    """pandas' `category` (a dictionary of strings) and a column of nulls only (Arrow type null) are text: a null
    is a blank line. A column of numbers is refused by the plan, before a cluster is reached."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    frame = pd.DataFrame({"text": pd.Categorical(["ab", None, "ab", "cd"])})
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), tmp_path / "cat.parquet")
    pq.write_table(pa.table({"text": pa.nulls(3), "id": [1, 2, 3]}), tmp_path / "nulls.parquet")
    assert pa.types.is_dictionary(pq.read_schema(tmp_path / "cat.parquet").field("text").type)
    job = plan([str(tmp_path / "cat.parquet"), str(tmp_path / "nulls.parquet")], tmp_path / "out", "text", {})
    assert [s.output.name for s in job.todo] == ["cat.txt", "nulls.txt"]
    write_parquet(tmp_path / "ids.parquet", {"text": [1, 2]})
    with pytest.raises(UserError, match=r"ids\.parquet: column 'text' holds int64, not text; name a string column"):
        plan([str(tmp_path / "ids.parquet")], tmp_path / "out2", "text", {})


def test_plan_resumes_the_same_job_and_refuses_another(tmp_path):
    for name in ("a.txt", "b.txt"):
        write_lines(tmp_path / name, ["x"])
    inputs, out = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], tmp_path / "out"
    record = {"manifest_sha256": "1", "beam_size": 4}
    assert len(plan(inputs, out, "text", record).todo) == 2
    write_lines(out / "a.txt", ["X"])  # a's output renamed into place: complete
    (out / f".a.txt.~pipeline-{dead_pid()}-x.part").write_text("torn")  # a killed run's temp
    job = plan(inputs, out, "text", record)
    assert [s.output.name for s in job.todo] == ["b.txt"] and [s.output.name for s in job.skipped] == ["a.txt"]
    assert hidden(out) == [RECORD]  # the dead writer's temp is gone
    with pytest.raises(UserError, match=r"another model or options \(beam_size differ\); rerun with the same"):
        plan(inputs, out, "text", {**record, "beam_size": 5})
    write_lines(tmp_path / "c.txt", ["y"])
    # another job's inputs into a dir holding this one's outputs: its record was replaced, the outputs mixed
    with pytest.raises(UserError, match=r"another model or options \(beam_size differ\)"):
        plan([str(tmp_path / "c.txt")], out, "text", {**record, "beam_size": 5})
    (out / RECORD).unlink()
    with pytest.raises(UserError, match="already holds outputs this command did not record"):
        plan(inputs, out, "text", record)
    with pytest.raises(UserError, match=r"--output-dir .*a.txt: a file, not a directory"):
        plan([str(tmp_path / "c.txt")], tmp_path / "a.txt", "text", record)



def test_an_output_made_from_another_input_of_that_name_is_not_taken_for_done(tmp_path):
    """A rerun skipped any shard whose output existed: d2/x.txt into the dir that holds d1/x.txt's translation
    (or x.txt regenerated in place) was "already translated", the output the other file's. The record keeps each
    output's input (path, size, mtime)."""
    import os

    record = {"manifest_sha256": "1", "format": "text"}
    (tmp_path / "d1").mkdir()
    (tmp_path / "d2").mkdir()
    first, second = tmp_path / "d1" / "x.txt", tmp_path / "d2" / "x.txt"
    write_lines(first, ["eins", "zwei"])
    write_lines(second, ["drei"])
    out = tmp_path / "out"
    assert [s.output.name for s in plan([str(first)], out, "text", record).todo] == ["x.txt"]
    write_lines(out / "x.txt", ["ONE", "TWO"])  # the job's output, complete
    assert not plan([str(first)], out, "text", record).todo  # the same input: resumed, nothing to do
    same = tmp_path / "d3" / "x.txt"  # another file of the same size and time (cp -p): not "modified"
    same.parent.mkdir()
    write_lines(same, ["eins", "zwei"])
    os.utime(same, ns=(os.stat(first).st_atime_ns, os.stat(first).st_mtime_ns))
    with pytest.raises(UserError, match=r"d3/x.txt is another file \(the same size and time\)"):
        plan([str(same)], out, "text", record)
    with pytest.raises(UserError, match=r"out/x.txt: translated from .*d1/x.txt, and .*d2/x.txt is another file "
                       r"\(size 10 -> 5\); it would be skipped as done"):
        plan([str(second)], out, "text", record)
    write_lines(first, ["eins", "zwei", "drei"])  # regenerated in place
    os.utime(first, ns=(1, 1))
    with pytest.raises(UserError, match=r"d1/x.txt is the same file, changed since"):
        plan([str(first)], out, "text", record)
    write_lines(first, ["zwei", "eins"])  # rewritten at the same size (touched): said so, not "size 10 -> 10"
    with pytest.raises(UserError, match=r"d1/x.txt is the same file, changed since \(the same size, modified at "
                       r"another time\)"):
        plan([str(first)], out, "text", record)
    (out / "x.txt").unlink()  # the way out the message names: translated again
    assert [s.output.name for s in plan([str(first)], out, "text", record).todo] == ["x.txt"]

def test_a_record_lists_its_outputs_and_an_older_record_resumes_its_job(tmp_path):
    """A README in the output dir counted as another job's output (a rerun with other options was refused over
    it); a record written before the search was recorded as it runs refused the very job that wrote it."""
    write_lines(tmp_path / "a.txt", ["x"])
    out = tmp_path / "out"
    out.mkdir()
    (out / "README").write_text("notes\n")
    # as the command records them: --format's value under "format" (a record's own bookkeeping once took that key,
    # and every rerun into the dir was refused, "format differ")
    new = {"manifest_sha256": "1", "format": "text", "decoding": {"beam_size": 4}}
    old = {"manifest_sha256": "1", "format": "text", "decoding": {}}
    plan([str(tmp_path / "a.txt")], out, "text", new)
    plan([str(tmp_path / "a.txt")], out, "text", {**new, "decoding": {"beam_size": 2}})  # nothing made yet
    assert json.loads((out / RECORD).read_text())["outputs"] == ["a.txt"]
    (out / RECORD).write_text(json.dumps(old))  # as the version before wrote it, its a.txt complete
    write_lines(out / "a.txt", ["X"])
    write_lines(tmp_path / "b.txt", ["y"])
    job = plan([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], out, "text", new, earlier={1: old})
    assert [s.output.name for s in job.todo] == ["b.txt"]
    assert json.loads((out / RECORD).read_text())["outputs"] == ["a.txt", "b.txt"]
    with pytest.raises(UserError, match=r"\(decoding differ\)"):  # b.txt not made yet; a.txt is listed
        plan([str(tmp_path / "b.txt")], out, "text", {**new, "decoding": {"beam_size": 2}})
    assert not plan([str(tmp_path / "a.txt")], out, "text", new).todo  # the same command: resumed, nothing to do
    with pytest.raises(UserError, match=r"\(format differ\)"):  # --format html outputs never mixed with text ones
        plan([str(tmp_path / "a.txt")], out, "text", {**new, "format": "html"})
    # a version 2 record: the backend as asked ("auto"), where version 3 records the one that runs
    asked, runs = {**new, "backend": "auto"}, {**new, "backend": "onnxruntime"}
    (out / RECORD).write_text(json.dumps({**asked, "record_version": 2, "outputs": ["a.txt"]}))
    assert not plan([str(tmp_path / "a.txt")], out, "text", runs, earlier={2: asked}).todo
    assert json.loads((out / RECORD).read_text())["backend"] == "onnxruntime"
    assert not plan([str(tmp_path / "a.txt")], out, "text", runs).todo  # rewritten as version 3: resumed as one


def test_job_record_names_the_model_by_its_manifest(fp32_dir):
    record = job_record(fp32_dir, {"beam_size": 4})
    assert record["beam_size"] == 4 and len(record["manifest_sha256"]) == 64
    assert json.loads(json.dumps(record)) == record


# -- the writer ---------------------------------------------------------------------------------------


def test_writer_restores_line_order_and_writes_each_shard_whole(tmp_path):
    for name in ("a.txt", "b.txt", "empty.txt"):
        write_lines(tmp_path / name, [])
    job = plan([str(tmp_path / n) for n in ("a.txt", "b.txt", "empty.txt")], tmp_path / "out", "text", {})
    rows = [(0, i, f"a{i}", i == 9) for i in range(10)] + [(1, i, f"b{i}", i == 4) for i in range(5)]
    random.Random(1).shuffle(rows)
    writer = ShardWriter(job.todo)
    for k, row in enumerate(rows):
        writer.add(*row)
        done = {p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith(".")}
        a_complete = all(r in rows[:k + 1] for r in rows if r[0] == 0)
        assert ("a.txt" in done) == a_complete  # an output exists only once complete
    writer.finish()
    assert (tmp_path / "out/a.txt").read_text() == "".join(f"a{i}\n" for i in range(10))
    assert (tmp_path / "out/b.txt").read_text() == "".join(f"b{i}\n" for i in range(5))
    assert (tmp_path / "out/empty.txt").read_text() == ""
    assert writer.lines == 15


def test_writer_refuses_a_line_twice_or_missing_and_leaves_no_temp(tmp_path):
    write_lines(tmp_path / "a.txt", ["x", "y", "z"])
    job = plan([str(tmp_path / "a.txt")], tmp_path / "out", "text", {})
    writer = ShardWriter(job.todo)
    writer.add(0, 0, "X", False)
    with pytest.raises(RuntimeError, match="line 1 came back twice"):
        writer.add(0, 0, "X", False)
    writer.add(0, 2, "Z", True)
    with pytest.raises(RuntimeError, match="rows after line 1 never came back"):
        writer.finish()
    writer.abort(RuntimeError("stop"))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [RECORD]  # no output, no temp
    writer = ShardWriter(job.todo)  # a shard with rows missing entirely is not an empty input
    with pytest.raises(RuntimeError, match="never came back"):
        writer.finish()


def test_the_python_api_in_three_lines(fp32_dir):
    """README's "Translate from Python": everything from `pipeline`, nothing from runtime or model."""
    import subprocess
    import sys

    from helpers import cli_env

    code = ("from pipeline import Translator, LoadOptions\n"
            f"t = Translator({str(fp32_dir)!r}, load_options=LoadOptions(backend='onnxruntime'))\n"
            "out = t.translate(['der hund sieht die katze.', ''])\n"
            "assert out.translation[1] == '' and out.translation[0] and out.empty == [False, True], out\n"
            "import sys; assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_ray_bar_knows_its_total_where_counting_is_cheap(tmp_path):
    """ray-translate's bar had no total: plain shards' lines and Parquet shards' rows are counted first; a .gz
    shard (counting would decompress it) leaves it without one."""
    import gzip

    pq = pytest.importorskip("pyarrow.parquet")
    pytest.importorskip("ray")
    import pyarrow as pa

    from pipeline.integrations.ray_read import shard_lines
    from pipeline.integrations.shards import Shard

    (tmp_path / "a.txt").write_text("x\ny\n\nz")  # a last line without its line break counts
    pq.write_table(pa.table({"text": ["a", None, "b"]}), tmp_path / "b.parquet")
    with gzip.open(tmp_path / "c.txt.gz", "wt") as f:
        f.write("x\n")
    shards = [Shard(i, str(tmp_path / n), tmp_path / "out") for i, n in enumerate(("a.txt", "b.parquet", "c.txt.gz"))]
    assert shard_lines(shards[:2]) == 4 + 3
    assert shard_lines(shards) is None


def test_ray_rows_of_a_file_without_line_breaks_are_refused_not_read_whole(monkeypatch):
    """ray-translate's reader kept the unfinished line of every chunk: a file without line breaks grew it to the
    file's size (serve-batch refuses past MAX_LINE_BYTES, and now so does it, in the same words)."""
    import io

    from pipeline.integrations import ray_read

    monkeypatch.setattr(ray_read, "READ_CHUNK", 8)
    monkeypatch.setattr(ray_read, "MAX_LINE_BYTES", 20)
    assert list(ray_read._text_rows(io.BytesIO(b"ab cd\n" * 5 + b"x" * 20), "s.txt", "error")) == \
        [("ab cd", 0)] * 5 + [("x" * 20, 0)]
    with pytest.raises(UserError, match=r"^s.txt:6: a line of more than \d+ MiB with no line break"):
        list(ray_read._text_rows(io.BytesIO(b"ab cd\n" * 5 + b"x" * 30), "s.txt", "error"))


def test_a_parquet_row_repaired_under_replace_is_counted_as_a_text_line_is():
    """A NUL in a Parquet row was replaced by U+FFFD without being counted, where the same NUL in a text shard
    is counted in the job's "line(s) had invalid UTF-8 or a NUL byte, replaced" line."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.integrations.ray_read import _parquet_rows

    buffer = io.BytesIO()
    pq.write_table(pa.table({"src": ["ab", "a\x00b", None, "\x00"]}), buffer)  # Arrow holds no lone surrogate

    class Stream:  # what Ray hands a datasource: a file object with readall()
        def readall(self) -> bytes:
            return buffer.getvalue()

    assert [flag for _, flag in _parquet_rows(Stream(), "p.parquet", "src", "replace")] == [0, 1, 0, 1]
    assert [flag for _, flag in _parquet_rows(Stream(), "p.parquet", "src", "error")] == [0, 0, 0, 0]


def test_a_job_of_before_resumes_only_under_the_sentence_rules_it_was_split_by(fp32_dir, tmp_path, capsys,
                                                                                monkeypatch):
    """A version 2 record (--lang's default then: en) of a --split sentences job on a de-en model resumed with the
    German rules --lang now takes from the model: its outputs split by English rules, the rest by German ones.
    Refused now ("lang differ"); --lang en resumes it. Without splitting, the rules change nothing: resumed."""
    import shutil

    from helpers import with_language_pair

    from pipeline.integrations import ray_job

    model = with_language_pair(fp32_dir, tmp_path / "de-en", "de", "en")
    ran: list[tuple[str | None, list[str]]] = []
    monkeypatch.setattr(ray_job, "translate_shards", lambda model_dir, job, load, decoding, opts, *rest: (
        ran.append((opts.lang, [s.output.name for s in job.todo])), ray_job.JobStats())[1])
    corpus = tmp_path / "in"
    corpus.mkdir()
    for name in ("a.txt", "b.txt"):
        (corpus / name).write_text("Er kam am 3. Oktober.\n")
    args = ["ray-translate", model, corpus, "--output-dir", tmp_path / "out", "--backend", "onnxruntime"]
    for split in ((), ("--split", "sentences")):
        out = tmp_path / "out"
        code, _, err = run_cli_captured(capsys, *args, *split)  # writes the record; the stand-in writes nothing
        assert code == 0, err
        record = json.loads((out / RECORD).read_text())
        (out / "a.txt.en").write_text("done\n")  # a's output, made by the version before
        older = {k: v for k, v in record.items() if k not in ("record_version", "outputs", "inputs")}
        older.update(record_version=2, backend="onnxruntime", lang="en", outputs=["a.txt.en"])
        (out / RECORD).write_text(json.dumps(older))
        ran.clear()
        code, _, err = run_cli_captured(capsys, *args, *split)
        if split:
            assert code == 2 and "(lang differ)" in err, err
            code, _, err = run_cli_captured(capsys, *args, *split, "--lang", "en")
            assert code == 0 and ran == [("en", ["b.txt.en"])], (err, ran)
        else:
            assert code == 0 and ran == [("de", ["b.txt.en"])], (err, ran)
        shutil.rmtree(out)

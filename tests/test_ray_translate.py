"""`pipeline ray-translate` on a local Ray cluster (two CPUs, started once for this module): outputs byte-identical
to serve-batch's for plain, .gz and Parquet shards; a rerun skips complete shards; a worker's refusal is one
line; and (slow tier) a Translator actor killed mid-job is restarted, its rows retried, and the outputs are
complete and identical, nothing lost or duplicated."""

from __future__ import annotations

import gzip
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray", reason="Ray is not installed (the ray extra)")
import ray  # noqa: E402
from helpers import assert_one_line_error, cli_env, hidden, pipeline_cmd, run_cli_captured, write_lines  # noqa: E402
from test_integrations import corpus_lines, write_parquet  # noqa: E402

from model.errors import UserError  # noqa: E402
from pipeline.integrations.options import RayOptions  # noqa: E402
from pipeline.integrations.ray_job import _JobTranslator, actors, translate_shards  # noqa: E402
from pipeline.integrations.shards import RECORD, plan  # noqa: E402
from pipeline.integrations.translator import Translator  # noqa: E402
from pipeline.serve_batch.files import serve_files  # noqa: E402
from pipeline.serve_batch.translation import ServeBatchOptions  # noqa: E402
from runtime.decoding import PAPER  # noqa: E402
from runtime.model_dir import LoadOptions, load  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    """One local cluster for the module: ray-translate finds it connected and uses it (ray.init costs seconds)."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning",
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})
    yield
    ray.shutdown()


def test_actors_fill_the_cluster_and_gpus_are_checked(caplog):
    cpus = {"CPU": 16.0}
    with caplog.at_level("WARNING"):  # more than fit: taken as asked, in silence, and the summary counted them
        assert actors(RayOptions(actors=20), LoadOptions(threads=2), cpus) == 20
    assert "--actors 20: the cluster holds 8 now (16 CPUs, 2 thread(s) an actor)" in caplog.text
    assert actors(RayOptions(), LoadOptions(), cpus) == 16  # one 1-thread actor per core
    assert actors(RayOptions(), LoadOptions(threads=4), cpus) == 4  # actors x threads = cores
    assert actors(RayOptions(actors=3), LoadOptions(), cpus) == 3
    assert actors(RayOptions(gpus_per_actor=1), LoadOptions(), {"CPU": 16.0, "GPU": 4.0}) == 4
    with pytest.raises(UserError, match=r"--gpus-per-actor 1: the cluster has 0 GPU\(s\)"):
        actors(RayOptions(gpus_per_actor=1), LoadOptions(), cpus)
    with pytest.raises(UserError, match=r"--threads 32: each actor reserves that many CPUs and the cluster has 16;"):
        actors(RayOptions(), LoadOptions(threads=32), cpus)  # no actor could be placed: it waited for ever


def test_the_jobs_actors_return_only_what_the_writer_takes(fp32_dir):
    """The actors drop the source text and path themselves: a projection step after them would be a Ray task
    per block, a worker process started for each on a small machine (twice the job's time on 2 cores)."""
    lines = corpus_lines(30)
    rows = {"shard": np.zeros(30, np.int32), "line": np.arange(1, 31), "text": np.array(lines, dtype=object),
            "path": np.array(["a.txt"] * 30, dtype=object), "last": np.arange(30) == 29,
            "replaced": np.zeros(30, bool)}
    load_options = LoadOptions(backend="onnxruntime")
    back = _JobTranslator(fp32_dir, load_options=load_options, origin_columns=("path", "line"))(dict(rows))
    assert list(back) == ["shard", "line", "translation", "last", "replaced", "empty", "truncated", "min_len_over",
                          "terms", "terms_applied", "pieced", "unclosed"]  # the counts the driver says
    assert list(back["translation"]) == Translator(fp32_dir, load_options=load_options).translate(lines).translation
    assert list(back["line"]) == list(range(1, 31)) and back["last"][-1]


def test_an_actor_that_cannot_load_the_model_refuses_its_first_batch(tmp_path):
    """An actor failing in its constructor (a node without the shared model dir) had Ray print four tracebacks,
    192 lines, before the one error line; it starts, and its first batch is refused as a shard's line is."""
    from pipeline.integrations.ray_job import _user_error

    actor = _JobTranslator(tmp_path / "missing", origin_columns=("path", "line"))  # no exception here
    with pytest.raises(UserError) as refused:
        actor({"text": np.array(["ab"], dtype=object)})
    said = _user_error(refused.value)
    assert said is not None and str(said).startswith(f"{tmp_path / 'missing'}: no such model directory")


def serve_batch_outputs(model_dir: Path, shards: dict[str, list[str]], tmp: Path) -> dict[str, str]:
    """serve-batch's translation of each shard (its lines), by shard name."""
    tmp.mkdir()
    loaded = load(model_dir, LoadOptions(backend="onnxruntime", threads=1))
    out = {}
    for name, lines in shards.items():
        write_lines(tmp / name, lines)
        serve_files(loaded.backend, loaded.tokenizer, [str(tmp / name)], [str(tmp / f"{name}.out")],
                    ServeBatchOptions(decoding=loaded.decoding), progress=False)
        out[name] = (tmp / f"{name}.out").read_text(encoding="utf-8")
    return out


def _ray_workers() -> int:
    """Ray's worker processes on this machine now (their titles start with ray::)."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                count += f.read(5) == b"ray::"
        except OSError:
            pass
    return count


def test_many_shards_start_few_worker_processes(cluster, fp32_dir, tmp_path, capsys):
    """Each shard's read task reserved no CPU, so nothing capped how many ran at once: Ray started a worker process
    for each (30 files of 500 lines: 24 processes, 4.5 GB, twice the time of one file, and "(raylet) WARNING: 26
    PYTHON worker processes" on the terminal). Two read at a time now, besides the job's 2 actors."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = corpus_lines(160)
    for k in range(16):
        write_lines(corpus / f"p{k:02d}.txt", lines[k * 10: k * 10 + 10])
    before, most, running = _ray_workers(), [0], [True]

    def watch() -> None:
        while running[0]:
            most[0] = max(most[0], _ray_workers())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        code, _, err = run_cli_captured(capsys, "ray-translate", fp32_dir, corpus, "--output-dir", tmp_path / "out",
                                        "--backend", "onnxruntime")
    finally:
        running[0] = False
        watcher.join()
    assert code == 0 and "translated 160 lines of 16 shard(s)" in err, err
    assert most[0] - before <= 2 + 2 + 1, (before, most[0])  # actors, readers, and one Ray may start ahead


def test_shards_translate_as_serve_batch_and_a_rerun_resumes(cluster, fp32_dir, tmp_path, capsys):
    lines = corpus_lines(300)
    shards = {"a.txt": lines[:120], "b.txt": lines[120:250], "c.txt": lines[250:], "d.txt": []}
    expected = serve_batch_outputs(fp32_dir, shards, tmp_path / "served")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_lines(corpus / "a.txt", shards["a.txt"])
    (corpus / "b.txt.gz").write_bytes(gzip.compress("".join(t + "\n" for t in shards["b.txt"]).encode()))
    write_parquet(corpus / "c.parquet", {"src": shards["c.txt"][:10] + [None] + shards["c.txt"][11:]})
    write_lines(corpus / "d.txt", [])
    args = ["ray-translate", fp32_dir, corpus, "--output-dir", tmp_path / "out", "--column", "src",
            "--batch-size", "40", "--backend", "onnxruntime"]
    code, _, err = run_cli_captured(capsys, *args)
    assert code == 0, err
    assert "translated 300 lines of 4 shard(s)" in err and "lines/s on 2 actor(s)" in err
    got = {name: (tmp_path / "out" / name).read_text(encoding="utf-8") for name in shards}
    expected["c.txt"] = expected["c.txt"].split("\n")
    expected["c.txt"][10] = ""  # the null row: a blank line
    expected["c.txt"] = "\n".join(expected["c.txt"])
    assert got == expected
    assert hidden(tmp_path / "out") == [RECORD]  # no temp left

    code, _, err = run_cli_captured(capsys, *args)  # everything done: nothing to start
    assert code == 0 and "all 4 shard(s) already translated" in err, err
    # the same job asked for otherwise (it was refused: "backend, lang differ"): the backend auto picks, sentence
    # rules where no sentence is split
    code, _, err = run_cli_captured(capsys, *args[:-2], "--lang", "fr")
    assert code == 0 and "all 4 shard(s) already translated" in err, err
    (tmp_path / "out" / "b.txt").unlink()
    code, _, err = run_cli_captured(capsys, *args)
    assert code == 0 and "translated 130 lines of 1 shard(s)" in err and "3 shard(s) already complete" in err, err
    assert (tmp_path / "out" / "b.txt").read_text(encoding="utf-8") == expected["b.txt"]


def test_a_workers_refusal_is_one_line_and_leaves_no_output(cluster, fp32_dir, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_lines(corpus / "a.txt", ["ab cd"] * 5)
    (corpus / "b.txt").write_bytes(b"ab\ncd \xff ef\n")
    code, _, err = run_cli_captured(capsys, "ray-translate", fp32_dir, corpus, "--output-dir", tmp_path / "out",
                                    "--backend", "onnxruntime")
    assert_one_line_error(code, err, "b.txt:2: invalid UTF-8", "--invalid-utf8 replace")
    assert not (tmp_path / "out" / "b.txt").exists()
    # no temp left; the dir itself goes when no shard was done (it was left behind holding only the job's record)
    out = tmp_path / "out"
    if out.exists():  # a.txt was done first: it stays, whole, beside the record
        assert (out / "a.txt").exists() and [p for p in hidden(out) if p != RECORD] == []


def test_dictionary_and_null_parquet_columns_translate_line_aligned(cluster, fp32_dir, tmp_path, capsys):
    """A pandas `category` column (Parquet dictionary of strings) is decoded; a column of nulls only (Arrow type
    null) gives one blank line per row, as the docs say a null does."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = corpus_lines(40, seed=9)
    cat = [None if k % 7 == 3 else lines[k % 12] for k in range(40)]  # repeated values: a real dictionary
    expected = serve_batch_outputs(fp32_dir, {"cat.txt": [t or "" for t in cat]}, tmp_path / "served")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    pq.write_table(pa.Table.from_pandas(pd.DataFrame({"text": pd.Categorical(cat)}), preserve_index=False),
                   corpus / "cat.parquet")
    pq.write_table(pa.table({"text": pa.nulls(5), "id": list(range(5))}), corpus / "nulls.parquet")
    code, _, err = run_cli_captured(capsys, "ray-translate", fp32_dir, corpus, "--output-dir", tmp_path / "out",
                                    "--batch-size", "16", "--backend", "onnxruntime")
    assert code == 0, err
    assert (tmp_path / "out" / "cat.txt").read_text(encoding="utf-8") == expected["cat.txt"]
    assert (tmp_path / "out" / "nulls.txt").read_text(encoding="utf-8") == "\n" * 5


def actor_pids() -> list[int]:
    """The processes of this cluster's Translator actors (Ray titles them after the class)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if b"MapBatches(" in cmdline and b"Translator)" in cmdline:  # ray-translate's _JobTranslator
                pids.append(int(entry))
    return pids


@pytest.mark.slow
def test_a_killed_actor_is_retried_and_the_outputs_are_whole(cluster, fp32_dir, tmp_path):
    lines = corpus_lines(1200, seed=5)
    shards = {f"s{k}.txt": lines[k * 200:(k + 1) * 200] for k in range(6)}
    expected = serve_batch_outputs(fp32_dir, shards, tmp_path / "served")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, shard in shards.items():
        write_lines(corpus / name, shard)
    job = plan([str(corpus)], tmp_path / "out", "text", {})
    done: dict[str, object] = {}

    def run() -> None:
        try:
            done["stats"] = translate_shards(fp32_dir, job, LoadOptions(backend="onnxruntime"), PAPER,
                                             ServeBatchOptions(), RayOptions(batch_size=25))
        except BaseException as e:  # noqa: B036 - handed to the test thread
            done["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 120
    while not [p for p in hidden(tmp_path / "out") if p != RECORD] and time.monotonic() < deadline:
        time.sleep(0.02)  # the first shard's temp output: translated rows are coming back
    pids = actor_pids()
    assert pids, "no Translator actor found"
    os.kill(pids[0], signal.SIGKILL)
    finished_at_kill = [name for name in shards if (tmp_path / "out" / name).exists()]
    thread.join(600)
    assert not thread.is_alive() and "error" not in done, done.get("error")
    assert len(finished_at_kill) < len(shards)  # the kill landed before the end
    assert pids[0] not in actor_pids()
    got = {name: (tmp_path / "out" / name).read_text(encoding="utf-8") for name in shards}
    assert got == expected
    assert done["stats"].lines == 1200  # type: ignore[attr-defined]


def test_an_actors_refusal_of_a_line_is_one_line(cluster, fp32_dir, tmp_path, capsys):
    """A refusal raised in an actor's batch reached the driver as Ray's UserCodeException: a traceback, exit 1."""
    src = write_lines(tmp_path / "long.txt", ["ab " * 400, "cd"])
    code, _, err = run_cli_captured(capsys, "ray-translate", fp32_dir, src, "--output-dir", tmp_path / "out",
                                    "--long-lines", "error")
    assert_one_line_error(code, err, "long.txt:1:", "--long-lines truncate")
    assert "options with" not in err  # the Python API's wording, meaningless on a terminal
    assert not (tmp_path / "out" / "long.txt").exists()



def test_a_bz2_shard_is_read_as_serve_batch_reads_it_not_decompressed_by_its_name(cluster, fp32_dir, tmp_path,
                                                                                   capsys):
    """Ray guessed a compression from the name: a.txt.bz2 was decompressed and its translation written as plain
    text under the name a.txt.bz2, where serve-batch refuses it (only .gz is decompressed)."""
    import bz2

    src = tmp_path / "a.txt.bz2"
    src.write_bytes(bz2.compress(b"ab cd\n"))
    code, _, err = run_cli_captured(capsys, "ray-translate", fp32_dir, src, "--output-dir", tmp_path / "out")
    assert_one_line_error(code, err, "a.txt.bz2:1:", "invalid UTF-8")
    assert not (tmp_path / "out" / "a.txt.bz2").exists()

def test_what_no_actor_could_do_is_refused_before_the_cluster(fp32_dir, tmp_path, capsys):
    """Each was Ray's traceback from every actor, a hang, or outputs written into the model dir."""
    (tmp_path / "in").mkdir()
    src = write_lines(tmp_path / "in" / "a.txt", ["ab cd"])
    fifo = tmp_path / "in" / "b.txt"
    os.mkfifo(fifo)
    out = ["--output-dir", tmp_path / "out"]
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    for args, says in [
        ((src, *out, "--src-lang", "de", "--tgt-lang", "en"), "this model translates one language pair"),
        ((src, *out, "--device", "cuda:7"), "cuda"),
        ((tmp_path / "in", *out), f"{fifo}: not a regular file"),  # a reader would wait for ever
        ((src, "--output-dir", fp32_dir / "translated"), "inside"),  # the model dir it serves
    ]:
        code, _, err = run_cli_captured(capsys, "ray-translate", fp32_dir, *args)
        assert_one_line_error(code, err, says)
    # a cluster that is not there left the dirs the job made (in a process of its own: this one may be connected
    # to an earlier test's cluster, which ray.init then keeps)
    for given in (tmp_path / "out", tmp_path / "out" / "a" / "b"):
        done = subprocess.run(pipeline_cmd("ray-translate", fp32_dir, src, "--output-dir", given, "--address",
                                           f"127.0.0.1:{free}"), env=cli_env(), capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and "no Ray cluster answers there" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists() and not (fp32_dir / "translated").exists()


def test_a_glossary_is_read_once_by_the_driver_counted_and_recorded(cluster, trained_model_dir, tmp_path, capsys,
                                                                      caplog):
    """`--glossary <(...)`: the driver read the pipe and the actors (other processes) opened its /proc path
    again: not found. The summary counted no terms, and the job record held no glossary, so a rerun with another
    glossary (or none) skipped the shards done and mixed two jobs' outputs."""
    import logging
    import threading

    from helpers import make_parallel
    from test_glossary_serve_batch import GLOSSARY

    lines = make_parallel(40, seed=21)[0] + ["Der Hund sieht die Katze"]
    (tmp_path / "in").mkdir()
    src = write_lines(tmp_path / "in" / "a.txt", lines)
    expected = tmp_path / "expected.txt"
    glossary = tmp_path / "terms.tsv"
    glossary.write_text(GLOSSARY, encoding="utf-8")
    assert run_cli_captured(capsys, "serve-batch", trained_model_dir, src, "-o", expected, "--glossary", glossary,
                            "--no-progress")[0] == 0
    fifo = tmp_path / "terms.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text(GLOSSARY, encoding="utf-8"), daemon=True)
    writer.start()
    out = ["--output-dir", tmp_path / "out", "--backend", "onnxruntime"]
    served = [r.getMessage() for r in caplog.records if "the glossary's terms" in r.getMessage()]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        code, _, err = run_cli_captured(capsys, "ray-translate", trained_model_dir, src, *out, "--glossary", fifo)
    writer.join(5)
    assert code == 0, err
    assert (tmp_path / "out" / "a.txt").read_text(encoding="utf-8") == expected.read_text(encoding="utf-8")
    said = [r.getMessage() for r in caplog.records if "the glossary's terms" in r.getMessage()]
    found = sum(("hund" in line.lower().split()) + ("katze" in line.lower().split()) for line in lines)
    assert len(said) == 1 and f"{found} found in the input" in said[0] and found > 0, said
    assert said[0] in served[0]  # serve-batch's count, line for line
    write_lines(tmp_path / "in" / "b.txt", lines[:3])
    for again in ([], ["--glossary", write_lines(tmp_path / "other.tsv", ["hund\ttree", "katze\tdog"])]):
        code, _, err = run_cli_captured(capsys, "ray-translate", trained_model_dir, tmp_path / "in", *out, *again)
        assert_one_line_error(code, err, "glossary")
    assert not (tmp_path / "out" / "b.txt").exists()


def test_a_glossary_the_model_cannot_apply_is_refused_before_the_cluster(trained_model_dir, tmp_path, capsys,
                                                                         monkeypatch):
    """A target the vocabulary cannot spell was Ray's tracebacks from every actor (about 95 lines) after the
    cluster started, then the error."""
    import pipeline.integrations.ray_job as ray_job

    def no_cluster(address: object) -> bool:
        raise AssertionError("the cluster was reached")

    monkeypatch.setattr(ray_job, "connect", no_cluster)
    src = write_lines(tmp_path / "a.txt", ["der hund"])
    unspelled = write_lines(tmp_path / "g.tsv", ["hund\t\u0416\u0416"])
    code, _, err = run_cli_captured(capsys, "ray-translate", trained_model_dir, src, "--output-dir", tmp_path / "out",
                                    "--glossary", unspelled)
    assert_one_line_error(code, err, "g.tsv:1")
    assert not (tmp_path / "out").exists()


def test_rows_with_line_ends_symlinked_shards_and_a_default_given_again(cluster, fp32_dir, tmp_path, capsys,
                                                                         caplog):
    """A Parquet row holding line ends, split into sentences, was written over several lines (8 lines for 5
    rows: every line after it misaligned); a shard beside a symlink to it was "line 1 came back twice", a
    traceback; `--beam-size 4` on a model whose default is 4 refused to resume the job run without it."""
    import logging

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rows = ["ab cd.\nef gh.", "ij kl.\r\nmn op.", "x1 y22.", "ab.\n\ncd.", " ".join(["ab cd ef gh"] * 20)]
    write_parquet(corpus / "docs.parquet", {"text": rows})  # the last: a sentence over the source limit
    write_lines(corpus / "a.txt", ["ab cd", "ef"])
    (corpus / "b.txt").symlink_to("a.txt")
    out = ["--output-dir", tmp_path / "out", "--backend", "onnxruntime", "--split", "sentences"]
    with caplog.at_level(logging.WARNING):
        code, _, err = run_cli_captured(capsys, "ray-translate", fp32_dir, corpus, *out)
    assert code == 0, err
    written = (tmp_path / "out" / "docs.txt").read_text(encoding="utf-8")
    assert written.count("\n") == len(rows) and "\r" not in written
    flat = Translator(fp32_dir, load_options=LoadOptions(backend="onnxruntime"),
                      options=ServeBatchOptions(split="sentences")).translate(rows).translation
    assert written.split("\n")[:-1] == [t.replace("\r\n", " ").replace("\n", " ") for t in flat]
    assert any("3 row(s) held line ends" in r.getMessage() for r in caplog.records)
    assert any("1 line(s) held a sentence longer than the model's source limit, translated in pieces" in
               r.getMessage() for r in caplog.records)  # (serve-batch said it, ray-translate did not)
    a, b = ((tmp_path / "out" / name).read_text(encoding="utf-8") for name in ("a.txt", "b.txt"))
    assert a == b and a.count("\n") == 2
    (tmp_path / "out" / "a.txt").unlink()
    code, _, err = run_cli_captured(capsys, "ray-translate", fp32_dir, corpus, *out, "--beam-size", "4")
    assert code == 0 and "translated 2 lines of 1 shard(s)" in err, err


def test_an_unreadable_job_record_is_named_as_such(tmp_path):
    """A damaged record was reported as "made with another model or options (all differ)"."""
    src = write_lines(tmp_path / "a.txt", ["ab"])
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.txt").write_text("done\n")
    (out / RECORD).write_text("{torn")
    with pytest.raises(UserError, match=r"the record of the job that wrote .* is unreadable"):
        plan([str(src)], out, "text", {"model": "m"})

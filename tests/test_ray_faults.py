"""`pipeline ray-translate` under faults, as a user sees them on the terminal (the CLI in a subprocess, its own
local cluster): a shard only a worker finds bad (a corrupt .gz, invalid UTF-8, a corrupt Parquet page) is one
`error:` line naming the file, exit 2, with Ray's tracebacks and retry notices left in Ray's logs; an --address
where no cluster runs is refused in seconds rather than retried for minutes."""

from __future__ import annotations

import gzip
import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed (the ray extra)")
from helpers import assert_one_line_error, run_pipeline, write_lines  # noqa: E402

from model.errors import UserError  # noqa: E402
from pipeline.integrations.ray_cluster import probe  # noqa: E402
from pipeline.integrations.shards import output_name  # noqa: E402


def free_port() -> int:
    """A port on 127.0.0.1 where nothing listens (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def corrupt_parquet(path: Path) -> Path:
    """A Parquet file whose footer (schema) reads but whose data page does not."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"ab cd {k}" for k in range(50)]}), path, use_dictionary=False)
    data = bytearray(path.read_bytes())
    data[30:200] = b"\xff" * 170  # the first page's header and values; the footer at the end is intact
    path.write_bytes(bytes(data))
    pq.read_schema(path)  # the plan's check passes: only a worker finds it bad
    return path


def test_probe_refuses_an_address_where_nothing_listens_in_seconds():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(UserError, match=rf"^--address 127\.0\.0\.1:{port}: no Ray cluster answers there "
                                        r"\(connection refused\); start one with `ray start --head`"):
        probe(f"127.0.0.1:{port}")
    with pytest.raises(UserError, match=r"--address nowhere: not `auto` or HOST:PORT"):
        probe("nowhere")
    assert time.monotonic() - started < 10



def test_a_cluster_that_answers_but_refuses_the_driver_is_not_called_absent(monkeypatch):
    """Ray 2.60's token authentication refused a driver at HOST:PORT of a running cluster: "no Ray cluster there",
    where `--address auto` worked. The probe found a listener; ray.init's ConnectionError is said as a refusal."""
    import ray

    from pipeline.integrations.ray_cluster import connect

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        def refused(**kwargs: object) -> None:  # what ray.init raises when the head refuses the token
            raise ConnectionError("Failed to connect to GCS: Unauthenticated")

        monkeypatch.setattr(ray, "init", refused)
        monkeypatch.setattr(ray, "is_initialized", lambda: False)
        with pytest.raises(UserError, match=rf"^--address 127\.0\.0\.1:{port}: something answers there, but Ray "
                                            r"could not join it as a cluster \(Failed to connect to GCS: "
                                            r"Unauthenticated\); if it is a Ray cluster that requires a token"):
            connect(f"127.0.0.1:{port}")


@pytest.mark.slow
def test_ray_datas_own_warnings_stay_off_the_terminal(fp32_dir, tmp_path):
    """An empty shard beside another (fewer blocks than actors) printed Ray Data's actor pool UserWarning to the
    terminal, where the docs say Ray's lines go to its session logs unless -v."""
    a = write_lines(tmp_path / "a.txt", ["ab cd"])
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, err = run_pipeline("ray-translate", fp32_dir, a, empty, "--output-dir", tmp_path / "out", "--actors", 2,
                             "--backend", "onnxruntime")
    assert code == 0, err
    assert "UserWarning" not in err and "actor_pool" not in err, err
    assert (tmp_path / "out" / "empty.txt").read_text() == ""


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["corrupt.txt.gz", "latin1.txt", "corrupt.parquet", "0-not-gzip.gz", "0-cut-short.gz"])
def test_a_bad_shard_a_worker_reads_is_one_error_line_naming_it(fp32_dir, tmp_path, bad):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_lines(corpus / "a.txt", ["ab cd"] * 3)
    path = corpus / bad
    if bad == "corrupt.txt.gz":
        path.write_bytes(gzip.compress(b"ab cd\n" * 200)[:40] + b"\x00" * 64)  # a gzip header, then garbage
        needles = [str(path), "cannot read"]
    elif bad.startswith("0-"):  # the first shard: the driver reads its head to size the blocks, before any worker
        path.write_bytes(b"plain text\n" if bad == "0-not-gzip.gz" else gzip.compress(b"ab cd\n" * 200)[:20])
        needles = [str(path), "cannot read"]  # was "Not a gzipped file" without the file, or "Ctrl-C" and 130
    elif bad == "latin1.txt":
        path.write_bytes("ab\nKöln ist groß\n".encode("latin-1"))
        needles = [f"{path}:2: invalid UTF-8"]
    else:
        corrupt_parquet(path)
        needles = [str(path), "cannot read as Parquet"]
    code, err = run_pipeline("ray-translate", fp32_dir, corpus, "--output-dir", tmp_path / "out", "--backend",
                             "onnxruntime", "--no-progress", timeout=300)
    assert code == 2, err
    line = assert_one_line_error(code, err, *needles)  # no traceback either
    assert "\n" not in line and "attempts" not in line
    for noise in ("RayTaskError", "To change retry attempts", "max_errored_blocks", "Full stack trace"):
        assert noise not in err, err  # Ray's own lines stay in its session logs
    assert not (tmp_path / "out" / output_name(str(path))).exists()


@pytest.mark.slow
def test_an_address_with_no_cluster_fails_in_seconds_naming_it(fp32_dir, tmp_path):
    write_lines(tmp_path / "a.txt", ["ab cd"])
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    code, err = run_pipeline("ray-translate", fp32_dir, tmp_path / "a.txt", "--output-dir", tmp_path / "out",
                             "--address", address, "--no-progress", timeout=60)  # it was still retrying at 420 s
    assert time.monotonic() - started < 60
    assert_one_line_error(code, err, f"--address {address}: no Ray cluster answers there (connection refused)",
                          "ray start --head")


def test_address_auto_with_no_cluster_on_this_machine_says_so(monkeypatch):
    """`--address auto` where `ray start` never ran said "something answers there, but Ray could not join it":
    nothing answered. Ray finds no cluster (none recorded, none running): said as such."""
    from ray._private import services

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: [])
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir=None: None)
    with pytest.raises(UserError, match=r"^--address auto: no Ray cluster runs on this machine \(`ray start --head` "
                                        r"starts one\); leave --address out for a local one$"):
        probe("auto")


@pytest.mark.slow
def test_sigterm_ends_a_job_as_it_ends_serve_batch(fp32_dir, tmp_path):
    """ray.init put its own SIGTERM handler in place of ours: exit 15 and a C++ stack dump, where serve-batch says
    "terminated (SIGTERM)" and exits 143. Finished shards stay, and no partial one is left."""
    import signal
    import subprocess

    from helpers import cli_env, pipeline_cmd

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k in range(4):
        write_lines(corpus / f"s{k}.txt", [f"ab cd ef {i}" for i in range(1500)])
    out = tmp_path / "out"
    proc = subprocess.Popen(pipeline_cmd("ray-translate", fp32_dir, corpus, "--output-dir", out, "--batch-size", 50,
                                         "--backend", "onnxruntime"), env=cli_env(), stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 240
        while not any(out.glob("s*.txt")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143 and err.strip().splitlines()[-1] == "terminated (SIGTERM)", err[-2000:]
    assert "SIGTERM received at time" not in err

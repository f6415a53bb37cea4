"""`pipeline serve` end to end: a real server process on a loopback port, answering
exactly what serve-batch writes, batching concurrent clients, refusing bad requests
with the right status, dropping departed clients' work and draining on SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import ROOT, TRAINED_LIMITS, make_parallel, run_cli

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

FAST = ["--max-len-a", "0", "--max-len-b", "6", "--threads", "1"]
SRC_LIMIT = TRAINED_LIMITS["max_src_len"]  # of model_dir
LONG_LINE = " ".join(["der hund sieht die katze"] * 12)  # 60 words: over SRC_LIMIT tokens


@pytest.fixture(scope="module")
def model_dir(trained_model_dir) -> Path:
    """The tiny trained model (lines get different translations), exported with a source limit that
    LONG_LINE exceeds: conftest's trained_model_dir."""
    return trained_model_dir


@pytest.fixture(scope="module")
def lines() -> list[str]:
    src, _ = make_parallel(30, seed=3)
    return src[:10] + ["", "   \t", LONG_LINE] + src[10:]


def serve_batch(model_dir: Path, tmp: Path, lines: list[str], *extra: object) -> list[str]:
    """What `pipeline serve-batch --backend torch` writes for these lines."""
    inp, out = tmp / "sb_in.txt", tmp / "sb_out.txt"
    inp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    assert run_cli("serve-batch", model_dir, inp, "-o", out, "--backend", "torch", "--no-progress",
                   *FAST, *extra) == 0
    return out.read_text(encoding="utf-8").split("\n")[:-1]


@pytest.fixture(scope="module")
def expected(model_dir, lines, tmp_path_factory) -> dict[str, str]:
    got = serve_batch(model_dir, tmp_path_factory.mktemp("sb"), lines)
    assert len(set(got)) > 5  # the lines really differ, so a mix-up would show
    return dict(zip(lines, got))


@contextmanager
def server(model_dir: Path, log_path: Path, *args: object) -> Iterator[tuple[subprocess.Popen, str]]:
    """A `pipeline serve` process on a free loopback port, ready; always stopped afterwards."""
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", str(model_dir), "--port", "0",
                             "--backend", "torch", *FAST, *map(str, args)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if url is None:
                m = re.search(r"at (http://127\.0\.0\.1:\d+)", log_path.read_text())
                url = m.group(1) if m else None
            if url is not None:
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        else:
            raise AssertionError(f"server did not become ready:\n{log_path.read_text()}")
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


@pytest.fixture(scope="module")
def url(model_dir, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("serverlog") / "serve.log"
    with server(model_dir, log, "--max-wait-ms", 20, "--max-lines", 50, "--max-bytes", 4000) as (_, u):
        yield u


def post(url: str, payload: object, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/translate", json=payload, timeout=timeout)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@pytest.mark.slow
def test_answers_equal_serve_batch(url, model_dir, lines, expected, tmp_path):
    r = post(url, {"text": lines})
    assert r.status_code == 200, r.text
    assert r.json()["translations"] == [expected[line] for line in lines]
    assert r.json()["translations"][10:12] == ["", ""]
    # n-best: the same hypotheses and scores serve-batch writes as 'text ||| score ||| ...'
    nbest = serve_batch(model_dir, tmp_path, lines[:6], "--nbest", 2)
    r = post(url, {"text": lines[:6], "nbest": 2})
    assert r.status_code == 200, r.text
    got = [" ||| ".join(f"{h['text']} ||| {h['score']:.4f}" for h in item["hypotheses"])
           for item in r.json()["translations"]]
    assert got == nbest
    assert metric(url, "pipeline_truncated_lines_total") >= 1


@pytest.mark.slow
def test_concurrent_clients_get_their_own_answers_in_order_and_are_batched(url, lines, expected):
    before = metric(url, "pipeline_batch_requests_count")
    before_sum = metric(url, "pipeline_batch_requests_sum")
    live = [line for line in lines if line.strip()]
    requests = [[live[(i * 7 + j) % len(live)] for j in range(1 + i % 9)] for i in range(100)]

    def one(text: list[str]) -> tuple[int, list[str]]:
        r = post(url, {"text": text})
        return r.status_code, r.json()["translations"]

    with ThreadPoolExecutor(100) as pool:
        answers = list(pool.map(one, requests))
    for text, (status, got) in zip(requests, answers):
        assert status == 200
        assert got == [expected[line] for line in text]
    batches = metric(url, "pipeline_batch_requests_count") - before
    batched = metric(url, "pipeline_batch_requests_sum") - before_sum
    assert batched == 100
    assert batches < 100  # some batch held more than one request
    assert metric(url, "pipeline_requests_total{code=\"200\"}") >= 100


@pytest.mark.slow
@pytest.mark.parametrize("body, message", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"text": "one string"}', "list of strings"),
    (b'{"text": ["a", 3]}', "list of strings"),
    (b'{"text": ["a"], "beam_size": "4"}', "integer"),
    (b'{"text": ["a"], "beam_size": true}', "integer"),
    (b'{"text": ["a"], "beam_size": 2, "nbest": 3}', "nbest"),
    (b'{"text": ["a"], "beam_size": 99}', "limit"),
    (b'{"text": ["a"], "scores": 1}', "scores"),
    (b'{"text": ["a"], "extra": 1}', "unknown field"),
    (b'{"text": ["a\\nb"]}', "newline"),
    (b'{"text": ["\\ud800"]}', "surrogate"),
    (b'{"text": ["der \xff hund"]}', "UTF-8"),
])
def test_bad_requests_are_400_with_a_message(url, body, message):
    r = httpx.post(f"{url}/translate", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    assert message in r.json()["error"]


@pytest.mark.slow
def test_oversized_requests_are_413(url):
    r = post(url, {"text": ["der hund"] * 51})
    assert r.status_code == 413 and "51 lines" in r.json()["error"]
    r = post(url, {"text": ["der hund sieht die katze " * 20] * 40})
    assert r.status_code == 413 and "4000" in r.json()["error"]
    assert post(url, {"text": []}).json() == {"translations": []}


@pytest.mark.slow
def test_info_and_health(url):
    info = httpx.get(f"{url}/info", timeout=10).json()
    assert info["backend"] == "torch" and info["precision"] == "fp32"
    assert info["model_limits"]["max_src_len"] == SRC_LIMIT and info["limits"]["max_lines"] == 50
    assert httpx.get(f"{url}/health", timeout=10).json()["ready"] is True


@pytest.mark.slow
def test_departed_clients_do_not_break_the_others(url, lines, expected):
    before = metric(url, "pipeline_client_disconnects_total")
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"text": [line for line in lines if line.strip()][:40]}).encode()

    def leave() -> None:
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def stay(i: int) -> list[str]:
        return post(url, {"text": lines[i:i + 5]}).json()["translations"]

    with ThreadPoolExecutor(16) as pool:
        gone = [pool.submit(leave) for _ in range(6)]
        stayed = [pool.submit(stay, i) for i in range(10)]
        for f in gone:
            f.result()
        for i, f in enumerate(stayed):
            assert f.result() == [expected[line] for line in lines[i:i + 5]]
    deadline = time.monotonic() + 30
    while metric(url, "pipeline_client_disconnects_total") == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(url, "pipeline_client_disconnects_total") > before
    assert post(url, {"text": lines[:3]}).json()["translations"] == [expected[line] for line in lines[:3]]


@pytest.mark.slow
def test_full_queue_is_503_and_long_lines_policy_error_is_413(model_dir, tmp_path, lines, expected):
    with server(model_dir, tmp_path / "serve.log", "--max-queue", 1, "--max-wait-ms", 300,
                "--long-lines", "error") as (_, u):
        r = post(u, {"text": ["der hund", LONG_LINE]})
        assert r.status_code == 413 and "line:2" in r.json()["error"] and str(SRC_LIMIT) in r.json()["error"]
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda i: post(u, {"text": [lines[i]]}), range(12)))
        busy = [r for r in answers if r.status_code == 503]
        assert busy and all(r.headers["Retry-After"] == "1" for r in busy)
        ok = [(i, r) for i, r in enumerate(answers) if r.status_code == 200]
        assert ok and len(ok) + len(busy) == 12
        assert all(r.json()["translations"] == [expected[lines[i]]] for i, r in ok)


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_and_exits_0(model_dir, tmp_path, lines, expected):
    with server(model_dir, tmp_path / "serve.log", "--max-wait-ms", 1500) as (proc, u):
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(post, u, {"text": lines[i:i + 3]}) for i in range(8)]
            deadline = time.monotonic() + 30
            while metric(u, "pipeline_in_flight_requests") < 8 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert metric(u, "pipeline_in_flight_requests") == 8
            proc.send_signal(signal.SIGTERM)
            for i, f in enumerate(futures):
                r = f.result()
                assert r.status_code == 200
                assert r.json()["translations"] == [expected[line] for line in lines[i:i + 3]]
        assert proc.wait(60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{u}/health", timeout=5)


def test_startup_failures_are_one_line_exit_2(model_dir, tmp_path, capsys):
    assert run_cli("serve", tmp_path / "missing") == 2
    assert capsys.readouterr().err.startswith("error: ")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert run_cli("serve", model_dir, "--backend", "torch", "--port", taken.getsockname()[1]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--port" in err[0] and "in use" in err[0]


@pytest.mark.slow
def test_cli_works_without_the_web_stack():
    """The serve extra is optional: other commands never import it, and serve says how to get it."""
    code = ("import sys; sys.modules['uvicorn'] = None\n"
            "from pipeline.cli import all_commands, main\n"
            "all_commands()\n"
            "assert not {'starlette', 'prometheus_client'} & set(sys.modules), 'web stack imported eagerly'\n"
            "main(['serve', 'some_model_dir'])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ('error: `pipeline serve` needs uvicorn, which is not installed: '
                                   'pip install -e ".[serve]"')

"""`pipeline serve` end to end: a real server process on a loopback port, answering
exactly what serve-batch writes (documents too), streaming, serving several models,
batching concurrent clients, refusing bad requests with the right status, dropping
departed clients' work, never stalled by slow clients, and draining on SIGTERM."""

from __future__ import annotations

import importlib.util
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
from helpers import ROOT, TRAINED_LIMITS, documents, make_parallel, run_cli

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
def server(model_dir: Path | None, log_path: Path, *args: object) -> Iterator[tuple[subprocess.Popen, str]]:
    """A `pipeline serve` process on a free loopback port, ready; always stopped afterwards."""
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", *([str(model_dir)] if model_dir else []),
                             "--port", "0",
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


def metric(url: str, name: str, model: str = "model", **labels: object) -> float:
    """A series of /metrics (every one is labelled with its model; a single MODEL_DIR's is its dir name)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    series = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted({"model": model, **labels}.items())) + "}"
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    assert m, f"{series} not in /metrics"
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
    assert batched >= 100  # each request in a batch, one over the budget in several
    assert batches < 100  # some batch held more than one request
    assert metric(url, "pipeline_requests_total", code=200) >= 100


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
    (b'{"text": ["a"], "split": "words"}', '"split"'),
    (b'{"text": ["a"], "split": "sentences", "nbest": 2, "beam_size": 2}', '"split"'),
    (b'{"text": ["a"], "split": "sentences", "scores": true}', '"split"'),
    (b'{"text": ["a"], "stream": "yes"}', '"stream"'),
    (b'{"text": ["a"], "lang": 7}', '"lang"'),
    (b'{"text": ["a"], "lang": "../etc"}', '"lang"'),
    (b'{"text": ["a"], "model": ["model"]}', '"model"'),
    (b'{"text": ["a"], "beam_size": 0}', "beam_size"),
    (b'{"text": ["a"], "nbest": -1}', "nbest"),
])
def test_bad_requests_are_400_with_a_message(url, body, message):
    r = httpx.post(f"{url}/translate", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    assert message in r.json()["error"]
    assert "--" not in r.json()["error"], "an HTTP client gets its own field names, not the CLI's flags"


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
    assert list(info["models"]) == ["model"] and info["limits"]["max_lines"] == 50
    # uvicorn's own loop setup: uvloop where the serve extra installed it (its event loop under the app)
    assert info["event_loop"] == ("uvloop" if importlib.util.find_spec("uvloop") else "asyncio")
    model = httpx.get(f"{url}/info", params={"model": "model"}, timeout=10).json()
    assert model["backend"] == "torch" and model["precision"] == "fp32" and model["lang"] == "en"
    assert model["batches_at_once"] == 1  # the torch backend: one batch at a time
    assert model["model_limits"]["max_src_len"] == SRC_LIMIT and model["limits"]["max_lines"] == 50
    assert httpx.get(f"{url}/health", timeout=10).json()["ready"] is True
    r = httpx.get(f"{url}/info", params={"model": "nope"}, timeout=10)
    assert r.status_code == 404 and "model" in r.json()["error"]


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


def stream(url: str, payload: dict, timeout: float = 60) -> list[dict]:
    """A streamed /translate answer, read object by object as it arrives."""
    with httpx.stream("POST", f"{url}/translate", json={**payload, "stream": True}, timeout=timeout) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson; charset=utf-8"
        return [json.loads(line) for line in r.iter_lines() if line]


def joined(objects: list[dict]) -> list[str]:
    """The texts of a streamed split answer: each text's pieces, in order, joined."""
    texts: dict[int, str] = {}
    for o in objects:
        texts[o["index"]] = texts.get(o["index"], "") + o["translation"]
    return [texts[i] for i in range(len(texts))]


@pytest.mark.slow
def test_documents_equal_serve_batch_split_sentences(url, model_dir, tmp_path):
    docs = documents() + ["der hund. die katze!\n\n  ein kind?\n"]  # line breaks inside a text: kept
    files = serve_batch(model_dir, tmp_path, docs[:-1], "--split", "sentences")
    r = post(url, {"text": docs, "split": "sentences"})
    assert r.status_code == 200, r.text
    got = r.json()["translations"]
    assert got[:-1] == files and got[1:3] == ["", " \t "]
    last = serve_batch(model_dir, tmp_path, ["der hund.", "die katze!", "ein kind?"])
    assert got[-1] == f"{last[0]} {last[1]}\n\n  {last[2]}\n"
    objects = stream(url, {"text": docs, "split": "sentences"})
    assert [(o["index"], o["sentence"]) for o in objects][:6] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (2, 0)]
    assert joined(objects) == got
    assert post(url, {"text": docs, "split": "sentences", "lang": "de"}).status_code == 200


@pytest.mark.slow
def test_stream_answers_each_line_in_input_order(url, lines, expected):
    objects = stream(url, {"text": lines})
    assert objects == [{"index": i, "translation": expected[line]} for i, line in enumerate(lines)]
    scored = stream(url, {"text": lines[:3], "nbest": 2})
    assert [o["index"] for o in scored] == [0, 1, 2] and all(len(o["hypotheses"]) == 2 for o in scored)
    assert stream(url, {"text": ["", " "]}) == [{"index": 0, "translation": ""}, {"index": 1, "translation": ""}]


@pytest.mark.slow
def test_stream_is_incremental_and_a_departing_client_frees_its_queue_place(model_dir, tmp_path, lines, expected):
    """A budget of about one line per batch: a 150-line request takes 150 batches. Its first objects
    arrive while most of it is still queued; a client that leaves then has the rest dropped."""
    live = [line for line in lines if line.strip() and line != LONG_LINE]
    text = [live[i % len(live)] for i in range(150)]
    with server(model_dir, tmp_path / "serve.log", "--max-batch-tokens", 40, "--max-wait-ms", 0) as (_, u):
        batches = lambda: metric(u, "pipeline_batch_requests_count")  # noqa: E731
        with httpx.stream("POST", f"{u}/translate", json={"text": text, "stream": True}, timeout=60) as r:
            received = r.iter_lines()
            first = json.loads(next(received))
            assert first == {"index": 0, "translation": expected[text[0]]}
            assert batches() < 100  # the first object came long before the last batch
            rest = [json.loads(line) for line in received if line]
        assert [o["index"] for o in rest] == list(range(1, 150))
        assert [o["translation"] for o in rest] == [expected[t] for t in text[1:]]
        done = batches()

        host, port = u.removeprefix("http://").split(":")
        body = json.dumps({"text": text, "stream": True}).encode()
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            received = b""
            while b'"index": 0' not in received:  # the first object; then the client leaves
                received += s.recv(65536)
        deadline = time.monotonic() + 30
        while metric(u, "pipeline_client_disconnects_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(u, "pipeline_client_disconnects_total") == 1
        assert metric(u, "pipeline_queue_depth") == 0 and metric(u, "pipeline_in_flight_requests") == 0
        # counted as they ended: the whole stream 200, the cut one 499 (both were counted 200 when they began)
        assert metric(u, "pipeline_requests_total", code=200) == 1
        assert metric(u, "pipeline_requests_total", code=499) == 1
        time.sleep(0.5)
        assert batches() - done < 100  # the rest was never translated
        assert post(u, {"text": lines[:2]}).json()["translations"] == [expected[line] for line in lines[:2]]
    access = [line for line in (tmp_path / "serve.log").read_text().splitlines() if "POST /translate" in line]
    assert len(access) == 3 and "ended=499" in access[1] and "ended" not in access[0] + access[2], access


@pytest.mark.slow
def test_several_models_each_with_its_own_queue(model_dir, fp32_dir, tmp_path, lines, expected):
    """Two model dirs in one server: each answers as serve-batch does with it; an overloaded one answers
    503 while the other still answers 200; /info and /metrics per model; unknown names are 404."""
    random_expected = serve_batch(fp32_dir, tmp_path, lines[:4])
    with server(None, tmp_path / "serve.log", "--model", f"de-en={model_dir}", "--model", f"other={fp32_dir}",
                "--max-queue", 2, "--max-wait-ms", 400) as (_, u):
        assert post(u, {"text": lines[:4], "model": "de-en"}).json()["translations"] == \
            [expected[line] for line in lines[:4]]
        assert post(u, {"text": lines[:4], "model": "other"}).json()["translations"] == random_expected
        r = post(u, {"text": ["a"], "model": "fr-en"})
        assert r.status_code == 404 and "de-en, other" in r.json()["error"]
        r = post(u, {"text": ["a"]})
        assert r.status_code == 400 and '"model"' in r.json()["error"]
        with ThreadPoolExecutor(24) as pool:
            flood = [pool.submit(post, u, {"text": [lines[i % 10]], "model": "de-en"}) for i in range(20)]
            time.sleep(0.2)
            calm = post(u, {"text": lines[:4], "model": "other"})
            answers = [f.result() for f in flood]
        assert calm.json()["translations"] == random_expected
        assert {r.status_code for r in answers} == {200, 503}
        busy = [r.json()["error"] for r in answers if r.status_code == 503]
        assert all(e.startswith("server busy: model 'de-en': ") for e in busy), busy  # the busy one named
        info = httpx.get(f"{u}/info", timeout=10).json()["models"]
        assert info["de-en"]["lang"] == "de" and info["other"]["lang"] == "en"
        assert info["de-en"]["model_config"] != info["other"]["model_config"]
        assert metric(u, "pipeline_requests_total", model="de-en", code=503) >= 1
        assert metric(u, "pipeline_requests_total", model="other", code=200) == 2
        assert metric(u, "pipeline_requests_total", model="", code=404) == 1


@pytest.mark.slow
def test_burst_stalled_and_vanishing_clients(model_dir, tmp_path, lines, expected):
    """A burst far larger than --max-queue: every answer is the right 200 or a 503 with Retry-After.
    Clients that stall mid-body or vanish hold nothing: /health answers throughout, well before a stalled
    client's --body-timeout-s could have freed the server (a client timeout, not a wall-clock assertion,
    so a slow shared CI machine does not fail it), and the stalled ones get 408 after --body-timeout-s.
    --long-lines error refuses a long line with 413."""
    body_timeout_s = 20
    with server(model_dir, tmp_path / "serve.log", "--max-queue", 2, "--max-wait-ms", 100, "--long-lines", "error",
                "--body-timeout-s", body_timeout_s) as (_, u):
        r = post(u, {"text": ["der hund", LONG_LINE]})
        assert r.status_code == 413 and "text[1]: " in r.json()["error"] and str(SRC_LIMIT) in r.json()["error"]
        assert "--long-lines" not in r.json()["error"]
        host, port = u.removeprefix("http://").split(":")
        stalled = []
        for i in range(30):
            s = socket.create_connection((host, int(port)), timeout=30)
            head = b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
            s.sendall(head + b'{"text": [' if i % 2 else head[:20])  # half a body, or half a header
            stalled.append(s)
        for _ in range(20):  # vanishing: a whole request, then gone
            with socket.create_connection((host, int(port)), timeout=30) as s:
                body = json.dumps({"text": lines[:5]}).encode()
                s.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        with ThreadPoolExecutor(100) as pool:
            burst = [pool.submit(post, u, {"text": [lines[i % 10]]}) for i in range(200)]
            while not all(f.done() for f in burst):
                assert httpx.get(f"{u}/health", timeout=body_timeout_s / 2).status_code == 200
                time.sleep(0.1)
        answers = [f.result() for f in burst]
        busy = [r for r in answers if r.status_code == 503]
        assert busy and all(r.headers["Retry-After"] == "1" and "busy" in r.json()["error"] for r in busy)
        ok = [(i, r) for i, r in enumerate(answers) if r.status_code == 200]
        assert ok and len(ok) + len(busy) == 200
        assert all(r.json()["translations"] == [expected[lines[i % 10]]] for i, r in ok)
        stalled[1].settimeout(2 * body_timeout_s)
        assert stalled[1].recv(4096).startswith(b"HTTP/1.1 408")
        for s in stalled:
            s.close()
        assert post(u, {"text": lines[:3]}).json()["translations"] == [expected[line] for line in lines[:3]]


@pytest.mark.slow
def held(url: str, payload: object) -> tuple[socket.socket, bytes]:
    """A POST /translate whose body is sent but for its last byte: the request is in flight (its route reads the
    body), so the batcher waits --max-wait-ms for it before starting the others. Returns the socket and that byte."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(payload).encode()
    conn = socket.create_connection((host, int(port)), timeout=60)
    conn.sendall(b"POST /translate HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body[:-1])
    return conn, body[-1:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_drains_in_flight_requests_and_exits_0(model_dir, tmp_path, lines, expected, sig):
    """Ten requests wait for company (--max-wait-ms, held by an eleventh still sending its body) when SIGTERM
    comes: every one is answered, the eleventh too once its body is complete, and the server exits 0. SIGHUP (a
    closed terminal or ssh session; nginx's reload) drains alike: it killed the server, every request lost."""
    with server(model_dir, tmp_path / "serve.log", "--max-wait-ms", 1500) as (proc, u):
        holder, last = held(u, {"text": lines[:2]})
        with ThreadPoolExecutor(10) as pool:
            futures = [pool.submit(post, u, {"text": lines[i:i + 3]}) for i in range(8)]
            streams = [pool.submit(stream, u, {"text": lines[i:i + 3]}) for i in range(2)]
            deadline = time.monotonic() + 30
            while metric(u, "pipeline_in_flight_requests") < 10 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert metric(u, "pipeline_in_flight_requests") == 10
            proc.send_signal(sig)
            for i, f in enumerate(futures):
                r = f.result()
                assert r.status_code == 200
                assert r.json()["translations"] == [expected[line] for line in lines[i:i + 3]]
            for i, f in enumerate(streams):
                assert [o["translation"] for o in f.result()] == [expected[line] for line in lines[i:i + 3]]
        holder.sendall(last)
        answer = b"".join(iter(lambda: holder.recv(65536), b""))
        holder.close()
        assert answer.startswith(b"HTTP/1.1 200") and json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {
            "translations": [expected[line] for line in lines[:2]]}
        assert proc.wait(60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{u}/health", timeout=5)


def test_requests_still_waiting_when_the_grace_runs_out_get_503_not_500(model_dir, tmp_path, lines):
    """--grace-s 1 while two requests wait for company (held by a third still sending its body): once it runs out,
    the plain one is a JSON 503 with Retry-After and the stream ends in an {"error"} object, as the docs promise
    for a server stopping first (uvicorn cancelled their tasks: a plain-text 500 and tracebacks); exit 0."""
    log_path = tmp_path / "serve.log"
    with server(model_dir, log_path, "--max-wait-ms", 60000, "--grace-s", 1) as (proc, u):
        holder, _ = held(u, {"text": lines[:2]})
        with ThreadPoolExecutor(2) as pool:
            plain = pool.submit(post, u, {"text": lines[:3]})
            streamed = pool.submit(stream, u, {"text": lines[3:6]})
            deadline = time.monotonic() + 30
            while metric(u, "pipeline_in_flight_requests") < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            r = plain.result()
            assert r.status_code == 503 and r.headers["retry-after"], r.text
            assert "--grace-s 1 ran out before this request was translated" in r.json()["error"]
            objects = streamed.result()
            assert objects[-1].keys() == {"error"} and "--grace-s 1 ran out" in objects[-1]["error"]
        # a client that never finished its body is answered once the answers' time is out too: a JSON 503 (it was
        # uvicorn's plain-text 500, a traceback, and 499 in the access log)
        answer = b"".join(iter(lambda: holder.recv(65536), b""))
        holder.close()
        assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: " in answer.lower(), answer
        assert "the server is stopping" in json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert proc.wait(60) == 0
    text = log_path.read_text()
    assert "Traceback" not in text and "never retrieved" not in text, text
    assert "--grace-s 1 ran out: 2 request(s) answered 503" in text
    assert "POST /translate answered 503: the server stopped before its answer was ready" in text


def test_a_second_ctrl_c_ends_streams_with_their_error_and_logs_no_traceback(model_dir, tmp_path, lines):
    """A second Ctrl-C cut a running stream off without its {"error"} object or its last chunk (clients raised
    IncompleteRead), and logged uvicorn's CancelledError traceback, the lifespan's as a failed shutdown, and
    "Future exception was never retrieved"."""
    log_path = tmp_path / "serve.log"
    with server(model_dir, log_path, "--max-wait-ms", 60000) as (proc, u):
        holder, _ = held(u, {"text": lines[:2]})  # the batcher waits for it: the stream below is in flight
        with ThreadPoolExecutor(1) as pool:
            streamed = pool.submit(stream, u, {"text": lines[3:6]})
            deadline = time.monotonic() + 30
            while metric(u, "pipeline_in_flight_requests") < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            objects = streamed.result()  # a whole chunked body (httpx raises on one cut short)
        holder.close()
        assert objects[-1] == {"error": "the server is stopping: this stream ends here; retry the texts without an "
                                        "answer elsewhere"}, objects
        assert proc.wait(60) == 0
    text = log_path.read_text()
    assert "Traceback" not in text and "never retrieved" not in text and "ERROR" not in text, text
    assert "POST /translate: its stream ended with an error: the server stopped" in text


def test_startup_failures_are_one_line_exit_2(model_dir, tmp_path, capsys):
    assert run_cli("serve", tmp_path / "missing") == 2
    assert capsys.readouterr().err.startswith("error: ")
    # a rate limit that nothing would apply (it limits the keyless clients of --api-keys) was taken in silence
    assert run_cli("serve", model_dir, "--keyless-rate", 1) == 2
    assert "--keyless-rate limits the clients without a key of --api-keys FILE" in capsys.readouterr().err
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

"""`pipeline serve` against the hostile cases of issue 58, each at the size that broke it: GET /languages of a
202-language model built once (it cost N^3 per request on the event loop), API keys looked up in constant
time whatever their number, a keys file with a byte-order mark or without end, keys where LibreTranslate's
clients put them (query string, UTF-8 bearer), "alternatives" no int() can read, a client that leaves
mid-translation (no asyncio traceback in the log), and Nagle off on the listening socket."""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
import socket
import threading
import time
import timeit
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")
pytest.importorskip("sentencex")

import httpx  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402
from test_serve_hostile import StandIn  # noqa: E402

from model.errors import UserError  # noqa: E402
from pipeline.serve import languages as serve_languages  # noqa: E402
from pipeline.serve.app import create_app  # noqa: E402
from pipeline.serve.keys import ApiKeys, KeyRefused  # noqa: E402
from pipeline.serve.languages import Routes, served_languages  # noqa: E402
from pipeline.serve.metrics import Metrics  # noqa: E402
from pipeline.serve.options import RequestLimits  # noqa: E402
from pipeline.serve.runner import bind  # noqa: E402
from pipeline.serve.state import ServedModel, ServerState  # noqa: E402
from runtime.decoding import PAPER  # noqa: E402

KEY = "k3y-for-tests-0001"
NLLB_LIKE = tuple(a + b + c for a in "abc" for b in "abcdefghijklmnopqrstuvwxyz" for c in "abcdefghijklmnopqrstuvwxyz"
                  )[:202]  # as many codes as NLLB serves


def state_of(models: dict[str, tuple[tuple[str, ...], tuple[str, ...]]], keys: ApiKeys | None = None,
             delay: float = 0.0) -> ServerState:
    metrics, limits = Metrics(), RequestLimits()
    decoding = PAPER.replace(batch_tokens=limits.max_batch_tokens)
    served = {name: ServedModel(name, StandIn(delay), decoding, 4, "en", {}, metrics.model(name), sources=src,
                                targets=tgt) for name, (src, tgt) in models.items()}
    return ServerState(served, limits, {}, metrics, warmed_up=True, keys=keys)


@contextmanager
def client(state: ServerState) -> Iterator[TestClient]:
    with TestClient(create_app(state)) as c:
        yield c


def test_languages_of_a_202_language_model_are_built_once_and_errors_stay_short(monkeypatch):
    state = state_of({"nllb": (NLLB_LIKE, NLLB_LIKE)})
    with client(state) as c:
        # built at start: a request builds nothing (it cost N^3 per request, 1.2 s of /health stalls for 202)
        monkeypatch.setattr(serve_languages, "language_name", lambda code: pytest.fail("built per request"))
        got = c.get("/languages").json()
        assert len(got) == 202 and got[0]["code"] == "aaa" and len(got[0]["targets"]) == 201
        assert c.get("/languages").content == state.routes.languages_json
        r = c.post("/translate", json={"q": "a", "source": "aaa", "target": "xx"})
        assert r.status_code == 400 and len(r.content) < 400, len(r.content)  # was 772 KB, every pair listed
        assert "40602 pairs of 202 languages (GET /languages lists them)" in r.json()["error"]
        assert c.post("/translate", json={"q": "a", "source": "aaa", "target": "aab"}).status_code == 200


def test_routes_answer_by_model_and_a_manifest_with_too_many_languages_is_one_line():
    routes = Routes.of([("a", "A", ("de", "en"), ("en", "fr")), ("b", "B", ("de",), ("fr", "it"))])
    assert [routes.model(s, t) for s, t in [("de", "fr"), ("de", "it"), ("en", "en"), ("it", "de")]] == \
        ["A", "B", None, None]
    assert routes.pairs() == [("de", "en"), ("de", "fr"), ("de", "it"), ("en", "fr")]
    assert routes.codes == ["de", "en", "fr", "it"] and routes.listed() == "de-en, de-fr, de-it, en-fr"
    many = tuple(f"x{i}" for i in range(2000))
    manifest = type("M", (), {"languages": type("L", (), {"source": many, "target": many})()})()
    with pytest.raises(UserError, match="2000 languages, more than the 1000"):
        served_languages("m", manifest)


def _keys_file(path: Path, n: int) -> Path:
    path.write_text(f"{KEY}\n" + "".join(f"key-number-{i:08d}\n" for i in range(n)))
    return path


def test_a_key_check_costs_the_same_with_10_keys_or_200000(tmp_path):
    """The check was linear in the keys (200k: 14 ms per refused request, on the event loop). Timed as the
    splitter's scaling tests: best of 7 alternating rounds, as a ratio."""
    few, many = (ApiKeys.read(str(_keys_file(tmp_path / f"{n}.txt", n))) for n in (10, 200_000))
    assert len(many) == 200_001

    def refused(keys: ApiKeys) -> None:
        with pytest.raises(KeyRefused):
            keys.check("not-a-key-at-all")

    calls = [functools.partial(refused, keys) for keys in (few, many)]
    rounds = [[timeit.timeit(call, number=200) for call in calls] for _ in range(7)]
    seconds = [min(times) for times in zip(*rounds)]
    assert seconds[1] / seconds[0] < 3, f"200,000 keys took {seconds[1] / seconds[0]:.1f}x the time of 10"
    many.check(KEY)
    many.check("key-number-00199999")


def test_a_keys_file_with_a_bom_or_without_end(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_bytes(b"\xef\xbb\xbf" + f"{KEY}\n".encode())  # as Notepad saves it
    ApiKeys.read(str(path)).check(KEY)  # the mark was part of the first key, which never matched
    started = time.monotonic()
    with pytest.raises(UserError, match="--api-keys /dev/zero: the file is over 64 MiB"):
        ApiKeys.read("/dev/zero")
    assert time.monotonic() - started < 30  # bounded: it read without end before


def test_keys_where_libretranslate_clients_send_them(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(f"{KEY}\nключ-для-тестов-1\n")
    with client(state_of({"de-en": (("de",), ("en",))}, ApiKeys.read(str(path), require=True))) as c:
        form = {"q": "hund", "source": "de", "target": "en"}
        assert c.post("/translate", data=form).status_code == 400  # required and missing, as LibreTranslate
        r = c.post(f"/translate?api_key={KEY}", data=form)  # a form POST with the key in the query string
        assert r.status_code == 200 and r.json()["translatedText"] == "HUND", r.text
        # deep-translator: every field in the query string, an empty body
        r = c.post("/translate", params={**form, "api_key": KEY})
        assert r.status_code == 200 and r.json()["translatedText"] == "HUND", r.text
        r = c.post("/detect", params={"q": "hund", "api_key": KEY})
        assert r.status_code in (200, 501), r.text  # 501: no detector in this state, but the key was read
        # a non-ASCII key as a bearer token: UTF-8 on the wire, read as Latin-1 by HTTP
        bearer = {"Authorization": "Bearer ключ-для-тестов-1".encode()}
        assert c.post("/translate", json=form, headers=bearer).status_code == 200
        assert c.post("/translate", json={"text": ["hund"]}, headers=bearer).status_code == 200
        assert c.post("/translate", json={"text": ["hund"]}, headers={"Authorization": "Bearer nope-nope"}
                      ).status_code == 401


@pytest.mark.parametrize("given", ["²", "1" * 4400, "٣", "1e3", "--2"])
def test_alternatives_no_int_can_read_are_a_400(given, caplog):
    with caplog.at_level(logging.WARNING), client(state_of({"de-en": (("de",), ("en",))})) as c:
        for r in (c.post("/translate", json={"q": "a", "source": "de", "target": "en", "alternatives": given}),
                  c.post("/translate", data={"q": "a", "source": "de", "target": "en", "alternatives": given})):
            assert r.status_code == 400 and '"alternatives" must be a whole number' in r.json()["error"], r.text
    assert not [rec for rec in caplog.records if rec.exc_info]  # was a 503 "retry later" and a traceback


@contextmanager
def real_server(state: ServerState) -> Iterator[tuple[str, int]]:
    """The app under uvicorn on a loopback port (bound as `pipeline serve` binds it), in a thread."""
    import uvicorn

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(state), log_config=None, access_log=False, lifespan="on"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield sock.getsockname()[:2]
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_clients_that_leave_mid_translation_leave_no_traceback_in_the_log(caplog):
    state = state_of({"de-en": (("de",), ("en",))}, delay=0.3)
    with caplog.at_level(logging.DEBUG), real_server(state) as (host, port):
        for body in (json.dumps({"q": "ein hund", "source": "de", "target": "en"}),
                     json.dumps({"text": ["ein hund"]})):
            for _ in range(3):
                with socket.create_connection((host, port), timeout=10) as s:
                    s.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode()))
                    time.sleep(0.05)  # queued, then gone
        deadline = time.monotonic() + 20
        gone = lambda: state.models["de-en"].metrics.disconnects._value.get()  # noqa: E731
        while gone() < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone() == 6
        r = httpx.post(f"http://{host}:{port}/translate", json={"q": "hund", "source": "de", "target": "en"})
        assert r.json()["translatedText"] == "HUND"
        gc.collect()  # "exception was never retrieved" is logged when the future is collected
        time.sleep(0.2)
    noise = [rec for rec in caplog.records if rec.exc_info or "never retrieved" in rec.getMessage()]
    assert not noise, [rec.getMessage() for rec in noise]


def test_the_listening_socket_turns_nagle_off_for_every_connection():
    """Accepted sockets inherit TCP_NODELAY, and say they are TCP, which is what asyncio checks before it
    turns Nagle off itself; with Nagle on, each answer on a kept-alive connection waited ~40 ms."""
    listener = bind("127.0.0.1", 0)
    listener.listen()
    try:
        with socket.create_connection(listener.getsockname()[:2], timeout=5):
            accepted, _ = listener.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
                assert accepted.proto == socket.IPPROTO_TCP
    finally:
        listener.close()


def test_query_string_fields_are_bounded():
    with client(state_of({"de-en": (("de",), ("en",))})) as c:
        r = c.post("/translate?" + "&".join(f"f{i}=x" for i in range(3000)))
        assert r.status_code == 400 and "more than 2048 fields" in r.json()["error"]
        # a repeated "q" is a list of texts (libretranslate-aio sends a list so), from a form or the query
        r = c.post("/translate", data={"q": ["ein hund", "eine katze"], "source": "de", "target": "en"})
        assert r.json()["translatedText"] == ["EIN HUND", "EINE KATZE"], r.text
        r = c.post("/translate", params={"q": ["a", "b"], "source": "de", "target": "en"})
        assert r.json()["translatedText"] == ["A", "B"], r.text

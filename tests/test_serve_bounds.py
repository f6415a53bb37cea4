"""`pipeline serve` against the hostile cases of issue 58, each at the size that broke it: GET /languages of a
202-language model built once (it cost N^3 per request on the event loop), API keys looked up in constant
time whatever their number, a keys file with a byte-order mark or without end, keys where LibreTranslate's
clients put them (query string, UTF-8 bearer), "alternatives" no int() can read, a client that leaves
mid-translation (no asyncio traceback in the log), and Nagle off on the listening socket."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import json
import logging
import re
import socket
import threading
import time
import timeit
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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
from pipeline.serve.access import ApiKeys, KeyRefused  # noqa: E402
from pipeline.serve.app import create_app  # noqa: E402
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
    path.write_bytes(f"{KEY}\n".encode() + b"secret-\xff-key\n")  # Latin-1: named by its line, its bytes unquoted
    with pytest.raises(UserError) as refused:
        ApiKeys.read(str(path))
    assert str(refused.value) == f"--api-keys {path}:2: not UTF-8 text; save the file as UTF-8"


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
        # a JSON body with fields in the query string: they were ignored without a word (?glossary=main translated
        # without the glossary); the key alone is read there, as LibreTranslate clients send it
        r = c.post("/translate?glossary=main&format=html", json={"q": "hund", "source": "de", "target": "en"},
                   headers=bearer)
        assert r.status_code == 400 and "not the query string ('format', 'glossary')" in r.json()["error"], r.text
        r = c.post(f"/translate?api_key={KEY}", json={"q": "hund", "source": "de", "target": "en"})
        assert r.status_code == 200 and r.json()["translatedText"] == "HUND", r.text
        r = c.post("/detect?q=der+hund", json={"q": "hund", "api_key": KEY})  # it detected the body's text
        assert r.status_code == 400 and "not the query string ('q')" in r.json()["error"], r.text


def test_a_busy_servers_503_is_not_counted_in_a_keys_rate(tmp_path, monkeypatch):
    """A key of 3 requests a minute tried a full queue three times (503, Retry-After: 1, as the docs say to retry)
    and its first served request was a 429 "retry in 55 s": the refused tries spent the minute. A 503 serves
    nothing and is taken back out; a 400 (read, refused) counts."""
    pytest.importorskip("multipart")
    from pipeline.serve.batcher import QueueFull

    path = tmp_path / "keys.txt"
    path.write_text(f"{KEY} 3\n")
    state = state_of({"de-en": (("de",), ("en",))}, ApiKeys.read(str(path)))
    auth = {"Authorization": f"Bearer {KEY}"}
    libre = {"q": "hund", "source": "de", "target": "en", "api_key": KEY}
    with client(state) as c:
        batcher = state.models["de-en"].batcher
        real = batcher.submit

        def full(*args, **kwargs):
            raise QueueFull("the queue holds 1 request (--max-queue 1)")

        monkeypatch.setattr(batcher, "submit", full)
        for _ in range(2):
            assert c.post("/translate", json={"text": ["hund"]}, headers=auth).status_code == 503
            assert c.post("/translate", json=libre).status_code == 503
            r = c.post("/translate_file", data={k: v for k, v in libre.items() if k != "q"},
                       files={"file": ("a.txt", b"hund\n")})
            assert r.status_code == 503, r.text
        monkeypatch.setattr(batcher, "submit", real)
        assert c.post("/translate", json={"text": ["hund"]}, headers=auth).json() == {"translations": ["HUND"]}
        assert c.post("/translate", json=libre).json()["translatedText"] == "HUND"
        assert c.post("/translate", json={"text": ["hund"], "beam_size": 0}, headers=auth).status_code == 400
        r = c.post("/translate", json=libre)  # the 400 counted: the fourth request of the minute
        assert r.status_code == 429 and "3 requests per minute" in r.json()["error"], r.text
        assert c.post("/translate", json={"text": ["hund"]}, headers=auth).status_code == 429
    # both APIs' refusals are counted under the server's one model (LibreTranslate's were model="")
    requests = state.metrics.requests
    assert requests.labels(model="de-en", code="429")._value.get() == 2
    assert requests.labels(model="de-en", code="503")._value.get() == 6
    assert requests.labels(model="", code="429")._value.get() == 0
    with client(state) as c:  # a body that is no object, a model the server lacks: the native API's too
        assert c.post("/translate", json=[1]).status_code == 400  # (keyless: the key's minute is spent)
        assert c.post("/translate", json={"text": ["a"], "model": "nope"}).status_code == 404
    assert requests.labels(model="", code="400")._value.get() == requests.labels(model="", code="404")._value.get() == 0


@pytest.mark.parametrize("given", ["²", "1" * 4400, "٣", "1e3", "--2"])
def test_alternatives_no_int_can_read_are_a_400(given, caplog):
    with caplog.at_level(logging.WARNING), client(state_of({"de-en": (("de",), ("en",))})) as c:
        for r in (c.post("/translate", json={"q": "a", "source": "de", "target": "en", "alternatives": given}),
                  c.post("/translate", data={"q": "a", "source": "de", "target": "en", "alternatives": given})):
            assert r.status_code == 400 and '"alternatives" must be a whole number' in r.json()["error"], r.text
    assert not [rec for rec in caplog.records if rec.exc_info]  # was a 503 "retry later" and a traceback


@contextmanager
def real_server(state: ServerState, **options: Any) -> Iterator[tuple[str, int]]:
    """The app under uvicorn on a loopback port (bound and configured as `pipeline serve` does it), in a thread."""
    import uvicorn

    from pipeline.serve.options import ServeHttpOptions
    from pipeline.serve.runner import uvicorn_config

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn_config(create_app(state), ServeHttpOptions(**options), state.limits))
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



@pytest.mark.parametrize("trusted", ["", "127.0.0.1"])
def test_x_forwarded_for_names_the_client_only_from_a_trusted_proxy(tmp_path, trusted):
    """uvicorn believed X-Forwarded-For from any peer on 127.0.0.1: behind a local proxy passing a client's own
    header on, each keyless request could name a new address and pass --keyless-rate."""
    (tmp_path / "keys").write_text(KEY + "\n")
    state = state_of({"de-en": (("de",), ("en",))}, ApiKeys.read(str(tmp_path / "keys"), keyless_per_minute=2))
    with real_server(state, forwarded_allow_ips=trusted) as (host, port):
        codes = [httpx.post(f"http://{host}:{port}/translate", json={"q": "hund", "source": "de", "target": "en"},
                            headers={"X-Forwarded-For": f"10.0.0.{k}"}, timeout=10).status_code for k in range(4)]
    assert codes == ([200] * 4 if trusted else [200, 200, 429, 429])


def test_a_proxy_list_that_names_no_address_is_refused_in_one_line(monkeypatch):
    """uvicorn takes an entry it cannot parse for a literal host: 127.0.0.0/33 or localhost trusted no proxy, without
    a word, and every client behind it shared one keyless rate."""
    from pipeline.serve.options import ServeHttpOptions
    from pipeline.serve.runner import trusted_proxies

    monkeypatch.delenv("FORWARDED_ALLOW_IPS", raising=False)
    for good in ("127.0.0.1", "127.0.0.0/8, ::1", "*", "10.0.0.1,*"):
        assert trusted_proxies(ServeHttpOptions(forwarded_allow_ips=good)) == good
    for bad in ("127.0.0.0/33", "localhost", "127.0.0.1;10.0.0.1", "garbage!!"):
        with pytest.raises(UserError, match=f"--forwarded-allow-ips '{re.escape(bad.split(',')[0])}': not an "):
            trusted_proxies(ServeHttpOptions(forwarded_allow_ips=bad))
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "localhost")
    with pytest.raises(UserError, match="FORWARDED_ALLOW_IPS 'localhost'"):
        trusted_proxies(ServeHttpOptions())


def test_a_trusted_proxys_scheme_makes_file_urls_https(tmp_path, monkeypatch):
    """Trusting no proxy by default also stopped X-Forwarded-Proto: behind a TLS proxy translatedFileUrl became
    http:// (mixed content on an https page). The option, or uvicorn's FORWARDED_ALLOW_IPS, makes it believed."""
    pytest.importorskip("multipart")
    from pipeline.serve.options import ServeHttpOptions
    from pipeline.serve.runner import uvicorn_config

    files = {"file": ("a.txt", b"ein hund\n")}
    headers = {"X-Forwarded-Proto": "https", "Host": "translate.example.org"}
    for env, option, scheme in (("", "", "http"), ("", "127.0.0.1", "https"), ("127.0.0.1", "", "https")):
        monkeypatch.setenv("FORWARDED_ALLOW_IPS", env)
        assert uvicorn_config(None, ServeHttpOptions(forwarded_allow_ips=option)).proxy_headers == (scheme == "https")
        with real_server(state_of({"de-en": (("de",), ("en",))}), forwarded_allow_ips=option) as (host, port):
            r = httpx.post(f"http://{host}:{port}/translate_file", data={"source": "de", "target": "en"},
                           files=files, headers=headers, timeout=10)
        assert r.json()["translatedFileUrl"].startswith(f"{scheme}://translate.example.org/download_file/"), r.text

def test_a_path_prefix_reaches_the_file_urls_with_root_path():
    """Behind a proxy serving the server under /mt (stripping it), translatedFileUrl was /download_file/ID: a 404
    through the proxy, and pipeline serve had no way to say the prefix. --root-path /mt puts it in the URL; the
    server still answers the paths the proxy sends it (without the prefix)."""
    pytest.importorskip("multipart")
    from pipeline.serve.runner import root_path

    files = {"file": ("a.txt", b"ein hund\n")}
    with real_server(state_of({"de-en": (("de",), ("en",))}), root_path="/mt/") as (host, port):
        r = httpx.post(f"http://{host}:{port}/translate_file", data={"source": "de", "target": "en"}, files=files,
                       timeout=10)  # as the proxy sends it: the prefix stripped
        url = r.json()["translatedFileUrl"]
        assert url.startswith(f"http://{host}:{port}/mt/download_file/"), r.text
        got = httpx.get(f"http://{host}:{port}/download_file/{url.rsplit('/', 1)[1]}", timeout=10)
        assert got.status_code == 200 and got.content == b"EIN HUND\n", got.text
        assert httpx.get(f"http://{host}:{port}/languages", timeout=10).status_code == 200
    for bad in ("mt", "/m t", "/mt?x"):
        with pytest.raises(UserError, match="--root-path .*like /mt"):
            root_path(bad)


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
        # each 499 on the model the request chose, on both APIs (LibreTranslate's was on model="")
        answered = lambda: state.metrics.requests.labels(model="de-en", code="499")._value.get()  # noqa: E731
        while (gone() < 6 or answered() < 6) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone() == 6 and answered() == 6
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


def test_two_servers_starting_on_one_port_the_second_is_refused_at_once():
    """bind() listens: two servers starting together both bound the port (SO_REUSEADDR), and the second, whose
    listen uvicorn (uvloop) then failed in silence, said it was serving and never answered."""
    first = bind("127.0.0.1", 0)
    try:
        with pytest.raises(UserError, match="Address already in use.*another server is using the port"):
            bind("127.0.0.1", first.getsockname()[1])
    finally:
        first.close()
    with pytest.raises(UserError, match="8.8.8.8 is not an address of this machine: pick another --host") as e:
        bind("8.8.8.8", 0)
    assert "another server" not in str(e.value)


def test_cors_origin_is_one_a_browser_can_send():
    """--cors-origin https://example.org/ (a trailing slash) started in silence, and every preflight from
    https://example.org was then refused: a browser's Origin never has a path."""
    from pipeline.serve.runner import cors_origin

    assert cors_origin("*") == "*" and cors_origin(" None ") is None
    for good in ("https://example.org", "http://localhost:8080", "moz-extension://4b2c-11", "http://[::1]:3000"):
        assert cors_origin(good) == good
    for spelled, sent in (("HTTPS://Example.org", "https://example.org"), ("https://example.org:443",
                          "https://example.org"), ("http://example.org:80", "http://example.org")):
        assert cors_origin(spelled) == sent  # what a browser sends, which the middleware compares exactly
    for bad in ("https://example.org/", "https://example.org/app", "garbage", "example.org", ""):
        with pytest.raises(UserError, match="scheme://host\\[:port\\] with no path"):
            cors_origin(bad)


def test_query_string_fields_are_bounded():
    with client(state_of({"de-en": (("de",), ("en",))})) as c:
        r = c.post("/translate?" + "&".join(f"f{i}=x" for i in range(3000)))
        assert r.status_code == 413 and r.json()["error"] == (
            "the query string has more than this server's limit of 2048 fields (--max-lines 1024 texts in \"q\", "
            "and other fields besides)")
        # a repeated "q" is a list of texts (libretranslate-aio sends a list so), from a form or the query
        r = c.post("/translate", data={"q": ["ein hund", "eine katze"], "source": "de", "target": "en"})
        assert r.json()["translatedText"] == ["EIN HUND", "EINE KATZE"], r.text
        r = c.post("/translate", params={"q": ["a", "b"], "source": "de", "target": "en"})
        assert r.json()["translatedText"] == ["A", "B"], r.text


def test_form_fields_follow_max_lines(tmp_path):
    """3,000 texts in "q" under --max-lines 5000: JSON took them, a form, a multipart form and a query string
    were refused at 2,048 fields (400), whatever --max-lines said; over the limit, a 413 naming --max-lines. With
    --api-keys, the key's own reading of the query string capped it at 2,048 too."""
    state = state_of({"de-en": (("de",), ("en",))}, keys=ApiKeys.read(str(_keys_file(tmp_path / "k.txt", 1)), 0))
    state.limits = dataclasses.replace(state.limits, max_lines=5000, max_bytes=1 << 22)
    texts = [f"w{i}" for i in range(3000)]  # short: a query string of 6,000 stays under its 64 KiB
    multipart = {"content-type": "multipart/form-data; boundary=b0undary"}
    with client(state) as c:
        for many, answer in ((texts, 200), (texts * 2, 413)):
            fields = {"q": many, "source": "de", "target": "en"}
            for sent in (dict(data=fields), dict(params=fields), dict(content=_multipart(fields), headers=multipart)):
                r = c.post("/translate", **sent)
                assert r.status_code == answer, r.text[:200]
                if answer == 200:
                    assert r.json()["translatedText"] == [t.upper() for t in texts]
                else:
                    assert r.json()["error"].endswith("has more than this server's limit of 5064 fields (--max-lines "
                                                      "5000 texts in \"q\", and other fields besides)"), r.text


def _multipart(fields: dict[str, Any]) -> bytes:
    parts = [(key, v) for key, value in fields.items() for v in (value if isinstance(value, list) else [value])]
    return b"".join(f'--b0undary\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
                    for k, v in parts) + b"--b0undary--\r\n"


def _read_body_of(declared: int | None, chunks: list[bytes], limits: RequestLimits,
                  ends: bool = False) -> tuple[object, int, float]:
    """http.read_body on a request declaring `declared` bytes whose client sends `chunks` and then stalls (or
    ends its body there): what it returned or raised, how many times it asked for more, and the seconds taken."""
    from starlette.requests import Request

    from pipeline.serve.http import ApiError, read_body

    asked = 0

    async def receive() -> dict[str, object]:
        nonlocal asked
        asked += 1
        if asked <= len(chunks):
            return {"type": "http.request", "body": chunks[asked - 1], "more_body": not ends or asked < len(chunks)}
        await asyncio.sleep(3600)  # a client that stalls
        raise AssertionError("unreachable")

    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    request = Request({"type": "http", "method": "POST", "path": "/translate", "headers": headers}, receive)
    started = time.monotonic()
    try:
        got: object = asyncio.run(read_body(request, limits))
    except ApiError as e:
        got = e
    return got, asked, time.monotonic() - started


def test_a_body_over_max_bytes_is_a_413_never_a_408():
    """A declared size past --max-bytes waited out the 30 s body timeout and got 408 (the drain ran inside it)."""
    limits = RequestLimits(max_bytes=2000, body_timeout_s=0.5)
    huge, asked, _ = _read_body_of(10 ** 12, [], limits)  # past any drain: refused unread, the connection closed
    assert huge.status == 413 and huge.headers == {"Connection": "close"} and asked == 0
    assert str(huge) == "request body of 1000000000000 bytes is over this server's limit of 2000 bytes " \
                        "(--max-bytes); split the request"
    lying, _, seconds = _read_body_of(5000, [b"{}"], limits)  # declared over, and then never sent
    assert lying.status == 413 and lying.headers == {"Connection": "close"} and seconds < 30
    sent, _, _ = _read_body_of(3000, [b"x" * 1000] * 3, limits, ends=True)  # drained: the client reads its 413
    assert sent.status == 413 and sent.headers == {}
    streamed, _, _ = _read_body_of(None, [b"x" * 1500] * 2, limits)  # no length: over once read past the limit
    assert streamed.status == 413 and "request body is over" in str(streamed)
    stalled, _, _ = _read_body_of(100, [b"{"], limits)  # within the limit but slow: 408
    assert stalled.status == 408 and stalled.headers == {"Connection": "close"}
    whole, _, _ = _read_body_of(4, [b'{"a"'], RequestLimits(max_bytes=2000), ends=True)
    assert whole == b'{"a"'


@pytest.mark.parametrize("path", ["/detect", "/suggest", "/translate", "/translate_file"])
def test_a_client_leaving_mid_body_leaves_nothing_in_the_log(path, caplog, tmp_path):
    """/detect and /suggest let ClientDisconnect escape: an ERROR line and uvicorn's traceback per client."""
    from pipeline.serve.suggestions import Suggestions

    state = state_of({"de-en": (("de",), ("en",))})
    state.suggestions = Suggestions(tmp_path / "s.db")
    app = create_app(state)
    sent: list[dict[str, object]] = []
    messages = iter([{"type": "http.request", "body": b'{"q": "ab', "more_body": True}, {"type": "http.disconnect"}])

    async def receive() -> dict[str, object]:
        return next(messages, {"type": "http.disconnect"})

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    kind = b"multipart/form-data; boundary=x" if path == "/translate_file" else b"application/json"
    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-length", b"1000"),
             (b"content-type", kind)], "query_string": b"", "server": ("x", 80), "scheme": "http", "app": app}
    caplog.set_level(logging.INFO)
    asyncio.run(app(scope, receive, send))
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] in ([], [499])
    # counted, as every client that leaves is (mid-body /translate was counted nowhere): no model was chosen yet,
    # so under the server's only one, as a refusal on either API is
    assert state.metrics.requests.labels(model="de-en", code="499")._value.get() == 1
    assert state.models["de-en"].metrics.disconnects._value.get() == 1


def test_unknown_routes_wrong_methods_and_refused_preflights_answer_json():
    """Starlette's defaults answered these in plain text ("Not Found"), against every other refusal's JSON."""
    with client(state_of({"de-en": (("de",), ("en",))})) as c:
        r = c.get("/nope")
        assert r.status_code == 404 and r.json() == {"error": "no route GET /nope; GET /spec describes this "
                                                              "server's API"}
        r = c.get("/translate")
        assert r.status_code == 405 and r.json() == {"error": "/translate takes POST, not GET"}
        assert r.headers["allow"] == "POST"
        r = c.delete("/languages")
        assert r.status_code == 405 and r.json()["error"].startswith("/languages takes GET")
        r = c.options("/translate", headers={"Origin": "http://page", "Access-Control-Request-Method": "DELETE"})
        assert r.status_code == 400 and r.json() == {"error": "CORS preflight refused: Disallowed CORS method"}
        assert r.headers["access-control-allow-origin"] == "*"
        r = c.options("/translate", headers={"Origin": "http://page", "Access-Control-Request-Method": "POST"})
        assert r.status_code == 200


def test_libretranslate_copies_a_sentence_without_letters():
    state = state_of({"de-en": (("de",), ("en",))})
    with client(state) as c:
        r = c.post("/translate", json={"q": ["Der Hund.\n123", "\U0001F600"], "source": "de", "target": "en"})
        assert r.json()["translatedText"] == ["DER HUND.\n123", "\U0001F600"]
    sent = [ids for batch in state.models["de-en"].loaded.batches for ids in batch if ids]
    assert len(sent) == 1 and len(sent[0]) == len("Der Hund.") + 1


def test_libretranslate_fields_of_a_wrong_type_are_400s_not_defaults(tmp_path):
    """`format` [] / 0 / false was served as text, `api_key` 0 / false / [] as no key (a keyed server served
    them keyless), `alternatives` 10^9 passed when no text reached a model, invalid UTF-8 in the query string
    became U+FFFD, a lone surrogate reached /detect, a file in /translate's form named no field."""
    (tmp_path / "keys").write_text(KEY + "\n")
    keys = ApiKeys.read(str(tmp_path / "keys"), require=True)
    q = {"q": "Hallo", "source": "de", "target": "en", "api_key": KEY}
    with client(state_of({"de-en": (("de",), ("en",))}, keys)) as c:
        for kind in ([], 0, False):
            r = c.post("/translate", json={**q, "format": kind})
            assert r.status_code == 400 and r.json()["error"].startswith('"format" must be "text" or "html"')
        for kind in (None, ""):
            assert c.post("/translate", json={**q, "format": kind}).json()["translatedText"] == "HALLO"
        for key in (0, False, []):
            r = c.post("/translate", json={**q, "api_key": key})
            assert r.status_code == 400 and r.json()["error"] == '"api_key" must be a string'
        r = c.post("/translate", json={**q, "target": "de", "alternatives": 10 ** 9})
        assert r.status_code == 400 and r.json()["error"] == "\"alternatives\" 1000000000 is above this server's " \
                                                             "limit of 3"
        assert c.post("/translate", json={**q, "alternatives": -1}).json()["translatedText"] == "HALLO"  # as there
        r = c.post(f"/translate?q=%ff&source=de&target=en&api_key={KEY}")
        assert r.status_code == 400 and r.json()["error"].startswith("the query string is not UTF-8 form data")
        r = c.post("/detect", content=json.dumps({"q": "\udc00abc", "api_key": KEY}),
                   headers={"content-type": "application/json"})
        assert r.status_code == 400 and "lone surrogate" in r.json()["error"]
        r = c.post("/translate", data={"source": "de", "target": "en", "api_key": KEY},
                   files={"q": ("q.txt", b"Hallo", "text/plain")})
        assert r.status_code == 400 and r.json()["error"].startswith("the form data holds a file")


def _raw(host: str, port: int, data: bytes, wait: float = 5.0) -> bytes:
    """What the server answers a connection that sends `data` (then nothing), until it closes or `wait` passes."""
    with socket.create_connection((host, port), timeout=wait) as conn:
        conn.sendall(data)
        got = b""
        try:
            while chunk := conn.recv(65536):
                got += chunk
        except TimeoutError:
            got += b"<still open>"
        except ConnectionResetError:  # closed with data unread: a reset
            got += b"<reset>"
        return got


def test_a_request_target_too_long_to_read_is_a_414_and_a_long_path_is_not_echoed_whole():
    """A path or query string past 65,535 bytes (uvicorn's URL parser has 16-bit offsets) was a bare 400 "Invalid
    HTTP request received."; a 60,000-character path came back whole in its 404."""
    pytest.importorskip("httptools")
    with real_server(state_of({"de-en": (("de",), ("en",))})) as (host, port):
        for target in (b"/" + b"a" * 70_000, b"/translate?q=" + b"%C3%BC" * 12_000):
            got = _raw(host, port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            assert got.startswith(b"HTTP/1.1 414 "), got[:100]
            assert b"exceeds 65535 bytes; send the texts in the body" in got
            assert b"\r\naccess-control-allow-origin: *\r\n" in got  # a browser's page reads why (--cors-origin)
        got = _raw(host, port, b"GET /" + b"a" * 60_000 + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 404 ") and len(got) < 1000 and b"(60001 characters)" in got, got[:300]
    too_long = b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    for option, header in (("https://Example.org", b"\r\naccess-control-allow-origin: https://example.org\r\n"
                                                  b"vary: Origin\r\n"), ("none", b"access-control")):
        with real_server(state_of({"de-en": (("de",), ("en",))}), cors_origin=option) as (host, port):
            got = _raw(host, port, too_long)
            assert got.startswith(b"HTTP/1.1 414 ") and (header in got) == (option != "none"), got[:300]


def test_a_request_head_is_bounded_in_time_size_and_connections(monkeypatch):
    """uvicorn waited for a request's head for ever and buffered it whole: idle connections (nothing sent, or "POST
    /tra") stayed open until the file descriptors ran out and /health failed, and 400 MB of headers held 574 MB.
    A head now has --head-timeout-s and 64 KiB (408 / 431, closed), and past --max-connections the connection that
    has waited longest for its head is closed (503) to make room; requests in time, and the next one on a kept-alive
    connection, are served as before."""
    pytest.importorskip("httptools")
    from pipeline.serve import connections

    monkeypatch.setattr(connections, "IDLE_S", 0.3)
    state = state_of({"de-en": (("de",), ("en",))})
    state.limits = dataclasses.replace(state.limits, head_timeout_s=0.5, max_connections=3)
    with real_server(state) as (host, port):
        started = time.monotonic()
        for partial in (b"", b"POST /tra"):
            assert _raw(host, port, partial).startswith(b"HTTP/1.1 408 ")
        assert time.monotonic() - started < 4
        huge = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (100 << 10)
        assert _raw(host, port, huge).startswith(b"HTTP/1.1 431 ")
        assert b"\r\naccess-control-allow-origin: *\r\n" in _raw(host, port, huge)
        ok = _raw(host, port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200 "), ok[:80]
        idle = [socket.create_connection((host, port)) for _ in range(3)]  # the cap, held
        try:
            time.sleep(0.1)  # one more: the oldest waiting for its head makes room (503), and this one is served
            served = _raw(host, port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert served.startswith(b"HTTP/1.1 200 "), served[:80]
            idle[0].settimeout(2)
            assert idle[0].recv(100).startswith(b"HTTP/1.1 503 ")
        finally:
            for conn in idle:
                conn.close()
        time.sleep(0.2)
        with httpx.Client(base_url=f"http://{host}:{port}") as c:  # one connection, two requests
            assert [c.get("/health").status_code for _ in range(2)] == [200, 200]
        # connections idle between requests make room too (a pool's kept-alive ones refused every new client), once
        # idle IDLE_S: one just answered may be sending its next request (closed, that request was reset)
        pools = [httpx.Client(base_url=f"http://{host}:{port}") for _ in range(3)]
        try:
            assert [p.get("/health").status_code for p in pools] == [200] * 3
            request = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            assert _raw(host, port, request).startswith(b"HTTP/1.1 503 ")  # the new one waits, not theirs
            time.sleep(connections.IDLE_S + 0.2)
            served = _raw(host, port, request)
            assert served.startswith(b"HTTP/1.1 200 "), served[:80]
        finally:
            for p in pools:
                p.close()
        time.sleep(0.2)
        # a body of 97 KB (under --max-bytes) and, pipelined behind it in the same packets, the next request's
        # head: the body was counted as head bytes (431, and the first request dropped)
        body = json.dumps({"text": ["ein hund " * 10_000][:1]}).encode()[:97_000]
        first = (b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
        answers = _raw(host, port, first + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert b" 431 " not in answers and answers.count(b"HTTP/1.1 ") == 2, answers[:200]


def test_sighup_drains_unless_ignored_as_under_nohup():
    """SIGHUP killed the server (every request in flight lost); it drains as SIGTERM does now, except where it is
    ignored (nohup): trapping it there stopped a server its user had asked to outlive the terminal."""
    import signal

    import uvicorn

    from pipeline.serve.runner import _Server

    server = _Server(uvicorn.Config(app=None), state_of({"de-en": (("de",), ("en",))}))
    before = signal.getsignal(signal.SIGHUP)
    try:
        for given, trapped in ((signal.SIG_DFL, True), (signal.SIG_IGN, False)):
            signal.signal(signal.SIGHUP, given)
            with server.capture_signals():
                assert (signal.getsignal(signal.SIGHUP) == server.handle_exit) == trapped
            assert signal.getsignal(signal.SIGHUP) == given
    finally:
        signal.signal(signal.SIGHUP, before)


def test_language_names_keep_a_region_apart():
    """NLLB's eng_Latn is English; pt-BR and zh-TW are named with their region (named Portuguese and Chinese,
    /languages listed two entries of one name; then by their codes); a code nobody knows is its own name."""
    from pipeline.serve.languages import language_name

    assert [language_name(c) for c in ("eng_Latn", "zho_Hant", "pt-BR", "zh-TW", "pt", "de", "xxx_Latn", "a1")] == [
        "English", "Chinese (Traditional)", "Portuguese (Brazil)", "Chinese (Taiwan)", "Portuguese", "German",
        "xxx_Latn", "a1"]


def test_a_client_that_never_reads_its_responses_is_dropped(monkeypatch, caplog):
    """Connections whose client sent requests and read nothing were held for ever (no send timeout): as many as
    --max-connections of them locked every new client out. Past SEND_TIMEOUT_S with the responses unread, dropped."""
    pytest.importorskip("httptools")
    from pipeline.serve import connections

    monkeypatch.setattr(connections, "SEND_TIMEOUT_S", 0.5)
    monkeypatch.setattr(connections, "WARN_EVERY_S", 0.0)
    with caplog.at_level(logging.WARNING, logger="pipeline.serve.connections"), \
            real_server(state_of({"de-en": (("de",), ("en",))})) as (host, port):
        with socket.create_connection((host, port)) as conn:
            conn.sendall(b"GET /spec HTTP/1.1\r\nHost: x\r\n\r\n" * 1000)  # 15 MB of answers, none read
            deadline = time.monotonic() + 10
            while "not reading their responses" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.1)
        assert "1 not reading their responses" in caplog.text
        assert httpx.get(f"http://{host}:{port}/health", timeout=10).status_code == 200


def _protocols() -> list[Any]:
    """The server's open connections (uvicorn's protocol objects; the server runs in this process)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return [o for o in gc.get_objects() if HttpToolsProtocol in type(o).__mro__ and not o.transport.is_closing()]


def test_pipelined_requests_wait_as_bytes_and_are_all_answered_in_order(monkeypatch):
    """Thousands of tiny requests pipelined behind a slow one were parsed in one go, each held as a request object
    (a 64 KiB write of them: 1,986 queued); the parser now stops while one waits its turn, and all are answered."""
    pytest.importorskip("httptools")
    from pipeline.serve import connections

    monkeypatch.setattr(connections, "FEED_BYTES", 1024)
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    body = json.dumps({"text": ["ein hund"]}).encode()
    slow = (b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)
    n = (64 << 10) // len(health)
    with real_server(state_of({"de-en": (("de",), ("en",))}, delay=1.0)) as (host, port), \
            socket.create_connection((host, port), timeout=20) as conn:
        conn.sendall(slow + health * n + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        time.sleep(0.5)  # the translation takes 1 s: everything behind it is read by now
        queued = [len(p.pipeline) for p in _protocols()]
        assert queued and max(queued) <= 1024 // len(health) + 1, queued  # was every one of them: 1872
        got = b""
        while chunk := conn.recv(1 << 16):
            got += chunk
    statuses = re.findall(rb"HTTP/1.1 (\d+) ", got)
    assert len(statuses) == n + 2 and set(statuses) == {b"200"}, (len(statuses), set(statuses))
    assert got.index(b'"translations"') < got.index(b'"status"')  # the slow one first, as sent


def test_bytes_no_request_begins_with_behind_a_response_are_answered_after_it():
    """Garbage pipelined behind a request being answered got its 400 at once, written into the middle of that
    response (a stream cut after 75 of 300 objects, no last chunk; a plain answer never sent) and the connection
    closed under it (logged as a client that left). The responses before it now end first, then the 400."""
    pytest.importorskip("httptools")
    body = json.dumps({"text": ["ein hund"]}).encode()
    slow = (b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with real_server(state_of({"de-en": (("de",), ("en",))}, delay=1.0)) as (host, port):
        got = _raw(host, port, slow + b"GARBAGE\r\n\r\n", wait=10)
        assert re.findall(rb"HTTP/1.1 (\d+) ", got) == [b"200", b"400"], got[:300]
        assert got.index(b'"translations"') < got.index(b"HTTP/1.1 400"), got[:300]
        assert got.endswith(b'{"error": "Invalid HTTP request received."}\n'), got[-200:]  # then closed
        with socket.create_connection((host, port), timeout=10) as conn:  # behind a request still to be answered
            conn.sendall(slow + health)
            time.sleep(0.3)
            conn.sendall(b"\x00\x01 not http\r\n\r\n" + health)  # what follows the garbage is dropped
            got = b""
            while chunk := conn.recv(1 << 16):
                got += chunk
        assert re.findall(rb"HTTP/1.1 (\d+) ", got) == [b"200", b"200", b"400"], got[:400]
        assert b"translations" in got.split(b"HTTP/1.1 200")[1] and b"status" in got.split(b"HTTP/1.1 200")[2]
        bad_body = (b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n")  # a chunk size no parser reads
        got = _raw(host, port, slow + bad_body, wait=10)  # queued behind the slow one: its 400 took the 200's place
        assert re.findall(rb"HTTP/1.1 (\d+) ", got) == [b"200", b"400"], got[:300]
        assert got.index(b'"translations"') < got.index(b"HTTP/1.1 400") and got.endswith(
            b'{"error": "Invalid HTTP request received."}\n'), got[-200:]


def test_a_chunked_trailer_and_stray_bytes_between_requests_are_bounded_as_a_head(monkeypatch):
    """httptools accumulates a chunked body's trailer field however long (16 connections held 933 MiB), and a stray
    CRLF between requests cancelled uvicorn's keep-alive timeout with no other timer: the connection stayed open
    for ever. A trailer is bounded as a head is (431); stray bytes have --head-timeout-s to begin a request."""
    pytest.importorskip("httptools")
    state = state_of({"de-en": (("de",), ("en",))})
    state.limits = dataclasses.replace(state.limits, head_timeout_s=0.5)
    with real_server(state) as (host, port):
        body = json.dumps({"text": ["ein hund"]}).encode()
        chunked = (b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(body) + body + b"\r\n0\r\n")
        answer = _raw(host, port, chunked + b"X-Trailer: " + b"a" * (200 << 10))
        assert answer.startswith(b"HTTP/1.1 431 ") and b"trailer" in answer, answer[:200]
        ok = _raw(host, port, chunked + b"X-Trailer: 1\r\n\r\n")  # a trailer of a few bytes is a request as before
        assert ok.startswith(b"HTTP/1.1 200 ") and b"translations" in ok, ok[:200]
        with socket.create_connection((host, port), timeout=4) as conn:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            got = b""
            while not got.endswith(b"}"):  # the whole answer, head and body
                got += conn.recv(1 << 16)
            assert got.startswith(b"HTTP/1.1 200 "), got[:80]
            conn.sendall(b"\r\n")  # kept alive, then a stray CRLF: it begins no request
            started = time.monotonic()
            try:
                late = conn.recv(1 << 16)
            except TimeoutError:
                late = b"<still open>"
        assert late.startswith(b"HTTP/1.1 408 ") and time.monotonic() - started < 3, late[:100]


def test_a_model_dir_given_through_a_link_is_served_under_the_name_given(tmp_path, monkeypatch):
    """`pipeline serve models/de-en` with de-en a link to de-en-v3 was served as "de-en-v3": no LibreTranslate
    route (the name carries the pair), where the docs say a MODEL_DIR is served under its directory's name."""
    from pipeline.serve.runner import model_specs

    (tmp_path / "de-en-v3").mkdir()
    (tmp_path / "de-en").symlink_to(tmp_path / "de-en-v3")
    assert model_specs(str(tmp_path / "de-en"), ()) == [("de-en", str(tmp_path / "de-en"))]
    monkeypatch.chdir(tmp_path / "de-en-v3")
    assert model_specs(".", ())[0][0] == "de-en-v3"  # "." is the directory it names


def test_odd_but_honest_requests_are_read_or_refused_as_json(monkeypatch):
    """A JSON file saved with a byte-order mark, sent as `curl -d @file` (the form content type), was read as a
    LibreTranslate form ("missing q parameter"); "DE" was refused by the native API where LibreTranslate's took it;
    a gzip body was "not valid UTF-8 (byte 1)"; a body declared over --max-bytes with Expect: 100-continue was
    invited (100 Continue), uploaded and then refused; the connection-level refusals were plain text."""
    pytest.importorskip("httptools")
    state = state_of({"de-en": (("de",), ("en",))})
    state.limits = dataclasses.replace(state.limits, head_timeout_s=0.5)
    with real_server(state) as (host, port), httpx.Client(base_url=f"http://{host}:{port}") as c:
        r = c.post("/translate", content=b'\xef\xbb\xbf{"text": ["hund"]}',
                   headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 200 and r.json() == {"translations": ["HUND"]}, r.text
        r = c.post("/translate", json={"text": ["hund"], "source": "DE", "target": "En"})
        assert r.status_code == 200 and r.json() == {"translations": ["HUND"]}, r.text
        r = c.post("/translate", content=b'{"text": ["hund"]}', headers={"content-encoding": "gzip"})
        assert r.status_code == 415 and "Content-Encoding 'gzip'" in r.json()["error"], r.text
        r = c.post("/translate", json={"text": ["hund"]}, headers={"content-encoding": "UTF-8"})  # a charset by
        assert r.status_code == 200, r.text  # mistake: read as before
        head = (b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
                b"Content-Length: " + str(state.limits.max_bytes + 1).encode() + b"\r\n\r\n")
        answer = _raw(host, port, head)
        assert answer.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in answer, answer[:200]
        for sent, status in ((b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (100 << 10), 431),
                             (b"POST /tra", 408), (b"GET /health HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 400)):
            answer = _raw(host, port, sent)
            assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
            assert b"content-type: application/json" in answer.lower()
            assert "error" in json.loads(answer.split(b"\r\n\r\n", 1)[1]), answer


def test_a_body_still_arriving_after_an_early_answer_is_not_taken_for_a_head():
    """A 404 (or 405, or translate_file's 400 for a wrong content type) is answered before its body has arrived;
    the rest of that body was counted as the next request's head: a second, unasked 431 and a reset."""
    pytest.importorskip("httptools")
    with real_server(state_of({"de-en": (("de",), ("en",))})) as (host, port), \
            socket.create_connection((host, port), timeout=10) as conn:
        size = 300 << 10
        conn.sendall(b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)
        got = b""
        while b"\r\n\r\n" not in got:
            got += conn.recv(1 << 16)
        assert got.startswith(b"HTTP/1.1 404 "), got[:100]
        for _ in range(size // (20 << 10)):  # the body after its answer, in pieces
            conn.sendall(b"x" * (20 << 10))
            time.sleep(0.01)
        conn.sendall(b"x" * (size % (20 << 10)) + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        while chunk := conn.recv(1 << 16):
            got += chunk
    assert b" 431 " not in got and got.count(b"HTTP/1.1 ") == 2 and b"HTTP/1.1 200 " in got, got[-300:]

"""The real LibreTranslate client (libretranslatepy, unmodified) against a real `pipeline serve` process on a
loopback port, serving a tiny exported model as de-en and en-de with API keys: languages, translate (a named
source and "auto"), detect, the key refused and accepted; and over plain HTTP, on the same server, what that
client cannot send: a list, HTML, alternatives. Every translation is checked against the native API's answer
for the same text, so a wrong route, a lost sentence or broken markup shows; and `serve-batch --format html`
writes what the server answers for the same documents."""

from __future__ import annotations

import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("py3langid")
libretranslatepy = pytest.importorskip("libretranslatepy")

import httpx  # noqa: E402
from helpers import run_cli  # noqa: E402
from test_server import FAST, server  # noqa: E402

KEY = "client-test-key-0123456789"
TEXT = "der hund sieht die katze. die frau hat ein rotes auto!"


@pytest.fixture(scope="module")
def url(fp32_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("libreclient")
    keys = tmp / "keys.txt"
    keys.write_text(f"{KEY} 1000\n")
    with server(None, tmp / "serve.log", "--model", f"de-en={fp32_dir}", "--model", f"en-de={fp32_dir}",
                "--api-keys", keys) as (_, u):
        yield u


def native(url: str, model: str, texts: list[str]) -> list[str]:
    """The native API's answer for the texts as documents, the same path LibreTranslate's takes."""
    r = httpx.post(f"{url}/translate", json={"text": texts, "model": model, "split": "sentences"},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["translations"]


@pytest.mark.slow
def test_the_libretranslate_client_translates_detects_and_lists_languages(url):
    client = libretranslatepy.LibreTranslateAPI(url, api_key=KEY)
    assert client.languages() == [{"code": "de", "name": "German", "targets": ["en"]},
                                  {"code": "en", "name": "English", "targets": ["de"]}]
    [expected] = native(url, "de-en", [TEXT])
    assert expected  # the random model says something
    assert client.translate(TEXT, "de", "en") == expected
    assert client.translate(TEXT, "auto", "en") == expected  # detected as de, so routed to de-en
    [expected_en_de] = native(url, "en-de", ["the man sees a big red house."])
    assert client.translate("the man sees a big red house.", "en", "de") == expected_en_de
    detected = client.detect("Der Mann fährt mit dem Fahrrad durch die Stadt.")
    assert detected[0]["language"] == "de" and detected[0]["confidence"] > 50


@pytest.mark.slow
def test_the_client_with_a_wrong_key_is_refused_and_without_one_served_at_the_keyless_rate(url):
    """As LibreTranslate: a wrong key is a 403; no key is served at the default (keyless) rate, so keyless
    clients keep working on a keyed server."""
    client = libretranslatepy.LibreTranslateAPI(url, "not-a-key")
    for call, args in ((client.translate, (TEXT, "de", "en")), (client.detect, (TEXT,))):
        with pytest.raises(urllib.error.HTTPError) as e:
            call(*args)
        assert e.value.code == 403
    assert client.languages()[0]["code"] == "de"  # open, as LibreTranslate's
    keyless = libretranslatepy.LibreTranslateAPI(url)
    assert keyless.translate(TEXT, "de", "en") == native(url, "de-en", [TEXT])[0]


@pytest.mark.slow
def test_what_the_client_cannot_send_a_list_html_and_alternatives(url):
    texts = [TEXT, "", "eine katze."]
    r = httpx.post(f"{url}/translate", json={"q": texts, "source": "de", "target": "en", "api_key": KEY}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["translatedText"] == native(url, "de-en", texts)
    assert [s is None for s in r.json()["score"]] == [False, True, False]
    html = '<p title="der hund">der hund <b>sieht</b> die katze &amp; das auto.</p><code>der hund</code>'
    r = httpx.post(f"{url}/translate", json={"q": html, "source": "de", "target": "en", "format": "html",
                                             "api_key": KEY}, timeout=60)
    assert r.status_code == 200, r.text
    parts = native(url, "de-en", ["der hund ", "sieht", " die katze & das auto."])
    escape = lambda s: s.replace("&", "&amp;").replace("<", "&lt;")
    assert r.json()["translatedText"] == (f'<p title="der hund">{escape(parts[0])}<b>{escape(parts[1])}</b>'
                                          f"{escape(parts[2])}</p><code>der hund</code>")
    r = httpx.post(f"{url}/translate", data={"q": TEXT, "source": "de", "target": "en", "alternatives": "2",
                                             "api_key": KEY}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["translatedText"] == native(url, "de-en", [TEXT])[0]
    assert len(r.json()["alternatives"]) <= 2 and r.json()["translatedText"] not in r.json()["alternatives"]


@pytest.mark.slow
def test_serve_batch_format_html_writes_what_the_server_answers(url, fp32_dir, tmp_path):
    docs = ['<p title="der hund">der hund <b>sieht</b> die katze &amp; das auto.</p><code>der hund</code>', "",
            "<br/>", "die frau hat ein rotes auto. <i>der mann</i> sieht es!"]
    inp, out = tmp_path / "in.html", tmp_path / "out.html"
    inp.write_text("".join(d + "\n" for d in docs), encoding="utf-8")
    assert run_cli("serve-batch", fp32_dir, inp, "-o", out, "--format", "html", "--lang", "de", "--backend", "torch",
                   "--no-progress", *FAST) == 0
    r = httpx.post(f"{url}/translate", json={"q": docs, "source": "de", "target": "en", "format": "html",
                                             "api_key": KEY}, timeout=60)
    assert r.status_code == 200, r.text
    assert out.read_text(encoding="utf-8").split("\n")[:-1] == r.json()["translatedText"]
    assert r.json()["translatedText"][1:3] == ["", "<br/>"]

"""LibreTranslate's clients, unmodified, and the exact requests of others replayed from their source, against one
real `pipeline serve` process on a loopback port (a tiny exported model as de-en and en-de) with API keys that
are not required: each client keyless and with its key, each answer checked the way that client reads it and
against the native API's translation of the same text.

- deep-translator (the most used Python client): every field in the query string, an empty body.
- libretranslate-aio: form data (a list of texts as a repeated q), detect, languages, frontend settings, health,
  a file translated and downloaded.
- Replays: Weblate 4 (urlencoded form, an empty api_key), Weblate 5 (JSON), Discourse's translator plugin
  (urlencoded, format html), Open WebUI's filter (JSON, source auto).
Each runs against a plain server and a keyed one. The real libretranslatepy client: test_serve_libreclient.py;
Mastodon's requests: test_docker_entrypoint.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("py3langid")
httpx = pytest.importorskip("httpx")

from test_server import server  # noqa: E402

KEY = "clients-test-key-0123456789"
TEXT = "der hund sieht die katze. die frau hat ein rotes auto!"


@pytest.fixture(scope="module", params=["plain", "keyed"])
def url(request: pytest.FixtureRequest, fp32_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A plain server (no keys: a key a client sends is not looked at) and a keyed one (keys not required)."""
    tmp = tmp_path_factory.mktemp("clients")
    keys = tmp / "keys.txt"
    keys.write_text(f"{KEY} 1000\n")
    extra = ["--api-keys", keys, "--keyless-rate", 1000] if request.param == "keyed" else []
    with server(None, tmp / "serve.log", "--model", f"de-en={fp32_dir}", "--model", f"en-de={fp32_dir}",
                *extra) as (_, u):
        yield u


def keyed(url: str) -> bool:
    return httpx.get(f"{url}/frontend/settings", timeout=30).json()["apiKeys"]


def native(url: str, model: str, text: str) -> str:
    r = httpx.post(f"{url}/translate", json={"text": [text], "model": model, "split": "sentences"},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["translations"][0]


@pytest.mark.slow
def test_deep_translator(url):
    """It always sends a key (it refuses to start without one) and every field in the query string."""
    from deep_translator import LibreTranslator
    from deep_translator.exceptions import AuthorizationException

    translator = LibreTranslator(source="de", target="en", custom_url=f"{url}/", api_key=KEY)
    assert translator.translate(TEXT) == native(url, "de-en", TEXT)
    assert translator.translate_batch([TEXT, "die katze"]) == [native(url, "de-en", t) for t in (TEXT, "die katze")]
    wrong = LibreTranslator(source="de", target="en", custom_url=f"{url}/", api_key="wrong-key-00")
    if keyed(url):
        with pytest.raises(AuthorizationException):
            wrong.translate(TEXT)
    else:  # a plain server serves everyone, as LibreTranslate without --api-keys
        assert wrong.translate(TEXT) == native(url, "de-en", TEXT)


@pytest.mark.slow
@pytest.mark.parametrize("key", [None, KEY])
def test_libretranslate_aio(url, key, tmp_path):
    from libretranslate_aio import ForbiddenError, LibreTranslate

    with LibreTranslate(url, api_key=key) as client:
        assert client.translate(TEXT, "de", "en").translated_text == native(url, "de-en", TEXT)
        listed = client.translate([TEXT, "der mann"], "de", "en").translated_text
        assert listed == [native(url, "de-en", t) for t in (TEXT, "der mann")]
        auto = client.translate("Der Mann fährt mit dem Fahrrad durch die Stadt.", "auto", "en")
        assert auto.detected_language is not None and auto.detected_language.language == "de"
        assert client.detect("Der Mann fährt mit dem Fahrrad durch die Stadt.")[0].language == "de"
        assert [(lang.code, lang.targets) for lang in client.languages()] == [("de", ["en"]), ("en", ["de"])]
        settings = client.frontend_settings()
        assert settings.api_keys is keyed(url) and settings.key_required is False and settings.char_limit > 0
        assert client.health() is True
        assert settings.supported_files_format and ".docx" in settings.supported_files_format
        path = tmp_path / "brief.txt"
        path.write_text(f"{TEXT}\n\nder mann\n")
        translated = client.translate_file(path, "de", "en")
        got = httpx.get(translated.translated_file_url, timeout=30)
        assert got.status_code == 200, got.text
        assert got.text == f"{native(url, 'de-en', TEXT)}\n\n{native(url, 'de-en', 'der mann')}\n"
    if keyed(url):
        with LibreTranslate(url, api_key="wrong-key-00") as client, pytest.raises(ForbiddenError):
            client.translate(TEXT, "de", "en")


@pytest.mark.slow
@pytest.mark.parametrize("key", ["", KEY])
def test_weblate_replays(url, key):
    """Weblate 4 (weblate/machinery/libretranslate.py): GET /languages read as codes, then a urlencoded form
    with api_key (empty when none is configured); Weblate 5 sends the same fields as JSON."""
    codes = [lang["code"] for lang in httpx.get(f"{url}/languages", timeout=30).json()]
    assert codes == ["de", "en"]
    fields = {"api_key": key, "q": TEXT, "source": "de", "target": "en"}
    for r in (httpx.post(f"{url}/translate", data=fields, timeout=60),
              httpx.post(f"{url}/translate", json=fields, timeout=60)):
        assert r.status_code == 200, r.text
        assert r.json()["translatedText"] == native(url, "de-en", TEXT)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["", KEY])
def test_discourse_translator_replay(url, key):
    """discourse-translator's LibreTranslate provider: POST /detect then /translate, each a urlencoded body
    (format html), a non-200 raised as an error, the body read as JSON."""
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    r = httpx.post(f"{url}/detect", content=f"q=Der+Mann+f%C3%A4hrt+nach+Hause.&api_key={key}", headers=form,
                   timeout=30)
    assert r.status_code == 200, r.text
    detected = json.loads(r.text)[0]["language"]
    assert detected == "de"
    html = "<p>der hund sieht die katze.</p>"
    body = httpx.QueryParams({"q": html, "source": detected, "target": "en", "format": "html", "api_key": key})
    r = httpx.post(f"{url}/translate", content=str(body), headers=form, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["translatedText"] == f"<p>{native(url, 'de-en', 'der hund sieht die katze.')}</p>"


@pytest.mark.slow
def test_open_webui_filter_replay(url):
    """Open WebUI's LibreTranslate filter: JSON {q, source: "auto", target, format: "text"}, no key, and
    raise_for_status; a reply already in the target language comes back as it was."""
    r = httpx.post(f"{url}/translate", json={"q": "Der Mann fährt mit dem Fahrrad durch die Stadt.",
                                             "source": "auto", "target": "en", "format": "text"}, timeout=60)
    r.raise_for_status()
    assert r.json()["translatedText"] == native(url, "de-en", "Der Mann fährt mit dem Fahrrad durch die Stadt.")
    r = httpx.post(f"{url}/translate", json={"q": "The man rides a bicycle through the city.", "source": "auto",
                                             "target": "en", "format": "text"}, timeout=60)
    r.raise_for_status()
    assert r.json()["translatedText"] == "The man rides a bicycle through the city."

"""What LibreTranslate's clients rely on beyond /translate itself (issue 60), in-process over stand-in models: CORS
for browser pages and add-ons, /frontend/settings, /spec and /docs, texts returned unchanged when they are in
the target language already or have no letters, and the access log an operator reads (never a key)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")
pytest.importorskip("sentencex")

from starlette.testclient import TestClient  # noqa: E402
from test_serve_bounds import state_of  # noqa: E402

from pipeline.serve import access  # noqa: E402
from pipeline.serve.access import ApiKeys  # noqa: E402
from pipeline.serve.app import create_app  # noqa: E402

PAIRS = {"de-en": (("de",), ("en",)), "en-de": (("en",), ("de",))}


def test_cors_for_pages_and_add_ons_on_other_origins():
    with TestClient(create_app(state_of(PAIRS))) as c:
        r = c.options("/translate", headers={"Origin": "https://example.org", "Access-Control-Request-Method": "POST",
                                             "Access-Control-Request-Headers": "content-type"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"  # preflight answered
        assert "POST" in r.headers["access-control-allow-methods"]
        r = c.post("/translate", json={"q": "hund", "source": "de", "target": "en"},
                   headers={"Origin": "https://example.org"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert c.get("/languages", headers={"Origin": "moz-extension://x"}).headers[
            "access-control-allow-origin"] == "*"
    state = state_of(PAIRS)
    state.cors_origin = None  # --cors-origin none
    with TestClient(create_app(state)) as c:
        r = c.post("/translate", json={"q": "hund", "source": "de", "target": "en"},
                   headers={"Origin": "https://example.org"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    state = state_of(PAIRS)
    state.cors_origin = "https://app.example"
    with TestClient(create_app(state)) as c:
        r = c.get("/languages", headers={"Origin": "https://app.example"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert "access-control-allow-origin" not in c.get("/languages", headers={"Origin": "https://evil.example"}
                                                          ).headers


def test_a_failure_a_route_did_not_foresee_is_a_503_with_cors_headers(monkeypatch):
    """Starlette answers what escapes a route outside every middleware: the 503 went out without the CORS header,
    so the page that sent the request saw a network error instead of the message."""
    from pipeline.serve import libre

    def broken(request: object) -> None:
        raise RuntimeError("the disk is gone")

    monkeypatch.setattr(libre, "frontend_settings", broken)
    with TestClient(create_app(state_of(PAIRS))) as c:
        r = c.get("/frontend/settings", headers={"Origin": "https://example.org"})
    assert r.status_code == 503 and r.json()["error"] == "RuntimeError: the disk is gone; retry later"
    assert r.headers["access-control-allow-origin"] == "*" and r.headers["retry-after"]


def test_same_language_and_letterless_texts_come_back_unchanged_per_text():
    with TestClient(create_app(state_of(PAIRS))) as c:
        r = c.post("/translate", json={"q": ["ein hund", "🐶 42", "", "3,14"], "source": "de", "target": "en"})
        assert r.json()["translatedText"] == ["EIN HUND", "🐶 42", "", "3,14"], r.text
        assert r.json()["score"][1:] == [None, None, None]
        r = c.post("/translate", json={"q": "der Hund", "source": "de", "target": "de"})
        assert r.status_code == 200 and r.json()["translatedText"] == "der Hund"  # was a 400 for the batch
        r = c.post("/translate", json={"q": "xx", "source": "fr", "target": "fr"})
        assert r.status_code == 400 and '"source" fr is not a language this server translates' in r.json()["error"]
        r = c.post("/translate", json={"q": "<p>😀</p>", "source": "de", "target": "en", "format": "html"})
        assert r.json()["translatedText"] == "<p>😀</p>"


def test_frontend_settings_spec_and_docs(tmp_path: Path):
    keys = tmp_path / "keys.txt"
    keys.write_text("a-key-for-tests\n")
    state = state_of(PAIRS, ApiKeys.read(str(keys), require=True))
    with TestClient(create_app(state)) as c:
        settings = c.get("/frontend/settings").json()  # open, as in LibreTranslate
        assert settings["keyRequired"] is True and settings["apiKeys"] is True
        assert settings["language"] == {"source": {"code": "en", "name": "English"},  # no detector here
                                        "target": {"code": "de", "name": "German"}}
        assert settings["charLimit"] * 12 <= state.limits.max_bytes and settings["frontendTimeout"] > 0
        assert {"suggestions", "filesTranslation", "supportedFilesFormat"} <= set(settings)
        spec = c.get("/spec").json()
        assert spec["openapi"].startswith("3.") and {"/translate", "/detect", "/languages",
                                                     "/frontend/settings"} <= set(spec["paths"])
        fields = spec["paths"]["/translate"]["post"]["requestBody"]["content"]["application/json"]["schema"]["oneOf"][0]
        assert {"q", "source", "target", "format", "alternatives", "api_key", "glossary"} == set(fields["properties"])
        # what the API takes: q a list too, glossary an object too (a generated client refused both); every refusal
        # a route gives is listed
        assert {"type": "array", "items": {"type": "string"}} in fields["properties"]["q"]["oneOf"]
        assert "object" in [k["type"] for k in fields["properties"]["glossary"]["oneOf"]]
        assert {"413", "501"} <= set(spec["paths"]["/detect"]["post"]["responses"])
        assert {"413", "503", "507"} <= set(spec["paths"]["/suggest"]["post"]["responses"])
        try:
            from openapi_spec_validator import validate
        except ImportError:
            pass
        else:
            validate(spec)
        page = c.get("/docs")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'fetch("spec")' in page.text


def test_one_access_log_line_per_request_never_the_key(tmp_path: Path, caplog):
    keys = tmp_path / "keys.txt"
    keys.write_text("# ops\nthe-secret-key-1 100\n")
    for fmt in ("text", "json"):
        state = state_of(PAIRS, ApiKeys.read(str(keys)))
        state.access_log = fmt
        with caplog.at_level(logging.INFO, logger="pipeline.access"), TestClient(create_app(state)) as c:
            caplog.clear()
            c.post("/translate", json={"q": ["hund", "katze"], "source": "de", "target": "en",
                                       "api_key": "the-secret-key-1"})
            c.post("/translate", json={"text": ["hund"], "model": "de-en"})
            c.post("/translate", json={"q": "x", "source": "de", "target": "en", "api_key": "wrong-key-99"})
            c.get("/health")
            c.get("/x%0Aforged 200 line")  # a line break in the path cannot forge a log line
        lines = [r.getMessage() for r in caplog.records if r.name == "pipeline.access"]
        assert len(lines) == 5 and all("\n" not in line for line in lines), lines
        lines = lines[:4]
        assert not any("the-secret-key-1" in line or "wrong-key-99" in line for line in lines)
        if fmt == "json":
            first, native, wrong, health = map(json.loads, lines)
            assert first["method"] == "POST" and first["path"] == "/translate" and first["status"] == 200
            assert first["model"] == "de-en" and first["texts"] == 2 and first["key"] == "line 2"
            assert native["key"] == "keyless" and native["model"] == "de-en" and native["texts"] == 1
            assert wrong["status"] == 403 and "model" not in wrong and health["path"] == "/health"
            assert all(isinstance(line["ms"], float) for line in (first, native, wrong, health))
        else:
            assert lines[0].startswith("POST /translate 200 ")
            assert lines[0].endswith(' ms model=de-en texts=2 key="line 2"')
            assert lines[2].startswith("POST /translate 403 ")


def test_a_rate_limited_request_says_whose_rate_in_the_access_log(tmp_path, caplog):
    """`POST /translate 429 0.5 ms` said nothing of the key that was over its rate: an operator could not tell which
    customer it was."""
    keys = tmp_path / "keys.txt"
    keys.write_text("the-secret-key-1 1\n")
    state = state_of(PAIRS, ApiKeys.read(str(keys)))
    state.access_log = "text"
    with caplog.at_level(logging.INFO, logger="pipeline.access"), TestClient(create_app(state)) as c:
        for _ in range(2):
            c.post("/translate", json={"q": "hund", "source": "de", "target": "en", "api_key": "the-secret-key-1"})
            c.post("/translate", json={"text": ["hund"], "model": "de-en"},
                   headers={"Authorization": "Bearer the-secret-key-1"})
    lines = [r.getMessage() for r in caplog.records if r.name == "pipeline.access"]
    limited = [line for line in lines if " 429 " in line]
    assert len(limited) == 3 and all(line.endswith('key="line 1"') for line in limited), lines


def test_the_access_log_has_its_own_plain_handler():
    access.configure("json")
    try:
        handler = access.log.handlers[0]
        record = logging.LogRecord("pipeline.access", logging.INFO, "", 0, '{"a": 1}', None, None)
        assert handler.format(record) == '{"a": 1}' and access.log.propagate is False  # nothing but JSON
    finally:
        access.log.handlers[:] = []
        access.log.propagate = True


def test_what_libretranslate_accepts_and_what_no_api_may_lose():
    """Codes in any case and `"alternatives": 2.0` were 400s LibreTranslate does not give (it lowercases codes
    and takes int() of the count); a repeated field kept its last value in silence; a multipart field that is
    not UTF-8 was read as Latin-1 and its mojibake translated; /spec's download route lacked its path parameter
    (strict OpenAPI tools refused the document)."""
    with TestClient(create_app(state_of({**PAIRS, "nllb": (("eng_Latn",), ("deu_Latn",))}))) as c:
        r = c.post("/translate", json={"q": "hund", "source": "DE", "target": "En"})
        assert r.status_code == 200 and r.json()["translatedText"] == "HUND", r.text
        r = c.post("/translate", json={"q": "dog", "source": "ENG_LATN", "target": "deu_latn"})
        assert r.status_code == 200 and r.json()["translatedText"] == "DOG", r.text
        r = c.post("/translate", json={"q": "hund", "source": "Auto", "target": "en"})
        assert r.status_code != 400 or "must be a language code" not in r.text
        r = c.post("/translate", json={"q": "hund", "source": "de", "target": "en", "alternatives": 2.0})
        assert r.status_code == 200 and "alternatives" in r.json(), r.text  # the stand-in has one hypothesis
        r = c.post("/translate", json={"q": "hund", "source": "de", "target": "en", "alternatives": 2.5})
        assert r.status_code == 400 and "whole number" in r.json()["error"]
        r = c.post("/translate", content=b'{"q": "a", "q": "hund", "source": "de", "target": "en", "x": 1, "x": 2}',
                   headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"] == "field(s) 'q' given more than once; send each once"
        body = (b'--B\r\nContent-Disposition: form-data; name="q"\r\n\r\nda \xed\xa0\x80 \xff\r\n--B\r\n'
                b'Content-Disposition: form-data; name="source"\r\n\r\nde\r\n--B\r\n'
                b'Content-Disposition: form-data; name="target"\r\n\r\nen\r\n--B--\r\n')
        r = c.post("/translate", content=body, headers={"content-type": "multipart/form-data; boundary=B"})
        assert r.status_code == 400 and "form field 'q' is not utf-8 text" in r.json()["error"], r.text
        route = c.get("/spec").json()["paths"]["/download_file/{id}"]["get"]
        assert route["parameters"] == [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"},
                                        "description": "the last part of translatedFileUrl"}]


def test_settings_default_to_a_pair_the_server_translates():
    """Clients that send /frontend/settings' defaults as they are: an en-de server said auto -> en (a 200 handing the
    text back untranslated), one of made-up codes auto -> a code nothing translates into, and auto without a
    detector (every default request a 400)."""
    for pairs, detector, expected in (({"en-de": (("en",), ("de",))}, True, ("auto", "de")),
                                      ({"en-de": (("en",), ("de",))}, False, ("en", "de")),
                                      ({"xx-yy": (("xx",), ("yy",))}, False, ("xx", "yy")),
                                      (PAIRS, True, ("auto", "en")), (PAIRS, False, ("en", "de")),
                                      ({"nllb": (("ace_Arab", "eng_Latn", "fra_Latn"),) * 2}, False,
                                       ("eng_Latn", "ace_Arab"))):  # English first, as a source too
        state = state_of(pairs)
        if detector:
            state.detector = object()  # type: ignore[assignment]  # any: settings only ask whether there is one
        with TestClient(create_app(state)) as c:
            language = c.get("/frontend/settings").json()["language"]
        assert (language["source"]["code"], language["target"]["code"]) == expected, pairs


def test_auto_with_a_target_nothing_translates_into_names_the_target():
    """Detection ran first and took the blame: 'q is detected as de (confidence 99.7): "source" de to "target" xx is
    not a language pair'. The target is checked first, as LibreTranslate does."""
    with TestClient(create_app(state_of(PAIRS))) as c:  # no detector: the target's problem is still the one named
        r = c.post("/translate", json={"q": "der Hund", "source": "auto", "target": "xx"})
    assert r.status_code == 400 and r.json()["error"].startswith('"target" xx is not a language this server '
                                                                 "translates into; it translates de-en, en-de")


def test_an_nllb_models_languages_are_detected_named_and_defaulted():
    """NLLB's codes (eng_Latn) are ISO 639-3 with a script: detection knew none of its 202 ("knows none of this
    server's languages", 2.6 KB of codes), /languages named them by code, and the settings defaulted to ace_Arab.
    A language served under two codes (en by one model, eng_Latn by NLLB) is detected as the one that reaches the
    target: dropping both had English text detected as French, and handed back untranslated."""
    pytest.importorskip("py3langid")
    from pipeline.serve.detect import Detector

    codes = ("deu_Latn", "eng_Latn", "fra_Latn", "zho_Hans", "zho_Hant", "ace_Arab", "xxx_Latn")
    state = state_of({"en-de": (("en",), ("de",)), "nllb": (codes, codes)})
    state.detector = Detector(list(state.routes.codes))
    assert state.detector.unknown == ["xxx_Latn"]
    english = "This is an English sentence about the weather today, and it is long enough."
    with TestClient(create_app(state)) as c:
        r = c.post("/detect", json={"q": "Der Hund läuft heute Abend durch den großen Park."})
        assert r.json()[0]["language"] == "deu_Latn", r.text
        for target, source in (("fra_Latn", "eng_Latn"), ("de", "en")):
            r = c.post("/translate", json={"q": english, "source": "auto", "target": target})
            assert r.status_code == 200 and r.json()["detectedLanguage"]["language"] == source, r.text
        names = {lang["code"]: lang["name"] for lang in c.get("/languages").json()}
        assert names["eng_Latn"] == "English" and names["zho_Hant"] == "Chinese (Traditional)"
        assert names["ace_Arab"] == "Acehnese (Arabic)"  # named by its code, as 147 of NLLB's 202 codes were
        assert names["xxx_Latn"] == "xxx_Latn"
        assert c.get("/frontend/settings").json()["language"]["target"]["name"] == "English"


def _json_schema(node: object) -> object:
    """An OpenAPI 3.0 schema as JSON Schema: `nullable` is a null type beside the others."""
    if isinstance(node, list):
        return [_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _json_schema(v) for k, v in node.items() if k not in ("nullable", "description", "title")}
    if node.get("nullable"):
        out["type"] = [node["type"], "null"]
    return out


def test_real_answers_validate_against_the_servers_own_spec():
    """The /translate answer was a oneOf of two objects without required fields: every answer matched both, so
    none validated (a generated client refused them); a list q's detectedLanguage and score are lists, and an
    unchanged text's score is null, which the spec did not allow."""
    jsonschema = pytest.importorskip("jsonschema")
    with TestClient(create_app(state_of(PAIRS))) as c:
        spec = c.get("/spec").json()
        answer = _json_schema(spec["paths"]["/translate"]["post"]["responses"]["200"]["content"]["application/json"]
                              ["schema"])
        for body in ({"q": "hund", "source": "de", "target": "en"}, {"q": ["hund", "123"], "source": "de",
                                                                      "target": "en", "alternatives": 1},
                     {"text": ["hund"], "model": "de-en"}, {"text": ["hund"], "model": "de-en", "nbest": 2}):
            got = c.post("/translate", json=body)
            assert got.status_code == 200, got.text
            jsonschema.validate(got.json(), answer)

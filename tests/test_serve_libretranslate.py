"""LibreTranslate's API on `pipeline serve`, in-process (starlette's TestClient) over stand-in models de-en and
en-de, with the real language detector, HTML parser and API keys: the answers' shapes, form data, documents,
HTML that keeps its markup, alternatives and scores, routing by language, and every refusal a clear 4xx naming
the field (on both APIs), never a traceback. The real client against a real server: test_serve_libreclient.py."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")
pytest.importorskip("sentencex")

from starlette.testclient import TestClient  # noqa: E402
from test_serve_hostile import StandIn  # noqa: E402

from pipeline.serve.access import ApiKeys  # noqa: E402
from pipeline.serve.app import create_app  # noqa: E402
from pipeline.serve.detect import Detector  # noqa: E402
from pipeline.serve.metrics import Metrics  # noqa: E402
from pipeline.serve.options import RequestLimits  # noqa: E402
from pipeline.serve.state import ServedModel, ServerState  # noqa: E402
from runtime.decoding import PAPER  # noqa: E402
from runtime.markup import parse_html  # noqa: E402

KEY, SLOW_KEY = "k3y-for-tests-0001", "k3y-rate-limited-2"


class NBestStandIn(StandIn):
    """The stand-in's upper-cased copy, and as further hypotheses the copy reversed and the copy without its
    last character: n-best lists whose order and scores are known."""

    def translate(self, ids: list[list[int]], decoding: Any, **_: Any) -> list[Any]:  # type: ignore[override]
        self.batches.append(ids)
        self.searches = [*getattr(self, "searches", []), (decoding.nbest, decoding.beam_size)]
        hyps = lambda src: [(src[:-1], -0.5), (src[-2::-1], -1.5), (src[:-2], -2.5)]
        return [hyps(src)[:decoding.nbest] if src else [] for src in ids]


@functools.cache
def _detector(codes: tuple[str, ...]) -> Detector:
    pytest.importorskip("py3langid")
    return Detector(list(codes))  # about a second to load: once for the module


@contextmanager
def client(detector: bool = True, keys: Path | None = None, require: bool = True, keyless: int | None = None,
           **limits: Any) -> Iterator[TestClient]:
    metrics, request_limits = Metrics(), RequestLimits(**limits)
    decoding = PAPER.replace(batch_tokens=request_limits.max_batch_tokens)
    models = {name: ServedModel(name, NBestStandIn(), decoding, 4, name[:2], {}, metrics.model(name),
                                sources=(name[:2],), targets=(name[3:],)) for name in ("de-en", "en-de")}
    state = ServerState(models, request_limits, {}, metrics, warmed_up=True,
                        keys=ApiKeys.read(str(keys), keyless, require) if keys else None)
    if detector:
        state.detector = _detector(tuple(state.routes.codes))
    with TestClient(create_app(state)) as c:
        yield c


def lt(c: TestClient, **body: Any) -> tuple[int, Any]:
    r = c.post("/translate", content=json.dumps(body), headers={"content-type": "application/json"})
    return r.status_code, r.json()


def test_translate_a_string_and_a_list_as_documents():
    with client() as c:
        status, got = lt(c, q="Ein Hund läuft.  Er bellt!\n\nJa.", source="de", target="en")
        assert status == 200, got
        assert got["translatedText"] == "EIN HUND LÄUFT.  ER BELLT!\n\nJA."  # sentences and whitespace kept
        assert got["score"] == pytest.approx(-0.5) and "detectedLanguage" not in got and "alternatives" not in got
        status, got = lt(c, q=["Ein Hund.", "", "Eine Katze."], source="de", target="en")
        assert status == 200 and got["translatedText"] == ["EIN HUND.", "", "EINE KATZE."]
        assert got["score"] == [pytest.approx(-0.5), None, pytest.approx(-0.5)]
        # the native API answers the same text the same way
        native = c.post("/translate", json={"text": ["Ein Hund läuft.  Er bellt!\n\nJa."], "model": "de-en",
                                            "split": "sentences"}).json()
        assert native["translations"] == ["EIN HUND LÄUFT.  ER BELLT!\n\nJA."]


def test_form_data_urlencoded_and_multipart():
    with client() as c:
        for r in (c.post("/translate", data={"q": "Ein Hund\r\nbellt", "source": "de", "target": "en"}),
                  c.post("/translate", files={"q": (None, "Ein Hund\r\nbellt"), "source": (None, "de"),
                                              "target": (None, "en")})):
            assert r.status_code == 200, r.text
            assert r.json()["translatedText"] == "EIN HUND\nBELLT"  # form line ends are \n, as LibreTranslate
        # but only line ends: LibreTranslate's splitlines() made U+2028, form feeds and NEL \n, dropped a last line
        # end and changed <pre> and attribute values; JSON kept them, and so does form data now
        for q, html in (("Ein\u2028Hund\x0cbellt\x85ja\n", False),
                        ('<pre>x\u2028y\x0cz</pre><p title="a\u2028b">c</p>\n', True)):
            body = {"q": q, "source": "de", "target": "en", "format": "html" if html else "text"}
            form, json_ = c.post("/translate", data=body).json(), lt(c, **body)[1]
            assert form == json_ and form["translatedText"] == (parse_html(q).rebuild(
                [t.upper() for t in parse_html(q).sources]) if html else q.upper()), form
        # curl -d sends JSON with the form content type: still the native API
        r = c.post("/translate", content=b'{"text": ["ein hund"], "model": "de-en"}',
                   headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 200 and r.json() == {"translations": ["EIN HUND"]}


def test_auto_detects_each_text_and_routes_it_to_its_model():
    with client() as c:
        status, got = lt(c, q="Der Mann fährt mit dem Fahrrad durch die Stadt.", source="auto", target="en")
        assert status == 200, got
        assert got["detectedLanguage"]["language"] == "de" and 50 < got["detectedLanguage"]["confidence"] <= 100
        status, got = lt(c, q=["Ein kleines Mädchen spielt im Garten.", "A little girl plays in the garden."],
                         source="auto", target="en")
        # a text detected as the target language comes back unchanged, as LibreTranslate returns it
        assert status == 200 and got["translatedText"] == ["EIN KLEINES MÄDCHEN SPIELT IM GARTEN.",
                                                           "A little girl plays in the garden."], got
        assert [d["language"] for d in got["detectedLanguage"]] == ["de", "en"]
        status, got = lt(c, q=["Ein kleines Mädchen spielt im Garten."], source="auto", target="en")
        assert status == 200 and [d["language"] for d in got["detectedLanguage"]] == ["de"]


def test_detect_and_languages():
    with client() as c:
        r = c.post("/detect", data={"q": "A man is riding a bicycle down the street."})
        assert r.status_code == 200
        got = r.json()
        assert got[0]["language"] == "en" and got[0]["confidence"] > got[-1]["confidence"]
        assert {d["language"] for d in got} == {"en", "de"}
        assert c.get("/languages").json() == [{"code": "de", "name": "German", "targets": ["en"]},
                                              {"code": "en", "name": "English", "targets": ["de"]}]


def test_alternatives_are_the_n_best_and_scores_the_best_hypothesis():
    with client() as c:
        status, got = lt(c, q="Hund. Katze.", source="de", target="en", alternatives=2)
        assert status == 200, got
        assert got["translatedText"] == "HUND. KATZE."
        assert got["alternatives"] == [".DNUH .EZTAK", "HUND KATZE"]  # sentence by sentence, k-th best
        status, got = lt(c, q=["ja"], source="de", target="en", alternatives="1")
        assert got["alternatives"] == [["AJ"]]
        status, got = lt(c, q="ja", source="de", target="en", alternatives=4)
        assert status == 400 and '"alternatives" 4' in got["error"] and "limit of 3" in got["error"]


def test_html_gets_no_alternatives_and_its_usual_search():
    """LibreTranslate answers html without alternatives: "alternatives" widened the beam for nothing (another
    translation, alternatives [])."""
    with client() as c:
        model = c.app.state.server.models["de-en"].loaded  # the stand-in
        status, plain = lt(c, q="<p>Hund. Katze.</p>", source="de", target="en", format="html")
        asked = model.searches[-1]
        status, got = lt(c, q="<p>Hund. Katze.</p>", source="de", target="en", format="html", alternatives=2)
        assert status == 200 and got == {**plain, "alternatives": []}, got
        assert model.searches[-1] == asked == (1, 4)


HTML = ('<!DOCTYPE html><p class="x" title="Ein Hund">Ein <b>großer</b> Hund &amp; eine&nbsp;Katze.</p>'
        '<pre>kein hund</pre><code>x = 1</code><script>var s = "<p>hund</p>";</script>'
        '<style>p { color: red }</style><span translate="no">Hund</span><!-- ein Hund --><br/>')


def test_html_keeps_tags_attributes_entities_and_untranslated_elements():
    with client() as c:
        status, got = lt(c, q=HTML, source="de", target="en", format="html")
        assert status == 200, got
        assert got["translatedText"] == HTML.replace("Ein <b>", "EIN <b>").replace("großer", "GROSSER").replace(
            "Hund &amp; eine&nbsp;Katze.", "HUND &amp; EINE&nbsp;KATZE.")
        # the markup of the answer is the markup of the question
        markup = lambda doc: [p for i, p in enumerate(parse_html(doc).pieces) if i not in parse_html(doc).texts]
        assert markup(got["translatedText"]) == markup(HTML)
        status, got = lt(c, q="<p>unfinished <b", source="de", target="en", format="html")
        # the text before a tag that never ends is translated; the tag, to the end, copied
        assert status == 200 and got["translatedText"] == "<p>UNFINISHED <b"


@pytest.mark.parametrize("body, status, needle", [
    ({"source": "de", "target": "en"}, 400, "missing q"),
    ({"q": 3, "source": "de", "target": "en"}, 400, '"q" must be a string'),
    ({"q": ["a", 3], "source": "de", "target": "en"}, 400, '"q" must be a string'),
    ({"q": "a", "target": "en"}, 400, "missing source"),
    ({"q": "a", "source": "de"}, 400, "missing target"),
    ({"q": "a", "source": "de!", "target": "en"}, 400, '"source" must be a language code'),
    ({"q": "a", "source": "de", "target": ["en"]}, 400, '"target" must be a language code'),
    ({"q": "a", "source": "de", "target": "en", "format": "pdf"}, 400, '"format" must be'),
    ({"q": "a", "source": "de", "target": "en", "alternatives": "many"}, 400, '"alternatives" must be'),
    ({"q": "a", "source": "de", "target": "en", "alternatives": 1e9}, 400, '"alternatives" 1000000000 is above'),
    ({"q": "a", "source": "de", "target": "en", "alternatives": 1.5}, 400, '"alternatives" must be'),
    ({"q": "a", "source": "de", "target": "en", "alternatives": 1e300}, 400,
     '"alternatives" 10000000000000000525... is'),
    ({"q": "a", "source": "fr", "target": "en"}, 400, "it translates de-en, en-de"),
    ({"q": "\ud800", "source": "de", "target": "en"}, 400, "q holds a lone surrogate"),
    ({"q": ["a"] * 11, "source": "de", "target": "en"}, 413, "--max-lines"),
])
def test_refusals_name_the_field(body, status, needle, caplog):
    with caplog.at_level(logging.WARNING), client(max_lines=10) as c:
        got_status, got = lt(c, **body)
        assert got_status == status and needle in got["error"], got
    assert not [r for r in caplog.records if r.exc_info]  # no traceback logged


def test_malformed_bodies_are_400_on_both_apis(caplog):
    with caplog.at_level(logging.WARNING), client(max_bytes=2000) as c:
        for body, needle in [(b'{"q": "a", ', "not JSON"), (b"[" * 100_000 + b"]" * 100_000, None),
                             (b'{"q": ' + b"1" * 5000 + b"}", "cannot read"), (b"\xff\xfe", "UTF-8")]:
            r = c.post("/translate", content=body, headers={"content-type": "application/json"})
            assert r.status_code in (400, 413) and "error" in r.json(), r.text
            if needle and len(body) <= 2000:
                assert needle in r.json()["error"]
        r = c.post("/translate", content=b"q=%FF&source=de&target=en",
                   headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 400 and "UTF-8" in r.json()["error"]
        r = c.post("/translate", content=b"--nope", headers={"content-type": "multipart/form-data; boundary=x"})
        assert r.status_code == 400 and "form data" in r.json()["error"]
        r = c.post("/translate", json={"text": "not a list", "model": "de-en"})  # the native API
        assert r.status_code == 400 and '"text" must be a list' in r.json()["error"]
        # a native body missing "text" is told so in its words (it was LibreTranslate's "missing q parameter"),
        # and one of both APIs is refused as such (it was LibreTranslate's "missing source parameter")
        for body, said in (({"model": "de-en", "source": "de", "target": "en"}, '"text" must be a list'),
                           ({"model": "de-en", "format": "text", "nbest": 2}, '"text" must be a list'),
                           ({"text": ["x"], "model": "de-en", "q": "x"}, 'the body has both "q" (LibreTranslate'
                                                                         '\'s API) and "text" (the native API)'),
                           ({"source": "de", "target": "en"}, "missing q parameter"),
                           ({"source": "de", "target": "en", "glossary": {"hund": "dog"}}, "missing q parameter")):
            r = c.post("/translate", json=body)
            assert r.status_code == 400 and said in r.json()["error"], (body, r.text)
        for q in (5, [1]):  # a list of strings is taken: the refusal says so (it said "a string")
            r = c.post("/detect", json={"q": q})
            assert r.status_code == 400 and r.json()["error"] == '"q" must be a string or a list of strings'
        r = c.post("/translate", json={"q": "x" * 3000, "source": "de", "target": "en"})
        assert r.status_code == 413 and "--max-bytes" in r.json()["error"]
    assert not [r for r in caplog.records if r.exc_info]


def test_without_a_detector_only_detection_is_refused():
    with client(detector=False) as c:
        status, got = lt(c, q="Ein Hund", source="auto", target="en")
        assert status == 400 and '"source": "auto" needs language detection' in got["error"]
        assert lt(c, q="Ein Hund", source="de", target="en")[0] == 200
        r = c.post("/detect", json={"q": "Ein Hund"})
        assert r.status_code == 501 and "cannot detect" in r.json()["error"]


def test_api_keys_on_both_apis_with_a_rate(tmp_path, caplog):
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# key  requests per minute\n{KEY}\n\n{SLOW_KEY} 2\n")
    with caplog.at_level(logging.DEBUG), client(keys=keys) as c:
        body = {"q": "Ein Hund", "source": "de", "target": "en"}
        # --require-api-key: LibreTranslate's words and status for a missing key
        assert lt(c, **body) == (400, {"error": "Please contact the server operator to get an API key"})
        status, got = lt(c, **body, api_key="wrong-key-123")
        assert status == 403 and got["error"] == "Invalid API key"
        assert lt(c, **body, api_key=KEY) == (200, {"translatedText": "EIN HUND", "score": -0.5})
        assert c.post("/translate", data={**body, "api_key": KEY}).status_code == 200
        assert c.post("/detect", json={"q": "Ein Hund"}).status_code == 400
        assert c.post("/detect", json={"q": "Ein Hund", "api_key": KEY}).status_code == 200
        native = {"text": ["ein hund"], "model": "de-en"}
        r = c.post("/translate", json=native)
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        r = c.post("/translate", json=native, headers={"Authorization": "Bearer wrong-key-123"})
        assert r.status_code == 401 and 'error="invalid_token"' in r.headers["www-authenticate"]
        r = c.post("/translate", json=native, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json() == {"translations": ["EIN HUND"]}
        assert c.get("/info").status_code == 401
        for path in ("/health", "/metrics", "/languages"):  # open
            assert c.get(path).status_code == 200
        # the rate: 2 requests per minute for SLOW_KEY, over either API
        assert lt(c, **body, api_key=SLOW_KEY)[0] == 200
        r = c.post("/translate", json=native, headers={"Authorization": f"Bearer {SLOW_KEY}"})
        assert r.status_code == 200
        r = c.post("/translate", json={**body, "api_key": SLOW_KEY})
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 60 and "Slowdown" in r.json()["error"]
        r = c.post("/translate", json=native, headers={"Authorization": f"Bearer {SLOW_KEY}"})
        assert r.status_code == 429 and "retry-after" in r.headers
        assert lt(c, **body, api_key=KEY)[0] == 200  # one key's rate is its own
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert KEY not in logged and SLOW_KEY not in logged and "wrong-key-123" not in logged


def test_without_require_keyless_requests_are_served_at_the_keyless_rate(tmp_path):
    """LibreTranslate serves keyless requests at its default rate when keys are on: Open WebUI's filter and
    Weblate with an empty key keep working on a keyed server."""
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{KEY}\n")
    now = [1000.0]  # the rate's clock, moved by the test
    with client(keys=keys, require=False, keyless=2) as c:
        c.app.state.server.keys.clock = lambda: now[0]
        body = {"q": "Ein Hund", "source": "de", "target": "en"}
        assert lt(c, **body) == (200, {"translatedText": "EIN HUND", "score": -0.5})
        now[0] += 10
        assert c.post("/translate", json={"text": ["ein hund"], "model": "de-en"}).status_code == 200
        now[0] += 20
        r = c.post("/translate", json=body)  # the third keyless request of this client in a minute
        assert r.status_code == 429 and "without an API key may make 2 requests" in r.json()["error"]
        assert r.headers["retry-after"] == "30"  # the first one leaves the window 60 s after it came
        now[0] += 30
        assert lt(c, **body)[0] == 200  # and then one more is allowed
        now[0] += 1
        assert c.post("/translate", json=body).status_code == 429
        assert lt(c, **body, api_key=KEY)[0] == 200  # a key is not held by the keyless rate
        assert lt(c, **body, api_key="wrong-key-123") == (403, {"error": "Invalid API key"})
        settings = c.get("/frontend/settings").json()
        assert settings["apiKeys"] is True and settings["keyRequired"] is False


@pytest.mark.parametrize("content, needle", [
    ("", "holds no key"), ("short\n", "8 to 512 characters"), (f"{KEY} fast\n", "line 1"),
    (f"{KEY}\n{KEY}\n", "line 2: this key is in the file twice"),
    (f"{KEY} \u00b2\n", "line 1: write KEY or KEY REQUESTS_PER_MINUTE"),  # a digit int() refuses: was a traceback
    (f"{KEY} \uff13\n", "line 1: write KEY or KEY REQUESTS_PER_MINUTE"),  # a full-width 3: was taken as 3
])
def test_a_bad_keys_file_is_one_line_naming_the_line(tmp_path, content, needle):
    from model.errors import UserError
    path = tmp_path / "keys.txt"
    path.write_text(content)
    with pytest.raises(UserError, match=needle) as e:
        ApiKeys.read(str(path))
    assert KEY not in str(e.value)


def test_served_languages_come_from_the_manifest_else_the_name():
    from types import SimpleNamespace

    from pipeline.serve.languages import Routes, served_languages
    plain = SimpleNamespace()  # a manifest of today: no `languages`
    assert served_languages("de-en", plain) == served_languages("DE-En", plain) == (("de",), ("en",))
    assert served_languages("model", plain) == ((), ())
    many = SimpleNamespace(languages=SimpleNamespace(source=("de", "en", "fr"), target=("de", "en", "fr")))
    assert served_languages("m2m", many) == (("de", "en", "fr"), ("de", "en", "fr"))
    routes = Routes.of([("m2m", "M", ("de", "en", "fr"), ("de", "en", "fr")), ("de-en", "D", ("de",), ("en",))])
    assert len(routes.pairs()) == 6 and routes.model("de", "en") == "M"  # the first model given wins a pair
    assert routes.model("de", "de") is None and routes.model("de", "xx") is None
    assert routes.languages()[0] == {"code": "de", "name": "German", "targets": ["en", "fr"]}


class Failing(NBestStandIn):
    def translate(self, ids: list[list[int]], decoding: Any, **_: Any) -> list[Any]:  # type: ignore[override]
        raise RuntimeError("the backend fell over")


def test_a_backend_fault_is_a_503_to_retry_and_the_server_goes_on():
    with client() as c:
        c.app.state.server.models["de-en"].batcher.loaded = Failing()
        status, got = lt(c, q="Ein Hund", source="de", target="en")
        assert status == 503 and "retry later" in got["error"]
        assert lt(c, q="a dog", source="en", target="de") == (200, {"translatedText": "A DOG", "score": -0.5})
        assert c.get("/health").status_code == 200


def test_native_api_takes_a_one_pair_models_own_languages_only():
    """"source"/"target" on the native API: a model of one pair takes its own (and they set the sentence rules),
    others are a 400 naming the field and the model's languages."""
    with client(detector=False) as c:
        r = c.post("/translate", json={"text": ["Ein Hund. Er bellt."], "model": "de-en", "source": "de",
                                       "target": "en", "split": "sentences"})
        assert r.status_code == 200 and r.json()["translations"] == ["EIN HUND. ER BELLT."], r.text
        r = c.post("/translate", json={"text": ["x"], "model": "de-en", "source": "de", "target": "fr"})
        assert r.status_code == 400 and r.json()["error"] == '"target" \'fr\' is not a language of model de-en (en)'


def test_a_refused_text_is_named_as_the_request_names_it():
    """With --long-lines error, a text over the model's limit was named `text[k]` counting only the texts sent to
    a model (after those returned unchanged), or counting HTML text nodes over all texts, and a file's text as
    q's: the refusal now names q[k] (q alone for a string), a file's text by its place, an HTML text's node."""
    with client(detector=False) as c:
        for model in c.app.state.server.models.values():  # type: ignore[attr-defined]
            model.long_lines, model.loaded.backend.max_src_len = "error", 12
        long = "ein sehr langer satz"
        status, got = lt(c, q=["123", "", "kurz", long], source="de", target="en")
        assert status == 413 and got["error"].startswith("q[3] sentence:1: 21 tokens"), got
        status, got = lt(c, q=long, source="de", target="en")
        assert status == 413 and got["error"].startswith("q sentence:1:"), got
        status, got = lt(c, q=["<p>a</p>", f"<p>b</p><p>{long}</p>"], source="de", target="en", format="html")
        assert status == 413 and got["error"].startswith("q[1] text node 2 sentence:1:"), got
        r = c.post("/translate_file", files={"file": ("d.txt", f"123\n\nkurz\n{long}\n".encode())},
                   data={"source": "de", "target": "en"})
        assert r.status_code == 413 and r.json()["error"].startswith("\"file\" 'd.txt' text "), r.text
        r = c.post("/translate", json={"text": ["<p>a</p><p>b</p>", f"<p>{long}</p>"], "model": "de-en",
                                       "format": "html"})
        assert r.status_code == 413 and r.json()["error"].startswith("text[1] text node 1 sentence:1:"), r.text


def test_nul_is_refused_by_both_apis_as_serve_batch_refuses_it():
    """A NUL was translated by both APIs (and the Translator) where serve-batch refuses it: one rule now."""
    with client(detector=False) as c:
        status, got = lt(c, q=["gut", "a\x00b"], source="de", target="en")
        assert status == 400 and got["error"].startswith("q[1] holds a NUL character (U+0000"), got
        r = c.post("/translate", json={"text": ["a\x00b"], "model": "de-en"})
        assert r.status_code == 400 and r.json()["error"].startswith("text[0] holds a NUL character"), r.text
        r = c.post("/detect", json={"q": ["gut", "a\x00b"]})
        assert r.status_code == 400 and r.json()["error"].startswith("q[1] holds a NUL character (U+0000, "
                                                                     "character 1"), r.text
        r = c.post("/translate_file", files={"file": ("d.txt", b"gut\nhello\x00world\n")},
                   data={"source": "de", "target": "en"})
        assert r.status_code == 400 and r.json()["error"].startswith(
            "\"file\" 'd.txt': its text 2 ('hello\\x00world') holds a NUL character"), r.text  # (the text said, to
        # find it by: "text 2" counts the texts to translate, not the lines)


def test_html_of_character_references_alone_is_translated():
    """LibreTranslate's API looked for letters in the raw HTML: text written as character references
    ("&#117;") was returned untranslated, where the native API and serve-batch translate it."""
    with client(detector=False) as c:
        status, got = lt(c, q="&#117;&#32;&#112;", source="de", target="en", format="html")
        assert status == 200 and got["translatedText"] == "U&#32;P" and got["score"] is not None, got
        status, got = lt(c, q='<img alt="123"><b>42</b>', source="de", target="en", format="html")
        assert status == 200 and got["translatedText"] == '<img alt="123"><b>42</b>' and got["score"] is None


def test_multipart_form_data_cut_short_is_refused_not_read_in_part():
    """python-multipart drops an unfinished last part: a body without its closing --boundary-- was a 200 that
    translated one q of two, or HTML as plain text, or "missing target" for a target that was sent."""
    parts = [("q", "Ein Hund"), ("source", "de"), ("target", "en"), ("q", "bellt")]
    whole = b"".join(f'--XYZ\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode() for k, v in parts)
    kind = {"content-type": "multipart/form-data; boundary=XYZ"}
    with client() as c:
        r = c.post("/translate", content=whole + b"--XYZ--\r\n", headers=kind)
        assert r.status_code == 200 and r.json()["translatedText"] == ["EIN HUND", "BELLT"], r.text
        for cut in (whole, whole[:-2], whole + b"--XYZ"):
            r = c.post("/translate", content=cut, headers=kind)
            assert r.status_code == 400, r.text
            assert "ends before its closing boundary" in r.json()["error"]


def test_char_limit_characters_always_fit_in_the_body_limit():
    """charLimit was max_bytes // 12: a q of charLimit astral letters (12 bytes each as JSON escapes and as form
    data) left 4 bytes for the rest of the request, so a client splitting text by charLimit got 413."""
    with client(max_bytes=4096) as c:
        limit = c.get("/frontend/settings").json()["charLimit"]
        assert 0 < limit < 4096 // 12
        q = "\U0001d42e" * limit  # MATHEMATICAL BOLD SMALL U: a letter, 4 bytes in UTF-8, 12 escaped
        fields = {"q": q, "source": "de", "target": "en", "format": "text", "alternatives": 3, "api_key": "k" * 200}
        for r in (c.post("/translate", content=json.dumps(fields), headers={"content-type": "application/json"}),
                  c.post("/translate", data=fields)):
            assert r.status_code != 413, r.text

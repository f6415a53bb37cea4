"""The native API's fields as a client can get them wrong or mean them: a key it cannot encode, a field given
twice, line breaks of every kind in a document, HTML, languages on a model whose pair is unknown, which model a
refusal is counted under, a body with a byte order mark, and /spec describing the API. Over test_serve_hostile's
stand-in model (the real app, its text service and batcher; the search copies and upper-cases)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
pytest.importorskip("sentencex")

from test_serve_hostile import client  # noqa: E402


def test_a_key_the_answer_cannot_hold_is_a_400_quoted_short():
    """An unknown key holding a lone surrogate was a 503 "retry later" with a traceback (the refusal quoted it
    and could not be encoded); a long one came back whole."""
    with client() as c:
        r = c.post("/translate", content=b'{"text": ["kipi"], "\\ud800": 1}',
                   headers={"content-type": "application/json"})
        assert r.status_code == 400 and "unknown field(s) '\\ud800'" in r.json()["error"]
        r = c.post("/translate", json={"text": ["kipi"], "k" * 100_000: 1})
        assert r.status_code == 400 and len(r.text) < 400 and "'kkkkkkkkkkkkkkkkkkkk'..." in r.json()["error"]
        r = c.post("/translate", json={"text": ["kipi"], "model": "x" * 100_000})
        assert r.status_code == 404 and len(r.text) < 300


def test_a_field_given_twice_is_refused_not_the_last_taken():
    with client() as c:
        r = c.post("/translate", content=b'{"text": ["a"], "text": ["der hund"]}',
                   headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"] == "field(s) 'text' given more than once; send each once"
        r = c.post("/translate", content=b'{"text": ["a"], "beam_size": 2, "beam_size": 3}',
                   headers={"content-type": "application/json"})
        assert r.status_code == 400 and "'beam_size' given more than once" in r.json()["error"]


def test_a_stream_says_its_charset():
    """application/x-ndjson without a charset: requests guessed iso8859_10 for some answers ("MÃžller")."""
    with client() as c:
        r = c.post("/translate", json={"text": ["müller kam"], "stream": True})
        assert r.headers["content-type"] == "application/x-ndjson; charset=utf-8"
        assert r.text == '{"index": 0, "translation": "MÜLLER KAM"}\n'


def test_info_for_a_model_named_twice_is_refused_not_the_last_taken():
    with client() as c:
        [name] = c.get("/info").json()["models"]
        assert c.get("/info", params={"model": name}).json()["model"] == name
        r = c.get("/info", params=[("model", "other"), ("model", name)])
        assert r.status_code == 400 and r.json()["error"].startswith('"model" given more than once'), r.text
        r = c.get("/info", params={"model": "x" * 60_000})  # not echoed whole
        assert r.status_code == 404 and len(r.text) < 300, len(r.text)


@pytest.mark.parametrize("sep", ["\r", "\r\n", "\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1e"])
def test_every_line_break_separates_sentences(sep):
    """A document with a lone CR (classic Mac), U+2028 (JavaScript, Word) or NEL between its lines was one sentence:
    the model merged the two lines. Each kind of line break now separates, and is kept."""
    text = f"der hund{sep}die katze"
    with client() as c:
        objects = [json.loads(line) for line in c.post("/translate", json={
            "text": [text], "split": "sentences", "stream": True}).text.splitlines() if line.startswith("{")]
        assert [o["sentence"] for o in objects] == [0, 1]
        assert "".join(o["translation"] for o in objects) == f"DER HUND{sep}DIE KATZE"
        r = c.post("/translate", json={"text": [text], "split": "sentences"})
        assert r.json() == {"translations": [f"DER HUND{sep}DIE KATZE"]}


def test_html_over_the_native_api_as_over_libretranslates():
    """"format": "html" (serve-batch --format html's twin): the markup kept, each text node translated, streamed
    or not; a model without a recorded pair could not translate HTML over HTTP at all (only "q" took it)."""
    docs = ["<p>der <b>hund</b> &amp; die katze</p>", "<ul><li>ja</li>\n<li>nein</li></ul>", "", "<br>"]
    want = ["<p>DER <b>HUND</b> &amp; DIE KATZE</p>", "<ul><li>JA</li>\n<li>NEIN</li></ul>", "", "<br>"]
    with client() as c:
        assert c.post("/translate", json={"text": docs, "format": "html"}).json() == {"translations": want}
        lines = c.post("/translate", json={"text": docs, "format": "html", "stream": True}).text.splitlines()
        assert [json.loads(line) for line in lines] == [{"index": i, "translation": t} for i, t in enumerate(want)]
        r = c.post("/translate", json={"text": docs, "format": "html", "nbest": 1, "scores": True})
        assert r.status_code == 400 and r.json()["error"].startswith('"format": "html" gives one translation per text')
        r = c.post("/translate", json={"text": docs, "format": "xml"})
        assert r.status_code == 400 and r.json()["error"] == '"format" must be one of "text", "html", not \'xml\''


def test_a_server_started_with_nbest_answers_documents_and_keeps_one_shape():
    """`pipeline serve --nbest 2` refused every split or HTML request, blaming "nbest" that the client never sent;
    "beam_size": 1 turned its answers from hypotheses into strings; an empty line had no hypothesis at all."""
    hyps = [{"hypotheses": [{"text": "JA", "score": -1.0}]}, {"hypotheses": [{"text": "", "score": 0.0}]}]
    with client(nbest=2) as c:
        assert c.post("/translate", json={"text": ["ja", ""]}).json() == {"translations": hyps}
        assert c.post("/translate", json={"text": ["ja", ""], "beam_size": 1}).json() == {"translations": hyps}
        r = c.post("/translate", json={"text": ["ja. nein.", ""], "split": "sentences"})
        assert r.json() == {"translations": ["JA. NEIN.", ""]}
        assert c.post("/translate", json={"text": ["<b>ja</b>"], "format": "html"}).json() == {
            "translations": ["<b>JA</b>"]}
        r = c.post("/translate", json={"text": ["ja"], "split": "sentences", "nbest": 2})  # asked for: refused
        assert r.status_code == 400 and r.json()["error"].startswith('"split": "sentences" gives one translation')
        r = c.post("/translate", json={"text": ["ja"], "beam_size": 0})
        assert r.status_code == 400 and "beam_size" in r.json()["error"] and "nbest" not in r.json()["error"]


def test_a_huge_number_is_not_echoed_whole_in_its_refusal():
    """"beam_size" of 4,000 digits came back in a 4 KB error repeating every digit (as did "nbest")."""
    huge = "9" * 4000
    with client() as c:
        for field, said in (("beam_size", "beam_size 99999999999999999999... (4000 characters) is above"),
                            ("nbest", "nbest must be between 1 and the beam width")):
            r = c.post("/translate", content=f'{{"text": ["ja"], "{field}": {huge}}}'.encode(),
                       headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and said in r.json()["error"] and len(r.content) < 300, r.text


def test_a_trailing_slash_is_a_json_404_not_a_redirect_to_plain_http():
    with client() as c:
        r = c.post("/translate/", json={"text": ["ja"]}, follow_redirects=False)
        assert r.status_code == 404 and r.json()["error"].startswith("no route POST /translate/")


def test_languages_on_a_model_whose_pair_is_unknown_must_look_like_codes():
    with client() as c:
        assert c.post("/translate", json={"text": ["ja"], "source": "xx", "target": "yy"}).status_code == 200
        r = c.post("/translate", content=b'{"text": ["ja"], "source": "\\ud800"}',
                   headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert r.json()["error"] == "\"source\" must be a language code like \"de\", not '\\ud800'"


def test_a_refused_request_is_counted_under_its_model():
    """A 400 of the server's only model (or the one named) was counted under model="", so per-model dashboards
    missed it."""
    with client() as c:
        assert c.post("/translate", json={"text": ["ja"], "beam_size": 99}).status_code == 400
        assert c.post("/translate", json={"text": ["ja"], "model": "m", "nbest": 0}).status_code == 400
        metrics = c.get("/metrics").text
        assert 'pipeline_requests_total{code="400",model="m"} 2.0' in metrics
        assert 'model=""' not in metrics  # nor any series of no model that never moved (they were all listed)


def test_a_body_with_a_byte_order_mark_is_read():
    with client() as c:
        r = c.post("/translate", content=b'\xef\xbb\xbf{"text": ["ja"]}', headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json() == {"translations": ["JA"]}


def test_the_spec_describes_both_apis_and_the_docs_page_lists_both():
    with client() as c:
        body = c.get("/spec").json()["paths"]["/translate"]["post"]["requestBody"]["content"]
        libre, native = body["application/json"]["schema"]["oneOf"]
        assert {"q", "source", "target", "format", "alternatives", "api_key", "glossary"} == set(libre["properties"])
        assert {"text", "model", "source", "target", "split", "lang", "format", "beam_size", "nbest", "scores",
                "stream", "glossary"} == set(native["properties"]) and native["required"] == ["text"]
        assert body["application/x-www-form-urlencoded"]["schema"]["properties"] == libre["properties"]
        assert "body.oneOf || [body]" in c.get("/docs").text
        assert c.get("/favicon.ico").status_code == 204  # every browser asks: no 404 in the page's console


def test_fields_in_the_query_string_of_a_json_request_are_refused_not_ignored():
    """`POST /translate?nbest=2&stream=true` with a JSON body was answered as if the query string were not there
    (one hypothesis, no stream); on a server of two models `?model=x` was "model is required"."""
    with client() as c:
        r = c.post("/translate?nbest=2&stream=true", json={"text": ["kipi"]})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == ("the native API reads its fields from the JSON body, not the query string "
                                     "('nbest', 'stream'); send them in the body")
        assert c.post("/translate", json={"text": ["kipi"], "nbest": 2}).status_code == 200
        r = c.post("/translate?q=kipi&source=de&target=en")  # LibreTranslate's query-string request: still read
        assert '"source" de to "target" en is not a language pair' in r.json()["error"], r.text  # (no pair here)

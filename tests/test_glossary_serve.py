"""Glossaries on `pipeline serve`, in process (starlette's TestClient) over the trained tiny model served as
de-en on ONNX Runtime: a named glossary (--glossary NAME=FILE) and an inline one, on the native API (whole
answers and streams) and LibreTranslate's (JSON, form data, /translate_file); the forced target is in the
translation (and without the glossary it is not), each answer lists its texts' terms, a text without terms is
answered exactly as without a glossary, and every refusal is a 400 naming the field, the entry or the limit;
--glossary's refusals are one start-up line."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_one_line_error, run_cli_captured

pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")
pytest.importorskip("sentencex")

from starlette.testclient import TestClient  # noqa: E402

from pipeline.serve.app import create_app  # noqa: E402
from pipeline.serve.batcher import _constraints  # noqa: E402
from pipeline.serve.glossaries import check_named, info, read_named  # noqa: E402
from pipeline.serve.metrics import Metrics  # noqa: E402
from pipeline.serve.options import RequestLimits, ServeHttpOptions  # noqa: E402
from pipeline.serve.runner import load_model  # noqa: E402
from pipeline.serve.state import ServerState  # noqa: E402
from runtime.decoding import PAPER  # noqa: E402
from runtime.glossary_file import MAX_REQUEST_TERMS  # noqa: E402
from runtime.model_dir import LoadOptions  # noqa: E402

GLOSSARY = "hund\ttree\nkatze\t\n"  # "hund" as "tree" (never its translation), "katze" kept as it is
TEXTS = ["der hund sieht die katze", "die frau hat ein kind", "", "ein hund"]  # the second: no term
HUND = {"source": "hund", "target": "tree", "applied": True, "constrained": True}


@pytest.fixture(scope="module")
def glossary_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("glossary") / "terms.tsv"
    path.write_text(GLOSSARY, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def state(trained_model_dir, glossary_file) -> ServerState:
    """The app's state as `pipeline serve de-en=DIR --glossary terms=terms.tsv --max-wait-ms 50` builds it."""
    metrics, limits = Metrics(), RequestLimits(max_wait_ms=50)
    opts = ServeHttpOptions(load=LoadOptions(backend="onnxruntime", threads=1))
    model = load_model("de-en", str(trained_model_dir), opts, PAPER.replace(batch_tokens=limits.max_batch_tokens),
                       metrics)
    glossaries = check_named(read_named((f"terms={glossary_file}",)), {"de-en": model.loaded})
    return ServerState({"de-en": model}, limits, {"glossaries": info(glossaries)}, metrics, warmed_up=True,
                       glossaries=glossaries)


@pytest.fixture(scope="module")
def client(state) -> Iterator[TestClient]:
    with TestClient(create_app(state)) as c:
        yield c


def native(c: TestClient, **body: Any) -> Any:
    r = c.post("/translate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def plain(client) -> list[str]:
    got = native(client, text=TEXTS)
    assert "terms" not in got
    assert not any(re.search(r"\btree\b", t) for t in got["translations"]), got  # never chosen by the model
    return got["translations"]


def test_a_named_glossary_forces_its_terms_and_lists_them(client, plain):
    got = native(client, text=TEXTS, glossary="terms")
    out, terms = got["translations"], got["terms"]
    assert re.search(r"\btree\b", out[0]) and re.search(r"\bkatze\b", out[0]), out
    assert out[1:3] == plain[1:3]  # no term: answered exactly as without the glossary
    assert re.search(r"\btree\b", out[3])
    assert terms[0] == [HUND, {"source": "katze", "target": "katze", "applied": True, "constrained": True}]
    assert terms[1:] == [[], [], [HUND]]


def test_an_inline_glossary_is_the_same_as_the_named_one(client):
    named = native(client, text=TEXTS, glossary="terms")
    assert native(client, text=TEXTS, glossary={"hund": "tree", "katze": ""}) == named
    assert native(client, text=TEXTS, glossary={}) == {"translations": native(client, text=TEXTS)["translations"],
                                                       "terms": [[], [], [], []]}


def test_a_glossary_that_matches_nothing_changes_nothing(client, plain):
    got = native(client, text=TEXTS[1:3], glossary={"auto": "car"})
    assert got == {"translations": plain[1:3], "terms": [[], []]}
    raw = client.post("/translate", json={"text": TEXTS[1:3]}).content
    assert raw == json.dumps({"translations": plain[1:3]}, ensure_ascii=False, separators=(",", ":")).encode()


def test_documents_and_streams_carry_their_terms(client):
    doc = "der hund sieht.\n die frau hat ein kind."  # two sentences (a line break always separates)
    got = native(client, text=[doc], split="sentences", glossary="terms")
    assert re.search(r"\btree\b", got["translations"][0]) and got["terms"] == [[HUND]]
    lines = [json.loads(line) for line in client.post("/translate", json={
        "text": TEXTS, "glossary": "terms", "stream": True}).text.splitlines()]
    assert [o["translation"] for o in lines] == native(client, text=TEXTS, glossary="terms")["translations"]
    assert [o["terms"] for o in lines] == native(client, text=TEXTS, glossary="terms")["terms"]
    sentences = [json.loads(line) for line in client.post("/translate", json={
        "text": [doc, ""], "split": "sentences", "glossary": "terms", "stream": True}).text.splitlines()]
    assert [o["terms"] for o in sentences] == [[HUND], [], []]
    assert "".join(o["translation"] for o in sentences[:2]) == got["translations"][0]
    plain_stream = client.post("/translate", json={"text": TEXTS, "stream": True}).text
    assert "terms" not in plain_stream


def test_libretranslate_json_and_form_data(client):
    def lt(**body: Any) -> Any:
        r = client.post("/translate", json={"source": "de", "target": "en", **body})
        assert r.status_code == 200, r.text
        return r.json()

    without = lt(q="der hund sieht")
    assert "terms" not in without and "tree" not in without["translatedText"]
    one = lt(q="der hund sieht", glossary="terms")
    assert re.search(r"\btree\b", one["translatedText"]) and one["terms"] == [HUND]
    many = lt(q=["der hund sieht", "die frau hat ein kind", "123"], glossary={"hund": "tree"})
    assert re.search(r"\btree\b", many["translatedText"][0]) and many["terms"] == [[HUND], [], []]
    assert many["translatedText"][1:] == lt(q=["die frau hat ein kind", "123"])["translatedText"]
    for glossary in ("terms", json.dumps({"hund": "tree"})):  # a name, or the object as a JSON string
        for r in (client.post("/translate", data={"q": "der hund sieht", "source": "de", "target": "en",
                                                  "glossary": glossary}),
                  client.post("/translate", files={"q": (None, "der hund sieht"), "source": (None, "de"),
                                                   "target": (None, "en"), "glossary": (None, glossary)})):
            assert r.status_code == 200, r.text
            assert r.json()["translatedText"] == one["translatedText"] and r.json()["terms"] == [HUND]
    # a repeated "glossary" field kept the first and dropped the others' terms in silence
    r = client.post("/translate", data={"q": "der hund sieht", "source": "de", "target": "en",
                                        "glossary": ["terms", json.dumps({"sieht": "tree"})]})
    assert r.status_code == 400 and r.json()["error"] == ('the form gives "glossary" more than once; send one '
                                                          "glossary holding every term")
    r = client.post("/translate?glossary=terms", data={"q": "der hund sieht", "source": "de", "target": "en",
                                                       "glossary": json.dumps({"sieht": "tree"})})
    assert r.status_code == 400 and r.json()["error"] == ('the form and the query string both give "glossary"; send '
                                                          "one glossary holding every term")


def test_translate_file_takes_a_glossary(client):
    def send(**fields: str) -> str:
        r = client.post("/translate_file", data={"source": "de", "target": "en", **fields},
                        files={"file": ("a.txt", b"der hund sieht\n", "text/plain")})
        assert r.status_code == 200, r.text
        return client.get(r.json()["translatedFileUrl"].split("testserver")[1]).text

    assert "tree" not in send() and re.search(r"\btree\b", send(glossary="terms"))


@pytest.mark.parametrize("glossary, status, needles", [
    ("legal", 400, ['"glossary" \'legal\'', "terms"]),  # unknown name: the known ones listed
    ({"hund": 3}, 400, ["glossary['hund']", "target term must be a string"]),
    ({"hund": "tree", "Hund": "car"}, 400, ["glossary['Hund']", "conflicts"]),
    ({"hund": "\u0416\u0417"}, 400, ["glossary['hund']: 'hund' -> '\u0416\u0417'", "cannot spell"]),  # model can't
    ({f"w{i}": "tree" for i in range(MAX_REQUEST_TERMS + 1)}, 400, [f"MAX_REQUEST_TERMS ({MAX_REQUEST_TERMS})"]),
    (["hund", "tree"], 400, ['"glossary" must be', "list"]),
    ("{not json", 400, ['"glossary"', "JSON"]),
])
def test_bad_glossaries_are_400_naming_the_field_and_the_entry(client, glossary, status, needles):
    for body in ({"text": ["der hund"], "glossary": glossary},
                 {"q": "der hund", "source": "de", "target": "en", "glossary": glossary}):
        r = client.post("/translate", json=body)
        assert r.status_code == status, r.text
        for needle in needles:
            assert needle in r.json()["error"], r.json()


def test_info_lists_the_servers_glossaries(client):
    assert client.get("/info").json()["glossaries"] == {"terms": {"entries": 2}}


def test_requests_with_and_without_a_glossary_share_a_batch(state, client, plain):
    """The batcher hands the search each line's constraints aligned with its ids, [] for a line of a request
    without a glossary; that request is answered exactly as alone."""
    loaded = state.models["de-en"].loaded
    calls: list[Any] = []
    original = loaded.translate

    def recording(ids: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append((len(ids), kwargs.get("constraints")))
        return original(ids, *args, **kwargs)

    loaded.translate = recording  # type: ignore[method-assign]
    try:
        answers: dict[str, Any] = {}
        barrier = threading.Barrier(2)

        def send(name: str, body: dict[str, Any]) -> None:
            barrier.wait()
            answers[name] = client.post("/translate", json=body).json()

        threads = [threading.Thread(target=send, args=("plain", {"text": TEXTS})),
                   threading.Thread(target=send, args=("forced", {"text": TEXTS, "glossary": "terms"}))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        del loaded.translate
    assert answers["plain"] == {"translations": plain}
    assert answers["forced"] == native(client, text=TEXTS, glossary="terms")
    shared = [c for n, c in calls if n == 2 * len(TEXTS)]
    if shared:  # both requests in one batch (they usually are, within --max-wait-ms 50)
        constraints = shared[0]
        assert constraints is not None and sum(1 for c in constraints if c) == 2
        assert sum(1 for c in constraints if not c) == len(TEXTS) + 2


def test_a_line_with_terms_costs_the_constrained_searchs_wider_beam(state):
    """The dynamic batch budget counts what translate_ids will search: a line with a glossary's terms at the
    constrained beam (twice the asked-for one here), a line without at the asked-for beam."""
    import asyncio

    from pipeline.serve.batcher import Batcher

    loaded = state.models["de-en"].loaded

    async def costs() -> list[int]:
        batcher = Batcher(loaded, Metrics().model("de-en"), 1 << 20, 60.0, 8)  # waits: nothing runs
        await batcher.start()
        try:
            work = batcher.submit([[5, 6, 2], [7, 2]], PAPER.replace(beam_size=2), constraints=[[[9]], []])
            batcher.drop(work)
            return [work.cost(0), work.cost(1)]
        finally:
            await batcher.stop()

    assert loaded.backend.topk >= 8  # room for the doubled beam: 2 x 4 candidates a row
    assert asyncio.run(costs()) == [3 * 4, 2 * 2]


def test_the_batchs_constraints_are_aligned_with_its_lines():
    class W:
        def __init__(self, constraints: Any) -> None:
            self.constraints = constraints

    a, b = W(None), W([[[5]], [], [[6, 7]]])
    assert _constraints([(a, 0, 2)]) is None
    assert _constraints([(a, 1, 3), (b, 1, 3)]) == [[], [], [], [[6, 7]]]  # type: ignore[list-item]


def test_bad_glossary_options_are_one_start_up_line(capsys, trained_model_dir, tmp_path, glossary_file):
    bad = tmp_path / "bad.tsv"
    bad.write_text("hund\ttree\nHund\tcar\n", encoding="utf-8")
    unspellable = tmp_path / "unspellable.tsv"
    unspellable.write_text("hund\t\u0416\u0417\n", encoding="utf-8")
    for args, needles in [
        (["--glossary", f"legal={bad}"], ["--glossary legal", "bad.tsv:2"]),
        (["--glossary", f"legal={tmp_path / 'missing.tsv'}"], ["--glossary legal", "missing.tsv"]),
        (["--glossary", f"1x={glossary_file}"], ["--glossary '1x=", "NAME=FILE"]),
        (["--glossary", str(glossary_file)], ["NAME=FILE"]),
        (["--glossary", f"a={glossary_file}", "--glossary", f"a={glossary_file}"], ["--glossary a", "twice"]),
        (["--glossary", f"odd={unspellable}"], ["--glossary odd", "unspellable.tsv", "model", "\u0416"]),
    ]:
        code, _, err = run_cli_captured(capsys, "serve", trained_model_dir, "--backend", "onnxruntime",
                                        "--port", "0", *args)
        assert_one_line_error(code, err, *needles)


def test_the_cli_serves_its_glossaries(trained_model_dir, glossary_file, tmp_path):
    """`pipeline serve --glossary terms=FILE` as a user runs it: /info lists it, a request names it."""
    from test_server import server

    httpx = pytest.importorskip("httpx")
    with server(trained_model_dir, tmp_path / "log.txt", "--model", "de-en=" + str(trained_model_dir),
                "--glossary", f"terms={glossary_file}") as (_, url):
        assert httpx.get(f"{url}/info", timeout=10).json()["glossaries"] == {"terms": {"entries": 2}}
        got = httpx.post(f"{url}/translate", json={"text": ["ein hund"], "model": "de-en", "glossary": "terms"},
                         timeout=60).json()
        assert re.search(r"\btree\b", got["translations"][0]) and got["terms"] == [[HUND]], got
    assert "glossaries: terms (2 entries)" in (tmp_path / "log.txt").read_text()


@pytest.mark.parametrize("raw, needles", [
    ('{"hund": "tr\\ud800"}', ["glossary['hund']", "U+D800"]),  # was a 503 "retry later" and a traceback
    ('{"hund": "tree", "hund": "car"}', ["glossary['hund']", "given twice"]),  # the last one won, in silence
    ('"{\\"hund\\": \\"tree\\", \\"hund\\": \\"car\\"}"', ["glossary['hund']", "given twice"]),  # a JSON string
])
def test_an_inline_glossary_that_would_lose_or_break_a_term_is_a_400(client, raw, needles):
    for head in ('"text": ["der hund"]', '"q": "der hund", "source": "de", "target": "en"'):
        body = "{" + head + ', "glossary": ' + raw + "}"
        r = client.post("/translate", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and all(n in r.json()["error"] for n in needles), r.text


def test_libretranslate_checks_a_glossary_when_no_text_reaches_a_model(client):
    """Numbers alone are returned unchanged; the glossary the model cannot spell was answered 200 then."""
    r = client.post("/translate", json={"q": ["123"], "source": "de", "target": "en",
                                        "glossary": {"hund": "\u0416\u0417"}})
    assert r.status_code == 400 and "cannot spell" in r.json()["error"]


def test_a_text_without_letters_gets_its_terms_target_on_both_apis(client):
    """A text or sentence without letters is returned unchanged (a model invents words for numbers), even when
    the request's glossary gave it a target: "2024" -> "tree" held for a whole line only, and the answer listed
    no term. Without a term, such a text is still returned as it came."""
    for body in ({"text": ["2024", "der hund. 2024"], "split": "sentences"},
                 {"q": ["2024", "der hund. 2024"], "source": "de", "target": "en"}):
        r = client.post("/translate", json={**body, "glossary": {"2024": "tree"}})
        assert r.status_code == 200, r.text
        got = r.json()
        out = got.get("translations") or got["translatedText"]
        assert all(re.search(r"\btree\b", t) for t in out), out
        assert got["terms"][0] == [{"source": "2024", "target": "tree", "applied": True, "constrained": True}]
        r = client.post("/translate", json={**body, "glossary": {"hund": "tree"}})
        assert (r.json().get("translations") or r.json()["translatedText"])[0] == "2024"

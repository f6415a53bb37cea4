"""LibreTranslate's API, as its documentation and server define it, beside the native one: POST /translate
(a body with "q"), GET /languages, POST /detect. Clients configured with this server's base URL (Mastodon,
Weblate, libretranslatepy, ...) work unchanged.

A request is JSON or form data (urlencoded or multipart); errors are {"error": "..."} naming the field: 400
fix the request, 403 an API key is missing or wrong, 413 too large, 429 over the key's rate (Retry-After),
503 retry later. Every text is translated as a document (split into sentences, its whitespace kept) through
the same service as the native API's (service.py); "format": "html" keeps the markup (markup.py). Each
translation carries "score" (clients ignore it): its hypotheses' beam score, a length-normalised
log-probability, not a quality guarantee."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from pipeline.serve.access import ADMISSION, KeyRefused, RateLimited, note, settle
from pipeline.serve.detect import TOP
from pipeline.serve.glossaries import for_model, requested, text_terms
from pipeline.serve.http import (
    ApiError,
    CountedDisconnect,
    bearer,
    error,
    failed,
    off_loop,
    query_fields,
    read_payload,
    refuse_repeated,
    shown,
    too_many,
)
from pipeline.serve.languages import language_name, preferred
from pipeline.serve.metrics import ModelMetrics
from pipeline.serve.service import TranslateRequest, translated
from pipeline.serve.state import ServedModel, ServerState
from runtime.glossary import Glossary
from runtime.languages import LANG_CODE
from runtime.markup import parse_html
from runtime.sentences import has_letters
from runtime.texts import EncodedTexts, finish_texts, has_fixed_term
from runtime.translate import NBest, not_text

KEYS = frozenset({"q", "source", "target", "format", "alternatives", "api_key"})
WHOLE = re.compile(r"-?[0-9]{1,9}")


def speaks_libre(data: Any, native: frozenset[str]) -> bool:
    """A JSON body for LibreTranslate's /translate: it has "q", or LibreTranslate's fields and none that only the
    `native` API has ("text", "model", "nbest"...: a native request missing its "text" is told so in its API's
    words). "q" and "text" together are a 400."""
    if not isinstance(data, dict):
        return False
    if "q" in data and "text" in data:
        raise ApiError(400, 'the body has both "q" (LibreTranslate\'s API) and "text" (the native API): send one')
    return "q" in data or (not (native - KEYS - {"glossary"}) & set(data) and bool(KEYS & set(data)))


def check_key(state: ServerState, given: Any, request: Request) -> None:
    """With --api-keys: 403 without a valid key (the request's "api_key": JSON, form or query string, as
    LibreTranslate reads it; or Authorization: Bearer), 429 over its rate."""
    if state.keys is None:
        return
    if given is None or given == "":  # 0, false or [] are a wrong type, never "no key"
        given = query_fields(request, state.limits).get("api_key") or \
            bearer(request.headers.get("authorization", ""))
    if given is not None and not isinstance(given, str):
        raise ApiError(400, '"api_key" must be a string')
    try:
        admitted = request.scope[ADMISSION] = state.keys.check(given, request.client.host if request.client else "")
        note(request, key=admitted.label)
    except KeyRefused as e:  # LibreTranslate's words and statuses: clients show them
        raise ApiError(403, "Invalid API key") if str(e) == "invalid" else \
            ApiError(400, "Please contact the server operator to get an API key") from None
    except RateLimited as e:
        note(request, key=e.label)  # the access log says whose rate it is
        raise ApiError(429, f"Slowdown: {e}", {"Retry-After": str(e.retry_after_s)}) from None


@dataclass
class LibreRequest:
    q: list[str]
    batch: bool  # q was a list: so is every field of the answer
    source: str  # a code or "auto"
    target: str
    html: bool
    alternatives: int
    glossary: Glossary | None = None  # an extension: "glossary" as the native API's; the answer gains "terms"
    file: str | None = None  # /translate_file's: the texts are this file's, named as its (text 4), not q's
    soft_breaks: bool = False  # the file's texts are markup's: a line break in one is a space (Document's)

    def name(self, i: int) -> str:
        """Text i as a refusal names it: q[i] (q alone when it is no list), or the file's text i + 1."""
        return f"{self.file!r} text {i + 1}" if self.file is not None else _name(i, self.batch)


def _code(data: dict[str, Any], key: str, state: ServerState) -> str:
    value = data.get(key)
    if value is None or value == "":
        raise ApiError(400, f"Invalid request: missing {key} parameter")
    if isinstance(value, str) and value.lower() == "auto" and key == "source":
        return "auto"
    if not isinstance(value, str) or not LANG_CODE.fullmatch(value):
        raise ApiError(400, f'"{key}" must be a language code like "de"' + (' or "auto"' if key == "source" else "")
                       + f", not {str(value)[:20]!r}")
    return state.routes.spelled(value)  # in any case, as LibreTranslate takes it; as the model lists it (eng_Latn)


def _name(i: int, batch: bool) -> str:
    """Text i as the request lists it: q[i] when q is a list, else q."""
    return f"q[{i}]" if batch else "q"


def parse_libre(data: Any, form: bool, state: ServerState) -> LibreRequest:
    """LibreTranslate's fields checked (400 / 413 naming the field); unknown fields are ignored, as there."""
    if not isinstance(data, dict):
        raise ApiError(400, 'request body must be a JSON object like {"q": "text", "source": "en", "target": "de"}')
    refuse_repeated(data, KEYS | {"glossary"})
    q = data.get("q")
    if q is None or q == "" or q == []:
        raise ApiError(400, "Invalid request: missing q parameter")
    batch = isinstance(q, list)
    texts = q if batch else [q]
    if not all(isinstance(t, str) for t in texts):
        raise ApiError(400, '"q" must be a string or a list of strings')
    if len(texts) > state.limits.max_lines:
        raise ApiError(413, too_many(len(texts), "texts in q", state.limits.max_lines, "--max-lines"))
    for i, text in enumerate(texts):
        if why := not_text(text):
            raise ApiError(400, f"{_name(i, batch)} holds {why}")
    if form:  # form data's line ends are CRLF (RFC 2046): \n, as LibreTranslate makes them; its splitlines() also
        # made U+2028, form feeds and NEL line ends and dropped a last one (in <pre>, in attributes): not here
        texts = [t.replace("\r\n", "\n").replace("\r", "\n") for t in texts]
    source, target = _code(data, "source", state), _code(data, "target", state)
    kind = data.get("format")
    kind = "text" if kind is None or kind == "" else kind
    if kind not in ("text", "html"):
        raise ApiError(400, f'"format" must be "text" or "html", not {str(kind)[:20]!r}')
    n = data.get("alternatives", 0)
    if isinstance(n, str) and WHOLE.fullmatch(n.strip()):  # ASCII digits only: int("²") raises
        n = int(n)
    elif isinstance(n, float) and n.is_integer():  # JSON's 2.0: LibreTranslate takes int() of it
        n = int(n)
    if not isinstance(n, int) or isinstance(n, bool):
        raise ApiError(400, f'"alternatives" must be a whole number, not {str(n)[:20]!r}')
    n = max(0, n)  # as LibreTranslate: a negative count asks for none
    most = max(model.max_beam for model in state.models.values()) - 1
    if n > most:  # checked whatever the texts are (those returned unchanged too), not only once one reaches a model
        said = str(n) if n < 10 ** 20 else f"{str(n)[:20]}..."  # 1e300 as a whole number: 301 digits
        raise ApiError(400, f'"alternatives" {said} is above this server\'s limit of {most}')
    glossary = requested(data.get("glossary"), state.glossaries)
    return LibreRequest(texts, batch, source, target, kind == "html", n, glossary)


@dataclass
class _Group:
    """The texts (their places in q) one model translates from one language, and its request of them."""

    model: ServedModel
    source: str
    places: list[int]
    request: TranslateRequest | None = None


def _detect(state: ServerState, req: LibreRequest) -> list[dict[str, Any]]:
    """Each text's most likely language among the served ones (CPU work: off the event loop). A target no model
    translates into is refused first, as LibreTranslate does: detection would be blamed for it."""
    if req.target not in state.routes.targets:
        raise ApiError(400, f'"target" {req.target} is not a language this server translates into; it translates '
                            f"{state.routes.listed()}")
    detector = state.detector
    if detector is None:
        raise ApiError(400, f'"source": "auto" needs language detection: {state.no_detector}; name the source '
                            'language')
    def usable(code: str) -> bool:  # of a language's codes (en, eng_Latn), one that reaches the target
        return code == req.target or state.routes.model(code, req.target) is not None

    return [detector.best(" ".join(parse_html(t).sources) if req.html else t, usable) for t in req.q]


def _groups(state: ServerState, req: LibreRequest, detected: list[dict[str, Any]] | None) -> list[_Group]:
    """The texts by model (with "auto" each text goes where its detected language does), as documents. A text
    already in the target language, or without letters (emoji, numbers), goes to no model: LibreTranslate
    returns it unchanged, and a model would invent a translation."""
    groups: dict[tuple[str, str], _Group] = {}
    for i, text in enumerate(req.q):
        source = detected[i]["language"] if detected else req.source
        if req.html and not has_letters(text):  # letters only in references ("&#117;"): its text nodes' say
            text = " ".join(parse_html(text).sources)  # (a text with letters is parsed once, by the encoding)
        if source == req.target or not has_letters(text) and not has_fixed_term(req.glossary, text):
            for code, key in ((source, "source"), (req.target, "target")):
                if code not in state.routes.codes:
                    raise ApiError(400, f'"{key}" {code} is not a language this server translates; it translates '
                                        f"{state.routes.listed()}")
            continue
        model = state.routes.model(source, req.target)
        if model is None:
            found = (f"{req.name(i)} is detected as {source} (confidence {detected[i]['confidence']}): "
                     if detected else "")
            raise ApiError(400, f'{found}"source" {source} to "target" {req.target} is not a language pair this '
                                f"server translates; it translates {state.routes.listed()}")
        group = groups.setdefault((model.name, source), _Group(model, source, []))
        group.places.append(i)
    if not groups and req.glossary is not None and req.source not in ("auto", req.target):
        # no text needs a model (numbers alone): the glossary is checked as if one had, against the pair's
        routed = state.routes.model(req.source, req.target)
        if routed is not None:
            for_model(req.glossary, routed.loaded, state.glossaries)
    for group in groups.values():
        decoding = group.model.decoding
        if req.alternatives and not req.html:  # html gets none (LibreTranslate's): its search is the usual one
            n = req.alternatives + 1
            if n > group.model.max_beam:
                raise ApiError(400, f'"alternatives" {req.alternatives} is above this model\'s limit of '
                                    f"{group.model.max_beam - 1}")
            decoding = decoding.replace(nbest=n, beam_size=max(decoding.beam_size, n))
        try:
            way = group.model.direction(group.source, req.target)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        texts = [req.q[i] for i in group.places]  # each a document (with html, each of its text nodes)
        for_model(req.glossary, group.model.loaded, state.glossaries)  # the server's own were checked at start
        group.request = TranslateRequest(texts, group.model, decoding, False, "sentences", group.source, False, way,
                                         "html" if req.html else "text", req.glossary,
                                         [req.name(i) for i in group.places], req.soft_breaks)
    return list(groups.values())


def _answer(req: LibreRequest, groups: list[_Group], done: list[tuple[EncodedTexts, list[NBest]]],
            detected: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The answer from the text service's results: each text's translation, up to "alternatives" others (each
    sentence's k-th hypothesis, rebuilt; those equal to an earlier one dropped, as LibreTranslate does; none for
    html, as there) and score (its sentences' best beam scores averaged by their length)."""
    texts = list(req.q)  # a text no model was given (same language, no letters) is answered as it came
    alternatives: list[list[str]] = [[] for _ in req.q]
    scores: list[float | None] = [None] * len(req.q)
    terms: list[Any] = [[] for _ in req.q]  # with a glossary; none for a text answered as it came
    for group, (encoded, results) in zip(groups, done):
        finished = finish_texts(group.model.loaded.tokenizer, encoded, results,
                                1 if req.html else req.alternatives + 1)
        for place, result, found in zip(group.places, finished, text_terms(finished)):
            texts[place], alternatives[place], scores[place] = result.text, result.alternatives, result.score
            terms[place] = found
    one = (lambda xs: xs) if req.batch else (lambda xs: xs[0])
    body: dict[str, Any] = {"translatedText": one(texts)}
    if detected is not None:
        body["detectedLanguage"] = one(detected)
    if req.alternatives:
        body["alternatives"] = one(alternatives)
    body["score"] = one(scores)
    if req.glossary is not None:
        body["terms"] = one(terms)
    return body


async def translate_texts(request: Request, state: ServerState, req: LibreRequest,
                          detected: list[dict[str, Any]] | None) -> tuple[dict[str, Any], ModelMetrics]:
    """The texts of `req` translated as LibreTranslate answers them (each routed to its model, queued, awaited,
    dropped if the client leaves), with the metrics of the model that answered (the first, with several):
    what /translate and /translate_file both do once their fields are read."""
    groups = await off_loop(state.prepare, _groups, state, req, detected)
    note(request, model=",".join(sorted({g.model.name for g in groups})) or None, texts=len(req.q))
    metrics = groups[0].model.metrics if groups else state.unnamed
    for g in groups:
        g.model.metrics.in_flight.inc()
    try:
        done = await translated(request, [g.request for g in groups if g.request], state)
    except ClientDisconnect:
        metrics.disconnects.inc()
        raise CountedDisconnect(metrics) from None
    finally:
        for g in groups:
            g.model.metrics.in_flight.dec()
    body = await off_loop(state.prepare, _answer, req, groups, done, detected)
    return body, metrics


async def translate(request: Request, data: Any, form: bool, state: ServerState) -> Response:
    """POST /translate in LibreTranslate's form (the body read and parsed already)."""
    started = time.perf_counter()
    m = state.refused_in
    try:
        check_key(state, data.get("api_key") if isinstance(data, dict) else None, request)
        refuse_query_fields(request, state, form)
        req = await off_loop(state.reading, parse_libre, data, form, state)  # in proportion to the body
        detected = await off_loop(state.prepare, _detect, state, req) if req.source == "auto" else None
        body, m = await translate_texts(request, state, req, detected)
        m.request_seconds.observe(time.perf_counter() - started)
        response: Response = JSONResponse(body)
    except Exception as e:
        m = e.metrics if isinstance(e, CountedDisconnect) else m
        response = failed(e, m, state.limits.retry_after_s, "translation")
    settle(request.scope, response.status_code)
    m.request(response.status_code)
    return response


async def languages(request: Request) -> Response:
    """GET /languages: [{"code", "name", "targets"}] of the served models; open, as LibreTranslate's."""
    state: ServerState = request.app.state.server
    return Response(state.routes.languages_json, media_type="application/json")


REQUEST_FIELDS_BYTES = 1024  # a request's other fields (source, target, format, api_key, ...) and its framing


def char_limit(max_bytes: int) -> int:
    """The characters of a q that always fit in a --max-bytes request with its other fields: a character is at
    most 12 bytes as JSON (\\ud83d\\ude00) and as form data (%F0%9F%98%80)."""
    return max(0, max_bytes - REQUEST_FIELDS_BYTES) // 12


async def frontend_settings(request: Request) -> Response:
    """GET /frontend/settings: the fields LibreTranslate's front end and clients (libretranslate-aio, LiquidBounce)
    read. charLimit is what always fits in --max-bytes, whatever the characters and their JSON escapes."""
    state: ServerState = request.app.state.server
    routes = state.routes  # defaults a client can send as they are: a served source, or auto where detection is
    source = "auto" if state.detector is not None or not routes.sources else \
        preferred(routes.sources) or routes.sources[0]
    into = routes.targets if source == "auto" else routes.targets_of(source)
    target = preferred(into) or (into[0] if into else "")  # English, as LibreTranslate's page defaults to
    return JSONResponse({
        "charLimit": char_limit(state.limits.max_bytes),
        "frontendTimeout": 500,
        "apiKeys": state.keys is not None,
        "keyRequired": bool(state.keys is not None and state.keys.require),
        "suggestions": state.suggestions is not None,
        "filesTranslation": True,
        "supportedFilesFormat": [".txt", ".html", ".htm", ".srt", ".docx", ".pptx", ".odt", ".odp", ".epub"],
        "language": {"source": {"code": source, "name": "Auto Detect" if source == "auto" else language_name(source)},
                     "target": {"code": target, "name": language_name(target)}},
    })


def refuse_query_fields(request: Request, state: ServerState, form: bool) -> None:
    """A JSON request's fields in its query string, which nothing reads (the key aside): a 400 naming them
    (`?glossary=main` translated without the glossary, `/detect?q=` detected the body's text)."""
    if not form and (unread := sorted(set(query_fields(request, state.limits)) - {"api_key"})):
        raise ApiError(400, f"a JSON body's fields are read from the body, not the query string "
                            f"({', '.join(shown(k) for k in unread[:5])}); send them in the body")


async def detect(request: Request) -> Response:
    """POST /detect {"q"}: [{"language", "confidence"}], most likely first, confidence in percent."""
    state: ServerState = request.app.state.server
    try:
        data, form = await read_payload(request, state.limits, state.reading)
        if not isinstance(data, dict):
            raise ApiError(400, 'request body must be a JSON object like {"q": "text"}')
        check_key(state, data.get("api_key"), request)
        refuse_query_fields(request, state, form)
        q = data.get("q")
        if q is None or q == "" or q == []:
            raise ApiError(400, "Invalid request: missing q parameter")
        texts = q if isinstance(q, list) else [q]
        if not all(isinstance(t, str) for t in texts):
            raise ApiError(400, '"q" must be a string or a list of strings')
        for i, text in enumerate(texts):  # each named as the request lists it
            if why := not_text(text):
                raise ApiError(400, f"{_name(i, isinstance(q, list))} holds {why}")
        q = "\n".join(texts)
        if state.detector is None:
            raise ApiError(501, f"this server cannot detect languages: {state.no_detector}")
        sources = frozenset(state.routes.sources)  # of a language's codes, one a client can send as "source"
        return JSONResponse(await off_loop(state.prepare, state.detector.rank, q, TOP, sources.__contains__))
    except ApiError as e:
        return error(e)

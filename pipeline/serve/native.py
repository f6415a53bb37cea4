"""The native API: POST /translate with {"text": [...]} (one line, or with "split", one document each), its
fields checked one by one (400 naming the field, 404 naming the served models, 413 naming the limit), its key
with --api-keys (Authorization: Bearer; 401 with WWW-Authenticate, 429 over the key's rate), and its answers:
{"translations": [...]} (hypotheses with scores for "nbest" / "scores"; "terms" with a glossary), or with
"stream" NDJSON, one object per text (per sentence with split) as soon as it and those before it are done.
The texts go through the service (service.py) and come back through runtime/texts.py finish_texts."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pipeline.serve.access import ADMISSION, KeyRefused, RateLimited, note, settle
from pipeline.serve.batcher import Work
from pipeline.serve.glossaries import for_model, requested, text_terms, unit_terms
from pipeline.serve.http import CLIENT_CLOSED, ApiError, bearer, failed, off_loop, refuse_repeated, shown, too_many
from pipeline.serve.metrics import ModelMetrics
from pipeline.serve.service import TranslateRequest, count, submit, translated, wait
from pipeline.serve.state import ServedModel, ServerState, pick_model
from runtime.decoding import said
from runtime.languages import LANG_CODE, ONE_PAIR, Direction, folded_spellings, spelled
from runtime.sentences import SPLIT_MODES
from runtime.texts import FORMATS, EncodedTexts, finish_text, finish_texts
from runtime.translate import NBest, not_text

log = logging.getLogger(__name__)

REQUEST_KEYS = frozenset({"text", "model", "split", "lang", "stream", "beam_size", "nbest", "scores", "source",
                          "target", "glossary", "format"})


def unauthorized(state: ServerState, request: Request) -> ApiError | None:
    """With --api-keys, the native API's refusal of a request without a valid Authorization: Bearer key:
    401 with WWW-Authenticate, or 429 over the key's rate."""
    if state.keys is None:
        return None
    given = bearer(request.headers.get("authorization", ""))
    try:
        admitted = request.scope[ADMISSION] = state.keys.check(given, request.client.host if request.client else "")
        note(request, key=admitted.label)
    except KeyRefused:
        challenge = 'Bearer realm="pipeline"' + (', error="invalid_token"' if given else "")
        return ApiError(401, "the API key in Authorization is not valid" if given else
                        "this server needs an API key: send Authorization: Bearer KEY", {"WWW-Authenticate": challenge})
    except RateLimited as e:
        note(request, key=e.label)
        return ApiError(429, str(e), {"Retry-After": str(e.retry_after_s)})
    return None


def _field(data: dict[str, Any], key: str, kind: type, default: Any, what: str) -> Any:
    value = data.get(key, default)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ApiError(400, f'"{key}" must be {what}')
    return value


def parse_request(data: Any, state: ServerState) -> TranslateRequest:
    """The JSON body checked for types, keys and limits (400 / 404 / 413 naming the problem)."""
    if not isinstance(data, dict):
        raise ApiError(400, 'request body must be a JSON object like {"text": ["a line", ...]}')
    unknown = sorted(set(data) - REQUEST_KEYS)
    if unknown:
        raise ApiError(400, f"unknown field(s) {', '.join(shown(k) for k in unknown[:5])}"
                            f"{f' and {len(unknown) - 5} more' if len(unknown) > 5 else ''}; known: "
                            f"{', '.join(sorted(REQUEST_KEYS))}")
    refuse_repeated(data)
    model = pick_model(data, state)
    text = data.get("text")
    if not isinstance(text, list) or not all(isinstance(t, str) for t in text):
        raise ApiError(400, '"text" must be a list of strings, one line (or with split, one document) each')
    if len(text) > state.limits.max_lines:
        raise ApiError(413, too_many(len(text), "lines", state.limits.max_lines, "--max-lines"))
    split = data.get("split", "none")
    if split not in SPLIT_MODES:
        raise ApiError(400, f'"split" must be one of {", ".join(map(json.dumps, SPLIT_MODES))}')
    way = _direction(data, model)
    lang = _field(data, "lang", str, way.source or model.lang, 'a language code like "de"')
    if not LANG_CODE.fullmatch(lang):
        raise ApiError(400, f'"lang" must be a language code like "de", not {lang[:20]!r}')
    stream = _field(data, "stream", bool, False, "true or false")
    kind = data.get("format", "text")
    if kind not in FORMATS:
        raise ApiError(400, f'"format" must be one of {", ".join(map(json.dumps, FORMATS))}, not {shown(kind)}')
    for i, line in enumerate(text):
        if "\n" in line and split == "none" and kind == "text":
            raise ApiError(400, f'text[{i}] holds a newline; send one line per list item, or "split": "sentences"')
        if why := not_text(line):
            raise ApiError(400, f"text[{i}] holds {why}")
    changes = {key: _field(data, key, int, None, "an integer") for key in ("beam_size", "nbest") if key in data}
    one_per_text = split != "none" or kind == "html"
    served_nbest = "nbest" not in changes and model.decoding.nbest > 1  # the server's --nbest, where it fits:
    if served_nbest:  # within the request's beam, and one translation per text with split or html
        beam = changes.get("beam_size", model.decoding.beam_size)
        changes["nbest"] = 1 if one_per_text else max(1, min(model.decoding.nbest, beam))
    decoding = model.decoding.replace(**changes)
    problems = decoding.problems(name=str)  # the request's own field names
    if decoding.beam_size > model.max_beam:
        problems.append(f"beam_size {said(decoding.beam_size)} is above this model's limit of {model.max_beam}")
    if problems:
        raise ApiError(400, "; ".join(problems))
    scores = _field(data, "scores", bool, False, "true or false")
    # the answer's shape is the request's and the server's, never the beam's: hypotheses wherever n-best applies
    structured = scores or decoding.nbest > 1 or served_nbest and not one_per_text
    if structured and (split != "none" or kind == "html"):
        what = '"format": "html"' if kind == "html" else '"split": "sentences"'
        raise ApiError(400, f'{what} gives one translation per text: "nbest" and "scores" need "split": "none" '
                            'and "format": "text"')
    glossary = requested(data.get("glossary"), state.glossaries)
    for_model(glossary, model.loaded, state.glossaries)
    return TranslateRequest(text, model, decoding, structured, split, lang, stream, way, kind, glossary)


def request_metrics(data: Any, state: ServerState) -> ModelMetrics:
    """The metrics a request is counted in, refused or not: the model it names (the server's only one when it
    names none, or one it lacks, or the body is no object: as LibreTranslate's API counts), else the unnamed
    series."""
    try:
        return pick_model(data, state).metrics if isinstance(data, dict) else state.refused_in
    except ApiError:  # no model, or one the server lacks: refused below
        return state.refused_in


def _direction(data: dict[str, Any], model: ServedModel) -> Direction:
    """The request's "source" -> "target" for the model: a multilingual model needs both (its language tokens);
    a model of one pair takes them only when they are its own (400 naming the field otherwise)."""
    folded = folded_spellings({*model.sources, *model.targets})  # any case, as LibreTranslate's API takes codes
    given = {key: spelled(_field(data, key, str, None, 'a language code like "de"'), folded)
             for key in ("source", "target") if key in data}
    try:
        way = model.direction(given.get("source"), given.get("target"))
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    if way is ONE_PAIR:
        for key, known in (("source", model.sources), ("target", model.targets)):
            if key in given and known and given[key] not in known:
                raise ApiError(400, f'"{key}" {shown(given[key])} is not a language of model {model.name} '
                                    f'({", ".join(known)})')
            if key in given and not LANG_CODE.fullmatch(given[key]):  # a model whose pair is not recorded
                raise ApiError(400, f'"{key}" must be a language code like "de", not {shown(given[key])}')
    return way


async def translate(request: Request, data: Any, state: ServerState, started: float) -> Response:
    """POST /translate in the native form (the body read and parsed already)."""
    m = request_metrics(data, state)
    try:
        refused = unauthorized(state, request)
        if refused is not None:
            raise refused
        if request.url.query:  # read nowhere: ?nbest=2 was answered with one hypothesis, without a word
            given = ", ".join(shown(k) for k in list(dict.fromkeys(request.query_params))[:5]) or "?"
            raise ApiError(400, f"the native API reads its fields from the JSON body, not the query string ({given}); "
                                "send them in the body")
        req = await off_loop(state.reading, parse_request, data, state)
        note(request, model=req.model.name, texts=len(req.text))
        m = req.model.metrics
        m.in_flight.inc()
        try:
            if req.stream:
                work, encoded = await submit(req, state)
                m.in_flight.inc()  # held by the stream until it ends
                response: Response = _Stream(req, work, encoded, state, started)
            else:
                [(encoded, results)] = await translated(request, [req], state)
                response = await off_loop(state.prepare, _translations, req, encoded, results)
                m.request_seconds.observe(time.perf_counter() - started)
        finally:
            m.in_flight.dec()
    except Exception as e:  # a backend fault: this request fails (503), the server goes on
        response = failed(e, m, state.limits.retry_after_s, "translation")
    settle(request.scope, response.status_code)
    if not isinstance(response, _Stream):  # a stream is counted when it ends, as it ended
        m.request(response.status_code)
    return response


def _translations(req: TranslateRequest, encoded: EncodedTexts, results: list[NBest]) -> Response:
    """The whole answer, from the text service: each line's translation (with split, each text rebuilt) or
    hypotheses; with a glossary, each text's terms."""
    done = finish_texts(req.model.loaded.tokenizer, encoded, results, req.decoding.nbest)
    items: list[Any]
    if req.structured:
        items = [{"hypotheses": _hypotheses(r.hypotheses)} for r in done]
    else:
        items = [r.text for r in done]
    body: dict[str, Any] = {"translations": items}
    if req.glossary is not None:
        body["terms"] = text_terms(done)
    return JSONResponse(body)


def _hypotheses(hyps: list[tuple[str, float]]) -> list[dict[str, Any]]:
    """The hypotheses as the answer lists them; an empty line (never searched) has one, empty, with score 0."""
    return [{"text": text, "score": score} for text, score in hyps] or [{"text": "", "score": 0.0}]


async def _stream(req: TranslateRequest, work: Work, encoded: EncodedTexts, state: ServerState, started: float,
                  answer: _Stream) -> AsyncIterator[bytes]:
    """NDJSON, one object per text (per sentence with split) in input order, each sent once it and
    everything before it is translated; with a glossary, each with its terms. How it ended goes to
    `answer.ended`: 200, or the status of the error that is its last object."""
    tokenizer, m = req.model.loaded.tokenizer, req.model.metrics

    def terms(unit: int, best: str) -> dict[str, Any]:
        return {} if req.glossary is None else {"terms": unit_terms(encoded, unit, best)}

    try:
        for index, span in enumerate(encoded.spans):
            split = encoded.split(index)
            if encoded.markups[index] is not None:  # an HTML text: rebuilt once its nodes' sentences are done
                await wait(work, span.stop, state)
                done = finish_text(tokenizer, encoded, index, work.results, req.decoding.nbest)
                yield _ndjson({"index": index, "translation": done.text,
                               **({} if req.glossary is None else {"terms": done.terms or []})})
                continue
            if split is None:
                await wait(work, span.stop, state)
                hyps = encoded.hypotheses(tokenizer, span.start, work.results[span.start])
                best = encoded.best(hyps)
                yield _ndjson({"index": index, **({"hypotheses": _hypotheses(hyps)} if req.structured
                                                  else {"translation": best}), **terms(span.start, best)})
                continue
            if not split.sentences:  # an empty or whitespace-only text: one object with its whitespace
                yield _ndjson({"index": index, "sentence": 0, "translation": split.gaps[0],
                               **({} if req.glossary is None else {"terms": []})})
            for j, unit in enumerate(span):
                await wait(work, unit + 1, state)
                best = encoded.best(encoded.hypotheses(tokenizer, unit, work.results[unit]))
                yield _ndjson({"index": index, "sentence": j, "translation": split.piece(j, best),
                               **terms(unit, best)})
        count(m, encoded, work.results)
        m.request_seconds.observe(time.perf_counter() - started)
        answer.ended = 200
    except ApiError as e:  # the status went out already: the error is the last object
        answer.ended = e.status
        yield _ndjson({"error": str(e)})
    except Exception as e:
        log.exception("translation failed")
        answer.ended = 503
        yield _ndjson({"error": f"translation failed ({type(e).__name__}: {e}); retry later"})


class _Stream(StreamingResponse):
    """A streamed answer that, however it ends (even before its first object), frees what its request
    holds (a client that left has its remaining work dropped from the queue) and is counted as it ended: 200
    when whole, the status of the error that ended it (503 when the server stopped it), 499 when its client
    left first. Its 200 went out with its first byte: the access log adds `ended=` when it ended otherwise."""

    def __init__(self, req: TranslateRequest, work: Work, encoded: EncodedTexts, state: ServerState,
                 started: float):
        super().__init__(_stream(req, work, encoded, state, started, self), media_type=NDJSON)
        self.model, self.work, self.state = req.model, work, state
        self.ended = CLIENT_CLOSED  # until the stream says otherwise

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            pass
        except asyncio.CancelledError:  # a stopping server's second Ctrl-C (app.py sends its error object)
            if self.state.draining:
                self.ended = 503
            raise
        finally:
            if not self.work.future.done():
                self.model.metrics.disconnects.inc()
                self.model.batcher.drop(self.work)  # type: ignore[union-attr]
            self.model.metrics.in_flight.dec()
            self.model.metrics.request(self.ended)
            if self.ended != 200:
                note(Request(scope), ended=self.ended)


NDJSON = "application/x-ndjson; charset=utf-8"  # without the charset, requests guessed iso8859_10 for some answers
# line breaks other than \n, which JSON may hold raw: escaped, so a client splitting the stream at any line break
# (Python's str.splitlines, a JavaScript reader) still reads one object per line
_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def _ndjson(item: dict[str, Any]) -> bytes:
    return json.dumps(item, ensure_ascii=False).translate(_BREAKS).encode("utf-8") + b"\n"

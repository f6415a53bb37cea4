"""What a request to `pipeline serve` is: the served models and the server's shared state, the body
read within its bounds (413 after a bounded drain, 408 for a stalled client), the JSON checked field
by field (400 naming the field, 404 naming the served models) and encoded within the limits on
sentences and source tokens (413 naming the limit); the routes are in app.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from pipeline.serve.batcher import Batcher
from pipeline.serve.detect import Detector
from pipeline.serve.glossaries import GlossaryError, for_model, requested
from pipeline.serve.keys import ApiKeys
from pipeline.serve.languages import Routes
from pipeline.serve.metrics import Metrics, ModelMetrics
from pipeline.serve.options import RequestLimits
from pipeline.serve.translator import Translator
from runtime.decoding import DecodingOptions
from runtime.errors import RuntimeUserError
from runtime.glossary import Glossary
from runtime.languages import LANG_CODE, ONE_PAIR, Direction
from runtime.sentences import SPLIT_MODES
from runtime.texts import EncodedTexts, Listed, TextPolicy, TooManyUnits, encode_texts
from runtime.translate import SourceTooLong

REQUEST_KEYS = {"text", "model", "split", "lang", "stream", "beam_size", "nbest", "scores", "source", "target",
                "glossary"}
LANG = LANG_CODE


@dataclass
class ServedModel:
    """One model dir as the routes see it: its translator, defaults, metrics and queue."""

    name: str
    translator: Translator
    decoding: DecodingOptions
    max_beam: int
    lang: str  # sentence rules when a request names none
    info: dict[str, Any]
    metrics: ModelMetrics
    batcher: Batcher | None = None
    # the languages it translates from and into (languages.served_languages): LibreTranslate's routes
    sources: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()


@dataclass
class ServerState:
    """What the routes share; `draining` turns /health to 503 once shutdown has begun."""

    models: dict[str, ServedModel]
    limits: RequestLimits
    info: dict[str, Any]
    metrics: Metrics
    warmed_up: bool = False
    draining: bool = False
    prepare: ThreadPoolExecutor | None = None  # threads preparing requests and answers (app.py's lifespan)
    reading: ThreadPoolExecutor | None = None  # threads reading bodies, apart from `prepare` (app.py's lifespan)
    keys: ApiKeys | None = None  # --api-keys: the keys, and the rule for requests without one
    cors_origin: str | None = "*"  # --cors-origin: Access-Control-Allow-Origin; None sends no CORS headers
    access_log: str | None = None  # --access-log: "text" or "json" lines; None writes none
    suggestions: Any = None  # --suggestions: suggestions.Suggestions, where POST /suggest stores; None: off
    detector: Detector | None = None  # "source": "auto" and /detect; None: `no_detector` says why
    no_detector: str = "language detection is off"
    glossaries: dict[str, Glossary] = field(default_factory=dict)  # --glossary NAME=FILE, checked at start
    unnamed: ModelMetrics = field(init=False)  # requests refused before they named a model
    routes: Routes[ServedModel] = field(init=False)  # (source, target) -> model, for LibreTranslate's API

    def __post_init__(self) -> None:
        self.unnamed = self.metrics.model("")
        self.routes = Routes.of((m.name, m, m.sources, m.targets) for m in self.models.values())


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


@dataclass
class TranslateRequest:
    text: list[str]
    model: ServedModel
    decoding: DecodingOptions
    structured: bool
    split: str
    lang: str
    stream: bool
    way: Direction = ONE_PAIR  # a multilingual model's source -> target (LibreTranslate's API); none for one pair
    format: str = "text"  # "html": each text an HTML document (LibreTranslate's API)
    glossary: Glossary | None = None  # "glossary": its terms forced into the translations, listed in the answer


def _field(data: dict[str, Any], key: str, kind: type, default: Any, what: str) -> Any:
    value = data.get(key, default)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ApiError(400, f'"{key}" must be {what}')
    return value


def pick_model(data: dict[str, Any], state: ServerState) -> ServedModel:
    """The model the request names; the only one when it names none (400 / 404 otherwise)."""
    known = ", ".join(state.models)
    if "model" not in data:
        if len(state.models) == 1:
            return next(iter(state.models.values()))
        raise ApiError(400, f'"model" is required: this server has {known}')
    name = _field(data, "model", str, None, "a model name")
    if name not in state.models:
        raise ApiError(404, f'unknown "model" {name!r}: this server has {known}')
    return state.models[name]


def parse_json(body: bytes) -> Any:
    """The body as JSON (400 naming what is wrong: encoding, syntax, depth, a huge integer)."""
    try:
        decoded = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {e.start}: {body[e.start:e.start + 1]!r})"
                       ) from None
    try:
        data = json.loads(decoded)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"request body is not JSON: {e}") from None
    except RecursionError:  # the client's mistake, not a fault to retry
        raise ApiError(400, "request body is JSON nested too deeply to read") from None
    except ValueError as e:  # an integer past Python's int-string conversion limit
        raise ApiError(400, f"request body is JSON this server cannot read: {str(e).split(';')[0]}") from None
    return data


def parse_request(data: Any, state: ServerState) -> TranslateRequest:
    """The JSON body checked for types, keys and limits (400 / 404 / 413 naming the problem)."""
    if not isinstance(data, dict):
        raise ApiError(400, 'request body must be a JSON object like {"text": ["a line", ...]}')
    unknown = sorted(set(data) - REQUEST_KEYS)
    if unknown:
        raise ApiError(400, f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(REQUEST_KEYS))}")
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
    if not LANG.fullmatch(lang):
        raise ApiError(400, f'"lang" must be a language code like "de", not {lang[:20]!r}')
    stream = _field(data, "stream", bool, False, "true or false")
    for i, line in enumerate(text):
        if "\n" in line and split == "none":
            raise ApiError(400, f'text[{i}] holds a newline; send one line per list item, or "split": "sentences"')
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, f"text[{i}] holds a lone surrogate (\\ud800-\\udfff), not text") from None
    changes = {key: _field(data, key, int, None, "an integer") for key in ("beam_size", "nbest") if key in data}
    if "beam_size" in changes and "nbest" not in changes:
        changes["nbest"] = min(model.decoding.nbest, changes["beam_size"])
    decoding = model.decoding.replace(**changes)
    problems = decoding.problems(name=str)  # the request's own field names
    if decoding.beam_size > model.max_beam:
        problems.append(f"beam_size {decoding.beam_size} is above this model's limit of {model.max_beam}")
    if problems:
        raise ApiError(400, "; ".join(problems))
    scores = _field(data, "scores", bool, False, "true or false")
    structured = scores or decoding.nbest > 1
    if structured and split != "none":
        raise ApiError(400, '"split": "sentences" gives one translation per text: "nbest" and "scores" need '
                            '"split": "none"')
    glossary = request_glossary(data, state, model)
    return TranslateRequest(text, model, decoding, structured, split, lang, stream, way, glossary=glossary)


def request_glossary(data: dict[str, Any], state: ServerState, model: ServedModel | None = None
                     ) -> Glossary | None:
    """The request's "glossary" (glossaries.py: a name of the server's, or inline terms), checked against
    `model` when given (400 naming the field and the entry)."""
    try:
        glossary = requested(data.get("glossary"), state.glossaries)
    except GlossaryError as e:
        raise ApiError(400, str(e)) from None
    if model is not None:
        check_glossary(glossary, model, state)
    return glossary


def check_glossary(glossary: Glossary | None, model: ServedModel, state: ServerState) -> None:
    """400 unless `model` can apply the request's glossary (its backend, its target vocabulary)."""
    try:
        for_model(glossary, model.translator, state.glossaries)
    except GlossaryError as e:
        raise ApiError(400, str(e)) from None


def _direction(data: dict[str, Any], model: ServedModel) -> Direction:
    """The request's "source" -> "target" for the model: a multilingual model needs both (its language tokens);
    a model of one pair takes them only when they are its own (400 naming the field otherwise)."""
    given = {key: _field(data, key, str, None, 'a language code like "de"') for key in ("source", "target")
             if key in data}
    try:
        way = model.translator.direction(given.get("source"), given.get("target"))
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    if way is ONE_PAIR:
        for key, known in (("source", model.sources), ("target", model.targets)):
            if key in given and known and given[key] not in known:
                raise ApiError(400, f'"{key}" {given[key][:20]!r} is not a language of model {model.name} '
                                    f'({", ".join(known)})')
    return way


def too_many(count: int, what: str, limit: int, option: str) -> str:
    """The 413 message: what is over which limit, and the server option that sets it."""
    return f"{count} {what}, more than this server's limit of {limit} per request ({option}); split the request"


def encode_request(req: TranslateRequest, limits: RequestLimits) -> EncodedTexts:
    """The request's texts through the text service (runtime/texts.py): its lines, or with split its
    documents' sentences (with html its text nodes'), as source ids within the limits on sentences and source
    tokens (413 naming the limit; sentences are counted before the tokenizer's work). CPU work in proportion
    to the body: the routes run it off the event loop."""
    translator = req.model.translator
    policy = TextPolicy(translator.long_lines, req.split, req.format, req.lang, req.way.prefix)
    try:
        encoded = encode_texts(translator.tokenizer, req.text, translator.max_src_len, policy, Listed(),
                               limits.max_sentences, req.glossary)
    except TooManyUnits as e:
        raise ApiError(413, too_many(e.count, "sentences", limits.max_sentences, "--max-sentences")) from None
    except SourceTooLong as e:  # the long line named as the request has it, without the CLI's fix
        raise ApiError(413, f"{e.what}; split the line") from None
    except RuntimeUserError as e:  # a glossary's term this model cannot take, found in a text
        raise ApiError(400, str(e)) from None
    if encoded.tokens > limits.max_source_tokens:
        raise ApiError(413, too_many(encoded.tokens, "source tokens", limits.max_source_tokens,
                                     "--max-source-tokens"))
    return encoded


# An oversized body is read and discarded up to these bounds before the 413 is sent: a client that
# is still sending when the server answers and closes gets "connection reset" instead of the answer
# (plain urllib / requests clients do). Past either bound the 413 goes out with Connection: close.
DRAIN_BYTES = 64 << 20
DRAIN_SECONDS = 30.0


async def read_body(request: Request, limits: RequestLimits) -> bytes:
    """The body, within body_timeout_s (408 and the connection closed beyond: a stalled client holds
    nothing); over max_bytes (declared or streamed) a 413, sent once the rest of the body has been
    drained within DRAIN_BYTES / DRAIN_SECONDS so that the client receives it."""
    try:
        return await asyncio.wait_for(_read_body(request, limits.max_bytes), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
                       {"Connection": "close"}) from None


async def _read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    over = declared is not None and declared.isdigit() and int(declared) > max_bytes
    stream = request.stream()
    chunks: list[bytes] = []
    size = 0
    if not over:
        async for chunk in stream:
            size += len(chunk)
            if size > max_bytes:
                over = True
                break
            chunks.append(chunk)
        else:
            return b"".join(chunks)
    drained = await _drain(stream, size)
    what = f"request body of {declared} bytes" if declared and declared.isdigit() else "request body"
    raise ApiError(413, f"{what} is over this server's limit of {max_bytes} bytes (--max-bytes); split the request",
                   headers=None if drained else {"Connection": "close"})


async def _drain(stream: AsyncIterator[bytes], seen: int) -> bool:
    """Read and discard the rest of a body; False when it is longer than DRAIN_BYTES or slower than
    DRAIN_SECONDS (the connection is then closed after the answer)."""
    async def consume() -> bool:
        total = seen
        async for chunk in stream:
            total += len(chunk)
            if total > DRAIN_BYTES:
                return False
        return True

    try:
        return await asyncio.wait_for(consume(), DRAIN_SECONDS)
    except asyncio.TimeoutError:
        return False

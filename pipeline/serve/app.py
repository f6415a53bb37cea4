"""The HTTP routes: POST /translate, GET /health, GET /metrics, GET /info.

No route reads or writes a file; every request is bounded (bytes, seconds to send them,
lines, tokens per line, queue places) and every refusal is a JSON {"error": ...} with the
status that tells a client what to do: 400 fix the request (naming the field), 404 name a
served model, 408 send faster, 413 split it, 503 retry later (with Retry-After). 503 is the
only 5xx: a backend fault is retried like an overload."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pipeline.serve.batcher import Batcher, BatcherStopped, QueueFull, Work
from pipeline.serve.metrics import CONTENT_TYPE, Metrics, ModelMetrics
from pipeline.serve.options import RequestLimits
from pipeline.serve.translator import Encoded, LineTooLong, Translator
from pipeline.serve_batch.sentences import SPLIT_MODES, rebuild_all
from runtime.decoding import DecodingOptions
from runtime.translate import NBest

log = logging.getLogger(__name__)

REQUEST_KEYS = {"text", "model", "split", "lang", "stream", "beam_size", "nbest", "scores"}
CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; nobody receives it
LANG = re.compile(r"[A-Za-z]{2,3}([-_][A-Za-z0-9]{1,8})*")


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


@dataclass
class ServerState:
    """What the routes share; `draining` turns /health to 503 once shutdown has begun."""

    models: dict[str, ServedModel]
    limits: RequestLimits
    info: dict[str, Any]
    metrics: Metrics
    warmed_up: bool = False
    draining: bool = False
    unnamed: ModelMetrics = field(init=False)  # requests refused before they named a model

    def __post_init__(self) -> None:
        self.unnamed = self.metrics.model("")


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


def parse_request(body: bytes, state: ServerState) -> TranslateRequest:
    """The JSON body checked for types, keys and limits (400 / 404 / 413 naming the problem)."""
    try:
        decoded = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {e.start}: {body[e.start:e.start + 1]!r})"
                       ) from None
    try:
        data = json.loads(decoded)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"request body is not JSON: {e}") from None
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
        raise ApiError(413, f"{len(text)} lines, more than this server's limit of {state.limits.max_lines} "
                            "per request; split the request")
    split = data.get("split", "none")
    if split not in SPLIT_MODES:
        raise ApiError(400, f'"split" must be one of {", ".join(map(json.dumps, SPLIT_MODES))}')
    lang = _field(data, "lang", str, model.lang, 'a language code like "de"')
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
    problems = decoding.problems()
    if decoding.beam_size > model.max_beam:
        problems.append(f"beam_size {decoding.beam_size} is above this model's limit of {model.max_beam}")
    if problems:
        raise ApiError(400, "; ".join(p.replace("--beam-size", "beam_size").replace("--nbest", "nbest")
                                      for p in problems))
    scores = _field(data, "scores", bool, False, "true or false")
    structured = scores or decoding.nbest > 1
    if structured and split != "none":
        raise ApiError(400, '"split": "sentences" gives one translation per text: "nbest" and "scores" need '
                            '"split": "none"')
    return TranslateRequest(text, model, decoding, structured, split, lang, stream)


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
    raise ApiError(413, f"{what} is over this server's limit of {max_bytes} bytes; split the request",
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


async def _client_gone(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _busy(message: str, state: ServerState) -> ApiError:
    return ApiError(503, message, {"Retry-After": str(state.limits.retry_after_s)})


async def translate(request: Request) -> Response:
    state: ServerState = request.app.state.server
    started = time.perf_counter()
    m = state.unnamed
    try:
        req = parse_request(await read_body(request, state.limits), state)
        m = req.model.metrics
        m.in_flight.inc()
        try:
            work, encoded = await _submit(req, state)
            if req.stream:
                m.in_flight.inc()  # held by the stream until it ends
                response: Response = _Stream(_stream(req, work, encoded, state, started), req.model, work)
            else:
                response = await _answer(request, req, work, encoded, state, started)
        finally:
            m.in_flight.dec()
    except ApiError as e:
        response = JSONResponse({"error": str(e)}, status_code=e.status, headers=e.headers)
    except ClientDisconnect:
        m.disconnects.inc()
        response = Response(status_code=CLIENT_CLOSED)
    except Exception as e:  # a backend fault: this request fails, the server goes on
        log.exception("translation failed")
        response = JSONResponse({"error": f"translation failed ({type(e).__name__}: {e}); retry later"},
                                status_code=503, headers={"Retry-After": str(state.limits.retry_after_s)})
    m.request(response.status_code)
    return response


async def _submit(req: TranslateRequest, state: ServerState) -> tuple[Work, Encoded]:
    """The request encoded (its sentences, with split) and queued on its model's batcher."""
    model = req.model
    try:
        encoded = await run_in_threadpool(model.translator.encode, req.text, req.split, req.lang)
    except LineTooLong as e:
        raise ApiError(413, f"{e}; split the line") from None
    if encoded.tokens == 0:  # blank lines only: nothing for the model
        return Work.finished([[] for _ in encoded.ids], req.decoding), encoded
    assert model.batcher is not None
    try:
        return model.batcher.submit(encoded.ids, req.decoding), encoded
    except QueueFull as e:
        raise _busy(f"server busy: {e}; retry later", state) from None


async def _wait(work: Work, n: int, state: ServerState) -> None:
    """Until the first n lines of the work are translated (503 if the server stopped first)."""
    try:
        await work.ready(n)
    except BatcherStopped as e:
        raise _busy(str(e), state) from None


async def _answer(request: Request, req: TranslateRequest, work: Work, encoded: Encoded, state: ServerState,
                  started: float) -> Response:
    """The whole answer at once; the work is dropped if the client leaves first."""
    model = req.model
    waiter = asyncio.ensure_future(_wait(work, len(encoded.ids), state))
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not waiter.done():
        waiter.cancel()
        model.batcher.drop(work)  # type: ignore[union-attr]
        raise ClientDisconnect()
    results = work.results
    _count(model.metrics, encoded, results)
    items: list[Any]
    if req.structured:
        items = [{"hypotheses": model.translator.hypotheses(nbest)} for nbest in results]
    else:
        items = [model.translator.format(nbest, 1) for nbest in results]
        if encoded.splits is not None:
            items = rebuild_all(encoded.splits, items)
    model.metrics.request_seconds.observe(time.perf_counter() - started)
    return JSONResponse({"translations": items})


async def _stream(req: TranslateRequest, work: Work, encoded: Encoded, state: ServerState, started: float
                  ) -> AsyncIterator[bytes]:
    """NDJSON, one object per text (per sentence with split) in input order, each sent once it and
    everything before it is translated."""
    model, m = req.model, req.model.metrics
    try:
        line = 0
        for index, split in enumerate(encoded.splits or [None] * len(encoded.ids)):
            if split is None:
                await _wait(work, line + 1, state)
                nbest = work.results[line]
                line += 1
                yield _ndjson({"index": index, **({"hypotheses": model.translator.hypotheses(nbest)} if req.structured
                                                  else {"translation": model.translator.format(nbest, 1)})})
                continue
            if not split.sentences:  # an empty or whitespace-only text: one object with its whitespace
                yield _ndjson({"index": index, "sentence": 0, "translation": split.gaps[0]})
            for j in range(len(split.sentences)):
                await _wait(work, line + 1, state)
                text = model.translator.format(work.results[line], 1)
                line += 1
                yield _ndjson({"index": index, "sentence": j, "translation": split.piece(j, text)})
        _count(m, encoded, work.results)
        m.request_seconds.observe(time.perf_counter() - started)
    except ApiError as e:  # the status went out already: the error is the last object
        yield _ndjson({"error": str(e)})
    except Exception as e:
        log.exception("translation failed")
        yield _ndjson({"error": f"translation failed ({type(e).__name__}: {e}); retry later"})


class _Stream(StreamingResponse):
    """A streamed answer that, however it ends (even before its first object), frees what its request
    holds: a client that left has its remaining work dropped from the queue."""

    def __init__(self, content: AsyncIterator[bytes], model: ServedModel, work: Work):
        super().__init__(content, media_type="application/x-ndjson")
        self.model, self.work = model, work

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            pass
        finally:
            if not self.work.future.done():
                self.model.metrics.disconnects.inc()
                self.model.batcher.drop(self.work)  # type: ignore[union-attr]
            self.model.metrics.in_flight.dec()


def _ndjson(item: dict[str, Any]) -> bytes:
    return json.dumps(item, ensure_ascii=False).encode("utf-8") + b"\n"


def _count(m: ModelMetrics, encoded: Encoded, results: list[NBest]) -> None:
    m.sentences.inc(len(encoded.ids))
    m.src_tokens.inc(encoded.tokens)
    m.truncated.inc(encoded.truncated)
    m.tgt_tokens.inc(sum(len(nbest[0][0]) + 1 for nbest in results if nbest))


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    running = all(model.batcher is not None and model.batcher.running for model in state.models.values())
    ready = state.warmed_up and running and not state.draining
    depths = {name: model.batcher.depth if model.batcher else 0 for name, model in state.models.items()}
    body = {"status": "ok" if ready else ("draining" if state.draining else "starting"),
            "ready": ready, "warmed_up": state.warmed_up, "queue_depth": sum(depths.values()),
            "models": {name: {"queue_depth": depth} for name, depth in depths.items()}}
    return JSONResponse(body, status_code=200 if ready else 503)


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


async def info(request: Request) -> Response:
    """Every model's facts and the server's settings; ?model=NAME: that model's facts alone."""
    state: ServerState = request.app.state.server
    name = request.query_params.get("model")
    if name is None:
        return JSONResponse({"models": {n: m.info for n, m in state.models.items()}, **state.info})
    if name not in state.models:
        return JSONResponse({"error": f'unknown "model" {name!r}: this server has {", ".join(state.models)}'},
                            status_code=404)
    return JSONResponse({"model": name, **state.models[name].info, **state.info})


async def _unavailable(request: Request, exc: Exception) -> Response:
    """Whatever escapes a route: 503, never 500."""
    log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    state: ServerState = request.app.state.server
    return JSONResponse({"error": f"{type(exc).__name__}: {exc}; retry later"}, status_code=503,
                        headers={"Retry-After": str(state.limits.retry_after_s)})


def create_app(state: ServerState) -> Starlette:
    """The ASGI app; each model's batcher runs between lifespan startup and shutdown (after the
    server has drained its in-flight requests)."""
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        limits = state.limits
        for model in state.models.values():
            model.batcher = Batcher(model.translator, model.metrics, limits.max_batch_tokens,
                                    limits.max_wait_ms / 1000.0, limits.max_queue)
            await model.batcher.start()
        try:
            yield
        finally:
            state.draining = True
            for model in state.models.values():
                await model.batcher.stop()  # type: ignore[union-attr]

    app = Starlette(routes=[
        Route("/translate", translate, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/info", info, methods=["GET"]),
    ], lifespan=lifespan, exception_handlers={Exception: _unavailable})
    app.state.server = state
    return app

"""The HTTP routes: POST /translate, GET /health, GET /metrics, GET /info.

No route reads or writes a file; every request is bounded (bytes, lines, tokens per
line, queue places) and every refusal is a JSON {"error": ...} with the status that
tells a client what to do: 400 fix the request, 413 split it, 503 retry later."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pipeline.serve.batcher import Batcher, BatcherStopped, QueueFull
from pipeline.serve.metrics import CONTENT_TYPE, Metrics
from pipeline.serve.options import RequestLimits
from pipeline.serve.translator import LineTooLong, Translator
from runtime.decoding import DecodingOptions
from runtime.translate import NBest

log = logging.getLogger(__name__)

REQUEST_KEYS = {"text", "beam_size", "nbest", "scores"}
CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; nobody receives it


@dataclass
class ServerState:
    """What the routes share; `draining` turns /health to 503 once shutdown has begun."""

    translator: Translator
    decoding: DecodingOptions
    limits: RequestLimits
    info: dict[str, Any]
    metrics: Metrics = field(default_factory=Metrics)
    warmed_up: bool = False
    draining: bool = False
    batcher: Batcher | None = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


@dataclass
class TranslateRequest:
    text: list[str]
    decoding: DecodingOptions
    structured: bool


def parse_request(body: bytes, state: ServerState) -> TranslateRequest:
    """The JSON body checked for types, keys and limits (400 / 413 naming the problem)."""
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
    text = data.get("text")
    if not isinstance(text, list) or not all(isinstance(t, str) for t in text):
        raise ApiError(400, '"text" must be a list of strings, one line each')
    if len(text) > state.limits.max_lines:
        raise ApiError(413, f"{len(text)} lines, more than this server's limit of {state.limits.max_lines} "
                            "per request; split the request")
    for i, line in enumerate(text):
        if "\n" in line:
            raise ApiError(400, f"text[{i}] holds a newline; send one line per list item")
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, f"text[{i}] holds a lone surrogate (\\ud800-\\udfff), not text") from None
    changes: dict[str, int] = {}
    for key in ("beam_size", "nbest"):
        if key in data:
            value = data[key]
            if not isinstance(value, int) or isinstance(value, bool):
                raise ApiError(400, f'"{key}" must be an integer')
            changes[key] = value
    if "beam_size" in changes and "nbest" not in changes:
        changes["nbest"] = min(state.decoding.nbest, changes["beam_size"])
    decoding = state.decoding.replace(**changes)
    problems = decoding.problems()
    if decoding.beam_size > state.limits.max_beam:
        problems.append(f"beam_size {decoding.beam_size} is above this model's limit of {state.limits.max_beam}")
    if problems:
        raise ApiError(400, "; ".join(p.replace("--beam-size", "beam_size").replace("--nbest", "nbest")
                                      for p in problems))
    scores = data.get("scores", False)
    if not isinstance(scores, bool):
        raise ApiError(400, '"scores" must be true or false')
    return TranslateRequest(text, decoding, structured=scores or decoding.nbest > 1)


# An oversized body is read and discarded up to these bounds before the 413 is sent: a client that
# is still sending when the server answers and closes gets "connection reset" instead of the answer
# (plain urllib / requests clients do). Past either bound the 413 goes out with Connection: close.
DRAIN_BYTES = 64 << 20
DRAIN_SECONDS = 30.0


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body; over max_bytes (declared or streamed) a 413, sent once the rest of the body has been
    drained within DRAIN_BYTES / DRAIN_SECONDS so that the client receives it."""
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


async def translate(request: Request) -> Response:
    state: ServerState = request.app.state.server
    m = state.metrics
    started = time.perf_counter()
    m.in_flight.inc()
    try:
        response = await _translate(request, state, started)
    except ApiError as e:
        response = JSONResponse({"error": str(e)}, status_code=e.status, headers=e.headers)
    except ClientDisconnect:
        m.disconnects.inc()
        response = Response(status_code=CLIENT_CLOSED)
    except Exception as e:  # a backend fault: this request fails, the server goes on
        log.exception("translation failed")
        response = JSONResponse({"error": f"internal error: {type(e).__name__}: {e}"}, status_code=500)
    finally:
        m.in_flight.dec()
    m.requests.labels(code=str(response.status_code)).inc()
    return response


async def _translate(request: Request, state: ServerState, started: float) -> Response:
    m = state.metrics
    req = parse_request(await read_body(request, state.limits.max_bytes), state)
    try:
        encoded = await run_in_threadpool(state.translator.encode, req.text)
    except LineTooLong as e:
        raise ApiError(413, f"{e}; split the line") from None
    if encoded.tokens == 0:  # blank lines only: nothing for the model
        results: list[NBest] = [[] for _ in req.text]
    else:
        assert state.batcher is not None
        try:
            work = state.batcher.submit(encoded.ids, req.decoding)
        except QueueFull as e:
            raise ApiError(503, f"server busy: {e}; retry later",
                           {"Retry-After": str(state.limits.retry_after_s)}) from None
        watcher = asyncio.ensure_future(_client_gone(request))
        try:
            waiters: set[asyncio.Future[Any]] = {work.future, watcher}
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not work.future.done():
            state.batcher.drop(work)
            raise ClientDisconnect()
        try:
            results = work.future.result()
        except BatcherStopped as e:
            raise ApiError(503, str(e), {"Retry-After": str(state.limits.retry_after_s)}) from None
    m.sentences.inc(len(req.text))
    m.src_tokens.inc(encoded.tokens)
    m.truncated.inc(encoded.truncated)
    m.tgt_tokens.inc(sum(len(nbest[0][0]) + 1 for nbest in results if nbest))
    translator = state.translator
    items: list[Any]
    if req.structured:
        items = [{"hypotheses": translator.hypotheses(nbest)} for nbest in results]
    else:
        items = [translator.format(nbest, 1) for nbest in results]
    m.request_seconds.observe(time.perf_counter() - started)
    return JSONResponse({"translations": items})


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    ready = state.warmed_up and state.batcher is not None and state.batcher.running and not state.draining
    body = {"status": "ok" if ready else ("draining" if state.draining else "starting"),
            "ready": ready, "warmed_up": state.warmed_up,
            "queue_depth": state.batcher.depth if state.batcher else 0}
    return JSONResponse(body, status_code=200 if ready else 503)


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


async def info(request: Request) -> Response:
    return JSONResponse(request.app.state.server.info)


def create_app(state: ServerState) -> Starlette:
    """The ASGI app; the batcher runs between lifespan startup and shutdown (after the
    server has drained its in-flight requests)."""
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        batcher = Batcher(state.translator, state.metrics, state.limits.max_batch_tokens,
                          state.limits.max_wait_ms / 1000.0, state.limits.max_queue)
        await batcher.start()
        state.batcher = batcher
        try:
            yield
        finally:
            state.draining = True
            await batcher.stop()

    app = Starlette(routes=[
        Route("/translate", translate, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/info", info, methods=["GET"]),
    ], lifespan=lifespan)
    app.state.server = state
    return app

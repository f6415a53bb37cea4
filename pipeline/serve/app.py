"""The app of `pipeline serve`, assembled: its routes (POST /translate hands a body to the API it is written
for: native.py's {"text": [...]} or libre.py's {"q": ...}, JSON or form data; LibreTranslate's other routes,
the file routes, /suggest, /spec, /docs and the page), GET /health, GET /metrics, GET /info, the middleware
(access log, CORS), the lifespan (each model's batcher, the threads that read and prepare requests) and the
last resort for whatever escapes a route.

No route reads or writes a file; every request is bounded (bytes, seconds to send them,
lines, sentences, source tokens, tokens per line, queue places) and every refusal is a JSON
{"error": ...} (http.error) with the status that tells a client what to do: 400 fix the request (naming the
field), 404 name a served model, 408 send faster, 413 split it, 503 retry later (with
Retry-After). 503 is the only 5xx: a backend fault is retried like an overload. A request's CPU
work (its JSON, sentences, tokens and answer) runs off the event loop, so no request holds the
others or /health while it is prepared."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, request_response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.serve import file_routes, libre, native, page, spec, suggestions
from pipeline.serve.access import AccessLog
from pipeline.serve.batcher import Batcher
from pipeline.serve.http import CLIENT_CLOSED, ApiError, CountedDisconnect, error, read_payload, shown
from pipeline.serve.metrics import CONTENT_TYPE
from pipeline.serve.state import ServerState

log = logging.getLogger(__name__)

PREPARE_THREADS = 4  # parse HTML, split, tokenize and format requests (ServerState.prepare), for every model
READING_THREADS = 2  # read bodies' JSON and forms (ServerState.reading), never held by documents
DOCUMENT_THREADS = 1  # read and rebuild uploaded files (ServerState.documents): files queue, requests do not
# uploads between their reading and their rebuilding (ServerState.held_documents): each holds its trees and texts
# while its texts are translated (up to ~300 MB); the others wait as the bytes sent (14 at once held 1.7 GB)
DOCUMENTS_HELD = 2


class Counted:
    """A translating route as an ASGI app, its requests counted in ServerState.in_flight from the route's start
    until the answer is sent (a stream's last line included): a batcher starts at once when every one of them is
    queued (batcher.py), and each that ends nudges the batchers to check again."""

    def __init__(self, route: Callable[[Request], Awaitable[Response]]):
        self.app = request_response(route)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state: ServerState = scope["app"].state.server
        state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.in_flight -= 1
            for model in state.models.values():
                if model.batcher is not None:
                    model.batcher.nudge()


async def translate(request: Request) -> Response:
    """POST /translate: the native API ({"text": [...]}) or LibreTranslate's ({"q": ...}, JSON or form)."""
    state: ServerState = request.app.state.server
    started = time.perf_counter()
    try:
        data, form = await read_payload(request, state.limits, state.reading)
        speaks_libre = form or libre.speaks_libre(data, native.REQUEST_KEYS)
    except ApiError as e:
        response = error(e)
        state.refused_in.request(response.status_code)
        return response
    if speaks_libre:
        return await libre.translate(request, data, form, state)
    return await native.translate(request, data, state, started)


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
    refused = native.unauthorized(state, request)
    if refused is not None:
        return error(refused)
    names = request.query_params.getlist("model")
    if len(names) > 1:  # one would be taken in silence
        return error(ApiError(400, '"model" given more than once; ask for one model (or none: every model)'))
    name = names[0] if names else None
    if name is None:
        return JSONResponse({"models": {n: m.info for n, m in state.models.items()}, **state.info})
    if name not in state.models:
        return error(ApiError(404, f'unknown "model" {shown(name)}: this server has {", ".join(state.models)}'))
    return JSONResponse({"model": name, **state.models[name].info, **state.info})


async def no_icon(request: Request) -> Response:
    """GET /favicon.ico, which every browser asks for: no icon (204), rather than a 404 in the page's console."""
    return Response(status_code=204)


async def _gone(request: Request, exc: Exception) -> Response:
    """A client that left before its answer (any route; mid-body, say) that its route did not answer: nothing to
    send, nothing to log, counted (no model was chosen: the server's only one, else the unnamed series)."""
    state: ServerState = request.app.state.server
    if not isinstance(exc, CountedDisconnect):
        state.refused_in.disconnects.inc()
    state.refused_in.request(CLIENT_CLOSED)
    return Response(status_code=CLIENT_CLOSED)


async def _no_route(request: Request, exc: Exception) -> Response:
    """Starlette's 404 and 405, as every refusal is answered: {"error": ...} naming the route."""
    assert isinstance(exc, HTTPException)
    path = request.url.path  # quoted whole up to 200 characters (a 64 KiB path came back whole in the 404)
    path = path if len(path) <= 200 else f"{path[:200]}... ({len(path)} characters)"
    if exc.status_code == 405:
        allowed = ", ".join(sorted(m for m in (exc.headers or {}).get("Allow", "").split(", ") if m))
        message = f"{path} takes {allowed or 'other methods'}, not {request.method}"
    elif exc.status_code == 404:
        message = f"no route {request.method} {path}; GET /spec describes this server's API"
    else:
        message = str(exc.detail)
    return error(ApiError(exc.status_code, message, dict(exc.headers or {})))


class JsonCors(CORSMiddleware):
    """CORSMiddleware whose refused preflight is answered as every refusal is: {"error": ...}, not plain text."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
        return error(ApiError(response.status_code, f"CORS preflight refused: {bytes(response.body).decode()}",
                              headers))


def _shutdown_when_cancelled(scope: Scope, receive: Receive) -> Receive:
    """The lifespan's receive: a second Ctrl-C cancels the wait for "shutdown" (uvicorn skips it), which Starlette
    reported as a failed shutdown with a traceback; a draining server's lifespan shuts down as asked instead."""
    async def received() -> Message:
        try:
            return await receive()
        except asyncio.CancelledError:
            if not scope["app"].state.server.draining:
                raise
            return {"type": "lifespan.shutdown"}

    return received


class Contained:
    """Whatever escapes a route answered inside the middleware (the 503 of _unavailable), so that the CORS headers
    and the access log are those of every answer: Starlette runs its handler for Exception outside them all."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, _shutdown_when_cancelled(scope, receive), send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = streaming = False

        async def tracked(message: Message) -> None:
            nonlocal started, streaming
            if message["type"] == "http.response.start":
                started = True
                streaming = any(k == b"content-type" and v.startswith(b"application/x-ndjson")
                                for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                streaming = False  # the answer is whole
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:  # noqa: BLE001 - every failure is answered; a started answer cannot be
            if started:
                raise
            await (await _unavailable(Request(scope), exc))(scope, receive, send)
        except asyncio.CancelledError:  # uvicorn ending a stopping server's tasks: --grace-s and its answers ran out
            state: ServerState = scope["app"].state.server  # (a body still arriving), or a second Ctrl-C
            if streaming and state.draining:  # a stream's last object is its error, as when --grace-s runs out
                log.warning("%s %s: its stream ended with an error: the server stopped", scope["method"],
                            scope["path"])
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "more_body": False, "body": json.dumps(
                        {"error": "the server is stopping: this stream ends here; retry the texts without an "
                                  "answer elsewhere"}).encode() + b"\n"})
                return
            if started or not state.draining:
                raise
            log.warning("%s %s answered 503: the server stopped before its answer was ready", scope["method"],
                        scope["path"])
            await error(ApiError(503, "the server is stopping: it stopped before this request's answer was ready; "
                                 "retry elsewhere",
                                 {"Retry-After": str(state.limits.retry_after_s)}))(scope, receive, send)


async def _unavailable(request: Request, exc: Exception) -> Response:
    """Whatever escapes a route: 503, never 500."""
    log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    state: ServerState = request.app.state.server
    return error(ApiError(503, f"{type(exc).__name__}: {exc}; retry later",
                          {"Retry-After": str(state.limits.retry_after_s)}))


def create_app(state: ServerState) -> Starlette:
    """The ASGI app; each model's batcher runs between lifespan startup and shutdown (after the
    server has drained its in-flight requests)."""
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        limits = state.limits
        state.info["event_loop"] = type(asyncio.get_running_loop()).__module__.split(".")[0]  # uvloop, or asyncio
        state.prepare = prepare = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare")
        state.reading = reading = ThreadPoolExecutor(READING_THREADS, thread_name_prefix="reading")
        state.documents = documents = ThreadPoolExecutor(DOCUMENT_THREADS, thread_name_prefix="documents")
        state.held_documents = asyncio.Semaphore(DOCUMENTS_HELD)
        for model in state.models.values():
            model.batcher = Batcher(model.loaded, model.metrics, limits.max_batch_tokens,
                                    limits.max_wait_ms / 1000.0, limits.max_queue, lambda: state.in_flight)
            await model.batcher.start()
        try:
            yield
        finally:
            state.draining = True
            for model in state.models.values():
                await model.batcher.stop()  # type: ignore[union-attr]
            prepare.shutdown(wait=False, cancel_futures=True)
            reading.shutdown(wait=False, cancel_futures=True)
            documents.shutdown(wait=False, cancel_futures=True)

    middleware = []  # the first is outermost: the access log sees preflights and CORS refusals too
    if state.access_log is not None:
        middleware.append(Middleware(AccessLog, fmt=state.access_log))
    if state.cors_origin is not None:  # browsers' pages and add-ons call the API from other origins
        middleware.append(Middleware(JsonCors, allow_origins=[state.cors_origin], allow_methods=["GET", "POST"],
                                     allow_headers=["*"], max_age=600))
    middleware.append(Middleware(Contained))  # innermost
    app = Starlette(routes=[
        Route("/", page.page, methods=["GET"]),
        Route("/favicon.ico", no_icon, methods=["GET"]),
        Route("/translate", Counted(translate), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/info", info, methods=["GET"]),
        Route("/languages", libre.languages, methods=["GET"]),
        Route("/detect", libre.detect, methods=["POST"]),
        Route("/frontend/settings", libre.frontend_settings, methods=["GET"]),
        Route("/translate_file", Counted(file_routes.translate_file), methods=["POST"]),
        Route("/download_file/{id}", file_routes.download_file, methods=["GET"]),
        Route("/suggest", suggestions.suggest, methods=["POST"]),
        Route("/spec", spec.spec, methods=["GET"]),
        Route("/docs", spec.docs, methods=["GET"]),
    ], lifespan=lifespan, exception_handlers={Exception: _unavailable, ClientDisconnect: _gone,
                                                    HTTPException: _no_route}, middleware=middleware)
    # /translate/ is a JSON 404, not Starlette's 307 to an absolute http:// URL (wrong behind a
    # TLS proxy); LibreTranslate's Flask routes take no trailing slash either
    app.router.redirect_slashes = False
    app.state.server = state
    return app

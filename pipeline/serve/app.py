"""The HTTP routes: POST /translate, GET /health, GET /metrics, GET /info; LibreTranslate's POST /translate
(a body with "q"), GET /languages and POST /detect are in libre.py.

No route reads or writes a file; every request is bounded (bytes, seconds to send them,
lines, sentences, source tokens, tokens per line, queue places) and every refusal is a JSON
{"error": ...} with the status that tells a client what to do: 400 fix the request (naming the
field), 404 name a served model, 408 send faster, 413 split it, 503 retry later (with
Retry-After). 503 is the only 5xx: a backend fault is retried like an overload. A request's CPU
work (its JSON, sentences, tokens and answer) runs off the event loop, so no request holds the
others or /health while it is prepared."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pipeline.serve import file_routes, libre, page, spec, suggestions
from pipeline.serve.access import AccessLog, note
from pipeline.serve.batcher import Batcher, Work
from pipeline.serve.flow import count, off_loop, off_loop_reading, read_payload, submit, translated, wait
from pipeline.serve.glossaries import text_terms, unit_terms
from pipeline.serve.keys import KeyRefused, RateLimited, bearer
from pipeline.serve.libre import speaks_libre
from pipeline.serve.metrics import CONTENT_TYPE
from pipeline.serve.requests import ApiError, ServedModel, ServerState, TranslateRequest, parse_request
from runtime.texts import EncodedTexts, finish_texts, hypotheses
from runtime.translate import NBest

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; nobody receives it
PREPARE_THREADS = 4  # parse HTML, split, tokenize and format requests (flow.off_loop), for every model
READING_THREADS = 2  # read bodies' JSON and forms (flow.off_loop_reading), never held by documents


def _unauthorized(state: ServerState, request: Request) -> ApiError | None:
    """With --api-keys, the native API's refusal of a request without a valid Authorization: Bearer key:
    401 with WWW-Authenticate, or 429 over the key's rate."""
    if state.keys is None:
        return None
    given = bearer(request.headers.get("authorization", ""))
    try:
        note(request, key=state.keys.check(given, request.client.host if request.client else ""))
    except KeyRefused:
        challenge = 'Bearer realm="pipeline"' + (', error="invalid_token"' if given else "")
        return ApiError(401, "the API key in Authorization is not valid" if given else
                        "this server needs an API key: send Authorization: Bearer KEY", {"WWW-Authenticate": challenge})
    except RateLimited as e:
        return ApiError(429, str(e), {"Retry-After": str(e.retry_after_s)})
    return None


async def translate(request: Request) -> Response:
    """POST /translate: the native API ({"text": [...]}) or LibreTranslate's ({"q": ...}, JSON or form)."""
    state: ServerState = request.app.state.server
    started = time.perf_counter()
    try:
        data, form = await read_payload(request, state)
    except ApiError as e:
        response: Response = JSONResponse({"error": str(e)}, status_code=e.status, headers=e.headers)
        state.unnamed.request(response.status_code)
        return response
    except ClientDisconnect:
        return Response(status_code=CLIENT_CLOSED)
    if form or speaks_libre(data):
        return await libre.translate(request, data, form, state)
    return await _native(request, data, state, started)


async def _native(request: Request, data: Any, state: ServerState, started: float) -> Response:
    m = state.unnamed
    try:
        refused = _unauthorized(state, request)
        if refused is not None:
            raise refused
        req = await off_loop_reading(state, parse_request, data, state)
        note(request, model=req.model.name, texts=len(req.text))
        m = req.model.metrics
        m.in_flight.inc()
        try:
            if req.stream:
                work, encoded = await submit(req, state)
                m.in_flight.inc()  # held by the stream until it ends
                response: Response = _Stream(_stream(req, work, encoded, state, started), req.model, work)
            else:
                [(encoded, results)] = await translated(request, [req], state)
                response = await off_loop(state, _translations, req, encoded, results)
                m.request_seconds.observe(time.perf_counter() - started)
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


def _translations(req: TranslateRequest, encoded: EncodedTexts, results: list[NBest]) -> Response:
    """The whole answer, from the text service: each line's translation (with split, each text rebuilt) or
    hypotheses; with a glossary, each text's terms."""
    done = finish_texts(req.model.translator.tokenizer, encoded, results, req.decoding.nbest)
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
    return [{"text": text, "score": score} for text, score in hyps]


async def _stream(req: TranslateRequest, work: Work, encoded: EncodedTexts, state: ServerState, started: float
                  ) -> AsyncIterator[bytes]:
    """NDJSON, one object per text (per sentence with split) in input order, each sent once it and
    everything before it is translated; with a glossary, each with its terms."""
    tokenizer, m = req.model.translator.tokenizer, req.model.metrics

    def terms(unit: int, best: str) -> dict[str, Any]:
        return {} if req.glossary is None else {"terms": unit_terms(encoded, unit, best)}

    try:
        for index, span in enumerate(encoded.spans):
            split = encoded.split(index)
            if split is None:
                await wait(work, span.stop, state)
                hyps = hypotheses(tokenizer, work.results[span.start])
                best = hyps[0][0] if hyps else ""
                yield _ndjson({"index": index, **({"hypotheses": _hypotheses(hyps)} if req.structured
                                                  else {"translation": best}), **terms(span.start, best)})
                continue
            if not split.sentences:  # an empty or whitespace-only text: one object with its whitespace
                yield _ndjson({"index": index, "sentence": 0, "translation": split.gaps[0],
                               **({} if req.glossary is None else {"terms": []})})
            for j, unit in enumerate(span):
                await wait(work, unit + 1, state)
                hyps = hypotheses(tokenizer, work.results[unit])
                best = hyps[0][0] if hyps else ""
                yield _ndjson({"index": index, "sentence": j, "translation": split.piece(j, best),
                               **terms(unit, best)})
        count(m, encoded, work.results)
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
    refused = _unauthorized(state, request)
    if refused is not None:
        return JSONResponse({"error": str(refused)}, status_code=refused.status, headers=refused.headers)
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
        state.prepare = prepare = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare")
        state.reading = reading = ThreadPoolExecutor(READING_THREADS, thread_name_prefix="reading")
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
            prepare.shutdown(wait=False, cancel_futures=True)
            reading.shutdown(wait=False, cancel_futures=True)

    middleware = []  # the first is outermost: the access log sees preflights and CORS refusals too
    if state.access_log is not None:
        middleware.append(Middleware(AccessLog, fmt=state.access_log))
    if state.cors_origin is not None:  # browsers' pages and add-ons call the API from other origins
        middleware.append(Middleware(CORSMiddleware, allow_origins=[state.cors_origin], allow_methods=["GET", "POST"],
                                     allow_headers=["*"], max_age=600))
    app = Starlette(routes=[
        Route("/", page.page, methods=["GET"]),
        Route("/translate", translate, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/info", info, methods=["GET"]),
        Route("/languages", libre.languages, methods=["GET"]),
        Route("/detect", libre.detect, methods=["POST"]),
        Route("/frontend/settings", libre.frontend_settings, methods=["GET"]),
        Route("/translate_file", file_routes.translate_file, methods=["POST"]),
        Route("/download_file/{id}", file_routes.download_file, methods=["GET"]),
        Route("/suggest", suggestions.suggest, methods=["POST"]),
        Route("/spec", spec.spec, methods=["GET"]),
        Route("/docs", spec.docs, methods=["GET"]),
    ], lifespan=lifespan, exception_handlers={Exception: _unavailable}, middleware=middleware)
    app.state.server = state
    return app

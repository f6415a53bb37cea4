"""The HTTP routes: POST /translate, GET /health, GET /metrics, GET /info.

No route reads or writes a file; every request is bounded (bytes, seconds to send them,
lines, sentences, source tokens, tokens per line, queue places) and every refusal is a JSON
{"error": ...} with the status that tells a client what to do: 400 fix the request (naming the
field), 404 name a served model, 408 send faster, 413 split it, 503 retry later (with
Retry-After). 503 is the only 5xx: a backend fault is retried like an overload. A request's CPU
work (its JSON, sentences, tokens and answer) runs off the event loop, so no request holds the
others or /health while it is prepared."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pipeline.serve.batcher import Batcher, BatcherStopped, QueueFull, Work
from pipeline.serve.metrics import CONTENT_TYPE, ModelMetrics
from pipeline.serve.requests import (
    ApiError,
    ServedModel,
    ServerState,
    TranslateRequest,
    encode_request,
    parse_request,
    read_body,
)
from pipeline.serve.translator import Encoded
from runtime.sentences import rebuild_all
from runtime.translate import NBest

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; nobody receives it
PREPARE_THREADS = 4  # parse, split, tokenize and format requests (_off_loop), for every model
T = TypeVar("T")


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
        req = await _off_loop(state, parse_request, await read_body(request, state.limits), state)
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


async def _off_loop(state: ServerState, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on the threads that prepare requests and answers: reading a large body's JSON, splitting
    and tokenizing it, formatting its translations take CPU time in proportion to it, which on the
    event loop would hold every other request and /health. Not the backend's thread, which translates."""
    return await asyncio.get_running_loop().run_in_executor(state.prepare, functools.partial(fn, *args))


async def _submit(req: TranslateRequest, state: ServerState) -> tuple[Work, Encoded]:
    """The request encoded (its sentences, with split) within the limits and queued on its model's batcher."""
    model = req.model
    encoded = await _off_loop(state, encode_request, req, state.limits)
    if encoded.tokens == 0:  # blank lines only: nothing for the model
        return Work.finished([[] for _ in encoded.ids], req.decoding), encoded
    assert model.batcher is not None
    try:
        return model.batcher.submit(encoded.ids, req.decoding), encoded
    except QueueFull as e:
        raise _busy(f"server busy: {e}; retry later", state) from None


async def _wait(work: Work, n: int, state: ServerState) -> None:
    """Until the first n lines of the work are translated (503 if the server stopped first). It lets
    the event loop run the others first, even when they are: a long stream of lines translated already
    holds no one."""
    await asyncio.sleep(0)
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
    _count(model.metrics, encoded, work.results)
    response = await _off_loop(state, _translations, req, encoded, work.results)
    model.metrics.request_seconds.observe(time.perf_counter() - started)
    return response


def _translations(req: TranslateRequest, encoded: Encoded, results: list[NBest]) -> Response:
    """The whole answer: each line's translation (with split, each text rebuilt) or hypotheses."""
    translator = req.model.translator
    items: list[Any]
    if req.structured:
        items = [{"hypotheses": translator.hypotheses(nbest)} for nbest in results]
    else:
        items = [translator.format(nbest, 1) for nbest in results]
        if encoded.splits is not None:
            items = rebuild_all(encoded.splits, items)
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
        state.prepare = prepare = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare")
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

    app = Starlette(routes=[
        Route("/translate", translate, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/info", info, methods=["GET"]),
    ], lifespan=lifespan, exception_handlers={Exception: _unavailable})
    app.state.server = state
    return app

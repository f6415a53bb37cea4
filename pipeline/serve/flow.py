"""The one path a translation request takes, whichever API it came in by (the native one in app.py,
LibreTranslate's in libre.py): its CPU work off the event loop, encoded within the limits, queued on its
model's batcher, awaited, and dropped from the queue if the client leaves first. A language a multilingual
model needs told (the target) goes through `encode_request` (requests.py), the only place a request
becomes source ids."""

from __future__ import annotations

import asyncio
import functools
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeVar

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request

from pipeline.serve.batcher import BatcherStopped, QueueFull, Work
from pipeline.serve.metrics import ModelMetrics
from pipeline.serve.requests import ApiError, ServerState, TranslateRequest, encode_request, parse_json, read_body
from runtime.texts import EncodedTexts
from runtime.translate import NBest

T = TypeVar("T")
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
MAX_FORM_FIELDS = 2048  # above --max-lines' default: a repeated "q" is a list of texts


async def off_loop(state: ServerState, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on the threads that prepare requests and answers: parsing HTML, splitting and tokenizing a
    document, formatting its translations take CPU time in proportion to it, which on the event loop would
    hold every other request and /health. Not the backend's thread, which translates."""
    return await asyncio.get_running_loop().run_in_executor(state.prepare, functools.partial(fn, *args))


async def off_loop_reading(state: ServerState, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on the threads that read bodies (JSON, form data): apart from those preparing documents,
    so that however many large documents are being prepared, the next request's body is still read."""
    return await asyncio.get_running_loop().run_in_executor(state.reading or state.prepare,
                                                            functools.partial(fn, *args))


def busy(message: str, state: ServerState) -> ApiError:
    return ApiError(503, message, {"Retry-After": str(state.limits.retry_after_s)})


async def client_gone(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def submit(req: TranslateRequest, state: ServerState) -> tuple[Work, EncodedTexts]:
    """The request encoded by the text service (its sentences, with split; with a glossary, each one's terms)
    within the limits and queued on its model's batcher."""
    model = req.model
    encoded = await off_loop(state, encode_request, req, state.limits)
    if encoded.tokens == 0:  # blank lines only: nothing for the model
        return Work.finished([[] for _ in encoded.ids], req.decoding), encoded
    assert model.batcher is not None
    try:
        return model.batcher.submit(encoded.ids, req.decoding, req.way.first, encoded.constraints), encoded
    except QueueFull as e:
        raise busy(f"server busy: {e}; retry later", state) from None


async def wait(work: Work, n: int, state: ServerState) -> None:
    """Until the first n lines of the work are translated (503 if the server stopped first). It lets
    the event loop run the others first, even when they are: a long stream of lines translated already
    holds no one."""
    await asyncio.sleep(0)
    try:
        await work.ready(n)
    except BatcherStopped as e:
        raise busy(str(e), state) from None


async def translated(request: Request, reqs: list[TranslateRequest], state: ServerState
                     ) -> list[tuple[EncodedTexts, list[NBest]]]:
    """Every request translated, each on its own model's queue at once (one client's texts may go to
    several models); all the work is dropped if the client leaves first (ClientDisconnect)."""
    submitted: list[tuple[TranslateRequest, Work, EncodedTexts]] = []
    try:
        for req in reqs:
            work, encoded = await submit(req, state)
            submitted.append((req, work, encoded))
        waiter: asyncio.Future[Any] = asyncio.ensure_future(
            asyncio.gather(*(wait(work, len(encoded.ids), state) for _, work, encoded in submitted)))
        watcher = asyncio.ensure_future(client_gone(request))
        try:
            await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not waiter.done():
            waiter.cancel()
            # a cancelled gather holds its CancelledError as an exception: retrieved here, or asyncio logs
            # "_GatheringFuture exception was never retrieved" with a traceback for every client that left
            waiter.add_done_callback(_retrieve)
            raise ClientDisconnect()
        waiter.result()  # its ApiError, if any
    except BaseException:
        for req, work, _ in submitted:
            if not work.future.done():
                req.model.batcher.drop(work)  # type: ignore[union-attr]
        raise
    for req, work, encoded in submitted:
        count(req.model.metrics, encoded, work.results)
    return [(encoded, work.results) for _, work, encoded in submitted]


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def count(m: ModelMetrics, encoded: EncodedTexts, results: list[NBest]) -> None:
    m.sentences.inc(len(encoded.ids))
    m.src_tokens.inc(encoded.tokens)
    m.truncated.inc(sum(encoded.truncated))
    m.tgt_tokens.inc(sum(len(nbest[0][0]) + 1 for nbest in results if nbest))


async def read_payload(request: Request, state: ServerState) -> tuple[Any, bool]:
    """The body within its limits, as JSON or as fields, and whether it was fields (400 naming what is
    unreadable). Fields are read as LibreTranslate reads `request.values`: the query string's, then the form's
    (urlencoded or multipart); a request with an empty body and a query string (deep-translator sends every
    field there) is its query string's fields."""
    body = await read_body(request, state.limits)
    if is_form(request.headers, body):
        if request.headers.get("content-type", "").lower().startswith("multipart/"):
            fields = await read_multipart(request.headers, body)
        else:
            fields = await off_loop_reading(state, parse_urlencoded, body)
        return {**fields, **query_fields(request)}, True
    if not body.strip() and request.url.query:
        return query_fields(request), True
    return await off_loop_reading(state, parse_json, body), False


def query_fields(request: Request) -> dict[str, Any]:
    """The query string's fields (as form fields are read), at most MAX_FORM_FIELDS."""
    pairs = request.query_params.multi_items()
    if len(pairs) > MAX_FORM_FIELDS:
        raise ApiError(400, f"the query string has more than {MAX_FORM_FIELDS} fields")
    return _first_of_each(pairs)


def is_form(headers: Headers, body: bytes) -> bool:
    """Form data, not JSON: a form content type and a body that is not a JSON object or list (curl -d sends
    JSON with the form content type)."""
    kind = headers.get("content-type", "").split(";")[0].strip().lower()
    return kind in FORM_TYPES and body.lstrip()[:1] not in (b"{", b"[")


def parse_urlencoded(body: bytes) -> dict[str, Any]:
    """An application/x-www-form-urlencoded body's fields (the first of a repeated one, as LibreTranslate
    reads them)."""
    try:
        pairs = urllib.parse.parse_qsl(body.decode("utf-8"), keep_blank_values=True, errors="strict",
                                       max_num_fields=MAX_FORM_FIELDS)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not UTF-8 form data ({e.reason} at byte {e.start})") from None
    except ValueError as e:
        raise ApiError(400, f"request body is not readable form data: {e}") from None
    return _first_of_each(pairs)


def _first_of_each(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Fields as LibreTranslate reads them (the first of a repeated one), except a repeated "q", which is a list
    of texts (libretranslate-aio sends a list that way; LibreTranslate would take its first only)."""
    fields: dict[str, Any] = {}
    texts = [value for key, value in pairs if key == "q"]
    for key, value in pairs:
        fields.setdefault(key, value)
    if len(texts) > 1:
        fields["q"] = texts
    return fields


async def read_multipart(headers: Headers, body: bytes) -> dict[str, Any]:
    """A multipart/form-data body's text fields (python-multipart, through starlette's parser)."""
    from starlette.formparsers import MultiPartException, MultiPartParser

    async def stream() -> Any:
        yield body
        yield b""

    try:
        form = await MultiPartParser(headers, stream(), max_files=0, max_fields=MAX_FORM_FIELDS).parse()
    except AssertionError:  # starlette's "python-multipart must be installed"
        raise ApiError(415, 'multipart form data needs python-multipart on this server (pip install -e ".[serve]"); '
                            "send JSON or application/x-www-form-urlencoded") from None
    except MultiPartException as e:
        raise ApiError(400, f"request body is not readable form data: {e.message}") from None
    pairs: list[tuple[str, str]] = []
    for key, value in form.multi_items():
        if not isinstance(value, str):
            raise ApiError(400, f'form field "{key}" is a file; send text')
        pairs.append((key, value))
    return _first_of_each(pairs)

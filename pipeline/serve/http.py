"""HTTP mechanics shared by both APIs (native.py, libre.py) and their neighbours: a request body read within its
bounds (413 after a bounded drain, 408 for a stalled client) as JSON or as fields (urlencoded, multipart, the
query string), the bearer key of an Authorization header, a client that closes its connection, CPU work kept
off the event loop, and the one error path: an ApiError becomes {"error": message} with its status and headers
(`error`), a failed request's exception its answer (`failed`). Each API phrases its own messages; none of this
knows a model, a queue or a translation."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import urllib.parse
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from pipeline.serve.metrics import ModelMetrics
from pipeline.serve.options import RequestLimits

log = logging.getLogger(__name__)

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; nobody receives it
BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, which a JSON body may start with
COMPRESSED = ("gzip", "x-gzip", "deflate", "br", "zstd", "compress", "x-compress")  # Content-Encoding: refused
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
MAX_FORM_FIELDS = 2048  # fields of a form or query string, or --max-lines + OTHER_FIELDS: a repeated "q" is texts
OTHER_FIELDS = 64
# An oversized body is read and discarded up to these bounds before the 413 is sent: a client that
# is still sending when the server answers and closes gets "connection reset" instead of the answer
# (plain urllib / requests clients do). Past either bound the 413 goes out with Connection: close.
DRAIN_BYTES = 64 << 20
DRAIN_SECONDS = 30.0


class ApiError(Exception):
    """A refusal: its status, its message (the API's own words) and headers (Retry-After, WWW-Authenticate)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


class CountedDisconnect(ClientDisconnect):
    """The client left while its texts were translated, counted on the model's metrics already: its 499 is that
    model's too."""

    def __init__(self, metrics: ModelMetrics):
        super().__init__()
        self.metrics = metrics


def error(e: ApiError) -> Response:
    """The answer to a refusal, for every route: {"error": message}, its status and headers (a lone surrogate a
    message quotes from the request is escaped: UTF-8 cannot hold it)."""
    message = str(e).encode("utf-8", "backslashreplace").decode("utf-8")
    return JSONResponse({"error": message}, status_code=e.status, headers=e.headers)


def failed(e: Exception, m: ModelMetrics, retry_after_s: int, what: str) -> Response:
    """The answer to a request that failed (called in its except block): its ApiError; 499 for a client that
    left (counted once); 503 for a backend fault, logged, while the server goes on."""
    if isinstance(e, ApiError):
        return error(e)
    if isinstance(e, ClientDisconnect):
        if not isinstance(e, CountedDisconnect):
            m.disconnects.inc()
        return Response(status_code=CLIENT_CLOSED)  # the caller counts it on m (a CountedDisconnect's metrics)
    log.exception("%s failed", what)
    return error(ApiError(503, f"{what} failed ({type(e).__name__}: {e}); retry later",
                          {"Retry-After": str(retry_after_s)}))


def too_many(count: int, what: str, limit: int, option: str) -> str:
    """The 413 message: what is over which limit, and the server option that sets it."""
    return f"{count} {what}, more than this server's limit of {limit} per request ({option}); split the request"


async def off_loop(pool: Executor | None, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on `pool`: the server's threads that read bodies (JSON, form data: apart from those preparing
    documents, so that the next request's body is still read) or that prepare requests and answers (parsing
    HTML, splitting and tokenizing a document, formatting its translations take CPU time in proportion to it,
    which on the event loop would hold every other request and /health). Not the backend's thread."""
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))


def bearer(authorization: str) -> str | None:
    """The key of an `Authorization: Bearer KEY` header, or None. HTTP hands header bytes over as Latin-1;
    a client sends a non-ASCII key as UTF-8, so it is read as UTF-8 again (the key as the file holds it)."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    token = token.strip()
    try:
        return token.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return token


async def client_gone(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def read_body(request: Request, limits: RequestLimits) -> bytes:
    """The body, within body_timeout_s (408 and the connection closed beyond: a stalled client holds
    nothing). Over max_bytes, declared or streamed, a 413: at once with the connection closed for a body
    declared past DRAIN_BYTES, else once the rest of the body has been drained (within DRAIN_BYTES and the
    shorter of DRAIN_SECONDS and body_timeout_s; closed past them) so that a client still sending receives it."""
    declared = request.headers.get("content-length")
    size = int(declared) if declared is not None and declared.isdigit() else None
    stream = request.stream()
    waits = request.headers.get("expect", "").lower() == "100-continue"  # sent nothing yet: told at once, unread
    if size is not None and size > (limits.max_bytes if waits else max(limits.max_bytes, DRAIN_BYTES)):
        raise _too_large(size, limits.max_bytes, drained=False)
    encoding = request.headers.get("content-encoding", "").strip().lower()
    # read as it came, a gzip body was "not valid UTF-8 (byte 1)" (a charset sent there by mistake, "UTF-8", is read)
    if any(part.strip() in COMPRESSED for part in encoding.split(",")):
        raise ApiError(415, f"Content-Encoding {encoding[:40]!r}: this server reads request bodies as they are; send "
                            "the body unencoded", {"Connection": "close"})
    if size is None or size <= limits.max_bytes:
        try:
            body = await asyncio.wait_for(_read_within(stream, limits.max_bytes), limits.body_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
                           {"Connection": "close"}) from None
        if isinstance(body, bytes):
            return body
        seen = body
    else:
        seen = 0
    raise _too_large(size, limits.max_bytes, await _drain(stream, seen, min(DRAIN_SECONDS, limits.body_timeout_s)))


async def _read_within(stream: AsyncIterator[bytes], max_bytes: int) -> bytes | int:
    """The body, or how many bytes were read when it passed max_bytes."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in stream:
        size += len(chunk)
        if size > max_bytes:
            return size
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(declared: int | None, max_bytes: int, drained: bool) -> ApiError:
    what = "request body" if declared is None else f"request body of {declared} bytes"
    return ApiError(413, f"{what} is over this server's limit of {max_bytes} bytes (--max-bytes); split the request",
                    headers=None if drained else {"Connection": "close"})


async def _drain(stream: AsyncIterator[bytes], seen: int, seconds: float) -> bool:
    """Read and discard the rest of a body; False when it is longer than DRAIN_BYTES or slower than
    `seconds` (the connection is then closed after the answer)."""
    async def consume() -> bool:
        total = seen
        async for chunk in stream:
            total += len(chunk)
            if total > DRAIN_BYTES:
                return False
        return True

    try:
        return await asyncio.wait_for(consume(), seconds)
    except asyncio.TimeoutError:
        return False


async def read_payload(request: Request, limits: RequestLimits, pool: Executor | None) -> tuple[Any, bool]:
    """The body within its limits, as JSON or as fields, and whether it was fields (400 naming what is
    unreadable), parsed on `pool`. Fields are read as LibreTranslate reads `request.values`: the query string's,
    then the form's (urlencoded or multipart); a request with an empty body and a query string (deep-translator
    sends every field there) is its query string's fields."""
    body = await read_body(request, limits)
    if is_form(request.headers, body):
        if request.headers.get("content-type", "").lower().startswith("multipart/"):
            fields = await read_multipart(request.headers, body, limits)
        else:
            fields = await off_loop(pool, parse_urlencoded, body, limits)
        query = query_fields(request, limits)
        if "glossary" in fields and "glossary" in query:  # one would replace the other's terms
            raise ApiError(400, 'the form and the query string both give "glossary"; send one glossary holding '
                                "every term")
        return {**fields, **query}, True
    if not body.strip() and request.url.query:
        return query_fields(request, limits), True
    return await off_loop(pool, parse_json, body), False


class JsonObject(dict):
    """A JSON object that gave keys more than once: `repeated_keys` names them (the last value is kept, as json
    keeps it). What reads the object decides whether that loses anything (an inline glossary's term does)."""

    repeated_keys: tuple[str, ...] = ()


def json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: a dict, or a JsonObject naming its repeated keys."""
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    counts: dict[str, int] = {}
    for key, _ in pairs:
        counts[key] = counts.get(key, 0) + 1
    out = JsonObject(obj)
    out.repeated_keys = tuple(key for key, n in counts.items() if n > 1)
    return out


def refuse_repeated(data: Any, fields: frozenset[str] | None = None) -> None:
    """400 when a JSON object gave one of `fields` (any, without them) more than once: json keeps the last value,
    and the others would be lost without a word."""
    repeated = [k for k in getattr(data, "repeated_keys", ()) if fields is None or k in fields]
    if repeated:
        raise ApiError(400, f"field(s) {', '.join(shown(k) for k in repeated[:5])} given more than once; send each "
                            "once")


def shown(value: Any) -> str:
    """A value the client sent, as a refusal quotes it: its repr, cut to 20 characters (a lone surrogate is
    escaped, a long key is not echoed whole)."""
    text = value if isinstance(value, str) else json.dumps(value)
    return repr(text[:20]) + ("..." if len(text) > 20 else "")


def parse_json(body: bytes) -> Any:
    """The body as JSON (400 naming what is wrong: encoding, syntax, depth, a huge integer). A leading byte order
    mark is skipped, as RFC 8259 allows and LibreTranslate's Flask does."""
    try:
        decoded = body.removeprefix(BOM).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {e.start}: {body[e.start:e.start + 1]!r})"
                       ) from None
    try:
        data = json.loads(decoded, object_pairs_hook=json_object)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"request body is not JSON: {e}") from None
    except RecursionError:  # the client's mistake, not a fault to retry
        raise ApiError(400, "request body is JSON nested too deeply to read") from None
    except ValueError as e:  # an integer past Python's int-string conversion limit
        raise ApiError(400, f"request body is JSON this server cannot read: {str(e).split(';')[0]}") from None
    return data


def query_fields(request: Request, limits: RequestLimits | None = None) -> dict[str, Any]:
    """The query string's fields (as form fields are read: strict UTF-8, at most max_fields)."""
    return _urlencoded(request.scope.get("query_string", b""), "the query string", limits)


def max_fields(limits: RequestLimits | None) -> int:
    """The most fields a form or query string may have: --max-lines texts in "q", and others besides."""
    return MAX_FORM_FIELDS if limits is None else max(MAX_FORM_FIELDS, limits.max_lines + OTHER_FIELDS)


def _too_many_fields(what: str, limits: RequestLimits | None) -> ApiError:
    lines = "" if limits is None else f" (--max-lines {limits.max_lines} texts in \"q\", and other fields besides)"
    return ApiError(413, f"{what} has more than this server's limit of {max_fields(limits)} fields{lines}")


def is_form(headers: Headers, body: bytes) -> bool:
    """Form data, not JSON: a form content type and a body that is not a JSON object or list (curl -d sends
    JSON with the form content type)."""
    kind = headers.get("content-type", "").split(";")[0].strip().lower()  # a byte-order mark first (a JSON file
    return kind in FORM_TYPES and body.removeprefix(BOM).lstrip()[:1] not in (b"{", b"[")  # saved on Windows)


def parse_urlencoded(body: bytes, limits: RequestLimits | None = None) -> dict[str, Any]:
    """An application/x-www-form-urlencoded body's fields (the first of a repeated one, as LibreTranslate
    reads them)."""
    return _urlencoded(body, "request body", limits)


def _urlencoded(data: bytes, what: str, limits: RequestLimits | None) -> dict[str, Any]:
    """URL-encoded fields, strictly UTF-8 (raw or percent-encoded: a client's mistake is a 400, never text
    with replacement characters), at most max_fields (413)."""
    try:
        pairs = urllib.parse.parse_qsl(data.decode("utf-8"), keep_blank_values=True, errors="strict",
                                       max_num_fields=max_fields(limits))
    except UnicodeDecodeError as e:
        raise ApiError(400, f"{what} is not UTF-8 form data ({e.reason} at byte {e.start})") from None
    except ValueError:  # parse_qsl's only other refusal: "Max number of fields exceeded"
        raise _too_many_fields(what, limits) from None
    return _first_of_each(pairs)


def _first_of_each(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Fields as LibreTranslate reads them (the first of a repeated one), except a repeated "q", which is a list
    of texts (libretranslate-aio sends a list that way; LibreTranslate would take its first only), and a
    repeated "glossary", our extension, which is refused (the terms of the others were dropped in silence)."""
    fields: dict[str, Any] = {}
    texts = [value for key, value in pairs if key == "q"]
    for key, value in pairs:
        if key == "glossary" and key in fields:
            raise ApiError(400, 'the form gives "glossary" more than once; send one glossary holding every term')
        fields.setdefault(key, value)
    if len(texts) > 1:
        fields["q"] = texts
    return fields


@functools.cache
def strict_multipart() -> Any:
    """starlette's multipart parser, refusing a text field that is not in its charset (starlette reads one as
    Latin-1: mojibake translated with a 200), as urlencoded fields and JSON are refused, and a body cut short
    (python-multipart drops an unfinished last part: a 200 without a q, or without format=html)."""
    from starlette.formparsers import MultiPartException, MultiPartParser

    class Strict(MultiPartParser):
        ended = False

        def on_end(self) -> None:  # the close delimiter, --boundary--
            self.ended = True

        async def parse(self) -> Any:
            form = await super().parse()
            if not self.ended:
                raise MultiPartException("it ends before its closing boundary (--BOUNDARY--), so its last part may "
                                         "be cut short; nothing of it was used")
            return form

        def on_part_end(self) -> None:
            part = self._current_part
            if part.file is None:
                try:
                    part.data.decode(self._charset or "utf-8")
                except (UnicodeDecodeError, LookupError) as e:
                    where = f"at byte {e.start}" if isinstance(e, UnicodeDecodeError) else "an unknown charset"
                    raise ApiError(400, f"form field {part.field_name!r} is not {self._charset or 'UTF-8'} text "
                                        f"({where})") from None
            super().on_part_end()

    return Strict


async def read_multipart(headers: Headers, body: bytes, limits: RequestLimits | None = None) -> dict[str, Any]:
    """A multipart/form-data body's text fields (python-multipart, through starlette's parser)."""
    from starlette.formparsers import MultiPartException

    async def stream() -> Any:
        yield body
        yield b""

    try:
        form = await strict_multipart()(headers, stream(), max_files=0, max_fields=max_fields(limits)).parse()
    except AssertionError:  # starlette's "python-multipart must be installed"
        raise ApiError(415, 'multipart form data needs python-multipart on this server (pip install -e ".[serve]"); '
                            "send JSON or application/x-www-form-urlencoded") from None
    except MultiPartException as e:
        if "files" in e.message:  # max_files=0: any part with a filename
            raise ApiError(400, "the form data holds a file; this route takes text fields (a document goes to "
                                "POST /translate_file)") from None
        if "fields" in e.message:  # "Too many fields. Maximum number of fields is N."
            raise _too_many_fields("request body", limits) from None
        raise ApiError(400, f"request body is not readable form data: {e.message}") from None
    pairs: list[tuple[str, str]] = []
    for key, value in form.multi_items():
        pairs.append((key, str(value)))
    return _first_of_each(pairs)

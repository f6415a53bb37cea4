"""Connections before a request reaches the app: uvicorn's httptools protocol with the bounds it lacks.

uvicorn waits for a request's head (request line and headers) without a time limit, buffers it without a size
limit (httptools accumulates a header however long), and keeps every connection it accepts: a few hundred clients
that connect and send nothing (or trickle a header) held the file descriptors /health needs, and one that sent a
gigabyte of headers held that much memory. Here a head must arrive within `head_timeout_s` (408, then closed) and
within MAX_HEAD_BYTES (431, then closed; a request target past MAX_URL_BYTES, which uvicorn could not read, is
a 414), and beyond `max_connections` open connections the one that has waited
longest for its head is closed (503), so an idle flood churns among itself while a client that sends its request
in time is served (a connection kept alive goes once idle IDLE_S). A client that reads nothing of its responses
for SEND_TIMEOUT_S is dropped (uvicorn has no send timeout). Between requests uvicorn's keep-alive timeout closes
an idle connection as before; bytes that begin no request there (a stray CRLF cancelled that timeout) have
`head_timeout_s` to become one. A chunked body's framing and trailer between two pieces of body are bounded as a
head is (httptools accumulates a trailer field however long). The parser is fed FEED_BYTES at a time and not at
all while a pipelined request waits its turn: a read of thousands of tiny pipelined requests was parsed at once,
each held as a request object (one 64 KiB write of them: 1,986 queued), where now the bytes wait as bytes.
Without httptools (not the serve extra) uvicorn's h11 protocol runs as it is: its head limit is 16 KiB, with no
timeout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import time
from typing import Any

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 << 10  # a request line and headers together (nginx's large_client_header_buffers: 4 x 8 KiB)
SEND_TIMEOUT_S = 60.0  # a response its client does not read for this long: the connection is dropped (nginx's
# send_timeout): clients that never read held their connections for ever, and --max-connections of them locked out
IDLE_S = 1.0  # a connection kept alive makes room for a new one once idle this long
WARN_EVERY_S = 10.0  # refusals are logged at most this often (a flood would otherwise fill the log)
FD_MARGIN = 64  # file descriptors kept for the model files, the listening socket, logs, /health
FEED_BYTES = 16 << 10  # bytes handed to the parser at a time (a read is up to 256 KiB)
MAX_URL_BYTES = 65535  # the longest request target httptools.parse_url reads (16-bit offsets): past it, a 414


def connection_cap(wanted: int) -> int:
    """`wanted`, within the process's file descriptors: the soft limit is raised to the hard one first (a
    server's usual first step: 1024 is a common default), and FD_MARGIN of them are kept for everything else;
    a cap lowered so is said once."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > soft):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return wanted
    cap = max(1, min(wanted, soft - FD_MARGIN))
    if cap < wanted:
        log.warning("--max-connections %d: this process may open %d files, so at most %d connections", wanted,
                    soft, cap)
    return cap


class _Warnings:
    """Counts refusals by kind and logs them at most every WARN_EVERY_S."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.logged = 0.0

    def add(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        now = time.monotonic()
        if now - self.logged >= WARN_EVERY_S:
            log.warning("connections closed to keep within the limits: %s", ", ".join(f"{n} {k}" for k, n in
                                                                                   sorted(self.counts.items())))
            self.counts, self.logged = {}, now


def bounded_protocol(head_timeout_s: float, max_connections: int, cors_origin: str | None = None) -> Any:
    """uvicorn's `http` setting: its httptools protocol with the bounds above, or "auto" without httptools. Its own
    answers carry `cors_origin` (--cors-origin) as the app's do: a browser's page reads why, not a CORS error."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        log.warning("httptools is not installed (the serve extra has it): uvicorn's h11 parser takes requests, "
                    "their heads bounded to 16 KiB but not in time, and --max-connections is not applied")
        return "auto"
    cap, warnings = connection_cap(max_connections), _Warnings()
    cors = "" if cors_origin is None else f"access-control-allow-origin: {cors_origin}\r\n" + (
        "" if cors_origin == "*" else "vary: Origin\r\n")  # (the headers are not read: the same for every origin)
    waiting: dict[Any, None] = {}  # the connections waiting for a request's head, oldest first

    class Bounded(HttpToolsProtocol):
        _timer: asyncio.TimerHandle | None = None
        _in_head = True  # from the connection (or a request's first byte) until its headers are complete
        _head = 0  # bytes of chunks read wholly inside an unfinished head
        _messages = 0  # requests begun on this connection
        _idle_since = 0.0  # when its last response ended (kept alive)
        _send_timer: asyncio.TimerHandle | None = None  # while the client reads nothing of a response
        _pending = b""  # bytes read and not yet parsed (from _at on): behind a pipelined request waiting its turn
        _at = 0
        _in_body = False  # from a request's headers until its message is complete
        _framing = 0  # bytes since the last piece of body: a chunked body's framing and trailer
        _bodied = False  # whether the piece being parsed held body
        _unparsable: str | None = None  # bytes no request begins with, read behind a response being written
        _dead = False  # the parser failed: nothing more is parsed, and what is read is dropped, not held

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()
            if len(self.connections) > cap:  # the one idle longest goes: a flood of idle ones churns among
                warnings.add(f"over --max-connections {cap}")  # themselves, and a client that sends its
                now = self.loop.time()  # request in time gets in (this one itself, when none may go)
                next(c for c in waiting if not c._answering() and (c._in_head or now - c._idle_since >= IDLE_S)
                     )._make_room()

        def _answering(self) -> bool:
            """Whether a response is being written on this connection (a pipelined request behind it)."""
            return self.cycle is not None and not self.cycle.response_complete

        def _make_room(self) -> None:
            if self._in_head:  # asked to send a request: told to retry
                self._refuse(503, "Service Unavailable", "too many open connections; retry", retry=True)
            else:  # idle between requests: closed, as uvicorn's keep-alive timeout closes it
                self._disarm()
                self.transport.close()

        def _arm(self) -> None:
            self._disarm()
            self._timer = self.loop.call_later(head_timeout_s, self._late)
            waiting[self] = None

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            waiting.pop(self, None)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._messages = True, self._messages + 1
            self._arm()

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            if len(self.url) > MAX_URL_BYTES:  # parse_url would fail on it: uvicorn's 400 "Invalid HTTP request"
                raise ValueError("request target too long")  # stops the parser: send_400_response says 414

        def on_headers_complete(self) -> None:
            self._in_head, self._head, self._in_body, self._framing = False, 0, True, 0
            self._disarm()
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            self._bodied = True
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._in_body = False
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.timeout_keep_alive_task is not None and not self._in_head:  # idle until its keep-alive ends:
                self._idle_since = self.loop.time()  # it may make room for a new connection once idle IDLE_S (a
                waiting[self] = None  # client may be sending its next request on it at once: closed, it was reset)
            if self._unparsable is not None:  # sent once the responses before it are complete
                if not self._answering() and not self.transport.is_closing():
                    self.send_400_response(self._unparsable)
            elif self._at < len(self._pending):  # the next pipelined request's turn
                self._feed()

        def data_received(self, data: bytes) -> None:
            if self._dead:  # the parser has failed: what follows is dropped, not held
                return
            self._pending, self._at = (self._pending[self._at:] + data if self._at < len(self._pending) else data), 0
            self._feed()

        def _feed(self) -> None:
            """Parses what was read, FEED_BYTES at a time, until a pipelined request waits behind the one being
            answered: the rest waits as bytes, with reading paused, until its turn (on_response_complete)."""
            while (self._at < len(self._pending) and not self.pipeline and not self._dead
                   and not self.transport.is_closing()):
                piece = self._pending[self._at:self._at + FEED_BYTES]
                self._at += len(piece)
                self._parse(piece)
            if self._at >= len(self._pending):
                self._pending, self._at = b"", 0
            elif not self.transport.is_closing():
                self.flow.pause_reading()  # resumed when a response completes (uvicorn's on_response_complete)
            if (self._timer is None and self.timeout_keep_alive_task is None and not self._answering()
                    and not self.pipeline and not self._in_body  # (the rest of a body answered early is not one)
                    and not self.transport.is_closing()):  # bytes that begin no request (a
                self._in_head = True  # stray CRLF between requests cancelled the keep-alive timeout): they have
                self._arm()  # head_timeout_s to become one, as a new connection has

        def _parse(self, piece: bytes) -> None:
            began, self._bodied = self._messages, False
            super().data_received(piece)
            if self._in_head and self._messages - began <= (began == 0):  # the whole piece lies in one unfinished
                self._head += len(piece)  # head (one begun in it after a pipelined body is not counted: <= a piece)
            elif self._in_body:  # framing and trailer accumulate only between pieces of body
                self._framing = 0 if self._bodied else self._framing + len(piece)
            if self.transport.is_closing() or self._dead:
                return
            if self._in_head and self._head > MAX_HEAD_BYTES:
                self._refuse(431, "Request Header Fields Too Large",
                             f"the request line and headers exceed {MAX_HEAD_BYTES // 1024} KiB")
            elif self._in_body and self._framing > MAX_HEAD_BYTES:
                self._refuse(431, "Request Header Fields Too Large", "a chunked body's framing or trailer exceeds "
                             f"{MAX_HEAD_BYTES // 1024} KiB")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._send_timer is not None:
                self._send_timer.cancel()
            super().connection_lost(exc)

        def pause_writing(self) -> None:  # the transport's buffer is full: the client is not reading
            super().pause_writing()
            if self._send_timer is None:
                self._send_timer = self.loop.call_later(SEND_TIMEOUT_S, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None

        def _stalled(self) -> None:
            self._send_timer = None
            warnings.add("not reading their responses")
            self.transport.abort()  # close() would wait for the buffer the client does not read

        def _late(self) -> None:
            self._timer = None
            if self._answering():  # a pipelined head behind a response still being written: its time starts after
                self._arm()
            elif self._in_head and not self.transport.is_closing():
                self._refuse(408, "Request Timeout",
                             f"the request line and headers did not arrive within {head_timeout_s:g} s")

        def _refuse(self, status: int, reason: str, message: str, retry: bool = False) -> None:
            self._disarm()
            if status != 503:
                warnings.add(str(status))
            if not self._answering() or (self._in_body and not self.cycle.response_started):  # an answer to
                self._answer(status, reason, message, "retry-after: 1\r\n" if retry else "")  # this request;
            self.transport.close()  # never inside another's response: the connection is closed alone

        def send_400_response(self, msg: str) -> None:  # uvicorn's, for a request httptools cannot parse
            self._disarm()
            self._dead, self._pending, self._at = True, b"", 0
            if self._in_body and self.pipeline:  # the body of a request queued behind another: its turn answers
                cycle, _ = self.pipeline[0]  # the 400 (then the close); written now, it broke into the response
                self.pipeline[0] = (cycle, _refusing(400, msg))  # before it, or took its place
                return
            if self._answering() and not self._in_body:  # bytes behind requests read whole: their responses
                self._unparsable = msg  # end first, then this one and the close
                self.flow.pause_reading()  # (written at once, it broke into a response being streamed)
                return
            if self._answering() and self.cycle.response_started:  # this request's body, after its response
                self.transport.close()  # began: nothing can be said inside it
                return
            if len(getattr(self, "url", b"")) > MAX_URL_BYTES:  # (unset before a message begins)
                warnings.add("414")
                self._answer(414, "URI Too Long", f"the request target (path and query) exceeds {MAX_URL_BYTES} "
                             "bytes; send the texts in the body (JSON or form data)")
            else:
                self._answer(400, "Bad Request", msg)
            self.transport.close()

        def _answer(self, status: int, reason: str, message: str, extra: str = "") -> None:
            """{"error"} as every refusal of the app is (these were plain text)."""
            body = json.dumps({"error": message}).encode() + b"\n"
            self.transport.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
                                 f"content-length: {len(body)}\r\n{extra}{cors}connection: close\r\n\r\n".encode()
                                 + body)

    def _refusing(status: int, message: str) -> Any:
        """An ASGI app answering {"error": message} with `status` and closing the connection after it."""
        async def app(scope: Any, receive: Any, send: Any) -> None:
            body = json.dumps({"error": message}).encode() + b"\n"
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            if cors_origin is not None:
                headers.append((b"access-control-allow-origin", cors_origin.encode()))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        return app

    return Bounded

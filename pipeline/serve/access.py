"""Who may come in, and what came: API keys (`pipeline serve --api-keys FILE`) with their rates, and the access log.

The file holds one key per line, optionally followed by the most requests that key may make in any 60
seconds; blank lines and lines starting with # are skipped:

    # key                               requests per minute (none: no limit)
    3f1c9a6e0b7d4e52a8c1f0e9d2b7a6c4    120
    ops-dashboard-key

The file may start with a UTF-8 byte-order mark (Windows editors write one); it is read up to MAX_FILE_BYTES,
so a device or a runaway file is refused, not read without end. Keys are held as SHA-256 digests in a dict:
a given key is hashed once and looked up, so a check costs the same with 10 keys or 200,000, and its time
depends on the digest of the guess, never on how many characters of a stored key it shares. A key is never
logged or put in an error message. /health and /metrics need no key.

The access log (`pipeline serve --access-log`, on by default): one line per request on stderr, so an operator
sees why a client says "translation failed". Each line has the method, path, status, milliseconds and, where
the route knew them, the model, the number of texts and the key's line in the keys file (never the key);
`--log-format json` writes each as one JSON object.

It is ASGI middleware around the whole app (preflights and refusals included); a route adds what it knows
with `note(request, ...)`."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sys
import threading
import time
from collections import deque
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from model.errors import UserError

WINDOW_S = 60.0
MAX_FILE_BYTES = 64 << 20  # about a million keys
MAX_CLIENTS = 100_000  # keyless client addresses tracked before the quiet ones are forgotten
MAX_KEY_CHARS = 512  # a longer key in the file is refused at start; a longer one given is not looked up


@dataclass
class _Key:
    digest: bytes
    per_minute: int | None
    label: str  # "line N": how the server names a key in its own messages
    recent: deque[float] = field(default_factory=deque)


ADMISSION = "pipeline.admission"  # the request's Admission, in its ASGI scope


@dataclass
class Admission:
    """One request counted in a rate (`label`: its key's line, or "keyless"); `refund` takes it back out."""

    label: str
    recent: deque[float] | None = None
    at: float = 0.0
    lock: threading.Lock | None = None

    def refund(self) -> None:
        if self.recent is not None and self.lock is not None:
            with self.lock:
                try:
                    self.recent.remove(self.at)
                except ValueError:  # already out of the window
                    pass
            self.recent = None


def settle(scope: MutableMapping[str, Any], status: int) -> None:
    """A request answered 503 (the queue full, the server stopping, a backend fault: nothing served, and the
    client told to retry) is taken out of its rate: tries at a busy server spent a key's minute and the first
    served request was a 429. Refused requests (4xx) count: the server read them."""
    admission = scope.pop(ADMISSION, None)
    if status == 503 and admission is not None:
        admission.refund()


class KeyRefused(Exception):
    """A key not in the file ("invalid"), or none where one is required ("missing")."""


class RateLimited(Exception):
    """Over the key's requests per minute; `retry_after_s` until one more is allowed."""

    def __init__(self, message: str, retry_after_s: int, label: str = ""):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.label = label  # the key's, for the access log (which customer is over its rate)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
    """The keys of --api-keys and the rule for requests without one: served at `keyless_per_minute` per client
    address (None: no limit), as LibreTranslate serves them at its default rate, unless `require` is set."""

    def __init__(self, keys: list[_Key], keyless_per_minute: int | None = None, require: bool = False):
        self._keys = {key.digest: key for key in keys}
        self._lock = threading.Lock()
        self.keyless_per_minute = keyless_per_minute or None  # 0 as the option says it: no limit
        self.require = require
        self._keyless: dict[str, deque[float]] = {}  # client address -> its recent keyless requests
        self.clock = time.monotonic  # what the rates count time by

    @classmethod
    def read(cls, path: str, keyless_per_minute: int | None = None, require: bool = False) -> ApiKeys:
        """The keys of FILE (UserErrors name the file and line; the key itself is never repeated)."""
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
            if len(raw) > MAX_FILE_BYTES:
                raise UserError(f"--api-keys {path}: the file is over {MAX_FILE_BYTES >> 20} MiB; give a file of "
                                "keys, one per line")
            text = raw.decode("utf-8-sig")  # a byte-order mark is not part of the first key
        except UnicodeDecodeError as e:  # named by its line, never quoting the bytes (they may be a key's)
            lineno = raw[:e.start].count(b"\n") + 1
            raise UserError(f"--api-keys {path}:{lineno}: not UTF-8 text; save the file as UTF-8") from None
        except OSError as e:
            raise UserError(f"--api-keys {path}: cannot read it ({e.strerror or e})") from None
        keys: list[_Key] = []
        seen: set[bytes] = set()
        for n, line in enumerate(text.splitlines(), 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            where = f"--api-keys {path} line {n}"
            if len(fields) > 2 or (len(fields) == 2 and not (fields[1].isascii() and fields[1].isdigit()
                                                               and int(fields[1]) > 0)):  # '²' and '３' are digits
                raise UserError(f"{where}: write KEY or KEY REQUESTS_PER_MINUTE (a whole number above 0)")
            if not 8 <= len(fields[0]) <= MAX_KEY_CHARS:
                raise UserError(f"{where}: a key must have 8 to {MAX_KEY_CHARS} characters")
            digest = _digest(fields[0])
            if digest in seen:
                raise UserError(f"{where}: this key is in the file twice")
            seen.add(digest)
            keys.append(_Key(digest, int(fields[1]) if len(fields) == 2 else None, f"line {n}"))
        if not keys:
            raise UserError(f"--api-keys {path}: the file holds no key (one per line: KEY [REQUESTS_PER_MINUTE])")
        return cls(keys, keyless_per_minute, require)

    def __len__(self) -> int:
        return len(self._keys)

    def check(self, given: str | None, client: str = "") -> Admission:
        """Accept one request with this key (or none, from this client address): its Admission, labelled for the
        access log ("line N", or "keyless"). KeyRefused when unknown, or missing where required; RateLimited
        over the key's rate, or a keyless client's."""
        if not given:
            if self.require:
                raise KeyRefused("missing")
            if self.keyless_per_minute is None:
                return Admission("keyless")
            with self._lock:
                if len(self._keyless) > MAX_CLIENTS:  # a flood of addresses: forget the quiet ones
                    self._forget(self.clock())
                recent = self._keyless.setdefault(client, deque())
                now = _admit(recent, self.keyless_per_minute, "a client without an API key", self.clock(),
                             "keyless")
            return Admission("keyless", recent, now, self._lock)
        found = self._keys.get(_digest(given)) if len(given) <= MAX_KEY_CHARS else None
        if found is None:
            raise KeyRefused("invalid")
        if found.per_minute is None:
            return Admission(found.label)
        with self._lock:
            now = _admit(found.recent, found.per_minute, "this API key", self.clock(), found.label)
        return Admission(found.label, found.recent, now, self._lock)

    def _forget(self, now: float) -> None:
        for client in [c for c, recent in self._keyless.items() if not recent or recent[-1] <= now - WINDOW_S]:
            del self._keyless[client]


def _admit(recent: deque[float], per_minute: int, who: str, now: float, label: str) -> float:
    """One more request in the window of `recent` (at `now`, returned), or RateLimited with the seconds until one
    is allowed."""
    while recent and recent[0] <= now - WINDOW_S:
        recent.popleft()
    if len(recent) >= per_minute:
        wait = max(1, math.ceil(recent[0] + WINDOW_S - now))
        raise RateLimited(f"{who} may make {per_minute} requests per minute; retry in {wait} s", wait, label)
    recent.append(now)
    return now

log = logging.getLogger("pipeline.access")
SCOPE_KEY = "pipeline.access"
ORDER = ("model", "texts", "key")


def note(request: Request, **fields: Any) -> None:
    """What the route learned of this request (model, texts, key) for its access-log line."""
    noted = request.scope.get(SCOPE_KEY)
    if noted is not None:
        noted.update({k: v for k, v in fields.items() if v is not None})


def configure(fmt: str) -> None:
    """The access log's own handler: plain lines (text) or JSON lines (json) on stderr, not through the root
    logger's format, so a JSON line is nothing but JSON."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s" if fmt == "json" else
                                           "%(asctime)s access: %(message)s", datefmt="%H:%M:%S"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


class AccessLog:
    """ASGI middleware writing one line per HTTP request when it ends."""

    def __init__(self, app: Any, fmt: str = "text"):
        self.app, self.fmt = app, fmt

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        noted: dict[str, Any] = {}
        scope[SCOPE_KEY] = noted
        status = [0]

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            ms = round((time.perf_counter() - started) * 1000, 1)
            client = scope.get("client")
            line = {"method": scope["method"], "path": scope["path"], "status": status[0] or 499, "ms": ms,
                    "client": client[0] if client else None, **noted}
            if self.fmt == "json":
                log.info("%s", json.dumps(line, ensure_ascii=False))
            else:
                extra = " ".join(f"{k}={json.dumps(v) if ' ' in str(v) else v}" for k, v in sorted(
                    noted.items(), key=lambda kv: ORDER.index(kv[0]) if kv[0] in ORDER else len(ORDER)))
                path = line["path"] if line["path"].isprintable() else json.dumps(line["path"])  # one line each
                log.info("%s %s %d %.1f ms%s", line["method"], path, line["status"], ms, f" {extra}" if extra else "")

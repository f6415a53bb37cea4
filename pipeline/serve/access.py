"""The access log (`pipeline serve --access-log`, on by default): one line per request on stderr, so an operator
sees why a client says "translation failed". Each line has the method, path, status, milliseconds and, where
the route knew them, the model, the number of texts and the key's line in the keys file (never the key);
`--log-format json` writes each as one JSON object.

It is ASGI middleware around the whole app (preflights and refusals included); a route adds what it knows
with `note(request, ...)`."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from starlette.requests import Request

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

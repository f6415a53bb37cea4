"""POST /suggest (LibreTranslate's): a user's better translation of a text, kept in SQLite for whoever improves
the model (`pipeline serve --suggestions DB`; without it the route answers 403 "Suggestions are disabled on
this server.", LibreTranslate's words). The table is LibreTranslate's (q, s, source, target) with the time it
came; each write is committed before the answer, off the event loop. Each text is bounded by the request body
limit, and the table by MAX_ROWS and by MAX_TEXT_BYTES of q and s together (beyond either: 507, nothing is
dropped), so anonymous clients cannot fill the disk."""

from __future__ import annotations

import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from model.errors import UserError
from pipeline.serve.http import ApiError, error, off_loop, read_payload, refuse_repeated
from pipeline.serve.libre import check_key
from pipeline.serve.state import ServerState
from runtime.languages import LANG_CODE
from runtime.translate import not_text

MAX_ROWS = 1_000_000
MAX_TEXT_BYTES = 1 << 30  # the UTF-8 bytes of every suggestion's q and s
BUSY_S = 2.0  # how long a write waits for another process' lock on the database before its 503
RETRY_AFTER_S = 5


class Suggestions:
    """The suggestions database (created when missing)."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        # its own thread: a write waiting on a lock another process holds waits there, not in the threads that
        # read every request's body
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="suggestions")
        try:
            self._db = sqlite3.connect(path, timeout=BUSY_S, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute('CREATE TABLE IF NOT EXISTS suggestions ("q" TEXT NOT NULL, "s" TEXT NOT NULL, '
                             '"source" TEXT NOT NULL, "target" TEXT NOT NULL, "created" REAL)')
            self._db.commit()
            self._rows, self._bytes = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(LENGTH(CAST(q AS BLOB)) + LENGTH(CAST(s AS BLOB))), 0) "
                "FROM suggestions").fetchone()
        except sqlite3.Error as e:
            raise UserError(f"--suggestions {path}: cannot use it as an SQLite database ({e})") from None

    def add(self, q: str, s: str, source: str, target: str) -> None:
        with self._lock:
            size = len(q.encode()) + len(s.encode())
            if self._rows >= MAX_ROWS or self._bytes + size > MAX_TEXT_BYTES:
                held = f"{MAX_ROWS} suggestions" if self._rows >= MAX_ROWS else \
                    f"{self._bytes} bytes of suggestions, and this one's {size} would pass {MAX_TEXT_BYTES}"
                raise ApiError(507, f"the suggestions database holds {held}, its limit; the operator must move them "
                                    "elsewhere")
            try:
                self._db.execute("INSERT INTO suggestions (q, s, source, target, created) VALUES (?, ?, ?, ?, ?)",
                                 (q, s, source, target, time.time()))
                self._db.commit()
            except sqlite3.Error as e:  # locked by another process past BUSY_S, a full disk, a damaged file
                self._db.rollback()
                raise ApiError(503, f"the suggestions database cannot take it now ({e}); retry later",
                               {"Retry-After": str(RETRY_AFTER_S)}) from None
            self._rows += 1
            self._bytes += size

    def close(self) -> None:
        self.writer.shutdown(wait=True)
        with self._lock:
            self._db.close()


def _fields(data: Any, state: ServerState) -> tuple[str, str, str, str]:
    """q, s, source and target as /translate reads its fields: each once, codes in any case (stored as the
    served models spell them)."""
    if not isinstance(data, dict):
        raise ApiError(400, 'request body must be a JSON object like {"q": "...", "s": "...", "source": "de", '
                            '"target": "en"}')
    refuse_repeated(data, frozenset({"q", "s", "source", "target", "api_key"}))
    values = []
    for key in ("q", "s", "source", "target"):
        value = data.get(key)
        if not value:
            raise ApiError(400, f"Invalid request: missing {key} parameter")
        if not isinstance(value, str):
            raise ApiError(400, f'"{key}" must be a string')
        if key in ("source", "target") and not LANG_CODE.fullmatch(value):
            raise ApiError(400, f'"{key}" must be a language code like "de", not {value[:20]!r}')
        if why := not_text(value):
            raise ApiError(400, f"{key} holds {why}")
        values.append(state.routes.spelled(value) if key in ("source", "target") else value)
    q, s, source, target = values
    return q, s, source, target


async def suggest(request: Request) -> Response:
    """POST /suggest {q, s, source, target, api_key?}: {"success": true} once stored."""
    state: ServerState = request.app.state.server
    try:
        if state.suggestions is None:
            raise ApiError(403, "Suggestions are disabled on this server.")
        data, _ = await read_payload(request, state.limits, state.reading)
        check_key(state, data.get("api_key") if isinstance(data, dict) else None, request)
        fields = _fields(data, state)
        await off_loop(state.suggestions.writer, state.suggestions.add, *fields)
        return JSONResponse({"success": True})
    except ApiError as e:
        return error(e)

"""POST /suggest (LibreTranslate's): off unless --suggestions DB (403 in LibreTranslate's words), each suggestion
committed to SQLite before the answer, the fields checked as /translate's, the key rules of the API."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
pytest.importorskip("sentencex")

from starlette.testclient import TestClient  # noqa: E402
from test_serve_bounds import state_of  # noqa: E402

from model.errors import UserError  # noqa: E402
from pipeline.serve import suggestions  # noqa: E402
from pipeline.serve.access import ApiKeys  # noqa: E402
from pipeline.serve.app import create_app  # noqa: E402

PAIRS = {"de-en": (("de",), ("en",))}


def test_off_unless_a_database_is_given():
    with TestClient(create_app(state_of(PAIRS))) as c:
        r = c.post("/suggest", json={"q": "Hund", "s": "dog", "source": "de", "target": "en"})
        assert r.status_code == 403 and r.json() == {"error": "Suggestions are disabled on this server."}


def test_suggestions_are_stored_and_checked(tmp_path: Path, monkeypatch):
    db = tmp_path / "suggestions.db"
    keys = tmp_path / "keys.txt"
    keys.write_text("a-key-for-tests\n")
    state = state_of(PAIRS, ApiKeys.read(str(keys)))
    state.suggestions = suggestions.Suggestions(db)
    with TestClient(create_app(state)) as c:
        assert c.post("/suggest", json={"q": "Hund", "s": "dog", "source": "de", "target": "en"}).json() == \
            {"success": True}
        assert c.post("/suggest", data={"q": "Katze", "s": "cat", "source": "de", "target": "en",
                                        "api_key": "a-key-for-tests"}).json() == {"success": True}
        for body, needle in (({"s": "x", "source": "de", "target": "en"}, "missing q parameter"),
                             ({"q": "x", "source": "de", "target": "en"}, "missing s parameter"),
                             ({"q": "x", "s": "y", "source": "de!", "target": "en"}, '"source" must be'),
                             ({"q": ["x"], "s": "y", "source": "de", "target": "en"}, '"q" must be a string')):
            r = c.post("/suggest", json=body)
            assert r.status_code == 400 and needle in r.json()["error"], r.text
        r = c.post("/suggest", json={"q": "x", "s": "y", "source": "de", "target": "en", "api_key": "wrong-one-1"})
        assert r.status_code == 403
        # as /translate: a field given twice is refused, a code in another case stored as the models spell it
        r = c.post("/suggest", content=b'{"q": "a", "q": "b", "s": "c", "source": "de", "target": "en"}',
                   headers={"content-type": "application/json"})
        assert r.status_code == 400 and "given more than once" in r.json()["error"]
        assert c.post("/suggest", json={"q": "Vogel", "s": "bird", "source": "DE", "target": "En"}).status_code == 200
        # bounded in bytes too: rows of 1 MiB each were 1 TiB under the row limit alone
        monkeypatch.setattr(suggestions, "MAX_TEXT_BYTES", 30)
        r = c.post("/suggest", json={"q": "Maus", "s": "mäuse ja", "source": "de", "target": "en"})
        assert r.status_code == 507 and "holds 24 bytes of suggestions, and this one's 13 would pass 30" in \
            r.json()["error"], r.text
        monkeypatch.setattr(suggestions, "MAX_TEXT_BYTES", 1 << 30)
        monkeypatch.setattr(suggestions, "MAX_ROWS", 2)
        r = c.post("/suggest", json={"q": "Maus", "s": "mouse", "source": "de", "target": "en"})
        assert r.status_code == 507 and "its limit" in r.json()["error"]
    state.suggestions.close()
    rows = sqlite3.connect(db).execute("SELECT q, s, source, target FROM suggestions ORDER BY rowid").fetchall()
    assert rows == [("Hund", "dog", "de", "en"), ("Katze", "cat", "de", "en"), ("Vogel", "bird", "de", "en")]
    reopened = suggestions.Suggestions(db)
    assert (reopened._rows, reopened._bytes) == (3, 24)  # counted again when reopened


def test_a_database_that_is_not_one_is_one_line(tmp_path: Path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(UserError, match="--suggestions .*bad.db: cannot use it as an SQLite database"):
        suggestions.Suggestions(bad)


def test_a_database_locked_by_another_process_is_a_503_with_the_apis_headers(tmp_path: Path, monkeypatch, caplog):
    """Another process holding the database's lock: the write waited 5 s in one of the two threads that read every
    request's body (so /translate waited too), then escaped as an OperationalError, answered outside the
    middleware: no CORS header for the page that sent it, a traceback in the log, 499 in the access log."""
    import logging
    import threading

    monkeypatch.setattr(suggestions, "BUSY_S", 0.05)
    db = tmp_path / "suggestions.db"
    state = state_of(PAIRS)
    state.suggestions = suggestions.Suggestions(db)
    state.access_log = "json"
    threads = []
    add = suggestions.Suggestions.add
    monkeypatch.setattr(suggestions.Suggestions, "add",
                        lambda self, *a: threads.append(threading.current_thread().name) or add(self, *a))
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with TestClient(create_app(state)) as c, caplog.at_level(logging.INFO):
            r = c.post("/suggest", json={"q": "Hund", "s": "dog", "source": "de", "target": "en"},
                       headers={"Origin": "https://example.org"})
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert r.status_code == 503 and "retry later" in r.json()["error"] and r.headers["retry-after"], r.text
    assert r.headers["access-control-allow-origin"] == "*"
    assert threads and all(name.startswith("suggestions") for name in threads)
    assert not any(rec.exc_info for rec in caplog.records)
    logged = [rec.getMessage() for rec in caplog.records if '"/suggest"' in rec.getMessage()]
    assert logged and '"status": 503' in logged[0], logged
    state.suggestions.close()

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
from pipeline.serve.app import create_app  # noqa: E402
from pipeline.serve.keys import ApiKeys  # noqa: E402

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
        monkeypatch.setattr(suggestions, "MAX_ROWS", 2)
        r = c.post("/suggest", json={"q": "Maus", "s": "mouse", "source": "de", "target": "en"})
        assert r.status_code == 507 and "its limit" in r.json()["error"]
    state.suggestions.close()
    rows = sqlite3.connect(db).execute("SELECT q, s, source, target FROM suggestions ORDER BY rowid").fetchall()
    assert rows == [("Hund", "dog", "de", "en"), ("Katze", "cat", "de", "en")]
    assert suggestions.Suggestions(db)._rows == 2  # counted again when reopened


def test_a_database_that_is_not_one_is_one_line(tmp_path: Path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(UserError, match="--suggestions .*bad.db: cannot use it as an SQLite database"):
        suggestions.Suggestions(bad)

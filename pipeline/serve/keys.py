"""API keys (`pipeline serve --api-keys FILE`): who may translate, and how often.

The file holds one key per line, optionally followed by the most requests that key may make in any 60
seconds; blank lines and lines starting with # are skipped:

    # key                               requests per minute (none: no limit)
    3f1c9a6e0b7d4e52a8c1f0e9d2b7a6c4    120
    ops-dashboard-key

Keys are held as SHA-256 digests and a given key is compared with every one of them by
hmac.compare_digest, so neither the comparison's time nor an early exit tells how close a guess was. A key
is never logged or put in an error message. /health and /metrics need no key."""

from __future__ import annotations

import hashlib
import hmac
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from model.errors import UserError

WINDOW_S = 60.0


@dataclass
class _Key:
    digest: bytes
    per_minute: int | None
    label: str  # "line N": how the server names a key in its own messages
    recent: deque[float] = field(default_factory=deque)


class KeyRefused(Exception):
    """No key, or one not in the file."""


class RateLimited(Exception):
    """Over the key's requests per minute; `retry_after_s` until one more is allowed."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
    def __init__(self, keys: list[_Key]):
        self._keys = keys
        self._lock = threading.Lock()

    @classmethod
    def read(cls, path: str) -> ApiKeys:
        """The keys of FILE (UserErrors name the file and line; the key itself is never repeated)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--api-keys {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        keys: list[_Key] = []
        seen: set[bytes] = set()
        for n, line in enumerate(text.splitlines(), 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            where = f"--api-keys {path} line {n}"
            if len(fields) > 2 or (len(fields) == 2 and not (fields[1].isdigit() and int(fields[1]) > 0)):
                raise UserError(f"{where}: write KEY or KEY REQUESTS_PER_MINUTE (a whole number above 0)")
            if len(fields[0]) < 8:
                raise UserError(f"{where}: a key must have at least 8 characters")
            digest = _digest(fields[0])
            if digest in seen:
                raise UserError(f"{where}: this key is in the file twice")
            seen.add(digest)
            keys.append(_Key(digest, int(fields[1]) if len(fields) == 2 else None, f"line {n}"))
        if not keys:
            raise UserError(f"--api-keys {path}: the file holds no key (one per line: KEY [REQUESTS_PER_MINUTE])")
        return cls(keys)

    def __len__(self) -> int:
        return len(self._keys)

    def check(self, given: str | None) -> None:
        """Accept one request with this key: KeyRefused when missing or unknown, RateLimited when over its rate."""
        if not given:
            raise KeyRefused("missing")
        digest = _digest(given)
        found = None
        for key in self._keys:  # every key compared, whichever matches
            if hmac.compare_digest(key.digest, digest):
                found = key
        if found is None:
            raise KeyRefused("invalid")
        if found.per_minute is None:
            return
        now = time.monotonic()
        with self._lock:
            while found.recent and found.recent[0] <= now - WINDOW_S:
                found.recent.popleft()
            if len(found.recent) >= found.per_minute:
                wait = max(1, math.ceil(found.recent[0] + WINDOW_S - now))
                raise RateLimited(f"this API key may make {found.per_minute} requests per minute; retry in {wait} s",
                                  wait)
            found.recent.append(now)

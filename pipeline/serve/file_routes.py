"""LibreTranslate's file routes: POST /translate_file (multipart form data: "file", "source" (a code or
"auto"), "target", "api_key") answers {"translatedFileUrl": "<base url>/download_file/<id>"}, and GET
/download_file/<id> sends the translated file as an attachment named as LibreTranslate names it
(report.docx to de: report_de.docx).

A file's texts (documents.py) are translated through the same path as LibreTranslate's /translate
(libre.py: one batch request, each text a document), so every limit of that path holds for a file too
(--max-sentences, --max-source-tokens, the queue). The translated file is kept in this process's memory, not
on disk as LibreTranslate keeps it: at most STORE_FILES files and STORE_BYTES bytes (the oldest go first),
each for KEEP_S seconds, under an unguessable id; a restart forgets them. The upload is read whole into
memory within MAX_FILE_BYTES (documents.py) and never written to disk."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import secrets
import time
import urllib.parse
from collections import OrderedDict
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pipeline.serve import documents
from pipeline.serve.access import settle
from pipeline.serve.documents import Document, DocumentError, extension
from pipeline.serve.glossaries import requested
from pipeline.serve.http import (
    MAX_FORM_FIELDS,
    ApiError,
    CountedDisconnect,
    error,
    failed,
    off_loop,
    read_body,
    strict_multipart,
)
from pipeline.serve.libre import LibreRequest, _code, _detect, check_key, translate_texts
from pipeline.serve.metrics import ModelMetrics
from pipeline.serve.state import ServerState
from runtime.glossary import Glossary
from runtime.sentences import has_letters
from runtime.translate import not_text

log = logging.getLogger(__name__)

MAX_FORM_BYTES = 64 << 10  # the form's other fields and its multipart framing, beside the file
STORE_FILES = 64
STORE_BYTES = 256 << 20
KEEP_S = 600.0
DETECT_CHARS = 4000  # the file's text that "source": "auto" looks at


class FileStore:
    """Translated files by id, in memory, bounded in number and bytes, each expiring KEEP_S seconds after it
    was made. Used on the event loop only."""

    def __init__(self, files: int | None = None, size: int | None = None, keep_s: float | None = None):
        self.files = STORE_FILES if files is None else files
        self.size = STORE_BYTES if size is None else size
        self.keep_s = KEEP_S if keep_s is None else keep_s
        self._items: OrderedDict[str, tuple[str, str, bytes, float]] = OrderedDict()
        self._bytes = 0

    def put(self, filename: str, media_type: str, data: bytes) -> str:
        if len(data) > self.size:
            raise ApiError(413, f"the translated file has {len(data)} bytes, more than this server keeps "
                                f"({self.size} bytes); split the file")
        self._expire()
        while self._items and (len(self._items) >= self.files or self._bytes + len(data) > self.size):
            self._drop(next(iter(self._items)))
        key = secrets.token_urlsafe(16)
        self._items[key] = (filename, media_type, data, time.monotonic() + self.keep_s)
        self._bytes += len(data)
        return key

    def get(self, key: str) -> tuple[str, str, bytes] | None:
        self._expire()
        item = self._items.get(key)
        return None if item is None else item[:3]

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, item in self._items.items() if item[3] <= now]:
            self._drop(key)

    def _drop(self, key: str) -> None:
        self._bytes -= len(self._items.pop(key)[2])


def _store(request: Request) -> FileStore:
    store = getattr(request.app.state, "translated_files", None)
    if store is None:
        store = request.app.state.translated_files = FileStore()
    return store


def _in_memory_parser() -> Any:
    """starlette's multipart parser with its upload spool never rolled over to a temporary file: the body is
    bounded already, so the file stays in memory."""
    class InMemory(strict_multipart()):  # type: ignore[misc]  # its text fields strict UTF-8, as /translate's
        spool_max_size = documents.MAX_FILE_BYTES + MAX_FORM_BYTES + 1

    return InMemory


async def read_form(request: Request, state: ServerState) -> tuple[dict[str, str], tuple[str, bytes] | None]:
    """The form's text fields (the first of a repeated one) and its "file" (name, bytes), within the limits:
    413 over documents.MAX_FILE_BYTES, 400 for a body that is not one file's multipart form data."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "multipart/form-data":
        key = "" if state.keys is None else " (and api_key)"
        raise ApiError(400, 'POST /translate_file takes multipart/form-data with the fields "file", "source" and '
                            f'"target"{key}, not {kind or "no content type"}')
    limits = dataclasses.replace(state.limits, max_bytes=documents.MAX_FILE_BYTES + MAX_FORM_BYTES)
    try:
        body = await read_body(request, limits)
    except ApiError as e:
        if e.status != 413:
            raise
        raise ApiError(413, f"the upload is over this server's limit of {documents.MAX_FILE_BYTES} bytes for a file "
                            f"({documents.MAX_FILE_BYTES >> 20} MiB); split the file", e.headers) from None
    from starlette.formparsers import MultiPartException

    async def stream() -> Any:
        yield body
        yield b""

    try:
        form = await _in_memory_parser()(request.headers, stream(), max_files=1, max_fields=MAX_FORM_FIELDS).parse()
    except AssertionError:  # starlette's "python-multipart must be installed"
        raise ApiError(415, 'multipart form data needs python-multipart on this server (pip install -e ".[serve]")'
                       ) from None
    except MultiPartException as e:
        raise ApiError(400, f"request body is not readable form data: {e.message}"
                            + (' (send one file, in "file")' if "files" in e.message else "")) from None
    fields: dict[str, str] = {}
    upload: tuple[str, bytes] | None = None
    try:
        for key, value in form.multi_items():
            if isinstance(value, str):
                fields.setdefault(key, value)
            elif key != "file":
                raise ApiError(400, f'form field "{key}" is a file; send the file in "file"')
            else:
                upload = (value.filename or "", await value.read())
    finally:
        await form.close()
    if "file" in fields and upload is None:
        raise ApiError(400, '"file" must be a file (a form part with a filename), not a text field')
    return fields, upload


MAX_NAME_BYTES = 255  # what file systems take for one name


def download_name(filename: str, target: str) -> str:
    """LibreTranslate's name for the translation: the upload's name (its last path part, printable) with
    _<target> before its extension, the extension spelled as it came (the one the upload was taken for), cut to
    MAX_NAME_BYTES."""
    name = re.sub(r'[\x00-\x1f\x7f"]', "", re.split(r"[/\\]", filename)[-1]).strip()
    ext = extension(filename)
    spelled = name[len(name) - len(ext):] if ext and name.lower().endswith(ext) else ext
    stem = name[:len(name) - len(spelled)] if ext and name.lower().endswith(ext) else name
    suffix = f"_{target}{spelled}"
    return (stem or "file").encode()[:MAX_NAME_BYTES - len(suffix.encode())].decode(errors="ignore") + suffix


async def translate_file(request: Request) -> Response:
    """POST /translate_file: the file read, its texts translated as LibreTranslate's /translate translates a
    batch, the file rebuilt and kept; the answer is its URL."""
    state: ServerState = request.app.state.server
    started = time.perf_counter()
    m = state.refused_in
    try:
        fields, upload = await read_form(request, state)
        check_key(state, fields.get("api_key"), request)
        if upload is None:
            raise ApiError(400, "Invalid request: missing file parameter")
        source, target = _code(fields, "source", state), _code(fields, "target", state)
        filename, data = upload
        if not filename.strip():
            raise ApiError(400, 'Invalid request: empty file ("file" has no filename)')
        if extension(filename) not in documents.SUPPORTED:
            raise ApiError(400, f'"file" {filename[-60:]!r}: the format {extension(filename) or "(no extension)"} '
                                f"is not supported; supported: {', '.join(documents.SUPPORTED)}")
        for code, key in ((source, "source"), (target, "target")):
            if code != "auto" and code not in state.routes.codes:
                raise ApiError(400, f'"{key}" {code} is not a language this server translates; it translates '
                                    f"{state.routes.listed()}")
        glossary = requested(fields.get("glossary"), state.glossaries)
        async with state.held_documents or contextlib.nullcontext():  # the others wait as the bytes sent
            answer, m = await _translated(request, state, filename, data, source, target, glossary)
        m.request_seconds.observe(time.perf_counter() - started)
        response: Response = JSONResponse(answer)
    except Exception as e:
        m = e.metrics if isinstance(e, CountedDisconnect) else m
        response = failed(e, m, state.limits.retry_after_s, "file translation")
    settle(request.scope, response.status_code)
    m.request(response.status_code)
    return response


async def _translated(request: Request, state: ServerState, filename: str, data: bytes, source: str, target: str,
                      glossary: Glossary | None) -> tuple[dict[str, Any], ModelMetrics]:
    """The upload read, its texts translated, the file rebuilt and kept: the answer, and the metrics it counts in."""
    try:
        # each text is a sentence at least: one over --max-sentences is refused before any translation
        doc: Document = await off_loop(state.documents, documents.read_document, filename, data,
                                       state.limits.max_sentences)
    except DocumentError as e:
        raise ApiError(413 if e.too_large else 400, f'"file" {filename[-60:]!r}: {e}') from None
    for i, text in enumerate(doc.texts):  # as /translate refuses it, and serve-batch a file's line
        if why := not_text(text):
            raise ApiError(400, f'"file" {filename[-60:]!r}: its text {i + 1} ({text.strip()[:30]!r}) holds {why}')
    req = LibreRequest(doc.texts, True, source, target, False, 0, glossary, filename[-60:], doc.soft_breaks)
    detected = await _source_of(state, req) if source == "auto" else None
    try:
        body, m = await translate_texts(request, state, req, None)
    except ApiError as e:  # a limit of the file's texts ("1335905 source tokens ... split the request"): the file's
        if e.status != 413 or str(e).startswith('"file"'):
            raise
        said = str(e).replace("split the request", "split the file").replace("split the line", "split that text")
        named = said if said.startswith(repr(filename[-60:])) else f'{filename[-60:]!r}: {said}'  # (a text of it)
        raise ApiError(413, f'"file" {named}', e.headers) from None
    out = await off_loop(state.documents, doc.rebuild, body["translatedText"])
    ext = extension(filename)
    key = _store(request).put(download_name(filename, target), documents.media_type(ext, out), out)
    answer: dict[str, Any] = {"translatedFileUrl": f"{str(request.base_url).rstrip('/')}/download_file/{key}"}
    if detected is not None:
        answer["detectedLanguage"] = detected
    return answer, m


async def _source_of(state: ServerState, req: LibreRequest) -> dict[str, Any] | None:
    """"source": "auto": the file's language, detected once on its first DETECT_CHARS characters of text (a
    short paragraph alone is often misread), set as the request's source; None for a file without text."""
    sample, size = [], 0
    for text in req.q:
        if size >= DETECT_CHARS:
            break
        if has_letters(text):
            sample.append(text[:DETECT_CHARS - size])
            size += len(sample[-1])
    if not sample:
        req.source = req.target  # nothing to translate: the file comes back as it was
        return None
    [detected] = await off_loop(state.prepare, _detect, state,
                                LibreRequest(["\n".join(sample)], False, "auto", req.target, False, 0))
    req.source = detected["language"]
    if req.source != req.target and state.routes.model(req.source, req.target) is None:
        raise ApiError(400, f'"file" is detected as {req.source} (confidence {detected["confidence"]}): '
                            f'"source" {req.source} to "target" {req.target} is not a language pair this server '
                            f"translates; it translates {state.routes.listed()}")
    return detected


async def download_file(request: Request) -> Response:
    """GET /download_file/<id>: the translated file, as often as asked until it expires. Open, as
    LibreTranslate's: the id, unguessable, is the key."""
    found = _store(request).get(request.path_params["id"])
    if found is None:
        return error(ApiError(404, f"no translated file has this id here: files are kept {KEEP_S / 60:g} minutes "
                                   f"after they are made, the newest {STORE_FILES} ({STORE_BYTES >> 20} MiB) at "
                                   "most, in the memory of the server that made them (behind a load balancer, the "
                                   "download must reach that one), not past a restart; translate the file again"))
    filename, media_type, data = found
    fallback = filename.encode("ascii", "replace").decode("ascii").replace("?", "_")
    disposition = f'attachment; filename="{fallback}"'
    if fallback != filename:
        disposition += f"; filename*=UTF-8''{urllib.parse.quote(filename, safe='')}"
    return Response(data, media_type=media_type, headers={"Content-Disposition": disposition})

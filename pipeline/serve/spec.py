"""GET /spec (the OpenAPI 3 document of both APIs, as LibreTranslate serves its own at /spec) and GET /docs (a
page that reads /spec and lists every route with its fields; no script from elsewhere, so it works offline)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

ERROR = {"type": "object", "properties": {"error": {"type": "string"}}}


def _field(kind: str, description: str, **more: Any) -> dict[str, Any]:
    return {"type": kind, "description": description, **more}


def _answers(ok: dict[str, Any], *codes: int) -> dict[str, Any]:
    errors = {str(c): {"description": {400: "fix the request (the field is named)", 403: "wrong API key",
                                       413: "too large: split it", 429: "over a rate (Retry-After)",
                                       401: "no or a wrong API key", 503: "busy: retry (Retry-After)",
                                       404: "no such model (the native API)",
                                       501: "no language detector on this server",
                                       507: "the suggestions table is full"}[c],
                       "content": {"application/json": {"schema": ERROR}}} for c in codes}
    return {"200": {"description": "done", "content": {"application/json": {"schema": ok}}}, **errors}


def _form(fields: dict[str, dict[str, Any]], required: list[str]) -> dict[str, Any]:
    schema = {"type": "object", "properties": fields, "required": required}
    return {"content": {kind: {"schema": schema} for kind in ("application/json", "application/x-www-form-urlencoded",
                                                              "multipart/form-data")}}


TEXTS = [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]  # a text, or a list of them


LIBRE_TRANSLATE = {
    "q": {"oneOf": TEXTS, "description": "the text, or a list of texts (a JSON list, or the field repeated in form "
                                         "data); each is translated as a document"},
    "source": _field("string", 'a language code, or "auto" to detect each text\'s'),
    "target": _field("string", "a language code"),
    "format": _field("string", "text or html (markup kept byte for byte)", enum=["text", "html"]),
    "alternatives": _field("integer", "how many other translations to give (the model's n-best)"),
    "api_key": _field("string", "with --api-keys (also the query string, or Authorization: Bearer)"),
    "glossary": {"oneOf": [{"type": "string"}, {"type": "object", "additionalProperties": {"type": "string"}}],
                 "description": "an extension: the name of a glossary the server was started with (--glossary "
                                'NAME=FILE), or one inline: a JSON object ({"Hund": "dog", "Acme": ""}), or that '
                                'object as a string in form data; the answer then has "terms"'},
}


NATIVE = {
    "text": _field("array", "the texts: one line each, or with split or html one document each",
                   items={"type": "string"}),
    "model": _field("string", "the model's name (GET /info lists them); required when the server has several"),
    "source": _field("string", "the source language: required by a multilingual model; a model of one pair takes "
                               "only its own"),
    "target": _field("string", "the target language, as source"),
    "split": _field("string", "sentences: each text a document, split into sentences and rebuilt with its "
                              "whitespace", enum=["none", "sentences"]),
    "lang": _field("string", "the language whose sentence rules split uses (default: a multilingual model's "
                             "\"source\", else the model's source language: its recorded pair or its name, like "
                             "de-en; else en)"),
    "format": _field("string", "text, or html: each text an HTML document, its text translated and its markup kept",
                     enum=["text", "html"]),
    "beam_size": _field("integer", "the beam for this request (at most the model's max_beam)"),
    "nbest": _field("integer", "hypotheses per text, with scores (at most the beam)"),
    "scores": _field("boolean", "each text's best hypothesis with its score"),
    "stream": _field("boolean", "NDJSON, one object per text (per sentence with split) as each is done"),
    "glossary": LIBRE_TRANSLATE["glossary"],
}


def _schema(title: str, fields: dict[str, dict[str, Any]], required: list[str]) -> dict[str, Any]:
    return {"title": title, "type": "object", "properties": fields, "required": required}


def document(title: str) -> dict[str, Any]:
    """The OpenAPI document of both APIs."""
    text_or_list = {"oneOf": TEXTS}
    return {
        "openapi": "3.0.3",
        "info": {"title": title, "version": "1",
                 "description": "LibreTranslate's API (fields from JSON, form data or the query string) beside "
                                "the native one (JSON with \"text\"); docs/serving.md has the details."},
        "paths": {
            "/translate": {"post": {
                "summary": "Translate text: LibreTranslate's API (\"q\") or the native one (JSON with \"text\")",
                "requestBody": {"content": {
                    "application/json": {"schema": {"oneOf": [
                        _schema("LibreTranslate's API", LIBRE_TRANSLATE, ["q", "source", "target"]),
                        _schema("the native API", NATIVE, ["text"])]}},
                    **{kind: {"schema": _schema("LibreTranslate's API", LIBRE_TRANSLATE, ["q", "source", "target"])}
                       for kind in ("application/x-www-form-urlencoded", "multipart/form-data")}}},
                "responses": _answers({"oneOf": [  # each with its required field: an answer matches one
                    {"title": "LibreTranslate's API", "type": "object", "required": ["translatedText"], "properties": {
                        "translatedText": text_or_list,
                        "detectedLanguage": {"oneOf": [{"type": "object"}, {"type": "array"}]},  # per text of a list
                        "alternatives": {"type": "array"}, "terms": {"type": "array"},
                        "score": {"oneOf": [{"type": "number", "nullable": True}, {"type": "array"}],
                                  "description": "null for a text returned unchanged"}}},
                    {"title": "the native API", "type": "object", "required": ["translations"], "properties": {
                        "translations": {"type": "array", "description": "per text its translation (with nbest or "
                                                                         "scores: its hypotheses with scores)"},
                        "terms": {"type": "array", "description": "with a glossary: per text, its terms"}}}]},
                    400, 401, 403, 404, 413, 429, 503)}},
            "/detect": {"post": {
                "summary": "Detect the language of a text among the served ones",
                "requestBody": _form({"q": {"oneOf": TEXTS, "description": "the text, or a list of texts, joined "
                                                                           "and ranked as one"},
                                      "api_key": LIBRE_TRANSLATE["api_key"]}, ["q"]),
                "responses": _answers({"type": "array", "items": {"type": "object", "properties": {
                    "language": {"type": "string"}, "confidence": {"type": "number"}}}}, 400, 403, 413, 429, 501)}},
            "/translate_file": {"post": {
                "summary": "Translate a document (.txt, .html, .srt, .docx, .pptx, .odt, .odp, .epub), its layout kept",
                "requestBody": {"content": {"multipart/form-data": {"schema": {
                    "type": "object", "required": ["file", "source", "target"], "properties": {
                        "file": {"type": "string", "format": "binary", "description": "the document"},
                        "source": _field("string", 'a language code, or "auto" to detect the file\'s (once, on '
                                                   'its first 4,000 characters)'),
                        "target": LIBRE_TRANSLATE["target"], "api_key": LIBRE_TRANSLATE["api_key"]}}}}},
                "responses": _answers({"type": "object", "properties": {"translatedFileUrl": {"type": "string"}}},
                                      400, 403, 413, 429, 503)}},
            "/download_file/{id}": {"get": {
                "summary": "The translated document (kept in memory for 10 minutes)",
                "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"},
                                "description": "the last part of translatedFileUrl"}],
                "responses": {"200": {"description": "the document, as an attachment"},
                              "404": {"description": "no such file, or expired"}}}},
            "/suggest": {"post": {
                "summary": "Suggest a better translation (stored with --suggestions DB; else 403)",
                "requestBody": _form({"q": _field("string", "the source text"),
                                      "s": _field("string", "the suggested translation"),
                                      "source": _field("string", "the source text's language code (not auto)"),
                                      "target": LIBRE_TRANSLATE["target"],
                                      "api_key": LIBRE_TRANSLATE["api_key"]}, ["q", "s", "source", "target"]),
                "responses": _answers({"type": "object", "properties": {"success": {"type": "boolean"}}}, 400,
                                      403, 413, 429, 503, 507)}},
            "/languages": {"get": {"summary": "The languages served, each with its targets",
                                   "responses": _answers({"type": "array", "items": {"type": "object"}})}},
            "/frontend/settings": {"get": {"summary": "The server's settings, as LibreTranslate's front end reads "
                                                      "them", "responses": _answers({"type": "object"})}},
            "/health": {"get": {"summary": "Ready to translate (503 while starting or draining)",
                                "responses": _answers({"type": "object"})}},
            "/metrics": {"get": {"summary": "Prometheus metrics, by model",
                                 "responses": {"200": {"description": "text/plain; version=0.0.4"}}}},
            "/info": {"get": {"summary": "Every model's facts and the server's limits (native API)",
                              "responses": _answers({"type": "object"}, 401)}},
        },
    }


async def spec(request: Request) -> Response:
    return JSONResponse(document("pipeline serve"))


DOCS_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>pipeline serve: API</title>
<style>body{font:15px/1.5 system-ui,sans-serif;max-width:52rem;margin:2rem auto;padding:0 1rem}
code{background:#f3f3f3;padding:0 .2em}h2{font-size:1.1rem;margin-top:1.6rem}li{margin:.2rem 0}</style></head>
<body><h1>pipeline serve: API</h1><p>The OpenAPI document is at <a href="spec">/spec</a>; the translator page at
<a href="./">/</a>.</p><div id="routes">Reading /spec ...</div>
<script>
fetch("spec").then(r => r.json()).then(spec => {
  const out = document.getElementById("routes");
  out.textContent = spec.info.description;
  for (const [path, methods] of Object.entries(spec.paths)) {
    for (const [method, op] of Object.entries(methods)) {
      const h = document.createElement("h2");
      h.textContent = method.toUpperCase() + " " + path + ": " + op.summary;
      out.appendChild(h);
      const body = op.requestBody && Object.values(op.requestBody.content)[0].schema;
      if (!body) continue;
      for (const schema of body.oneOf || [body]) {
        if (schema.title) {
          const p = document.createElement("p");
          p.textContent = schema.title + ":";
          out.appendChild(p);
        }
        const ul = document.createElement("ul");
        for (const [name, f] of Object.entries(schema.properties)) {
          const li = document.createElement("li");
          li.innerHTML = "<code></code> ";
          li.firstChild.textContent = name + (schema.required.includes(name) ? " (required)" : "");
          li.appendChild(document.createTextNode(f.description || ""));
          ul.appendChild(li);
        }
        out.appendChild(ul);
      }
    }
  }
});
</script></body></html>
"""


async def docs(request: Request) -> Response:
    return HTMLResponse(DOCS_PAGE)

"""GET /: the translator page (pipeline/serve/static/), how most people first judge a model. One HTML page with its
script and style inlined, read from the package once; it calls this server's own API (GET /languages, GET
/frontend/settings, POST /translate, POST /translate_file) and nothing from another origin. The Content-Security-
Policy allows this origin only, and inline code only by the hashes of the page's own script and style."""

from __future__ import annotations

import base64
import functools
import hashlib
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

STATIC = ("index.html", "page.css", "page.js")


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


@functools.lru_cache(maxsize=1)
def built() -> tuple[bytes, str]:
    """The page's bytes and its Content-Security-Policy: the script and style put in the page's marked places."""
    folder = resources.files("pipeline.serve").joinpath("static")
    html, css, js = (folder.joinpath(name).read_text(encoding="utf-8") for name in STATIC)
    style, script = f"\n{css}", f"\n{js}"
    for marker in ("<!-- page.css -->", "<!-- page.js -->"):
        if html.count(marker) != 1:
            raise RuntimeError(f"pipeline/serve/static/index.html must hold {marker} once")
    html = html.replace("<!-- page.css -->", f"<style>{style}</style>").replace(
        "<!-- page.js -->", f"<script>{script}</script>")
    policy = (f"default-src 'self'; script-src {_sha256(script)}; style-src {_sha256(style)}; img-src 'self' data:; "
              "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
    return html.encode("utf-8"), policy


async def page(request: Request) -> Response:
    body, policy = built()
    return HTMLResponse(body, headers={"Content-Security-Policy": policy, "X-Content-Type-Options": "nosniff",
                                       "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"})

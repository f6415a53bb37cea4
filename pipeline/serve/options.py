"""The options of `pipeline serve`, each with its default and help text (the CLI is generated
from them). No web-stack imports, so `pipeline serve --help` works without the `serve` extra."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.cli_options import opt
from runtime.model_dir import LoadOptions
from runtime.translate import LONG_LINE_POLICIES

SERVE_BATCH_TOKENS = 2048

DEFAULT_MAX_BEAM = 16  # the largest beam a request may ask for when the model dir sets none


@dataclass(frozen=True)
class ServeHttpOptions:
    """Where and how the process serves."""

    model: tuple[str, ...] = opt((), "Serve the model dir DIR as NAME; repeat it to serve several models, each with "
                                 "its own queue (requests name one with \"model\"). A MODEL_DIR argument is served "
                                 "as its directory's name. A NAME like de-en splits documents with de's sentence "
                                 "rules.", multiple=True, metavar="NAME=DIR")
    host: str = opt("127.0.0.1", "Address to listen on; 0.0.0.0 exposes the service to the network (put it "
                    "behind a proxy).")
    port: int = opt(8000, "TCP port; 0 picks a free one (logged at startup).", min=0, max=65535)
    long_lines: str = opt("truncate", "Lines longer than the model's source limit: truncate them (as "
                          "serve-batch does, counted in /metrics; a document's long sentence is cut into sentences "
                          "that fit) or refuse the request with 413 naming the line.",
                          choices=LONG_LINE_POLICIES)
    grace_s: int = opt(30, "On SIGTERM / Ctrl-C: stop accepting, let in-flight requests finish for up to this "
                       "many seconds (then cancel them), exit 0.", min=0)
    api_keys: Path | None = opt(None, "A file of API keys, one per line, each optionally followed by its requests "
                                "per minute (over it: 429). A wrong key is refused (native API: 401; "
                                "LibreTranslate's: 403); requests without a key are served at --keyless-rate, as "
                                "LibreTranslate serves them, unless --require-api-key. /health, /metrics, "
                                "/languages, /frontend/settings, /spec, /docs, the web page at / and "
                                "/download_file/ID (its ID the key) stay open.",
                        exists=True, metavar="FILE")
    keyless_rate: int = opt(60, "With --api-keys: requests per minute each client address may make without a key "
                            "(0: no limit); over it: 429 with Retry-After.", min=0)
    require_api_key: bool = opt(False, "With --api-keys: refuse requests without a key (LibreTranslate's API: 400 "
                                "\"Please contact the server operator to get an API key\"; native API: 401).")
    forwarded_allow_ips: str = opt("", "Proxies whose X-Forwarded-For / X-Forwarded-Proto headers name the client "
                                   "and the scheme (comma-separated addresses or networks, * for any), as uvicorn's "
                                   "option of that name (its FORWARDED_ALLOW_IPS too); by default none: the client "
                                   "is the connection's peer, so a client cannot name itself another address to "
                                   "pass --keyless-rate. Behind a proxy on this machine (a TLS one: translated "
                                   "files' URLs are then https): 127.0.0.1, with the proxy setting "
                                   "X-Forwarded-For itself.", metavar="ADDRESSES")
    root_path: str = opt("", "The URL path a reverse proxy serves this server under, which it strips from each "
                         "request (nginx: location /mt/ { proxy_pass http://127.0.0.1:8000/; }): /mt, so the "
                         "download links /translate_file answers hold it (they were /download_file/ID, a 404 "
                         "through the proxy); as uvicorn's --root-path.", metavar="PATH")
    cors_origin: str = opt("*", "The Access-Control-Allow-Origin sent to browsers (pages and add-ons calling the "
                           "API from another origin), preflight requests answered; * as LibreTranslate, an origin "
                           "like https://example.org, or none to send no CORS headers.")
    suggestions: Path | None = opt(None, "An SQLite database (created when missing) where POST /suggest keeps the "
                                   "better translations users send; without it /suggest answers 403, as "
                                   "LibreTranslate's does when suggestions are off.", metavar="DB")
    access_log: bool = opt(True, "One line per request on stderr: method, path, status, milliseconds, model, "
                           "texts and the key's line in the keys file (never the key).")
    log_format: str = opt("text", "The access log's form: text, or json (one JSON object per line).",
                          choices=("text", "json"))
    glossary: tuple[str, ...] = opt((), "A glossary file (TSV: source term, target term; an empty target: do not "
                                    "translate) that requests choose by NAME with \"glossary\": \"NAME\"; repeat it "
                                    "for several. Loaded once and checked against every served model at start "
                                    "(docs/glossary.md).", multiple=True, metavar="NAME=FILE")
    # how every served model dir is loaded (its own command-line options: runtime/model_dir.py LoadOptions)
    load: LoadOptions = LoadOptions()

# what `pipeline serve` adds to the LoadOptions options' help
LOAD_NOTES = {"device": "One process per GPU.", "shortlist": "Every served model dir must have one; /info reports it.",
              "parallel_batches": "Here: the queue's batches, started while others run; /info reports it."}


@dataclass(frozen=True)
class RequestLimits:
    """What one request, and the queue of them, may hold; beyond them the answer is 413 or 503."""

    max_lines: int = opt(1024, "Most lines (texts, with \"split\") per request (413 beyond).", min=1)
    max_sentences: int = opt(10_000, "Most sentences per request once its texts are split (413 beyond): one "
                             "document of many short sentences is bounded too.", min=1)
    max_source_tokens: int = opt(100_000, "Most source tokens per request, all its sentences together (413 "
                                 "beyond): what one request may ask of its model.", min=1)
    max_bytes: int = opt(1 << 20, "Largest request body in bytes (413 beyond).", min=1)
    # 2048: the server gathers requests for max_wait_ms to fill a batch; a smaller budget than serve-batch's
    # 8192 keeps the first request of a busy batch from waiting on three more batches' worth of others
    max_batch_tokens: int = opt(SERVE_BATCH_TOKENS, "Dynamic batch budget: source tokens x beam of the requests "
                                "batched together (and sentences x longest source x beam per search batch, as "
                                "serve-batch's --batch-tokens).", min=1)
    max_wait_ms: float = opt(5.0, "How long the oldest queued request may wait for others to share its batch; "
                             "a request that finds no other in the server (none being read, prepared or translated) "
                             "starts at once.",
                             min=0)
    max_queue: int = opt(256, "Requests that may wait for a batch, per model; beyond it requests get 503 with "
                         "Retry-After.", min=1)
    body_timeout_s: float = opt(30.0, "Seconds a client may take to send its request body; a slower one gets 408 "
                                "and its connection closed.", min=0.001)
    head_timeout_s: float = opt(10.0, "Seconds a client may take to send a request's line and headers (at most 64 "
                                "KiB; beyond: 431), from its connection or its first byte; a slower one gets 408 "
                                "and its connection closed.", min=0.001)
    max_connections: int = opt(10_000, "Open connections at most (within the process's file descriptors); one more "
                               "closes the one idle longest (waiting for a request, or between requests), so that "
                               "a flood of idle ones cannot starve the others.", min=1)
    retry_after_s: int = 1

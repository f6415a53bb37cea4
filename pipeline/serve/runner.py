"""Start, run and stop `pipeline serve`: verify and load each model dir, bind the port,
warm each up with one real translation, serve until SIGTERM / Ctrl-C, then drain.

On a stop signal uvicorn stops accepting, lets in-flight requests finish for up to
`grace_s` seconds; those still waiting then are answered 503 with Retry-After (a stream: its last object an
error), the lifespan stops the batcher, and the process exits 0.
Startup failures (bad model dir, port in use) are UserErrors: one line, exit 2."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib.metadata
import ipaddress
import logging
import os
import re
import signal
import socket
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import uvicorn

from model.errors import UserError
from pipeline.serve import access
from pipeline.serve.app import create_app
from pipeline.serve.connections import bounded_protocol
from pipeline.serve.detect import Detector, DetectorMissing, listed
from pipeline.serve.glossaries import check_named, read_named
from pipeline.serve.glossaries import info as glossaries_info
from pipeline.serve.languages import preferred, served_languages
from pipeline.serve.metrics import Metrics
from pipeline.serve.options import DEFAULT_MAX_BEAM, RequestLimits, ServeHttpOptions
from pipeline.serve.state import ServedModel, ServerState
from pipeline.serve.suggestions import Suggestions
from runtime.decoding import DecodingOptions
from runtime.model_dir import Loaded, load
from runtime.sentences import DEFAULT_LANG
from runtime.texts import TextPolicy, encode_texts, finish_texts

log = logging.getLogger(__name__)


BACKLOG = 2048  # uvicorn's own
WARMUP_LINE = "warm up"


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a taken port is one clear line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    # proto IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say they are TCP,
    # and with Nagle on, a kept-alive client waited ~40 ms per answer (Nagle against its delayed ACK).
    sock = socket.socket(family, kind, proto or socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets on Linux
    try:
        sock.bind(address)
        # listening now, not when uvicorn starts: with SO_REUSEADDR two servers starting together could both bind
        # the port, and uvicorn (uvloop) took the second one's failed listen in silence: it said it served, and
        # never answered. Connections made while the model loads wait in the backlog.
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        hint = {errno.EADDRINUSE: "another server is using the port: pick another --port",
                errno.EADDRNOTAVAIL: f"{host} is not an address of this machine: pick another --host",
                errno.EACCES: "ports below 1024 need privileges: pick a port of 1024 or more"}.get(e.errno or 0)
        raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror})"
                        + (f"; {hint}" if hint else "")) from None
    sock.set_inheritable(True)
    return sock


ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s]+")  # what a browser sends: scheme://host[:port]


def cors_origin(given: str) -> str | None:
    """--cors-origin as the CORS middleware takes it: None for "none", "*", or one origin exactly as a browser
    sends it (an origin with a path or a trailing slash never matched: every preflight was refused in silence)."""
    value = given.strip()
    if value.lower() == "none":
        return None
    if value == "*":
        return value
    if not ORIGIN.fullmatch(value):
        raise UserError(f"--cors-origin {given[:100]!r}: give *, none, or an origin as a browser sends it, "
                        "scheme://host[:port] with no path, like https://example.org")
    # as a browser spells it, which the middleware compares exactly: lower case, no default port
    origin = value.lower()
    for scheme, port in (("https://", ":443"), ("http://", ":80")):
        if origin.startswith(scheme) and origin.endswith(port):
            origin = origin.removesuffix(port)
    return origin


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def model_specs(model_dir: str | None, specs: tuple[str, ...]) -> list[tuple[str, str]]:
    """(name, dir) of every model to serve: MODEL_DIR as its directory's name, then each --model NAME=DIR."""
    # the name as given, not the link's target (models/de-en -> de-en-v3 is served as de-en); "." is the cwd's
    models = [(Path(os.path.abspath(model_dir)).name or "model", model_dir)] if model_dir else []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not path or not NAME.fullmatch(name):
            raise UserError(f"--model {spec!r}: give NAME=DIR, NAME of letters, digits, '.', '_' or '-'")
        models.append((name, path))
    if not models:
        raise UserError("give a MODEL_DIR or at least one --model NAME=DIR")
    names = [name for name, _ in models]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"model name(s) {', '.join(twice)} given twice; name each model once (--model NAME=DIR)")
    return models


def server_info(limits: RequestLimits, opts: ServeHttpOptions) -> dict[str, Any]:
    """What /info tells of the server as a whole: versions and settings."""
    versions = {p: _version(p) for p in ("pipeline", "torch", "onnxruntime", "sentencepiece", "starlette",
                                         "uvicorn", "uvloop", "httptools", "sentencex", "py3langid")}
    return {"versions": versions, "limits": {**asdict(limits), "long_lines": opts.long_lines},
            "grace_s": opts.grace_s}


def load_model(name: str, model_dir: str, opts: ServeHttpOptions, decoding: DecodingOptions, metrics: Metrics
               ) -> ServedModel:
    """One model dir verified, loaded and warmed up (UserErrors name the model when it is unusable); over its
    vocabulary shortlist with opts.shortlist."""
    try:
        # with the model's own decoding defaults (an imported model's num_beams, ...) for the options not given
        loaded = load(model_dir, opts.load, decoding)
        decoding, limits = loaded.decoding, loaded.manifest.limits
        max_beam = limits.max_beam or DEFAULT_MAX_BEAM
        if decoding.beam_size > max_beam:
            raise UserError(f"--beam-size {decoding.beam_size} is above the model dir's limit of {max_beam}")
        longest = (limits.max_tgt_len or 0) - 1
        if decoding.min_len > longest:  # serve-batch warns of each line so; here no translation could meet it
            log.warning("model %s: --min-len %d is above the longest output the model dir allows (%d tokens): every "
                        "translation stops at that maximum", name, decoding.min_len, longest)
    except UserError as e:
        raise UserError(f"model {name}: {e}") from None
    sources, targets = served_languages(name, loaded.manifest)
    lang = (preferred(sources) or sources[0]) if sources else DEFAULT_LANG  # the source's sentence rules
    info = {**summary(loaded), "decoding": decoding.to_dict(), "max_beam": max_beam, "lang": lang,
            "languages": {"source": list(sources), "target": list(targets)}}
    warm_up(loaded, decoding, opts.long_lines)
    return ServedModel(name, loaded, decoding, max_beam, lang, info, metrics.model(name), sources=sources,
                       targets=targets, long_lines=opts.long_lines)


def summary(loaded: Loaded) -> dict[str, Any]:
    """The manifest's facts a client may see in /info (no file paths)."""
    backend, manifest = loaded.backend, loaded.manifest
    return {"backend": backend.name, "device": str(backend.device), "precision": backend.precision,  # what runs
            "shortlist": backend.shortlist is not None,  # serve --shortlist
            "batches_at_once": int(backend.parallel_batches),  # --parallel-batches (the batcher's threads)
            "model_config": manifest.model_config.to_dict(), "model_limits": asdict(manifest.limits),
            "exported_with": manifest.versions}


def warm_up(loaded: Loaded, decoding: DecodingOptions, long_lines: str) -> str:
    """One real translation through the text service, so the first request pays no lazy initialisation."""
    encoded = encode_texts(loaded.tokenizer, [WARMUP_LINE], int(loaded.backend.max_src_len), TextPolicy(long_lines))
    return finish_texts(loaded.tokenizer, encoded, loaded.translate(encoded.ids, decoding, workers=1), 1)[0].text


def attach_detector(state: ServerState) -> None:
    """Language detection over the served languages, loaded and warmed up now when it is installed; without
    it only "source": "auto" and /detect are refused (one line each)."""
    codes = state.routes.codes
    if not codes:
        state.no_detector = "no served model has languages (name models SRC-TGT, like de-en)"
        return
    try:
        state.detector = Detector(codes)
    except DetectorMissing as e:
        state.no_detector = str(e)
        log.warning("%s; \"source\": \"auto\" and /detect are refused", e)
        return
    state.detector.best("warm up")
    if state.detector.unknown:
        log.warning("language detection does not know %s; name them as source", listed(state.detector.unknown))


ANSWER_S = 5  # after --grace-s: the seconds the 503s of requests still waiting have to go out


class _Server(uvicorn.Server):
    """uvicorn re-raises a stop signal after its graceful shutdown, which would end
    the process by that signal; a drained server should exit 0 instead."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.state.draining:
            log.info("signal %d: draining in-flight requests (up to %d s), then stopping", sig,
                     self.config.timeout_graceful_shutdown or 0)
        self.state.draining = True
        for model in self.state.models.values():
            if model.batcher is not None:
                model.batcher.drain()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's graceful shutdown, but when `grace_s` runs out the requests still waiting are answered 503
        with Retry-After (ANSWER_S more for those answers to go out) instead of having their tasks cancelled
        (a plain-text 500 and a traceback)."""
        grace = self.config.timeout_graceful_shutdown
        if grace is not None:
            self.config.timeout_graceful_shutdown = grace + ANSWER_S
            asyncio.get_running_loop().call_later(grace, self._out_of_time, grace)
        await super().shutdown(sockets)

    def _out_of_time(self, grace: int) -> None:
        reason = f"the server is stopping and its --grace-s {grace} ran out before this request was translated"
        failed = sum(model.batcher.abandon(reason) for model in self.state.models.values() if model.batcher)
        if failed:
            log.warning("--grace-s %d ran out: %d request(s) answered 503 (retry elsewhere)", grace, failed)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # SIGHUP (a closed terminal, an operator expecting a reload) drains as SIGTERM does: it killed the process;
        # under nohup (SIGHUP ignored) it stays ignored, so the server outlives its terminal as asked
        hangup = (signal.SIGHUP,) if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN else ()
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM, *hangup)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def trusted_proxies(opts: ServeHttpOptions) -> str:
    """--forwarded-allow-ips (else uvicorn's FORWARDED_ALLOW_IPS), each entry an address, a network or *: uvicorn
    takes any other text for a literal host that no peer is, so a typo (127.0.0.0/33, localhost) trusted no proxy
    without a word and every client behind it shared one keyless rate."""
    option = "--forwarded-allow-ips" if opts.forwarded_allow_ips.strip() else "FORWARDED_ALLOW_IPS"
    trusted = opts.forwarded_allow_ips.strip() or os.environ.get("FORWARDED_ALLOW_IPS", "").strip()
    for entry in (e.strip() for e in trusted.split(",") if e.strip() not in ("", "*")):
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise UserError(f"{option} {entry[:60]!r}: not an address or a network (127.0.0.1, 10.0.0.0/8, ::1), "
                            "nor *") from None
    return trusted


def root_path(given: str) -> str:
    """--root-path as uvicorn takes it: "" or a path of its own (/mt; /mt/ is /mt), else one line."""
    path = given.strip().rstrip("/")
    if path and (not path.startswith("/") or any(c.isspace() or c in "?#" for c in path)):
        raise UserError(f"--root-path {given[:60]!r}: give the URL path the proxy serves this server under, "
                        "like /mt")
    return path


def uvicorn_config(app: Any, opts: ServeHttpOptions, limits: RequestLimits | None = None) -> uvicorn.Config:
    """uvicorn's settings for the app: no log config or access log of its own (ours), the grace period, and proxy
    headers (X-Forwarded-For, X-Forwarded-Proto) believed from --forwarded-allow-ips (or uvicorn's
    FORWARDED_ALLOW_IPS) only: uvicorn's default believes any peer on 127.0.0.1, so behind a local proxy that
    passes a client's own X-Forwarded-For on, each request could name a new address."""
    trusted = trusted_proxies(opts)
    limits = limits or RequestLimits()  # the request's head bounded before it reaches the app (connections.py)
    return uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=opts.grace_s,
                          proxy_headers=bool(trusted), forwarded_allow_ips=trusted or None,
                          root_path=root_path(opts.root_path),
                          http=bounded_protocol(limits.head_timeout_s, limits.max_connections,
                                                cors_origin(opts.cors_origin)))


def serve_http(models: list[tuple[str, str]], opts: ServeHttpOptions, decoding: DecodingOptions,
               limits: RequestLimits) -> None:
    """Run the service for the (name, model dir) pairs until stopped. Blocks; returns after a graceful stop."""
    decoding.validate()
    trusted_proxies(opts)  # a typo is one line now, not a proxy silently distrusted
    metrics = Metrics()
    sock = bind(opts.host, opts.port)
    try:
        if opts.api_keys is None and opts.require_api_key:
            raise UserError("--require-api-key needs --api-keys FILE, the keys to require")
        keys = access.ApiKeys.read(str(opts.api_keys), opts.keyless_rate or None, opts.require_api_key) \
            if opts.api_keys is not None else None
        cors = cors_origin(opts.cors_origin)
        named = read_named(opts.glossary)  # the files first: a bad one is refused before any model loads
        served = {name: load_model(name, path, opts, decoding, metrics) for name, path in models}
        glossaries = check_named(named, {name: model.loaded for name, model in served.items()})
        state = ServerState(served, limits, {**server_info(limits, opts), "glossaries": glossaries_info(glossaries)},
                            metrics, warmed_up=True, keys=keys, cors_origin=cors,
                            access_log=opts.log_format if opts.access_log else None, glossaries=glossaries)
        if opts.access_log:
            access.configure(opts.log_format)
        if opts.suggestions is not None:
            state.suggestions = Suggestions(opts.suggestions)
        attach_detector(state)
        config = uvicorn_config(create_app(state), opts, limits)
        host, port = sock.getsockname()[:2]
        for model in served.values():
            log.info("model %s: %s (backend %s on %s%s)", model.name, dict(models)[model.name],
                     model.loaded.backend.name, model.loaded.backend.device,
                     ", vocabulary shortlist" if opts.load.shortlist else "")
        log.info("LibreTranslate API: %s%s", state.routes.listed(), "" if keys is None else
                 f"; {len(keys)} API key(s), " + ("required" if keys.require else
                                                 f"keyless requests at {opts.keyless_rate or 'any'} per minute"))
        if glossaries:
            log.info("glossaries: %s", ", ".join(f"{name} ({len(g)} entries)" for name, g in glossaries.items()))
        log.info("serving %s at http://%s:%d", ", ".join(served), host if ":" not in host else f"[{host}]", port)
        _Server(config, state).run(sockets=[sock])  # uvicorn's loop: uvloop where installed (the serve extra)
    finally:
        sock.close()
    log.info("stopped")

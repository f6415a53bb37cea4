"""Start, run and stop `pipeline serve`: verify and load the model dir, bind the port,
warm up with one real translation, serve until SIGTERM / Ctrl-C, then drain.

On a stop signal uvicorn stops accepting, lets in-flight requests finish for up to
`grace_s` seconds, then the lifespan stops the batcher; the process then exits 0.
Startup failures (bad model dir, port in use) are UserErrors: one line, exit 2."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import signal
import socket
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import uvicorn

from model.errors import UserError
from pipeline.serve.app import ServerState, create_app
from pipeline.serve.options import DEFAULT_MAX_BEAM, RequestLimits, ServeHttpOptions
from pipeline.serve.translator import Translator
from runtime.decoding import DecodingOptions

log = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a taken port is one clear line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); "
                        "is another server using the port? pick another --port") from None
    sock.set_inheritable(True)
    return sock


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def server_info(translator: Translator, decoding: DecodingOptions, limits: RequestLimits, opts: ServeHttpOptions
                ) -> dict[str, Any]:
    """What /info tells: the manifest summary and this server's settings."""
    versions = {p: _version(p) for p in ("pipeline", "torch", "onnxruntime", "sentencepiece", "starlette",
                                         "uvicorn")}
    return {**translator.summary(), "versions": versions, "decoding": asdict(decoding),
            "limits": {**asdict(limits), "long_lines": opts.long_lines}, "grace_s": opts.grace_s}


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
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def serve_http(model_dir: str, opts: ServeHttpOptions, decoding: DecodingOptions, limits: RequestLimits) -> None:
    """Run the service until stopped. Blocks; returns after a graceful stop."""
    decoding.validate()
    translator = Translator.load(model_dir, opts.backend, opts.device, opts.threads, opts.long_lines)
    max_beam = translator.model_limit("max_beam") or DEFAULT_MAX_BEAM
    if decoding.beam_size > max_beam:
        raise UserError(f"--beam-size {decoding.beam_size} is above the model dir's limit of {max_beam}")
    limits = RequestLimits(**{**asdict(limits), "max_beam": max_beam})
    state = ServerState(translator, decoding, limits, server_info(translator, decoding, limits, opts))
    sock = bind(opts.host, opts.port)
    try:
        translator.warm_up(decoding)
        state.warmed_up = True
        config = uvicorn.Config(create_app(state), log_config=None, access_log=False, lifespan="on",
                                timeout_graceful_shutdown=opts.grace_s)
        host, port = sock.getsockname()[:2]
        log.info("serving %s (backend %s on %s) at http://%s:%d", model_dir, translator.backend.name,
                 translator.backend.device, host if ":" not in host else f"[{host}]", port)
        asyncio.run(_Server(config, state).serve(sockets=[sock]))
    finally:
        sock.close()
    log.info("stopped")

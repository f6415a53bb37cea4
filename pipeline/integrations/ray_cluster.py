"""Reaching the Ray cluster a job runs on (`ray-translate --address`, or a local one it starts): an address where
nothing answers refused in seconds (Ray retries it for minutes), Ray's own start-up lines kept off the terminal,
and this process's SIGTERM handler kept (ray.init puts its own)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from model.errors import UserError

log = logging.getLogger(__name__)


def connect(address: str | None) -> bool:
    """Reach the cluster (or start a local one); whether this call started the connection (and so ends it).
    Ray's own log lines (its start-up warnings, the workers' output) stay in its session logs unless -v."""
    import ray

    if ray.is_initialized():
        return False
    root = str(Path(__file__).resolve().parents[2])  # workers import this checkout, installed or not
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    verbose = log.isEnabledFor(logging.DEBUG)
    quiet: dict[str, Any] = {"include_dashboard": False, "log_to_driver": verbose,
                             "logging_level": logging.INFO if verbose else logging.ERROR}
    if address is not None:
        probe(address)
    terminate = signal.getsignal(signal.SIGTERM)  # ray.init puts its own: exit 15 with a C++ stack dump
    try:
        if address is None:
            # a local cluster's processes inherit this environment: no runtime_env, which would leave the workers
            # Ray prestarts unusable for the job (they start without it) and start fresh ones, ~3 s of CPU each
            with _environ("PYTHONPATH", path):
                # "local": a cluster of its own, even where `ray start` left one (joined, it could be another
                # user's, or dead: Ray then retries it for ever); --address names a cluster to join
                ray.init(address="local", **quiet)
        else:
            ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": path}}, **quiet)
    except ConnectionError as e:
        if address is None:
            raise UserError(f"a local Ray cluster could not start ({e})") from None
        # something answered the probe: a cluster that refused this driver (Ray 2.60's token authentication), or
        # not a Ray cluster at all
        raise UserError(f"--address {address}: something answers there, but Ray could not join it as a cluster "
                        f"({str(e)[:200]}); if it is a Ray cluster that requires a token (RAY_AUTH_MODE=token), set "
                        "RAY_AUTH_MODE and RAY_AUTH_TOKEN as its head has them; else start one with `ray start "
                        "--head`") from None
    finally:
        if terminate is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, terminate)  # ours again: "terminated (SIGTERM)", status 143, as serve-batch
    return True


PROBE_SECONDS = 5.0


def probe(address: str) -> None:
    """Refuse in seconds an --address where nothing listens: Ray itself retries such an address for minutes.
    `auto` is probed at the address `ray start` recorded, when there is one (else ray.init says it finds none)."""
    target = address.split("://", 1)[-1]
    if target == "auto":
        try:
            from ray._private.services import canonicalize_bootstrap_address

            target = canonicalize_bootstrap_address("auto") or ""
        except ConnectionError:  # none recorded, none running: ray.init's error then said "something answers"
            raise UserError(f"--address {address}: no Ray cluster runs on this machine (`ray start --head` starts "
                            "one); leave --address out for a local one") from None
        except Exception:  # noqa: BLE001 - Ray's private API moved: ray.init says what it finds
            return
    host, sep, port = target.rpartition(":")
    host = host.strip("[]")  # an IPv6 [::1]:6379
    if not (sep and host and port.isdigit()):
        raise UserError(f"--address {address}: not `auto` or HOST:PORT (the head's GCS address, as `ray start "
                        "--head` prints it)")
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_SECONDS).close()
    except OSError as e:
        if isinstance(e, ConnectionRefusedError):
            why = "connection refused"
        elif isinstance(e, TimeoutError):  # socket.timeout
            why = f"no answer in {PROBE_SECONDS:g} s"
        elif isinstance(e, socket.gaierror):
            why = f"unknown host {host!r}"
        else:
            why = e.strerror or str(e)
        raise UserError(f"--address {address}: no Ray cluster answers there ({why}); start one with `ray start "
                        "--head` or leave --address out") from None


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before

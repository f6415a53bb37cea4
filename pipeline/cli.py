"""The `pipeline` command line: thin click commands that parse options and delegate."""

from __future__ import annotations

import errno
import logging
import signal
import sys
from typing import Any

import click

from model.errors import UserError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-v", "--verbose", is_flag=True, help="Log debug details.")
@click.version_option(package_name="pipeline")
def cli(verbose: bool) -> None:
    """Train the paper's Transformer, export it to ONNX / TensorRT, translate files
    with beam search on any backend, and prove the backends translate alike."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


def _register() -> None:
    # One line per command module; each module defines exactly one click command.
    from pipeline.commands.train import average, train
    cli.add_command(train)
    cli.add_command(average)
    from pipeline.commands.serve_batch import serve_batch
    cli.add_command(serve_batch)
    from pipeline.commands.serve import serve
    cli.add_command(serve)
    from pipeline.commands.export import export
    cli.add_command(export)
    from pipeline.commands.parity import parity
    cli.add_command(parity)
    from pipeline.commands.bench import bench
    cli.add_command(bench)
    from pipeline.commands.demo import demo
    cli.add_command(demo)
    from pipeline.commands.doctor import doctor
    cli.add_command(doctor)
    from pipeline.commands.tune import tune_decoding_cmd
    cli.add_command(tune_decoding_cmd)
    from pipeline.commands.random_checkpoint import random_checkpoint
    cli.add_command(random_checkpoint)


# What to do about the environment faults a user meets (the OSError's own text says what happened).
_FIXES = {
    errno.ENOSPC: "no space left on device; free space and rerun",
    errno.EDQUOT: "disk quota exceeded; free space and rerun",
    errno.EROFS: "read-only file system; choose a writable location",
    errno.EACCES: "permission denied; choose a location you can write, or fix its permissions",
    errno.EPERM: "operation not permitted; choose a location you can write, or fix its permissions",
    errno.EISDIR: "is a directory; give a file path",
    errno.ENOTDIR: "a parent of this path is not a directory",
    errno.ENOENT: "no such file or directory",
}


class Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so every `finally` and atomic write cleans
    up on the way out (a BaseException: no `except Exception` may swallow it)."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated(signum)


def describe_os_error(e: OSError) -> str:
    """`<path>: <reason>` for an OSError, with the fix for the usual environment faults."""
    reason = _FIXES.get(e.errno or 0) or e.strerror or str(e)
    where = e.filename if e.filename is not None else e.filename2
    return f"{where}: {reason}" if where is not None else reason


def main(argv: list[str] | None = None) -> None:
    """Run a command; every user mistake or environment fault ends as one line on stderr.
    Anything else is a bug and keeps its traceback, so it can be reported."""
    _register()
    try:
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread (an embedding caller): leave signals alone
        previous = None
    try:
        cli.main(args=argv, prog_name="pipeline", standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("interrupted (Ctrl-C)", err=True)
        sys.exit(130)
    except Terminated:
        click.echo("terminated (SIGTERM)", err=True)
        sys.exit(128 + signal.SIGTERM)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except UserError as e:  # the user's to fix: one line, exit 2, no traceback
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except OSError as e:
        click.echo(f"error: {describe_os_error(e)}", err=True)
        sys.exit(2)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

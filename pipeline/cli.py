"""The `pipeline` command line: thin click commands that parse options and delegate."""

from __future__ import annotations

import logging
import sys

import click

from export.errors import ExportError
from model.checkpoint import CheckpointError
from model.config import ConfigError
from model.manifest import ModelDirError
from pipeline.errors import UserError
from runtime.errors import RuntimeUserError

# Errors that are the user's to fix: one line on stderr, exit status 2, no traceback.
# ExportError covers VerificationError and TensorRTUnavailable; RuntimeUserError covers
# the tokenizer's TokenizerError.
USER_ERRORS = (UserError, ConfigError, CheckpointError, ModelDirError, RuntimeUserError, ExportError)


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
    from pipeline.train_cli import average, train
    cli.add_command(train)
    cli.add_command(average)
    from pipeline.serve_cli import serve_batch
    cli.add_command(serve_batch)
    from pipeline.export_cli import export
    cli.add_command(export)
    from pipeline.parity_cli import parity
    cli.add_command(parity)
    from pipeline.bench_cli import bench
    cli.add_command(bench)
    from pipeline.demo_cli import demo
    cli.add_command(demo)
    from pipeline.doctor_cli import doctor
    cli.add_command(doctor)
    from pipeline.tune_cli import tune_decoding_cmd
    cli.add_command(tune_decoding_cmd)


def main(argv: list[str] | None = None) -> None:
    _register()
    try:
        cli.main(args=argv, prog_name="pipeline", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except USER_ERRORS as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)

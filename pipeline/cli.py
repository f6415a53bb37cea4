"""The `pipeline` command line: thin click commands that parse options and delegate."""

from __future__ import annotations

import errno
import importlib
import logging
import os
import signal
import sys
from typing import Any

import click

from model.errors import UserError
from pipeline.invocation import record
from pipeline.textio import OutputClosed

# Each command's module, imported only when that command runs (`--help` lists SUMMARIES), so a
# deploy-only install (no torch) serves, and every command starts without the others' imports.
COMMANDS = {
    "train": "pipeline.commands.train:train",
    "import": "pipeline.commands.import_model:import_group",
    "average": "pipeline.commands.train:average",
    "export": "pipeline.commands.export:export",
    "serve-batch": "pipeline.commands.serve_batch:serve_batch",
    "ray-translate": "pipeline.commands.ray_translate:ray_translate",
    "serve": "pipeline.commands.serve:serve",
    "parity": "pipeline.commands.parity:parity",
    "bench": "pipeline.commands.bench:bench",
    "tune-decoding": "pipeline.commands.tune:tune_decoding_cmd",
    "demo": "pipeline.commands.demo:demo",
    "doctor": "pipeline.commands.doctor:doctor",
    "random-checkpoint": "pipeline.commands.random_checkpoint:random_checkpoint",
}
# What `pipeline --help` lists for each command, without importing it (torch alone takes seconds):
# each command's first sentence, tests/test_cli_options.py keeps them equal.
SUMMARIES = {
    "train": "Train the Transformer on a parallel corpus (or the built-in one) into --save-dir.",
    "import": "Import a model trained elsewhere as a checkpoint that export, serve-batch, serve, parity and bench "
              "take as they take ours.",
    "average": "Average the weights of the last K checkpoints of a save dir (section 6.1).",
    "export": "Export CHECKPOINT (a save dir: its latest or averaged checkpoint; or one .pt file) to a verified "
              "model directory: encoder.onnx, decoder.onnx, TensorRT engines when possible, model.pt, spm.model and "
              "manifest.json.",
    "serve-batch": "Translate INPUT files ('-' = stdin) with the model in MODEL_DIR, line-aligned.",
    "ray-translate": "Translate INPUT files, globs or directories of shards (plain, .gz or Parquet) on a Ray cluster "
                     "with the model in MODEL_DIR, one line-aligned output per input, exactly as serve-batch "
                     "translates them.",
    "serve": "Serve the model in MODEL_DIR (or several: --model NAME=DIR ...) over HTTP, batching concurrent "
             "requests dynamically, one queue per model.",
    "parity": "Translate SRC with each backend of MODEL_DIR and compare with the PyTorch model: BLEU and chrF "
              "against REF, BLEU against PyTorch, share of token-identical sentences, first divergence step and "
              "log-prob gap.",
    "bench": "Measure target tokens/s, sentences/s, latency and peak memory per backend of MODEL_DIRS.",
    "tune-decoding": "Pick --beam-size and --alpha for serve-batch on a validation set: MODEL is an exported model "
                     "dir, a checkpoint, or a training save dir (its averaged or latest checkpoint).",
    "demo": "Train on the built-in made-up language pair, export fp32, fp16 and int8, translate the test file with "
            "serve-batch and print the parity table of each backend against PyTorch.",
    "doctor": "Say what this machine can run: Python, PyTorch (CUDA, cuDNN, GPUs, bf16, NCCL), onnxruntime and its "
              "execution providers, TensorRT (or exactly why not), tokenizer / scoring / CTranslate2 versions and "
              "the CPU's instruction sets.",
    "random-checkpoint": "Write OUT, a checkpoint with random weights of a preset's shape and a real tokenizer, to "
                         "measure a shape's speed and memory without training it:",
}
TRAIN_EXTRA = 'pip install -e ".[train]"'
# Packages some commands import only when they need them, and the extra (pyproject.toml) that installs each:
# a deploy-only install lacks most of them, and a command that reaches one says so in one line.
OPTIONAL_PACKAGES = {
    "torch": "train", "onnxscript": "train", "transformers": "import", "safetensors": "import",
    "ctranslate2": "bench", "starlette": "serve", "uvicorn": "serve", "prometheus_client": "serve",
    "httpx": "serve", "sentencex": "serve", "tensorboard": "tensorboard", "onnxruntime": "cpu", "onnx": "deploy",
    "ray": "ray", "pyarrow": "ray", "pyspark": "spark",
}


def needs_torch(name: str) -> click.Command:
    """What `pipeline NAME` is in an install without PyTorch: one line saying how to get it."""
    def refuse() -> None:
        raise UserError(f"`pipeline {name}` needs PyTorch, which this install does not have (a deploy-only "
                        f"install): {TRAIN_EXTRA}")

    return click.Command(name, callback=refuse, help="Needs PyTorch: " + TRAIN_EXTRA,
                         context_settings={"ignore_unknown_options": True, "allow_extra_args": True})


class LazyGroup(click.Group):
    """A click group whose commands are imported on first use (see COMMANDS)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list of `pipeline --help` as click writes it, from SUMMARIES: no command imported."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)
        with formatter.section("Commands"):
            formatter.write_dl([(name, click.Command(name, help=SUMMARIES[name]).get_short_help_str(limit))
                                for name in names])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, attr = COMMANDS[cmd_name].split(":")
        try:
            command = getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as e:
            if e.name != "torch":
                raise
            return needs_torch(cmd_name)
        assert isinstance(command, click.Command)
        return command


def all_commands() -> dict[str, click.Command]:
    """Every command, imported (tests and documentation)."""
    found = {name: cli.get_command(click.Context(cli), name) for name in COMMANDS}
    return {name: c for name, c in found.items() if c is not None}


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-v", "--verbose", is_flag=True, help="Log debug details.")
@click.version_option(package_name="pipeline")
def cli(verbose: bool) -> None:
    """Train the paper's Transformer, export it to ONNX / TensorRT, translate files
    with beam search on any backend, and prove the backends translate alike."""
    # under torchrun, the other ranks say only what goes wrong (each line was there once per process: 8 GPUs, 8)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO if rank == "0" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s" if rank == "0" else
                        f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s", datefmt="%H:%M:%S")


# What to do about the environment faults a user meets (the OSError's own text says what happened).
_FIXES = {
    errno.ENOSPC: "no space left on device; free space and rerun",
    errno.EDQUOT: "disk quota exceeded; free space and rerun",
    errno.EROFS: "read-only file system; choose a writable location",
    errno.EACCES: "permission denied; fix its permissions, or choose another path",  # read or write alike
    errno.EPERM: "operation not permitted; fix its permissions, or choose another path",
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


def missing_package(e: ModuleNotFoundError, argv: list[str]) -> str | None:
    """The one line for an optional package a command needs and this install lacks; None for any other
    missing module (our own code missing is a bug, and keeps its traceback)."""
    package = (e.name or "").split(".")[0]
    extra = OPTIONAL_PACKAGES.get(package)
    if extra is None:
        return None
    command = next((a for a in argv if a in COMMANDS), None)
    if command == "import":  # its extra brings torch, transformers and safetensors together
        extra = "import"
    what = f"`pipeline {command}` as called here" if command else "this command"
    return f"{what} needs {package}, which this install does not have: pip install -e \".[{extra}]\""


def main(argv: list[str] | None = None) -> None:
    """Run a command; every user mistake or environment fault ends as one line on stderr.
    Anything else is a bug and keeps its traceback, so it can be reported."""
    record(sys.argv[1:] if argv is None else argv)
    try:
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread (an embedding caller): leave signals alone
        previous = None
    try:
        cli.main(args=argv, prog_name="pipeline", standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt) as e:
        if isinstance(e.__cause__, EOFError):  # click turns an escaped EOFError into Abort: a bug, not a Ctrl-C
            raise e.__cause__ from None
        click.echo("interrupted (Ctrl-C)", err=True)
        sys.exit(130)
    except Terminated:
        click.echo("terminated (SIGTERM)", err=True)
        sys.exit(128 + signal.SIGTERM)
    except getattr(click.exceptions, "NoArgsIsHelpError", ()) as e:  # `pipeline import` alone: its help (8.2+)
        e.show()
        sys.exit(e.exit_code)
    except click.ClickException as e:  # click's own checks (an unknown option, a value of the wrong type): one
        # `error:` line as every refusal is, and where the usage is (click printed four lines, "Error:" last)
        # a command may name another to see (`pipeline import DIR` runs `auto`: "see `pipeline import --help`")
        path = e.ctx.meta.get("pipeline.usage_path", e.ctx.command_path) if isinstance(e, click.UsageError) and \
            e.ctx else None
        usage = f" (see `{path} --help`)" if path else ""
        message = e.format_message()
        if isinstance(e, click.NoSuchOption) and e.option_name == "--resume" and e.ctx and e.ctx.info_name in (
                "train", "demo"):  # click offered --preset
            where = "--save-dir" if e.ctx.info_name == "train" else "--out"
            message = (f"no option --resume: a run resumes by itself; rerun the same command (the same {where}) "
                       "and it goes on from its latest checkpoint")
        click.echo(f"error: {message}{usage}", err=True)
        sys.exit(e.exit_code)
    except UserError as e:  # the user's to fix: one line, exit 2, no traceback
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except OutputClosed:  # `-o - | head`: quiet, as a command killed by SIGPIPE is; what Python still holds for
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # standard output goes nowhere (its
        sys.exit(128 + signal.SIGPIPE)  # flush at exit printed "Exception ignored ... BrokenPipeError")
    except OSError as e:
        click.echo(f"error: {describe_os_error(e)}", err=True)
        sys.exit(2)
    except ModuleNotFoundError as e:
        line = missing_package(e, sys.argv[1:] if argv is None else argv)
        if line is None:
            raise
        click.echo(f"error: {line}", err=True)
        sys.exit(2)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

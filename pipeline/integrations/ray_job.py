"""`pipeline ray-translate`: shards read by Ray Data, translated by a pool of `Translator` actors, written
back per shard in line order.

    read (ray_read: each row's shard, line number, text)  ->  map_batches(Translator, concurrency=actors)
        ->  the driver: ShardWriter (line order restored, each output renamed into place when complete)

Order: Ray Data is asked to keep block order (cheap, and it bounds what the writer holds back), but the
writer does not rely on it: every row carries its shard and line, so rows are put back in place whatever
order they come in, and a line that comes twice or never is an error. Faults: an actor that dies is
restarted and its batches retried by Ray Data; outputs are written only by the driver, so a retried batch
is written once. A driver that dies leaves the completed shards' outputs and no partial one: rerunning the
same command translates the rest."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model.errors import UserError
from pipeline.integrations.options import RayOptions
from pipeline.integrations.ray_cluster import connect
from pipeline.integrations.ray_read import READERS, LinesDatasource, shard_lines
from pipeline.integrations.shards import Plan, Shard, ShardWriter
from pipeline.integrations.translator import Translator
from pipeline.serve_batch.files import progress_bar
from pipeline.serve_batch.translation import ServeBatchOptions
from pipeline.textio import read_head
from runtime.decoding import DecodingOptions
from runtime.glossary import Glossary
from runtime.model_dir import LoadOptions

log = logging.getLogger(__name__)

@dataclass
class JobStats:
    lines: int = 0
    empty: int = 0
    truncated: int = 0
    replaced: int = 0
    min_len_over: int = 0          # rows whose maximum output length is below --min-len
    terms: int = 0                 # with a glossary: the terms found in the rows, and those the translations hold
    terms_applied: int = 0
    line_breaks: int = 0           # rows whose translation held line ends, written as spaces
    pieced: int = 0                # rows with a sentence over the source limit, translated in pieces that fit
    unclosed: int = 0              # --format html rows leaving a tag open: the rest of each copied untranslated
    startup_seconds: float = 0.0  # reaching or starting the cluster
    seconds: float = 0.0          # from then to the last output renamed into place
    actors: int = 0
    fit: int = 0                   # the actors the cluster held at the start (fewer than asked: Ray places what fits)

    def summary(self, plan: Plan) -> str:
        rate = self.lines / self.seconds if self.seconds > 0 else 0.0
        placed = f" asked, {self.fit} fitting the cluster at the start" if self.fit < self.actors else ""
        return (f"translated {self.lines} lines of {len(plan.todo)} shard(s) in {self.seconds:.2f} s: {rate:.1f} "
                f"lines/s on {self.actors} actor(s){placed}; {len(plan.skipped)} shard(s) already complete; Ray "
                f"start-up {self.startup_seconds:.2f} s")


def translate_shards(model_dir: str | Path, plan: Plan, load_options: LoadOptions, decoding: DecodingOptions,
                     opts: ServeBatchOptions, ray_opts: RayOptions, progress: bool = False,
                     glossary: Glossary | None = None) -> JobStats:
    """Translate every shard of plan.todo on the cluster (reached or started here) into its output, with
    `glossary` (read and checked by the driver, each actor checking it against its model once more) if given;
    opts.glossary, files the actors would read, must be empty."""
    import ray

    if opts.glossary:
        raise ValueError("read the glossary files once, in the driver, and pass the Glossary")
    stats = JobStats()
    started = time.perf_counter()
    ours = connect(ray_opts.address)
    stats.startup_seconds = time.perf_counter() - started
    try:
        if plan.todo:
            resources = ray.cluster_resources()
            stats.actors = actors(ray_opts, load_options, resources)
            stats.fit = actors(dataclasses.replace(ray_opts, actors=0), load_options, resources)
            _run(model_dir, plan, load_options, decoding, opts, ray_opts, stats, progress, glossary)
    finally:
        if ours:
            ray.shutdown()
    stats.seconds = time.perf_counter() - started - stats.startup_seconds
    return stats


def actors(ray_opts: RayOptions, load_options: LoadOptions, resources: dict[str, float]) -> int:
    """How many actors: as asked, or as many as the cluster's CPUs (GPUs) hold; asking for more GPUs than the
    cluster has is refused now rather than left waiting."""
    threads = load_options.threads or 1
    if ray_opts.gpus_per_actor > 0:
        gpus = resources.get("GPU", 0.0)
        if gpus < ray_opts.gpus_per_actor:
            raise UserError(f"--gpus-per-actor {ray_opts.gpus_per_actor:g}: the cluster has {gpus:g} GPU(s); "
                            "leave it at 0 for CPU actors")
        fit = int(gpus // ray_opts.gpus_per_actor)
    else:
        cpus = resources.get("CPU", 0.0)
        if threads > cpus:  # no actor could be placed: the job would wait for ever, saying nothing
            raise UserError(f"--threads {threads}: each actor reserves that many CPUs and the cluster has {cpus:g}; "
                            f"give at most {int(cpus)}")
        fit = max(1, int(cpus // threads))
    if ray_opts.actors and ray_opts.actors > fit:
        log.warning("--actors %d: the cluster holds %d now (%s); Ray starts those and the others if it grows",
                    ray_opts.actors, fit, f"{resources.get('GPU', 0.0):g} GPU(s)" if ray_opts.gpus_per_actor > 0
                    else f"{resources.get('CPU', 0.0):g} CPUs, {threads} thread(s) an actor")
    return ray_opts.actors or fit


def _run(model_dir: str | Path, plan: Plan, load_options: LoadOptions, decoding: DecodingOptions,
         opts: ServeBatchOptions, ray_opts: RayOptions, stats: JobStats, progress: bool,
         glossary: Glossary | None) -> None:
    import ray.data

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False  # ours counts lines across the cluster
    # set before the dataset is made (it copies the context), and put back after: the caller's Ray Data jobs as
    # they were
    with contextlib.ExitStack() as settings:
        settings.callback(setattr, context, "target_max_block_size", context.target_max_block_size)
        settings.enter_context(_no_retries(context))
        if not log.isEnabledFor(logging.DEBUG):  # Ray Data's plan, timing and error lines: in its ray-data.log
            settings.enter_context(_console_quiet("ray.data"))
            settings.enter_context(warnings.catch_warnings())  # and its UserWarnings (the actor pool's minimum)
            warnings.filterwarnings("ignore", category=UserWarning, module=r"ray\.data(\.|$)")
        # Ray Data joins what a task yields into blocks of up to this many bytes (128 MiB by default: a whole
        # shard, translated by one actor, its rows held until it is done). Blocks of about --batch-size rows keep
        # every actor busy, the writer fed, and a retry small.
        context.target_max_block_size = max(1 << 12, int(0.75 * ray_opts.batch_size * _row_bytes(plan.todo[0])))
        _translate(ray.data, model_dir, plan, load_options, decoding, opts, ray_opts, stats, progress, glossary)


def _translate(data: Any, model_dir: str | Path, plan: Plan, load_options: LoadOptions, decoding: DecodingOptions,
               opts: ServeBatchOptions, ray_opts: RayOptions, stats: JobStats, progress: bool,
               glossary: Glossary | None) -> None:
    threads = load_options.threads or 1
    ds = data.read_datasource(LinesDatasource(plan.todo, ray_opts.column, opts.invalid_utf8, ray_opts.batch_size),
                              num_cpus=0, concurrency=READERS)
    ds = ds.map_batches(_JobTranslator, batch_size=ray_opts.batch_size,
                        compute=data.ActorPoolStrategy(size=stats.actors),
                        num_cpus=0 if ray_opts.gpus_per_actor else threads, num_gpus=ray_opts.gpus_per_actor or None,
                        fn_constructor_kwargs={"model_dir": str(Path(model_dir).resolve()), "column": "text",
                                               "load_options": dataclasses.replace(load_options, threads=threads),
                                               "decoding": decoding, "options": opts,
                                               "origin_columns": ("path", "line"), "glossary": glossary})
    writer = ShardWriter(plan.todo)
    bar = progress_bar("translating", progress, shard_lines(plan.todo) if progress and sys.stderr.isatty() else None)
    try:
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            translations, broken = one_line_each(batch["translation"])
            stats.line_breaks += broken
            writer.add_rows(batch["shard"], batch["line"] - 1, translations, batch["last"])
            stats.lines += len(batch["line"])
            stats.empty += int(batch["empty"].sum())
            stats.truncated += int((batch["truncated"] > 0).sum())  # lines (a row counts its sentences cut)
            stats.replaced += int(batch["replaced"].sum())
            for name in _BATCH_COUNTS:
                setattr(stats, name, getattr(stats, name) + int(batch[name].sum()))
            bar.update(len(batch["line"]))
        writer.finish()
        if stats.line_breaks:
            log.warning("%d row(s) held line ends their translations kept (--split sentences and --format html copy "
                        "the text between sentences): written as spaces, one line per row", stats.line_breaks)
        if stats.min_len_over:
            log.warning("%d row(s) have a maximum output length below --min-len %d; they stop at that maximum",
                        stats.min_len_over, decoding.min_len)
        if stats.pieced:  # every word translated, a sentence in pieces: said, as serve-batch says it
            log.warning("%d line(s) held a sentence longer than the model's source limit, translated in pieces that "
                        "fit (--long-lines error refuses them)", stats.pieced)
        if stats.unclosed:
            log.warning("%d line(s) leave a tag, a comment or a <script> open, so the rest of each is copied "
                        "untranslated: --format html reads each line as an HTML document", stats.unclosed)
    except BaseException as e:
        writer.abort(e)
        raise _user_error(e) or e from None
    finally:
        bar.close()


_BREAK = re.compile(r"\r?\n")


def one_line_each(translations: Any) -> tuple[list[str], int]:
    """Each row's translation on one line of its output, and how many rows that repaired: line N is row N. A
    Parquet row may hold line ends (a text shard's rows cannot), which a sentence split copies between its
    sentences: made spaces. A lone CR stays, as serve-batch keeps it."""
    out, repaired = [], 0
    for text in translations:
        if "\n" in text:
            text = _BREAK.sub(" ", text)
            repaired += 1
        out.append(text)
    return out, repaired


# A shard's error (a bad file, a refused line) is the same on every try: Ray Data's defaults retry none of them
# today, and these pin it (a retry would repeat the error, its traceback and its notice on the terminal)
_NO_RETRIES = {"max_errored_blocks": 0, "max_map_retries": 0, "retried_map_errors": False,
               "actor_task_retry_on_errors": False, "actor_init_retry_on_errors": False}


@contextlib.contextmanager
def _no_retries(context: Any) -> Iterator[None]:
    before = {name: getattr(context, name) for name in _NO_RETRIES if hasattr(context, name)}
    for name in before:
        setattr(context, name, _NO_RETRIES[name])
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(context, name, value)


@contextlib.contextmanager
def _console_quiet(name: str) -> Iterator[None]:
    """The logger's terminal handlers silenced (its file handlers, Ray's session logs, still get everything)."""
    handlers = [h for h in logging.getLogger(name).handlers
                if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
    levels = [h.level for h in handlers]
    for h in handlers:
        h.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for h, level in zip(handlers, levels):
            h.setLevel(level)


class _JobTranslator(Translator):
    """The Translator returning only the columns the writer takes: the actors drop the source text and path
    themselves, so no projection step (a Ray task per block, each a worker process to start on a small
    machine) follows them."""

    counts: dict[str, int] = {}  # the last batch's _BATCH_COUNTS
    API = False  # its refusals name the command's flags alone (the Python options meant nothing on a terminal)

    def __init__(self, *args: Any, **kwargs: Any):
        self.refused: UserError | None = None
        try:
            super().__init__(*args, **kwargs)
        except UserError as e:  # said by its first batch, as a shard's refusal is: an actor that failed to start
            self.refused = e  # had Ray print its tracebacks (192 lines, on a node without the model dir) first

    def __call__(self, batch: Any) -> Any:
        with _marked():
            if self.refused is not None:
                raise self.refused
            done = super().__call__(batch)
        back = {name: done[name] for name in _BACK}
        # the batch's counts (rows stopped below --min-len, the glossary's terms), on its first row: the actors' own
        # warnings stay in Ray's logs (log_to_driver off), and the driver says them once for the job
        for name in _BATCH_COUNTS:
            back[name] = np.zeros(len(back["line"]), np.int32)
            back[name][:1] = self.counts[name]
        return back

    def translate(self, sources: Any, origins: Any = None) -> Any:
        done = super().translate(sources, origins)
        self.counts = {name: getattr(done, name) for name in _BATCH_COUNTS}
        return done


_BACK = ("shard", "line", "translation", "last", "replaced", "empty", "truncated")
# per batch, in Translated and JobStats alike
_BATCH_COUNTS = ("min_len_over", "terms", "terms_applied", "pieced", "unclosed")


def _row_bytes(shard: Shard) -> int:
    """About how many bytes a row of `shard` takes in a block (its text, measured on the first lines, and the
    columns beside it)."""
    if shard.parquet:
        import pyarrow.parquet as pq  # type: ignore[import-untyped]

        meta = pq.read_metadata(shard.path)
        text = meta.serialized_size if meta.num_rows == 0 else sum(
            meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)) // meta.num_rows
    else:
        head = read_head(shard.path, 1 << 16)
        text = len(head) // max(1, head.count(b"\n"))
    return text + len(shard.path) + 4 * 4 + 8 + 4 + 2  # text, path and their offsets, line, shard, flags


# An actor's UserError crosses to the driver as the text of Ray's error (Ray Data wraps it in a UserCodeException
# whose cause does not survive the trip; an actor that fails to start is an ActorDiedError): marked so, its line
# is found in that text
_MARK = "pipeline-user-error: "


@contextlib.contextmanager
def _marked() -> Iterator[None]:
    """An actor's UserError re-raised with its message marked for the driver (_user_error)."""
    try:
        yield
    except UserError as e:
        raise UserError(_MARK + str(e).split("\n", 1)[0]) from None


def _user_error(e: BaseException) -> UserError | None:
    """The user's mistake a worker or the driver raised (a refused line, invalid UTF-8, a shard it cannot read, a
    bad model dir, a language the model lacks), without the layers of Ray's wrapping: one line, as serve-batch
    says it."""
    from ray.exceptions import RayError

    seen: BaseException | None = e
    for _ in range(20):
        if seen is None:
            break
        if isinstance(seen, UserError) and not isinstance(seen, RayError):
            # Ray Data appends its retry notice to the message's own args: the first line is ours
            return UserError(str(seen).split("\n", 1)[0].removeprefix(_MARK))
        seen = getattr(seen, "cause", None) or seen.__cause__
    found = re.search(re.escape(_MARK) + r"([^\n]*)", str(e))
    return UserError(found.group(1)) if found else None

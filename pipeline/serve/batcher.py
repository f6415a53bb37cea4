"""Dynamic batching: requests queue on the event loop, backend threads translate.

The collector coroutine takes the first request of the queue, adds the following ones
that share its decoding options while their source tokens x beam fit `max_batch_tokens`,
and waits at most `max_wait_s` (counted from the first request's arrival) for more. A
request larger than the budget is taken a budget's worth of lines at a time, so a
streaming client receives its first lines while the rest are translated. Requests take
turns: one that has had a budget's worth of lines since its turn began goes to the back
of the queue before the next batch is collected, so a request that arrives behind a big
one waits about one batch of it (one per big request ahead of it), not all of them.
The wait ends as soon as no other request is on its way (every request the server is handling,
`in_flight`, is queued, none decoding or being read): a lone client's request starts at once instead of
waiting for company that is not coming. The batch runs on a backend thread, so the event loop keeps
accepting, answering /health and reading bodies while the backend works; requests that arrive meanwhile
form the next batch. A backend that decodes several batches at once (`parallel_batches`: the onnxruntime
backend on a CPU of 2 or more threads, each batch on its share of them) gets that many
threads, and the next batch is collected and started while the others run: a lone request
runs on one thread, faster than on two at batch 1, and several requests run side by side
(docs/performance.md). Results go back to each request's Work in line order, whichever of
its batches ends first: `ready(n)` waits for its first n lines, `future` for all of them."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pipeline.serve.metrics import ModelMetrics
from runtime.constrained import constrained_beam
from runtime.decoding import DecodingOptions
from runtime.model_dir import Loaded
from runtime.translate import NBest

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The queue holds max_queue requests already (an HTTP 503 with Retry-After)."""


class BatcherStopped(Exception):
    """The server stopped before this request was translated."""


@dataclass(eq=False)
class Work:
    """One request's lines on their way through the queue."""

    ids: list[list[int]]
    decoding: DecodingOptions
    future: asyncio.Future[list[NBest]]
    first: int | None = None  # a multilingual model's target language token, forced first in every line
    constraints: list[list[list[int]]] | None = None  # per line, a glossary's target token phrases; None: no term
    wide_beam: int = 0  # the beam a line with phrases is searched with (runtime/constrained.py constrained_beam)
    enqueued: float = field(default_factory=time.monotonic)
    taken: int = 0  # lines handed to a batch so far
    turn: int = 0  # the cost of the lines taken since its turn began (Batcher._take_turns)
    results: list[NBest] = field(default_factory=list)  # of the first len(results) lines
    ahead: dict[int, list[NBest]] = field(default_factory=dict)  # later lines' results, by first line, until theirs
    progress: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def finished(cls, results: list[NBest], decoding: DecodingOptions) -> Work:
        """A Work with nothing to translate (blank lines only)."""
        work = cls([[] for _ in results], decoding, asyncio.get_running_loop().create_future())
        work._add(0, results)
        return work

    async def ready(self, n: int) -> None:
        """Until the first n lines are translated (in `results`); this Work's error if it failed."""
        while len(self.results) < n:
            if self.future.done():
                self.future.result()  # raises the failure or CancelledError
            self.progress.clear()
            await self.progress.wait()

    def _add(self, start: int, share: list[NBest]) -> None:
        """The results of lines start:start + len(share); kept aside until every earlier line has its own."""
        self.ahead[start] = share
        while len(self.results) in self.ahead:
            self.results += self.ahead.pop(len(self.results))
        if len(self.results) == len(self.ids):
            self.future.set_result(self.results)
        self.progress.set()

    def _fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)
            if isinstance(error, BatcherStopped):  # a stopping server's: no "exception never retrieved" when no
                self.future.exception()           # request is left to await it (a second Ctrl-C's)
        self.progress.set()

    @property
    def key(self) -> tuple[int, int, bool]:
        # Requests batch together only when the search would treat them alike (targets may differ).
        return (self.decoding.beam_size, self.decoding.nbest, self.first is None)

    def cost(self, line: int) -> int:
        """Source tokens x the beam the line is searched with: a line with a glossary's terms counts the
        constrained search's wider beam, as translate_ids batches it."""
        forced = self.constraints is not None and bool(self.constraints[line])
        return len(self.ids[line]) * (self.wide_beam if forced else self.decoding.beam_size)


Slice = tuple[Work, int, int]  # lines start:stop of a Work


class Batcher:
    def __init__(self, loaded: Loaded, metrics: ModelMetrics, max_batch_tokens: int, max_wait_s: float,
                 max_queue: int, in_flight: Callable[[], int] | None = None):
        self.loaded = loaded  # its search, called on the backend threads
        self.metrics = metrics
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        # the requests the server is handling, whichever model and stage (None: unknown, always wait max_wait_s)
        self.in_flight = in_flight
        self._pending: deque[Work] = deque()
        self.draining = False  # drain(): oldest first
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        # As many threads as the backend decodes batches at once (1 but for onnxruntime on a CPU: the others are
        # not re-entrant); the batches running on them:
        self.workers = max(1, int(loaded.backend.parallel_batches))
        self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="backend")
        self._running: set[asyncio.Task[None]] = set()
        self._open: set[Work] = set()  # submitted and not yet answered (queued, or with lines in a running batch)
        self._closed: str | None = None  # why new work is refused (abandon)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def depth(self) -> int:
        return len(self._pending)

    async def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="batcher")

    async def stop(self) -> None:
        for task in [self._task, *self._running]:
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        for work in self._pending:
            work._fail(BatcherStopped("the server is shutting down"))
        self._pending.clear()
        self._executor.shutdown(wait=True)

    def submit(self, ids: list[list[int]], decoding: DecodingOptions, first: int | None = None,
               constraints: list[list[list[int]]] | None = None) -> Work:
        """Queue one request's source ids (with a multilingual model's target token, and per line a glossary's
        constraints); await `work.future` for its hypotheses."""
        if self._closed is not None:
            raise BatcherStopped(self._closed)
        if len(self._pending) >= self.max_queue:
            raise QueueFull(f"{len(self._pending)} requests are queued already (--max-queue {self.max_queue})")
        wide = constrained_beam(decoding.beam_size, self.loaded.backend.topk) if constraints else 0
        work = Work(ids, decoding, asyncio.get_running_loop().create_future(), first, constraints, wide)
        self._pending.append(work)
        self._open.add(work)
        work.future.add_done_callback(lambda _: self._open.discard(work))
        self.metrics.queue_depth.set(len(self._pending))
        assert self._wakeup is not None, "Batcher.start() was not awaited"
        self._wakeup.set()
        return work

    def abandon(self, reason: str) -> int:
        """Fail every request not yet answered, and refuse new ones, with BatcherStopped(reason) (503 with
        Retry-After: the server stops before they are translated); a batch running finishes unread. Returns how
        many were failed."""
        self._closed = reason
        failed = list(self._open)
        for work in failed:
            work._fail(BatcherStopped(reason))
        self._pending.clear()
        self.metrics.queue_depth.set(0)
        return len(failed)

    def nudge(self) -> None:
        """A request left the server (app.py counted): a batch waiting for company may now be alone."""
        if self._wakeup is not None:
            self._wakeup.set()

    def drop(self, work: Work) -> None:
        """Forget a request whose client left: out of the queue if it is still there;
        if its batch is running, the batch finishes for the others and this share is discarded."""
        try:
            self._pending.remove(work)
        except ValueError:
            pass
        self.metrics.queue_depth.set(len(self._pending))
        work.future.cancel()
        work.progress.set()

    async def _run(self) -> None:
        assert self._wakeup is not None
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if len(self._running) >= self.workers:  # every thread busy: the next batch is collected when one ends
                await asyncio.wait(self._running, return_when=asyncio.FIRST_COMPLETED)
                continue
            batch = await self._collect()
            if batch:
                task = asyncio.create_task(self._execute(batch), name="batch")
                self._running.add(task)
                task.add_done_callback(self._running.discard)

    def _select(self) -> tuple[list[Slice], bool]:
        """Lines of the first request and of the next ones of the same kind that fit the budget (in
        queue order; at least one line), and whether the batch is full."""
        key = self._pending[0].key
        batch: list[Slice] = []
        cost = 0
        for work in self._pending:
            if work.key != key:
                continue
            stop = work.taken
            while stop < len(work.ids) and (cost + work.cost(stop) <= self.max_batch_tokens or not batch
                                            and stop == work.taken):
                cost += work.cost(stop)
                stop += 1
            if stop > work.taken:
                batch.append((work, work.taken, stop))
            if stop < len(work.ids):
                return batch, True
        return batch, cost >= self.max_batch_tokens

    def drain(self) -> None:
        """The server stops: the requests still queued are finished oldest first, without taking turns, so the
        grace period answers as many as it can (sharing batches between them all, each was left partly
        translated when it ran out, and 60 of 60 were 503s). Only a flag: a signal handler calls it, mid-loop."""
        self.draining = True

    def _take_turns(self) -> None:
        """Requests that have had a budget's worth of lines since their turn began go to the back of the
        queue (in queue order), each with a new turn. A request cut short by the budget before that keeps
        its place: small requests are batched in arrival order as before. Not while draining."""
        if self.draining:  # oldest first (the turns taken so far had reordered the queue)
            self._pending = deque(sorted(self._pending, key=lambda work: work.enqueued))
            return
        done = [work for work in self._pending if work.turn >= self.max_batch_tokens]
        for work in done:
            self._pending.remove(work)
            work.turn = 0
        self._pending.extend(done)

    async def _collect(self) -> list[Slice]:
        assert self._wakeup is not None
        self._take_turns()
        while self._pending:
            batch, full = self._select()
            remaining = self._pending[0].enqueued + self.max_wait_s - time.monotonic()
            if full or remaining <= 0 or self._alone():
                for work, start, stop in batch:
                    work.taken = stop
                    work.turn += sum(work.cost(line) for line in range(start, stop))
                    if stop == len(work.ids):
                        self._pending.remove(work)
                self.metrics.queue_depth.set(len(self._pending))
                return batch
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        return []  # every waiting client left

    def _alone(self) -> bool:
        """Whether every request the server is handling is queued here: none is on its way, so waiting for
        company would only delay the batch (a lone client's every request). A request whose batch decodes is in
        flight too, so while one decodes the wait stays and requests arriving meanwhile fill the next batch
        (measured: starting whenever a thread was free made smaller batches and fewer texts/s at 32 clients)."""
        return self.in_flight is not None and self.in_flight() <= len(self._pending)

    async def _execute(self, batch: list[Slice]) -> None:
        ids = [s for work, start, stop in batch for s in work.ids[start:stop]]
        started = time.monotonic()
        for work, start, _ in batch:
            if start == 0:
                self.metrics.queue_seconds.observe(started - work.enqueued)
        loop = asyncio.get_running_loop()
        try:
            args: tuple = (ids, batch[0][0].decoding)
            if batch[0][0].first is not None:  # the key keeps works with and without one apart
                args += ([work.first for work, start, stop in batch for _ in range(start, stop)],)
            constraints = _constraints(batch)
            # one batch at a time per call, each call on its share of the threads (runtime/translate.py)
            more: dict[str, Any] = {"workers": 1} if constraints is None else {"workers": 1, "constraints": constraints}
            call = functools.partial(self.loaded.translate, *args, **more)
            results = await loop.run_in_executor(self._executor, call)
        except Exception as e:  # a backend fault fails this batch's requests, not the server
            log.exception("batch of %d request(s) failed", len(batch))
            for work, _, _ in batch:
                if work in self._pending:
                    self._pending.remove(work)
                work._fail(e)
            self.metrics.queue_depth.set(len(self._pending))
            return
        self.metrics.batch_seconds.observe(time.monotonic() - started)
        self.metrics.batch_requests.observe(len(batch))
        self.metrics.batch_sentences.observe(len(ids))
        done = 0
        for work, start, stop in batch:
            share = results[done:done + stop - start]
            done += stop - start
            if not work.future.done():
                work._add(start, share)


def _constraints(batch: list[Slice]) -> list[list[list[int]]] | None:
    """The batch's lines' glossary constraints, aligned with its ids ([] for a line without a term), or None
    when no line has one: the search then runs exactly as for a request without a glossary (the search
    decodes lines with constraints apart from the others, so works with and without them share a batch)."""
    if all(work.constraints is None for work, _, _ in batch):
        return None
    return [work.constraints[line] if work.constraints is not None else []
            for work, start, stop in batch for line in range(start, stop)]

"""Dynamic batching: requests queue on the event loop, one backend thread translates.

The collector coroutine takes the oldest request, adds the following ones that share
its decoding options while their source tokens x beam fit `max_batch_tokens`, and
waits at most `max_wait_s` (counted from the oldest request's arrival) for more. The
batch then runs on a dedicated single thread, so the event loop keeps accepting,
answering /health and reading bodies while the backend works; requests that arrive
meanwhile form the next batch. Results go back to each request's future."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pipeline.serve.metrics import Metrics
from pipeline.serve.translator import Translator
from runtime.decoding import DecodingOptions
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
    enqueued: float = field(default_factory=time.monotonic)

    @property
    def key(self) -> tuple[int, int]:
        # Requests batch together only when the search would treat them alike.
        return (self.decoding.beam_size, self.decoding.nbest)

    @property
    def cost(self) -> int:
        return sum(len(s) for s in self.ids) * self.decoding.beam_size


class Batcher:
    def __init__(self, translator: Translator, metrics: Metrics, max_batch_tokens: int, max_wait_s: float,
                 max_queue: int):
        self.translator = translator
        self.metrics = metrics
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self._pending: deque[Work] = deque()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        # One thread: backends are not re-entrant, and one batch at a time is the point.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="backend")

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
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for work in self._pending:
            if not work.future.done():
                work.future.set_exception(BatcherStopped("the server is shutting down"))
        self._pending.clear()
        self._executor.shutdown(wait=True)

    def submit(self, ids: list[list[int]], decoding: DecodingOptions) -> Work:
        """Queue one request's source ids; await `work.future` for its hypotheses."""
        if len(self._pending) >= self.max_queue:
            raise QueueFull(f"{len(self._pending)} requests are queued already (--max-queue {self.max_queue})")
        work = Work(ids, decoding, asyncio.get_running_loop().create_future())
        self._pending.append(work)
        self.metrics.queue_depth.set(len(self._pending))
        assert self._wakeup is not None, "Batcher.start() was not awaited"
        self._wakeup.set()
        return work

    def drop(self, work: Work) -> None:
        """Forget a request whose client left: out of the queue if it is still there;
        if its batch is running, the batch finishes for the others and this share is discarded."""
        try:
            self._pending.remove(work)
        except ValueError:
            pass
        self.metrics.queue_depth.set(len(self._pending))
        work.future.cancel()

    async def _run(self) -> None:
        assert self._wakeup is not None
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = await self._collect()
            if batch:
                await self._execute(batch)

    def _select(self) -> tuple[list[Work], bool]:
        """The oldest request and the next ones of the same kind that fit the budget
        (in arrival order), and whether the batch is full."""
        first = self._pending[0]
        batch, cost = [first], first.cost
        for work in list(self._pending)[1:]:
            if work.key != first.key:
                continue
            if cost + work.cost > self.max_batch_tokens:
                return batch, True
            batch.append(work)
            cost += work.cost
        return batch, cost >= self.max_batch_tokens

    async def _collect(self) -> list[Work]:
        assert self._wakeup is not None
        while self._pending:
            batch, full = self._select()
            remaining = batch[0].enqueued + self.max_wait_s - time.monotonic()
            if full or remaining <= 0:
                for work in batch:
                    self._pending.remove(work)
                self.metrics.queue_depth.set(len(self._pending))
                return batch
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        return []  # every waiting client left

    async def _execute(self, batch: list[Work]) -> None:
        ids = [s for work in batch for s in work.ids]
        started = time.monotonic()
        for work in batch:
            self.metrics.queue_seconds.observe(started - work.enqueued)
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._executor, self.translator.translate, ids, batch[0].decoding)
        except Exception as e:  # a backend fault fails this batch's requests, not the server
            log.exception("batch of %d request(s) failed", len(batch))
            for work in batch:
                if not work.future.done():
                    work.future.set_exception(e)
            return
        self.metrics.batch_seconds.observe(time.monotonic() - started)
        self.metrics.batch_requests.observe(len(batch))
        self.metrics.batch_sentences.observe(len(ids))
        start = 0
        for work in batch:
            share = results[start:start + len(work.ids)]
            start += len(work.ids)
            if not work.future.done():
                work.future.set_result(share)

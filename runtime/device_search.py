"""Beam search on the device, several decoder steps per CUDA graph replay (`--steps-per-replay K`).

The fixed-shape step (runtime/static_step.py) returns to Python after every step: search's top-k
bookkeeping and the finished check run on the host, which on a GPU takes longer than the step itself
(docs/gpu.md). Here the whole of fairseq's beam search step, as runtime/search.py does it, runs on the
device next to the decoder step, K times in one body that is captured once as a CUDA graph (or compiled
with torch.compile and then captured); the host replays it and looks at the finished flags once per
replay. Per step, on the device:

- the decoder step over the static cache (runtime/static_step.py's buffers and ancestry layout), which
  writes its own keys and values at `t * beam + row`;
- each row's top 2 x beam candidates, EOS masked before min_len and forced at a sentence's length limit
  (search's `_step_candidates`); the sentence's best 2 x beam by cumulative log-prob (a stable sort, as
  search's stable argsort, so ties keep the same order);
- the EOS candidates among the first `beam` finalised in order into `beam` slots per sentence (fairseq keeps
  the first `beam`), with the same fp32 arithmetic for scores and length penalties (a table made on the host
  with search's own function);
- a sentence is done when it holds `beam` hypotheses or reaches its length limit; a done sentence's later
  steps still run but write nothing that counts (masked no-ops), so the result is search's;
- the best `beam` non-EOS candidates continue: tokens, scores, the token and log-prob histories and the
  ancestry (`pos`) are gathered by parent row.

So in fp32 the hypotheses are search's over the same step (tests/test_device_search.py checks tokens and
scores on the CPU, where the body runs uncaptured). A batch ends at the first replay after its last sentence is
done (at most K - 1 steps run for nothing). Finished sentences keep their slots until then, as in the one-step
graph: moving them to a smaller bucket would cost a new K-step graph capture per bucket, which on a real file
cost more than the work it saved (docs/gpu.md, "Search on the device", links the GPU check that measured it).
Supported: beam search (beam >= 2) under fairseq's rules without forced first tokens or glossaries; other
searches run step by step (`supports`).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import numpy as np
import torch

from model import io_names
from model.cache import INITIAL_CAPACITY
from runtime.decoding import DecodingOptions
from runtime.device_step import compile_step, one_step
from runtime.search import Hypothesis, length_penalty, max_output_lengths
from runtime.static_step import (
    StaticBatch,
    StaticStepRunner,
    _Capacity,
    size_bucket,
    source_bucket,
)

log = logging.getLogger(__name__)

NEG_INF = float("-inf")


@functools.lru_cache(maxsize=8)
def _penalties(n: int, alpha: float, rules: str) -> np.ndarray:
    """search.py's length penalty for lengths 1..n as it divides by it (fp32), indexed by step; read only."""
    return np.array([np.float32(length_penalty(float(x), alpha, rules)) for x in range(1, n + 1)], np.float32)


def capacity_for(steps: int) -> int:
    """Cache positions for `steps` steps: INITIAL_CAPACITY doubled until it holds them."""
    cap = INITIAL_CAPACITY
    while cap < steps:
        cap *= 2
    return cap


# state tensors whose last dimension is the cache capacity (dynamic under torch.compile, padded when it grows)
_PER_POSITION = ("pos", "hist", "hist_lp", "fin_tok", "fin_lp")
# the search's state (the rest of _Store.st is the batch's storage: cache, cross K/V, constants)
_STATE = ("t", "tokens", "scores", "count", "done", "max_len", "row_max", "min_len", "penalty",
          "fin_score", "fin_logp", "fin_len") + _PER_POSITION


class _Store:
    """The search's tensors for one StaticBatch at one cache capacity, and the graph that replays them."""

    def __init__(self, batch: StaticBatch, storage: _Capacity, max_positions: int):
        s, beam, n, cap, dev = batch.n_sentences, batch.rows, batch.n_hyps, storage.capacity, batch.device
        i64 = dict(dtype=torch.int64, device=dev)
        f32 = dict(dtype=torch.float32, device=dev)
        self.batch, self.storage, self.capacity, self.beam = batch, storage, cap, beam
        self.st: dict[str, Any] = {
            "k": storage.k, "v": storage.v, "cross_k": batch.cross_k, "cross_v": batch.cross_v,
            "src_bias": batch.src_bias, "head_start": storage.head_start,
            "row_in_sentence": torch.arange(beam, **i64), "sentence": torch.arange(s, **i64),
            "cand": torch.arange(2 * beam, **i64),
            "t": torch.zeros(1, **i64), "tokens": torch.zeros(n, **i64), "scores": torch.zeros(s, beam, **f32),
            "count": torch.zeros(s, **i64), "done": torch.ones(s, dtype=torch.bool, device=dev),
            "max_len": torch.zeros(s, **i64), "row_max": torch.zeros(n, **i64), "min_len": torch.zeros(1, **i64),
            "penalty": torch.ones(max_positions + 1, **f32),
            "fin_score": torch.zeros(s, beam + 1, **f32), "fin_logp": torch.zeros(s, beam + 1, **f32),
            "fin_len": torch.zeros(s, beam + 1, **i64),
            "pos": torch.full((n, cap), -1, **i64), "hist": torch.zeros(s, beam, cap, **i64),
            "hist_lp": torch.zeros(s, beam, cap, **f32), "fin_tok": torch.zeros(s, beam + 1, cap, **i64),
            "fin_lp": torch.zeros(s, beam + 1, cap, **f32),
        }
        self.graph: Any = None

    def start(self, state: dict[str, np.ndarray]) -> None:
        """A new batch: every state tensor from its host value (one copy each)."""
        for name, value in state.items():
            self.st[name].copy_(torch.from_numpy(value))

    def take_over(self, old: _Store) -> None:
        """Continue `old`'s search at a larger capacity: the cache's written steps and the state move once."""
        used = old.capacity * self.beam
        for new_buf, old_buf in zip(self.storage.k + self.storage.v, old.storage.k + old.storage.v):
            new_buf[:, :, :used].copy_(old_buf)
        for name in _STATE:
            if name in _PER_POSITION:
                dst = self.st[name]
                dst.fill_(-1 if name == "pos" else 0)
                dst[..., :old.capacity].copy_(old.st[name])
            else:
                self.st[name].copy_(old.st[name])


class DeviceSearch:
    """Beam search of whole batches on the device for a StaticStepRunner's model, `steps` steps per replay."""

    def __init__(self, runner: StaticStepRunner, steps: int, compiled: bool = False):
        if steps < 1:
            raise ValueError(f"steps per replay must be at least 1, got {steps}")
        self.runner, self.steps = runner, steps
        self.one_step = compile_step() if compiled else one_step
        self.stores: dict[tuple[int, int], _Store] = {}  # (id of the StaticBatch, capacity) -> store
        self.replays = 0  # replays run so far (tests and bench read it)
        self.gpu_times: list[float] | None = None  # a list: each replay's GPU seconds are appended (bench)
        self.compiled: dict[tuple[int, int, int], float] = {}  # (sentences, beam, source) -> compilation seconds

    @property
    def compile_seconds(self) -> float:
        return sum(self.compiled.values())

    @staticmethod
    def supports(options: DecodingOptions, first_tokens: Any = None) -> bool:
        """Whether this search gives search.py's result for `options` (else search runs step by step)."""
        return options.beam_size >= 2 and options.rules == "fairseq" and first_tokens is None

    def search(self, backend: Any, src_ids: np.ndarray, options: DecodingOptions) -> list[list[Hypothesis]]:
        n = int(src_ids.shape[0])
        if n == 0:
            return []
        runner, beam = self.runner, options.beam_size
        enc = backend.encode(src_ids)
        src_len = source_bucket(int(enc.tensors[io_names.SRC_BIAS].shape[1]))
        with runner.lock:
            batch = runner.take((size_bucket(n), beam, src_len))
        try:
            batch.load(enc)
            max_len = max_output_lengths(src_ids, backend, options.max_len_a, options.max_len_b)
            store = self._store(batch, capacity_for(self.steps))
            store.start(self._initial(batch, store, max_len, options))
            t, last = 0, int(max_len.max())
            while True:
                grown = self._store(batch, capacity_for(t + self.steps))
                if grown is not store:
                    grown.take_over(store)
                    store = grown
                self._replay(store)
                t += self.steps
                if store.st["done"].all().item():  # the one wait per replay
                    break
                if t > last + 1:
                    raise RuntimeError(f"device search: sentences not done after {t} steps (limit {last})")
            return self._collect(store, n, options.nbest)
        finally:
            runner.release(batch)

    # -- storage and replays ----------------------------------------------------------------

    def _store(self, batch: StaticBatch, capacity: int) -> _Store:
        with self.runner.lock:  # searches on other threads (the HTTP server) keep stores too
            return self._store_locked(batch, capacity)

    def _store_locked(self, batch: StaticBatch, capacity: int) -> _Store:
        key = (id(batch), capacity)
        store = self.stores.get(key)
        if store is None or store.storage is not batch.capacities.get(capacity):
            kept = {id(b) for b in self.runner.batches.values()} | {id(batch)}
            for old in [k for k in self.stores if k[0] not in kept]:
                del self.stores[old]  # storage of batch shapes the runner no longer keeps
            store = self.stores[key] = _Store(batch, batch.capacity(capacity), self.runner.cfg.max_positions)
        return store

    def _initial(self, batch: StaticBatch, store: _Store, max_len: np.ndarray,
                 options: DecodingOptions) -> dict[str, np.ndarray]:
        s, beam, n = batch.n_sentences, batch.rows, max_len.shape[0]
        cfg = self.runner.cfg
        scores = np.full((s, beam), NEG_INF, dtype=np.float32)
        scores[:, 0] = 0.0
        sentence_max = np.full(s, -1, dtype=np.int64)  # padding slots: done from the start
        sentence_max[:n] = max_len
        done = np.ones(s, dtype=bool)
        done[:n] = False
        penalty = _penalties(store.st["penalty"].shape[0], options.alpha, options.rules)
        cap = store.capacity
        return {"t": np.zeros(1, np.int64), "tokens": np.full(s * beam, cfg.bos_id, np.int64), "scores": scores,
                "count": np.zeros(s, np.int64), "done": done, "max_len": sentence_max,
                "row_max": np.repeat(sentence_max, beam), "min_len": np.array([options.min_len], np.int64),
                "penalty": penalty, "fin_len": np.zeros((s, beam + 1), np.int64),
                "pos": np.full((s * beam, cap), -1, np.int64), "hist": np.zeros((s, beam, cap), np.int64),
                "hist_lp": np.zeros((s, beam, cap), np.float32)}

    def _replay(self, store: _Store) -> None:
        runner = self.runner
        if runner.capture and store.graph is None:
            try:
                self._capture(store)
            except RuntimeError as e:  # the search stays correct, only slower
                log.warning("the device search could not be captured as a CUDA graph (%s); it runs eagerly on "
                            "fixed shapes from now on", e)
                runner.capture = False
        if store.graph is not None:
            if self.gpu_times is not None:
                events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                events[0].record()
                store.graph.replay()
                events[1].record()
                events[1].synchronize()
                self.gpu_times.append(events[0].elapsed_time(events[1]) / 1000)
            else:
                store.graph.replay()
        else:
            self._run(store)
        self.replays += 1

    def _run(self, store: _Store) -> None:
        batch = store.batch
        key = (batch.n_sentences, batch.rows, batch.src_len)
        first = self.one_step is not one_step and key not in self.compiled
        start = time.perf_counter()
        if first:  # one compilation serves every capacity
            for name in _PER_POSITION:
                torch._dynamo.mark_dynamic(store.st[name], store.st[name].dim() - 1)
            for buf in store.st["k"] + store.st["v"]:
                torch._dynamo.mark_dynamic(buf, 2)
        for _ in range(self.steps):  # unrolled: a capture records the K steps as one graph
            self.one_step(self.runner.model, store.st, store.beam, self.runner.cfg.eos_id)
        if first:  # the compilation (and on CUDA the first run's wait): what a new bucket costs once
            if self.runner.device.type == "cuda":
                torch.cuda.synchronize(self.runner.device)
            self.compiled[key] = time.perf_counter() - start
            log.info("compiled the search step for %d sentences x %d rows, source %d in %.1f s", *key,
                     self.compiled[key])

    def _capture(self, store: _Store) -> None:
        """Capture one replay. The warm-up runs it for real on a side stream (as capture requires), so the
        state is saved before and put back after it: the first replay then runs the same steps."""
        device = self.runner.device
        saved = {name: store.st[name].clone() for name in _STATE}
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._run(store)
        torch.cuda.current_stream(device).wait_stream(side)
        for name, value in saved.items():
            store.st[name].copy_(value)
        graph = torch.cuda.CUDAGraph(keep_graph=True) if self.runner.keep_graphs else torch.cuda.CUDAGraph()
        batch = store.batch
        if batch.pool is None:
            batch.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=batch.pool, capture_error_mode="thread_local"):
            self._run(store)
        store.graph = graph
        self.runner.captures += 1

    @staticmethod
    def _collect(store: _Store, n: int, nbest: int) -> list[list[Hypothesis]]:
        """The finished hypotheses of the first `n` slots (the batch's sentences, in order), best first (search's
        ranked)."""
        st = {name: store.st[name][:n].cpu().numpy()
              for name in ("count", "fin_tok", "fin_lp", "fin_score", "fin_logp", "fin_len")}
        results = []
        for i in range(n):
            hyps = []
            for j in range(int(st["count"][i])):
                length = int(st["fin_len"][i, j])
                hyps.append(Hypothesis(tokens=st["fin_tok"][i, j, :length - 1].tolist(),
                                       score=float(st["fin_score"][i, j]), log_prob=float(st["fin_logp"][i, j]),
                                       step_log_probs=st["fin_lp"][i, j, :length].tolist()))
            results.append(sorted(hyps, key=lambda h: -h.score)[:nbest])
        return results

"""The torch backend's decoder step at fixed shapes, replayed as a CUDA graph on the GPU.

Eager PyTorch launches each of a step's few hundred kernels from Python, so on a GPU a base model's
step costs about 5 ms whatever the batch, the card idle most of that time (docs/gpu.md). A CUDA graph
launches them all at once, but every tensor it reads or writes must keep its address and shape. So, for
one batch being decoded:

- its sentences are padded up to a size bucket (`size_bucket`) and its source up to a multiple of
  SOURCE_ALIGN; the cross-attention K/V and the source bias are copied once into static tensors of
  that shape, the padding masked;
- the self-attention cache keeps model/cache.py's layout, in static buffers per capacity (16, 32, 64...
  steps) that the step itself writes in place at `write_pos`; growing copies the written part once;
- each hypothesis reads its ancestors' keys through the eager step's index, padded to the capacity with
  masked positions (-1 in `pos`), so the step's shapes depend on the bucket alone;
- finished sentences keep their slots (their rows decode padding and are ignored): nothing is compacted
  and the cross K/V are never selected again;
- the small inputs (tokens, position, write rows, ancestry) travel to the device in one copy, and the
  candidates come back in three.

One graph per (sentences, beam, source, capacity) bucket, captured at its first step and replayed
after; the buffers and graphs of the last MAX_BATCHES batch shapes are kept. A batch's graphs share one
memory pool: one search at a time uses them, and reads each step's outputs before the next replay.
Without capture (mode "static") the same body runs eagerly: that is how the CPU tests check the
graph's arithmetic. Translations match the eager step's in fp32; log-probs may differ in rounding
(sums over masked padding), which in fp16 can flip a near-tie (docs/gpu.md).

Mode "compiled" hands the body to torch.compile (inductor) first, once per bucket (`compile_body`; the
cache's capacity is a symbolic size, so growing it recompiles nothing): LayerNorms, residuals, bias
epilogues, masks and gathers become a few fused kernels, each attention one scaled_dot_product_attention
kernel, the GEMMs stay cuBLAS's. On CUDA the compiled body is then captured like the plain one (a base
step: 110 kernels instead of 296); on the CPU it runs inductor's C++ kernels uncaptured.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from model.cache import BeamCache
from model.config import MASK_VALUE, ModelConfig
from model.transformer import Transformer, select_candidates
from runtime.backend import EncoderState, StepOutput, host

log = logging.getLogger(__name__)

SOURCE_ALIGN = 8  # source positions are padded up to a multiple of this
MAX_BATCHES = 4  # batch shapes whose buffers and graphs are kept


_NO_INDEX = (np.zeros((0, 0, 0), dtype=np.int64), np.zeros((0, 0), dtype=np.float32))


def size_bucket(n: int) -> int:
    """The padded sentence count: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48... (at most 1.5x n)."""
    if n < 1:
        raise ValueError(f"a batch needs at least one sentence, got {n}")
    p = 1 << (n - 1).bit_length()  # the power of two >= n
    return p * 3 // 4 if p >= 4 and n <= p * 3 // 4 else p


def source_bucket(s: int) -> int:
    return -(-s // SOURCE_ALIGN) * SOURCE_ALIGN


class StaticCache(BeamCache):
    """BeamCache's ancestry over a StaticBatch's buffers: sentences that finish keep their slots
    (`live` maps each live sentence to its slot), and the step writes its keys itself."""

    def __init__(self, cfg: ModelConfig, n_hyps: int, max_steps: int):
        super().__init__(cfg, n_hyps, max_steps=max_steps)  # its own numpy buffers stay empty
        self.live = np.zeros(0, dtype=np.int64)
        self.batch: StaticBatch | None = None
        self.storage: _Capacity | None = None  # the batch's buffers for self.capacity

    def _allocate(self, n_sentences: int, capacity: int) -> None:
        self.capacity, self.n_sentences = capacity, n_sentences
        self.live = np.arange(n_sentences, dtype=np.int64)

    def _drop(self, kept: np.ndarray) -> None:
        self.live = self.live[kept]
        self.n_sentences = int(kept.shape[0])

    def _grow(self, capacity: int) -> None:
        self.capacity = capacity  # the runner moves the buffers (StaticStepRunner.step)

    def index(self) -> tuple[np.ndarray, np.ndarray]:
        """Not built: the step reads positions() into its padded index on the device instead."""
        return _NO_INDEX

    def static_rows(self) -> np.ndarray:
        """(hyps,) the static row of each live hypothesis."""
        return (self.live[:, None] * self.rows + np.arange(self.rows, dtype=np.int64)).reshape(-1)


class _Capacity:
    """A batch's buffers for one cache capacity, with the inputs its graph reads."""

    def __init__(self, batch: StaticBatch, capacity: int):
        cfg, n, rows = batch.cfg, batch.n_hyps, batch.rows
        h, dh, dev = cfg.n_heads, cfg.d_head, batch.device
        self.capacity = capacity
        shape = (batch.n_sentences, h, capacity * rows, dh)
        self.k = [torch.zeros(shape, dtype=batch.dtype, device=dev) for _ in range(cfg.n_dec_layers)]
        self.v = [torch.zeros(shape, dtype=batch.dtype, device=dev) for _ in range(cfg.n_dec_layers)]
        sentence = torch.arange(n, device=dev) // rows
        self.head_start = ((sentence[:, None] * h + torch.arange(h, device=dev)) * (capacity * rows))[:, :, None]
        # one host-to-device copy per step: tokens (n), position (1), write rows (rows), ancestry (n x capacity)
        self.feed = torch.zeros(n + 1 + rows + n * capacity, dtype=torch.int64, device=dev)
        self.tokens, self.step = self.feed[:n], self.feed[n:n + 1]
        self.write_pos = self.feed[n + 1:n + 1 + rows]
        self.pos = self.feed[n + 1 + rows:].view(n, capacity)
        self.host_feed = np.zeros(self.feed.shape[0], dtype=np.int64)
        self.graph: Any = None
        self.out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class StaticBatch:
    """Static storage for batches of one shape: `n_sentences` slots (padded), `rows` hypotheses each,
    sources of `src_len` positions (padded); one _Capacity per cache capacity."""

    def __init__(self, cfg: ModelConfig, n_sentences: int, rows: int, src_len: int, dtype: torch.dtype,
                 device: torch.device):
        self.cfg, self.n_sentences, self.rows, self.src_len = cfg, n_sentences, rows, src_len
        self.n_hyps = n_sentences * rows
        self.dtype, self.device = dtype, device
        shape = (n_sentences, cfg.n_heads, src_len, cfg.d_head)
        self.cross_k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_dec_layers)]
        self.cross_v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_dec_layers)]
        self.src_bias = torch.full((n_sentences, src_len), MASK_VALUE, dtype=torch.float32, device=device)
        self.capacities: dict[int, _Capacity] = {}
        self.busy = False
        self.pool: Any = None  # the graphs' memory pool, made at the first capture

    def load(self, state: EncoderState) -> None:
        """Copy a batch's encoder state into slots 0..n-1; other slots and positions masked."""
        from model import io_names

        t = state.tensors
        bias = t[io_names.SRC_BIAS]
        n, s = bias.shape
        self.src_bias.fill_(MASK_VALUE)
        self.src_bias[:n, :s].copy_(bias)
        for i in range(self.cfg.n_dec_layers):
            self.cross_k[i][:n, :, :s].copy_(t[io_names.cross_k(i)])
            self.cross_v[i][:n, :, :s].copy_(t[io_names.cross_v(i)])

    def capacity(self, capacity: int) -> _Capacity:
        if capacity not in self.capacities:
            self.capacities[capacity] = _Capacity(self, capacity)
        return self.capacities[capacity]


def _step_body(model: Transformer, topk: int, n_sentences: int, tokens: torch.Tensor, step: torch.Tensor,
               pos: torch.Tensor, head_start: torch.Tensor, write_pos: torch.Tensor, k: list[torch.Tensor],
               v: list[torch.Tensor], cross_k: list[torch.Tensor], cross_v: list[torch.Tensor],
               src_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step on static tensors only: what a graph captures, and what torch.compile compiles (a plain
    function of tensors, so that its guards are shapes, not the runner's objects)."""
    cfg = model.cfg
    index = head_start + pos.clamp(min=0)[:, None, :]
    bias = (pos < 0).float() * MASK_VALUE
    log_probs, step_k, step_v = model.decode_step(tokens, step, index, bias, k, v, cross_k, cross_v, src_bias)
    for buf, new in zip(k + v, step_k + step_v):
        buf.index_copy_(2, write_pos, new.view(n_sentences, -1, cfg.n_heads, cfg.d_head).transpose(1, 2))
    return select_candidates(log_probs, topk, cfg.eos_id)


def compile_body(options: dict[str, Any] | None = None) -> Any:
    """_step_body through torch.compile: fixed shapes but for the cache's capacity (one compilation per
    bucket; a runner keeps at most MAX_BATCHES of them), the whole body one graph or an error.
    `options`: inductor settings for this compilation (torch.compile's options)."""
    raise_recompile_limits()
    return torch.compile(_step_body, dynamic=False, fullgraph=True, options=options)


def raise_recompile_limits() -> None:
    """Every (sentences, beam, source, capacity) bucket is a recompilation, not a fallback to eager."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 256))


def mark_compiled(model: Transformer, sdpa: bool = True) -> None:
    """What the compiled step may assume of `model` while traced: its fused q/k/v views (checked here,
    eagerly: data pointers cannot be traced) and, with `sdpa`, each attention as
    scaled_dot_product_attention (one fused kernel; its softmax in fp32 inside the kernel)."""
    for layer in model.decoder:
        layer.self_attn.compile_fused = layer.self_attn._qkv_fused()
        layer.self_attn.sdpa_step = layer.cross_attn.sdpa_step = sdpa


class StaticStepRunner:
    """Runs TorchBackend's steps on StaticBatch storage: as CUDA graphs (`capture`), or eagerly;
    `compiled`: the body through torch.compile (inductor) first."""

    def __init__(self, model: Transformer, topk: int, dtype: torch.dtype, device: torch.device, capture: bool,
                 compiled: bool = False, sdpa: bool = True, options: dict[str, Any] | None = None):
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.model, self.cfg, self.topk = model, model.cfg, topk
        self.dtype, self.device, self.capture = dtype, device, capture
        self.batches: OrderedDict[tuple[int, int, int], StaticBatch] = OrderedDict()
        self.lock = threading.Lock()  # searches on other threads take storage too
        self.captures = 0  # graphs captured so far (bench and tests read it)
        self.gpu_times: list[float] | None = None  # a list: each replay's GPU seconds are appended (the GPU check)
        self.body = compile_body(options) if compiled else _step_body
        if compiled:
            mark_compiled(model, sdpa)
        # per bucket and capacity compiled: (sentences, rows, source, capacity) -> seconds of its first call
        self.compile_seconds: dict[tuple[int, int, int, int], float] = {}
        self.dynamic_capacity = True  # the capacity dimension symbolic: no recompilation as the cache grows
        self.keep_graphs = False  # keep each captured cudaGraph_t (CUDAGraph.raw_cuda_graph: counting its kernels)

    def cache(self, n_hyps: int, max_steps: int) -> StaticCache:
        return StaticCache(self.cfg, n_hyps, max_steps)

    # -- binding a batch ----------------------------------------------------------------

    def _bind(self, cache: StaticCache, state: EncoderState) -> StaticBatch:
        from model import io_names

        src_len = int(state.tensors[io_names.SRC_BIAS].shape[1])
        key = (size_bucket(state.n_rows), cache.rows, source_bucket(src_len))
        with self.lock:
            batch = self.take(key)
        weakref.finalize(cache, StaticStepRunner.release, batch)
        batch.load(state)
        return batch

    def take(self, key: tuple[int, int, int]) -> StaticBatch:
        """Storage for a batch of shape `key` (sentences, rows, source), busy until release(); call under `lock`."""
        batch = self.batches.get(key)
        if batch is None or batch.busy:  # a busy one serves another search (threads) at this moment
            batch = StaticBatch(self.cfg, key[0], key[1], key[2], self.dtype, self.device)
            if key not in self.batches:
                self.batches[key] = batch
                while len(self.batches) > MAX_BATCHES:
                    oldest = next((k for k, b in self.batches.items() if not b.busy), None)
                    if oldest is None:
                        break
                    del self.batches[oldest]
        if self.batches.get(key) is batch:
            self.batches.move_to_end(key)
        batch.busy = True
        return batch

    @staticmethod
    def release(batch: StaticBatch) -> None:
        batch.busy = False

    # -- one step -------------------------------------------------------------------------

    def step(self, state: EncoderState, tokens: Any, step: int, cache: StaticCache,
             reorder: Any) -> tuple[StepOutput, StaticCache]:
        cache.advance(reorder, state.n_rows)
        if cache.batch is None:
            cache.batch = self._bind(cache, state)
        batch = cache.batch
        storage = batch.capacity(cache.capacity)
        old = cache.storage
        if old is not None and old is not storage:  # grown: the written steps move once
            used = old.capacity * batch.rows
            for new_buf, old_buf in zip(storage.k + storage.v, old.k + old.v):
                new_buf[:, :, :used].copy_(old_buf)
        cache.storage = storage

        live = cache.static_rows()
        n, rows_per = batch.n_hyps, batch.rows
        feed = storage.host_feed
        feed[:n] = self.cfg.pad_id
        feed[live] = np.asarray(tokens, dtype=np.int64)
        feed[n] = step
        feed[n + 1:n + 1 + rows_per] = cache.steps * rows_per + np.arange(rows_per)
        pos = feed[n + 1 + rows_per:].reshape(n, storage.capacity)
        pos.fill(-1)
        t = cache.slots.shape[1]
        if t:
            pos[live, :t] = cache.positions()
        storage.feed.copy_(torch.from_numpy(feed))

        if self.capture and storage.graph is None:
            try:
                self._capture(batch, storage)
            except RuntimeError as e:  # the step stays correct, only slower
                log.warning("the decoder step could not be captured as a CUDA graph (%s); it runs eagerly on "
                            "fixed shapes from now on", e)
                self.capture = False
        events = None
        if storage.graph is not None:
            if self.gpu_times is not None:
                events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                events[0].record()
            storage.graph.replay()
            if events is not None:
                events[1].record()
            top_lp, top_ids, eos_lp = storage.out  # type: ignore[misc]
        else:
            top_lp, top_ids, eos_lp = self._body(batch, storage)
        cache.steps += 1
        out = StepOutput(host(top_lp)[live], host(top_ids)[live], host(eos_lp)[live])  # waits for the device
        if events is not None and self.gpu_times is not None:
            self.gpu_times.append(events[0].elapsed_time(events[1]) / 1000)
        return out, cache

    def _body(self, batch: StaticBatch, s: _Capacity) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (batch.n_sentences, batch.rows, batch.src_len, s.capacity)
        first = self.body is not _step_body and key not in self.compile_seconds
        start = time.perf_counter()
        if first and self.dynamic_capacity:  # one compilation serves every capacity of the bucket
            for t in [s.pos] + s.k + s.v:
                torch._dynamo.mark_dynamic(t, t.dim() - 1 if t is s.pos else 2)
        out = self.body(self.model, self.topk, batch.n_sentences, s.tokens, s.step, s.pos, s.head_start,
                        s.write_pos, s.k, s.v, batch.cross_k, batch.cross_v, batch.src_bias)
        if first:  # the compilation (and on CUDA the first run's wait): what a new bucket costs once
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.compile_seconds[key] = time.perf_counter() - start
            log.info("compiled the decoder step for %d sentences x %d rows, source %d, capacity %d in %.1f s",
                     *key, self.compile_seconds[key])
        return out

    def _capture(self, batch: StaticBatch, s: _Capacity) -> None:
        """Capture the step for this bucket. The warm-up runs the step for real on a side stream (as
        capture requires); it writes the same keys that the replay then writes again."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._body(batch, s)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph(keep_graph=True) if self.keep_graphs else torch.cuda.CUDAGraph()
        if batch.pool is None:
            batch.pool = torch.cuda.graph_pool_handle()
        # thread_local: another thread's synchronising calls (another model served on this GPU) stay legal
        with torch.cuda.graph(graph, pool=batch.pool, capture_error_mode="thread_local"):
            s.out = self._body(batch, s)
        s.graph = graph
        self.captures += 1
        log.debug("captured the decoder step for %d sentences x %d rows, source %d, capacity %d",
                  batch.n_sentences, batch.rows, batch.src_len, s.capacity)

"""The decoder's self-attention cache, laid out once for the model, the exported graphs,
the export verifier and every backend.

Beam search reorders hypotheses every step. The cache is never reordered for it: each
step's keys and values are written once, in place, into a buffer per layer that grows by
doubling, and each hypothesis gathers its own history from it inside the step by an index
that the cache keeps (which slot each hypothesis' ancestor wrote at every earlier step).
A step thus copies each layer's history once (the gather its attention reads) instead of
twice (gather by `reorder`, then concatenation of the grown cache), and decoding holds
the cache once instead of twice (input and grown output).

Layout. K (or V) of decoder layer i: (batch, n_heads, capacity * rows, d_head) with one
row per *sentence*; `rows` hypotheses per sentence (the beam). Step j's key of the
hypothesis in slot s (0 <= s < rows) of sentence b sits at [b, :, j * rows + s]. The step
graph reads the buffer flattened to (batch * n_heads * capacity * rows, d_head) through

    self_index (hyps, n_heads, past) int64: per hypothesis and head, the rows of its
               ancestors' keys, one per earlier step (past = steps so far)
    self_bias  (hyps, past) fp32: 0, or MASK_VALUE where a position is not a key

and scores its own key of this step apart, returning it (`step_k.i`, `step_v.i`,
(hyps, d_model)) for the caller to write at time `step`. Step 0 has no earlier key, but
TensorRT profiles and torch.export reject size-0 dims, so step 0 gathers one masked
position (past = 1, bias MASK_VALUE): the graph needs no control flow.

`BeamCache` keeps the buffers and the ancestry and turns search's `reorder` (the previous
step's row each hypothesis continues, within its own sentence) into the next index. When
sentences finish, their buffer rows are dropped: the rows past the survivors' count fill the holes in place
(`tail_filled`, search's order), so a finish moves as many rows as finished, not every row after it.
The ancestry and the index are small integer arrays, kept in numpy on the host; the buffers
are numpy arrays (the ONNX Runtime CPU backend, which must not need torch) or torch tensors
on any device (the PyTorch and TensorRT backends), chosen by the `dtype` given.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any

import numpy as np

from model import io_names
from model.config import MASK_VALUE, ModelConfig

INITIAL_CAPACITY = 16  # steps the buffers hold before their first doubling


class CacheError(ValueError):
    """A reorder that this cache cannot follow (a hypothesis continuing another sentence's)."""


def host_ints(x: Any) -> np.ndarray:
    """An int64 numpy array from a numpy array, a list or a torch tensor on any device."""
    if hasattr(x, "detach"):  # a torch tensor: converted without this module importing torch
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.int64)


def check_sentences(parents: np.ndarray, kept: np.ndarray, n_sentences: int) -> bool:
    """CacheError unless every hypothesis continues a row of its own sentence: `parents` (sentences, rows) the
    earlier sentence of each hypothesis' parent, the same along a row; `kept` (its first column) distinct earlier
    sentences of the `n_sentences` there were (finished ones left out, the rest in any order). Returns whether
    every sentence stays where it was (nothing to move: search's every step but those where sentences finish)."""
    # (count_nonzero: a C call, where .all() goes through Python; this runs every step)
    ascending = kept.size < 2 or not np.count_nonzero(kept[1:] <= kept[:-1])  # then distinct, the ends the bounds
    low, high = (int(kept[0]), int(kept[-1])) if ascending else (int(kept.min()), int(kept.max()))
    if not (not np.count_nonzero(parents != kept[:, None]) and 0 <= low and high < n_sentences
            and (ascending or _distinct(kept))):
        raise CacheError("each hypothesis must continue a row of its own sentence: a sentence's rows consecutive, "
                         "each earlier sentence continued by at most one (finished ones left out)")
    return ascending and kept.size == n_sentences


def _distinct(ids: np.ndarray) -> bool:
    """Whether `ids` (1-D) holds no value twice. Sorted neighbours, not np.unique, whose first call in a process
    imports numpy.ma (about 7 ms of a short file's run)."""
    ordered = np.sort(ids)
    return not np.count_nonzero(ordered[1:] == ordered[:-1])


def split_reorder(reorder: Any, n_sentences: int) -> tuple[np.ndarray, int, int]:
    """(reorder as int64 on the host, hypotheses, hypotheses per sentence); CacheError where they do not split."""
    reorder = host_ints(reorder)
    n = int(reorder.shape[0])
    if n_sentences < 1 or n % n_sentences:
        raise CacheError(f"{n} hypotheses do not split into {n_sentences} sentences")
    return reorder, n, n // n_sentences


def tail_filled(alive: np.ndarray) -> np.ndarray:
    """The rows to keep (`alive`, a bool per row) in the order that moves the fewest: of the first n (n the alive
    count), the alive ones stay where they are, and each hole among them takes one of the alive rows past n, in
    their order. So dropping a finished sentence moves at most as many rows as finished, not every row after it.
    search.py keeps its sentences in this order; nothing of a translation depends on it."""
    kept = np.flatnonzero(alive)
    order = np.arange(kept.size, dtype=np.int64)
    order[np.flatnonzero(~alive[:kept.size])] = kept[kept >= kept.size]
    return order


def moves_in_place(kept: np.ndarray, rows: int) -> bool:
    """Whether keep_rows_in_place can take `kept` (distinct rows of `rows`, each at or after its new place): each
    move then reads a row that no earlier move wrote. Ascending rows (the old order) and tail_filled's qualify."""
    n = int(kept.shape[0])
    if n == 0:
        return True
    if not (bool((kept >= np.arange(n)).all()) and int(kept.max()) < rows):
        return False
    seen = np.zeros(rows, dtype=bool)
    seen[kept] = True
    return int(np.count_nonzero(seen)) == n


def keep_rows_in_place(arrays: list[np.ndarray], kept: np.ndarray) -> list[np.ndarray]:
    """Each array's rows (axis 0) `kept` moved to its front, row i of the result the array's row kept[i], in place
    by one memmove per run of consecutive rows: views of the first len(kept) rows. `kept` must pass moves_in_place,
    which the callers ask once for all their arrays. An array that is not C-contiguous is copied instead
    (np.take). The arrays' other rows are overwritten: the caller gives them up."""
    n = int(kept.shape[0])
    starts = np.flatnonzero(np.diff(kept, prepend=-2) != 1)  # runs of consecutive rows: one memmove each
    runs = [(int(j), int(kept[j]), int(e - j)) for j, e in zip(starts, [*starts[1:], n]) if kept[j] != j]
    out = []
    for a in arrays:
        if not a.flags.c_contiguous:
            out.append(np.take(a, kept, axis=0))
            continue
        row, at = a.strides[0], a.ctypes.data
        for dst, src, length in runs:  # src >= dst, and no earlier move wrote src: memmove is safe
            ctypes.memmove(at + dst * row, at + src * row, length * row)
        out.append(a[:n])
    return out


def keep_rows(arrays: list[np.ndarray], kept: np.ndarray) -> list[np.ndarray]:
    """Each array's rows `kept`: moved in place where they can be (moves_in_place, asked once for all of them, which
    share their row count), else copied (np.take)."""
    if arrays and not moves_in_place(kept, int(arrays[0].shape[0])):
        return [np.take(a, kept, axis=0) for a in arrays]
    return keep_rows_in_place(arrays, kept)


class NumpyBuffers:
    """Cache buffers as numpy arrays in host memory."""

    def __init__(self, dtype: Any):
        self.dtype = np.dtype(dtype)
        self.device = "cpu"

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, self.dtype)

    def zeros_many(self, count: int, shape: tuple[int, ...]) -> list[np.ndarray]:
        """`count` zeroed buffers of `shape` as views of one block. Above 4 MB numpy asks the kernel for huge
        pages, so a batch's cache faults in a few 2 MB pages instead of thousands of 4 kB ones: after the heap
        trim between batches (runtime/heap.py), that was most of the cost of starting one (docs/performance.md)."""
        block = np.zeros((count, *shape), self.dtype)
        return [block[i] for i in range(count)]

    @staticmethod
    def stacked(bufs: list[np.ndarray]) -> np.ndarray | None:
        """The buffers as one array (len(bufs), *shape) where they are the first rows of consecutive buffers of one
        block (zeros_many's, rows kept in place), so one copy writes a step into all of them; else None."""
        base = bufs[0].base if bufs else None
        if base is None or base.ndim != bufs[0].ndim + 1 or base.shape[0] != len(bufs) or \
                not base.flags.c_contiguous:
            return None
        block = base[:, :bufs[0].shape[0]]
        same = all(b.base is base and b.shape == block.shape[1:] and b.ctypes.data == block[i].ctypes.data
                   for i, b in enumerate(bufs))
        return block if same else None

    def keep_rows(self, bufs: list[np.ndarray], kept: np.ndarray) -> list[np.ndarray]:
        """Each buffer's rows `kept` moved to its front, in place where they can be (moves_in_place: ascending,
        or tail_filled's order): views of the first len(kept) rows. No new buffer, so no fresh pages to fault in,
        and old and new never coexist (peak memory). Another order is copied (np.take)."""
        return keep_rows(bufs, kept)

    def grown(self, bufs: list[np.ndarray], shape: tuple[int, ...], used: int) -> list[np.ndarray]:
        """The buffers in a new block of `shape` each, their first `used` rows of axis 2 copied."""
        block = self.zeros_many(len(bufs), shape)
        for new, old in zip(block, bufs):
            new[:, :, :used] = old
        return block

    def write(self, at_t: np.ndarray, src: Any) -> None:
        np.copyto(at_t, src)

    def step_rows(self, new: Any, b: int, rows: int, h: int, dh: int) -> np.ndarray:
        return np.asarray(new).reshape(b, rows, h, dh).transpose(0, 2, 1, 3)

    def feed(self, array: np.ndarray) -> np.ndarray:
        return array


class TorchBuffers:
    """Cache buffers as torch tensors on `device` (torch is imported only here)."""

    def __init__(self, dtype: Any, device: Any):
        import torch

        self.torch = torch
        self.dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, np.dtype(dtype).name)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        # numpy copies on this thread. torch would split a copy this size over its OpenMP
        # pool, whose threads then spin, taking the cores that the engine's threads need next.
        self.single_thread = self.device.type == "cpu" and self.dtype in (torch.float32, torch.float16)

    def zeros(self, shape: tuple[int, ...]) -> Any:
        return self.torch.zeros(shape, dtype=self.dtype, device=self.device)

    def zeros_many(self, count: int, shape: tuple[int, ...]) -> list[Any]:
        return [self.zeros(shape) for _ in range(count)]

    def keep_rows(self, bufs: list[Any], kept: np.ndarray) -> list[Any]:
        """Each buffer's rows `kept`, in new tensors (CUDA-graph steps bind their own static buffers)."""
        index = self.torch.from_numpy(kept).to(self.device)
        return [buf.index_select(0, index) for buf in bufs]

    def grown(self, bufs: list[Any], shape: tuple[int, ...], used: int) -> list[Any]:
        """The list's buffers grown to `shape` in place, one at a time: each old one goes before the next grows
        (device memory), where the list held the only reference."""
        for i, old in enumerate(bufs):
            new = self.zeros(shape)
            new[:, :, :used].copy_(old)
            bufs[i] = new
        return bufs

    def step_rows(self, new: Any, b: int, rows: int, h: int, dh: int) -> Any:
        if isinstance(new, np.ndarray):
            new = self.torch.from_numpy(new)
        return new.reshape(b, rows, h, dh).transpose(1, 2)

    def write(self, at_t: Any, src: Any) -> None:
        if self.single_thread:
            np.copyto(at_t.numpy(), src.numpy())
        else:
            at_t.copy_(src)

    def feed(self, array: np.ndarray) -> Any:
        return self.torch.from_numpy(array).to(self.device)


def buffers_for(dtype: Any, device: Any = None) -> NumpyBuffers | TorchBuffers:
    """numpy buffers for a numpy dtype on the CPU; torch tensors for a torch dtype or a torch device."""
    torch_dtype = type(dtype).__module__.startswith("torch")
    torch_device = device is not None and (type(device).__module__.startswith("torch") or str(device) != "cpu")
    return TorchBuffers(dtype, device) if torch_dtype or torch_device else NumpyBuffers(dtype)


class BeamCache:
    """Self-attention K/V of every decoder layer for one batch being decoded.

    Use: `feeds = cache.advance(reorder, n_sentences)` before step t (t = cache.steps),
    run the step with `feeds` (io_names self_index, self_bias, self_k.i, self_v.i), then
    `cache.append(step_k, step_v)` with the step's per-layer (hyps, d_model) outputs.
    `dtype` picks the buffers: a numpy dtype (default float32) keeps them in numpy, a torch
    dtype (or a torch device) in torch tensors; the feeds come in the same kind.
    """

    def __init__(self, cfg: ModelConfig, n_hyps: int, dtype: Any = np.float32, device: Any = None,
                 max_steps: int | None = None, initial_capacity: int = INITIAL_CAPACITY):
        self.cfg = cfg
        self.buffers = buffers_for(dtype, device)
        self.dtype = self.buffers.dtype
        self.device = self.buffers.device
        self.max_steps = max_steps or cfg.max_positions
        self.initial_capacity = max(1, min(initial_capacity, self.max_steps))
        self.n_hyps = n_hyps  # rows of the last step (before the first: of step 0)
        self.steps = 0  # steps written
        self.rows = 0  # hypotheses per sentence, fixed by the first step
        self.capacity = 0
        self.k: list[Any] = []
        self.v: list[Any] = []
        self.n_sentences = 0
        # ancestry (hyps, steps) int64: the slot each hypothesis' ancestor wrote at each step
        self.slots = np.zeros((n_hyps, 0), dtype=np.int64)
        # index()'s first row of each (hypothesis, head) in the flattened buffers, for (hyps, rows, capacity)
        self._head_start = np.zeros((0, 0, 1), dtype=np.int64)
        self._head_start_for = (0, 0, 0)
        self._names = [io_names.self_k(i) for i in range(cfg.n_dec_layers)] + \
            [io_names.self_v(i) for i in range(cfg.n_dec_layers)]  # the graph's inputs for k + v
        self._heads, self._d_head = cfg.n_heads, cfg.d_head
        self._kv: Any = None  # numpy buffers: k + v as one array (2 x layers, ...) while they are one block's

    # -- before a step ------------------------------------------------------------------

    def advance(self, reorder: Any, n_sentences: int) -> dict[str, Any]:
        """Follow `reorder` ((hyps,) rows of the previous step each hypothesis continues;
        step 0: any), and return the step's cache feeds."""
        reorder, n, rows = split_reorder(reorder, n_sentences)
        if self.steps == 0:
            self.rows = rows
            self._allocate(n_sentences, self.initial_capacity)
            self.slots = np.zeros((n, 0), dtype=np.int64)  # step 0's hypotheses, whatever __init__ was told
        else:
            if rows != self.rows:
                raise CacheError(f"{rows} hypotheses per sentence, but the cache holds {self.rows}")
            parents = (reorder // rows).reshape(n_sentences, rows)  # each hypothesis' parent's sentence
            kept = parents[:, 0]
            stay = check_sentences(parents, kept, self.n_sentences)
            t = self.slots.shape[1]  # each hypothesis' ancestry: its parent's, then the slot its parent wrote
            slots = np.empty((n, t + 1), dtype=np.int64)
            slots[:, :t] = self.slots[reorder]
            slots[:, t] = reorder % rows
            self.slots = slots
            if not stay:
                self._drop(kept)  # finished sentences leave; the live ones move as search ordered them
        if self.steps >= self.capacity:
            if self.steps >= self.max_steps:
                raise CacheError(f"step {self.steps} is past the {self.max_steps} decoder positions")
            self._grow(min(2 * self.capacity, self.max_steps))
        self.n_hyps = n
        index, bias = self.index()
        feeds = dict(zip(self._names, self.k + self.v))
        feeds[io_names.SELF_INDEX], feeds[io_names.SELF_BIAS] = self.buffers.feed(index), self.buffers.feed(bias)
        return feeds

    def index(self) -> tuple[np.ndarray, np.ndarray]:
        """(self_index (hyps, n_heads, past) int64, self_bias (hyps, past) float32) for the next step."""
        n, t = self.slots.shape
        h = self.cfg.n_heads
        if t == 0:  # one masked position (no size-0 dims)
            return np.zeros((n, h, 1), dtype=np.int64), np.full((n, 1), MASK_VALUE, dtype=np.float32)
        if self._head_start_for != (n, self.rows, self.capacity):
            sentence = np.arange(n, dtype=np.int64) // self.rows
            head_start = (sentence[:, None] * h + np.arange(h, dtype=np.int64)) * (self.capacity * self.rows)
            self._head_start, self._head_start_for = head_start[:, :, None], (n, self.rows, self.capacity)
        return self._head_start + self.positions()[:, None, :], np.zeros((n, t), dtype=np.float32)

    def positions(self) -> np.ndarray:
        """(hyps, steps) int64: where in its sentence's time-major rows each hypothesis' ancestor
        wrote at each earlier step."""
        t = self.slots.shape[1]
        return self.slots + np.arange(0, t * self.rows, self.rows, dtype=np.int64)

    # -- after a step -------------------------------------------------------------------

    def append(self, step_k: list[Any], step_v: list[Any], stacked: np.ndarray | None = None) -> None:
        """Write the step's keys and values (per layer (hyps, d_model)) at time `steps`. `stacked`: a numpy array
        (2 x layers, hyps, d_model) whose rows are step_k + step_v, written by one copy where the buffers are one
        block's (the ONNX Runtime CPU backend binds the step's outputs so)."""
        b, h, dh, rows = self.n_sentences, self._heads, self._d_head, self.rows
        at = slice(self.steps * rows, (self.steps + 1) * rows)  # step t's rows in time-major order
        if stacked is not None and self._kv is not None:
            np.copyto(self._kv[:, :, :, at], stacked.reshape(-1, b, rows, h, dh).transpose(0, 1, 3, 2, 4))
        else:
            for buf, new in zip(self.k + self.v, list(step_k) + list(step_v)):
                self.buffers.write(buf[:, :, at], self.buffers.step_rows(new, b, rows, h, dh))
        self.steps += 1

    # -- storage ------------------------------------------------------------------------

    def _shape(self, n_sentences: int, capacity: int) -> tuple[int, int, int, int]:
        return (n_sentences, self.cfg.n_heads, capacity * self.rows, self.cfg.d_head)

    def _allocate(self, n_sentences: int, capacity: int) -> None:
        shape = self._shape(n_sentences, capacity)
        n = self.cfg.n_dec_layers
        block = self.buffers.zeros_many(2 * n, shape)
        self.k, self.v = block[:n], block[n:]
        self.capacity = capacity
        self.n_sentences = n_sentences
        self._stack()

    def _drop(self, kept: np.ndarray) -> None:
        """Keep the sentences `kept` (their earlier indices, in their new order) and drop the others' rows."""
        self.k = self.buffers.keep_rows(self.k, kept)
        self.v = self.buffers.keep_rows(self.v, kept)
        self.n_sentences = int(kept.shape[0])
        self._stack()

    def _grow(self, capacity: int) -> None:
        """Room for `capacity` steps; what is written keeps its place (time-major rows)."""
        used = self.capacity * self.rows
        n = self.cfg.n_dec_layers
        bufs, self.k, self.v = self.k + self.v, [], []  # referenced once: the torch buffers go one by one
        bufs = self.buffers.grown(bufs, self._shape(self.n_sentences, capacity), used)
        self.k, self.v = bufs[:n], bufs[n:]
        self.capacity = capacity
        self._stack()

    def _stack(self) -> None:
        self._kv = self.buffers.stacked(self.k + self.v) if isinstance(self.buffers, NumpyBuffers) else None


def step_outputs(outputs: Mapping[str, Any], n_layers: int) -> tuple[list[Any], list[Any]]:
    """The step's own keys and values from the decoder graph's named outputs."""
    return ([outputs[io_names.step_k(i)] for i in range(n_layers)],
            [outputs[io_names.step_v(i)] for i in range(n_layers)])

"""The self-attention cache of a decoder whose self-attention is ONNX Runtime's DecoderMaskedMultiHeadAttention
(export/self_attention.py): one row per hypothesis, written in place by the graph, read through each
hypothesis' ancestry.

model/cache.py's BeamCache keeps each step's keys once per sentence, time-major, and hands the graph an index
of every earlier position for each hypothesis to gather. Here the layout is the kernel's: per layer K and V of
shape (hyps, heads, capacity, d_head), all views of one block, which the decoder reads as `self_k.i` /
`self_v.i` and writes at position `step` as `present_k.i` / `present_v.i` bound to the same memory
(past_present_share_buffer). A hypothesis' earlier keys stay in the rows of the hypotheses that wrote them;
`cache_indirection` (sentences, beam, capacity) int32 says, for each hypothesis and earlier position, which
beam row of its sentence wrote it: BeamCache's `slots` (the ancestry), in the kernel's type.

Use: `cache.advance(reorder, n_sentences)` before step t, `cache.bind(binding)` on the decoder's IO binding,
run, `cache.wrote()`. Finished sentences leave as in BeamCache (their rows dropped, the holes filled in place by
the last rows: model/cache.py's tail_filled); the buffers are bound again only when they change (`generation`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from model import io_names
from model.cache import (
    INITIAL_CAPACITY,
    CacheError,
    check_sentences,
    keep_rows,
    split_reorder,
)
from model.config import ModelConfig


class IndirectCache:
    def __init__(self, cfg: ModelConfig, n_hyps: int, max_steps: int | None = None,
                 initial_capacity: int = INITIAL_CAPACITY):
        self.cfg = cfg
        self.max_steps = max_steps or cfg.max_positions
        self.capacity = max(1, min(initial_capacity, self.max_steps))
        self.n_hyps = n_hyps
        self.steps = 0  # steps written
        self.rows = 0  # hypotheses per sentence, fixed by the first step
        self.n_sentences = 0
        self.kv: list[np.ndarray] = []  # K of layers 0..L-1, then V of layers 0..L-1
        self.ancestry = np.zeros((n_hyps, self.capacity), np.int32)
        self.generation = 0  # changes whenever the buffers do: they must be bound again
        self._bound: tuple[Any, int] | None = None  # (binding, generation) last bound

    def _block(self, n: int, capacity: int) -> list[np.ndarray]:
        layers = self.cfg.n_dec_layers
        block = np.zeros((2 * layers, n, self.cfg.n_heads, capacity, self.cfg.d_head), np.float32)
        return [block[i] for i in range(2 * layers)]

    def advance(self, reorder: Any, n_sentences: int) -> np.ndarray:
        """Follow `reorder` (the previous step's row each hypothesis continues); returns cache_indirection."""
        reorder, n, rows = split_reorder(reorder, n_sentences)
        if self.steps == 0:
            self.rows, self.n_sentences = rows, n_sentences
            self.kv = self._block(n, self.capacity)
            self.ancestry = np.zeros((n, self.capacity), np.int32)
            self.generation += 1
        else:
            if rows != self.rows:
                raise CacheError(f"{rows} hypotheses per sentence, but the cache holds {self.rows}")
            parents = (reorder // rows).reshape(n_sentences, rows)
            kept = parents[:, 0]
            stay = check_sentences(parents, kept, self.n_sentences)
            ancestry = self.ancestry[reorder]  # the parent's history, then the parent's own row at the last step
            ancestry[:, self.steps - 1] = reorder % rows
            if stay:
                np.copyto(self.ancestry, ancestry)  # the buffer the binding holds: not bound again
            else:
                # finished sentences' rows leave; the others move where search put them, in place when they can
                hyps = (kept[:, None] * rows + np.arange(rows)).reshape(-1)
                self.kv = keep_rows(self.kv, hyps)
                self.n_sentences = n_sentences
                self.ancestry = ancestry
                self.generation += 1
        if self.steps >= self.capacity:
            if self.steps >= self.max_steps:
                raise CacheError(f"step {self.steps} is past the {self.max_steps} decoder positions")
            self._grow(n, min(2 * self.capacity, self.max_steps))
        self.n_hyps = n
        return self.ancestry.reshape(n_sentences, rows, self.capacity)

    def _grow(self, n: int, capacity: int) -> None:
        grown = self._block(n, capacity)
        for new, old in zip(grown, self.kv):
            new[:, :, :self.capacity] = old
        ancestry = np.zeros((n, capacity), np.int32)
        ancestry[:, :self.capacity] = self.ancestry
        self.kv, self.ancestry, self.capacity = grown, ancestry, capacity
        self.generation += 1

    def bind(self, binding: Any) -> np.ndarray:
        """Bind, where they changed, the buffers as the decoder's past (self_k.i / self_v.i) and present
        (present_k.i / present_v.i, the same memory) and cache_indirection on an onnxruntime IOBinding (advance
        writes each step's ancestry into the bound buffer); returns what must stay referenced until the run."""
        layers = self.cfg.n_dec_layers
        ancestry = self.ancestry.reshape(self.n_sentences, self.rows, self.capacity)  # a view: the same memory
        if self._bound is None or self._bound[0] is not binding or self._bound[1] != self.generation:
            for j, kv in enumerate("kv"):
                for i in range(layers):
                    a = self.kv[j * layers + i]
                    binding.bind_cpu_input(f"self_{kv}.{i}", a)
                    binding.bind_output(f"present_{kv}.{i}", "cpu", 0, np.float32, list(a.shape), a.ctypes.data)
            binding.bind_cpu_input(io_names.CACHE_INDIRECTION, ancestry)
            self._bound = (binding, self.generation)
        return ancestry

    def wrote(self) -> None:
        """The step ran: its keys and values are in the buffers at position `steps`."""
        self.steps += 1

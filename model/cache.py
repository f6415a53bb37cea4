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
sentences finish, their buffer rows are dropped (one copy of the survivors, on such steps).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from model import io_names
from model.config import ModelConfig
from model.transformer import MASK_VALUE

INITIAL_CAPACITY = 16  # steps the buffers hold before their first doubling


class CacheError(ValueError):
    """A reorder that this cache cannot follow (a hypothesis continuing another sentence's)."""


class BeamCache:
    """Self-attention K/V of every decoder layer for one batch being decoded.

    Use: `feeds = cache.advance(reorder, n_sentences)` before step t (t = cache.steps),
    run the step with `feeds` (io_names self_index, self_bias, self_k.i, self_v.i), then
    `cache.append(step_k, step_v)` with the step's per-layer (hyps, d_model) outputs.
    """

    def __init__(self, cfg: ModelConfig, n_hyps: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, max_steps: int | None = None,
                 initial_capacity: int = INITIAL_CAPACITY):
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.max_steps = max_steps or cfg.max_positions
        self.initial_capacity = max(1, min(initial_capacity, self.max_steps))
        self.n_hyps = n_hyps  # rows of the last step (before the first: of step 0)
        self.steps = 0  # steps written
        self.rows = 0  # hypotheses per sentence, fixed by the first step
        self.capacity = 0
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        # ancestry (hyps, steps) int64: the slot each hypothesis' ancestor wrote at each step
        self.slots = torch.zeros(n_hyps, 0, dtype=torch.int64, device=self.device)

    # -- before a step ------------------------------------------------------------------

    def advance(self, reorder: Tensor, n_sentences: int) -> dict[str, Tensor]:
        """Follow `reorder` ((hyps,) rows of the previous step each hypothesis continues;
        step 0: any), and return the step's cache feeds."""
        n = int(reorder.shape[0])
        if n_sentences < 1 or n % n_sentences:
            raise CacheError(f"{n} hypotheses do not split into {n_sentences} sentences")
        rows = n // n_sentences
        if self.steps == 0:
            self.rows = rows
            self._allocate(n_sentences, self.initial_capacity)
            self.slots = self.slots.new_zeros(n, 0)  # step 0's hypotheses, whatever __init__ was told
        else:
            if rows != self.rows:
                raise CacheError(f"{rows} hypotheses per sentence, but the cache holds {self.rows}")
            reorder = reorder.to(self.device, torch.int64)
            parent_sentence = torch.div(reorder, rows, rounding_mode="floor")
            kept = parent_sentence.view(n_sentences, rows)[:, 0]
            if self.device.type == "cpu" and not (torch.equal(parent_sentence, kept.repeat_interleave(rows))
                                                   and bool((kept[1:] > kept[:-1]).all())):
                # checked where it costs no device synchronisation; search never does this
                raise CacheError("each hypothesis must continue a row of its own sentence: a sentence's "
                                 "rows consecutive, sentences in their order (finished ones left out)")
            own_slot = (torch.arange(self.n_hyps, device=self.device) % rows)[:, None]
            self.slots = torch.cat([self.slots, own_slot], dim=1).index_select(0, reorder)
            if n_sentences != self.k[0].shape[0]:  # finished sentences leave (search keeps the order)
                self.k = [t.index_select(0, kept) for t in self.k]
                self.v = [t.index_select(0, kept) for t in self.v]
        if self.steps >= self.capacity:
            if self.steps >= self.max_steps:
                raise CacheError(f"step {self.steps} is past the {self.max_steps} decoder positions")
            self._grow(min(2 * self.capacity, self.max_steps))
        self.n_hyps = n
        index, bias = self.index()
        return {io_names.SELF_INDEX: index, io_names.SELF_BIAS: bias, **cache_inputs(self.k, self.v)}

    def index(self) -> tuple[Tensor, Tensor]:
        """(self_index (hyps, n_heads, past), self_bias (hyps, past)) for the next step."""
        n, t = self.slots.shape
        h, dev = self.cfg.n_heads, self.device
        if t == 0:  # one masked position (no size-0 dims)
            return (torch.zeros(n, h, 1, dtype=torch.int64, device=dev),
                    torch.full((n, 1), MASK_VALUE, dtype=torch.float32, device=dev))
        sentence = torch.arange(n, device=dev) // self.rows
        head_start = (sentence[:, None] * h + torch.arange(h, device=dev)) * (self.capacity * self.rows)
        position = torch.arange(t, device=dev) * self.rows + self.slots  # (hyps, t)
        return (head_start[:, :, None] + position[:, None, :],
                torch.zeros(n, t, dtype=torch.float32, device=dev))

    # -- after a step -------------------------------------------------------------------

    def append(self, step_k: list[Tensor], step_v: list[Tensor]) -> None:
        """Write the step's keys and values (per layer (hyps, d_model)) at time `steps`."""
        b, h, dh, t = self.k[0].shape[0], self.cfg.n_heads, self.cfg.d_head, self.steps
        single_thread = self.device.type == "cpu" and self.dtype in (torch.float32, torch.float16)
        for buf, new in zip(self.k + self.v, list(step_k) + list(step_v)):
            at_t = buf.view(b, h, self.capacity, self.rows, dh)[:, :, t]  # (b, h, rows, dh)
            src = new.reshape(b, self.rows, h, dh).transpose(1, 2)
            if single_thread:
                # numpy copies on this thread. torch would split a copy this size over its OpenMP
                # pool, whose threads then spin, taking the cores that the engine's threads need next.
                np.copyto(at_t.numpy(), src.numpy())
            else:
                at_t.copy_(src)
        self.steps += 1

    # -- storage ------------------------------------------------------------------------

    def _shape(self, n_sentences: int, capacity: int) -> tuple[int, int, int, int]:
        return (n_sentences, self.cfg.n_heads, capacity * self.rows, self.cfg.d_head)

    def _allocate(self, n_sentences: int, capacity: int) -> None:
        shape = self._shape(n_sentences, capacity)
        n = self.cfg.n_dec_layers
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(n)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(n)]
        self.capacity = capacity

    def _grow(self, capacity: int) -> None:
        """Room for `capacity` steps; what is written keeps its place (time-major rows)."""
        used = self.capacity * self.rows
        for bufs in (self.k, self.v):
            for i, old in enumerate(bufs):
                new = torch.zeros(self._shape(old.shape[0], capacity), dtype=self.dtype, device=self.device)
                new[:, :, :used].copy_(old)
                bufs[i] = new  # one layer at a time: the old buffer goes before the next grows
        self.capacity = capacity


def cache_inputs(self_k: list[Any], self_v: list[Any]) -> dict[str, Any]:
    """Per-layer buffers as the decoder graph's named inputs."""
    feeds = {io_names.self_k(i): k for i, k in enumerate(self_k)}
    feeds.update({io_names.self_v(i): v for i, v in enumerate(self_v)})
    return feeds


def step_outputs(outputs: Mapping[str, Any], n_layers: int) -> tuple[list[Any], list[Any]]:
    """The step's own keys and values from the decoder graph's named outputs."""
    return ([outputs[io_names.step_k(i)] for i in range(n_layers)],
            [outputs[io_names.step_v(i)] for i in range(n_layers)])

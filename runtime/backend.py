"""The one interface beam and greedy search run against, whatever executes the model.

A backend owns the encoder output and the decoder caches in its native form (torch
tensors, ONNX Runtime values, TensorRT device buffers); search only sees the step's
candidates as torch tensors on `backend.device`, and hands back row indices.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from model import io_names
from model.cache import BeamCache
from runtime.errors import RuntimeUserError


@dataclass
class EncoderState:
    """What decoding needs from the source: per-layer cross K/V and the source bias.

    `tensors` maps io_names (cross_k.i, cross_v.i, src_bias) to backend-native arrays
    with one row per sentence; a step's N hypotheses are N / n_rows consecutive rows per
    sentence, which share that sentence's row (no per-beam copies).
    """

    tensors: dict[str, Any]
    n_rows: int


@dataclass
class StepOutput:
    """Candidates of one decoder step, as torch tensors on the backend's device."""

    topk_log_probs: Tensor  # (N, K) float32, sorted descending
    topk_ids: Tensor        # (N, K) int64
    eos_log_probs: Tensor   # (N,) float32


class Backend(Protocol):
    name: str
    device: torch.device  # where StepOutput tensors live and where reorder indices go
    topk: int             # K of the step's candidates; beam search needs 2 * beam <= K
    max_src_len: int      # longest source (tokens, EOS included) this backend accepts
    max_tgt_len: int      # decoder positions available: BOS + generated tokens incl. EOS

    def encode(self, src_ids: Tensor) -> EncoderState:
        """src_ids (B, S) int64 padded with PAD_ID -> state with B rows."""

    def select(self, state: EncoderState, rows: Tensor) -> EncoderState:
        """A state whose row i is `state`'s row rows[i] (drops finished sentences)."""

    def initial_cache(self, n_rows: int) -> Any:
        """An empty self-attention cache for n_rows hypotheses (model.cache.BeamCache for
        the real backends; opaque to search)."""

    def step(self, state: EncoderState, tokens: Tensor, step: int, cache: Any,
             reorder: Tensor) -> tuple[StepOutput, Any]:
        """One decoder step. tokens (N,) int64 with N a multiple of state.n_rows (rows of
        a sentence are consecutive); reorder (N,) int64 rows of `cache` each hypothesis
        continues (within its own sentence); returns the candidates and the cache with
        this step added (the real backends extend it in place)."""


def select_rows(state: EncoderState, rows: Tensor) -> EncoderState:
    """`Backend.select` for backends whose state tensors are torch tensors: row i of the
    result is row rows[i] of every tensor."""
    first = next(iter(state.tensors.values()))
    rows = rows.to(first.device)
    return EncoderState({k: v.index_select(0, rows) for k, v in state.tensors.items()}, int(rows.shape[0]))


class ExportedGraphBackend:
    """What the onnxruntime and tensorrt backends share: torch tensors as state and caches,
    laid out as the exported graphs take them. Subclasses set cfg, device, cache_dtype,
    max_tgt_len."""

    cfg: Any
    device: torch.device
    cache_dtype: torch.dtype
    max_tgt_len: int

    def select(self, state: EncoderState, rows: Tensor) -> EncoderState:
        return select_rows(state, rows)

    @staticmethod
    def check_decoder_inputs(inputs: Iterable[str], where: object) -> None:
        """Refuse, with the way out, a decoder built before the beam cache (model/cache.py):
        its inputs have a `reorder` instead of the ancestry index, so binding would fail at the
        first step with an engine's message instead."""
        if io_names.SELF_INDEX not in set(inputs):
            raise RuntimeUserError(f"{where} has an older decoder interface (no `{io_names.SELF_INDEX}` input: "
                                   "exported before the beam cache); export the model again with `pipeline export`")

    def initial_cache(self, n_rows: int) -> BeamCache:
        return BeamCache(self.cfg, n_rows, self.cache_dtype, self.device, max_steps=self.max_tgt_len)

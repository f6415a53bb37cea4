"""The decoder's self-attention cache, laid out once for the model, the exported graphs,
the export verifier and every backend.

A cache is a pair (self_k, self_v) of per-decoder-layer tensors, each
(rows, n_heads, length, d_head), whose slot 0 is the masked dummy slot (see
model/transformer.py): before step t, length = 1 + t. The graphs take it as named
inputs `self_k.i` / `self_v.i` and give it back grown as `new_self_k.i` / `new_self_v.i`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from torch import Tensor

from model import io_names
from model.config import ModelConfig

T = TypeVar("T")  # torch tensors in backends, numpy arrays in the verifier

SelfCache = tuple[list[Tensor], list[Tensor]]  # (self_k per layer, self_v per layer)


def cache_shape(cfg: ModelConfig, n_rows: int, length: int = 1) -> tuple[int, int, int, int]:
    """One layer's K (or V) cache: (rows, n_heads, length, d_head)."""
    return (n_rows, cfg.n_heads, length, cfg.d_head)


def dummy_slot_cache(cfg: ModelConfig, n_rows: int, dtype: torch.dtype = torch.float32,
                     device: torch.device | str | None = None) -> SelfCache:
    """The length-1 cache (only the masked dummy slot) that the first step takes."""
    shape = cache_shape(cfg, n_rows)
    n = cfg.n_dec_layers
    return ([torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)],
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)])


def cache_inputs(self_k: list[T], self_v: list[T]) -> dict[str, T]:
    """A cache as the decoder graph's named inputs."""
    feeds = {io_names.self_k(i): k for i, k in enumerate(self_k)}
    feeds.update({io_names.self_v(i): v for i, v in enumerate(self_v)})
    return feeds


def cache_outputs(outputs: Mapping[str, Any], n_layers: int) -> tuple[list[Any], list[Any]]:
    """The grown cache from the decoder graph's named outputs."""
    return ([outputs[io_names.new_self_k(i)] for i in range(n_layers)],
            [outputs[io_names.new_self_v(i)] for i in range(n_layers)])

"""The Transformer: config, modules, inference functions, checkpoints. Imports nothing
else of this project and knows nothing of ONNX.

The modules that need PyTorch (transformer, checkpoint) load on first use, so the deploy
runtime can read configs, manifests and caches from here without importing torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from model.config import BOS_ID, EOS_ID, MASK_VALUE, PAD_ID, PRESETS, UNK_ID, ConfigError, ModelConfig, Preset, preset

if TYPE_CHECKING:
    from model.transformer import Transformer, build_model, select_candidates

_TORCH_NAMES = ("Transformer", "build_model", "select_candidates")

__all__ = [
    "BOS_ID", "EOS_ID", "PAD_ID", "UNK_ID", "PRESETS", "MASK_VALUE", "ConfigError",
    "ModelConfig", "Preset", "Transformer", "build_model", "preset", "select_candidates",
]


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from model import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module 'model' has no attribute {name!r}")

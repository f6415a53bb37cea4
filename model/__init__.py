"""The Transformer: config, modules, inference functions, checkpoints. Imports nothing
else of this project and knows nothing of ONNX."""

from model.config import BOS_ID, EOS_ID, PAD_ID, PRESETS, UNK_ID, ConfigError, ModelConfig, Preset, preset
from model.transformer import MASK_VALUE, Transformer, build_model, select_candidates

__all__ = [
    "BOS_ID", "EOS_ID", "PAD_ID", "UNK_ID", "PRESETS", "MASK_VALUE", "ConfigError",
    "ModelConfig", "Preset", "Transformer", "build_model", "preset", "select_candidates",
]

"""pipeline: train, export, serve and verify the Transformer of "Attention Is All You Need".

The Python API, in three lines (no torch needed for an exported model dir):

    from pipeline import Translator
    translator = Translator("models/de-en")
    translator.translate(["Ein Hund läuft über die Wiese."]).translation

Translator's options come from here too: `LoadOptions` (backend, threads, device, shortlist), `DecodingOptions`
(beam, length penalty, ...), `ServeBatchOptions` (long lines, sentence splitting, HTML). They are imported on
first use, so `import pipeline` (and every command's start) stays light."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Translator": "pipeline.integrations.translator",
    "Translated": "pipeline.integrations.translator",
    "LoadOptions": "runtime.model_dir",
    "DecodingOptions": "runtime.decoding",
    "ServeBatchOptions": "pipeline.serve_batch.translation",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")

#!/usr/bin/env python
"""Moved into the product: `pipeline bench MODEL_DIR --compare ctranslate2`
(pipeline/evaluation/ctranslate2_compare.py)."""
raise SystemExit("use: pipeline bench MODEL_DIR --compare ctranslate2 [--batch-size 32 --beam-size 4 --threads 2]")

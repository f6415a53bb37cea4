"""Translating on engines users already run for bulk inference, with serve-batch's runtime and output.

    translator.py  Translator: a model dir loaded once per worker, a callable on batches of rows (Ray Data's
                   map_batches); no torch, no Ray needed to import it
    spark.py       make_predict_fn: the same class under pyspark.ml.functions.predict_batch_udf
    shards.py      a corpus as shards: inputs, outputs, resume, the writer that restores line order
    ray_job.py     `pipeline ray-translate`: Ray Data reads the shards, Translator actors translate them
    ray_read.py    the shards as Ray Data rows (read tasks that reserve no CPU); read_shards, for jobs of your own

docs/scale-out.md says how to run them on many machines."""

from typing import Any

from pipeline.integrations.translator import OUTPUT_COLUMNS, Translated, Translator
from pipeline.serve_batch.translation import ServeBatchOptions
from runtime.decoding import DecodingOptions
from runtime.model_dir import LoadOptions

# the Translator's options, here so that a Ray or Spark job imports nothing from the top-level runtime package
__all__ = ["OUTPUT_COLUMNS", "DecodingOptions", "LoadOptions", "ServeBatchOptions", "Translated", "Translator",
           "read_shards"]


def __getattr__(name: str) -> Any:
    if name == "read_shards":  # imports Ray: only when asked for
        from pipeline.integrations.ray_read import read_shards

        return read_shards
    raise AttributeError(f"module 'pipeline.integrations' has no attribute {name!r}")

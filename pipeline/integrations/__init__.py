"""Translating on engines users already run for bulk inference, with serve-batch's runtime and output.

    translator.py  Translator: a model dir loaded once per worker, a callable on batches of rows (Ray Data's
                   map_batches); no torch, no Ray needed to import it
    spark.py       make_predict_fn: the same class under pyspark.ml.functions.predict_batch_udf
    shards.py      a corpus as shards: inputs, outputs, resume, the writer that restores line order
    ray_job.py     `pipeline ray-translate`: Ray Data reads the shards, Translator actors translate them

docs/scale-out.md says how to run them on many machines."""

from pipeline.integrations.translator import OUTPUT_COLUMNS, Translated, Translator

__all__ = ["OUTPUT_COLUMNS", "Translated", "Translator"]

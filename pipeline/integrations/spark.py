"""Spark: the same Translator under `pyspark.ml.functions.predict_batch_udf`.

    from pyspark.ml.functions import predict_batch_udf
    from pipeline.integrations.spark import make_predict_fn, return_type

    translate = predict_batch_udf(make_predict_fn("models/en-de"), return_type=return_type(), batch_size=500)
    df.withColumn("out", translate("text")).select("out.translation", "out.score")

With a glossary, `make_predict_fn("models/en-de", glossary="terms.tsv")` and `return_type(glossary=True)`: the
struct gains `terms` (per row, JSON of the terms found and whether each was applied).

Spark calls the factory once per Python worker, which loads the model dir once; each batch of the column
comes as a numpy array of strings and goes back as the Translator's columns, translated as serve-batch
does. Only return_type, called on the driver, imports pyspark: the executors need this package, its model dir,
and no torch."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.integrations.translator import Translator

PredictFn = Callable[[np.ndarray], dict[str, np.ndarray]]


def return_type(glossary: bool = False) -> Any:
    """predict_batch_udf's return_type for what make_predict_fn's function returns: Translator's columns as a
    struct (a StructType: predict_batch_udf takes no DDL string, and no boolean field, so `empty` is 0 or 1);
    `glossary`: the function was made with one, so it returns `terms` too (predict_batch_udf refuses columns
    its return type does not name)."""
    try:
        from pyspark.sql.types import DoubleType, IntegerType, StringType, StructField, StructType
    except ModuleNotFoundError as e:  # (the driver's: it builds the UDF) one line naming the extra, as the CLI's
        if e.name is None or e.name.split(".")[0] != "pyspark":
            raise
        raise ModuleNotFoundError('return_type() is a pyspark type, and pyspark is not installed here: '
                                  'pip install -e ".[spark]" (it needs a Java runtime)', name="pyspark") from None

    return StructType([StructField("translation", StringType()), StructField("score", DoubleType()),
                       StructField("empty", IntegerType()), StructField("truncated", IntegerType()),
                       *([StructField("terms", StringType())] if glossary else [])])


def make_predict_fn(model_dir: str | Path, **translator_options: Any) -> Callable[[], PredictFn]:
    """The `make_predict_fn` predict_batch_udf takes: a picklable factory that, on an executor, loads
    `model_dir` (Translator's keyword options: load_options, decoding, options) and returns the function
    from a batch of source strings to the columns of return_type()."""
    return functools.partial(_load, str(model_dir), translator_options)


def _load(model_dir: str, translator_options: dict[str, Any]) -> PredictFn:
    translator = Translator(model_dir, **translator_options)

    def predict(sources: np.ndarray) -> dict[str, np.ndarray]:
        columns = translator.translate(list(sources)).columns()
        columns["empty"] = columns["empty"].astype(np.int32)
        return columns

    return predict

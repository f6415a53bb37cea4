"""The Translator under Spark's predict_batch_udf, on local[2]: the same lines as serve-batch, null rows blank.

Not in CI: pyspark is not in the dev extra (it needs a Java runtime, 17+ for pyspark 4, and starts a JVM in
about 10 s on two cores). `pip install -e ".[spark]"` where Java is installed runs it."""

from __future__ import annotations

import shutil

import pytest
from test_integrations import corpus_lines, serve_batch_lines

from pipeline.integrations.spark import make_predict_fn, return_type
from pipeline.serve_batch.translation import ServeBatchOptions
from runtime.model_dir import LoadOptions

pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (the spark extra)")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("java") is None, reason="Spark needs a Java runtime")]


def test_predict_batch_udf_translates_as_serve_batch(fp32_dir, tmp_path):
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql import SparkSession

    lines = corpus_lines(60)
    expected, _ = serve_batch_lines(fp32_dir, lines, tmp_path, ServeBatchOptions())
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    try:
        rows = [(i, None if i == 7 else text) for i, text in enumerate(lines)]
        frame = spark.createDataFrame(rows, "id long, text string").repartition(2)
        translate = predict_batch_udf(make_predict_fn(str(fp32_dir), load_options=LoadOptions(backend="onnxruntime")),
                                      return_type=return_type(), batch_size=16)
        out = frame.withColumn("out", translate("text")).select("id", "out.translation", "out.empty").collect()
    finally:
        spark.stop()
    got = {row["id"]: (row["translation"], row["empty"]) for row in out}
    expected[7] = ""
    assert [got[i][0] for i in range(len(lines))] == expected
    assert got[7] == ("", 1)
    assert sum(e for _, e in got.values()) == 1 + sum(not t.strip() for t in lines[:7] + lines[8:])


def test_predict_batch_udf_with_a_glossary_returns_its_terms(trained_model_dir, tmp_path):
    """make_predict_fn(..., glossary=) returned a `terms` column that return_type() did not name, and
    predict_batch_udf refuses a result whose columns differ from its return type's."""
    import json

    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql import SparkSession
    from test_glossary_serve_batch import GLOSSARY

    glossary = tmp_path / "terms.tsv"
    glossary.write_text(GLOSSARY, encoding="utf-8")
    lines = ["der hund sieht die katze", "die katze", "ein haus"]
    expected, _ = serve_batch_lines(trained_model_dir, lines, tmp_path, ServeBatchOptions(glossary=(str(glossary),)))
    spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
    try:
        frame = spark.createDataFrame(list(enumerate(lines)), "id long, text string")
        translate = predict_batch_udf(make_predict_fn(str(trained_model_dir), glossary=str(glossary)),
                                      return_type=return_type(glossary=True), batch_size=8)
        out = frame.withColumn("out", translate("text")).select("id", "out.translation", "out.terms").collect()
    finally:
        spark.stop()
    got = sorted((row["id"], row["translation"], json.loads(row["terms"])) for row in out)
    assert [t for _, t, _ in got] == expected
    assert {"source": "hund", "target": "tree", "applied": True, "constrained": True} in got[0][2]
    assert got[2][2] == []

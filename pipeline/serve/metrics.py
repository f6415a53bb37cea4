"""Prometheus metrics of one server, in a registry of its own (no process-global state). Every series
carries a `model` label: the model the request named ("" for a request refused before naming one: those series
are listed once one is counted)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
PER_MODEL = ("sentences", "src_tokens", "tgt_tokens", "truncated", "disconnects", "queue_depth", "in_flight",
             "batch_requests", "batch_sentences", "batch_seconds", "queue_seconds", "request_seconds")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model"]
        self.requests = Counter("pipeline_requests", "HTTP /translate requests by model and status code (a "
                                "stream as it ended: 200 whole, 499 its client left, or the status of the error "
                                "object that ended it).",
                                ["model", "code"], registry=r)
        self.sentences = Counter("pipeline_sentences", "Lines (with split: sentences) answered, blank ones "
                                 "included (a request whose client left is not: pipeline_client_disconnects).", m,
                                 registry=r)
        self.src_tokens = Counter("pipeline_source_tokens", "Source tokens of the sentences answered (EOS "
                                  "included).", m, registry=r)
        self.tgt_tokens = Counter("pipeline_target_tokens",
                                  "Target tokens answered (best hypothesis, EOS included); rate() of it is the "
                                  "target tokens/s clients got (the backend's work: pipeline_batch_sentences).", m,
                                  registry=r)
        self.truncated = Counter("pipeline_truncated_lines", "Lines cut to the model's source limit.", m,
                                 registry=r)
        self.disconnects = Counter("pipeline_client_disconnects",
                                   "Requests whose client left before the answer; their work was dropped.", m,
                                   registry=r)
        self.queue_depth = Gauge("pipeline_queue_depth", "Requests waiting for a batch.", m, registry=r)
        self.in_flight = Gauge("pipeline_in_flight_requests", "Requests accepted and not yet answered.", m,
                               registry=r)
        self.batch_requests = Histogram("pipeline_batch_requests", "Requests per dynamic batch (one over the "
                                        "budget counts in each of its batches).", m, buckets=COUNT_BUCKETS,
                                        registry=r)
        self.batch_sentences = Histogram("pipeline_batch_sentences", "Lines per dynamic batch.", m,
                                         buckets=COUNT_BUCKETS, registry=r)
        self.batch_seconds = Histogram("pipeline_batch_seconds", "Backend time per dynamic batch.", m,
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("pipeline_queue_seconds", "Time a request waited for its first batch.", m,
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram("pipeline_request_seconds",
                                         "Latency of successful /translate requests, body read to answer "
                                         "(streams: to the last object).", m, buckets=LATENCY_BUCKETS, registry=r)

    def model(self, name: str, listed: bool = True) -> ModelMetrics:
        return ModelMetrics(self, name, listed)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """One model's series: the attributes of PER_MODEL, and `request(code)` to count an answer."""

    sentences: Counter
    src_tokens: Counter
    tgt_tokens: Counter
    truncated: Counter
    disconnects: Counter
    queue_depth: Gauge
    in_flight: Gauge
    batch_requests: Histogram
    batch_sentences: Histogram
    batch_seconds: Histogram
    queue_seconds: Histogram
    request_seconds: Histogram

    def __init__(self, metrics: Metrics, name: str, listed: bool = True):
        self.name, self._metrics = name, metrics
        self._requests = metrics.requests
        for attr in PER_MODEL if listed else ():  # a served model's series are listed (at 0) from the start
            setattr(self, attr, getattr(metrics, attr).labels(model=name))

    def __getattr__(self, attr: str) -> Any:
        """A series not listed from the start (the requests no model was named for): made when first counted, so
        /metrics holds no model="" series that never moved."""
        if attr not in PER_MODEL:
            raise AttributeError(attr)
        series = getattr(self._metrics, attr).labels(model=self.name)
        setattr(self, attr, series)
        return series

    def request(self, code: int) -> None:
        self._requests.labels(model=self.name, code=str(code)).inc()

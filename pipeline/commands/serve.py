"""`pipeline serve`: the click command; the service is in pipeline/serve/."""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from model.errors import UserError
from pipeline.cli_options import MODEL_DIR_KIND, GivenPath, decoding_options, options_from, pick
from pipeline.serve.options import LOAD_NOTES, RequestLimits, ServeHttpOptions
from runtime.decoding import DecodingOptions
from runtime.model_dir import LoadOptions


def _require_web_stack() -> None:
    """The web stack is an optional extra: imported only when serving, refused in one line."""
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(f"`pipeline serve` needs {e.name or 'its web stack'}, which is not installed: "
                        'pip install -e ".[serve]"') from None


@click.command("serve")
@click.argument("model_dir", type=GivenPath(file_okay=False, kind=MODEL_DIR_KIND), required=False)
@options_from(ServeHttpOptions)
@options_from(LoadOptions, notes=LOAD_NOTES)
@decoding_options("beam_size", "alpha", "max_len_a", "max_len_b", "min_len", "nbest", "rules",
                  notes={"beam_size": 'Requests may ask for another with "beam_size".',
                         "nbest": 'With N > 1 each translation is {"hypotheses": [{text, score}, ...]}, at most the '
                                  'beam of the request; requests with "split" or "format": "html" get one.'})
@options_from(RequestLimits)
def serve(model_dir: str | None, decoding: DecodingOptions, **options: Any) -> None:
    """Serve the model in MODEL_DIR (or several: --model NAME=DIR ...) over HTTP, batching
    concurrent requests dynamically, one queue per model.

    POST /translate {"text": [lines], "model"?, "source"?, "target"?, "split"?, "lang"?,
    "format"?, "stream"?, "beam_size"?, "nbest"?, "scores"?, "glossary"?} answers
    {"translations": [...]}, exactly what serve-batch writes for those lines
    ("source"/"target": a multilingual model's languages; "split": "sentences": documents, as
    serve-batch --split sentences; "format": "html": markup kept, as serve-batch --format
    html; "stream": true: NDJSON, one object per text as soon as it is done; "glossary": a
    --glossary NAME or {"term": "translation"}). GET /health, /metrics (Prometheus, by model)
    and /info. Beside it, LibreTranslate's API: POST /translate {"q", "source" (or "auto"),
    "target", "format"?, "alternatives"?, "api_key"?, "glossary"?} (JSON, form data or the
    query string), GET /languages, POST /detect, /translate_file, /suggest, /spec,
    /frontend/settings and a web page at /, routed by each model's languages (a model named
    SRC-TGT, like --model de-en=DIR, or one whose manifest lists them). Stateless: run one
    process per GPU and as many replicas as needed behind any load balancer.
    """
    _require_web_stack()
    from pipeline.serve.runner import model_specs, serve_http

    given = click.get_current_context().get_parameter_source("keyless_rate")
    if options.get("api_keys") is None and given not in (None, click.core.ParameterSource.DEFAULT):
        raise click.UsageError("--keyless-rate limits the clients without a key of --api-keys FILE; without keys "
                               "no client is limited: give --api-keys too")

    load = dataclasses.replace(pick(LoadOptions, options), many_batches=True)  # a queue: batches side by side
    opts, limits = dataclasses.replace(pick(ServeHttpOptions, options), load=load), pick(RequestLimits, options)
    models = model_specs(model_dir, opts.model)
    # the server's budget, not one the user set: a model dir's own batch_tokens still applies
    serve_http(models, opts, decoding.replace(batch_tokens=limits.max_batch_tokens, explicit=decoding.explicit),
               limits)

"""`pipeline serve`: the click command; the service is in pipeline/serve/."""

from __future__ import annotations

import click

from model.errors import UserError
from runtime.decoding import PAPER, DecodingOptions
from runtime.loader import BACKENDS

H = DecodingOptions.help


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
@click.argument("model_dir", type=click.Path(file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; 0.0.0.0 exposes the service to the network (put it behind a proxy).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="TCP port; 0 picks a free one (logged at startup).")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
              help="auto: tensorrt if the engines, TensorRT and a GPU are present, else onnxruntime "
                   "if installed, else torch.")
@click.option("--device", default=None, metavar="DEV",
              help="cpu, cuda or cuda:N [default: cuda when available, else cpu]. One process per GPU.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Intra-op threads of torch / onnxruntime [default: all cores].")
@click.option("--beam-size", type=click.IntRange(min=1), default=PAPER.beam_size, show_default=True,
              help=H("beam_size") + " Requests may ask for another with \"beam_size\".")
@click.option("--alpha", type=float, default=PAPER.alpha, show_default=True, help=H("alpha"))
@click.option("--max-len-a", type=float, default=PAPER.max_len_a, show_default=True, help=H("max_len_a"))
@click.option("--max-len-b", type=int, default=PAPER.max_len_b, show_default=True, help=H("max_len_b"))
@click.option("--min-len", type=click.IntRange(min=0), default=PAPER.min_len, show_default=True,
              help=H("min_len"))
@click.option("--nbest", type=click.IntRange(min=1), default=PAPER.nbest, show_default=True,
              help=H("nbest") + " With N > 1 each translation is a list of {text, score}.")
@click.option("--max-batch-tokens", type=click.IntRange(min=1), default=PAPER.batch_tokens, show_default=True,
              help="Dynamic batch budget: source tokens x beam of the requests batched together "
                   "(and sentences x longest source x beam per search batch, as serve-batch's --batch-tokens).")
@click.option("--max-wait-ms", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="How long the oldest queued request may wait for others to share its batch.")
@click.option("--max-queue", type=click.IntRange(min=1), default=256, show_default=True,
              help="Requests that may wait for a batch; beyond it requests get 503 with Retry-After.")
@click.option("--max-lines", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Most lines per request (413 beyond).")
@click.option("--max-bytes", type=click.IntRange(min=1), default=1 << 20, show_default=True,
              help="Largest request body in bytes (413 beyond).")
@click.option("--long-lines", type=click.Choice(["truncate", "error"]), default="truncate", show_default=True,
              help="Lines longer than the model's source limit: truncate them (as serve-batch does, counted "
                   "in /metrics) or refuse the request with 413 naming the line.")
@click.option("--grace-s", type=click.IntRange(min=0), default=30, show_default=True,
              help="On SIGTERM / Ctrl-C: stop accepting, let in-flight requests finish for up to this many "
                   "seconds (then cancel them), exit 0.")
def serve(model_dir: str, host: str, port: int, backend: str, device: str | None, threads: int | None,
          beam_size: int, alpha: float, max_len_a: float, max_len_b: int, min_len: int, nbest: int,
          max_batch_tokens: int, max_wait_ms: float, max_queue: int, max_lines: int, max_bytes: int,
          long_lines: str, grace_s: int) -> None:
    """Serve the model in MODEL_DIR over HTTP, batching concurrent requests dynamically.

    POST /translate {"text": [lines], "beam_size"?, "nbest"?, "scores"?} answers
    {"translations": [...]}, exactly what serve-batch writes for those lines.
    GET /health, /metrics (Prometheus) and /info. Stateless: run one process per GPU
    and as many replicas as needed behind any load balancer.
    """
    _require_web_stack()
    from pipeline.serve.app import RequestLimits
    from pipeline.serve.runner import ServeHttpOptions, serve_http

    decoding = DecodingOptions(beam_size=beam_size, alpha=alpha, max_len_a=max_len_a, max_len_b=max_len_b,
                               min_len=min_len, nbest=nbest, batch_tokens=max_batch_tokens)
    limits = RequestLimits(max_lines=max_lines, max_bytes=max_bytes, max_batch_tokens=max_batch_tokens,
                    max_wait_ms=max_wait_ms, max_queue=max_queue)
    opts = ServeHttpOptions(host=host, port=port, backend=backend, device=device, threads=threads,
                            long_lines=long_lines, grace_s=grace_s)
    serve_http(model_dir, opts, decoding, limits)

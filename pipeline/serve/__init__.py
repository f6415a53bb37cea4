"""`pipeline serve`: an HTTP translation service over any backend, with dynamic batching, laid out per API over
the text service (runtime/texts.py), as vLLM lays out its entrypoints:

    app.py        the app assembled: routes, middleware, lifespan, /health, /metrics, /info
    native.py     the native API: {"text": [...]} parsed, answered (whole or streamed)
    libre.py      LibreTranslate's API: /translate, /languages, /detect, /frontend/settings
                  (file_routes.py: its /translate_file and /download_file; suggestions.py: /suggest)
    service.py    the service calls both APIs make: encode within the limits, queue, await, drop, count
    state.py      the served models (each a loaded model dir, runtime/model_dir.py), the server's shared state,
                  the model a request names
    http.py       HTTP mechanics: bodies within bounds, forms, the bearer key, client disconnects, off-loop
                  work, the one error path
    batcher.py    queues requests and calls the loaded model's search on its backend threads; runner.py loads,
                  warms up, binds and drains

Texts go in through runtime/texts.py encode_texts (service.encode) and come out through its finish_texts (each
API's answer), the functions serve-batch writes with. The web stack (starlette, uvicorn, prometheus-client) is
the optional `serve` extra, imported only by this package."""

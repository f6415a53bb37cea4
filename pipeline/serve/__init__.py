"""`pipeline serve`: an HTTP translation service over any backend, with dynamic batching.

Texts go in and answers come out through the text service serve-batch writes with (runtime/texts.py:
requests.encode_request encodes, app.py and libre.py finish); translator.py holds a loaded model dir and its
one call into the search; batcher.py queues requests and runs one backend thread; app.py holds the routes;
runner.py loads, warms up, binds and drains. The web stack (starlette, uvicorn,
prometheus-client) is the optional `serve` extra, imported only by this package."""

"""`pipeline serve`: an HTTP translation service over any backend, with dynamic batching.

translator.py is the only module that calls into serve-batch's encode / search / format path;
batcher.py queues requests and runs one backend thread; app.py holds the routes;
runner.py loads, warms up, binds and drains. The web stack (starlette, uvicorn,
prometheus-client) is the optional `serve` extra, imported only by this package."""

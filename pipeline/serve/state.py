"""What the routes of `pipeline serve` share: each served model (its loaded model dir, defaults, metrics and queue),
the server's state (limits, threads, keys, detector, glossaries, the LibreTranslate routes) and the model a
request names (400 / 404 naming the served models). Runner.py builds it; app.py hands it to every route."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pipeline.serve.access import ApiKeys
from pipeline.serve.batcher import Batcher
from pipeline.serve.detect import Detector
from pipeline.serve.http import ApiError
from pipeline.serve.languages import Routes
from pipeline.serve.metrics import Metrics, ModelMetrics
from pipeline.serve.options import RequestLimits
from runtime.decoding import DecodingOptions
from runtime.glossary import Glossary
from runtime.languages import ONE_PAIR, Direction, LanguageError, direction
from runtime.model_dir import Loaded


@dataclass
class ServedModel:
    """One model dir as the routes see it: loaded (runtime/model_dir.py: its backend, tokenizer, manifest and
    decoding, the model's own defaults under what the server was given; the batcher calls its search), its
    defaults, metrics and queue, and the server's --long-lines policy."""

    name: str
    loaded: Loaded
    decoding: DecodingOptions
    max_beam: int
    lang: str  # sentence rules when a request names none
    info: dict[str, Any]
    metrics: ModelMetrics
    batcher: Batcher | None = None
    # the languages it translates from and into (languages.served_languages): LibreTranslate's routes
    sources: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    long_lines: str = "truncate"

    def direction(self, source: str | None, target: str | None) -> Direction:
        """The token ids that tell a multilingual model (its manifest lists languages) to translate source ->
        target; nothing for a model of one pair (ValueError naming "source" / "target" when it lacks one)."""
        manifest = self.loaded.manifest
        if manifest is None or not manifest.model_config.languages:  # one pair: no language tokens
            return ONE_PAIR
        try:
            return direction(self.loaded.backend.cfg, source, target, source_name='"source"', target_name='"target"')
        except LanguageError as e:
            raise ValueError(str(e)) from None


@dataclass
class ServerState:
    """What the routes share; `draining` turns /health to 503 once shutdown has begun."""

    models: dict[str, ServedModel]
    limits: RequestLimits
    info: dict[str, Any]
    metrics: Metrics
    warmed_up: bool = False
    draining: bool = False
    prepare: ThreadPoolExecutor | None = None  # threads preparing requests and answers (app.py's lifespan)
    reading: ThreadPoolExecutor | None = None  # threads reading bodies, apart from `prepare` (app.py's lifespan)
    # the thread reading and rebuilding uploaded files (/translate_file), apart from `prepare`: files wait for
    # each other, never the requests the other threads prepare (app.py's lifespan)
    documents: ThreadPoolExecutor | None = None
    # uploads held from their reading to their rebuilding, at most (app.py's lifespan): the others wait as bytes
    held_documents: asyncio.Semaphore | None = None
    keys: ApiKeys | None = None  # --api-keys: the keys, and the rule for requests without one
    cors_origin: str | None = "*"  # --cors-origin: Access-Control-Allow-Origin; None sends no CORS headers
    access_log: str | None = None  # --access-log: "text" or "json" lines; None writes none
    suggestions: Any = None  # --suggestions: suggestions.Suggestions, where POST /suggest stores; None: off
    detector: Detector | None = None  # "source": "auto" and /detect; None: `no_detector` says why
    no_detector: str = "language detection is off"
    glossaries: dict[str, Glossary] = field(default_factory=dict)  # --glossary NAME=FILE, checked at start
    in_flight: int = 0  # translating requests being handled (app.py counted), of every model
    unnamed: ModelMetrics = field(init=False)  # requests refused before they named a model
    routes: Routes[ServedModel] = field(init=False)  # (source, target) -> model, for LibreTranslate's API

    def __post_init__(self) -> None:
        self.unnamed = self.metrics.model("", listed=False)
        self.routes = Routes.of((m.name, m, m.sources, m.targets) for m in self.models.values())

    @property
    def refused_in(self) -> ModelMetrics:
        """Where a request refused before a model was picked is counted: the server's only model (both APIs
        alike: a key's 429 was model="de-en" on the native API and model="" on LibreTranslate's), else unnamed."""
        return next(iter(self.models.values())).metrics if len(self.models) == 1 else self.unnamed


def pick_model(data: dict[str, Any], state: ServerState) -> ServedModel:
    """The model the request names; the only one when it names none (400 / 404 otherwise)."""
    known = ", ".join(state.models)
    if "model" not in data:
        if len(state.models) == 1:
            return next(iter(state.models.values()))
        raise ApiError(400, f'"model" is required: this server has {known}')
    name = data["model"]
    if not isinstance(name, str):
        raise ApiError(400, '"model" must be a model name')
    if name not in state.models:
        raise ApiError(404, f'unknown "model" {name[:40]!r}{"..." if len(name) > 40 else ""}: this server has {known}')
    return state.models[name]

"""The service calls under both HTTP APIs (native.py, libre.py): a TranslateRequest (texts, model, decoding,
split, format, language pair, glossary) encoded by the text service (runtime/texts.py encode_texts: the only
place a request becomes source ids) within the limits on sentences and source tokens (413 naming the limit),
its CPU work off the event loop, queued on its model's batcher, awaited, dropped from the queue if the client
leaves first, and counted; each API then finishes the units' hypotheses with runtime/texts.py finish_texts in
its own answer."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request

from pipeline.serve.batcher import BatcherStopped, QueueFull, Work
from pipeline.serve.http import ApiError, client_gone, off_loop, too_many
from pipeline.serve.metrics import ModelMetrics
from pipeline.serve.options import RequestLimits
from pipeline.serve.state import ServedModel, ServerState
from runtime.decoding import DecodingOptions
from runtime.errors import RuntimeUserError
from runtime.glossary import Glossary
from runtime.languages import ONE_PAIR, Direction
from runtime.texts import EncodedTexts, Listed, TextPolicy, TooManyUnits, encode_texts
from runtime.translate import NBest, SourceTooLong


@dataclass
class TranslateRequest:
    """What either API asks of one model: its texts and how to translate them."""

    text: list[str]
    model: ServedModel
    decoding: DecodingOptions
    structured: bool
    split: str
    lang: str
    stream: bool
    way: Direction = ONE_PAIR  # a multilingual model's source -> target (LibreTranslate's API); none for one pair
    format: str = "text"  # "html": each text an HTML document (LibreTranslate's API)
    glossary: Glossary | None = None  # "glossary": its terms forced into the translations, listed in the answer
    names: list[str] | None = None  # each text as a refusal names it (LibreTranslate's q[3]); text[k] without
    soft_breaks: bool = False  # texts taken out of markup (a file's): a line break is a space (TextPolicy's)


def encode(req: TranslateRequest, limits: RequestLimits) -> EncodedTexts:
    """The request's texts through the text service (runtime/texts.py): its lines, or with split its
    documents' sentences (with html its text nodes'), as source ids within the limits on sentences and source
    tokens (413 naming the limit; sentences are counted before the tokenizer's work). CPU work in proportion
    to the body: run off the event loop."""
    loaded = req.model.loaded
    policy = TextPolicy(req.model.long_lines, req.split, req.format, req.lang, req.way.prefix, req.way.same,
                        req.soft_breaks)
    try:
        encoded = encode_texts(loaded.tokenizer, req.text, int(loaded.backend.max_src_len), policy,
                               Listed(req.names or ()), limits.max_sentences, req.glossary)
    except TooManyUnits as e:
        raise ApiError(413, too_many(e.count, "sentences", limits.max_sentences, "--max-sentences") if e.counted else
                       f"more than {limits.max_sentences} sentences, this server's limit per request "
                       "(--max-sentences); split the request") from None
    except SourceTooLong as e:  # the long line named as the request has it, without the CLI's fix
        raise ApiError(413, f"{e.what}; split the line") from None
    except RuntimeUserError as e:  # a glossary's term this model cannot take, found in a text
        raise ApiError(400, str(e)) from None
    if encoded.tokens > limits.max_source_tokens:
        raise ApiError(413, too_many(encoded.tokens, "source tokens", limits.max_source_tokens,
                                     "--max-source-tokens"))
    return encoded


def busy(message: str, state: ServerState) -> ApiError:
    return ApiError(503, message, {"Retry-After": str(state.limits.retry_after_s)})


async def submit(req: TranslateRequest, state: ServerState) -> tuple[Work, EncodedTexts]:
    """The request encoded by the text service (its sentences, with split; with a glossary, each one's terms)
    within the limits and queued on its model's batcher."""
    model = req.model
    encoded = await off_loop(state.prepare, encode, req, state.limits)
    if encoded.tokens == 0:  # blank lines only: nothing for the model
        return Work.finished([[] for _ in encoded.ids], req.decoding), encoded
    assert model.batcher is not None
    try:
        return model.batcher.submit(encoded.ids, req.decoding, req.way.first, encoded.constraints), encoded
    except QueueFull as e:  # each model has its queue: with several, the busy one named
        which = f"model {model.name!r}: " if len(state.models) > 1 else ""
        raise busy(f"server busy: {which}{e}; retry later", state) from None
    except BatcherStopped as e:
        raise busy(f"{e}; retry later", state) from None


async def wait(work: Work, n: int, state: ServerState) -> None:
    """Until the first n lines of the work are translated (503 if the server stopped first). It lets
    the event loop run the others first, even when they are: a long stream of lines translated already
    holds no one."""
    await asyncio.sleep(0)
    try:
        await work.ready(n)
    except BatcherStopped as e:
        raise busy(str(e), state) from None


async def translated(request: Request, reqs: list[TranslateRequest], state: ServerState
                     ) -> list[tuple[EncodedTexts, list[NBest]]]:
    """Every request translated, each on its own model's queue at once (one client's texts may go to
    several models); all the work is dropped if the client leaves first (ClientDisconnect)."""
    submitted: list[tuple[TranslateRequest, Work, EncodedTexts]] = []
    waiter: asyncio.Future[Any] | None = None
    try:
        for req in reqs:
            work, encoded = await submit(req, state)
            submitted.append((req, work, encoded))
        waiter = asyncio.ensure_future(
            asyncio.gather(*(wait(work, len(encoded.ids), state) for _, work, encoded in submitted)))
        watcher: asyncio.Future[Any] = asyncio.ensure_future(client_gone(request))
        try:
            await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not waiter.done():  # cancelled below: a cancelled gather holds its CancelledError as an exception,
            # retrieved there, or asyncio logs "_GatheringFuture exception was never retrieved" with a traceback
            raise ClientDisconnect()
        waiter.result()  # its ApiError, if any
    except BaseException:  # a client that left, a refusal, or this task cancelled
        if waiter is not None and not waiter.done():
            waiter.cancel()
            waiter.add_done_callback(_retrieve)
        for req, work, _ in submitted:
            if not work.future.done():
                req.model.batcher.drop(work)  # type: ignore[union-attr]
        raise
    for req, work, encoded in submitted:
        count(req.model.metrics, encoded, work.results)
    return [(encoded, work.results) for _, work, encoded in submitted]


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def count(m: ModelMetrics, encoded: EncodedTexts, results: list[NBest]) -> None:
    m.sentences.inc(len(encoded.ids))
    m.src_tokens.inc(encoded.tokens)
    m.truncated.inc(encoded.texts_cut)
    m.tgt_tokens.inc(sum(len(nbest[0][0]) + 1 for nbest in results if nbest))

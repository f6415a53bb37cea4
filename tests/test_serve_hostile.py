"""`pipeline serve` against hostile requests, in-process (starlette's TestClient) over a stand-in
model, so each case runs in milliseconds: a request's CPU work never holds the event loop (/health
answers while a large body is parsed or split), one request is bounded in sentences and source tokens
(413 naming the option), a big request takes turns with the others (one behind it waits about one
batch), and JSON no parser could read is the client's mistake (400, one line, no traceback)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")
pytest.importorskip("sentencex")

from starlette.testclient import TestClient  # noqa: E402

from pipeline.serve import http, service  # noqa: E402
from pipeline.serve.app import create_app  # noqa: E402
from pipeline.serve.batcher import Batcher  # noqa: E402
from pipeline.serve.metrics import Metrics  # noqa: E402
from pipeline.serve.options import RequestLimits  # noqa: E402
from pipeline.serve.state import ServedModel, ServerState  # noqa: E402
from runtime.decoding import PAPER  # noqa: E402
from runtime.model_dir import Loaded  # noqa: E402

EOS = 2


class CharTokenizer:
    """Each character one piece (its code point + 3), then EOS; decoding upper-cases, which is the
    stand-in model's 'translation'."""

    def encode_source(self, texts: list[str]) -> list[list[int]]:
        return [[ord(c) + 3 for c in text] + [EOS] for text in texts]

    def decode(self, ids: list[list[int]]) -> list[str]:
        return ["".join(chr(i - 3) for i in seq if i > EOS).upper() for seq in ids]

    def source_cut(self, text: str, pieces: int) -> int:
        """Where the first `pieces` pieces end: one a character."""
        return min(len(text), max(pieces, 0))


class StandIn(Loaded):
    """A loaded model dir as serve holds one (the text service's encoding, splitting and formatting run for real)
    over CharTokenizer and a search that copies the source; each batch is recorded, and takes `delay` seconds;
    `parallel_batches` as a backend's (how many batches the batcher runs at once)."""

    def __init__(self, delay: float = 0.0, max_src_len: int = 1000, parallel_batches: int = 1):
        backend = SimpleNamespace(max_src_len=max_src_len, name="stand-in", device="cpu",
                                  parallel_batches=parallel_batches)
        super().__init__(SimpleNamespace(tokenizer=CharTokenizer(), manifest=None), backend, PAPER)  # type: ignore[arg-type]
        self.delay = delay
        self.batches: list[list[list[int]]] = []

    def translate(self, ids: list[list[int]], decoding: Any, **_: Any) -> list[Any]:  # type: ignore[override]
        self.batches.append(ids)
        time.sleep(self.delay)
        return [[(src[:-1], -1.0)] if src else [] for src in ids]


@contextmanager
def client(translator: Loaded | None = None, nbest: int = 1, **limits: Any) -> Iterator[TestClient]:
    """The real app serving the stand-in as model "m" (`pipeline serve --nbest N`), started (its batcher runs)
    and stopped."""
    metrics, request_limits = Metrics(), RequestLimits(**limits)
    decoding = PAPER.replace(batch_tokens=request_limits.max_batch_tokens, nbest=nbest)
    model = ServedModel("m", translator or StandIn(), decoding, 16, "en", {}, metrics.model("m"))
    state = ServerState({"m": model}, request_limits, {}, metrics, warmed_up=True)
    with TestClient(create_app(state)) as c:
        yield c


def test_the_stand_in_answers_lines_and_documents():
    with client() as c:
        r = c.post("/translate", json={"text": ["der hund", "", "die katze"]})
        assert r.json() == {"translations": ["DER HUND", "", "DIE KATZE"]}
        r = c.post("/translate", json={"text": ["Der Hund.  Die Katze!\n ja"], "split": "sentences"})
        assert r.json() == {"translations": ["DER HUND.  DIE KATZE!\n JA"]}


# -- 1. a request's CPU work runs off the event loop -----------------------------------------------


@pytest.mark.parametrize("stage", ["parse", "split"])
def test_health_answers_while_a_large_request_is_prepared(stage, monkeypatch):
    """The request's JSON parsing or sentence splitting is held (as a large body's would take time)
    until /health has answered: on the event loop it would hold /health too, for ever."""
    started, release = threading.Event(), threading.Event()
    released: list[bool] = []

    def hold() -> None:
        started.set()
        released.append(release.wait(10))

    loads = json.loads

    def slow_loads(text: str, **kw: Any) -> Any:
        if stage == "parse" and "HOLD" in text:
            hold()
        return loads(text, **kw)

    encode_texts = service.encode_texts

    def slow_encode(*args: Any, **kw: Any) -> Any:  # the text service splits, then tokenizes
        if stage == "split":
            hold()
        return encode_texts(*args, **kw)

    monkeypatch.setattr(http, "json", SimpleNamespace(loads=slow_loads, JSONDecodeError=json.JSONDecodeError))
    monkeypatch.setattr(service, "encode_texts", slow_encode)
    with client() as c:
        answer: list[Any] = []
        big = threading.Thread(target=lambda: answer.append(
            c.post("/translate", json={"text": ["HOLD. Der Hund."], "split": "sentences"})))
        big.start()
        assert started.wait(10)
        assert c.get("/health").status_code == 200
        release.set()
        big.join(20)
    assert released == [True], f"/health waited for the request's {stage}"
    assert answer[0].json() == {"translations": ["HOLD. DER HUND."]}


# -- 2. one request is bounded, and takes turns ----------------------------------------------------


def test_sentences_over_the_limit_are_413_naming_the_option():
    with client(max_sentences=100) as c:
        r = c.post("/translate", json={"text": ["Ja. " * 101], "split": "sentences"})
        assert r.status_code == 413
        assert r.json()["error"] == ("more than 100 sentences, this server's limit per request "
                                     "(--max-sentences); split the request")
        assert c.post("/translate", json={"text": ["Ja. " * 100], "split": "sentences"}).status_code == 200
        r = c.post("/translate", json={"text": ["ja"] * 101})  # without split, each line is a sentence
        assert r.status_code == 413 and "--max-sentences" in r.json()["error"]


def test_source_tokens_over_the_limit_are_413_naming_the_option():
    with client(max_source_tokens=100) as c:
        r = c.post("/translate", json={"text": ["x" * 60, "y" * 60]})  # 61 + 61 tokens with EOS
        assert r.status_code == 413
        assert r.json()["error"] == ("122 source tokens, more than this server's limit of 100 per request "
                                     "(--max-source-tokens); split the request")
        assert c.post("/translate", json={"text": ["x" * 60]}).status_code == 200
        info = c.post("/translate", json={"text": ["ja"] * 2000})
        assert info.status_code == 413 and "--max-lines" in info.json()["error"]


def run_batcher(translator: StandIn, budget: int, scenario: Any) -> Any:
    """scenario(batcher, decoding) on a started Batcher of the stand-in (beam 1: a line's cost is its
    length), in a fresh event loop."""
    async def main() -> Any:
        batcher = Batcher(translator, Metrics().model("m"), budget, max_wait_s=0.0, max_queue=16)
        await batcher.start()
        try:
            return await scenario(batcher, PAPER.replace(beam_size=1, nbest=1))
        finally:
            await batcher.stop()

    return asyncio.run(main())


def test_a_request_behind_a_big_one_waits_about_one_batch():
    """A big request of 50 batches is being translated when a one-line request arrives: the small one
    is in the next batch or the one after (not behind all 50), and both get every line, in order."""
    big_lines = [[10 + i % 50, EOS] for i in range(200)]  # 4 lines of cost 2 per batch of budget 8

    async def scenario(batcher: Batcher, decoding: Any) -> tuple[int, int, list[Any]]:
        big = batcher.submit(big_lines, decoding)
        while not translator.batches:
            await asyncio.sleep(0.001)
        arrived = len(translator.batches)  # batches started when the small request arrives
        small = batcher.submit([[7, EOS]], decoding)
        assert await small.future == [[([7], -1.0)]]
        answered = next(i for i, batch in enumerate(translator.batches) if [7, EOS] in batch)
        assert not big.future.done()
        return arrived, answered, await big.future

    translator = StandIn(delay=0.005)
    arrived, answered, results = run_batcher(translator, 8, scenario)
    assert answered - arrived <= 1, f"the small request waited {answered - arrived + 1} batches of the big one"
    assert results == [[(line[:-1], -1.0)] for line in big_lines]


def test_requests_cut_by_the_budget_keep_their_place():
    """Small requests are batched in arrival order: one cut short by the budget (before it has had a
    budget's worth) is finished first in the next batch."""
    async def scenario(batcher: Batcher, decoding: Any) -> list[Any]:
        works = [batcher.submit([[10 + r, EOS]] * 3, decoding) for r in range(4)]  # 3 lines of cost 2 each
        return [await w.future for w in works]

    translator = StandIn()
    results = run_batcher(translator, 8, scenario)
    assert [[line[0] - 10 for line in batch] for batch in translator.batches] == [[0, 0, 0, 1], [1, 1, 2, 2],
                                                                                   [2, 3, 3, 3]]
    assert results == [[[([10 + r], -1.0)]] * 3 for r in range(4)]


def test_a_draining_batcher_finishes_the_oldest_request_first():
    """On SIGTERM the queued requests took turns as before, each left partly translated when --grace-s ran out (60
    of 60 were 503s): draining, the oldest is finished first, so the grace period answers as many as it can."""
    first, second = [[10, EOS]] * 40, [[20, EOS]] * 40  # 10 batches each of budget 8

    async def scenario(batcher: Batcher, decoding: Any) -> list[Any]:
        older = batcher.submit(first, decoding)
        newer = batcher.submit(second, decoding)
        while len(translator.batches) < 4:  # turns taken: both have lines done
            await asyncio.sleep(0.001)
        batcher.drain()
        started = len(translator.batches) + 1  # the batch in flight, collected before the drain, aside
        await older.future
        done_when = len(translator.batches)
        await newer.future
        return [started, done_when]

    translator = StandIn(delay=0.005)
    started, done_when = run_batcher(translator, 8, scenario)
    assert {line[0] for batch in translator.batches[:4] for line in batch} == {10, 20}  # they took turns
    after = [line[0] for batch in translator.batches[started:done_when] for line in batch]
    assert set(after) == {10}, after  # then the older alone, to its end


class SideBySide(StandIn):
    """A stand-in backend that decodes two batches at once, as onnxruntime on a CPU does: the batches in flight
    counted, and the first batch taking longer than the others, so that later ones end before it."""

    def __init__(self) -> None:
        super().__init__(parallel_batches=2)
        self.lock = threading.Lock()
        self.in_flight = self.most_in_flight = 0
        self.ended: list[list[list[int]]] = []

    def translate(self, ids: list[list[int]], decoding: Any, **_: Any) -> list[Any]:  # type: ignore[override]
        with self.lock:
            self.batches.append(ids)
            first = len(self.batches) == 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        time.sleep(0.5 if first else 0.01)
        with self.lock:
            self.in_flight -= 1
            self.ended.append(ids)
        return [[(src[:-1], -1.0)] if src else [] for src in ids]


def test_two_batches_at_once_and_each_request_gets_its_lines_in_order():
    """A backend that decodes two batches at once (parallel_batches 2) gets two at once from the batcher, never
    more: while a request's first batch runs on, its later ones end on the other thread, yet none of its lines is
    handed out before the earlier ones (ready(n) waits for the first n), and a request that arrives meanwhile is
    answered before the slow batch ends. Then every line, in order."""
    big_lines = [[10 + i, EOS] for i in range(8)]  # 2 lines of cost 2 per batch of budget 4: 4 batches

    async def scenario(batcher: Batcher, decoding: Any) -> tuple[list[Any], list[Any], bool, list[Any]]:
        big = batcher.submit(big_lines, decoding)
        while not translator.ended:  # a later batch has ended; the first, slow one runs on
            await asyncio.sleep(0.001)
        held_back = list(big.results)
        small = await batcher.submit([[7, EOS]], decoding).future
        slow_running = translator.batches[0] not in translator.ended
        return held_back, small, slow_running, await big.future

    translator = SideBySide()
    held_back, small, slow_running, results = run_batcher(translator, 4, scenario)
    assert translator.most_in_flight == 2
    assert held_back == [] and translator.ended[-1] == translator.batches[0]
    assert small == [[([7], -1.0)]] and slow_running
    assert results == [[(line[:-1], -1.0)] for line in big_lines]


def test_a_streamed_big_request_and_a_small_one_each_get_their_answer():
    """Through the app: the big request streams every sentence in order while turns let the small
    one through; both answers are complete. Each batch takes 50 ms, so that the small request's own preparation
    (on the prepare threads) fits well within one batch whatever the machine's load."""
    translator = StandIn(delay=0.05)
    big_text = " ".join(f"Satz {i}." for i in range(60))
    with client(translator, max_batch_tokens=60) as c:
        objects: list[Any] = []

        def stream() -> None:
            with c.stream("POST", "/translate", json={"text": [big_text], "split": "sentences", "stream": True,
                                                      "beam_size": 1}) as r:
                objects.extend(json.loads(line) for line in r.iter_lines() if line)

        big = threading.Thread(target=stream)
        big.start()
        while not translator.batches:
            time.sleep(0.001)
        arrived = len(translator.batches)
        small = c.post("/translate", json={"text": ["ein kind"], "beam_size": 1})
        big.join(30)
    assert small.json() == {"translations": ["EIN KIND"]}
    answered = next(i for i, batch in enumerate(translator.batches) if CharTokenizer().encode_source(["ein kind"])[0]
                    in batch)
    assert answered - arrived <= 2 and len(translator.batches) - answered > 3
    assert [o["sentence"] for o in objects] == list(range(60))
    assert "".join(o["translation"] for o in objects) == big_text.upper()


def waiting_batcher(translator: StandIn, scenario: Any, in_flight: list[int]) -> Any:
    """run_batcher's, but waiting up to 60 s for company, and told the server's requests in flight (in_flight[0])."""
    async def main() -> Any:
        batcher = Batcher(translator, Metrics().model("m"), 1000, max_wait_s=60.0, max_queue=16,
                          in_flight=lambda: in_flight[0])
        await batcher.start()
        try:
            return await asyncio.wait_for(scenario(batcher, PAPER.replace(beam_size=1, nbest=1)), 20)
        finally:
            await batcher.stop()

    return asyncio.run(main())


def test_a_lone_request_starts_at_once_and_company_on_its_way_is_waited_for():
    """The batcher waits for company only while another request is on its way (in flight, not yet queued): a
    lone request starts at once whatever --max-wait-ms; of two in flight, the first waits for the second and
    both go in one batch; when the second leaves the server instead (nudge), the first starts then."""
    async def lone(batcher: Batcher, decoding: Any) -> Any:
        return await batcher.submit([[7, EOS]], decoding).future

    translator = StandIn()
    assert waiting_batcher(translator, lone, [1]) == [[([7], -1.0)]]  # not 60 s later (wait_for's 20 s)

    in_flight = [2]

    async def pair(batcher: Batcher, decoding: Any) -> Any:
        first = batcher.submit([[7, EOS]], decoding)
        await asyncio.sleep(0.2)
        started_alone = bool(translator.batches)
        second = batcher.submit([[8, EOS]], decoding)
        return started_alone, await first.future, await second.future

    translator = StandIn()
    assert waiting_batcher(translator, pair, in_flight) == (False, [[([7], -1.0)]], [[([8], -1.0)]])
    assert translator.batches == [[[7, EOS], [8, EOS]]]

    async def left(batcher: Batcher, decoding: Any) -> Any:
        first = batcher.submit([[7, EOS]], decoding)
        await asyncio.sleep(0.2)
        waited = not translator.batches
        in_flight[0] = 1  # the other request was refused before it was queued
        batcher.nudge()
        return waited, await first.future

    translator = StandIn()
    assert waiting_batcher(translator, left, in_flight) == (True, [[([7], -1.0)]])


def test_the_app_counts_its_requests_in_flight():
    """Through the app, with --max-wait-ms of ten minutes: a lone client's requests are answered at once (the
    route counts itself in flight, the batcher sees it queued), counted while translated (a stream until its last
    line is sent, though its route has returned), and the count is back to 0 after each."""
    class Counting(StandIn):
        def translate(self, ids: list[list[int]], decoding: Any, **_: Any) -> list[Any]:  # type: ignore[override]
            seen.append(state.in_flight)
            return super().translate(ids, decoding)

    seen: list[int] = []
    with client(Counting(), max_wait_ms=600_000) as c:
        state = c.app.state.server  # type: ignore[attr-defined]
        answers: list[Any] = []
        asker = threading.Thread(target=lambda: answers.extend(
            c.post("/translate", json={"text": [text], "stream": text == "doch"}).text for text in ("ja", "doch")))
        asker.start()
        asker.join(30)
        assert [json.loads(a) for a in answers] == [{"translations": ["JA"]}, {"index": 0, "translation": "DOCH"}]
        assert state.in_flight == 0
    assert seen == [1, 1]  # each request counted while it was translated, a streamed one until its stream ends


# -- 3. JSON the parser cannot read is the client's mistake -----------------------------------------


@pytest.mark.parametrize("body, says", [
    pytest.param(b"[" * 100_000, "nested too deeply", id="100000 levels of nesting"),
    pytest.param(b'{"text": ["a"], "beam_size": ' + b"9" * 5000 + b"}", "digits", id="a 5000-digit integer"),
])
def test_unreadable_json_is_400_in_one_line_without_a_traceback(body, says, caplog):
    """Python's parser raises RecursionError on deep nesting and ValueError past its int-string limit:
    the request is wrong and retrying it cannot help, so no 503 / Retry-After and nothing logged."""
    with caplog.at_level(logging.INFO), client() as c:
        r = c.post("/translate", content=body, headers={"content-type": "application/json"})
        assert c.post("/translate", json={"text": ["ja"]}).json() == {"translations": ["JA"]}
    assert r.status_code == 400 and "retry-after" not in r.headers
    error = r.json()["error"]
    assert says in error and "\n" not in error and "set_int_max_str_digits" not in error
    assert not [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.WARNING]



def test_a_sentence_without_letters_reaches_no_model_on_any_api():
    """ "kipi tava\\n123" came back with words invented for "123" (the native API split into sentences, its
    stream, and LibreTranslate's /translate: test_serve_bounds.py); such a sentence is copied, never sent."""
    stand_in = StandIn()
    with client(stand_in) as c:
        doc = "Der Hund.\n123\n2024-01-01"
        r = c.post("/translate", json={"text": [doc], "split": "sentences"})
        assert r.json() == {"translations": ["DER HUND.\n123\n2024-01-01"]}
        lines = c.post("/translate", json={"text": [doc], "split": "sentences", "stream": True}).text.splitlines()
        assert [json.loads(line)["translation"] for line in lines] == ["DER HUND.\n", "123\n", "2024-01-01"]
    sent = [ids for batch in stand_in.batches for ids in batch if ids]
    assert len(sent) == 2 and all(len(ids) == len("Der Hund.") + 1 for ids in sent)  # EOS


def test_a_min_len_no_translation_can_meet_is_warned_at_start(fp32_dir, caplog):
    """serve --min-len 100000 started and answered without a word (serve-batch warns of each such line)."""
    from pipeline.serve.options import ServeHttpOptions
    from pipeline.serve.runner import load_model

    with caplog.at_level(logging.WARNING, logger="pipeline.serve.runner"):
        model = load_model("m", str(fp32_dir), ServeHttpOptions(), PAPER.replace(min_len=100_000), Metrics())
    limit = model.loaded.manifest.limits.max_tgt_len
    assert f"model m: --min-len 100000 is above the longest output the model dir allows ({limit - 1} tokens)" \
        in caplog.text

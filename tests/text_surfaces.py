"""Every surface's answers for one set of inputs, as JSON: serve-batch (its files path), the native HTTP API
and LibreTranslate's (an app in this process, starlette's TestClient), and the Ray / Spark Translator, on plain
lines with blanks and a long one, n-best, documents, HTML and, given a multilingual model dir, its languages;
refusals of long lines too. tests/test_text_service.py runs it with an older commit's tree and with this one
and compares:

    PYTHONPATH=TREE python tests/text_surfaces.py MODEL_DIR OUT.json [M2M_DIR]

It uses only the entry points both trees have."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from runtime.decoding import PAPER
from runtime.model_dir import LoadOptions, load

SHORT = PAPER.replace(max_len_a=0, max_len_b=8)  # the random model would write up to its limit
LOAD = LoadOptions(backend="onnxruntime", threads=1)
LONG = " ".join(["der hund sieht die katze"] * 12)  # 60 words: over the trained model's 48-token source limit
# a document's sentence over the limit is cut into sentences that fit since the tree before (its line was
# truncated): documents hold the longest sentence that fits, and a long one only where it is refused (_error)
FITS = " ".join(["der hund sieht die katze"] * 3)
PLAIN = ["der hund sieht", "", "   \t", "die katze hat ein kind", LONG, "eine frau sieht", "mann"]
PLAIN_DOCS = [FITS if line == LONG else line for line in PLAIN]  # LibreTranslate's texts are documents
DOCS = ["der hund sieht. die katze hat?  ein kind", "", "  \n ", "rot blau!\ngross klein. das kind",
        f"eine frau. {FITS}. der mann", "katze"]
HTML = ["<p>der hund sieht. <b>die katze</b> hat &amp; ein kind</p>", "", "<br>",
        "<p title='der hund'>rot &eacute; blau<code>der hund</code> gross &#233; klein</p>",
        "no tags here. der mann sieht", "<!-- die katze --><div translate=\"no\">der hund</div><i>das kind</i>",
        f"<ul><li>eine frau</li><li>{FITS}</li></ul>"]


def _clean(value: Any) -> Any:
    """JSON-safe: NaN as a string, numpy scalars and arrays as Python's."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _attempt(fn: Any) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a refusal is an answer to pin too
        return {"raised": type(e).__name__, "message": str(e)}


def serve_batch(model_dir: str, cases: dict[str, tuple[list[str], dict[str, Any]]]) -> dict[str, Any]:
    from pipeline.serve_batch.translation import ServeBatchOptions

    out: dict[str, Any] = {}
    loaded = {}
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # refusals name the file as given: the same relative name in every run
        for name, (lines, options) in cases.items():
            decoding = SHORT.replace(**options.pop("decoding", {}))
            key = decoding.nbest
            if key not in loaded:
                loaded[key] = load(model_dir, LOAD, decoding)
            src, dst = Path(f"{name}.src"), Path(f"{name}.out")
            src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
            opts = ServeBatchOptions(decoding=loaded[key].decoding, **options)
            out[name] = _attempt(functools.partial(_files, loaded[key], src, dst, opts))
        os.chdir(here)
    return out


def _files(loaded: Any, src: Path, dst: Path, opts: Any) -> Any:
    from pipeline.serve_batch.files import serve_files

    stats = serve_files(loaded.backend, loaded.tokenizer, [str(src)], [str(dst)], opts, progress=False)
    counts = {k: getattr(stats, k) for k in ("sentences", "empty", "truncated", "src_tokens", "tgt_tokens",
                                             "min_len_over")}
    return {"lines": dst.read_text(encoding="utf-8").split("\n"), "stats": counts}


def http(model_dir: str, name: str, requests: dict[str, dict[str, Any]], long_lines: str = "truncate"
         ) -> dict[str, Any]:
    from starlette.testclient import TestClient

    from pipeline.serve.app import create_app
    from pipeline.serve.metrics import Metrics
    from pipeline.serve.options import RequestLimits, ServeHttpOptions
    from pipeline.serve.runner import load_model

    try:
        from pipeline.serve.state import ServerState
    except ImportError:  # the tree before serve/ was laid out per API (issue 59)
        from pipeline.serve.requests import ServerState  # type: ignore[no-redef]

    metrics, limits = Metrics(), RequestLimits()
    opts = ServeHttpOptions(load=LOAD, long_lines=long_lines)
    model = load_model(name, model_dir, opts, SHORT.replace(batch_tokens=limits.max_batch_tokens), metrics)
    state = ServerState({name: model}, limits, {}, metrics, warmed_up=True)
    out: dict[str, Any] = {}
    with TestClient(create_app(state)) as client:
        for key, body in requests.items():
            r = client.post("/translate", json=body)
            out[key] = {"status": r.status_code, "body": r.text}
        out["metrics"] = [line for line in client.get("/metrics").text.splitlines()
                          if line.startswith(("pipeline_sentences_total", "pipeline_source_tokens_total",
                                              "pipeline_truncated_lines_total", "pipeline_target_tokens_total"))]
    return out


def rows(model_dir: str, cases: dict[str, tuple[list[str], dict[str, Any], list[int]]]) -> dict[str, Any]:
    from pipeline.integrations import Translator
    from pipeline.serve_batch.translation import ServeBatchOptions

    out: dict[str, Any] = {}
    for name, (lines, options, sizes) in cases.items():
        decoding = SHORT.replace(**options.pop("decoding", {}))
        origins = options.pop("origins", False)
        translator = Translator(model_dir, column="src", load_options=LOAD, decoding=decoding,
                                options=ServeBatchOptions(**options),
                                origin_columns=("path", "line") if origins else None)
        out[name] = _attempt(functools.partial(_batches, translator, lines, sizes))
    return out


def _batches(translator: Any, lines: list[str], sizes: list[int]) -> Any:
    """The rows in batches of `sizes`, each row named shard.txt:11, :12, ... (the origin columns)."""
    got: dict[str, list[Any]] = {}
    start = 0
    for size in sizes:
        batch = {"src": lines[start:start + size], "path": ["shard.txt"] * size,
                 "line": list(range(start + 11, start + 11 + size))}
        for column, values in translator(batch).items():
            if column not in ("src", "path", "line"):
                got.setdefault(column, []).extend(_clean(values))
        start += size
    return got


def one_pair(model_dir: str) -> dict[str, Any]:
    nbest2 = {"nbest": 2, "beam_size": 2, "explicit": frozenset({"nbest", "beam_size"})}
    long_doc = ["der hund", f"ein kind. {LONG}"]
    long_html = ["<p>der hund</p>", f"<p>ein kind. <b>{LONG}</b></p>"]
    batch = {
        "plain": (PLAIN, {}), "nbest": (PLAIN, {"decoding": nbest2}),
        "sentences": (DOCS, {"split": "sentences"}), "html": (HTML, {"format": "html"}),
        "plain_error": (PLAIN, {"long_lines": "error"}),
        "sentences_error": (long_doc, {"split": "sentences", "long_lines": "error"}),
        "html_error": (long_html, {"format": "html", "long_lines": "error"}),
    }
    native = {
        "plain": {"text": PLAIN}, "scores": {"text": PLAIN, "scores": True},
        "nbest": {"text": PLAIN, "nbest": 2, "beam_size": 2}, "sentences": {"text": DOCS, "split": "sentences"},
        "sentences_lang": {"text": DOCS, "split": "sentences", "lang": "en"},
        "stream": {"text": PLAIN, "stream": True}, "stream_nbest": {"text": PLAIN, "stream": True, "nbest": 2},
        "stream_sentences": {"text": DOCS, "split": "sentences", "stream": True},
    }
    libre = {
        "one": {"q": DOCS[0], "source": "de", "target": "en"},
        "list": {"q": PLAIN_DOCS + DOCS, "source": "de", "target": "en"},
        "alternatives": {"q": PLAIN_DOCS + DOCS, "source": "de", "target": "en", "alternatives": 2},
        "html": {"q": HTML, "source": "de", "target": "en", "format": "html"},
        "html_alternatives": {"q": HTML, "source": "de", "target": "en", "format": "html", "alternatives": 1},
        "same_language": {"q": ["der hund", "123"], "source": "en", "target": "en"},
    }
    refused = {
        "plain": {"text": PLAIN}, "sentences": {"text": long_doc, "split": "sentences"},
        "libre": {"q": long_doc, "source": "de", "target": "en"},
        "libre_html": {"q": long_html, "source": "de", "target": "en", "format": "html"},
    }
    nbest2_rows = {"nbest": 2, "beam_size": 2, "explicit": frozenset({"nbest", "beam_size"})}
    ray = {
        "plain": (PLAIN, {}, [3, 4]), "nbest": (PLAIN, {"decoding": nbest2_rows}, [7]),
        "sentences": (DOCS, {"split": "sentences"}, [2, 4]), "html": (HTML, {"format": "html"}, [1, 6]),
        "plain_error": (PLAIN, {"long_lines": "error"}, [7]),
        "plain_error_origins": (PLAIN, {"long_lines": "error", "origins": True}, [7]),
        "sentences_error": (long_doc, {"split": "sentences", "long_lines": "error"}, [2]),
        "sentences_error_origins": (long_doc, {"split": "sentences", "long_lines": "error", "origins": True}, [2]),
        "html_error": (long_html, {"format": "html", "long_lines": "error"}, [2]),
        "html_error_origins": (long_html, {"format": "html", "long_lines": "error", "origins": True}, [2]),
    }
    return {"serve_batch": serve_batch(model_dir, batch), "http": http(model_dir, "de-en", {**native, **libre}),
            "http_error": http(model_dir, "de-en", refused, long_lines="error"), "rows": rows(model_dir, ray)}


def multilingual(model_dir: str) -> dict[str, Any]:
    from pipeline.corpus.synthetic import generate

    en, de = generate(6, seed=4)
    docs = [f"{en[0]}. {en[1]}!", "", en[2], f"{en[3]}? {en[4]}"]
    lang = {"src_lang": "en", "tgt_lang": "de"}
    nbest2 = {"nbest": 2, "beam_size": 2, "explicit": frozenset({"nbest", "beam_size"})}
    batch = {"plain": (en, dict(lang)), "nbest": (en, {**lang, "decoding": nbest2}),
             "sentences": (docs, {**lang, "split": "sentences", "lang": "en"}),
             "back": (de, {"src_lang": "de", "tgt_lang": "en"})}
    requests = {"native": {"text": en, "source": "en", "target": "de"},
                "native_nbest": {"text": en, "source": "en", "target": "de", "nbest": 2, "beam_size": 2},
                "native_sentences": {"text": docs, "source": "en", "target": "de", "split": "sentences"},
                "libre": {"q": docs, "source": "en", "target": "de"},
                "libre_back": {"q": de, "source": "de", "target": "en", "alternatives": 1}}
    ray = {"plain": (en, dict(lang), [6]), "sentences": (docs, {**lang, "split": "sentences"}, [4])}
    return {"serve_batch": serve_batch(model_dir, batch), "http": http(model_dir, "m2m", requests),
            "rows": rows(model_dir, ray)}


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    result = {"one_pair": one_pair(model_dir)}
    if len(sys.argv) > 3:
        result["multilingual"] = multilingual(sys.argv[3])
    out.write_text(json.dumps(_clean(result), indent=1, ensure_ascii=False, default=str), encoding="utf-8")


if __name__ == "__main__":
    main()

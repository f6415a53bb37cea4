"""Profiled walks (issue 59's targets): which of our own functions and files run for one unit of work, counted
with sys.setprofile, not read off the code.

    python scripts/profile_walks.py [--json walks.json] [--walk libre --walk ray --walk m2m100]

Ours are the functions whose file is under model/, runtime/, export/ or pipeline/ of this checkout. Each walk
counts only during its unit of work, after a warm-up (the server started and one request answered; the
Translator built and one batch translated; the importer's modules imported), in every thread (the HTTP app's
event loop and its worker threads included):

    libre   one LibreTranslate POST /translate ({"q", "source", "target"}) through starlette's TestClient to
            `pipeline serve`'s app over a tiny random model dir exported here, and back;
    ray     one Ray Data batch (a dict of numpy arrays) through pipeline.integrations.translator.Translator, called
            directly (no Ray needed): from the call to the runtime and back;
    m2m100  `pipeline import m2m100 DIR --out X` of a tiny random M2M-100 directory (tests/m2m100_fixture.py),
            counting besides how many times each JSON file of DIR is opened (builtins.open, io.open, os.open),
            and by whom (our code or a library's).

Columns: our functions and files that ran; of those functions, the named ones (defs and methods; left out:
comprehensions, which Python 3.12 inlines into their function, generator expressions and lambdas); their calls
(a generator's every resumption counts); the functions (named) and files of them under pipeline/ (the
surface's own layer, above the runtime); and climbs: calls into pipeline/serve/ whose nearest calling frame of
ours is in runtime/ (the runtime calling back up into the HTTP layer). Then each walk's files with their function counts
and each climb; --json writes every function too. Needs the serve extra (libre), numpy (ray) and the import
extra (m2m100: transformers); a walk whose packages are missing is reported as skipped."""

from __future__ import annotations

import argparse
import builtins
import io
import json
import os
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OURS = tuple(str(ROOT / d) + os.sep for d in ("model", "runtime", "export", "pipeline"))
WALKS = ("libre", "ray", "m2m100")
UNNAMED = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>")  # unnamed code objects
TEXT = "Das ist ein kleiner Satz. Noch einer, etwas länger als der erste."


def ours(filename: str) -> str | None:
    """The repository-relative path of one of our files, else None."""
    return filename[len(str(ROOT)) + 1:] if filename.startswith(OURS) else None


class Walk:
    """Counts the calls of our functions while `counting()`, in every thread that has the profiler."""

    def __init__(self) -> None:
        self.active = False
        self.calls: Counter[tuple[str, int, str]] = Counter()
        self.climbs: Counter[str] = Counter()
        self.lock = threading.Lock()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.active or event != "call":
            return
        path = ours(frame.f_code.co_filename)
        if path is None:
            return
        code = frame.f_code
        key = (path, code.co_firstlineno, getattr(code, "co_qualname", code.co_name))
        climb = None
        if path.startswith("pipeline/serve/"):
            caller = frame.f_back
            while caller is not None and ours(caller.f_code.co_filename) is None:
                caller = caller.f_back
            if caller is not None and (ours(caller.f_code.co_filename) or "").startswith("runtime/"):
                climb = f"{ours(caller.f_code.co_filename)}:{caller.f_code.co_name} -> {path}:{code.co_name}"
        with self.lock:
            self.calls[key] += 1
            if climb:
                self.climbs[climb] += 1

    @contextmanager
    def counting(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def summary(self) -> dict[str, Any]:
        files = Counter(path for path, _, _ in self.calls)
        surface = [(path, name) for path, _, name in self.calls if path.startswith("pipeline/")]
        named = [name for _, _, name in self.calls if not name.endswith(UNNAMED)]
        return {"functions": len(self.calls), "named": len(named), "files": len(files),
                "calls": sum(self.calls.values()),
                "pipeline_functions": len(surface), "pipeline_files": len({path for path, _ in surface}),
                "pipeline_named": sum(1 for _, name in surface if not name.endswith(UNNAMED)),
                "climbs": sum(self.climbs.values()), "climb_edges": dict(self.climbs),
                "by_file": dict(sorted(files.items())),
                "function_list": [f"{p}:{line} {name} x{n}" for (p, line, name), n in sorted(self.calls.items())]}


@contextmanager
def profiled(walk: Walk) -> Iterator[None]:
    """The profiler in this thread and every thread started from now on."""
    sys.setprofile(walk)
    threading.setprofile(walk)
    try:
        yield
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def opener(frame: FrameType | None) -> str:
    """Whose code asked for the file: our function's name, or "library" (the standard library's frames, pathlib's,
    passed by)."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if ours(filename):
            return frame.f_code.co_name
        if "site-packages" in filename or "dist-packages" in filename:
            return "library"
        frame = frame.f_back
    return "library"


@contextmanager
def json_opens(directory: Path) -> Iterator[Counter[tuple[str, str]]]:
    """(file name, our function or "library") -> opens of the JSON files under `directory` while inside."""
    counts: Counter[tuple[str, str]] = Counter()
    where = str(directory.resolve())

    def note(path: Any) -> None:
        try:
            name = os.fspath(path)
        except TypeError:
            return  # a file descriptor
        name = name.decode() if isinstance(name, bytes) else name
        if name.endswith(".json") and os.path.abspath(name).startswith(where):
            counts[(os.path.basename(name), opener(sys._getframe(2)))] += 1

    originals = builtins.open, io.open, os.open

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def opened(file: Any, *args: Any, **kwargs: Any) -> Any:
            note(file)
            return original(file, *args, **kwargs)
        return opened

    builtins.open, io.open, os.open = wrap(originals[0]), wrap(originals[1]), wrap(originals[2])
    try:
        yield counts
    finally:
        builtins.open, io.open, os.open = originals


def tiny_model_dir(work: Path) -> Path:
    """A random `tiny` checkpoint over a 64-piece SentencePiece model, exported for ONNX Runtime (fp32)."""
    import torch

    from export.api import export_model
    from model import build_model, preset
    from model.checkpoint import save_checkpoint
    from pipeline.corpus.spm import train_sentencepiece
    from pipeline.corpus.synthetic import generate
    from runtime.tokenizer import Tokenizer

    src, tgt = generate(200, seed=0)
    spm_bytes = train_sentencepiece(src + tgt, vocab_size=64)
    torch.manual_seed(0)
    model = build_model(preset("tiny", vocab_size=Tokenizer(spm_bytes).vocab_size)).eval()
    save_checkpoint(work / "random.pt", model, spm_bytes)
    export_model(work / "random.pt", work / "model", tensorrt=False, max_batch=8, max_src_len=32, max_tgt_len=40,
                 max_beam=4)
    return work / "model"


def libre_walk(model_dir: Path) -> dict[str, Any]:
    from starlette.testclient import TestClient

    from pipeline.serve.app import create_app
    from pipeline.serve.metrics import Metrics
    from pipeline.serve.options import RequestLimits, ServeHttpOptions
    from pipeline.serve.runner import load_model
    from pipeline.serve.state import ServerState
    from runtime.decoding import PAPER
    from runtime.model_dir import LoadOptions

    metrics, limits = Metrics(), RequestLimits()
    opts = ServeHttpOptions(load=LoadOptions(backend="onnxruntime", threads=1))
    model = load_model("de-en", str(model_dir), opts, PAPER.replace(batch_tokens=limits.max_batch_tokens), metrics)
    state = ServerState({"de-en": model}, limits, {}, metrics, warmed_up=True)
    body = {"q": TEXT, "source": "de", "target": "en"}
    walk = Walk()
    with profiled(walk), TestClient(create_app(state)) as client:
        assert client.post("/translate", json=body).status_code == 200  # warm-up
        with walk.counting():
            answer = client.post("/translate", json=body)
    assert answer.status_code == 200, answer.text
    return walk.summary()


def ray_walk(model_dir: Path) -> dict[str, Any]:
    import numpy as np

    from pipeline.integrations.translator import Translator

    translator = Translator(model_dir)
    batch = {"text": np.array([TEXT, "Kurz.", ""], dtype=object)}
    translator(dict(batch))  # warm-up
    walk = Walk()
    with profiled(walk), walk.counting():
        out = translator(dict(batch))
    assert len(out["translation"]) == 3
    return walk.summary()


def m2m100_walk(work: Path) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    from m2m100_fixture import make_m2m100_dir

    import pipeline.importers.convert  # noqa: F401 (imported before counting: the walk, not the imports)
    import pipeline.importers.m2m100  # noqa: F401
    from pipeline.commands.import_model import import_group

    hf = make_m2m100_dir(work / "m2m100-hf", train_steps=0)
    import_group.main(["m2m100", str(hf), "--out", str(work / "warm.pt")], standalone_mode=False)  # warm-up
    walk = Walk()
    with json_opens(hf) as opens, profiled(walk), walk.counting():
        import_group.main(["m2m100", str(hf), "--out", str(work / "m2m100.pt")], standalone_mode=False)
    return {**walk.summary(), "json_opens": {f"{name} ({who})": n for (name, who), n in sorted(opens.items())}}


def table(results: dict[str, dict[str, Any]]) -> str:
    head = f"{'walk':<8} {'functions':>9} {'named':>6} {'files':>6} {'calls':>7} {'pipeline/':>16} {'climbs':>7}"
    rows = [head + "  JSON files opened (by which function of ours)"]
    for name, r in results.items():
        if "skipped" in r:
            rows.append(f"{name:<8} skipped: {r['skipped']}")
            continue
        opens = ", ".join(f"{k} x{n}" for k, n in r.get("json_opens", {}).items()) or "-"
        surface = f"{r['pipeline_functions']} ({r['pipeline_named']}) in {r['pipeline_files']}"
        rows.append(f"{name:<8} {r['functions']:>9} {r['named']:>6} {r['files']:>6} {r['calls']:>7} {surface:>16} "
                    f"{r['climbs']:>7}"
                    f"  {opens}")
    for name, r in results.items():
        if "by_file" in r:
            rows.append(f"\n{name}: " + ", ".join(f"{p} {n}" for p, n in r["by_file"].items()))
            rows += [f"  climb: {edge} x{n}" for edge, n in r["climb_edges"].items()]
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="also write every walk, with its functions, as JSON here")
    ap.add_argument("--walk", action="append", choices=WALKS, help="only these walks (repeatable) [default: all]")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="profile-walks-") as tmp:
        work = Path(tmp)
        wanted = args.walk or list(WALKS)
        model_dir = tiny_model_dir(work) if {"libre", "ray"} & set(wanted) else None
        for name in wanted:
            try:
                if name == "libre":
                    results[name] = libre_walk(model_dir)  # type: ignore[arg-type]
                elif name == "ray":
                    results[name] = ray_walk(model_dir)  # type: ignore[arg-type]
                else:
                    results[name] = m2m100_walk(work)
            except ImportError as e:
                results[name] = {"skipped": f"{e.name or e} is not installed"}
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

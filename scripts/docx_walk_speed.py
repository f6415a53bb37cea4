"""Reading and rebuilding a .docx: POST /translate_file's paragraph walker (zipfile + lxml,
pipeline/serve/archive_formats.py) against python-docx, on one made-up document, alternating.

    python scripts/docx_walk_speed.py [--paragraphs 3000] [--runs 3] [--rounds 3]

The document is made with python-docx: PARAGRAPHS paragraphs of RUNS runs each (bold every other run). Each side
reads every paragraph's text and writes a replacement into its first run, then saves the file; the best of the
rounds is printed in seconds, with their ratio."""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--paragraphs", type=int, default=3000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import docx

    from pipeline.serve.archive_formats import read_docx

    made = docx.Document()
    for k in range(args.paragraphs):
        p = made.add_paragraph()
        for r in range(args.runs):
            p.add_run(f"Satz {k} Teil {r} mit ein paar Worten. ").bold = r % 2 == 1
    buffer = io.BytesIO()
    made.save(buffer)
    data = buffer.getvalue()

    def ours() -> None:
        doc = read_docx(data)
        doc.rebuild([t.upper() for t in doc.texts])

    def theirs() -> None:
        d = docx.Document(io.BytesIO(data))
        for p in d.paragraphs:
            text = p.text
            if p.runs:
                p.runs[0].text = text.upper()
                for run in p.runs[1:]:
                    run.text = ""
        d.save(io.BytesIO())

    best = {"lxml walker": float("inf"), "python-docx": float("inf")}
    for _ in range(args.rounds):
        for name, fn in (("lxml walker", ours), ("python-docx", theirs)):
            started = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - started)
    print(f"{args.paragraphs} paragraphs x {args.runs} runs ({len(data) >> 10} KiB): " +
          ", ".join(f"{name} {s:.2f} s" for name, s in best.items()) +
          f"; python-docx / walker {best['python-docx'] / best['lxml walker']:.1f}x")


if __name__ == "__main__":
    main()

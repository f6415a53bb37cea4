#!/usr/bin/env python
"""CTranslate2 at 1 and 2 intra-op threads on one model dir, batch 1 and one batch of all lines (issue 62).

`pipeline bench --compare ctranslate2 --threads N` gives both engines N threads. On a virtual machine whose
second core is contended, CTranslate2's OpenMP threads can be far slower with 2 threads than with 1 (on
2026-11-28's KVM Xeon: batch 1 at 240 ms a sentence with 2, 17 ms with 1), which would flatter any engine
compared at 2 threads. Run this first and compare at the thread count where CTranslate2 is fastest.

    python scripts/ct2_threads.py MODEL_DIR FILE [--lines 24] [--beam-size 4] [--length 30]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import ctranslate2

    from pipeline.evaluation import ctranslate2_compare

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path)
    p.add_argument("file", type=Path)
    p.add_argument("--lines", type=int, default=24)
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--length", type=int, default=30, help="exactly this many target tokens per sentence")
    p.add_argument("--compute-type", default="int8")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ct2-threads-") as tmp:
        ct2_dir, _, tokenizer, _ = ctranslate2_compare.for_model_dir(a.model_dir, Path(tmp))
        lines = [x for x in a.file.read_text(encoding="utf-8").splitlines() if x.strip()][: a.lines]
        pieces = ctranslate2_compare.id_pieces(ct2_dir, tokenizer)
        src = [[pieces[i] for i in ids] for ids in tokenizer.encode_source(lines)]  # pieces + EOS, by id
        fixed = dict(beam_size=a.beam_size, max_decoding_length=a.length, min_decoding_length=a.length)
        for threads in (1, 2, 1, 2):
            tr = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type=a.compute_type, intra_threads=threads)
            tr.translate_batch(src[:2], **fixed)  # warm-up
            start = time.perf_counter()
            for s in src:
                tr.translate_batch([s], **fixed)
            one = (time.perf_counter() - start) / len(src)
            start = time.perf_counter()
            tr.translate_batch(src, max_batch_size=len(src), **fixed)
            batch = (time.perf_counter() - start) / len(src)
            print(f"CTranslate2 {a.compute_type}, {threads} thread(s): batch 1 {one * 1e3:.1f} ms/sentence, "
                  f"batch {len(src)} {batch * 1e3:.1f} ms/sentence", flush=True)


if __name__ == "__main__":
    main()

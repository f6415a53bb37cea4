#!/usr/bin/env python
"""Whole process at several `--batch-tokens` against CTranslate2, alternating rounds (issue 62).

`pipeline bench --whole-process` runs serve-batch at its default batch budget; this runs it at each
budget given, beside `pipeline bench`'s own CTranslate2 script on the same weights, every run a fresh
process, the engines in a different order each round. Ours runs under process_split.TIMED_SERVE_BATCH,
so each row also has the encoder's and the decoder's seconds and the number of decoder steps.

    python scripts/whole_process_batch_tokens.py MODEL_DIR FILE --batch-tokens 2048,4096,8192 \
        --ct2 int8 --rounds 3 --json out.json

A value BUDGET:N also caps a batch at N sentences (the loaded backend's max_batch set to N, which
length_batches honours), as CTranslate2's script batches 32 sentences whatever their length: `8192:32`.
Every sentence gets exactly --fixed-length target tokens in every engine. Compare ratios within one
run only (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Runs before process_split.TIMED_SERVE_BATCH, which then wraps this load: the backend's max_batch set to a cap.
CAPPED = """
import runtime.model_dir as _model_dir
_load = _model_dir.load
def _capped(*args, **kwargs):
    loaded = _load(*args, **kwargs)
    loaded.backend.max_batch = {cap}
    return loaded
_model_dir.load = _capped
"""
sys.path.insert(0, str(ROOT))


def main() -> None:
    from pipeline.evaluation import ctranslate2_compare
    from pipeline.evaluation.process_split import TIMED_SERVE_BATCH, pieces_summary, source_pieces
    from pipeline.evaluation.whole_process import CT2_SCRIPT, ours_command, run_timed, sentencepiece_files, user_env
    from runtime.model_dir import ModelDir

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path)
    p.add_argument("file", type=Path)
    p.add_argument("--batch-tokens", default="2048",
                   help="comma-separated serve-batch --batch-tokens values; BUDGET:N caps batches at N sentences too")
    p.add_argument("--ct2", default="int8", help="comma-separated CTranslate2 precisions (fp32, int8; '' for none)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--fixed-length", type=int, default=30)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="whole-bt-") as tmp_name:
        tmp = Path(tmp_name)
        out = tmp / "out.txt"
        engines: dict[str, list[str]] = {}
        for value in a.batch_tokens.split(","):
            bt, _, cap = value.partition(":")
            ours = ours_command(a.model_dir, a.file, out, a.threads, a.beam_size, a.fixed_length)
            code = (CAPPED.format(cap=int(cap)) if cap else "") + TIMED_SERVE_BATCH
            name = f"ours bt={int(bt)}" + (f" max {int(cap)}" if cap else "")
            engines[name] = [sys.executable, "-c", code, *ours[3:], "--batch-tokens", str(int(bt))]
        precisions = [x for x in a.ct2.split(",") if x]
        if precisions:
            ct2_dir, *_ = ctranslate2_compare.for_model_dir(a.model_dir, tmp / "ct2")
            spms = sentencepiece_files(ModelDir.open(a.model_dir, verify=False), tmp)
            for precision in precisions:  # alpha is moot at a fixed length; no language tokens
                engines[f"ct2 {precision}"] = [
                    sys.executable, "-c", CT2_SCRIPT, str(ct2_dir), *spms, str(a.file), str(out), str(a.threads),
                    str(a.beam_size), ctranslate2_compare.COMPUTE_TYPES[precision], str(a.fixed_length), "1.0",
                    str(a.fixed_length), "", "", "1"]
        env = user_env(tmp)
        for command in engines.values():
            run_timed(command, env=env)  # untimed: bytecode compiled, files in the page cache
        names, timings = list(engines), tmp / "timings.json"
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in names}
        for r in range(a.rounds):
            for k in names[r % len(names):] + names[:r % len(names)]:
                timings.unlink(missing_ok=True)
                wall, rss, _ = run_timed(engines[k], env={**env, "PIPELINE_TIMINGS": str(timings)})
                recorded = json.loads(timings.read_text()) if timings.exists() else {}
                runs[k].append({"wall_s": wall, "peak_mb": rss, **{x: recorded.get(x) for x in (
                    "encoder_s", "decoder_s", "encoder_calls", "decoder_steps")}})
                print(f"round {r + 1} {k}: {wall:.2f} s", flush=True)
    rows: dict[str, dict[str, Any]] = {}
    for k, samples in runs.items():
        row: dict[str, Any] = {key: statistics.median(s[key] for s in samples) if samples[0][key] is not None
                               else None for key in ("wall_s", "encoder_s", "decoder_s", "decoder_steps")}
        row["peak_mb"] = max(s["peak_mb"] or 0.0 for s in samples)
        row["rounds_wall_s"] = [round(s["wall_s"], 2) for s in samples]
        rows[k] = row
    ct2_walls = [v["wall_s"] for k, v in rows.items() if k.startswith("ct2")]
    for k, v in rows.items():
        v["x_ct2_best"] = v["wall_s"] / min(ct2_walls) if ct2_walls else None
        split = f", encoder {v['encoder_s']:.2f} s, decoder {v['decoder_s']:.2f} s ({v['decoder_steps']:.0f} steps)" \
            if v["encoder_s"] is not None else ""
        ratio = f", x CT2 best {v['x_ct2_best']:.2f}" if v["x_ct2_best"] else ""
        print(f"{k:14} {v['wall_s']:.2f} s{ratio}, peak {v['peak_mb']:.0f} MiB{split}; rounds {v['rounds_wall_s']}")
    if a.json:
        a.json.write_text(json.dumps({"model_dir": str(a.model_dir), "file": str(a.file), "rounds": a.rounds,
                                      "threads": a.threads, "beam_size": a.beam_size, "fixed_length": a.fixed_length,
                                      **pieces_summary(source_pieces(a.model_dir, a.file)), "results": rows,
                                      "runs": runs}, indent=1))


if __name__ == "__main__":
    main()

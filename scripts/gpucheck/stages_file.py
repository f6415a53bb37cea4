"""The GPU check's `file` stage, a method of Check (check.py): what a user waits for to translate a file on the
device (issue 64). serve-batch on the trained model, whole process, over the first `file_lines` source lines of
its training corpus: the default (on CUDA: the decoder step as a CUDA graph, 4 beam search steps per replay),
then one step per replay; transformers' MarianMTModel.generate on the same weights at its best batch (a
subprocess worker, workers_marian.py); onnxruntime on the host's CPU on the fp32 dir."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from gpucheck.modes import Stage
from gpucheck.util import Fail, Skip, atomic_write

SUMMARY = re.compile(r"translated (\d+) sentences \((\d+) source tokens, (\d+) target tokens\) in ([\d.]+) s")


SLOWER = 1.3  # the default's translation time over one step per replay's that fails the stage (noise: ~1.25x)
CHANGED = 0.1  # the share of lines fp16 may change between step modes (the bench stage's rule)


def default_problem(default: dict[str, Any], one_step: dict[str, Any]) -> str | None:
    """Why the default (several steps per replay) failed against one step per replay on the same file, if it
    did: slower by more than SLOWER in translation time (issue: 2.8x slower once, 232 captures), or more than
    CHANGED of the lines different."""
    slow, fast = default["translate_s"], one_step["translate_s"]
    if fast and slow > SLOWER * fast:
        return (f"the default took {slow} s to translate the file, {slow / fast:.2f}x the {fast} s of "
                "--steps-per-replay 1: the default is not the fast path (runtime/device_search.py)")
    changed = default["lines"] - one_step.get("same_lines_as_default", default["lines"])
    if changed > CHANGED * default["lines"]:
        return f"{changed} of {default['lines']} lines differ between the default and --steps-per-replay 1"
    return None


class FileStages:
    """Check's `file` stage (self is the Check)."""

    def file(self, st: Stage, deadline: float) -> str:
        m = self.mode
        precision = "fp16" if m.device == "cuda" else "fp32"
        model_dir = self.need_model_dir(precision)
        corpus = self.save_dir / "data" / "train.src"
        if not corpus.is_file():
            raise Skip(f"no training corpus at {corpus} (written by pipeline train for the built-in corpus)")
        lines = [x for x in corpus.read_text(encoding="utf-8").splitlines() if x.strip()][: m.file_lines]
        src = self.work / "file.src"
        atomic_write(src, "\n".join(lines) + "\n")
        runs: list[dict[str, Any]] = []
        variants = [("default", ())] + ([("one step per replay", ("--steps-per-replay", "1"))]
                                        if m.device == "cuda" else [])
        for label, extra in variants:
            runs.append(self._serve_file(st, deadline, model_dir, src, label, m.device, precision, extra))
        if len(runs) == 2:
            a, b = (Path(r["output"]).read_bytes().splitlines() for r in runs)
            runs[1]["same_lines_as_default"] = sum(x == y for x, y in zip(a, b))
            st.data["runs"] = runs
            problem = default_problem(runs[0], runs[1])
            if problem:
                raise Fail(problem)
        cpu_src = self.work / "file-cpu.src"
        atomic_write(cpu_src, "\n".join(lines[: m.file_cpu_lines]) + "\n")
        runs.append(self._serve_file(st, deadline, self.need_model_dir("fp32"), cpu_src, "onnxruntime on the CPU",
                                     "cpu", "fp32", ("--backend", "onnxruntime")))
        generate = self.worker(st, "generate-file", {
            "device": m.device, "dtype": precision, "trained": str(self.save_dir), "src": str(src),
            "lines": m.file_generate_lines, "batches": list(m.file_generate_batches), "beam": 4,
            "threads": m.threads, "decode": dict(zip(m.decode[::2], m.decode[1::2]))}, deadline)
        st.data.update({"lines": len(lines), "runs": runs, "generate": generate})
        best = generate["best"]
        ours = runs[0]
        ratio = ours["target_tokens_per_s"] / best["target_tokens_per_s"] if best["target_tokens_per_s"] else None
        st.data["ours_over_generate_tokens_per_s"] = round(ratio, 2) if ratio else None
        parts = [f"{r['label']}: {r['lines']} lines in {r['wall_s']} s whole process ({r['lines_per_s']} lines/s, "
                 f"{r['target_tokens_per_s']} target tokens/s)" for r in runs]
        in_search = ours["target_tokens"] / ours["translate_s"] if ours["translate_s"] else None
        parts.append(f"generate at its best batch ({best['batch_size']}) on {best['sentences']} lines: "
                     f"{best['sentences_per_s']} lines/s, {best['target_tokens_per_s']} target tokens/s in generate "
                     "alone" + (f"; ours {ratio:.2f}x its target tokens/s by our whole process" if ratio else "")
                     + (f", {in_search / best['target_tokens_per_s']:.2f}x by our translation time"
                        if in_search and best["target_tokens_per_s"] else ""))
        return "; ".join(parts)

    def _serve_file(self, st: Stage, deadline: float, model_dir: Path, src: Path, label: str, device: str,
                    precision: str, extra: tuple[str, ...]) -> dict[str, Any]:
        out = self.work / f"file-{len(st.commands)}.txt"
        backend = () if "--backend" in extra else ("--backend", "torch", "--dtype", precision)
        t0 = time.perf_counter()
        self.cmd(st, self.pipeline("serve-batch", model_dir, src, "-o", out, "--device", device, "--no-progress",
                                   *backend, *extra, *self.mode.decode), deadline)
        wall = time.perf_counter() - t0
        err = Path(st.commands[-1]["stderr"]).read_text(errors="replace").strip().splitlines()
        found = next((SUMMARY.search(x) for x in reversed(err) if SUMMARY.search(x)), None)
        if found is None:
            raise Fail(f"serve-batch ({label}) printed no summary line")
        n, _, target, seconds = int(found.group(1)), int(found.group(2)), int(found.group(3)), float(found.group(4))
        return {"label": label, "device": device, "precision": precision, "options": list(extra), "lines": n,
                "target_tokens": target, "wall_s": round(wall, 2), "translate_s": seconds,
                "lines_per_s": round(n / wall, 1), "target_tokens_per_s": round(target / wall, 1),
                "output": str(out)}

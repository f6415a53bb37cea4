"""The GPU check's stages on the trained model, as methods of Check (check.py): export, serve-batch and
parity."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from gpucheck.modes import Stage
from gpucheck.util import Fail, Skip, atomic_write, read_json


class ServeStages:
    """Check's stages from export to parity (self is the Check: its mode, work dir, cmd, worker...)."""

    def export(self, precision: str) -> Any:
        def stage(st: Stage, deadline: float) -> str:
            save_dir = self.need_trained()
            out = self.model_dirs[precision]
            extra = ["--fp16"] if precision == "fp16" else []
            stdout = self.cmd(st, self.pipeline("export", save_dir, "--out", out, "--no-tensorrt", "--force",
                                                *extra, *self.mode.export), deadline)
            manifest = read_json(out / "manifest.json") or {}
            st.data["manifest_precision"] = manifest.get("precision")
            st.data["verification"] = manifest.get("verification")
            return stdout.strip().splitlines()[-1] if stdout.strip() else "exported"
        return stage

    def test_split(self) -> tuple[Path, Path]:
        """The first test_lines pairs of the built-in corpus' test split (SAVE_DIR/data/test.*)."""
        src, ref = self.save_dir / "data" / "test.src", self.save_dir / "data" / "test.tgt"
        if not src.is_file():
            raise Skip(f"no test split at {src} (written by pipeline train for the built-in corpus)")
        with self.lock:
            out = []
            for path in (src, ref):
                head = self.work / f"test-head{path.suffix}"
                if not head.is_file():
                    lines = path.read_bytes().splitlines(keepends=True)[: self.mode.test_lines]
                    atomic_write(head, b"".join(lines).decode("utf-8"))
                out.append(head)
        return out[0], out[1]

    def need_model_dir(self, precision: str) -> Path:
        path = self.model_dirs[precision]
        if not (path / "manifest.json").is_file():
            raise Skip(f"no {precision} model dir (export-{precision}: {self.stages['export-' + precision].status})")
        return path

    def serve(self, precision: str) -> Any:
        def stage(st: Stage, deadline: float) -> str:
            model_dir = self.need_model_dir(precision)
            src, _ = self.test_split()
            out = self.work / f"serve-{precision}.txt"
            out.unlink(missing_ok=True)
            self.cmd(st, self.pipeline("serve-batch", model_dir, src, "-o", out, "--backend", "torch", "--device",
                                       self.mode.device, "--dtype", precision, "--no-progress",
                                       *self.mode.serve_threads, *self.mode.decode), deadline)
            n_in, n_out = len(src.read_bytes().splitlines()), len(out.read_bytes().splitlines())
            st.data.update({"output": str(out), "lines_in": n_in, "lines_out": n_out})
            if n_in != n_out:
                raise Fail(f"{n_out} output lines for {n_in} input lines")
            err = Path(st.commands[-1]["stderr"]).read_text(errors="replace").strip().splitlines()
            st.data["summary"] = err[-1] if err else ""
            # the batches: the GPU's own default, no sentence cap (DecodingOptions.for_device), logged when it applies
            budget = next((m for m in map(re.compile(r"no sentence cap on (\S+)").search, err) if m), None)
            st.data["uncapped"] = budget is not None
            if (budget is not None) != (self.mode.device == "cuda"):
                raise Fail(f"serve-batch on {self.mode.device} logged "
                           f"{budget.group(0) if budget else 'no batch change'}: the GPU default applies on CUDA only")
            note = " (the CPU runs torch in fp32: fp16 only on a GPU)" if precision == "fp16" and \
                self.mode.device == "cpu" else ""
            if budget is not None:  # the same file with the CPU's sentence cap: what the GPU's default buys
                from runtime.decoding import PAPER  # this checkout is on PYTHONPATH (gpu_check.sh)

                cpu_cap = str(PAPER.batch_sentences)
                again = self.work / f"serve-{precision}-cap{cpu_cap}.txt"
                self.cmd(st, self.pipeline("serve-batch", model_dir, src, "-o", again, "--backend", "torch",
                                           "--device", self.mode.device, "--dtype", precision, "--no-progress",
                                           "--batch-sentences", cpu_cap, *self.mode.decode), deadline)
                err2 = Path(st.commands[-1]["stderr"]).read_text(errors="replace").strip().splitlines()
                rates = [re.search(r"([\d.]+) target tokens/s", x[-1] if x else "") for x in (err, err2)]
                same = sum(a == b for a, b in zip(out.read_bytes().splitlines(), again.read_bytes().splitlines()))
                st.data.update({"cpu_cap_summary": err2[-1] if err2 else "", "cpu_cap_same_lines": same})
                note += (f"; at --batch-sentences {cpu_cap}: " + (f"{rates[1].group(1)} tok/s" if rates[1] else "?")
                         + f", {same}/{n_out} lines the same")
            return f"{n_out} lines; {st.data['summary']}{note}" + (f"; {budget.group(0)}" if budget else "")
        return stage

    def parity_recorded(self, st: Stage, deadline: float) -> str:
        model_dir = self.need_model_dir("fp32")
        report = self.work / "parity-torch-recorded.json"
        self.cmd(st, self.pipeline("parity", model_dir, "--backends", "torch", "--device", self.mode.device,
                                   "--json", report), deadline)
        return self.parity_summary(st, report)

    def parity_summary(self, st: Stage, report: Path) -> str:
        data = read_json(report)
        if data is None:
            raise Fail(f"parity wrote no JSON at {report}")
        st.data["parity"] = data
        rows = [f"{r['backend']} {r['precision']} on {r['device']}: identical {r['identical']:.1%}, "
                f"dBLEU {r['bleu_delta']:+.2f}, {'PASS' if r['passed'] else 'FAIL ' + '; '.join(r['failures'])}"
                for r in data["results"]]
        if not data.get("passed"):
            raise Fail("; ".join(rows))
        return f"{data['sentences']} sentences: " + "; ".join(rows)

    def parity_live(self, precision: str) -> Any:
        def stage(st: Stage, deadline: float) -> str:
            model_dir = self.need_model_dir(precision)
            src, ref = self.test_split()
            report = self.work / f"parity-onnxruntime-{precision}.json"
            hyps = self.hyps / precision
            hyps.mkdir(parents=True, exist_ok=True)
            # torch is parity's reference (CPU, fp32); listing it saves its translation for parity-serve
            self.cmd(st, self.pipeline("parity", model_dir, "--src", src, "--ref", ref, "--backends",
                                       "torch,onnxruntime", "--device", "cpu", "--json", report, "--save-hyps", hyps,
                                       *self.mode.decode), deadline)
            return self.parity_summary(st, report)
        return stage

    def parity_serve(self, st: Stage, deadline: float) -> str:
        _, ref = self.test_split()
        reference = next((p for p in (self.hyps / "fp32" / "torch.fp32.txt", self.hyps / "fp16" / "torch.fp32.txt")
                          if p.is_file()), None)
        if reference is None:
            raise Skip("no torch (CPU, fp32) translation of the test split: stages parity-onnxruntime-* "
                       "write it with --save-hyps")
        runs = [{"name": f"torch-{self.mode.device}", "precision": p, "path": str(self.work / f"serve-{p}.txt")}
                for p in ("fp32", "fp16") if (self.work / f"serve-{p}.txt").is_file()]
        if not runs:
            raise Skip("no serve-batch output (stages serve-fp32, serve-fp16)")
        data = self.worker(st, "compare-outputs", {"reference": str(reference), "ref": str(ref), "runs": runs},
                           deadline)
        st.data.update(data)
        rows = [f"{r['name']} {r['precision']}: identical {r['identical']:.1%}, dBLEU {r['bleu_delta']:+.2f} "
                f"({'PASS' if r['passed'] else 'FAIL ' + '; '.join(r['failures'])})" for r in data["results"]]
        if not all(r["passed"] for r in data["results"]):
            raise Fail("; ".join(rows))
        return "; ".join(rows)

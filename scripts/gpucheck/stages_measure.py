"""The GPU check's measuring stages, as methods of Check (check.py): random checkpoints, bench-cli, bench,
the Marian peer, the roofline and onnxruntime's CUDA provider."""

from __future__ import annotations

from gpucheck.modes import FP16_MODE_AGREEMENT, Stage
from gpucheck.util import PASS, Fail, Skip, read_json


class MeasureStages:
    """Check's timed stages (self is the Check: its mode, work dir, cmd, worker...)."""

    def random_checkpoints(self, st: Stage, deadline: float) -> str:
        made = []
        for preset, path in self.checkpoints.items():
            self.cmd(st, self.pipeline("random-checkpoint", path, "--preset", preset, "--vocab-size",
                                       self.mode.bench_vocab, "--force"), deadline, label=preset)
            made.append(f"{preset} ({path.stat().st_size / 2 ** 20:.0f} MiB)")
        return "random weights, vocab " + str(self.mode.bench_vocab) + ": " + ", ".join(made)

    def bench_cli(self, st: Stage, deadline: float) -> str:
        model_dir = self.need_model_dir("fp32")
        report = self.work / "bench-cli.json"
        batches = [a for b in self.mode.cli_batches for a in ("--batch-size", str(b))]
        threads = ["--threads", str(self.mode.threads)] if self.mode.threads else []
        stdout = self.cmd(st, self.pipeline("bench", model_dir, "--backends", "torch", "--device", self.mode.device,
                                            *batches, "--beam-size", "4", "--fixed-length", "30", "--sentences",
                                            str(max(self.mode.cli_batches) * 2), *threads, "--json", report),
                          deadline)
        data = read_json(report)
        st.data["bench"] = data
        st.data["table"] = stdout.strip()
        rows = (data or {}).get("results") or []
        if not rows:
            raise Fail("pipeline bench wrote no result rows")
        return "; ".join(f"batch {r['batch_size']}: {r['target_tokens_per_s']:.0f} tok/s on {r['device']}"
                         + (f", peak GPU {r['peak_gpu_mb']:.0f} MB" if r.get("peak_gpu_mb") is not None else "")
                         for r in rows)

    def need_checkpoints(self) -> dict[str, str]:
        missing = [p for p, path in self.checkpoints.items() if not path.is_file()]
        if missing:
            raise Skip(f"no random checkpoint for {', '.join(missing)} (random-checkpoints: "
                       f"{self.stages['random-checkpoints'].status})")
        return {p: str(path) for p, path in self.checkpoints.items()}

    def bench(self, st: Stage, deadline: float) -> str:
        m = self.mode
        data = self.worker(st, "bench", {
            "device": m.device, "checkpoints": self.need_checkpoints(), "batches": list(m.bench_batches),
            "sentences": {str(k): v for k, v in m.bench_sentences.items()}, "beam": 4, "fixed_length": 30,
            "dtypes": list(m.bench_dtypes), "roofline_batches": list(m.roofline_batches), "threads": m.threads,
            "step_modes": list(m.step_modes),
        }, deadline)
        st.data.update(data)
        if not data.get("rows"):
            raise Fail("no bench rows")
        # fp32: token-identical. fp16: the graph's attention sums run over masked padding, whose rounding can
        # flip a near-tie (random weights have many: 123/128 on the first H100 run); at most 1 in 10 may.
        differ = [r for r in data["rows"] if r["identical_to_first_mode"] < r["identity_sentences"] * (
            1.0 if r["dtype"] == "fp32" else FP16_MODE_AGREEMENT)]
        if differ:
            raise Fail("the decoder step modes translate differently: " + "; ".join(
                f"{r['preset']} {r['dtype']} {r['step_mode']} batch {r['batch_size']}: {r['identical_to_first_mode']}"
                f"/{r['identity_sentences']} identical to {m.step_modes[0]}" for r in differ))
        same = sum(r["identical_to_first_mode"] for r in data["rows"])
        total = sum(r["identity_sentences"] for r in data["rows"])
        return f"{len(data['rows'])} rows ({', '.join(m.bench_presets)} x {', '.join(m.bench_dtypes)} x batch " \
               f"{', '.join(map(str, m.bench_batches))} x step {', '.join(m.step_modes)}), beam 4, 30 tokens; " \
               f"{same}/{total} first-batch translations identical across step modes (fp32: all must be)"

    def marian(self, st: Stage, deadline: float) -> str:
        m = self.mode
        checkpoints = self.need_checkpoints() if all(p.is_file() for p in self.checkpoints.values()) else {}
        try:
            trained: str | None = str(self.need_trained())
            src, ref = map(str, self.test_split())
        except Skip as e:
            if not checkpoints:
                raise Skip(f"{e}; and no random checkpoints either") from None
            trained = src = ref = None
            self.notes.append(f"marian: {e}, so the agreement ran on the random {next(iter(checkpoints))} weights")
        if not checkpoints:
            self.notes.append("marian: no random checkpoints, so only the agreement ran (no timing)")
        data = self.worker(st, "marian", {
            "device": m.device, "trained": trained, "src": src, "ref": ref,
            "agree_sentences": 16, "checkpoints": checkpoints, "batches": list(m.bench_batches),
            "sentences": {str(k): v for k, v in m.bench_sentences.items()}, "beam": 4, "new_tokens": 30,
            "dtypes": list(m.bench_dtypes), "threads": m.threads,
        }, deadline)
        st.data.update(data)
        agree = data["agreement"]
        if agree["identical"] != agree["sentences"]:
            raise Fail(f"greedy output token-identical on {agree['identical']} of {agree['sentences']} sentences "
                       f"only; first difference {agree['first_difference']}")
        if data["teacher_forced_gap"] > 1e-3:
            raise Fail(f"teacher-forced log-probs differ by up to {data['teacher_forced_gap']:.3g} (> 1e-3)")
        return (f"greedy token-identical on {agree['identical']}/{agree['sentences']} sentences "
                f"({data['agreement_on']}, {m.device}, fp32), teacher-forced max |d log-prob| "
                f"{data['teacher_forced_gap']:.2g}"
                f"; transformers {data.get('transformers')}; {len(data.get('rows', []))} timing rows")

    def roofline(self, st: Stage, deadline: float) -> str:
        m = self.mode
        bench = self.stages["bench"].data.get("roofline_timings") or []
        data = self.worker(st, "roofline", {"device": m.device, "copy_bytes": m.copy_bytes, "matmul_n": m.matmul_n,
                                            "dtypes": list(m.matmul_dtypes), "timings": bench}, deadline)
        st.data.update(data)
        machine = data["machine"]
        head = (f"copy {machine['copy']['bytes_per_s'] / 1e9:.0f} GB/s, matmul "
                + ", ".join(f"{k} {v['flops_per_s'] / 1e12:.1f} TFLOP/s" for k, v in machine["matmul"].items()))
        if not data["rows"]:
            why = f"{head}; no step timings from stage bench ({self.stages['bench'].status}) to place on it"
            raise (Fail(why) if self.stages["bench"].status == PASS else Skip(why))
        rows = "; ".join(f"{r['preset']} {r['dtype']} {r.get('step_mode') or 'eager'} batch {r['batch_size']}: "
                         f"{r['achieved']['roofline_pct']:.0f}% of roofline" for r in data["rows"])
        return f"{head}; {rows}"

    def onnxruntime_cuda(self, st: Stage, deadline: float) -> str:
        """The exported dirs on onnxruntime's CUDA provider: parity against torch fp32 on the CPU, then bench
        beside the torch backend on CUDA. Needs onnxruntime-gpu, which travels in parts (docs/gpu.md)."""
        providers = ((self.stages["doctor"].data.get("facts") or {}).get("onnxruntime") or {}).get("providers") or []
        if self.mode.name != "gpu" or "CUDAExecutionProvider" not in providers:
            raise Skip(f"onnxruntime here has no CUDAExecutionProvider (providers {providers}): onnxruntime-gpu "
                       "did not travel (docs/gpu.md, scripts/ort_gpu_parts.sh)")
        src, ref = self.test_split()
        results = []
        for precision in ("fp32", "fp16"):
            model_dir = self.need_model_dir(precision)
            report = self.work / f"onnxruntime-cuda-parity-{precision}.json"
            self.cmd(st, self.pipeline("parity", model_dir, "--src", src, "--ref", ref, "--backends", "onnxruntime",
                                       "--device", "cuda", "--json", report, *self.mode.decode), deadline,
                     label=f"parity-{precision}")
            results.append(self.parity_summary(st, report))
            st.data[f"parity_{precision}"] = st.data.pop("parity")
            bench = self.work / f"onnxruntime-cuda-bench-{precision}.json"
            batches = [a for b in self.mode.cli_batches for a in ("--batch-size", str(b))]
            st.data[f"table_{precision}"] = self.cmd(
                st, self.pipeline("bench", model_dir, "--backends", "onnxruntime,torch", "--device", "cuda", *batches,
                                  "--beam-size", "4", "--fixed-length", "30", "--sentences",
                                  str(max(self.mode.cli_batches) * 2), "--json", bench), deadline,
                label=f"bench-{precision}").strip()
            data = read_json(bench) or {}
            st.data[f"bench_{precision}"] = data
            results.append("; ".join(f"{r['backend']} {precision} batch {r['batch_size']}: "
                                     f"{r['target_tokens_per_s']:.0f} tok/s" for r in data.get("results") or []))
        return " | ".join(results)

"""The GPU check's report.md (scripts/gpu_check.py): the summary, the stage table, decoding speed beside
the Marian peer, the roofline table and each stage's details, from report.json's content."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpucheck.modes import Mode
from gpucheck.util import FAIL, PY, ROOT, fmt


def render_markdown(report: dict[str, Any], mode: Mode) -> str:
    host = report["host"]
    counts = ", ".join(f"{v} {k}" for k, v in report["counts"].items() if v)
    lines = [f"# GPU check: {report['card']} ({report['mode']} mode)", "",
             f"- **Date:** {report['started']}; {report['wall_s']:.0f} s of a {report['budget_s']} s budget.",
             f"- **Machine:** {report['card']}; CPU {host['cpu']}; {host['platform']}.",
             f"- **Software:** Python {host['python']}, torch {host['torch']} (CUDA {host['cuda']}), "
             f"onnxruntime {host.get('onnxruntime')}, transformers {host.get('transformers')}.",
             f"- **Commit:** {host['commit']}.",
             f"- **Command:** `bash scripts/gpu_check.sh OUT_DIR{' --cpu' if mode.name == 'cpu' else ''}` "
             "(docs/gpu.md); every command's output is in OUT_DIR/logs/, small results in OUT_DIR/artifacts/.",
             f"- **Stages:** {counts}.", ""]
    for note in report["notes"]:
        lines.append(f"Note: {note}")
    lines += ["", "| stage | status | seconds | result or reason |", "| --- | --- | ---: | --- |"]
    for st in report["stages"]:
        reason = st["reason"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {st['name']} | {st['status']} | {st['seconds']:.0f} | {reason} |")

    rows = report.get("bench") or []
    marian_rows = {(r["preset"], r["dtype"], r["batch_size"]): r for r in (report.get("marian") or {}).get("rows", [])}
    if rows:
        lines += ["", "## Decoding speed: our torch backend and MarianMTModel.generate on the same weights", "",
                  "Beam 4, exactly 30 target tokens per sentence (ours: `--fixed-length 30`, 31 decoder steps with "
                  "the forced EOS; generate: min_new_tokens = max_new_tokens = 30), random sources of 20 tokens, "
                  "random weights. Peak memory: torch.cuda.max_memory_allocated during the measurement, "
                  "weights included (on the CPU: the process's peak RSS).", "",
                  "Ours in each decoder step mode (runtime/static_step.py: `eager` launches each kernel from "
                  "Python; `graph` replays the step as a CUDA graph on fixed shapes; `static` is that without "
                  "capture); 'same tokens' counts the first batch's translations identical to the first mode's.", "",
                  "| shape | dtype | batch | step | ours tok/s | ours ms/sent | ours peak MiB | same tokens | "
                  "Marian tok/s | Marian ms/sent | Marian peak MiB | ours / Marian |",
                  "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            peer = marian_rows.get((r["preset"], r["dtype"], r["batch_size"])) or {}
            speed = peer.get("target_tokens_per_s")
            ratio = r["target_tokens_per_s"] / speed if speed else None
            peak = r.get("peak_gpu_mib") if r.get("peak_gpu_mib") is not None else r.get("peak_rss_mb")
            same = f"{r.get('identical_to_first_mode')}/{r.get('identity_sentences')}"
            cells = [r["preset"], r["dtype"], r["batch_size"], r.get("step_mode", "eager"),
                     fmt(r["target_tokens_per_s"], ".0f"), fmt(r["latency_ms_per_sentence"], ".2f"), fmt(peak, ".0f"),
                     same, fmt(speed, ".0f"),
                     fmt(peer.get("latency_ms_per_sentence"), ".2f"), fmt(peer.get("peak_gpu_mib"), ".0f"),
                     fmt(ratio, ".2f")]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    marian = report.get("marian") or {}
    if marian.get("agreement"):
        a, ra = marian["agreement"], marian.get("random_agreement") or {}
        lines += ["", f"Marian mapping (transformers {marian.get('transformers')}, attention "
                      f"{marian.get('attn_implementation')}): greedy output token-identical to our torch backend on "
                      f"{a['identical']}/{a['sentences']} sentences ({marian.get('agreement_on')}); teacher-forced max "
                      f"|d log-prob| {fmt(marian.get('teacher_forced_gap'), '.2g')}; on the random "
                      f"{marian.get('random_shape')} weights: greedy {fmt(ra.get('identical'), 'd')}"
                      f"/{fmt(ra.get('sentences'), 'd')}, teacher-forced "
                      f"{fmt(marian.get('random_teacher_forced_gap'), '.2g')}."]

    roof = report.get("roofline") or {}
    if roof.get("machine"):
        mach = roof["machine"]
        lines += ["", "## Roofline of one decoder step", "",
                  f"Measured: device copy {mach['copy']['bytes_per_s'] / 1e9:.0f} GB/s (bytes read + written, "
                  f"{mach['copy']['bytes'] / 2 ** 30:.2f} GiB moved); matmul "
                  + ", ".join(f"{k} {v['flops_per_s'] / 1e12:.2f} TFLOP/s (n={v['n']:.0f})"
                              for k, v in mach["matmul"].items())
                  + ". Bytes and FLOPs from the shape (pipeline/evaluation/roofline.py): decoder weights incl. the "
                    "output projection, self K/V of t earlier positions per hypothesis, cross K/V once per sentence, "
                    "the fp32 log-probs written and read once; summed over the 31 steps of a batch and divided by "
                    "the measured time of those steps (search's host work included).", "",
                  "The step ms is the host's wall time of each step (upload, replay or launches, downloads); GPU "
                  "ms is the device's time in the graph (CUDA events around each replay); device ops counts "
                  "what one eager step launches (torch.profiler), which the graph replays.", "",
                  "| shape | dtype | step | batch x beam | MB/step | GFLOP/step | step ms | GPU ms | device ops | "
                  "GB/s | % copy BW | TFLOP/s | % matmul | % roofline |",
                  "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in roof.get("rows", []):
            a, c, steps = r["achieved"], r["cost"], r["steps"]
            cells = [r["preset"], r["dtype"], r.get("step_mode") or "eager", f"{r['batch_size']} x {r['beam']}",
                     f"{c['bytes'] / steps / 1e6:.1f}",
                     f"{c['flops'] / steps / 1e9:.2f}", f"{1000 * a['seconds'] / steps:.2f}",
                     fmt(1000 * r["gpu_step_seconds"] / steps if r.get("gpu_step_seconds") else None, ".2f"),
                     fmt((r.get("device_ops_per_step") or {}).get("per_step"), ".0f"),
                     f"{a['bytes_per_s'] / 1e9:.0f}", f"{a['bandwidth_pct']:.1f}", f"{a['flops_per_s'] / 1e12:.2f}",
                     f"{a['flops_pct']:.1f}", f"{a['roofline_pct']:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")

    lines += ["", "## Stage details", ""]
    for st in report["stages"]:
        lines += [f"### {st['name']}: {st['status']}", "", st["title"] + ".", ""]
        if st["reason"]:
            lines += [st["reason"], ""]
        for c in st["commands"]:
            argv = " ".join(c["argv"])
            argv = argv.replace(str(ROOT) + "/", "").replace(PY, "python")
            lines.append(f"- `{argv[:400]}` -> exit {c.get('rc')} in {fmt(c.get('seconds'))} s "
                         f"(logs/{Path(c['stdout']).stem}.out/.err)")
        extra = stage_details(st)
        if extra:
            lines += ["", *extra]
        if st["status"] == FAIL and st["stderr_tail"]:
            lines += ["", "stderr tail:", "", "```", st["stderr_tail"][-3000:], "```"]
        lines.append("")
    lines += ["## Not covered by this check", "",
              "TensorRT (cannot be installed on these machines: export runs with --no-tensorrt) and onnxruntime-gpu "
              "(the GPU machine has the CPU onnxruntime; its CUDA execution provider runs only if onnxruntime-gpu "
              "travels with the command). With one GPU, training runs one process, which uses no process group: "
              "the `distributed` stage checks NCCL and DDP on their own. `pipeline parity` always runs torch as its "
              "fp32 reference, so torch in fp16 on the GPU is gated here through serve-batch's output "
              "(parity-serve) with parity's own gates.", ""]
    return "\n".join(lines)


def stage_details(st: dict[str, Any]) -> list[str]:
    d = st["data"]
    out: list[str] = []
    if st["name"] == "resume" and d.get("comparison"):
        c = d["comparison"]
        out.append(f"Uninterrupted vs interrupted+resumed: step {c['steps']}, identical {c['identical']}, max |diff| "
                   f"{fmt(c['max_abs'], '.3g')}, rel L2 {fmt(c['rel_l2'], '.3g')}, optimizer max |diff| "
                   f"{fmt(c['optimizer_max_abs'], '.3g')}, RNG states equal {c['rng_equal']}; interrupted: "
                   f"{d.get('interrupted')}.")
        if d.get("run_to_run"):
            n = d["run_to_run"]
            out.append(f"Two uninterrupted runs of the same command: identical {n['identical']}, max |diff| "
                       f"{fmt(n['max_abs'], '.3g')}, rel L2 {fmt(n['rel_l2'], '.3g')}. Tolerance: 10 x that max |diff| "
                       f"({fmt(d.get('tolerance'), '.3g')}). Why: bf16 autocast and CUDA kernels that sum with "
                       "atomics (the memory-efficient attention backward, embedding/index backward) make two "
                       "uninterrupted runs differ in the last bits, and the differences grow over the steps; a "
                       "correct resume differs from the uninterrupted run by that much and no more, while the "
                       "training state that must replay exactly (step, data position, token count) is compared "
                       "exactly.")
    if st["name"] == "train" and d.get("last_train"):
        out.append(f"Last train event {d.get('last_train')}; last validation {d.get('last_valid')}; "
                   f"checkpoints {d.get('checkpoints')}.")
    if st["name"] == "nvidia-smi" and d.get("nvidia_smi"):
        out += ["```", d["nvidia_smi"].strip()[:4000], "```"]
    if st["name"] == "bench-cli" and d.get("table"):
        out += ["```", d["table"][-3000:], "```"]
    if st["name"].startswith("export") and d.get("verification"):
        out.append(f"Verification: {json.dumps(d['verification'])[:1500]}")
    return out

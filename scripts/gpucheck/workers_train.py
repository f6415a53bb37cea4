"""The GPU check's workers for training and serving results (subprocesses of `python scripts/gpu_check.py
_worker NAME`; torch is imported inside them only): ddp (stage distributed, under torchrun),
compare-checkpoints (resume) and compare-outputs (parity-serve)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def worker_ddp(p: dict[str, Any]) -> dict[str, Any]:
    """A 1-rank process group (nccl / gloo) as torchrun sets it up: all-reduce, an object broadcast
    and one DDP step of a tiny Transformer with the training autocast, against the plain model."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from model import build_model, preset

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(p["device"], local_rank) if p["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=p["backend"])
    try:
        x = torch.full((4,), float(dist.get_rank() + 1), device=device)
        dist.all_reduce(x)
        obj = [{"hello": dist.get_rank()}]
        dist.broadcast_object_list(obj, src=0, device=device if device.type == "cuda" else None)
        torch.manual_seed(0)
        model = build_model(preset("tiny", vocab_size=64)).to(device)
        plain = copy.deepcopy(model)
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        src = torch.randint(4, 64, (3, 7), device=device)
        tgt = torch.randint(4, 64, (3, 6), device=device)
        dtype = torch.bfloat16 if p["precision"] == "bf16" else torch.float16 if p["precision"] == "fp16" else None

        def loss_of(net: Any) -> Any:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                return net(src, tgt).float().logsumexp(-1).mean()

        loss_of(ddp).backward()
        loss_of(plain).backward()
        diff = max(float((a.grad - b.grad).abs().max()) for a, b in zip(model.parameters(), plain.parameters())
                   if a.grad is not None)
        ok = bool(x.eq(float(dist.get_world_size())).all()) and obj[0] == {"hello": 0}
        problem = None if ok else "all-reduce or object broadcast gave a wrong value"
        if ok and diff > 1e-2:
            ok, problem = False, f"DDP gradients differ from the plain model's by {diff:.3g}"
        return {"ok": ok, "problem": problem, "backend": dist.get_backend(), "world_size": dist.get_world_size(),
                "device": str(device), "grad_max_abs_diff": diff, "torch": torch.__version__,
                "nccl": nccl_version(torch) if device.type == "cuda" else None}
    finally:
        dist.destroy_process_group()


def nccl_version(torch: Any) -> str:
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, (tuple, list)) else str(version)


def worker_compare_checkpoints(p: dict[str, Any]) -> dict[str, Any]:
    """The last step checkpoints of two save dirs: training state (exact), weights, optimizer, RNG."""
    import torch

    from model.checkpoint import read_checkpoint, step_checkpoints

    a = read_checkpoint(step_checkpoints(Path(p["a"]))[-1])
    b = read_checkpoint(step_checkpoints(Path(p["b"]))[-1])
    ta, tb = a["train_state"], b["train_state"]
    diffs = {k: [ta.get(k), tb.get(k)] for k in ("step", "data", "tokens", "world_size") if ta.get(k) != tb.get(k)}
    max_abs, num, den = 0.0, 0.0, 0.0
    for name, x in a["model"].items():
        d = x.double() - b["model"][name].double()
        max_abs = max(max_abs, float(d.abs().max()))
        num += float(d.pow(2).sum())
        den += float(x.double().pow(2).sum())

    def tensors(state: Any) -> list[Any]:
        out = []
        for s in state["state"].values():
            out += [v for v in s.values() if torch.is_tensor(v)]
        return out

    opt = max((float((x.double() - y.double()).abs().max())
               for x, y in zip(tensors(ta["optimizer"]), tensors(tb["optimizer"]))), default=0.0)

    def rng_equal(x: Any, y: Any) -> bool:
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(rng_equal(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(rng_equal(u, v) for u, v in zip(x, y))
        if torch.is_tensor(x):
            return torch.equal(x, y)
        if hasattr(x, "shape"):
            return bool((x == y).all())
        return x == y

    rng = rng_equal(ta["rng"], tb["rng"])
    return {"steps": [ta["step"], tb["step"]], "state_equal": not diffs, "state_diffs": diffs,
            "identical": max_abs == 0.0 and opt == 0.0 and rng, "weights_identical": max_abs == 0.0,
            "max_abs": max_abs, "rel_l2": (num / den) ** 0.5 if den else 0.0, "optimizer_max_abs": opt,
            "rng_equal": rng}


def worker_compare_outputs(p: dict[str, Any]) -> dict[str, Any]:
    """serve-batch outputs against the torch (CPU, fp32) translation of the same lines, with parity's gates."""
    import sacrebleu

    from pipeline.evaluation.parity import DEFAULT_GATES
    from pipeline.textio import read_lines

    reference = read_lines(Path(p["reference"]))
    refs = read_lines(Path(p["ref"]))
    bleu = sacrebleu.BLEU()
    base = bleu.corpus_score(reference, [refs]).score
    results = []
    for run in p["runs"]:
        lines = read_lines(Path(run["path"]))
        if len(lines) != len(reference):
            results.append({**run, "identical": 0.0, "bleu": None, "bleu_delta": float("nan"), "passed": False,
                            "failures": [f"{len(lines)} lines, the reference has {len(reference)}"]})
            continue
        same = sum(a == b for a, b in zip(lines, reference)) / max(len(lines), 1)
        score = bleu.corpus_score(lines, [refs]).score
        gate = DEFAULT_GATES[run["precision"]]
        failures = []
        if gate.min_identical is not None and same < gate.min_identical:
            failures.append(f"identical {same:.1%} < {gate.min_identical:.1%}")
        if gate.max_bleu_delta is not None and abs(score - base) > gate.max_bleu_delta:
            failures.append(f"|dBLEU| {abs(score - base):.2f} > {gate.max_bleu_delta}")
        results.append({**run, "identical": same, "bleu": round(score, 2), "bleu_torch_cpu": round(base, 2),
                        "bleu_delta": round(score - base, 2), "passed": not failures, "failures": failures,
                        "gate": {"min_identical": gate.min_identical, "max_bleu_delta": gate.max_bleu_delta}})
    return {"reference": p["reference"], "results": results,
            "note": "line-identical output text (what serve-batch writes), parity's gates per precision"}

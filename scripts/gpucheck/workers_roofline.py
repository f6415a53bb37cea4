"""The GPU check's roofline worker (a subprocess of `python scripts/gpu_check.py _worker roofline`):
the measured copy bandwidth and matmul rate, and the bench's step timings placed on them."""

from __future__ import annotations

from typing import Any

from gpucheck.util import _threads


def worker_roofline(p: dict[str, Any]) -> dict[str, Any]:
    from pipeline.evaluation import roofline

    _threads(p)
    copy = roofline.measure_copy_bandwidth(p["device"], int(p["copy_bytes"]))
    matmul = {dt: roofline.measure_matmul_rate(p["device"], dt, int(p["matmul_n"])) for dt in p["dtypes"]}
    rows = []
    for t in p["timings"]:
        shape = roofline.Shape.of(_Cfg(t["model_config"]))
        width = 2 if t["dtype"] in ("fp16", "bf16") else 4
        cost = roofline.decode_cost(shape, t["batch_size"], t["beam"], t["steps"], t["src_len"], weight_bytes=width)
        rate = matmul.get(t["dtype"], matmul.get("fp32"))
        rows.append({**{k: t.get(k) for k in ("preset", "dtype", "step_mode", "batch_size", "beam", "steps",
                                              "src_len", "gpu_step_seconds", "device_ops_per_step")},
                     "cost": cost.to_dict(),
                     "per_step_at_t15": roofline.step_cost(shape, t["batch_size"], t["beam"], 15, t["src_len"],
                                                           weight_bytes=width).to_dict(),
                     "achieved": roofline.achieved(cost, t["step_seconds"], copy["bytes_per_s"], rate["flops_per_s"])})
    return {"machine": {"device": p["device"], "copy": copy, "matmul": matmul}, "rows": rows}


class _Cfg:
    def __init__(self, d: dict[str, Any]):
        self.__dict__.update(d)

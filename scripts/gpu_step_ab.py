"""The torch backend's decoder step with and without prepare_for_inference, on one device, in one process.

prepare_for_inference (runtime/torch_backend.py) fuses each decoder self-attention's q, k and v projections
into one GEMM and keeps the LayerNorms' parameters in fp32 under half precision: fewer kernels per step, the
same arithmetic. This measures what that buys where kernels are what a step waits for (a GPU, the step
replayed as a CUDA graph): the same random-weight model, with and without, the order alternating per round;
per row the best step time of the rounds (host wall time of each step, search included), the GPU's time
per replay (CUDA events), the first batch's translations compared, and on CUDA the kernels one eager step
launches (torch.profiler).

    python scripts/gpu_step_ab.py --json OUT.json                   # a GPU: base and big, fp32 and fp16
    python scripts/gpu_step_ab.py --device cpu --presets tiny --dtypes fp32 --batches 1,4 --mode static
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402
from gpu_check import device_ops_per_step, timed_steps  # noqa: E402

from model.config import EOS_ID, preset  # noqa: E402
from model.transformer import build_model  # noqa: E402
from runtime.decoding import PAPER  # noqa: E402
from runtime.search import search  # noqa: E402
from runtime.torch_backend import TorchBackend  # noqa: E402
from runtime.translate import pad_batch  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
VARIANTS = ("as loaded", "prepared")  # fuse=False, fuse=True


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    decoding = PAPER.replace(beam_size=4, max_len_a=0.0, max_len_b=args.tokens, min_len=args.tokens)
    rows = []
    for name in args.presets.split(","):
        torch.manual_seed(0)
        plain = build_model(preset(name, args.vocab)).eval()
        models = {"as loaded": plain, "prepared": copy.deepcopy(plain)}
        g = torch.Generator().manual_seed(1)
        batches = [int(b) for b in args.batches.split(",")]
        sources = [torch.randint(4, args.vocab, (20,), generator=g).tolist() + [EOS_ID] for _ in range(max(batches))]
        for dtype in args.dtypes.split(","):
            backends = {v: TorchBackend(models[v], device, DTYPES[dtype], step_mode=args.mode, fuse=v == "prepared")
                        for v in VARIANTS}
            ops = {}
            if cuda:
                for v in VARIANTS:
                    eager = TorchBackend(models[v], device, DTYPES[dtype], step_mode="eager", fuse=v == "prepared")
                    ops[v] = device_ops_per_step(eager, sources[:min(32, max(batches))], decoding).get("per_step")
            for bs in batches:
                first = {v: [h[0].tokens for h in search(backends[v], pad_batch(sources[:bs]), decoding)]
                         for v in VARIANTS}  # also captures the graphs
                best: dict[str, tuple[float, int, float | None]] = {}
                for r in range(args.rounds):
                    for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                        t = timed_steps(backends[v], sources[:bs], decoding)
                        best[v] = min(best.get(v, t), t, key=lambda x: x[0])
                for v in VARIANTS:
                    seconds, steps, gpu = best[v]
                    rows.append({"preset": name, "dtype": dtype, "batch": bs, "beam": 4, "variant": v,
                                 "mode": args.mode, "step_ms": round(1000 * seconds / steps, 3),
                                 "gpu_ms": round(1000 * gpu / steps, 3) if gpu is not None else None,
                                 "device_ops_per_eager_step": ops.get(v),
                                 "identical_first_batch": sum(a == b for a, b in zip(first[v], first["as loaded"])),
                                 "sentences": bs})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            del backends
            if cuda:
                torch.cuda.empty_cache()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| shape | dtype | batch x beam | step ms, as loaded | prepared | GPU ms, as loaded | prepared | "
             "ops, as loaded | prepared | same tokens |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for a, b in zip(rows[::2], rows[1::2]):
        lines.append(f"| {a['preset']} | {a['dtype']} | {a['batch']} x 4 | {a['step_ms']} | {b['step_ms']} | "
                     f"{a['gpu_ms']} | {b['gpu_ms']} | {a['device_ops_per_eager_step']} | "
                     f"{b['device_ops_per_eager_step']} | {b['identical_first_batch']}/{b['sentences']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--presets", default="base,big")
    ap.add_argument("--dtypes", default="fp32,fp16")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mode", default="graph", choices=("graph", "static", "eager"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = measure(args)
    info = {"device": str(args.device), "torch": torch.__version__, "rows": rows,
            "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
            "command": "python scripts/gpu_step_ab.py " + " ".join(sys.argv[1:])}
    if args.json:
        args.json.write_text(json.dumps(info, indent=1) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

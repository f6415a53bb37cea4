"""The GPU check's Marian peer worker (a subprocess of `python scripts/gpu_check.py _worker marian`;
torch and transformers are imported inside it only): greedy agreement and generate() timing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from gpucheck.util import _threads


def worker_marian(p: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers

    from model.checkpoint import load_model, resolve_checkpoint
    from pipeline.evaluation import marian_peer
    from pipeline.evaluation.bench import make_sources
    from pipeline.textio import read_lines
    from runtime.tokenizer import Tokenizer
    from runtime.translate import encode_sources

    _threads(p)
    device = torch.device(p["device"])
    cuda = device.type == "cuda"
    if p["trained"] is not None:
        model, spm_bytes, _ = load_model(resolve_checkpoint(Path(p["trained"])), device="cpu")
        tokenizer = Tokenizer(spm_bytes)
        lines = [x for x in read_lines(Path(p["src"])) if x.strip()][: p["agree_sentences"]]
        refs = [x for x in read_lines(Path(p["ref"])) if x.strip()][: p["agree_sentences"]]
        sources = encode_sources(tokenizer, lines, model.cfg.max_positions, origin=p["src"]).ids
        targets = tokenizer.encode(refs)
        agreement_on = "test sentences of the trained model"
    else:  # no trained model (a rerun with --only, or training failed): the first random checkpoint
        preset, path = next(iter(p["checkpoints"].items()))
        model, spm_bytes, _ = load_model(Path(path), device="cpu")
        sources = make_sources(Tokenizer(spm_bytes), None, 8, 20, model.cfg.max_positions, seed=1)
        targets = [s[:-1] for s in sources]
        agreement_on = f"random sources, random {preset} weights"
    marian = marian_peer.to_marian(model).to(device)
    out: dict[str, Any] = {"transformers": transformers.__version__, "device": str(device),
                           "attn_implementation": getattr(marian.config, "_attn_implementation", None),
                           "agreement_on": agreement_on}
    out["agreement"] = marian_peer.greedy_agreement(model, marian, sources, max_len=40, device=device)
    out["teacher_forced_gap"] = marian_peer.teacher_forced_gap(model, marian, sources, targets, device=device)
    del marian
    rows = []
    for i, (preset, path) in enumerate(p["checkpoints"].items()):
        big, spm, _ = load_model(Path(path), device="cpu")
        n = max(p["sentences"][str(b)] for b in p["batches"])
        srcs = make_sources(Tokenizer(spm), None, n, 20, big.cfg.max_positions)
        peer = marian_peer.to_marian(big).to(device)
        if i == 0:  # the mapping on a paper-sized shape too (random weights: near-ties can flip a token)
            out["random_shape"] = preset
            out["random_agreement"] = marian_peer.greedy_agreement(big, peer, srcs[:4], max_len=20, device=device)
            out["random_teacher_forced_gap"] = marian_peer.teacher_forced_gap(big, peer, srcs[:4],
                                                                               [s[:-1] for s in srcs[:4]], device)
        del big
        for dtype in p["dtypes"]:
            peer = peer.to(torch.float16 if dtype == "fp16" else torch.float32)
            for bs in p["batches"]:
                if cuda:
                    torch.cuda.empty_cache()
                row = marian_peer.time_generate(peer, srcs[: p["sentences"][str(bs)]], bs, p["beam"], p["new_tokens"])
                row.update(preset=preset, dtype=dtype)
                rows.append(row)
                print(f"marian {preset} {dtype} batch {bs}: {row['target_tokens_per_s']:.0f} tok/s, "
                      f"{row['latency_ms_per_sentence']:.2f} ms/sentence, peak GPU {row['peak_gpu_mib']} MiB",
                      file=sys.stderr, flush=True)
        del peer
        if cuda:
            torch.cuda.empty_cache()
    out["rows"] = rows
    return out

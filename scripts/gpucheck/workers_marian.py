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


def worker_generate_file(p: dict[str, Any]) -> dict[str, Any]:
    """MarianMTModel.generate on the trained model's weights over a file's first lines, sorted by length as
    serve-batch batches them, at each batch size: beam 4, at most a * source + b new tokens per batch (our
    decoding's limits over its longest source), length penalty our alpha. The best batch's row is `best`."""
    import time

    import torch

    from model.checkpoint import load_model, resolve_checkpoint
    from pipeline.evaluation import marian_peer
    from pipeline.textio import read_lines
    from runtime.decoding import PAPER
    from runtime.tokenizer import Tokenizer
    from runtime.translate import encode_sources

    _threads(p)
    device = torch.device(p["device"])
    model, spm_bytes, _ = load_model(resolve_checkpoint(Path(p["trained"])), device="cpu")
    lines = [x for x in read_lines(Path(p["src"])) if x.strip()][: p["lines"]]
    ids = sorted(encode_sources(Tokenizer(spm_bytes), lines, model.cfg.max_positions, origin=p["src"]).ids, key=len)
    decode = p.get("decode") or {}  # serve-batch's limits where the check gives any (the untrained CPU model)
    a, b = float(decode.get("--max-len-a", PAPER.max_len_a)), int(decode.get("--max-len-b", PAPER.max_len_b))
    peer = marian_peer.to_marian(model).to(device, torch.float16 if p["dtype"] == "fp16" else torch.float32)
    rows = []
    for bs in p["batches"]:
        tokens, t0 = 0, time.perf_counter()
        for i in range(0, len(ids), bs):
            batch = ids[i: i + bs]
            new = max(1, int(a * max(map(len, batch)) + b))
            gen = marian_peer.generation_config(p["beam"], new, 0, PAPER.alpha)
            with torch.inference_mode():
                out = peer.generate(**marian_peer.inputs(batch, device), generation_config=gen)
            tokens += sum(len(marian_peer.strip(row)) for row in out.tolist())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        rows.append({"batch_size": bs, "sentences": len(ids), "target_tokens": tokens, "seconds": round(seconds, 2),
                     "sentences_per_s": round(len(ids) / seconds, 1),
                     "target_tokens_per_s": round(tokens / seconds, 1)})
        print(f"generate batch {bs}: {rows[-1]['sentences_per_s']} lines/s", file=sys.stderr, flush=True)
    return {"rows": rows, "best": max(rows, key=lambda r: r["target_tokens_per_s"]), "device": str(device),
            "dtype": p["dtype"], "how": "MarianMTModel.generate, the first batch included (no warm-up)"}

#!/usr/bin/env python
"""Benchmark CTranslate2 on the same model and inputs as `pipeline bench`.

Maps a pipeline model dir's weights (model.pt) to a CTranslate2 TransformerSpec
(post-norm, shared embeddings, our sinusoidal table), checks that CTranslate2's greedy
output equals our PyTorch model's on a few sentences (so the comparison is the same
model), then times translate_batch with fixed-length outputs. CTranslate2 is a benchmark
dependency only: `pip install ctranslate2`.

    python scripts/bench_ctranslate2.py MODEL_DIR --batch-size 32 --beam-size 4 \
        --fixed-length 30 --threads 2 --json ct2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.checkpoint import load_model  # noqa: E402
from model.manifest import CHECKPOINT_FILE  # noqa: E402
from pipeline.bench import make_sources, peak_rss_mb  # noqa: E402
from runtime.decoding import PAPER  # noqa: E402
from runtime.search import greedy_search  # noqa: E402
from runtime.tokenizer import Tokenizer  # noqa: E402
from runtime.torch_backend import TorchBackend  # noqa: E402
from runtime.translate import pad_batch  # noqa: E402


def to_ct2_spec(model, tokenizer: Tokenizer):
    from ctranslate2.specs import transformer_spec

    cfg = model.cfg
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.n_enc_layers, cfg.n_dec_layers), cfg.n_heads, pre_norm=False, no_final_norm=True)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    pe = model.pe.float().numpy()

    def linear(s, name):
        s.weight, s.bias = sd[f"{name}.weight"], sd[f"{name}.bias"]

    def fused(s, names):
        s.weight = np.concatenate([sd[f"{n}.weight"] for n in names])
        s.bias = np.concatenate([sd[f"{n}.bias"] for n in names])

    def norm(s, name):
        s.gamma, s.beta = sd[f"{name}.weight"], sd[f"{name}.bias"]

    def ffn(s, name, ln):
        linear(s.linear_0, f"{name}.w1")
        linear(s.linear_1, f"{name}.w2")
        norm(s.layer_norm, ln)

    emb = sd["embed.weight"]
    spec.encoder.embeddings[0].weight = emb
    spec.encoder.position_encodings.encodings = pe
    for i, layer in enumerate(spec.encoder.layer):
        p = f"encoder.{i}"
        fused(layer.self_attention.linear[0], [f"{p}.self_attn.{x}_proj" for x in "qkv"])
        linear(layer.self_attention.linear[1], f"{p}.self_attn.out_proj")
        norm(layer.self_attention.layer_norm, f"{p}.res_attn.norm")
        ffn(layer.ffn, f"{p}.ffn", f"{p}.res_ffn.norm")
    spec.decoder.embeddings.weight = emb
    spec.decoder.position_encodings.encodings = pe
    spec.decoder.projection.weight = emb
    spec.decoder.projection.bias = np.zeros(emb.shape[0], dtype=np.float32)
    for i, layer in enumerate(spec.decoder.layer):
        p = f"decoder.{i}"
        fused(layer.self_attention.linear[0], [f"{p}.self_attn.{x}_proj" for x in "qkv"])
        linear(layer.self_attention.linear[1], f"{p}.self_attn.out_proj")
        norm(layer.self_attention.layer_norm, f"{p}.res_self.norm")
        linear(layer.attention.linear[0], f"{p}.cross_attn.q_proj")
        fused(layer.attention.linear[1], [f"{p}.cross_attn.{x}_proj" for x in "kv"])
        linear(layer.attention.linear[2], f"{p}.cross_attn.out_proj")
        norm(layer.attention.layer_norm, f"{p}.res_cross.norm")
        ffn(layer.ffn, f"{p}.ffn", f"{p}.res_ffn.norm")
    vocab = [tokenizer.sp.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    spec.register_source_vocabulary(vocab)
    spec.register_target_vocabulary(vocab)
    spec.config.bos_token = tokenizer.sp.id_to_piece(tokenizer.sp.bos_id())
    spec.config.eos_token = tokenizer.sp.id_to_piece(tokenizer.sp.eos_id())
    spec.config.unk_token = tokenizer.sp.id_to_piece(tokenizer.sp.unk_id())
    spec.config.decoder_start_token = spec.config.bos_token
    return spec


def ct2_translator(model, tokenizer: Tokenizer, directory: Path, threads: int, compute_type: str = "float32"):
    """Convert `model` into `directory` and open it with CTranslate2 on the CPU."""
    import ctranslate2

    spec = to_ct2_spec(model, tokenizer)
    spec.validate()  # as ctranslate2's own converters do: check, then wrap the arrays
    spec.optimize(quantization=None)
    directory.mkdir(parents=True, exist_ok=True)
    spec.save(str(directory))
    return ctranslate2.Translator(str(directory), device="cpu", compute_type=compute_type,
                                  intra_threads=threads, inter_threads=1)


def greedy_agreement(model, tokenizer: Tokenizer, translator, sources: list[list[int]], max_len: int = 20) -> int:
    """Sentences whose greedy output is token-identical in CTranslate2 and our PyTorch model:
    proof that the benchmark compares the same model."""
    piece = tokenizer.sp.id_to_piece
    ours = greedy_search(TorchBackend(model), pad_batch(sources), max_len_a=0.0, max_len_b=max_len)
    theirs = translator.translate_batch([[piece(i) for i in s] for s in sources], beam_size=1,
                                        max_decoding_length=max_len)
    return sum(o[0].tokens == [tokenizer.sp.piece_to_id(p) for p in t.hypotheses[0]]
               for o, t in zip(ours, theirs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--beam-size", type=int, default=PAPER.beam_size)
    ap.add_argument("--fixed-length", type=int, default=None)
    ap.add_argument("--src", type=Path, default=None)
    ap.add_argument("--sentences", type=int, default=256)
    ap.add_argument("--src-len", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compute-type", default="float32")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import ctranslate2

    model, spm_bytes, _ = load_model(args.model_dir / CHECKPOINT_FILE)
    tokenizer = Tokenizer(spm_bytes)
    sources = make_sources(tokenizer, args.src, args.sentences, args.src_len, model.cfg.max_positions)
    piece = tokenizer.sp.id_to_piece
    src_tokens = [[piece(i) for i in s] for s in sources]

    with tempfile.TemporaryDirectory() as tmp:
        translator = ct2_translator(model, tokenizer, Path(tmp), args.threads, args.compute_type)
        check = sources[:16]
        agree = greedy_agreement(model, tokenizer, translator, check)
        print(f"greedy agreement with the PyTorch model: {agree}/{len(check)} sentences")

        opts = dict(beam_size=args.beam_size, max_batch_size=args.batch_size, length_penalty=PAPER.alpha)
        if args.fixed_length:
            opts.update(max_decoding_length=args.fixed_length, min_decoding_length=args.fixed_length)
        translator.translate_batch(src_tokens[: args.batch_size], **opts)  # warm-up
        latencies, tokens = [], 0
        t0 = time.perf_counter()
        for i in range(0, len(src_tokens), args.batch_size):
            t = time.perf_counter()
            out = translator.translate_batch(src_tokens[i: i + args.batch_size], **opts)
            latencies.append((time.perf_counter() - t) * 1000)
            tokens += sum(len(r.hypotheses[0]) for r in out)
        seconds = time.perf_counter() - t0

    result = {
        "backend": f"ctranslate2-{ctranslate2.__version__}", "compute_type": args.compute_type,
        "batch_size": args.batch_size, "beam_size": args.beam_size, "fixed_length": args.fixed_length,
        "threads": args.threads, "sentences": len(src_tokens), "target_tokens": tokens,
        "seconds": round(seconds, 3), "target_tokens_per_s": round(tokens / seconds, 1),
        "sentences_per_s": round(len(src_tokens) / seconds, 2),
        "latency_ms_mean": round(statistics.fmean(latencies), 2), "peak_rss_mb": peak_rss_mb(),
        "greedy_agreement": f"{agree}/{len(check)}", "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""The same weights in Hugging Face transformers' MarianMTModel: a peer for our torch backend on the
same card (scripts/gpu_check.py, docs/gpu.md).

Marian (transformers/models/marian/modeling_marian.py) is the paper's Transformer as ours is:
post-LN blocks (residual + sublayer, then LayerNorm, no final encoder/decoder norm, no
layernorm_embedding), embeddings scaled by sqrt(d_model) (`scale_embedding=True`), one embedding
shared by encoder, decoder and the output projection (`share_encoder_decoder_embeddings`,
`tie_word_embeddings`), a zero `final_logits_bias`, Q/K/V/out projections with biases and the
query scaled by d_head^-0.5, fc1 -> activation -> fc2 (`activation_function="relu"`), positions
from a frozen sinusoidal table indexed from 0 in encoder and decoder. Two things differ and are
set here: Marian's table puts all sines before all cosines, ours interleaves them (PE(pos, 2i) sin,
PE(pos, 2i+1) cos), so the table is overwritten with ours; and the special ids are ours (PAD 0,
UNK 1, BOS 2 = the decoder start, EOS 3; no forced EOS, which Marian's config sets to 0 by default).

`to_marian` copies every Marian parameter from ours and fails on any it cannot map, so a renamed
field in a later transformers is an error, not a random weight. `greedy_agreement` is the proof
that both compute the same model: token-identical greedy output on the same sources.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from model.config import BOS_ID, EOS_ID, PAD_ID
from model.errors import UserError
from pipeline.importers.marian_weights import EMBEDDINGS, LOGITS_BIAS, POSITIONS, layer_name
from runtime.search import greedy_search
from runtime.translate import pad_batch


def import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise UserError("the Marian peer needs Hugging Face transformers: pip install 'transformers>=4.46' "
                        "(it is in the dev extra)") from None
    return transformers


def marian_config(cfg: Any) -> Any:
    """A MarianConfig of our ModelConfig's shape and ids, dropout off (inference)."""
    transformers = import_transformers()
    return transformers.MarianConfig(
        vocab_size=cfg.vocab_size, decoder_vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_positions,
        d_model=cfg.d_model, encoder_layers=cfg.n_enc_layers, decoder_layers=cfg.n_dec_layers,
        encoder_attention_heads=cfg.n_heads, decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff, activation_function="relu",
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
        scale_embedding=True, share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
        pad_token_id=cfg.pad_id, eos_token_id=cfg.eos_id, bos_token_id=cfg.bos_id,
        decoder_start_token_id=cfg.bos_id, forced_eos_token_id=None, use_cache=True, is_encoder_decoder=True,
    )


def our_name(marian_name: str) -> str | None:
    """The name in our state dict of a Marian parameter or buffer; None for the embedding (tied),
    the position tables and final_logits_bias, which to_marian sets itself."""
    if marian_name in EMBEDDINGS or marian_name in POSITIONS or marian_name == LOGITS_BIAS:
        return None
    name = layer_name(marian_name)
    if name is not None:
        return name
    raise UserError(f"MarianMTModel has a tensor {marian_name!r} that the mapping from our model does not know; "
                    "this transformers version changed Marian's layout")


def to_marian(model: Any) -> Any:
    """A MarianMTModel (eval, fp32, on the CPU) computing `model` (model.Transformer) exactly."""
    import torch

    transformers = import_transformers()
    cfg = model.cfg
    marian = transformers.MarianMTModel(marian_config(cfg)).eval()
    ours = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    emb = ours["embed.weight"]
    pe = model.pe.detach().float().cpu()[: cfg.max_positions]
    with torch.no_grad():
        for name, tensor in list(marian.named_parameters()) + list(marian.named_buffers()):
            if name in EMBEDDINGS:
                value = emb
            elif name in POSITIONS:
                value = pe
            elif name == LOGITS_BIAS:
                value = torch.zeros_like(tensor)
            else:
                value = ours[our_name(name) or ""]
            if tuple(value.shape) != tuple(tensor.shape):
                raise UserError(f"{name}: Marian expects {tuple(tensor.shape)}, ours is {tuple(value.shape)}")
            tensor.copy_(value)
    return marian


def generation_config(num_beams: int, max_new_tokens: int, min_new_tokens: int = 0, length_penalty: float = 1.0,
                      ) -> Any:
    """Search as ours: our special ids, no sampling, no forced BOS/EOS, no repetition rules."""
    transformers = import_transformers()
    return transformers.GenerationConfig(
        num_beams=num_beams, do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
        length_penalty=length_penalty, early_stopping=num_beams > 1, num_return_sequences=1,
        pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=BOS_ID, decoder_start_token_id=BOS_ID,
        forced_bos_token_id=None, forced_eos_token_id=None, no_repeat_ngram_size=0, repetition_penalty=1.0,
        use_cache=True,
    )


def inputs(sources: list[list[int]], device: Any) -> dict[str, Any]:
    """input_ids (padded with PAD) and attention_mask for generate."""
    import torch

    ids = torch.from_numpy(pad_batch(sources)).to(device)
    return {"input_ids": ids, "attention_mask": ids.ne(PAD_ID).long()}


def strip(row: list[int]) -> list[int]:
    """A generate row without the decoder start, cut at the first EOS (padding after it dropped)."""
    out = []
    for token in row[1:]:
        if token == EOS_ID:
            break
        out.append(token)
    return out


def marian_greedy(marian: Any, sources: list[list[int]], max_len: int) -> list[list[int]]:
    """Marian's greedy output: up to max_len tokens per source (our limit: max_len_a 0, max_len_b max_len)."""
    import torch

    device = next(marian.parameters()).device
    with torch.inference_mode():
        out = marian.generate(**inputs(sources, device), generation_config=generation_config(1, max_len))
    return [strip(row) for row in out.tolist()]


def greedy_agreement(model: Any, marian: Any, sources: list[list[int]], max_len: int = 40,
                     device: Any = "cpu") -> dict[str, Any]:
    """Greedy output of our torch backend (model on `device`, fp32) and of Marian on the same sources:
    how many sentences are token-identical, and the first that is not."""
    from runtime.torch_backend import TorchBackend

    ours = [h[0].tokens for h in greedy_search(TorchBackend(model, device), pad_batch(sources), max_len_a=0.0,
                                                 max_len_b=max_len)]
    theirs = marian_greedy(marian.to(device), sources, max_len)
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    first = None
    if differ:
        i = differ[0]
        first = {"sentence": i, "ours": ours[i], "marian": theirs[i]}
    return {"sentences": len(sources), "identical": len(sources) - len(differ), "max_len": max_len,
            "tokens": sum(len(x) for x in ours), "first_difference": first}


def teacher_forced_gap(model: Any, marian: Any, sources: list[list[int]], targets: list[list[int]],
                       device: Any = "cpu") -> float:
    """Largest |log-prob difference| between our model and Marian teacher-forced on (source, BOS +
    target) pairs, over real (non-pad) target positions: the mapping's error, free of argmax ties."""
    import torch

    src = torch.from_numpy(pad_batch(sources)).to(device)
    tgt_in = torch.from_numpy(pad_batch([[BOS_ID] + t for t in targets])).to(device)
    model = model.to(device).eval()
    marian = marian.to(device).eval()
    with torch.inference_mode():
        ours = model(src, tgt_in).float().log_softmax(-1)
        # no decoder mask beyond the causal one, as ours: padding only follows a target's real tokens
        theirs = marian(input_ids=src, attention_mask=src.ne(PAD_ID).long(), decoder_input_ids=tgt_in,
                        use_cache=False).logits.float().log_softmax(-1)
    real = torch.from_numpy(pad_batch([[1] * (len(t) + 1) for t in targets])).to(device).bool()
    return float((ours - theirs).abs()[real].max())


def time_generate(marian: Any, sources: list[list[int]], batch_size: int, beam_size: int,
                  new_tokens: int, length_penalty: float = 0.6) -> dict[str, Any]:
    """generate() timed as `pipeline bench` times our search: one warm-up batch, then every batch of
    `sources`, exactly `new_tokens` tokens per sentence (min_new_tokens = max_new_tokens); peak GPU
    memory (torch.cuda.max_memory_allocated, weights included) on CUDA."""
    import torch

    device = next(marian.parameters()).device
    cuda = device.type == "cuda"
    gen = generation_config(beam_size, new_tokens, new_tokens, length_penalty)

    def run(batch: list[list[int]]) -> Any:
        with torch.inference_mode():
            out = marian.generate(**inputs(batch, device), generation_config=gen)
        if cuda:
            torch.cuda.synchronize(device)
        return out

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    run(sources[:batch_size])
    latencies, tokens = [], 0
    t0 = time.perf_counter()
    for i in range(0, len(sources), batch_size):
        t = time.perf_counter()
        out = run(sources[i: i + batch_size])
        latencies.append((time.perf_counter() - t) * 1000)
        tokens += sum(len(strip(row)) for row in out.tolist())
    seconds = time.perf_counter() - t0
    return {
        "engine": "marian", "batch_size": batch_size, "beam_size": beam_size, "sentences": len(sources),
        "target_tokens": tokens, "seconds": round(seconds, 3),
        "target_tokens_per_s": round(tokens / seconds, 1), "sentences_per_s": round(len(sources) / seconds, 2),
        "latency_ms_mean": round(statistics.fmean(latencies), 2),
        "latency_ms_per_sentence": round(seconds * 1000 / len(sources), 2),
        "peak_gpu_mib": round(torch.cuda.max_memory_allocated(device) / 2 ** 20, 1) if cuda else None,
        "attn_implementation": getattr(marian.config, "_attn_implementation", None),
    }


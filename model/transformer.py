"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), post-LN.

Read top to bottom: positions, the two layer kinds, the model (attention: model/attention.py). The model
offers the teacher-forced `forward` used in training and three plain-tensor inference
functions that the PyTorch backend, the ONNX export and hence TensorRT all run:

    encode(src_ids)                 -> memory, src_bias
    cross_kv(memory)                -> per decoder layer cross-attention K and V, once per
                                       sentence (its beam's hypotheses share them)
    decode_step(tokens, step, ...)  -> next-token log-probs and the step's self-attention K/V

Self-attention cache (model/cache.py): every step's keys and values are written once into
per-layer buffers that beam search never reorders; each hypothesis gathers its ancestors'
keys by an index, and attends to its own key of the step too, which decode_step computes,
scores separately and returns for the caller to store.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.attention import MultiHeadAttention
from model.config import MASK_VALUE, ModelConfig


def sinusoidal_positions(n_positions: int, d_model: int, layout: str = "interleaved", offset: int = 0) -> Tensor:
    """Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same).

    layout "halves" holds the same values as Marian lays them out: all the sines, then all
    the cosines, computed as Marian computes them (numpy float64, then fp32). Layout "fairseq" is
    fairseq's (M2M-100, NLLB): frequencies 10000^(-i / (d/2 - 1)), sines then cosines, in fp32 as
    fairseq computes them. Row t is position t + offset (M2M-100's table starts at padding id + 1)."""
    if layout == "fairseq":
        half = d_model // 2
        freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -(math.log(10000) / (half - 1)))
        angle = torch.arange(offset, offset + n_positions, dtype=torch.int64).float().unsqueeze(1) * freq[None, :]
        return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1)
    if offset:
        return sinusoidal_positions(n_positions + offset, d_model, layout)[offset:]
    if layout == "halves":
        j = np.arange(d_model) // 2 * 2
        angle = np.arange(n_positions)[:, None] / np.power(10000, j / d_model)[None, :]  # (P, d)
        return torch.from_numpy(np.concatenate([np.sin(angle[:, 0::2]), np.cos(angle[:, 1::2])], axis=1)).float()
    pos = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (d/2,)
    angle = pos / torch.pow(10000.0, two_i / d_model)  # (P, d/2)
    pe = torch.zeros(n_positions, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)
    return pe.float()


def padding_bias(src_ids: Tensor, pad_id: int) -> Tensor:
    """(B, S) fp32 additive bias: 0 for tokens, MASK_VALUE for padding."""
    return src_ids.eq(pad_id).float() * MASK_VALUE


def causal_bias(length: int, device: torch.device | None = None) -> Tensor:
    """(T, T) fp32 additive bias: position i may attend to positions <= i only."""
    future = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
    return future.float() * MASK_VALUE


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm computed in fp32 whatever the parameters' dtype (fp16-safe post-LN)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(),
                            self.bias.float(), self.eps)


class Dropout(nn.Dropout):
    """Section 5.4's residual dropout: nn.Dropout, with a cheaper mask on CPU.

    PyTorch's CPU dropout draws its mask with `bernoulli_`, one generator call per element, a
    noticeable part of a CPU training step (docs/training.md). Here each element gets 16 random
    bits (four per drawn int64) compared with a threshold: the same inverted dropout, with the drop
    probability rounded to a multiple of 1/65536 (within 8e-6 of p) and the survivors scaled
    by the inverse of the rounded keep probability, so the expectation is unchanged. It draws
    from the same global generator, so seeding and checkpointed RNG state keep training
    reproducible. Other devices keep F.dropout (fused and fast there)."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0 or x.device.type != "cpu":
            return super().forward(x)
        threshold = min(round(self.p * 65536), 65535)
        n = x.numel()
        bits = torch.randint(-2 ** 63, 2 ** 63 - 1, ((n + 3) // 4,), dtype=torch.int64)
        keep = bits.view(torch.int16)[:n].view(x.shape) >= threshold - 32768
        return x * keep * (65536 / (65536 - threshold))


ACTIVATION_FUNCTIONS = {"relu": F.relu, "swish": F.silu, "gelu": F.gelu}  # ModelConfig.activation


class FeedForward(nn.Module):
    """Section 3.3: FFN(x) = max(0, x W1 + b1) W2 + b2 (ReLU; imported models may use another
    activation, ModelConfig.activation)."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu"):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff)
        self.w2 = nn.Linear(d_ff, d_model)
        self.act = ACTIVATION_FUNCTIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.act(self.w1(x)))


class Residual(nn.Module):
    """Section 5.4 and 3.1: LayerNorm(x + Dropout(Sublayer(x))), the sum taken in fp32 (post-LN).
    Pre-LN (ModelConfig.pre_norm: M2M-100, NLLB): x + Dropout(Sublayer(LayerNorm(x))). A layer
    feeds its sublayer `inp(x)` and closes the block with `self(x, sublayer_out)` either way."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool = False):
        super().__init__()
        self.norm = LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.pre_norm = pre_norm

    def inp(self, x: Tensor) -> Tensor:
        """What the sublayer reads: x, or LayerNorm(x) before it (pre-LN)."""
        return self.norm(x).to(x.dtype) if self.pre_norm else x

    def forward(self, x: Tensor, sublayer_out: Tensor) -> Tensor:
        if self.pre_norm:
            return (x.float() + self.dropout(sublayer_out)).to(x.dtype)
        return self.norm(x.float() + self.dropout(sublayer_out)).to(x.dtype)  # fp32 + fp16 promotes


class EncoderLayer(nn.Module):
    """Section 3.1: self-attention and feed-forward, each in a post-LN residual block."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.encoder_heads)
        self.ffn = FeedForward(cfg.d_model, cfg.encoder_d_ff, cfg.activation)
        self.res_attn = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)
        self.res_ffn = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        h = self.res_attn.inp(x)
        k, v = self.self_attn.project_kv(h)
        x = self.res_attn(x, self.self_attn(h, k, v, bias))
        return self.res_ffn(x, self.ffn(self.res_ffn.inp(x)))


class DecoderLayer(nn.Module):
    """Section 3.1: masked self-attention, encoder-decoder attention, feed-forward."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation)
        self.res_self = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)
        self.res_cross = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)
        self.res_ffn = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)

    def forward(self, x: Tensor, self_bias: Tensor, cross_k: Tensor, cross_v: Tensor, cross_bias: Tensor) -> Tensor:
        """Teacher forcing: x (B, T, d_model) over its own keys and values."""
        h = self.res_self.inp(x)
        k, v = self.self_attn.project_kv(h)
        x = self.res_self(x, self.self_attn(h, k, v, self_bias))
        return self.cross_and_ffn(x, cross_k, cross_v, cross_bias)

    def step(self, x: Tensor, past_k: Tensor, past_v: Tensor, past_index: Tensor, past_bias: Tensor,
             cross_k: Tensor, cross_v: Tensor, cross_bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """One decoder step: x (N, 1, d_model) over the beam cache (MultiHeadAttention.step_self);
        returns x and the step's self-attention keys and values (N, d_model)."""
        attn, k_t, v_t = self.self_attn.step_self(self.res_self.inp(x), past_k, past_v, past_index, past_bias)
        x = self.res_self(x, attn)
        return self.cross_and_ffn(x, cross_k, cross_v, cross_bias), k_t, v_t

    def cross_and_ffn(self, x: Tensor, cross_k: Tensor, cross_v: Tensor, cross_bias: Tensor) -> Tensor:
        """x (N, Tq, d_model); cross_k/cross_v (B, H, S, d_head) with N a multiple of B:
        rows b*N/B .. (b+1)*N/B - 1 of x belong to sentence b (a beam's hypotheses)."""
        # A sentence's hypotheses share its cross K/V: fold them into the query length
        # (B, rows * Tq, d_model), one matmul per sentence and no per-beam K/V copies.
        # The rows factor comes from the shapes, so the graph has no control flow.
        grouped = self.res_cross.inp(x).reshape(cross_k.shape[0], -1, x.shape[-1])
        x = self.res_cross(x, self.cross_attn(grouped, cross_k, cross_v, cross_bias).reshape(x.shape))
        return self.res_ffn(x, self.ffn(self.res_ffn.inp(x)))


class Transformer(nn.Module):
    """Section 3: encoder-decoder with one shared embedding / pre-softmax matrix (3.4)."""

    logits_bias: Tensor | None
    suppress: Tensor | None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.register_buffer("pe", sinusoidal_positions(cfg.max_positions, cfg.d_model, cfg.positions,
                                                        cfg.position_offset), persistent=False)
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        # weights of an imported model, saved with the checkpoint (None: not in the state dict)
        self.register_buffer("logits_bias", torch.zeros(cfg.vocab_size) if cfg.logits_bias else None)
        suppress = None
        if cfg.suppress_ids:  # added to the step's log-probs: -inf where an id must never be generated
            suppress = torch.zeros(cfg.vocab_size)
            suppress[list(cfg.suppress_ids)] = float("-inf")
        self.register_buffer("suppress", suppress, persistent=False)
        self.emb_dropout = Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_dec_layers))
        # pre-LN: each stack ends with a LayerNorm (its output is otherwise the un-normalised residual stream)
        self.enc_norm = LayerNorm(cfg.d_model) if cfg.pre_norm else None
        self.dec_norm = LayerNorm(cfg.d_model) if cfg.pre_norm else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Xavier for projections; embeddings N(0, d^-1/2) so that after the sqrt(d)
        # scaling of section 3.4 they have unit variance, like the positions they join.
        for name, p in self.named_parameters():
            if p.dim() > 1 and not name.startswith("embed"):
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        nn.init.normal_(self.embed.weight, mean=0.0, std=self.cfg.d_model ** -0.5)
        with torch.no_grad():
            self.embed.weight[self.cfg.pad_id].zero_()

    # -- pieces shared by training and inference -------------------------------------

    def embed_tokens(self, ids: Tensor, positions: Tensor) -> Tensor:
        """Section 3.4/3.5: embedding * sqrt(d_model) + PE[positions]. ids (B, T)."""
        x = self.embed(ids) * self.embed_scale
        x = x + self.pe[positions].to(x.dtype)
        return self.emb_dropout(x)

    def logits(self, x: Tensor, candidates: Tensor | None = None) -> Tensor:
        """Pre-softmax projection tied to the embedding (section 3.4), plus the imported
        models' logits bias; fp32 out. With `candidates` (C,) int64, onto those target ids only
        (a vocabulary shortlist): their embedding rows, gathered, and their biases."""
        if candidates is None:
            weight, bias = self.embed.weight, self.logits_bias
        else:
            weight = self.embed(candidates)  # (C, d_model): a Gather on the tied embedding
            bias = None if self.logits_bias is None else self.logits_bias[candidates]
        logits = F.linear(x, weight).float()
        return logits if bias is None else logits + bias.float()

    # -- inference functions (exported) ------------------------------------------------

    def encode(self, src_ids: Tensor) -> tuple[Tensor, Tensor]:
        """src_ids (B, S) padded with pad_id -> memory (B, S, d_model), src_bias (B, S) fp32."""
        src_bias = padding_bias(src_ids, self.cfg.pad_id)
        positions = torch.arange(src_ids.shape[1], device=src_ids.device)
        x = self.embed_tokens(src_ids, positions)
        bias = src_bias[:, None, None, :]  # (B, 1, 1, S)
        for layer in self.encoder:
            x = layer(x, bias)
        return self._closed(x, self.enc_norm), src_bias

    @staticmethod
    def _closed(x: Tensor, norm: LayerNorm | None) -> Tensor:
        """A stack's output: pre-LN models' final LayerNorm, else x as it is."""
        return x if norm is None else norm(x).to(x.dtype)

    def cross_kv(self, memory: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Every decoder layer's cross-attention K and V, (B, H, S, d_head) each, once."""
        ks, vs = [], []
        for layer in self.decoder:
            k, v = layer.cross_attn.project_kv(memory)
            ks.append(k)
            vs.append(v)
        return ks, vs

    def decode_step(self, tokens: Tensor, step: Tensor, self_index: Tensor, self_bias: Tensor,
                    self_k: list[Tensor], self_v: list[Tensor],
                    cross_k: list[Tensor], cross_v: list[Tensor], src_bias: Tensor,
                    candidates: Tensor | None = None) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """One decoder step for N hypotheses over the beam cache (model/cache.py).

        tokens (N,) int64: each hypothesis' last token; step (1,) int64: its position.
        self_index (N, H, T) int64 and self_bias (N, T) fp32: where each hypothesis' earlier
        keys are in the flattened buffers, and their bias (model/cache.py).
        self_k/self_v: per layer (B, H, R, d_head), the buffers of earlier steps.
        cross_k/cross_v: per layer (B, H, S, d_head), once per sentence; src_bias (B, S)
        fp32. N = B x rows: hypotheses rows*b .. rows*b + rows - 1 belong to sentence b.
        Returns log-probs (N, V) fp32 and per layer this step's keys and values (N, d_model).
        candidates (C,) int64: score only these target ids (a vocabulary shortlist,
        runtime/shortlist.py); the log-probs are then (N, C), normalised over them.
        """
        x = self.embed_tokens(tokens[:, None], step)  # (N, 1, d_model)
        cross_bias = src_bias[:, None, None, :]
        step_k, step_v = [], []
        for layer, past_k, past_v, ck, cv in zip(self.decoder, self_k, self_v, cross_k, cross_v):
            x, k_t, v_t = layer.step(x, past_k, past_v, self_index, self_bias, ck, cv, cross_bias)
            step_k.append(k_t)
            step_v.append(v_t)
        x = self._closed(x[:, 0], self.dec_norm)
        log_probs = self.logits(x, candidates).log_softmax(dim=-1)  # (N, V or C) fp32
        if self.suppress is not None:  # after the softmax, as transformers' bad_words_ids: others keep theirs
            log_probs = log_probs + (self.suppress if candidates is None else self.suppress[candidates]).float()
        return log_probs, step_k, step_v

    # -- training ---------------------------------------------------------------------

    def forward(self, src_ids: Tensor, tgt_in: Tensor, rows: Tensor | None = None) -> Tensor:
        """Teacher forcing: src (B, S), tgt_in (B, T) starting with BOS -> logits (B, T, V) fp32.

        With `rows`, a (B, T) bool mask (the target positions that are not padding), only
        those positions are projected onto the vocabulary: logits (rows.sum(), V). Training
        passes it, so the largest matmul and the loss skip the batch's padding."""
        memory, src_bias = self.encode(src_ids)
        cross_k, cross_v = self.cross_kv(memory)
        t = tgt_in.shape[1]
        positions = torch.arange(t, device=tgt_in.device)
        x = self.embed_tokens(tgt_in, positions)
        # Queries attend to earlier positions only. Padding in the target needs no key
        # mask: a padded position is only ever attended to by later padded positions.
        self_bias = causal_bias(t, tgt_in.device)  # (T, T)
        cross_bias = src_bias[:, None, None, :]
        for layer, ck, cv in zip(self.decoder, cross_k, cross_v):
            x = layer(x, self_bias, ck, cv, cross_bias)
        x = self._closed(x, self.dec_norm)
        return self.logits(x if rows is None else x[rows])


def select_candidates(log_probs: Tensor, k: int, eos_id: int,
                      candidates: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """What leaves the decoder step for search: each row's top-k log-probs and ids, and
    the EOS log-prob (needed to force EOS at the length limit). k is a constant so the
    TopK node has a build-time K, as TensorRT requires. Over a shortlist (log_probs (N, C) of
    `candidates`, whose first id is EOS), the ids are mapped back to the vocabulary's."""
    if candidates is None:
        top_lp, top_ids = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)  # sorted, descending
        return top_lp, top_ids, log_probs[:, eos_id]
    top_lp, top_pos = log_probs.topk(k, dim=-1)  # callers pass at least k candidates
    return top_lp, candidates.index_select(0, top_pos.flatten()).view(top_pos.shape), log_probs[:, 0]


def build_model(cfg: ModelConfig) -> Transformer:
    """The make_model factory: a Transformer with the paper's initialisation."""
    return Transformer(cfg)

"""Section 3.2: scaled dot-product attention and multi-head attention, with the decoder's one-step
self-attention over the beam cache (model/cache.py) and, for inference, q, k and v fused into one GEMM."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import MASK_VALUE


def attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
    """Section 3.2.1, scaled dot-product attention; softmax in fp32.

    q (B, H, Tq, d_head), k and v (B, H, Tk, d_head), bias fp32 broadcastable to
    (B, H, Tq, Tk). The scale is applied to q before the matmul so fp16 scores stay small.
    """
    q = q * (1.0 / math.sqrt(q.shape[-1]))
    scores = torch.matmul(q, k.transpose(-1, -2)) + bias.float()  # (B, H, Tq, Tk) fp32: the sum promotes
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs, v)  # (B, H, Tq, d_head)


class MultiHeadAttention(nn.Module):
    """Section 3.2.2: h parallel heads of d_model / h dimensions, then an output projection."""

    qkv: tuple[Tensor, Tensor] | None = None  # fuse_qkv_: the weight and bias q, k and v are views of
    compile_fused = False  # trust qkv under torch.compile (set by the compiled step, which checked it eagerly)
    sdpa_step = False  # under torch.compile: each attention one fused kernel (set by the compiled step)

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def fuse_qkv_(self) -> None:
        """For inference: make the q, k and v projections views of one (3 d_model, d_model) weight and
        one bias, so that a decoder step projects with one GEMM instead of three (on a GPU, fewer and
        larger kernels; on the CPU the same bits). Names, shapes, values and state_dict are unchanged.
        `.to()` to another device or dtype afterwards copies the parameters apart: the step then
        projects separately again until fused again. Not for a model being trained (its optimizer
        holds the parameter objects this replaces)."""
        if self._qkv_fused():
            return
        lins = (self.q_proj, self.k_proj, self.v_proj)
        with torch.no_grad():
            weight = torch.cat([lin.weight for lin in lins])
            bias = torch.cat([lin.bias for lin in lins])
        d = self.q_proj.out_features
        for i, lin in enumerate(lins):
            lin.weight = nn.Parameter(weight[i * d:(i + 1) * d], requires_grad=False)
            lin.bias = nn.Parameter(bias[i * d:(i + 1) * d], requires_grad=False)
        self.qkv = (weight, bias)

    def _qkv_fused(self) -> bool:
        """Whether q, k and v are still the views fuse_qkv_ made (not when traced for export)."""
        if self.qkv is None:
            return False
        if torch.compiler.is_compiling():  # data pointers cannot be traced: the compiled step's word for it
            return self.compile_fused
        weight, bias = self.qkv
        d, size = self.q_proj.out_features, weight.element_size()
        w0, b0 = weight.data_ptr(), bias.data_ptr()
        return all(lin.weight.dtype == weight.dtype and lin.weight.data_ptr() == w0 + i * d * weight.shape[1] * size
                   and lin.bias.data_ptr() == b0 + i * d * size
                   for i, lin in enumerate((self.q_proj, self.k_proj, self.v_proj)))

    def _sdpa(self) -> bool:
        """Only while torch.compile traces the compiled step (runtime/static_step.py); the eager and the
        exported step keep the explicit arithmetic, with its fp32 scores."""
        return self.sdpa_step and torch.compiler.is_compiling()

    def split_heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, T, d_head)

    def merge_heads(self, x: Tensor) -> Tensor:
        b, _, t, _ = x.shape
        return x.transpose(1, 2).reshape(b, t, self.n_heads * self.d_head)  # (B, T, d_model)

    def project_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.split_heads(self.k_proj(x)), self.split_heads(self.v_proj(x))

    def forward(self, x: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        """Queries from x (B, Tq, d_model) over already projected k, v (B, H, Tk, d_head)."""
        q = self.split_heads(self.q_proj(x))
        if self.training:
            # Fused kernel for training speed; inference keeps the explicit path that is
            # exported (export always traces an eval() copy), so the PyTorch backend runs
            # the same arithmetic as the graphs.
            mask = (bias > MASK_VALUE / 2).expand(q.shape[0], 1, q.shape[2], k.shape[2])
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self._sdpa():  # the compiled step: one kernel instead of two matmuls and a softmax
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))
        else:
            out = attend(q, k, v, bias)
        return self.out_proj(self.merge_heads(out))

    def step_self(self, x: Tensor, past_k: Tensor, past_v: Tensor, past_index: Tensor, past_bias: Tensor
                  ) -> tuple[Tensor, Tensor, Tensor]:
        """One decoder step of self-attention over the beam cache (model/cache.py).

        x (N, 1, d_model); past_k/past_v (B, H, R, d_head), the cache buffers; past_index
        (N, H, T) int64, the rows of the flattened buffers holding each hypothesis' earlier
        keys per head; past_bias (N, T) fp32. The step's own key is scored apart. Returns
        the attention output (N, 1, d_model) and the step's keys and values (N, d_model)."""
        n = x.shape[0]
        if self._qkv_fused():  # one GEMM (fuse_qkv_); the export fuses the three MatMuls itself
            q, k_t, v_t = F.linear(x, *self.qkv).split(self.q_proj.out_features, dim=-1)  # type: ignore[misc]
        else:  # (N, 1, d_model) each, as in training
            q, k_t, v_t = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        k_h, v_h = self.split_heads(k_t), self.split_heads(v_t)
        rows = past_index.reshape(-1)
        shape = (n, self.n_heads, -1, self.d_head)
        k = past_k.reshape(-1, self.d_head).index_select(0, rows).view(shape)  # (N, H, T, d_head)
        v = past_v.reshape(-1, self.d_head).index_select(0, rows).view(shape)
        if self._sdpa():  # the step's own key first, unmasked; one fused attention kernel
            mask = F.pad(past_bias, (1, 0))[:, None, None, :].to(q.dtype)
            out = F.scaled_dot_product_attention(self.split_heads(q), torch.cat([k_h, k], dim=2),
                                                 torch.cat([v_h, v], dim=2), attn_mask=mask)
            return self.out_proj(self.merge_heads(out)), k_t.reshape(n, -1), v_t.reshape(n, -1)
        q_h = self.split_heads(q) * (1.0 / math.sqrt(self.d_head))  # (N, H, 1, d_head)
        # fp32 from here: a sum or product with an fp32 operand promotes (no separate casts in fp16)
        past = torch.matmul(q_h, k.transpose(-1, -2)) + past_bias.float()[:, None, None, :]  # (N, H, 1, T)
        own = (q_h.float() * k_h).sum(dim=-1, keepdim=True)  # (N, H, 1, 1)
        probs = torch.cat([own, past], dim=-1).softmax(dim=-1)
        # the two parts summed in fp32 and rounded once, as one matmul over both would
        out = torch.matmul(probs[..., 1:].to(v.dtype), v) + probs[..., :1] * v_h
        out = out.to(v_t.dtype)  # (N, H, 1, d_head)
        return self.out_proj(self.merge_heads(out)), k_t.reshape(n, -1), v_t.reshape(n, -1)

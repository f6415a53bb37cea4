"""One optimizer update (sections 5.3, 5.4): the learning-rate schedule, the label-smoothed
loss, mixed precision, gradient clipping, and skipping updates that are not finite.

The loss of an update is the sum of label-smoothed token losses over every micro-batch
of every rank, divided by the target-token count of that whole global batch (all-reduced
before backward) and multiplied by the world size (DDP averages gradients). One process
with the global batch and N processes with its shards therefore make the same update.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from model.config import PAD_ID
from model.errors import UserError
from model.transformer import Transformer
from pipeline.corpus.data import Batch
from pipeline.distributed import DistContext

SCHEDULES = ("rsqrt", "linear")


def learning_rate(step: int, d_model: int, warmup: int, scale: float = 1.0, schedule: str = "rsqrt",
                  decay_steps: int | None = None) -> float:
    """Section 5.3 (`rsqrt`): lr = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step >= 1.

    `linear` warms up the same way, then falls in a straight line from that peak to zero at
    `decay_steps` (and stays there): within a fixed budget, ending at a learning rate near
    zero trains the last steps far better than rsqrt's slow tail. Until `decay_steps` is known
    (it may be estimated from a time budget at the end of warmup) the peak holds."""
    step = max(step, 1)
    if schedule == "rsqrt" or step <= warmup:
        return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
    if schedule != "linear":
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; choose one of {SCHEDULES}")
    peak = scale * d_model ** -0.5 * warmup ** -0.5
    if decay_steps is None:
        return peak
    return peak * max(0.0, (decay_steps - step) / max(decay_steps - warmup, 1))


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Label-smoothed cross-entropy summed over non-pad rows, and the plain NLL beside it.

    The value is F.cross_entropy(..., label_smoothing=eps, ignore_index=PAD_ID, reduction="sum"),
    but the logits (tokens x vocab, the step's largest tensor) are passed over far fewer times:
    one log-softmax serves both the loss and the NLL, and the gradient is written in one
    expression, softmax - ((1 - eps) * one_hot + eps / V), instead of autograd's zero-fill,
    scatter, add and log-softmax backward (docs/training.md).
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, smoothing: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = logits.log_softmax(dim=-1)
        keep = target != PAD_ID
        index = torch.where(keep, target, 0)[:, None]
        nll = -log_probs.gather(1, index).squeeze(1)
        loss = (1.0 - smoothing) * nll - (smoothing / logits.shape[-1]) * log_probs.sum(dim=-1)
        zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
        ctx.save_for_backward(log_probs, index, keep)
        ctx.smoothing = smoothing
        nll_sum = torch.where(keep, nll, zero).sum()
        ctx.mark_non_differentiable(nll_sum)
        return torch.where(keep, loss, zero).sum(), nll_sum

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, _grad_nll: torch.Tensor
                 ) -> tuple[torch.Tensor, None, None]:
        log_probs, index, keep = ctx.saved_tensors
        eps = ctx.smoothing
        grad = log_probs.exp().sub_(eps / log_probs.shape[-1])
        grad.scatter_add_(1, index, torch.full_like(index, -(1.0 - eps), dtype=grad.dtype))
        grad.mul_((keep.to(grad.dtype) * grad_loss)[:, None])
        return grad, None, None


def token_losses(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(label-smoothed loss sum, NLL sum) over non-pad target tokens (section 5.4)."""
    flat_logits, flat_target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    loss, nll = _SmoothedCrossEntropy.apply(flat_logits, flat_target, label_smoothing)
    return loss, nll


def batch_losses(net: torch.nn.Module, batch: Batch, label_smoothing: float, precision: str,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """token_losses of one batch on the device; the vocabulary projection skips padding."""
    rows = batch.tgt_out != PAD_ID
    with autocast(precision, device):
        logits = net(batch.src, batch.tgt_in, rows)
    return token_losses(logits, batch.tgt_out[rows], label_smoothing)


def resolve_precision(name: str, device: torch.device) -> str:
    """--precision to fp32 / bf16 / fp16 for this device (auto: bf16 on CUDA when it can)."""
    if name == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "fp32"
    if name not in ("fp32", "bf16", "fp16"):
        raise UserError(f"--precision {name!r}: choose auto, fp32, bf16 or fp16")
    if name == "fp16" and device.type != "cuda":
        raise UserError("--precision fp16 needs a CUDA device; use fp32 or bf16 on CPU")
    return name


def autocast(precision: str, device: torch.device) -> Any:
    if precision == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


@dataclass
class UpdateStats:
    loss: float  # label-smoothed loss per target token (global batch)
    nll: float
    tgt_tokens: int
    src_tokens: int
    finite: bool
    stop: bool  # some rank was asked to stop: nothing was computed
    out_of_time: bool = False  # some rank found --max-time spent: nothing was computed
    grad_norm: float = float("nan")  # before clipping


@dataclass
class Stepper:
    """What an update needs besides its batches; `net` is `model`, or `model` wrapped in DDP."""

    net: torch.nn.Module
    model: Transformer
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    ctx: DistContext
    precision: str
    label_smoothing: float
    clip_norm: float  # 0 = off

    def update(self, group: list[Batch], lr: float, stop_requested: bool,
               out_of_time: bool = False) -> UpdateStats:
        """One optimizer update over this rank's micro-batches of the global batch. Ranks agree
        first on the token counts and on whether any of them was asked to stop or ran out of
        time (in the same all-reduce, so the budget costs no extra collective)."""
        ctx, scaler = self.ctx, self.scaler
        local_tgt = sum(b.n_tgt_tokens for b in group)
        local_src = sum(b.n_src_tokens for b in group)
        tgt_total, src_total, stop, late = ctx.all_reduce([local_tgt, local_src, float(stop_requested),
                                                           float(out_of_time)])
        if stop or late:
            return UpdateStats(0.0, 0.0, 0, 0, True, bool(stop), out_of_time=bool(late) and not stop)
        loss_sum = nll_sum = 0.0
        for i, batch in enumerate(group):
            batch = batch.to(ctx.device)
            last = i == len(group) - 1
            # Gradients are all-reduced once, on the last micro-batch of the update.
            ddp = isinstance(self.net, DistributedDataParallel)
            sync = nullcontext() if (last or not ddp) else self.net.no_sync()  # type: ignore[operator]
            with sync:
                loss, nll = batch_losses(self.net, batch, self.label_smoothing, self.precision, ctx.device)
                scaled = loss * (ctx.world_size / tgt_total)
                (scaler.scale(scaled) if scaler else scaled).backward()
            loss_sum += loss.item()
            nll_sum += nll.item()
        loss_sum, nll_sum = ctx.all_reduce([loss_sum, nll_sum])
        finite, grad_norm = self._apply(lr) if math.isfinite(loss_sum) else (False, float("nan"))
        self.optimizer.zero_grad(set_to_none=True)
        return UpdateStats(loss_sum / tgt_total, nll_sum / tgt_total, int(tgt_total), int(src_total),
                           finite, False, grad_norm=grad_norm)

    def _apply(self, lr: float) -> tuple[bool, float]:
        """Clip and step; False (weights untouched) when the gradient is not finite. Also the
        gradient norm before clipping."""
        scaler, optimizer = self.scaler, self.optimizer
        if scaler:
            scaler.unscale_(optimizer)
        max_norm = self.clip_norm if self.clip_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        # GradScaler skips non-finite steps itself (and lowers its scale).
        norm = float(grad_norm)
        if scaler is None and not math.isfinite(norm):
            return False, norm
        for g in optimizer.param_groups:
            g["lr"] = lr
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        return True, norm

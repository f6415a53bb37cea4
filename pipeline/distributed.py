"""This process's place under torchrun, for every stage that runs on several ranks
(training, serve-batch): the context, its device, its process group, and the one way
rank 0 does some work and shares the result, or its error, with the others.

Without torchrun (or with WORLD_SIZE 1) everything here is a plain single process and
no collective is ever called, so the same code runs in tests and on a laptop. torch is
imported only for a device or a process group: a single serve-batch process on ONNX Runtime
runs without it.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from model.errors import UserError

T = TypeVar("T")

# Errors that are the user's, raised on rank 0 while the others wait: they are sent to
# every rank and raised there as the same one-line UserError.
SHARED_ERRORS: tuple[type[Exception], ...] = (UserError,)


def _dist() -> Any:
    import torch.distributed as dist

    return dist


@dataclass(frozen=True)
class DistContext:
    """Rank, world size, local rank and device of this process (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: Any = "cpu"  # a torch.device once a stage picked one (training), else the name
    owns_group: bool = False  # we called init_process_group, so we destroy it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, values: list[float]) -> list[float]:
        """Sum a few numbers over ranks (float64 on this rank's device)."""
        if not self.distributed:
            return [float(v) for v in values]
        import torch

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        _dist().all_reduce(t)
        return t.tolist()

    def broadcast(self, value: T) -> T:
        """Rank 0's value on every rank (any picklable object)."""
        if not self.distributed:
            return value
        box = [value]
        _dist().broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: T) -> list[T] | None:
        """Every rank's value in rank order on rank 0; None on the other ranks."""
        if not self.distributed:
            return [value]
        everyone: list[Any] | None = [None] * self.world_size if self.is_main else None
        _dist().gather_object(value, everyone, dst=0)
        return everyone


def env_ranks() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment ((0, 1, 0) without it)."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def pick_device(name: str, local_rank: int, world: int = 1) -> Any:
    """auto / cpu / cuda / cuda:N -> this rank's torch.device. auto and cuda take the LOCAL_RANK-th GPU; cuda:N
    names one GPU, so only a single process may take it (under torchrun every rank would share it)."""
    import torch

    number = name.partition(":")[2] if name.startswith("cuda:") else None
    if name not in ("auto", "cpu", "cuda") and not (number and number.isascii() and number.isdigit()):
        raise UserError(f"--device {name!r}: choose auto, cpu, cuda or cuda:N")
    if name != "cpu" and name != "auto" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA device is available; use --device cpu")
    if number is not None:
        count = torch.cuda.device_count()
        if world > 1:
            raise UserError(f"--device {name}: under torchrun each of the {world} processes takes its own GPU "
                            "(cuda:LOCAL_RANK); give --device cuda, or run one process")
        if int(number) >= count:
            raise UserError(f"--device {name}: this machine has {count} CUDA device{'s' * (count != 1)} "
                            f"(cuda:0 to cuda:{count - 1})")
        local_rank = int(number)
    if name != "cpu" and (name != "auto" or torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def rank_device(ctx: DistContext, device: str | None) -> str | None:
    """For stages whose backends pick their own device (serve-batch: None = the backend's
    default): under torchrun each rank takes its own GPU, cuda:LOCAL_RANK modulo the GPUs."""
    if not ctx.distributed:
        return device
    import torch

    if device in (None, "cuda") and torch.cuda.is_available():
        return f"cuda:{ctx.local_rank % torch.cuda.device_count()}"
    return device


def init_distributed(device_name: str | None = "auto", backend: str | None = None) -> DistContext:
    """From torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*). The process group
    is NCCL on CUDA and gloo on CPU unless `backend` names one (gloo carries object
    collectives on every build of torch). device_name None leaves the device to the caller
    (see rank_device; ctx.device is then the CPU, where object collectives run).
    Pair with `shutdown`, or use `dist_context`."""
    rank, world, local_rank = env_ranks()
    device = pick_device(device_name, local_rank, world) if device_name is not None else "cpu"
    owns = False
    if world > 1:
        dist = _dist()
        if not dist.is_initialized():
            on_cuda = str(device).startswith("cuda")
            dist.init_process_group(backend=backend or ("nccl" if on_cuda else "gloo"),
                                    timeout=datetime.timedelta(minutes=60))
            owns = True
        rank, world = dist.get_rank(), dist.get_world_size()
    return DistContext(rank, world, local_rank, device, owns)


def shutdown(ctx: DistContext) -> None:
    """Destroy the process group if this context created it."""
    if ctx.owns_group and _dist().is_initialized():
        _dist().destroy_process_group()


@contextmanager
def dist_context(device_name: str | None = "auto", backend: str | None = None) -> Iterator[DistContext]:
    """init_distributed, and the process group always torn down on the way out."""
    ctx = init_distributed(device_name, backend)
    try:
        yield ctx
    finally:
        shutdown(ctx)


def on_main(ctx: DistContext, fn: Callable[[], T], share: bool = True) -> T | None:
    """Run fn on rank 0 only. Its result (with share; None without) reaches every rank; a
    SHARED_ERRORS exception on rank 0 is raised as a UserError on every rank instead of
    leaving the others waiting on a collective forever. Every rank must call this."""
    if not ctx.distributed:
        return fn()
    result: Any = None
    error: str | None = None
    if ctx.is_main:
        try:
            result = fn()
        except SHARED_ERRORS as e:
            error = str(e)
    box = [(result if share else None, error)]
    _dist().broadcast_object_list(box, src=0)
    shared, error = box[0]
    if error is not None:
        raise UserError(error)
    return result if ctx.is_main else shared


def rank0_first(ctx: DistContext, fn: Callable[[bool], T]) -> T:
    """fn(True) on rank 0 (which writes caches), then fn(False) on the others (which read
    them); an error on rank 0 is raised on every rank."""
    if not ctx.distributed:
        return fn(True)
    result = on_main(ctx, lambda: fn(True), share=False)
    return result if ctx.is_main else fn(False)  # type: ignore[return-value]

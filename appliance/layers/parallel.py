"""Tensor-parallel state of this process: rank, world size and the collectives the layers use.

With one rank (the default) every collective is the identity, so single-device code pays
nothing for the parallel layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

_rank = 0
_size = 1


def set_tensor_parallel(rank: int, size: int) -> None:
    global _rank, _size
    _rank, _size = rank, size


@contextmanager
def tensor_parallel(rank: int, size: int) -> Iterator[None]:
    """Set the TP state for a block and restore the previous one after it: for building or
    inspecting another rank's shard (tests, planning tools). The state is read when layers are
    built and on every collective."""
    saved = (_rank, _size)
    set_tensor_parallel(rank, size)
    try:
        yield
    finally:
        set_tensor_parallel(*saved)


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})"
        )
    return numerator // denominator


def agree_min(value: int) -> int:
    """The smallest `value` over all ranks (KV block counts, fit checks): every rank must take
    the same decision, or the ones that go on wait forever in the next collective."""
    if _size == 1:
        return value
    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    )
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())

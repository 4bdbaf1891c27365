"""Tensor-parallel state of this process: rank, world size and the collectives the layers use.

With one rank (the default) every collective is the identity, so single-device code pays
nothing for the parallel layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_rank = 0
_size = 1


def set_tensor_parallel(rank: int, size: int) -> None:
    global _rank, _size
    _rank, _size = rank, size


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
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator

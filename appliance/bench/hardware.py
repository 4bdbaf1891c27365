"""Measured machine rates the benchmarks compare against: memory copy bandwidth and the
matmul rate in the compute dtype."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch


def _timed(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def copy_bandwidth(device: torch.device, mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second moved by a large copy, counting the read and the write."""
    n = mib * 2**20 // 2
    src = torch.ones(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * src.element_size() / seconds


def matmul_flops(
    device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 3
) -> float:
    """FLOP/s of a square matmul of `size` (smaller where one would take over a second: an
    emulated bf16 GEMM on an AVX2 CPU runs at well under 1 GFLOP/s)."""
    n = 256
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        seconds = _timed(functools.partial(torch.matmul, a, b), 1 if n < size else repeats)
        if n >= size or seconds * 8 > 1.0:
            return 2 * n**3 / seconds
        n *= 2

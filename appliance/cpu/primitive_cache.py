"""oneDNN's matmul primitives: their caches bounded, and filled at load.

Every distinct shape of a prepacked matmul (rows x weight) makes oneDNN build a primitive (JIT
kernels), which two LRU caches keep: oneDNN's own (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and
ideep's, PyTorch's oneDNN wrapper (LRU_CACHE_CAPACITY), 1024 entries each by default. Prefill
chunks of any length and decode batches of any size give the engine a new row count at almost
every step, so under mixed load the caches fill for as long as new shapes come. Measured on
the AMD EPYC Zen 3 (fp32 prepacked matmuls of the small demo model's four weight shapes, 34 row
counts): +77.6 MiB of malloc'd memory in use, 0.57 MiB a (rows, weight) pair, the two caches
holding about half each; bounded to 8 entries each, +1.1 MiB. At the default bounds that is up
to ~580 MiB reached over hours, the engine core's RSS "growth" under a soak (+5-7%).

A small bound costs little: the 30 layers of a step reuse that step's 4-5 primitives, and a
miss costs one primitive creation, 1.1-1.5 ms (Zen 3, 40 to 600 rows, measured interleaved with
cached calls), at most once per shape per step, against steps of 100s of ms on the torch path:
on a chat-like load an LRU of 64 missed 243 times over 95 torch-path steps (1024: 26), ~0.3 s
of their 35-50 s. The bound is in
force for the first primitive created in the process (both caches read it then): the CPU
backend sets it before the weights are reordered. A capacity the operator put in the
environment wins. ideep crashes on 0 entries (LRU_CACHE_CAPACITY=0: segfault), so the config
never passes one below 8.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from appliance.layers.linear import MatmulWeight, MergedColumnLinear

CAPACITY_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
# The warm-up fills at most this many entries: a capacity raised towards the libraries'
# default would otherwise cost seconds of start-up (1024 entries: 6.4 s on the Zen 3) for
# memory that the bound is there to avoid.
WARM_MAX_ENTRIES = 128


def bound_primitive_caches(capacity: int) -> dict[str, str]:
    """Set both caches' capacity unless the environment already does; returns what is in force
    (for the start-up log and /admin/stats' backend view)."""
    for name in CAPACITY_ENV:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in CAPACITY_ENV}


def capacity_in_force() -> int:
    """The smaller of the two caches' capacities (what a warm-up can fill); an unreadable value
    counts as the libraries' default."""

    def read(name: str) -> int:
        try:
            return int(os.environ.get(name, "1024"))
        except ValueError:
            return 1024

    return min(read(name) for name in CAPACITY_ENV)


def warm_primitive_caches(modules: Iterable[torch.nn.Module], first_rows: int) -> int:
    """Fill the bounded caches at load, so that the core's memory after start-up already holds
    them (what serving adds later is only what replaces an evicted entry). One matmul per
    distinct prepacked weight shape at row counts from `first_rows` up (the decode batches
    just above the native decode's limit: the torch path's commonest shapes), until the
    entries made reach the capacity (or WARM_MAX_ENTRIES). Returns the number of matmuls run
    (inputs are zeros: only shapes matter)."""
    # What keys a primitive: the weight's shape and dtype, and whether a bias is added (only the
    # merged column linears pass theirs, as their forward does).
    distinct: dict[tuple[object, ...], tuple[MatmulWeight, torch.Tensor, torch.Tensor | None]] = {}
    for m in modules:
        if not isinstance(m, MatmulWeight) or m.matmul is None:
            continue
        copy = m.matmul.copy
        if m.matmul.prepacked and copy is not None:
            bias: torch.Tensor | None = m.bias if isinstance(m, MergedColumnLinear) else None
            key = (*copy.shape, copy.dtype, bias is None)
            distinct.setdefault(key, (m, copy, bias))
    if not distinct:
        return 0
    entries = min(capacity_in_force(), WARM_MAX_ENTRIES)
    row_counts = range(first_rows, first_rows + -(-entries // len(distinct)))
    runs = 0
    with torch.inference_mode():
        for m, weight, bias in distinct.values():
            for rows in row_counts:
                m._matmul(torch.zeros(rows, weight.shape[1], dtype=weight.dtype), bias)
                runs += 1
    return runs

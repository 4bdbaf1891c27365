"""Attention kernels: torch reference / CPU path (`paged_attention`) and Triton (CUDA).

Importing this package does not import triton; `get_attention_backend` does, for CUDA only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import cpu_native

# Aliased: the plain names would shadow the `paged_attention` submodule on this package.
from .paged_attention import paged_attention as _torch_paged_attention
from .paged_attention import write_kv as _torch_write_kv

AttentionBackend = tuple[Callable[..., None], Callable[..., torch.Tensor]]


def get_attention_backend(device: torch.device | str, native_cpu: bool = True) -> AttentionBackend:
    """(write_kv, paged_attention) for ``device``: Triton kernels on CUDA; on the CPU the
    native decode attention when `native_cpu` (else the torch reference alone).

    Both pairs share the signatures of `paged_attention.write_kv` and
    `paged_attention.paged_attention`.
    """
    device = torch.device(device)
    if device.type == "cuda":
        from .triton_attention import paged_attention_triton, write_kv_triton

        return write_kv_triton, paged_attention_triton
    return _torch_write_kv, cpu_paged_attention if native_cpu else _torch_paged_attention


def cpu_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CPU backend: decode batches over a 16/32-bit cache go to the native kernel
    (cpu_decode.c), which reads each K/V row in place (the torch path first gathers the
    context into padded copies: ~40% of a 64-sequence decode step of the small demo model);
    everything else (prefills with their fresh key/value included) to the torch reference."""
    if (
        max_query_len == 1
        and kv_cache_dtype == "auto"
        # The cache's dtype, or a float32 forward over a bf16 cache (CPUs without bf16 math).
        and query.dtype in (k_cache.dtype, torch.float32)
        and cpu_native.supports(k_cache.dtype, query.shape[1] // k_cache.shape[2])
    ):
        return cpu_native.paged_decode_attention(
            query, k_cache, v_cache, block_tables, seq_lens, scale
        )
    return _torch_paged_attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        max_query_len,
        max_seq_len,
        kv_cache_dtype,
        k_scale,
        v_scale,
        key,
        value,
    )

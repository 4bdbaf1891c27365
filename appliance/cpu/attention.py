"""The CPU backend's attention pair: decode batches over a 16/32-bit cache go to the native
kernel (cpu_decode.c), which reads each K/V row in place (the torch path first gathers the
context into padded copies: ~40% of a 64-sequence decode step of the small demo model);
everything else (prefills with their fresh key/value included, quantized caches) to the torch
reference. Which batch takes which kernel is this backend's policy, so it lives here and not
among the kernels."""

from __future__ import annotations

import torch

from appliance.kernels import cpu_native
from appliance.kernels.attention_api import AttentionBackend
from appliance.kernels.paged_attention import TORCH_ATTENTION, paged_attention, write_kv


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
    return paged_attention(
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


CPU_NATIVE_ATTENTION = AttentionBackend("cpu-native", write_kv, cpu_paged_attention)


def cpu_attention(native: bool) -> AttentionBackend:
    """The pair the CPU plan chose: the native decode dispatch, or the torch reference."""
    return CPU_NATIVE_ATTENTION if native else TORCH_ATTENTION

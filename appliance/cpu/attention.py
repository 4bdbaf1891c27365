"""The CPU backend's attention pair: decode batches over a 16/32-bit cache go to the native
kernel (cpu_decode.c), which reads each K/V row in place (the torch path first gathers the
context into padded copies: ~40% of a 64-sequence decode step of the small demo model);
prefill chunks over a bf16 cache, where the plan chose it (AVX-512-BF16 without AMX:
appliance.cpu.choice), to the native prefill attention (cpu_prefill_attention.inc.c: pair dot
products, ~2x torch's SDPA on a 2-core Zen 4); everything else (prefills on AMX, whose SDPA
runs its products on tiles; float32 prefills; quantized caches with their fresh key/value) to
the torch reference, a prefill batch in groups of sequences (cpu/prefill_groups.py). Which
batch takes which kernel is this backend's policy, so it lives here and not among the
kernels."""

from __future__ import annotations

from functools import partial

import torch

from appliance.cpu.prefill_groups import grouped_prefill_attention
from appliance.kernels import cpu_native
from appliance.kernels.attention_api import AttentionBackend
from appliance.kernels.paged_attention import write_kv


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
    *,
    native_prefill: bool,
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
    if (
        native_prefill
        and max_query_len > 1
        and kv_cache_dtype == "auto"
        and query.dtype == k_cache.dtype
        and cpu_native.prefill_attention_available(k_cache, query.shape[2])
    ):
        return _native_prefills(
            query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale
        )
    return grouped_prefill_attention(
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


def _native_prefills(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each sequence's chunk through the native prefill attention, one call a sequence (a
    step prefills a few: a summary's chunk, a handful of chats' prompts)."""
    bounds = query_start_loc.tolist()
    lens = seq_lens.tolist()
    parts = []
    for i, length in enumerate(lens):
        lo, hi = bounds[i], bounds[i + 1]
        blocks = -(-length // k_cache.shape[1])
        parts.append(
            cpu_native.prefill_attention(
                query[lo:hi], k_cache, v_cache, block_tables[i, :blocks], length - (hi - lo), scale
            )
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts)


CPU_NATIVE_ATTENTION = AttentionBackend(
    "cpu-native", write_kv, partial(cpu_paged_attention, native_prefill=True)
)
# Native decode, torch's SDPA for prefill chunks (CPUs with AMX).
CPU_NATIVE_DECODE_ATTENTION = AttentionBackend(
    "cpu-native-decode", write_kv, partial(cpu_paged_attention, native_prefill=False)
)


# The torch reference, its prefill batches in groups (no native kernels: no C compiler).
CPU_TORCH_ATTENTION = AttentionBackend("cpu-torch", write_kv, grouped_prefill_attention)


def cpu_attention(native: bool, native_prefill: bool) -> AttentionBackend:
    """The pair the CPU plan chose: the native decode dispatch, with or without the native
    prefill attention, or the torch reference with its prefill batches in groups."""
    if not native:
        return CPU_TORCH_ATTENTION
    return CPU_NATIVE_ATTENTION if native_prefill else CPU_NATIVE_DECODE_ATTENTION

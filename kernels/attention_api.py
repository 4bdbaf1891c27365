"""The attention kernels' one signature, stated once: every device's pair (the torch reference
in paged_attention.py, the Triton kernels on CUDA, the CPU backend's native dispatch) is an
`AttentionBackend` whose two callables the type checker holds to these protocols.

Cache layout, scales and the token order of a step: paged_attention.py's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class WriteKV(Protocol):
    """Store this step's K/V rows [tokens, kv_heads, head_dim] at their slots (a negative slot
    is padding, skipped); quantized kinds with their per-head scales, or per-token scale caches
    (kv_formats.PER_TOKEN_KIND) as k_scale/v_scale."""

    def __call__(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str = "auto",
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None: ...


class PagedAttention(Protocol):
    """Attention of each sequence's query rows over its cached context; `key`/`value`, where
    given, are a prefill chunk's own fresh rows (attended at full precision over a quantized
    cache)."""

    def __call__(
        self,
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
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class AttentionBackend:
    """A device's pair: how K/V are written and how a batch attends over them."""

    name: str
    write_kv: WriteKV
    paged_attention: PagedAttention

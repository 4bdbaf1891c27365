"""Attention over the paged KV cache, through one interface with a torch backend (CPU, and the
reference) and a Triton backend (CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from appliance.kernels import paged_attention as torch_backend


@dataclass
class PagedBatch:
    """Sequences of one attention call; query rows of sequence i are
    query_start_loc[i]:query_start_loc[i+1] (relative to this batch's first row)."""

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_tokens: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    # Decodes (one query each) come first in the token order, then prefill chunks.
    decode: PagedBatch | None
    prefill: PagedBatch | None


@dataclass
class KVCacheSpec:
    kv_cache_dtype: str = "auto"
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


WriteKV = Callable[..., None]
PagedAttention = Callable[..., torch.Tensor]


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.write_kv: WriteKV = torch_backend.write_kv
        self.paged_attention: PagedAttention = torch_backend.paged_attention
        self.spec = KVCacheSpec()

    def set_backend(self, write_kv: WriteKV, paged_attention: PagedAttention) -> None:
        self.write_kv = write_kv
        self.paged_attention = paged_attention

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        spec = self.spec
        self.write_kv(
            k,
            v,
            k_cache,
            v_cache,
            meta.slot_mapping,
            spec.kv_cache_dtype,
            spec.k_scale,
            spec.v_scale,
        )
        outputs = []
        start = 0
        for batch in (meta.decode, meta.prefill):
            if batch is None:
                continue
            rows = slice(start, start + batch.num_tokens)
            # A prefill over a quantized cache also gets its fresh K/V (kv_quant.RotatedKV).
            fresh = (
                {"key": k[rows], "value": v[rows]}
                if batch is meta.prefill and spec.k_scale is not None
                else {}
            )
            outputs.append(
                self.paged_attention(
                    q[rows],
                    k_cache,
                    v_cache,
                    batch.block_tables,
                    batch.seq_lens,
                    batch.query_start_loc,
                    self.scale,
                    batch.max_query_len,
                    batch.max_seq_len,
                    spec.kv_cache_dtype,
                    spec.k_scale,
                    spec.v_scale,
                    **fresh,
                )
            )
            start += batch.num_tokens
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

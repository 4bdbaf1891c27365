"""Attention over the paged KV cache. The layer holds one `KVPath`, composed when the layer is
configured (16-bit over the device's kernels here; quantized, rotated and split-head paths in
appliance.layers.quantized_kv): forward is the same call whatever the cache stores."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from appliance.kernels.attention_api import AttentionBackend
from appliance.kernels.paged_attention import TORCH_ATTENTION
from appliance.layers.kv_cache import LayerCache


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


@dataclass(frozen=True)
class KVCacheSpec:
    """What a layer's cache stores: its format, the per-head scales of a quantized one (one
    float32 per KV head it holds; None for per-token INT8, kv_formats.PER_TOKEN_KIND, whose
    scales are the cache's `scales`), and the local KV heads kept apart in its 16-bit side
    cache."""

    kv_cache_dtype: str = "auto"
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    kept_heads: tuple[int, ...] = ()


class KVPath(Protocol):
    """How one layer writes this step's K/V into its cache and attends over it."""

    # The device's own pair underneath (a quantized path wraps it).
    kernels: AttentionBackend
    spec: KVCacheSpec

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerCache,
        scale: float,
    ) -> torch.Tensor: ...


def attend_over(
    kernels: AttentionBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    spec: KVCacheSpec,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into one cache and attend over it (decodes, then prefills)."""
    kernels.write_kv(
        k, v, k_cache, v_cache, meta.slot_mapping, spec.kv_cache_dtype, spec.k_scale, spec.v_scale
    )
    outputs = []
    start = 0
    for batch in (meta.decode, meta.prefill):
        if batch is None:
            continue
        rows = slice(start, start + batch.num_tokens)
        # A prefill over a quantized cache also attends to its fresh K/V at full precision.
        fresh = batch is meta.prefill and spec.kv_cache_dtype != "auto"
        outputs.append(
            kernels.paged_attention(
                q[rows],
                k_cache,
                v_cache,
                batch.block_tables,
                batch.seq_lens,
                batch.query_start_loc,
                scale,
                batch.max_query_len,
                batch.max_seq_len,
                spec.kv_cache_dtype,
                spec.k_scale,
                spec.v_scale,
                key=k[rows] if fresh else None,
                value=v[rows] if fresh else None,
            )
        )
        start += batch.num_tokens
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


class PlainKV:
    """A 16-bit (or float32) cache through the device's pair as it is."""

    spec = KVCacheSpec()

    def __init__(self, kernels: AttentionBackend) -> None:
        self.kernels = kernels

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerCache,
        scale: float,
    ) -> torch.Tensor:
        assert cache.plain, "a 16-bit layer's cache holds K and V only"
        return attend_over(self.kernels, q, k, v, meta, cache.k, cache.v, self.spec, scale)


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # The torch reference until the backend wires the device's path (and the KV cache's
        # configuration its format).
        self.kv_path: KVPath = PlainKV(TORCH_ATTENTION)

    def wire(self, kv_path: KVPath) -> None:
        self.kv_path = kv_path

    @property
    def spec(self) -> KVCacheSpec:
        return self.kv_path.spec

    @property
    def kernels(self) -> AttentionBackend:
        """The device's pair under this layer's path."""
        return self.kv_path.kernels

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerCache,
    ) -> torch.Tensor:
        return self.kv_path.attend(q, k, v, meta, cache, self.scale)

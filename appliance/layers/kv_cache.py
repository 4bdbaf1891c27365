"""One layer's KV cache, typed: the tensors the pool allocates for a layer, by role."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class KVPair:
    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class LayerCache:
    """K and V, [blocks, block_size, heads, head_dim], in the layer's storage dtype. A quantized
    layer may keep some KV heads apart in a 16-bit `side` cache (cache.kv_cache_keep_16bit_heads:
    `k`/`v` then hold only the other heads), and an INT8 layer with per-token scales has float16
    `scales` caches [blocks, block_size, heads] of its quantized heads beside them."""

    k: torch.Tensor
    v: torch.Tensor
    side: KVPair | None = None
    scales: KVPair | None = None

    @property
    def plain(self) -> bool:
        """Only K and V: the layout the fused native decode reads."""
        return self.side is None and self.scales is None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of the layer, in a fixed order (a swapped block holds all of them)."""
        out: tuple[torch.Tensor, ...] = (self.k, self.v)
        for pair in (self.side, self.scales):
            if pair is not None:
                out += (pair.k, pair.v)
        return out


@dataclass
class KVStorage:
    """What the pool allocates per layer: the cache's dtype, and how many of the layer's KV
    heads sit apart in a 16-bit side cache of `side_dtype` (cache.kv_cache_keep_16bit_heads;
    the layer's own cache then holds only the other heads), and whether the layer's INT8
    cache has per-token scales (cache.kv_cache_scales = "per_token": float16 scale caches of
    the quantized heads, [blocks, block_size, heads], beside K and V)."""

    dtypes: list[torch.dtype]
    side_heads: list[int]
    side_dtype: torch.dtype
    token_scales: list[bool] = field(default_factory=list)

    @classmethod
    def of(
        cls, dtype: torch.dtype | Sequence[torch.dtype] | KVStorage, num_layers: int
    ) -> KVStorage:
        if isinstance(dtype, KVStorage):
            return dtype
        dtypes = [dtype] * num_layers if isinstance(dtype, torch.dtype) else list(dtype)
        return cls(dtypes, [0] * len(dtypes), dtypes[0] if dtypes else torch.bfloat16)

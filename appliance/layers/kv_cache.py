"""One layer's KV cache, typed: the tensors the pool allocates for a layer, by role."""

from __future__ import annotations

from dataclasses import dataclass

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

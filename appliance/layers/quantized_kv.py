"""The KV paths of a quantized layer (engine/kv_quant.py decides which layers and calibrates
the scales): K/V stored rotated, and some KV heads kept apart in a 16-bit side cache.

Rotation: a quantized layer stores ``K @ R`` and ``V @ R`` (R: an orthonormal Hadamard matrix
of head_dim), attends with ``q @ R`` and turns its output back with ``R^T``; since R is
orthonormal, q.k and p.V are unchanged, but the few outlier channels of a trained model's K
(RoPE dimensions 5-20x the rest) are spread over all channels, so a per-head scale no longer
spends the format's range on them. It needs no storage: `rotated` wraps whichever pair the
device has (torch, Triton, the CPU's native dispatch).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from appliance.kernels.attention_api import AttentionBackend
from appliance.kernels.kv_formats import PER_TOKEN_KIND
from appliance.layers.attention import AttentionMetadata, KVCacheSpec, KVPath, PlainKV, attend_over
from appliance.layers.kv_cache import LayerCache


def rotation_matrix(head_dim: int, device: torch.device) -> torch.Tensor:
    """Orthonormal [head_dim, head_dim], float32: Sylvester's Hadamard matrix / sqrt(head_dim)
    for powers of two (every entry +-1/sqrt(d): each stored channel mixes all input channels
    equally); other sizes take a fixed orthogonal matrix (QR of a seeded Gaussian)."""
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        r = h / math.sqrt(head_dim)
    else:
        g = torch.Generator().manual_seed(head_dim)
        r, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))
    return r.to(torch.float32).to(device)


class RotatedKV:
    """The device's pair with K/V written rotated, queries rotated in and outputs rotated back
    (module docstring). A prefill's fresh K/V (key=/value=) are rotated the same way."""

    def __init__(self, inner: AttentionBackend, head_dim: int, device: torch.device) -> None:
        self.inner = inner
        self.rot = rotation_matrix(head_dim, device)
        self.backend = AttentionBackend(f"rotated {inner.name}", self.write_kv, self.attend)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str = "auto",
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        self.inner.write_kv(
            key.float() @ self.rot,
            value.float() @ self.rot,
            k_cache,
            v_cache,
            slot_mapping,
            kv_cache_dtype,
            k_scale,
            v_scale,
        )

    def attend(
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
    ) -> torch.Tensor:
        q = (query.float() @ self.rot).to(query.dtype)
        fresh_k = key.float() @ self.rot if key is not None and value is not None else None
        fresh_v = value.float() @ self.rot if key is not None and value is not None else None
        out = self.inner.paged_attention(
            q,
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
            key=fresh_k,
            value=fresh_v,
        )
        return (out.float() @ self.rot.T).to(query.dtype)


class QuantizedKV:
    """A quantized cache (FP8/INT8 with per-head scales, or INT8 with per-token scale caches),
    stored rotated."""

    def __init__(self, kernels: AttentionBackend, spec: KVCacheSpec, rotated: RotatedKV) -> None:
        assert spec.kv_cache_dtype != "auto", "a 16-bit layer takes PlainKV"
        self.kernels = kernels
        self.spec = spec
        self.rotated = rotated

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerCache,
        scale: float,
    ) -> torch.Tensor:
        spec = self.spec
        if spec.kv_cache_dtype == PER_TOKEN_KIND:
            # The kernels take the scale caches where per-head scales go (k_scale, v_scale).
            assert cache.scales is not None, "a per-token INT8 layer needs its scale caches"
            spec = replace(spec, k_scale=cache.scales.k, v_scale=cache.scales.v)
        return attend_over(self.rotated.backend, q, k, v, meta, cache.k, cache.v, spec, scale)


class HeadSplit:
    """Index tensors that split a layer's heads into the quantized cache's and the side
    cache's: KV heads, and their query heads (query head j reads KV head j // group, the GQA
    grouping of every backend), and the permutation that puts the outputs back in order."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, kept: tuple[int, ...], device: torch.device
    ) -> None:
        group = num_heads // num_kv_heads
        quant = [h for h in range(num_kv_heads) if h not in kept]
        kept_l = sorted(kept)

        def q_of(heads: list[int]) -> list[int]:
            return [h * group + j for h in heads for j in range(group)]

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        self.kv_quant, self.kv_kept = t(quant), t(kept_l)
        self.q_quant, self.q_kept = t(q_of(quant)), t(q_of(kept_l))
        order = q_of(quant) + q_of(kept_l)
        self.inverse = t(sorted(range(num_heads), key=order.__getitem__))


class SplitHeadsKV:
    """Heads stored apart: the quantized heads over the layer's cache (rotated), the kept heads
    over the 16-bit side cache (the device's plain pair: on the CPU the native decode
    attention), each with its own query heads; outputs back in head order."""

    def __init__(self, quantized: QuantizedKV, split: HeadSplit) -> None:
        self.kernels = quantized.kernels
        self.spec = quantized.spec
        self.quantized = quantized
        self.split = split

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerCache,
        scale: float,
    ) -> torch.Tensor:
        split, side = self.split, cache.side
        assert side is not None, "a layer that keeps heads needs its side cache"
        out_q = self.quantized.attend(
            q.index_select(1, split.q_quant),
            k.index_select(1, split.kv_quant),
            v.index_select(1, split.kv_quant),
            meta,
            cache,
            scale,
        )
        out_kept = attend_over(
            self.kernels,
            q.index_select(1, split.q_kept),
            k.index_select(1, split.kv_kept),
            v.index_select(1, split.kv_kept),
            meta,
            side.k,
            side.v,
            PlainKV.spec,
            scale,
        )
        return torch.cat([out_q, out_kept], dim=1).index_select(1, split.inverse)


def kv_path(
    kernels: AttentionBackend,
    spec: KVCacheSpec,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
) -> KVPath:
    """The path for a layer whose cache stores `spec` over the device's `kernels`; the rotation
    and the head split are built on `device`."""
    if spec.kv_cache_dtype == "auto":
        assert not spec.kept_heads, "a 16-bit layer keeps no heads apart"
        return PlainKV(kernels)
    quantized = QuantizedKV(kernels, spec, RotatedKV(kernels, head_dim, device))
    if not spec.kept_heads:
        return quantized
    return SplitHeadsKV(quantized, HeadSplit(num_heads, num_kv_heads, spec.kept_heads, device))

"""Attention over the paged KV cache, through one interface with a torch backend (CPU, and the
reference) and a Triton backend (CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from appliance.kernels import paged_attention as torch_backend
from appliance.kv_layout import PER_TOKEN_KIND


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
    # One float32 per KV head of the (quantized) cache: the layer's heads, or with kept_heads
    # only the others, in their order. None for per-token INT8 (PER_TOKEN_KIND), whose scales
    # are the pool's scale caches, the last two tensors of the layer's cache entry.
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    # Local KV heads stored apart in a 16-bit side cache (cache.kv_cache_keep_16bit_heads): the
    # layer's cache entry is then (k, v, side_k, side_v).
    kept_heads: tuple[int, ...] = ()


WriteKV = Callable[..., None]
PagedAttention = Callable[..., torch.Tensor]


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
        # The 16-bit side cache's pair (the device's own backend) and the head split, set with
        # a spec that keeps heads (set_side).
        self.side_backend: tuple[WriteKV, PagedAttention] | None = None
        self.split: HeadSplit | None = None

    def set_backend(self, write_kv: WriteKV, paged_attention: PagedAttention) -> None:
        self.write_kv = write_kv
        self.paged_attention = paged_attention

    def set_side(
        self, backend: tuple[WriteKV, PagedAttention] | None, device: torch.device | None = None
    ) -> None:
        """The side cache's backend for spec.kept_heads (None: the layer keeps no heads)."""
        self.side_backend = backend
        self.split = None
        if backend is not None:
            assert device is not None and self.spec.kept_heads
            self.split = HeadSplit(self.num_heads, self.num_kv_heads, self.spec.kept_heads, device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        spec = self.spec
        if spec.kv_cache_dtype == PER_TOKEN_KIND:
            # The backends take the scale caches where per-head scales go (k_scale, v_scale).
            spec = replace(spec, k_scale=kv_cache[-2], v_scale=kv_cache[-1])
            kv_cache = kv_cache[:-2]
        if len(kv_cache) == 2:
            assert not spec.kept_heads, "a layer that keeps heads needs its side cache"
            return self._attend(q, k, v, meta, kv_cache, spec, self.write_kv, self.paged_attention)
        # Heads stored apart: the quantized heads over the layer's cache (its backend, rotated),
        # the kept heads over the 16-bit side cache (the device's plain backend: on the CPU the
        # native decode attention), each with its own query heads; outputs back in head order.
        split, side = self.split, self.side_backend
        assert split is not None and side is not None, "side cache without kept heads"
        out_q = self._attend(
            q.index_select(1, split.q_quant),
            k.index_select(1, split.kv_quant),
            v.index_select(1, split.kv_quant),
            meta,
            kv_cache[:2],
            spec,
            self.write_kv,
            self.paged_attention,
        )
        out_kept = self._attend(
            q.index_select(1, split.q_kept),
            k.index_select(1, split.kv_kept),
            v.index_select(1, split.kv_kept),
            meta,
            kv_cache[2:],
            KVCacheSpec(),
            *side,
        )
        return torch.cat([out_q, out_kept], dim=1).index_select(1, split.inverse)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, ...],
        spec: KVCacheSpec,
        write_kv: WriteKV,
        paged_attention: PagedAttention,
    ) -> torch.Tensor:
        """Write this step's K/V into one cache and attend over it (decodes, then prefills)."""
        k_cache, v_cache = kv_cache
        write_kv(
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
                if batch is meta.prefill and spec.kv_cache_dtype != "auto"
                else {}
            )
            outputs.append(
                paged_attention(
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

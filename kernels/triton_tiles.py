"""JIT helpers shared by the Triton decode and prefill attention kernels: where a tile of
context tokens lies in the paged cache, its K/V read at their stored width, a KV head's
per-head scales, and per-token INT8's scales of the tile."""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_kv import _dequant


@triton.jit
def _tile_offsets(
    bt_row_ptr, pos, valid, kvh, stride_cb, stride_cs, stride_ch, BLOCK_SIZE: tl.constexpr
):
    """Token positions -> element offsets of their cache rows (int64), via the block table."""
    block = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch


@triton.jit
def _load_kv_tile(cache_ptr, rows, mask, offs_d, KV_FMT: tl.constexpr, DTYPE: tl.constexpr):
    raw = tl.load(cache_ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0)
    return _dequant(raw, KV_FMT).to(DTYPE)


@triton.jit
def _head_scales(qk_scale, v_mult, k_scale_ptr, v_scale_ptr, kvh, KV_FMT: tl.constexpr):
    """The factors on a KV head's scores and output: the softmax scale and the V multiplier,
    times the head's calibrated K/V scales for a per-head quantized cache (16-bit: none;
    per-token INT8, KV_FMT 4: its scales come with each tile, `_token_scales`)."""
    k_scale = qk_scale
    v_scale = v_mult
    if KV_FMT != 0:
        if KV_FMT != 4:
            k_scale = k_scale * tl.load(k_scale_ptr + kvh)
            v_scale = v_scale * tl.load(v_scale_ptr + kvh)
    return k_scale, v_scale


@triton.jit
def _token_scales(scale_ptr, rows, valid):
    """Per-token INT8: the float16 scales of a tile's tokens (rows: their offsets in the scale
    cache, `_tile_offsets` with its strides) as float32, 0 past the context (masked anyway)."""
    return tl.load(scale_ptr + rows, mask=valid, other=0.0).to(tl.float32)

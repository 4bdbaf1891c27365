"""JIT helpers shared by the Triton decode and prefill attention kernels: where a tile of
context tokens lies in the paged cache, its K/V read at their stored width, and per-token INT8's
scales of the tile."""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_kv import _dequant


@triton.jit
def _tile_offsets(bt_row_ptr, pos, valid, kvh, stride_cb, stride_cs, stride_ch,
                  BLOCK_SIZE: tl.constexpr):
    """Token positions -> element offsets of their cache rows (int64), via the block table."""
    block = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch


@triton.jit
def _load_kv_tile(cache_ptr, rows, mask, offs_d, KV_FMT: tl.constexpr, DTYPE: tl.constexpr):
    raw = tl.load(cache_ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0)
    return _dequant(raw, KV_FMT).to(DTYPE)



@triton.jit
def _token_scales(scale_ptr, rows, valid):
    """Per-token INT8: the float16 scales of a tile's tokens (rows: their offsets in the scale
    cache, `_tile_offsets` with its strides) as float32, 0 past the context (masked anyway)."""
    return tl.load(scale_ptr + rows, mask=valid, other=0.0).to(tl.float32)

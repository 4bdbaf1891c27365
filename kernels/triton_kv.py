"""Triton reshape-and-cache: scatter new K/V into the paged cache, quantizing on the way.

Same contract as `paged_attention.write_kv` (cache layout ``[num_blocks, block_size,
num_kv_heads, head_dim]``, ``slot = block_id * block_size + offset``), plus: a negative slot id
(``-1``) means "padding token, skip it", so CUDA-graph padded batches need no compaction.

FP8 conversion is done with integer bit manipulation through fp16 instead of Triton's fp8 casts:
Triton only allows ``float8e4nv`` on sm89+, and these kernels must run on Ampere too.

* e5m2 is the top byte of an fp16: ``fp16_bits = byte << 8`` decodes exactly.
* e4m3fn (bias 7) sits inside fp16 (bias 15) shifted by 2**-8: ``fp16_bits = sign << 8 |
  (byte & 0x7F) << 7`` decodes to ``value / 256`` exactly (subnormals included); readers fold
  the 256 into the per-head scale.
* Writing rounds the fp32 bits once, to nearest even, saturating at the format's max (like
  torch's clamp + cast): bit-identical to `paged_attention.quantize` when x / scale matches.

INT8 with per-token scales (kind ``int8_token``, `appliance.kv_layout.PER_TOKEN_KIND`): each
token's K and V get one float16 scale per KV head, the token's own absmax / 127, computed here
as the token is written and stored in scale caches ``[num_blocks, block_size, num_kv_heads]``
(passed as ``k_scale``/``v_scale``, same slots). The rounding is the CPU path's
(`paged_attention.quantize_per_token`) bit for bit: scale rounded to float16 before dividing,
IEEE divisions, round half to even.

The JIT helpers here (`_dequant`, `_quantize`) are shared with the attention kernels
(`triton_tiles`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_formats import PER_TOKEN_KIND
from .paged_attention import MIN_TOKEN_SCALE

# kv_cache_dtype -> the KV_FMT constexpr of the kernels (the JIT code compares with the
# numbers: 4 is per-token INT8, whose scales are read per token, never per head).
FMT_AUTO, FMT_E4M3, FMT_E5M2, FMT_INT8, FMT_INT8_TOKEN = 0, 1, 2, 3, 4
KV_FORMATS = {
    "auto": FMT_AUTO,
    "fp8_e4m3": FMT_E4M3,
    "fp8_e5m2": FMT_E5M2,
    "int8": FMT_INT8,
    PER_TOKEN_KIND: FMT_INT8_TOKEN,
}
# What `_dequant` returns times this (and the head's or token's scale) is the real value.
FMT_MULTIPLIER = {FMT_AUTO: 1.0, FMT_E4M3: 256.0, FMT_E5M2: 1.0, FMT_INT8: 1.0, FMT_INT8_TOKEN: 1.0}


def kv_format(kv_cache_dtype: str) -> int:
    try:
        return KV_FORMATS[kv_cache_dtype]
    except KeyError:
        raise ValueError(f"kv_cache_dtype: unknown value {kv_cache_dtype!r}") from None


@triton.jit
def _dequant(x, KV_FMT: tl.constexpr):
    """Stored cache values -> unscaled numbers (fp16 for FP8, as-is otherwise).

    The result times FMT_MULTIPLIER[KV_FMT] times the head's scale is the cached value.
    """
    if KV_FMT == 1:  # fp8 e4m3fn bytes -> fp16 holding value / 256
        b = x.to(tl.int32)
        bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        return bits.to(tl.uint16).to(tl.float16, bitcast=True)
    elif KV_FMT == 2:  # fp8 e5m2 bytes -> fp16 (exact)
        bits = x.to(tl.int32) << 8
        return bits.to(tl.uint16).to(tl.float16, bitcast=True)
    else:
        return x


@triton.jit
def _fp8_code(
    v, MAX: tl.constexpr, MANT: tl.constexpr, INV_MIN_NORMAL: tl.constexpr, BIAS: tl.constexpr
):
    """fp32 -> FP8 byte, one round-to-nearest-even like torch (saturating at +-MAX)."""
    a = tl.minimum(tl.abs(v), MAX)
    bits = a.to(tl.int32, bitcast=True)
    half = (1 << (22 - MANT)) - 1
    normal = ((bits + half + ((bits >> (23 - MANT)) & 1)) >> (23 - MANT)) - ((127 - BIAS) << MANT)
    # Subnormals: the code is the integer multiple of the smallest step, rounded to even
    # with the 2**23 trick.
    tiny = tl.minimum(a, 1.0 / INV_MIN_NORMAL)
    sub = (tiny * (INV_MIN_NORMAL * (1 << MANT)) + 8388608.0) - 8388608.0
    code = tl.where(a < 1.0 / INV_MIN_NORMAL, sub.to(tl.int32), normal)
    return (tl.where(v < 0, code | 0x80, code)).to(tl.uint8)


@triton.jit
def _quantize(x, scale, KV_FMT: tl.constexpr):
    """fp32 values -> stored representation (uint8 bytes for FP8, int8 for INT8)."""
    v = x / scale
    if KV_FMT == 1:
        return _fp8_code(v, 448.0, 3, 64.0, 7)
    elif KV_FMT == 2:
        return _fp8_code(v, 57344.0, 2, 16384.0, 15)
    else:
        return _round_int8(v)


@triton.jit
def _round_int8(v):
    """fp32 in stored units -> int8: clamped to +-127, rounded half to even (torch.round)."""
    v = tl.minimum(tl.maximum(v, -127.0), 127.0)
    v = (v + 12582912.0) - 12582912.0  # 1.5 * 2**23: round half to even, like torch.round
    return v.to(tl.int8)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    KV_FMT: tl.constexpr,
):
    """One program per (token, chunk of the token's num_kv_heads * head_dim elements)."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    mask = (offs < NUM_KV_HEADS * HEAD_DIM) & (slot >= 0)
    dst = (
        (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + head * stride_ch + dim
    )
    k = tl.load(key_ptr + token.to(tl.int64) * stride_kt + head * stride_kh + dim, mask=mask)
    v = tl.load(value_ptr + token.to(tl.int64) * stride_vt + head * stride_vh + dim, mask=mask)
    if KV_FMT != 0:
        k_scale = tl.load(k_scale_ptr + head, mask=mask, other=1.0)
        v_scale = tl.load(v_scale_ptr + head, mask=mask, other=1.0)
        k = _quantize(k.to(tl.float32), k_scale, KV_FMT)
        v = _quantize(v.to(tl.float32), v_scale, KV_FMT)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_per_token(x, cache_ptrs, scale_ptrs, mask, head_ok, MIN_SCALE: tl.constexpr):
    """One token's heads ([heads, head_dim], fp32, zeros where masked) -> int8 rows and one
    float16 scale per head: absmax / 127 (at least MIN_SCALE), rounded to float16 before the
    values are divided by it, so stored x scale is exactly what was meant. Both divisions are
    div_rn: a plain `/` compiles to an approximate division on the GPU, which would round some
    values differently from the CPU path."""
    absmax = tl.max(tl.abs(x), 1)
    scale = tl.maximum(tl.math.div_rn(absmax, 127.0), MIN_SCALE).to(tl.float16)
    stored = _round_int8(tl.math.div_rn(x, scale.to(tl.float32)[:, None]))
    tl.store(cache_ptrs, stored, mask=mask)
    tl.store(scale_ptrs, scale.to(scale_ptrs.dtype.element_ty), mask=head_ok)


@triton.jit
def _write_kv_token_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_sh,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    """Per-token INT8, one program per token: all its KV heads at once, as a [heads, head_dim]
    tile, so each head's absmax is one row reduction."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    head_ok = (offs_h < NUM_KV_HEADS) & (slot >= 0)  # a negative slot: padding, skipped
    mask = head_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    s_dst = block * stride_sb + offset * stride_ss + offs_h * stride_sh
    t = token.to(tl.int64)
    k = tl.load(
        key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    v = tl.load(
        value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    _store_per_token(k, k_cache_ptr + dst, k_scale_ptr + s_dst, mask, head_ok, MIN_SCALE)
    _store_per_token(v, v_cache_ptr + dst, v_scale_ptr + s_dst, mask, head_ok, MIN_SCALE)


def _check_token_scales(
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, k_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token INT8's scale caches: [num_blocks, block_size, num_kv_heads] of the cache, one
    set of strides for both (the kernels take one). Never copied: the writer fills them."""
    shape = tuple(k_cache.shape[:3])
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None or tuple(scale.shape) != shape or not scale.is_floating_point():
            raise ValueError(
                f"{PER_TOKEN_KIND} caches need {name}: a float scale cache {list(shape)} "
                "([num_blocks, block_size, num_kv_heads], one scale per token and head)"
            )
    assert k_scale is not None and v_scale is not None
    if k_scale.stride() != v_scale.stride():
        raise ValueError("k_scale and v_scale (scale caches) must have the same strides")
    return k_scale, v_scale


def _check_scale(scale: torch.Tensor | None, num_kv_heads: int, name: str) -> torch.Tensor:
    if scale is None:
        raise ValueError(f"quantized caches need {name} (one float32 scale per KV head)")
    if scale.numel() != num_kv_heads:
        raise ValueError(f"{name}: expected {num_kv_heads} scales, got {scale.numel()}")
    return scale.reshape(-1).to(torch.float32).contiguous()


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_cache_dtype: str) -> int:
    fmt = kv_format(kv_cache_dtype)
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.dim() != 4 or k_cache.stride(3) != 1:
        raise ValueError(
            "caches must be [num_blocks, block_size, num_kv_heads, head_dim], dim-contiguous"
        )
    expected = {
        FMT_E4M3: torch.uint8,
        FMT_E5M2: torch.uint8,
        FMT_INT8: torch.int8,
        FMT_INT8_TOKEN: torch.int8,
    }.get(fmt)
    if expected is not None and k_cache.dtype != expected:
        raise ValueError(f"{kv_cache_dtype} caches are stored as {expected}, got {k_cache.dtype}")
    return fmt


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter key/value ([num_tokens, num_kv_heads, head_dim]) into their cache slots.

    Token ``i`` goes to ``slot_mapping[i]``; tokens whose slot is negative are skipped. Only the
    first ``slot_mapping.numel()`` rows of key/value are read. For ``int8_token`` k_scale and
    v_scale are the scale caches, written at the same slots.
    """
    fmt = _check_cache(k_cache, v_cache, kv_cache_dtype)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    if key.shape[0] < num_tokens or value.shape[0] < num_tokens:
        raise ValueError("slot_mapping has more entries than key/value have tokens")
    if key.shape[1:] != (num_kv_heads, head_dim) or value.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"key/value must be [tokens, {num_kv_heads}, {head_dim}]")
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    if fmt == FMT_INT8_TOKEN:
        _write_per_token(
            key,
            value,
            k_cache,
            v_cache,
            slot_mapping.contiguous(),
            *_check_token_scales(k_scale, v_scale, k_cache),
        )
        return
    if fmt == FMT_AUTO:
        k_scale = v_scale = slot_mapping  # never read
    else:
        k_scale = _check_scale(k_scale, num_kv_heads, "k_scale")
        v_scale = _check_scale(v_scale, num_kv_heads, "v_scale")
    width = num_kv_heads * head_dim
    block = min(triton.next_power_of_2(width), 2048)
    grid = (num_tokens, triton.cdiv(width, block))
    _write_kv_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping.contiguous(),
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK=block,
        KV_FMT=fmt,
        num_warps=4 if block >= 512 else 2,
    )


def _write_per_token(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Per-token INT8: one program per token, its heads and head_dim padded to powers of two."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    heads_pad, dim_pad = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    _write_kv_token_kernel[(slots.numel(),)](
        key,
        value,
        k_cache,
        v_cache,
        slots,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *k_scale.stride(),
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=heads_pad,
        HEAD_DIM_PAD=dim_pad,
        MIN_SCALE=MIN_TOKEN_SCALE,
        num_warps=4 if heads_pad * dim_pad >= 512 else 2,
    )


write_kv = write_kv_triton

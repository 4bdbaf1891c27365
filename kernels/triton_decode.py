"""Triton decode attention (split-K / flash-decoding): one query token per sequence, and the
log-sum-exp merge of the splits. Launched by `triton_attention.paged_attention_decode`, whose
docstring holds the design."""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_tiles import _head_scales, _load_kv_tile, _tile_offsets, _token_scales


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    v_mult,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_sb,
    stride_ss,
    stride_sh,
    stride_pb,
    stride_ph,
    stride_ps,
    split_size,
    USE_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_FMT: tl.constexpr,
    FP32_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (batch, num_kv_heads, num_splits): one query token per sequence.

    split_size is a runtime argument, not a constexpr: it follows the step's longest context
    (the whole of it when unsplit), and a constexpr that changes with every step's length
    made Triton compile a new kernel almost every step (~0.4 s each on the first H200 run)."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(seq_lens_ptr + seq)
    if USE_SPLITS:
        start = split * split_size
        end = tl.minimum(start + split_size, ctx_len)
        if start >= end:  # this sequence is shorter: nothing to do
            return
    else:
        start = 0
        end = ctx_len  # empty (ctx_len 0): zeros out
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    row_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask,
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)
    k_scale, v_scale = _head_scales(qk_scale, v_mult, k_scale_ptr, v_scale_ptr, kvh, KV_FMT)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for tok in range(start, end, BLOCK_N):
        pos = tok + offs_n
        valid = pos < end
        rows = _tile_offsets(bt_row, pos, valid, kvh, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
        kv_mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = _load_kv_tile(k_cache_ptr, rows, kv_mask, offs_d, KV_FMT, q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * k_scale  # [G, N], log2 units
        if KV_FMT == 4:  # per-token INT8: each key's scale multiplies its column of scores
            s_rows = _tile_offsets(
                bt_row, pos, valid, kvh, stride_sb, stride_ss, stride_sh, BLOCK_SIZE
            )
            s = s * _token_scales(k_scale_ptr, s_rows, valid)[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv_tile(v_cache_ptr, rows, kv_mask, offs_d, KV_FMT, q.dtype)
        pv = p
        if KV_FMT == 4:  # ... and each value's scale its column of probabilities (not l_i).
            # Rounded to fp16 with fp16 queries, p x scale may fall below fp16's normal range:
            # under 2^-24 x 127 absolute per token, far under the output's own fp16 rounding.
            pv = p * _token_scales(v_scale_ptr, s_rows, valid)[None, :]
        acc = acc * alpha[:, None] + tl.dot(pv.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    if USE_SPLITS:
        part = seq.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part[:, None] + offs_d[None, :], out, mask=row_mask)
        # part_lse is part_out without its last (HEAD_DIM_PAD) dimension.
        tl.store(part_lse_ptr + part // HEAD_DIM_PAD, m_i + tl.log2(l_i), mask=offs_g < GROUP)
    else:
        o = out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o, out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_ot,
    stride_oh,
    split_size,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """Grid (batch, num_heads): merge the splits' normalised outputs by log-sum-exp."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx_len = tl.load(seq_lens_ptr + seq)
    num_splits = tl.cdiv(ctx_len, split_size)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < num_splits
    base = seq.to(tl.int64) * stride_pb + head * stride_ph + offs_s * stride_ps
    lse = tl.load(part_lse_ptr + base // HEAD_DIM_PAD, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # empty context: no NaN
    weight = tl.where(s_mask, tl.exp2(lse - lse_max), 0.0)
    parts = tl.load(
        part_out_ptr + base[:, None] + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )

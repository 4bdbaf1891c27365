"""Triton (chunked) prefill attention: query tiles of a ragged chunk attend causally to the
cached prefix and to themselves. Launched by `triton_attention.paged_attention_prefill`, whose
docstring holds the design."""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_tiles import _head_scales, _load_kv_tile, _tile_offsets, _token_scales


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    fresh_k_ptr,
    fresh_v_ptr,
    qk_scale,
    v_mult,
    fresh_qk_scale,
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
    stride_ft,
    stride_fh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_FMT: tl.constexpr,
    FP32_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FRESH: tl.constexpr,
):
    """Grid (query tiles, batch, num_kv_heads). A tile is BLOCK_Q query tokens x the head group,
    flattened to BLOCK_Q * GROUP_PAD rows; it attends causally to the cached prefix and itself.
    With FRESH, the chunk's own positions are read from this step's K/V ([tokens, kv heads,
    head_dim], rows as the queries') instead of the stored bytes of a quantized cache (and
    need no scale: per-token INT8's scale caches are read for the prefix only)."""
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # this sequence has fewer query tiles
        return
    ctx_len = tl.load(seq_lens_ptr + seq)
    prefix = ctx_len - q_len
    offs_m = tl.arange(0, BLOCK_Q * GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    tok = q_tile * BLOCK_Q + offs_m // GROUP_PAD
    heads = kvh * GROUP + offs_m % GROUP_PAD
    row_ok = (tok < q_len) & (offs_m % GROUP_PAD < GROUP)
    row_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask,
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)
    k_scale, v_scale = _head_scales(qk_scale, v_mult, k_scale_ptr, v_scale_ptr, kvh, KV_FMT)
    q_pos = prefix + tok  # absolute position of each row's token
    kv_end = tl.minimum(ctx_len, prefix + (q_tile + 1) * BLOCK_Q)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    cache_end = prefix if FRESH else kv_end
    for tok0 in range(0, cache_end, BLOCK_N):
        pos = tok0 + offs_n
        valid = pos < cache_end
        kv_rows = _tile_offsets(
            bt_row, pos, valid, kvh, stride_cb, stride_cs, stride_ch, BLOCK_SIZE
        )
        kv_mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = _load_kv_tile(k_cache_ptr, kv_rows, kv_mask, offs_d, KV_FMT, q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * k_scale
        if KV_FMT == 4:  # per-token INT8: each key's scale multiplies its column of scores
            s_rows = _tile_offsets(
                bt_row, pos, valid, kvh, stride_sb, stride_ss, stride_sh, BLOCK_SIZE
            )
            s = s * _token_scales(k_scale_ptr, s_rows, valid)[None, :]
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv_tile(v_cache_ptr, kv_rows, kv_mask, offs_d, KV_FMT, q.dtype)
        pv = p
        if KV_FMT == 4:  # ... and each value's scale its column of probabilities (not l_i)
            pv = p * _token_scales(v_scale_ptr, s_rows, valid)[None, :]
        acc = acc * alpha[:, None] + tl.dot(pv.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if FRESH:
        # Fresh values carry no cache scale: scores take the plain softmax scale, and V is
        # divided by the cache's V scale here because the epilogue multiplies every row by it.
        inv_v = 1.0 / v_scale
        for tok0 in range(prefix, kv_end, BLOCK_N):
            pos = tok0 + offs_n
            valid = pos < kv_end
            f_rows = (q_start + pos - prefix).to(tl.int64) * stride_ft + kvh * stride_fh
            kv_mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
            f_offs = f_rows[:, None] + offs_d[None, :]
            k = tl.load(fresh_k_ptr + f_offs, mask=kv_mask, other=0.0).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * fresh_qk_scale
            s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = (tl.load(fresh_v_ptr + f_offs, mask=kv_mask, other=0.0).to(tl.float32) * inv_v).to(
                q.dtype
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
    # m_i is finite here: every query row sees at least its own position.
    out = acc * (v_scale / l_i)[:, None]
    o = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o, out.to(out_ptr.dtype.element_ty), mask=row_mask)

"""Paged attention in torch: the CPU path of the engine and the reference for the Triton kernels.

Cache layout (one pair per layer): ``k_cache``/``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. A token's slot is
``block_id * block_size + offset``. Quantized caches store bytes (``torch.uint8`` for FP8,
``torch.int8`` for INT8) with one float32 scale per KV head: ``stored = x / scale``; or, for
INT8 with per-token scales (kind ``int8_token``), one float16 scale per token and KV head in a
scale cache ``[num_blocks, block_size, num_kv_heads]`` of the same block table, passed as
``k_scale``/``v_scale``: the token's own absmax / 127, computed when it is written.

A step's tokens are laid out sequence by sequence: sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]``, which are its *last* ``q_len`` positions out of
``seq_lens[i]`` context tokens (cached prefix + this step's tokens, already written).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention_api import AttentionBackend
from .kv_formats import PER_TOKEN_KIND

FP8_FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
INT8_MAX = 127.0
# The smallest normal float16: a per-token scale below it would lose precision (an all-zero
# head still gets a usable scale, and stores zeros).
MIN_TOKEN_SCALE = 2.0**-14


def cache_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in FP8_FORMATS:
        return torch.uint8
    if kv_cache_dtype in ("int8", PER_TOKEN_KIND):
        return torch.int8
    raise ValueError(f"kv_cache_dtype: unknown value {kv_cache_dtype!r}")


def quantize(x: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor | None) -> torch.Tensor:
    """x: [..., num_kv_heads, head_dim] -> stored representation; scale: [num_kv_heads]."""
    if kv_cache_dtype == "auto":
        return x
    assert scale is not None, "quantized caches need a per-head scale"
    scaled = x.float() / scale.view(-1, 1)
    if kv_cache_dtype in FP8_FORMATS:
        limit = FP8_MAX[kv_cache_dtype]
        return scaled.clamp(-limit, limit).to(FP8_FORMATS[kv_cache_dtype]).view(torch.uint8)
    return scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., num_kv_heads, head_dim] -> (int8 of the same shape, float16 scales [..., heads]).
    The scale is rounded to float16 before dividing, so that stored * scale is what was meant
    (the rounding only moves the step, by up to 2^-11, clamped at +-127)."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / INT8_MAX).clamp_min(MIN_TOKEN_SCALE).to(torch.float16)
    stored = (xf / scale.float().unsqueeze(-1)).round().clamp(-INT8_MAX, INT8_MAX)
    return stored.to(torch.int8), scale


def dequantize(
    stored: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of `quantize`: stored [..., num_kv_heads, head_dim] -> out_dtype."""
    if kv_cache_dtype == "auto":
        return stored.to(out_dtype)
    assert scale is not None
    if kv_cache_dtype in FP8_FORMATS:
        return _dequantize_fp8_table(stored, kv_cache_dtype, scale, out_dtype)
    return (stored.float() * scale.view(-1, 1)).to(out_dtype)


def _dequantize_fp8_table(
    stored: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """FP8 bytes -> out_dtype through a 256-entry table per KV head (byte value x the head's
    scale, rounded once to out_dtype): bit-identical to ``(fp8.float() * scale).to(out_dtype)``
    but faster on the CPU, where torch's fp8 -> float conversion is scalar code: 0.5 vs 3.3 ms
    for 590k elements, and a decode step of the small demo model (32 sequences x ~100 tokens, one
    thread) 182 ms instead of 218 ms (bf16 cache: 137 ms)."""
    heads = scale.numel()
    codes = torch.arange(256, dtype=torch.uint8, device=stored.device)
    values = codes.view(FP8_FORMATS[kv_cache_dtype]).float()
    table = (values[None, :] * scale.view(-1, 1).float()).to(out_dtype)  # [heads, 256]
    offsets = torch.arange(heads, dtype=torch.int32, device=stored.device).view(heads, 1) * 256
    index = stored.to(torch.int32) + offsets
    return table.view(-1).index_select(0, index.view(-1)).view(stored.shape)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter new K/V ([num_tokens, num_kv_heads, head_dim]) into their slots.

    A negative slot (-1) marks a padding token: it is skipped (as in the Triton kernel).
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    if kv_cache_dtype == PER_TOKEN_KIND:
        assert k_scale is not None and v_scale is not None, "per-token INT8 needs scale caches"
        for x, flat, scales in ((key, flat_k, k_scale), (value, flat_v, v_scale)):
            stored, scale = quantize_per_token(x)
            flat.index_copy_(0, slot_mapping, stored)
            scales.view(num_blocks * block_size, num_kv_heads).index_copy_(0, slot_mapping, scale)
        return
    flat_k.index_copy_(0, slot_mapping, quantize(key, kv_cache_dtype, k_scale).to(k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, quantize(value, kv_cache_dtype, v_scale).to(v_cache.dtype))


def gather_kv(
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    max_len: int,
    kv_cache_dtype: str,
    scale: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """[B, max_blocks] block tables -> [B, num_kv_heads, max_len, head_dim] (padded)."""
    block_size = cache.shape[1]
    blocks_needed = (max_len + block_size - 1) // block_size
    batch = block_tables.shape[0]
    # index_select of whole blocks as rows of a 2-D view: on the CPU ~5x faster than on the 4-D
    # cache (which copies element-wise) and ~30x faster than advanced indexing.
    flat_ids = block_tables[:, :blocks_needed].reshape(-1)
    gathered = cache.view(cache.shape[0], -1).index_select(0, flat_ids)  # [B * nb, bs*Hkv*D]
    gathered = gathered.view(batch, blocks_needed * block_size, *cache.shape[2:])[:, :max_len]
    if kv_cache_dtype == PER_TOKEN_KIND:
        # The token's scales through the same block ids: [B, L, Hkv], one per row of D values.
        assert scale is not None, "per-token INT8 needs its scale cache"
        scales = scale.view(scale.shape[0], -1).index_select(0, flat_ids)
        scales = scales.view(batch, blocks_needed * block_size, scale.shape[2])[:, :max_len]
        gathered = (gathered.float() * scales.float().unsqueeze(-1)).to(out_dtype)
    elif kv_cache_dtype != "auto":
        gathered = dequantize(gathered, kv_cache_dtype, scale, out_dtype)
    values = gathered.transpose(1, 2)
    # Contiguous [B, Hkv, L, D] so the matmuls take K^T and V as they are. Left strided, matmul
    # makes its own copy, and for K^T an element-wise transposed one: 3x slower at batch 64.
    # (empty + copy_ is ~2x faster than .contiguous() on the CPU here, and converts a 16-bit
    # cache to out_dtype in the same pass.)
    return torch.empty(values.shape, dtype=out_dtype, device=values.device).copy_(values)


def paged_attention(
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
    """Causal attention of each sequence's new queries over its whole (paged) context.

    query: [num_tokens, num_heads, head_dim]; returns the same shape. One padded
    scaled-dot-product call for the whole batch; GQA through `enable_gqa`. key/value (optional,
    [num_tokens, num_kv_heads, head_dim]): this step's K/V of the same rows, which a prefill over
    a quantized cache then reads for the chunk's own positions instead of the stored bytes.
    """
    num_tokens, num_heads, head_dim = query.shape
    batch = seq_lens.shape[0]
    device = query.device
    query_lens = query_start_loc[1:] - query_start_loc[:-1]

    # Decode of one or two sequences on the CPU computes in float32: their K/V are a few hundred
    # KB, and there the float32 matmuls (MKL) beat the 16-bit ones, whose per-call cost
    # dominates (73 vs 111 us a layer).
    small_cpu_decode = max_query_len == 1 and batch <= 2 and device.type == "cpu"
    kv_dtype = torch.float32 if small_cpu_decode else query.dtype
    keys = gather_kv(k_cache, block_tables, max_seq_len, kv_cache_dtype, k_scale, kv_dtype)
    values = gather_kv(v_cache, block_tables, max_seq_len, kv_cache_dtype, v_scale, kv_dtype)

    if max_query_len == 1:
        # Decode batch: one query per sequence. Two batched matmuls over the head group:
        # the CPU's fused SDPA kernel is ~20x slower than this for single-query bf16.
        num_kv_heads = k_cache.shape[2]
        q = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).to(kv_dtype)
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale
        if batch > 1 or int(seq_lens[0]) < max_seq_len:  # else no key is padding
            key_pos = torch.arange(max_seq_len, device=device)
            padding = (key_pos[None, :] >= seq_lens[:, None]).view(batch, 1, 1, max_seq_len)
            scores.masked_fill_(padding, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs.to(values.dtype), values)
        return out.reshape(num_tokens, num_heads, head_dim).to(query.dtype)

    if batch == 1:
        return _one_prefill(
            query, keys, values, int(seq_lens[0]), scale, kv_cache_dtype, key, value
        )

    # Scatter the ragged queries into a padded [B, max_q] grid.
    row = torch.arange(num_tokens, device=device)
    seq_of_row = torch.repeat_interleave(torch.arange(batch, device=device), query_lens)
    pos_in_query = row - query_start_loc[:-1][seq_of_row]
    padded = query.new_zeros(batch, max_query_len, num_heads, head_dim)
    padded[seq_of_row, pos_in_query] = query
    if key is not None and value is not None and kv_cache_dtype != "auto":
        # The chunk's own K/V as computed, not as read back from a quantized cache (as vLLM's
        # prefill attends to its fresh K/V): the quantization error then enters only through
        # earlier steps' tokens instead of compounding through every layer of the prompt.
        abs_pos = (seq_lens - query_lens)[seq_of_row] + pos_in_query
        keys[seq_of_row, :, abs_pos] = key.to(keys.dtype)
        values[seq_of_row, :, abs_pos] = value.to(values.dtype)

    # Query i of sequence s sits at absolute position seq_len - q_len + i.
    q_abs = (seq_lens - query_lens)[:, None] + torch.arange(max_query_len, device=device)[None]
    key_pos = torch.arange(max_seq_len, device=device)
    mask = key_pos[None, None, :] <= q_abs[:, :, None]
    # Padded query rows see key 0 only, so softmax stays finite; their output is dropped.
    mask[:, :, 0] = True
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2),
        keys,
        values,
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)[seq_of_row, pos_in_query]


def _one_prefill(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seq_len: int,
    scale: float,
    kv_cache_dtype: str,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
) -> torch.Tensor:
    """paged_attention's prefill of one sequence: no padded grid to scatter into and, for a
    prompt with no cached context, SDPA's own causal mask instead of a boolean one (a 128-token
    prompt of the small demo shape: 0.65 instead of 1.3 ms a layer on a Zen 3)."""
    num_tokens = query.shape[0]
    start = seq_len - num_tokens
    if key is not None and value is not None and kv_cache_dtype != "auto":
        # The chunk's own K/V as computed (see paged_attention).
        keys[0, :, start:seq_len] = key.transpose(0, 1).to(keys.dtype)
        values[0, :, start:seq_len] = value.transpose(0, 1).to(values.dtype)
    q = query.unsqueeze(0).transpose(1, 2)
    if start == 0:
        out = F.scaled_dot_product_attention(
            q, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        # SDPA's is_causal aligns query 0 with key 0; these queries sit at start.. instead.
        q_abs = torch.arange(start, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_abs[:, None]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return out[0].transpose(0, 1)


# The torch pair: the reference for every other backend, and the CPU's path without native kernels.
TORCH_ATTENTION = AttentionBackend("torch", write_kv, paged_attention)

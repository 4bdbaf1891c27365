"""Triton paged attention: decode (split-K / flash-decoding) and chunked prefill, the launch
side (shapes checked, grids and constexprs chosen); the kernels are in `triton_decode` and
`triton_prefill`, their shared tile helpers in `triton_tiles`, the KV write in `triton_kv`.

Same contract as `paged_attention.paged_attention` (the torch reference): cache
``[num_blocks, block_size, num_kv_heads, head_dim]`` read through ``block_tables``; sequence
``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``, its last ``q_len`` positions
out of ``seq_lens[i]`` (already written) context tokens.

Design:
* One program per (sequence, KV head[, split / query tile]) handles the whole GQA head group,
  so every K/V byte is read once per group: the group's query rows (padded to a power of two,
  at least 16 for `tl.dot`) multiply each K/V tile with `tl.dot`.
* K/V are read a tile of ``BLOCK_N`` tokens at a time; each token's physical row comes from the
  block table, and a row is ``head_dim`` contiguous elements (coalesced loads).
* Quantized caches are read at their stored width and converted in registers (FP8 through fp16
  bit tricks, see `triton_kv`), never with fp8 dots: works on Ampere. The per-head K scale is
  folded into the softmax scale and the V scale into the output.
* Per-token INT8 (``int8_token``: k_scale / v_scale are float16 scale caches
  ``[num_blocks, block_size, num_kv_heads]`` on the same block table) reads a tile's scales
  beside its K/V: a key's scale multiplies its column of scores after the dot, a value's scale
  its column of probabilities before the dot with V (the softmax sum stays unscaled), so the
  int8 values go into the dots as they are stored (exact in 16 bits) and no dequantized tile
  is ever built. Those scales add 2 bytes per token and head to the head_dim bytes read.
* Online softmax in fp32 (base 2). Decode splits long contexts across programs and merges the
  partial results by log-sum-exp in a second kernel.
* 16-bit queries use 16-bit dots with fp32 accumulation on the GPU; fp32 queries use IEEE fp32
  dots. Off the GPU (TRITON_INTERPRET=1) every dot is fp32: the interpreter's bf16 dot is broken.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from .attention_api import AttentionBackend
from .triton_decode import _decode_kernel, _decode_reduce_kernel
from .triton_kv import (
    FMT_AUTO,
    FMT_INT8_TOKEN,
    FMT_MULTIPLIER,
    _check_cache,
    _check_scale,
    _check_token_scales,
)
from .triton_kv import write_kv_triton as write_kv_triton
from .triton_prefill import _prefill_kernel

__all__ = [
    "KernelConfig",
    "choose_split_size",
    "default_config",
    "paged_attention_decode",
    "paged_attention_prefill",
    "paged_attention_triton",
    "write_kv_triton",
]

LOG2E = 1.4426950408889634
PREFILL_BLOCK_M = 64  # query rows (tokens x padded group) per program (prefill)
MIN_SPLIT_SIZE = 512  # tokens: below this a split's fixed cost outweighs the parallelism
MAX_SPLITS = 64


@dataclass(frozen=True)
class KernelConfig:
    """Launch knobs. Defaults were checked offline with ptxas (no spills on sm80 / sm90 for
    bf16 and FP8 caches, head_dim 128); tune on a GPU with ``python -m appliance.kernels.bench
    --sweep``."""

    block_n: int = 64  # context tokens per loop iteration
    num_warps: int = 8
    num_stages: int = 2


def default_config(head_dim: int) -> KernelConfig:
    if head_dim <= 64:
        return KernelConfig(block_n=64, num_warps=4)
    if head_dim <= 128:
        return KernelConfig(block_n=64, num_warps=8)
    return KernelConfig(block_n=32, num_warps=8)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_split_size(
    batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device, block_n: int = 64
) -> int:
    """Tokens per decode split: split the context only when (batch x KV heads) programs
    cannot fill the GPU; never below MIN_SPLIT_SIZE tokens. A split size >= max_seq_len means
    no split (one kernel, no reduction)."""
    if device.type != "cuda":
        return max(max_seq_len, 1)
    programs = batch * num_kv_heads
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= 2 * sms or max_seq_len <= 2 * MIN_SPLIT_SIZE:
        return max(max_seq_len, 1)
    splits = min(triton.cdiv(4 * sms, programs), MAX_SPLITS)  # about 4 programs per SM
    size = max(MIN_SPLIT_SIZE, triton.cdiv(max_seq_len, splits))
    return triton.cdiv(size, block_n) * block_n


class _Launch:
    """Checked shapes and the arguments shared by the decode and prefill launches."""

    def __init__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        kv_cache_dtype: str,
        scale: float,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
    ) -> None:
        self.fmt = _check_cache(k_cache, v_cache, kv_cache_dtype)
        _, self.block_size, self.num_kv_heads, self.head_dim = k_cache.shape
        if query.dim() != 3 or query.shape[2] != self.head_dim:
            raise ValueError(f"query must be [tokens, heads, {self.head_dim}]")
        self.num_heads = query.shape[1]
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        self.group = self.num_heads // self.num_kv_heads
        self.query = query if query.stride(2) == 1 else query.contiguous()
        # int32 metadata: one compiled variant whatever the engine passes (no-op if already so).
        self.block_tables = block_tables.to(torch.int32)
        if self.block_tables.stride(1) != 1:
            self.block_tables = self.block_tables.contiguous()
        scale_strides: tuple[int, ...] = (0, 0, 0)  # per-token INT8's scale caches only
        if self.fmt == FMT_AUTO:
            self.k_scale = self.v_scale = block_tables  # never read
        elif self.fmt == FMT_INT8_TOKEN:
            self.k_scale, self.v_scale = _check_token_scales(k_scale, v_scale, k_cache)
            scale_strides = self.k_scale.stride()
        else:
            self.k_scale = _check_scale(k_scale, self.num_kv_heads, "k_scale")
            self.v_scale = _check_scale(v_scale, self.num_kv_heads, "v_scale")
        self.qk_scale = scale * LOG2E * FMT_MULTIPLIER[self.fmt]
        self.v_mult = FMT_MULTIPLIER[self.fmt]
        self.fp32_dot = query.dtype == torch.float32 or query.device.type != "cuda"
        self.head_dim_pad = max(triton.next_power_of_2(self.head_dim), 16)
        self.cache_strides = (
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            self.block_tables.stride(0),
            *scale_strides,
        )


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    split_size: int | None = None,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Decode: query row ``i`` ([batch, num_heads, head_dim]) is sequence ``i``'s last token.

    ``split_size`` (tokens per program along the context) defaults to `choose_split_size`;
    a sequence with ``seq_lens == 0`` gets zeros. For ``int8_token`` k_scale / v_scale are the
    float16 scale caches ``[num_blocks, block_size, num_kv_heads]``, read per token.
    """
    a = _Launch(query, k_cache, v_cache, block_tables, kv_cache_dtype, scale, k_scale, v_scale)
    batch = seq_lens.shape[0]
    out = query.new_empty(query.shape) if out is None else out
    if batch == 0:
        return out
    cfg = config or default_config(a.head_dim_pad)
    if split_size is None:
        split_size = choose_split_size(
            batch, a.num_kv_heads, max_seq_len, query.device, cfg.block_n
        )
    split_size = max(int(split_size), 1)
    num_splits = max(triton.cdiv(max_seq_len, split_size), 1)
    use_splits = num_splits > 1
    group_pad = max(triton.next_power_of_2(a.group), 16)
    if use_splits:
        part_out = torch.empty(
            batch, a.num_heads, num_splits, a.head_dim_pad, dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            batch, a.num_heads, num_splits, dtype=torch.float32, device=query.device
        )
        part_strides = part_out.stride()[:3]
    else:
        part_out = part_lse = out  # never touched
        part_strides = (0, 0, 0)
    seq_lens = seq_lens.to(torch.int32).contiguous()
    _decode_kernel[(batch, a.num_kv_heads, num_splits)](
        a.query,
        k_cache,
        v_cache,
        a.block_tables,
        seq_lens,
        a.k_scale,
        a.v_scale,
        out,
        part_out,
        part_lse,
        a.qk_scale,
        a.v_mult,
        a.query.stride(0),
        a.query.stride(1),
        out.stride(0),
        out.stride(1),
        *a.cache_strides,
        *part_strides,
        # Unsplit, the kernel reads no split size: a constant keeps Triton's ==1 / %16
        # specialisation of this argument from following the context length.
        split_size if use_splits else 0,
        USE_SPLITS=use_splits,
        GROUP=a.group,
        GROUP_PAD=group_pad,
        HEAD_DIM=a.head_dim,
        HEAD_DIM_PAD=a.head_dim_pad,
        BLOCK_SIZE=a.block_size,
        BLOCK_N=cfg.block_n,
        KV_FMT=a.fmt,
        FP32_DOT=a.fp32_dot,
        DOT_PRECISION="ieee" if a.fp32_dot else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if use_splits:
        _decode_reduce_kernel[(batch, a.num_heads)](
            part_out,
            part_lse,
            seq_lens,
            out,
            *part_strides,
            out.stride(0),
            out.stride(1),
            split_size,
            SPLITS_PAD=max(triton.next_power_of_2(num_splits), 2),
            HEAD_DIM=a.head_dim,
            HEAD_DIM_PAD=a.head_dim_pad,
            num_warps=4,
        )
    return out


def paged_attention_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """(Chunked) prefill: ragged query chunks attending causally to prefix + themselves.

    key/value (optional, [num_tokens, num_kv_heads, head_dim]): this step's K/V of the query
    rows; over a quantized cache the chunk's own positions then come from them (as the torch
    reference's `paged_attention(key=, value=)` does). Scales as `paged_attention_decode`."""
    a = _Launch(query, k_cache, v_cache, block_tables, kv_cache_dtype, scale, k_scale, v_scale)
    fresh = key is not None and value is not None and a.fmt != FMT_AUTO
    if fresh:
        assert key is not None and value is not None
        if key.shape != (query.shape[0], a.num_kv_heads, a.head_dim) or value.shape != key.shape:
            raise ValueError(f"key/value must be [tokens, {a.num_kv_heads}, {a.head_dim}]")
        if key.stride(2) != 1 or value.stride() != key.stride():  # one set of strides for both
            key, value = key.contiguous(), value.contiguous()
    else:
        key = value = a.query  # never read
    batch = seq_lens.shape[0]
    out = query.new_empty(query.shape) if out is None else out
    if batch == 0 or max_query_len == 0:
        return out
    cfg = config or default_config(a.head_dim_pad)
    group_pad = triton.next_power_of_2(a.group)
    block_q = max(PREFILL_BLOCK_M // group_pad, 1)  # rows = block_q * group_pad >= 16
    grid = (triton.cdiv(max_query_len, block_q), batch, a.num_kv_heads)
    _prefill_kernel[grid](
        a.query,
        k_cache,
        v_cache,
        a.block_tables,
        seq_lens.to(torch.int32).contiguous(),
        query_start_loc.to(torch.int32).contiguous(),
        a.k_scale,
        a.v_scale,
        out,
        key,
        value,
        a.qk_scale,
        a.v_mult,
        scale * LOG2E,
        a.query.stride(0),
        a.query.stride(1),
        out.stride(0),
        out.stride(1),
        *a.cache_strides,
        key.stride(0),
        key.stride(1),
        GROUP=a.group,
        GROUP_PAD=group_pad,
        HEAD_DIM=a.head_dim,
        HEAD_DIM_PAD=a.head_dim_pad,
        BLOCK_SIZE=a.block_size,
        BLOCK_Q=block_q,
        BLOCK_N=cfg.block_n,
        KV_FMT=a.fmt,
        FP32_DOT=a.fp32_dot,
        DOT_PRECISION="ieee" if a.fp32_dot else "tf32",
        FRESH=fresh,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def paged_attention_triton(
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
    """Drop-in for `paged_attention.paged_attention`: the decode kernel when every sequence
    brings one query token (``max_query_len == 1``), the prefill kernel otherwise (which reads
    the chunk's fresh key/value over a quantized cache, as the reference does)."""
    if max_query_len == 1:
        return paged_attention_decode(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            scale,
            max_seq_len,
            kv_cache_dtype,
            k_scale,
            v_scale,
        )
    return paged_attention_prefill(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        max_query_len,
        kv_cache_dtype,
        k_scale,
        v_scale,
        key=key,
        value=value,
    )


TRITON_ATTENTION = AttentionBackend("triton", write_kv_triton, paged_attention_triton)

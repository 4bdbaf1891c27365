"""Triton segment (grouped) LoRA matmuls, the GPU side of a LoRA linear's update (the CUDA
backend's choice: appliance.engine.cuda_lora), in the manner of S-LoRA's SGMV and vLLM's punica
kernels: the rows that run an adapter are grouped by slot once per step (`SlotSegments`), and
each program works on one slot's segment, so a batch mixing adapters and base rows costs one
shrink and one expand launch a linear, and base rows cost nothing.

- `lora_shrink`: t[i] = x[row_i] @ A_slot^T over each segment's rows, accumulated and returned
  in float32 (segment order: t's row i belongs to `segments.rows[i]`). K may be split across
  programs (float32 atomic adds into a zeroed t) so a decode step of a few rows still fills
  the GPU.
- `lora_expand`: out[row_i] += t[i] @ B_slot^T, in place, in out's dtype.

The factors are the slot pool's: A (slots * width, K) with slot s's rows at s * width, B
transposed (slots * width, N); `width` is the pool's padded rank times the parts of a merged
projection (A stacked along the rank, B block-diagonal: one dot covers every part, the zero
blocks included); a wide one is tiled MAX_BLOCK_R factor rows at a time (shrink: programs of
their own; expand: a loop). 16-bit factors take 16-bit dots with float32 accumulation on the
GPU; off the GPU (TRITON_INTERPRET=1) every dot is float32, since the interpreter's bf16 dot is
broken.
Tested under the interpreter against torch and a float64 reference (tests/test_triton_lora.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Rows of one segment a program takes (tl.dot needs at least 16).
BLOCK_M = 16
# Columns of K a shrink program's loop step takes, and output columns of an expand program.
BLOCK_K = 32
BLOCK_N = 64
# Factor rows (the stacked rank) a program takes at once: a wide merged projection (q|k|v at
# rank 256 is 768 rows) is tiled, so the tiles stay within registers and shared memory.
MAX_BLOCK_R = 64
# A shrink splits K over up to this many programs when the segments alone launch few.
MAX_SPLIT_K = 8
# Programs a shrink launch should have before K is split further (an SM count's order).
TARGET_PROGRAMS = 128


@dataclass(frozen=True)
class SlotSegments:
    """The adapter rows of one step grouped by slot, on the device. `rows`: the row indices,
    slot by slot (base rows left out); segment g covers rows[starts[g] : starts[g] + counts[g]]
    and runs slot `slots[g]`. `max_count` (on the host) sizes the launch grids."""

    rows: torch.Tensor
    slots: torch.Tensor
    starts: torch.Tensor
    counts: torch.Tensor
    max_count: int

    @property
    def num_segments(self) -> int:
        return int(self.slots.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])


def slot_segments(slot_ids: torch.Tensor, device: torch.device) -> SlotSegments:
    """Groups the rows by slot (-1: a base row, left out) on the host, where the step's slots
    were set, and moves the result to `device` in one copy."""
    ids = slot_ids.to("cpu", torch.int64)
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    adapter = sorted_ids >= 0
    rows = order[adapter]
    slots, counts = torch.unique_consecutive(sorted_ids[adapter], return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    packed = torch.cat([rows, slots, starts, counts]).to(torch.int32).to(device)
    n, s = int(rows.shape[0]), int(slots.shape[0])
    return SlotSegments(
        rows=packed[:n],
        slots=packed[n : n + s],
        starts=packed[n + s : n + 2 * s],
        counts=packed[n + 2 * s :],
        max_count=int(counts.max()) if s else 0,
    )


@triton.jit
def _shrink(
    x_ptr,
    a_ptr,
    t_ptr,
    rows_ptr,
    slots_ptr,
    starts_ptr,
    counts_ptr,
    K,
    WIDTH,
    stride_x,
    stride_a,
    k_per_split,
    r_blocks,
    FP32_DOT: tl.constexpr,
    ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    seg = tl.program_id(1)
    split = tl.program_id(2) // r_blocks
    r_block = tl.program_id(2) % r_blocks
    count = tl.load(counts_ptr + seg)
    if pid_m * BLOCK_M >= count:
        return
    start = tl.load(starts_ptr + seg)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = offs_m < count
    rows = tl.load(rows_ptr + start + offs_m, mask=valid, other=0).to(tl.int64)
    offs_r = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    a_rows = slot * WIDTH + offs_r
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_begin = split * k_per_split
    for k0 in range(0, k_per_split, BLOCK_K):
        offs_k = k_begin + k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + offs_k[None, :],
            mask=valid[:, None] & in_k[None, :],
            other=0.0,
        )
        a = tl.load(
            a_ptr + a_rows[None, :] * stride_a + offs_k[:, None],
            mask=(offs_r[None, :] < WIDTH) & in_k[:, None],
            other=0.0,
        )
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x.to(a.dtype), a)
    t_ptrs = t_ptr + (start + offs_m)[:, None] * WIDTH + offs_r[None, :]
    t_mask = valid[:, None] & (offs_r[None, :] < WIDTH)
    if ATOMIC:
        tl.atomic_add(t_ptrs, acc, mask=t_mask)
    else:
        tl.store(t_ptrs, acc, mask=t_mask)


@triton.jit
def _expand(
    out_ptr,
    t_ptr,
    b_ptr,
    rows_ptr,
    slots_ptr,
    starts_ptr,
    counts_ptr,
    N,
    WIDTH,
    stride_out,
    stride_b,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    seg = tl.program_id(2)
    count = tl.load(counts_ptr + seg)
    if pid_m * BLOCK_M >= count:
        return
    start = tl.load(starts_ptr + seg)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = offs_m < count
    rows = tl.load(rows_ptr + start + offs_m, mask=valid, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs_n < N
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, WIDTH, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        in_r = offs_r < WIDTH
        t = tl.load(
            t_ptr + (start + offs_m)[:, None] * WIDTH + offs_r[None, :],
            mask=valid[:, None] & in_r[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + (slot * WIDTH + offs_r)[:, None] * stride_b + offs_n[None, :],
            mask=in_r[:, None] & in_n[None, :],
            other=0.0,
        )
        if FP32_DOT:
            delta += tl.dot(t, b.to(tl.float32), input_precision="ieee")
        else:
            delta += tl.dot(t.to(b.dtype), b)
    o_ptrs = out_ptr + rows[:, None] * stride_out + offs_n[None, :]
    o_mask = valid[:, None] & in_n[None, :]
    base = tl.load(o_ptrs, mask=o_mask, other=0.0)
    tl.store(o_ptrs, (base.to(tl.float32) + delta).to(base.dtype), mask=o_mask)


def _block_r(width: int) -> int:
    return min(MAX_BLOCK_R, max(16, triton.next_power_of_2(width)))


def _fp32_dot(factors: torch.Tensor) -> bool:
    """float32 factors, or no GPU (the interpreter): IEEE float32 dots."""
    return factors.dtype == torch.float32 or factors.device.type != "cuda"


def shrink_split(segments: SlotSegments, k: int) -> int:
    """How many programs share K: enough for about TARGET_PROGRAMS programs, each with at
    least one BLOCK_K step; one off the GPU, where the interpreter runs programs in turn."""
    if segments.rows.device.type != "cuda":
        return 1
    programs = triton.cdiv(segments.max_count, BLOCK_M) * segments.num_segments
    wanted = triton.cdiv(TARGET_PROGRAMS, max(1, programs))
    return max(1, min(MAX_SPLIT_K, wanted, triton.cdiv(k, BLOCK_K)))


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    segments: SlotSegments,
    width: int,
    split_k: int | None = None,
) -> torch.Tensor:
    """(segments.num_rows, width) float32: each segment row's x @ A_slot^T. `x`: (rows, K)
    with unit column stride; `a`: (slots * width, K) contiguous."""
    k = x.shape[1]
    assert x.stride(1) == 1 and a.stride(1) == 1 and a.shape[1] == k, (x.shape, a.shape)
    split = shrink_split(segments, k) if split_k is None else split_k
    # Each split's K range is a whole number of BLOCK_K steps.
    k_per_split = triton.cdiv(triton.cdiv(k, BLOCK_K), split) * BLOCK_K
    alloc = torch.zeros if split > 1 else torch.empty
    t = alloc(segments.num_rows, width, dtype=torch.float32, device=x.device)
    if segments.num_segments == 0:
        return t
    block_r = _block_r(width)
    r_blocks = triton.cdiv(width, block_r)
    grid = (triton.cdiv(segments.max_count, BLOCK_M), segments.num_segments, split * r_blocks)
    _shrink[grid](
        x,
        a,
        t,
        segments.rows,
        segments.slots,
        segments.starts,
        segments.counts,
        k,
        width,
        x.stride(0),
        a.stride(0),
        k_per_split,
        r_blocks,
        FP32_DOT=_fp32_dot(a),
        ATOMIC=split > 1,
        BLOCK_M=BLOCK_M,
        BLOCK_R=block_r,
        BLOCK_K=BLOCK_K,
    )
    return t


def lora_expand(
    out: torch.Tensor, t: torch.Tensor, b_t: torch.Tensor, segments: SlotSegments, width: int
) -> torch.Tensor:
    """out[row] += t[i] @ B_slot^T for each segment row, in place; returns out. `out`: (rows,
    N) with unit column stride; `t`: lora_shrink's; `b_t`: (slots * width, N) contiguous."""
    n = out.shape[1]
    assert out.stride(1) == 1 and b_t.stride(1) == 1 and b_t.shape[1] == n, (out.shape, b_t.shape)
    assert t.dtype == torch.float32 and t.is_contiguous() and t.shape[1] == width
    if segments.num_segments == 0:
        return out
    grid = (
        triton.cdiv(segments.max_count, BLOCK_M),
        triton.cdiv(n, BLOCK_N),
        segments.num_segments,
    )
    _expand[grid](
        out,
        t,
        b_t,
        segments.rows,
        segments.slots,
        segments.starts,
        segments.counts,
        n,
        width,
        out.stride(0),
        b_t.stride(0),
        FP32_DOT=_fp32_dot(b_t),
        BLOCK_M=BLOCK_M,
        BLOCK_R=_block_r(width),
        BLOCK_N=BLOCK_N,
    )
    return out

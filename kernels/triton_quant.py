"""Triton dequantizing matmuls over the packed layouts of appliance.kernels.quant_weight (4-bit
groups: q4; INT8 and the 8-bit GGUF formats: q8), the GPU side of a packed linear's matmul (the
CUDA backend wires it: layers/matmul.py).

Each program dequantizes a [BLOCK_N, BLOCK_K] tile of the packed weight in registers
(nibble = byte >> (4 * (column // 16 % 2)) within each 32-column run; scale and min gathered
per column's group) and multiplies it into a float32 accumulator:
- `_gemm`: tl.dot over [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles (prefills, wide decode
  batches; tensor cores in fp16/bf16, IEEE fp32 when the activations are fp32);
- `_gemv`: one row of x per program, a multiply and a row sum, no padding of M to 16 (decode
  steps of a few sequences, which read each weight byte once per row block).
No dense copy of the weight is ever made. Tested under TRITON_INTERPRET=1 against the torch
reference (tests/test_triton_quant.py); timed on a GPU only where one is present.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant_weight import QuantWeight

# Rows of x up to which the GEMV kernel runs.
GEMV_MAX_ROWS = 8


@triton.jit
def _dequant_tile(q_ptr, s_ptr, m_ptr, offs_n, offs_k, N, K, G, GROUP, BITS: tl.constexpr):
    """float32 [BLOCK_N, BLOCK_K] of rows offs_n, columns offs_k (zeros outside the matrix)."""
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    grp = offs_k // GROUP
    s = tl.load(s_ptr + offs_n[:, None] * G + grp[None, :], mask=mask, other=0.0).to(tl.float32)
    if BITS == 4:
        # Column c of a 32-column run sits in byte c % 16 of it, high nibble when c % 32 >= 16.
        byte = (offs_k // 32) * 16 + offs_k % 16
        raw = tl.load(q_ptr + offs_n[:, None] * (K // 2) + byte[None, :], mask=mask, other=0)
        shift = ((offs_k // 16) % 2) * 4
        val = ((raw.to(tl.int32) >> shift[None, :]) & 0xF).to(tl.float32)
        mn = tl.load(m_ptr + offs_n[:, None] * G + grp[None, :], mask=mask, other=0.0)
        w = val * s + mn.to(tl.float32)
    else:
        raw = tl.load(q_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask, other=0)
        w = raw.to(tl.float32) * s
    return w


@triton.jit
def _gemm(
    x_ptr,
    q_ptr,
    s_ptr,
    m_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    G,
    GROUP,
    stride_x,
    stride_y,
    BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xm = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=xm, other=0.0)
        w = _dequant_tile(q_ptr, s_ptr, m_ptr, offs_n, offs_k, N, K, G, GROUP, BITS)
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w).to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    ym = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], acc, mask=ym)


@triton.jit
def _gemv(
    x_ptr,
    q_ptr,
    s_ptr,
    m_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    G,
    GROUP,
    stride_x,
    stride_y,
    BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        w = _dequant_tile(q_ptr, s_ptr, m_ptr, offs_n, offs_k, N, K, G, GROUP, BITS)
        acc += tl.sum(w * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs_n, acc, mask=offs_n < N)


def quant_matmul_triton(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias), accumulated in float32, returned in x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = x2.shape
    n = w.out_features
    assert k == w.in_features, (k, w.in_features)
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    groups = w.scales.shape[1]
    mins = w.mins if w.mins is not None else w.scales  # never read for q8
    bits = 4 if w.fmt == "q4" else 8
    bias_arg = bias if bias is not None else y
    # 32-column runs for q4 (one run a tile keeps the nibble arithmetic simple).
    block_k = 32
    if m <= GEMV_MAX_ROWS:
        block_n = 32
        grid = (m, triton.cdiv(n, block_n))
        _gemv[grid](
            x2,
            w.qweight,
            w.scales,
            mins,
            bias_arg,
            y,
            n,
            k,
            groups,
            w.group,
            x2.stride(0),
            y.stride(0),
            BITS=bits,
            HAS_BIAS=bias is not None,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
        )
    else:
        block_m, block_n = 16, 32
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _gemm[grid](
            x2,
            w.qweight,
            w.scales,
            mins,
            bias_arg,
            y,
            m,
            n,
            k,
            groups,
            w.group,
            x2.stride(0),
            y.stride(0),
            BITS=bits,
            HAS_BIAS=bias is not None,
            FP32_DOT=x2.dtype == torch.float32,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
        )
    return y.to(x.dtype).reshape(*lead, n)

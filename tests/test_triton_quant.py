"""The Triton dequantizing GEMV/GEMM (kernels/triton_quant.py) under TRITON_INTERPRET=1 against
the torch reference (appliance.kernels.quant_weight): 4-bit groups (fp16 and float32 mins) and 8-bit
(per group and per channel, K not a multiple of the tile), odd N, with and without bias, on
both kernels (rows at and above the GEMV limit)."""

from __future__ import annotations

import pytest
import torch
from appliance.kernels.quant_weight import QuantWeight, pack_q4, quantize_int8
from appliance.kernels.triton_quant import GEMV_MAX_ROWS, quant_matmul_triton


def _q4(n: int, k: int, group: int, mins_dtype: torch.dtype) -> QuantWeight:
    g = torch.Generator().manual_seed(n * k)
    values = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.1 + 0.01).half()
    mins = (torch.randn(n, k // group, generator=g) * 0.1).to(mins_dtype)
    return QuantWeight("q4", pack_q4(values), scales, mins, group, k)


def _q8(n: int, k: int, group: int) -> QuantWeight:
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, -(-k // group), generator=g) * 0.02 + 0.001).half()
    return QuantWeight("q8", q, scales, None, group, k)


CASES = {
    "q4 g32 fp16 mins": lambda: _q4(37, 96, 32, torch.float16),
    "q4 g128 fp32 mins": lambda: _q4(19, 256, 128, torch.float32),
    "q8 g32": lambda: _q8(21, 64, 32),
    "q8 g16": lambda: _q8(33, 48, 16),
    "q8 per-channel K=75": lambda: quantize_int8(torch.randn(17, 75)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("rows", [1, 3, GEMV_MAX_ROWS + 9])
@pytest.mark.parametrize("bias", [False, True])
def test_triton_quant_matmul_matches_torch(name: str, rows: int, bias: bool) -> None:
    w = CASES[name]()
    x = torch.randn(rows, w.in_features)
    b = torch.randn(w.out_features) if bias else None
    ref = x @ w.dequantize().T + (b if b is not None else 0)
    got = quant_matmul_triton(x, w, b)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


def test_triton_quant_matmul_fp16_activations() -> None:
    """16-bit activations take the tensor-core dot (w cast to x's dtype)."""
    w = CASES["q4 g32 fp16 mins"]()
    x = torch.randn(20, w.in_features).half()
    got = quant_matmul_triton(x, w, None)
    assert got.dtype == torch.float16
    ref = x.float() @ w.dequantize().T
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())

"""The CPU matmul switch: 1-2 row passes take ATen's GEMV, wider ones oneDNN, and torch's global
flag is put back afterwards (kv-eval and calibration forwards run outside the runner)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from appliance.layers.linear import NATIVE_GEMM_MAX_ROWS, cpu_gemm_for

CPU = torch.device("cpu")


@pytest.mark.parametrize("rows", [1, NATIVE_GEMM_MAX_ROWS, NATIVE_GEMM_MAX_ROWS + 1, 64])
def test_switch_follows_rows_and_is_restored(rows: int) -> None:
    assert torch.backends.mkldnn.enabled
    with cpu_gemm_for(rows, CPU):
        assert torch.backends.mkldnn.enabled == (rows > NATIVE_GEMM_MAX_ROWS)
    assert torch.backends.mkldnn.enabled


def test_restored_after_an_error() -> None:
    with pytest.raises(RuntimeError), cpu_gemm_for(1, CPU):
        raise RuntimeError("forward failed")
    assert torch.backends.mkldnn.enabled


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_bf16_linear_on_either_path_matches_float64(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    w = torch.randn(3072, 576, generator=gen).bfloat16()
    reference = F.linear(x.double(), w.double())
    with cpu_gemm_for(rows, CPU):
        out = F.linear(x, w)
    # One bf16 rounding of an fp32-accumulated dot product of 576 terms.
    torch.testing.assert_close(out.double(), reference, rtol=1e-2, atol=0.25)

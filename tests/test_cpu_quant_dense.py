"""Wide passes over row-tiled packed weights as dequantize + float32 GEMM
(kernels/cpu_quant_dense.py, model.cpu_quant_dense_rows): from the threshold on they compute
the float32 reference on the exactly dequantized weights (closer to it than int8 activations),
slice by slice through the one scratch buffer; below it, and over row-major weights, the int8
kernel runs and computes the int8-activation arithmetic (cpu_quant.act8_reference)."""

from __future__ import annotations

import pytest
import torch
from appliance.kernels import cpu_quant
from appliance.kernels.cpu_quant_dense import DenseWidePasses, dequant_tiles

from appliance.config import load_config
from appliance.cpu.backend import CpuBackend, plan_cpu
from appliance.layers.quant import quantize_int8
from tests.test_cpu_quant import _q4, _q8

CASES = [
    ("q4 g32", lambda: _q4(40, 96, 32, 21)),
    ("q4 g128 float32 mins (AWQ/GPTQ)", lambda: _q4(24, 384, 128, 22, torch.float32)),
    ("q8 g32 (Q8_0)", lambda: _q8(48, 160, 32, 23)),
]

DEQUANT_CASES = CASES + [
    ("q8 g64 ending short of K", lambda: _q8(8, 96, 64, 24)),
    ("q8 per-channel (INT8)", lambda: quantize_int8(torch.randn(32, 224))),
]


@pytest.mark.parametrize("name,make", DEQUANT_CASES, ids=[c[0] for c in DEQUANT_CASES])
def test_whole_tiles_dequantize_exactly(cpu_path: str, name: str, make) -> None:  # type: ignore[no-untyped-def]
    """The transposing AVX2 tile dequantization gives the reference's values bit for bit."""
    cpu_quant.forget_builds()
    w = make()
    t = cpu_quant.tiled_for_int8(w)
    assert t.tile_rows == 8
    n, k = w.out_features, w.in_features
    into = torch.full((n * k + 5,), float("nan"))
    assert torch.equal(dequant_tiles(t, 0, n, into), w.dequantize())
    if n > 8:
        assert torch.equal(dequant_tiles(t, 8, n, into), w.dequantize()[8:])
        assert torch.equal(dequant_tiles(t, 0, 8, into), w.dequantize()[:8])


@pytest.mark.parametrize("name,make", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("slice_rows", [16, 1000])  # slices of 2 tiles, the last one short; one
def test_wide_passes_dequantize_and_match_the_float32_reference(
    cpu_path: str, name: str, make, slice_rows: int  # type: ignore[no-untyped-def]
) -> None:
    cpu_quant.forget_builds()
    w = make()
    t = cpu_quant.tiled_for_int8(w)
    assert t.tile_rows == 8
    k = w.in_features
    wide = DenseWidePasses(min_rows=20, slice_floats=slice_rows * k)
    assert wide.nbytes() == slice_rows * k * 4
    bias = torch.randn(w.out_features)
    exact_w = w.dequantize()

    x = torch.randn(2, 10, k, dtype=torch.bfloat16)  # 20 rows: taken
    got = wide(x, t, bias)
    assert wide.dense_passes == 1 and got.dtype == torch.bfloat16 and got.shape == (2, 10, w.out_features)
    ref = (x.float().reshape(20, k) @ exact_w.T + bias).reshape(2, 10, -1)
    torch.testing.assert_close(got.float(), ref.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    x32 = torch.randn(25, k)
    ref32 = x32 @ exact_w.T + bias
    torch.testing.assert_close(wide(x32, t, bias), ref32, rtol=1e-5, atol=1e-5 * ref32.abs().max().item())
    assert wide.dense_passes == 2
    # It is not the int8 arithmetic: that differs from the exact product by far more.
    act8 = cpu_quant.act8_reference(x32, w) + bias
    assert (act8 - ref32).abs().max() > 100 * (wide(x32, t, bias) - ref32).abs().max()

    # One row fewer: the int8 row-tile kernel, its own arithmetic, no dense pass.
    x19 = torch.randn(19, k)
    below = wide(x19, t, None)
    assert wide.dense_passes == 3
    ref8 = cpu_quant.act8_reference(x19, w)
    torch.testing.assert_close(below, ref8, rtol=1e-4, atol=1e-4 * ref8.abs().max().item())
    # Row-major weights (shapes the tiles do not take) keep their kernels at any width.
    wide(x32, w, None)
    assert wide.dense_passes == 3


def test_the_backend_wires_it_from_the_config() -> None:
    config = load_config(None, {"model.cpu_quant_activations": "int8"})
    plan = plan_cpu(config, 4, 2)
    backend = CpuBackend(plan, act8=True, dense_rows=48)
    matmul = backend._quant_matmul()
    if matmul is not cpu_quant.quant_matmul_act8 and not isinstance(matmul, DenseWidePasses):
        pytest.skip("no native kernels on this box")
    assert isinstance(matmul, DenseWidePasses) and matmul.min_rows == 48
    assert backend._quant_matmul() is matmul  # one scratch for the whole model
    assert backend.describe()["quant_dense_scratch_bytes"] == matmul.nbytes() > 0
    assert CpuBackend(plan, act8=True, dense_rows=0)._quant_matmul() is cpu_quant.quant_matmul_act8
    assert CpuBackend(plan, act8=False, dense_rows=48)._quant_matmul() is cpu_quant.quant_matmul

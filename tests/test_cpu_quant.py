"""The packed-weight CPU kernels (kernels/cpu_quant.c) against the torch reference
(appliance.kernels.quant_weight), at odd sizes: rows not a multiple of the two-row or four-row blocks,
batches with tails of the 4-row x blocks, groups that end mid-vector, per-channel rows of odd
length; natively and under the AVX2 mask (the `cpu_path` fixture rebuilds for each)."""

from __future__ import annotations

import pytest
import torch
from appliance.kernels import cpu_quant
from appliance.kernels.quant_weight import QuantWeight, pack_q4, quantize_int8, unpack_q4


def _q4(
    n: int, k: int, group: int, seed: int, mins_dtype: torch.dtype = torch.float16
) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.1 + 0.01).half()
    mins = (torch.randn(n, k // group, generator=g) * 0.1).to(mins_dtype)
    return QuantWeight("q4", pack_q4(values), scales, mins, group, k)


def _q8(n: int, k: int, group: int, seed: int) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, -(-k // group), generator=g) * 0.02 + 0.001).half()
    return QuantWeight("q8", q, scales, None, group, k)


CASES = [
    ("q4 g32", lambda: _q4(37, 96, 32, 1)),
    ("q4 g128 float32 mins (AWQ/GPTQ)", lambda: _q4(29, 384, 128, 2, torch.float32)),
    ("q4 g32 wide", lambda: _q4(5, 224, 32, 3)),
    ("q8 g32 (Q8_0)", lambda: _q8(33, 160, 32, 4)),
    ("q8 g16 (Q6_K)", lambda: _q8(19, 112, 16, 5)),
    ("q8 per-channel, odd K", lambda: quantize_int8(torch.randn(23, 203))),
    ("q8 group ends mid-vector", lambda: _q8(9, 100, 36, 6)),
]


def test_q4_pack_round_trips() -> None:
    values = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    assert torch.equal(unpack_q4(pack_q4(values)), values)
    # ggml's order: byte i holds column i low and column i + 16 high.
    assert int(pack_q4(values)[0, 0]) == int(values[0, 0]) | (int(values[0, 16]) << 4)


@pytest.mark.parametrize("name,make", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("batch", [1, 2, 3, 5, 7, 16])
def test_quant_matmul_matches_torch(cpu_path: str, name: str, make, batch: int) -> None:  # type: ignore[no-untyped-def]
    cpu_quant.forget_builds()
    assert cpu_quant.load() is not None, cpu_quant.load_error()
    w = make()
    x = torch.randn(batch, w.in_features)
    bias = torch.randn(w.out_features)
    ref = x @ w.dequantize().T + bias
    got = cpu_quant.quant_matmul(x, w, bias)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("name,make", CASES[:4], ids=[c[0] for c in CASES[:4]])
def test_wide_pass_takes_the_dense_tile_and_matches(cpu_path: str, name: str, make) -> None:  # type: ignore[no-untyped-def]
    """Above DENSE_TILE_ROWS rows (prefills): a transient float32 tile and torch's GEMM."""
    cpu_quant.forget_builds()
    w = make()
    x = torch.randn(cpu_quant.DENSE_TILE_ROWS + 3, w.in_features, dtype=torch.bfloat16)
    got = cpu_quant.quant_matmul(x, w, None)
    assert got.dtype == torch.bfloat16
    ref = (x.float() @ w.dequantize().T).to(torch.bfloat16)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name,make", CASES, ids=[c[0] for c in CASES])
def test_dequant_rows_matches_torch(cpu_path: str, name: str, make) -> None:  # type: ignore[no-untyped-def]
    cpu_quant.forget_builds()
    w = make()
    rows = torch.tensor([w.out_features - 1, 0, 2, 2])
    assert torch.equal(cpu_quant.dequant_rows(w, rows), w.dequantize()[rows])
    assert torch.equal(cpu_quant.dequant_rows(w), w.dequantize())


@pytest.mark.parametrize("name,make", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("batch", [1, 3, 6])
def test_int8_activation_dot_matches_its_torch_reference(
    cpu_path: str, name: str, make, batch: int
) -> None:  # type: ignore[no-untyped-def]
    """model.cpu_quant_activations = "int8": x rounded to int8 per 32 columns, integer dot
    products (VNNI where built for it). Shapes it cannot take (K or group not in whole
    32-column blocks) keep the float32 dot: those must still equal the float32 reference."""
    cpu_quant.forget_builds()
    w = make()
    x = torch.randn(batch, w.in_features)
    got = cpu_quant.quant_matmul(x, w, None, act8=True)
    eligible = w.in_features % 32 == 0 and w.group % 32 == 0
    ref = cpu_quant.act8_reference(x, w) if eligible else x @ w.dequantize().T
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    if eligible:  # and it is a rounding of the float32 product, not something else
        exact = x @ w.dequantize().T
        assert (got - exact).abs().max() < 0.05 * exact.abs().max()


def test_packed_linear_with_a_dense_copy_reads_the_copy() -> None:
    """A packed MatmulWeight the CPU backend gave a dense copy (on AMX) runs its torch-path
    passes on the copy, at any width (the packed bytes then serve the fused decode only):
    the result equals the torch reference, and a poisoned copy shows in every pass."""
    from appliance.layers.linear import MatmulWeight
    from appliance.layers.matmul import CopyMatmul, reference_quant_matmul

    w = _q4(96, 128, 32, seed=5)
    layer = MatmulWeight()
    layer.quant = w
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 128, generator=gen)
    packed = layer._matmul(x, None)  # no copy: the packed kernel (the reference here)
    torch.testing.assert_close(packed, reference_quant_matmul(x, w, None))
    layer.wire(CopyMatmul(w.dequantize(torch.float32), False))
    for rows in (1, 3, 40):
        x = torch.randn(rows, 128, generator=gen)
        torch.testing.assert_close(
            layer._matmul(x, None), reference_quant_matmul(x, w, None), rtol=1e-5, atol=1e-4
        )
    layer.wire(CopyMatmul(torch.full((96, 128), float("nan")), False))
    assert torch.isnan(layer._matmul(torch.randn(1, 128, generator=gen), None)).all()


def test_weight_bytes_counts_a_packed_linears_dense_copy() -> None:
    """quant-eval's memory figure: the packed bytes, plus the dense copy the backend wired
    beside them (AMX), read from the linear's matmul strategy."""
    from appliance.layers.linear import MatmulWeight
    from appliance.layers.matmul import CopyMatmul, PackedMatmul, reference_quant_matmul
    from appliance.tools.quant_eval import weight_bytes

    w = _q4(96, 128, 32, seed=5)
    layer = MatmulWeight()
    layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    layer.quant = w
    layer.wire(PackedMatmul(reference_quant_matmul, w))
    packed_only = weight_bytes(layer)
    assert packed_only == w.nbytes()
    layer.wire(CopyMatmul(w.dequantize(torch.bfloat16), False))
    assert weight_bytes(layer) == packed_only + 96 * 128 * 2

"""Row-tiled packed weights (QuantWeight.tile_rows = 8, kernels/cpu_quant_tiles.h): the reorder
round-trips, and the int8-activation kernels over tiles match the torch reference of the
int8-activation arithmetic (cpu_quant.act8_reference) at odd sizes: K an odd number of
32-column blocks, groups that end short of K, x batches with tails of the 4-row x blocks;
natively and under the AVX2 mask (the `cpu_path` fixture)."""

from __future__ import annotations

import pytest
import torch
from appliance.kernels import cpu_quant
from appliance.kernels.quant_weight import QuantWeight, quantize_int8, tile_rows_of, untile_rows

from tests.test_cpu_quant import _q4, _q8

CASES = [
    ("q4 g32, 3 blocks", lambda: _q4(24, 96, 32, 11)),
    ("q4 g128 float32 mins (AWQ/GPTQ)", lambda: _q4(16, 384, 128, 12, torch.float32)),
    ("q4 g64, 7 blocks of 2-block groups", lambda: _q4(40, 448, 64, 13)),
    ("q8 g32 (Q8_0), 5 blocks", lambda: _q8(40, 160, 32, 14)),
    ("q8 g64 ending short of K", lambda: _q8(8, 96, 64, 15)),
    ("q8 per-channel (INT8)", lambda: quantize_int8(torch.randn(32, 224))),
]
IDS = [c[0] for c in CASES]


def _same(a: QuantWeight, b: QuantWeight) -> None:
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)
    assert (a.mins is None) == (b.mins is None)
    if a.mins is not None:
        assert torch.equal(a.mins, b.mins)  # type: ignore[arg-type]


@pytest.mark.parametrize("name,make", CASES, ids=IDS)
def test_tile_order_round_trips_and_dequantizes_alike(name: str, make) -> None:  # type: ignore[no-untyped-def]
    w = make()
    t = tile_rows_of(w)
    assert t.tile_rows == 8 and t.qweight.shape == w.qweight.shape and t.nbytes() == w.nbytes()
    assert not torch.equal(t.qweight, w.qweight)
    _same(untile_rows(t), w)
    rows = torch.tensor([w.out_features - 1, 0, 5, 5, 3])
    _same(untile_rows(t, rows), w.take_rows(rows))
    assert torch.equal(t.dequantize(), w.dequantize())


@pytest.mark.parametrize("name,make", CASES, ids=IDS)
def test_dequant_rows_reads_tiles(cpu_path: str, name: str, make) -> None:  # type: ignore[no-untyped-def]
    """The embedding lookup and the wide passes' float32 tile, from the tiled bytes."""
    cpu_quant.forget_builds()
    w = make()
    t = cpu_quant.tiled_for_int8(w)
    assert t.tile_rows == 8, "the AVX2 build has the tile kernels"
    rows = torch.tensor([w.out_features - 1, 0, 2, 2])
    assert torch.equal(cpu_quant.dequant_rows(t, rows), w.dequantize()[rows])
    assert torch.equal(cpu_quant.dequant_rows(t), w.dequantize())


@pytest.mark.parametrize("name,make", CASES, ids=IDS)
@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8, 16, 37])
def test_tiled_int8_dot_matches_its_torch_reference(
    cpu_path: str, name: str, make, batch: int
) -> None:  # type: ignore[no-untyped-def]
    """Up to 4 x rows a weight load, in blocks of 4 with tails; 37 rows: a prefill (tiled
    weights keep the packed kernel above DENSE_TILE_ROWS)."""
    cpu_quant.forget_builds()
    w = make()
    t = cpu_quant.tiled_for_int8(w)
    assert t.tile_rows == 8
    x = torch.randn(batch, w.in_features)
    bias = torch.randn(w.out_features)
    got = cpu_quant.quant_matmul(x, t, bias, act8=True)
    ref = cpu_quant.act8_reference(x, w) + bias
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    # The row-major int8 kernel computes the same thing (it takes the narrow passes only).
    if batch <= cpu_quant.DENSE_TILE_ROWS:
        plain = cpu_quant.quant_matmul(x, w, bias, act8=True)
        torch.testing.assert_close(got, plain, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_extreme_values_do_not_overflow_the_int16_sums(cpu_path: str) -> None:
    """Every nibble 15 against x at +-127 in every column: the q4 block's int16 sums reach
    their largest (8 x 2 x 15 x 127); q8 at -127/127 (and -128) likewise."""
    cpu_quant.forget_builds()
    n, k = 8, 64
    q4 = QuantWeight(
        "q4",
        torch.full((n, k // 2), 0xFF, dtype=torch.uint8),
        torch.ones(n, 2, dtype=torch.float16),
        torch.zeros(n, 2, dtype=torch.float16),
        32,
        k,
    )
    q = torch.full((n, k), -128, dtype=torch.int8)
    q[:, ::2] = 127
    q8 = QuantWeight("q8", q, torch.ones(n, 2, dtype=torch.float16), None, 32, k)
    for w in (q4, q8):
        for sign in (1.0, -1.0):
            x = torch.full((1, k), sign)
            got = cpu_quant.quant_matmul(x, cpu_quant.tiled_for_int8(w), None, act8=True)
            torch.testing.assert_close(got, x @ w.dequantize().T, rtol=1e-6, atol=1e-3)

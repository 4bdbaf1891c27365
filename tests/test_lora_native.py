"""The CPU's native LoRA update (kernels/cpu_lora.c through appliance.cpu.lora_update) against
a float64 per-row reference and against torch's update (appliance.layers.lora), in bf16 and
float32: rows of several slots mixed with base rows (slot -1), a merged projection whose parts
own block-diagonal pieces of B, an adapter of a lower rank zero-padded in its slot, odd sizes
(in features not a whole number of vectors, a part's columns ending mid-vector), x a strided
view, one row (its output columns split between threads) and many; on one and two threads,
natively and under the AVX2 mask (the `cpu_path` fixture rebuilds for each). The engine-level
proof, greedy tokens equal to peft's in a mixed batch, is tests/test_lora_exact.py, whose CPU
engines take this update."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from appliance.kernels import cpu_lora

from appliance.layers.lora import LoraBatch, LoraFactors, TorchLoraUpdate

SLOTS, RANK = 4, 8
# Three parts of a merged projection (q|k|v-like): output columns (first, count), unequal and
# not whole vectors.
PARTS = [(0, 40), (40, 24), (64, 13)]
IN_FEATURES = 100
# Slot 1 holds an adapter of rank 5: its factor rows 5..7 of each part stay zero.
PADDED_SLOT, PADDED_RANK = 1, 5

ROW_SLOTS = {
    "one row": [2],
    "mixed with base rows": [2, -1, 0, 2, 3, -1, 1, 1, 0],
    "many rows, every slot": [(i * 3) % 5 - 1 for i in range(37)],
    "one slot only": [3] * 6,
}


@pytest.fixture
def native_kernel(cpu_path: str) -> Iterator[str]:
    cpu_lora.forget_builds()
    if cpu_lora.load() is None:
        pytest.skip(f"native LoRA kernel unavailable: {cpu_lora.load_error()}")
    if cpu_path == "avx2":  # the masked build really is another one
        assert not cpu_lora.uses_dpbf16()
    yield cpu_path
    cpu_lora.forget_builds()


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(int(request.param))
    yield int(request.param)
    torch.set_num_threads(before)


def slot_factors(dtype: torch.dtype, seed: int) -> LoraFactors:
    """Random A; B block-diagonal over PARTS (each part's rank rows, its own columns)."""
    g = torch.Generator().manual_seed(seed)
    width = RANK * len(PARTS)
    out_features = sum(n for _, n in PARTS)
    a = torch.randn(SLOTS * width, IN_FEATURES, generator=g) / IN_FEATURES**0.5
    b_t = torch.zeros(SLOTS * width, out_features)
    for s in range(SLOTS):
        for p, (first, n) in enumerate(PARTS):
            lo = s * width + p * RANK
            rank = PADDED_RANK if s == PADDED_SLOT else RANK
            b_t[lo : lo + rank, first : first + n] = torch.randn(rank, n, generator=g) * 0.5
            a[lo + rank : lo + RANK] = 0.0
    return LoraFactors(a.to(dtype).contiguous(), b_t.to(dtype).contiguous(), RANK, PARTS)


def reference(
    base: torch.Tensor, x: torch.Tensor, f: LoraFactors, slots: list[int]
) -> torch.Tensor:
    """float64, row by row: base_i + x_i A_s^T B_s^T."""
    w = f.width
    out = base.double().clone()
    for i, s in enumerate(slots):
        if s >= 0:
            a, b_t = f.a[s * w : (s + 1) * w].double(), f.b_t[s * w : (s + 1) * w].double()
            out[i] += x[i].double() @ a.T @ b_t
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(ROW_SLOTS))
def test_native_update_matches_torch_and_a_float64_reference(
    dtype: torch.dtype, case: str, threads: int, native_kernel: str
) -> None:
    from appliance.kernels.cpu_features import detect

    from appliance.cpu.lora_update import NativeLoraUpdate

    slots = ROW_SLOTS[case]
    factors = slot_factors(dtype, seed=len(slots))
    g = torch.Generator().manual_seed(7)
    rows = len(slots)
    # x a column slice of a wider activation: rows IN_FEATURES + 12 apart.
    x = torch.randn(rows, IN_FEATURES + 12, generator=g).to(dtype)[:, 3 : 3 + IN_FEATURES]
    base = torch.randn(rows, sum(n for _, n in PARTS), generator=g).to(dtype)
    batch = LoraBatch(SLOTS)
    batch.set_rows(slots, torch.device("cpu"))

    out = base.clone()
    got = NativeLoraUpdate(factors, SLOTS, detect())(out, x, factors, batch)
    assert got.data_ptr() == out.data_ptr()  # in place, into the base output
    via_torch = TorchLoraUpdate()(base.clone(), x, factors, batch)
    expected = reference(base, x, factors, slots)

    # Base rows are untouched, bit for bit.
    for i, s in enumerate(slots):
        if s < 0:
            assert torch.equal(got[i], base[i])
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, via_torch, rtol=1e-5, atol=1e-5)
    else:
        # One bf16 rounding of the sum (torch's path rounds the shrink, the expand and the sum).
        ulp = expected.abs().clamp_min(1e-3) * 2**-8
        assert ((got.double() - expected).abs() <= ulp).all()
        torch.testing.assert_close(got.float(), via_torch.float(), rtol=0.03, atol=0.03)
    # The update is not nothing: every adapter row moved.
    moved = (got.double() - base.double()).abs().amax(dim=1)
    assert all(moved[i] > 1e-2 for i, s in enumerate(slots) if s >= 0)


def test_cpu_engine_wires_the_native_update(tiny_model_dir: Path) -> None:
    """The CPU backend chose the native update for every LoRA linear (where the kernel builds),
    so test_lora_exact's peft-equality tests run through it."""
    from appliance import Engine
    from appliance.config import load_config
    from appliance.cpu.lora_update import NativeLoraUpdate
    from appliance.layers.lora import LoraMatmul

    config = load_config(
        None,
        {
            "model.path": str(tiny_model_dir),
            "model.dtype": "float32",
            "cache.kv_cache_memory": 0.05,
            "hardware.device": "cpu",
            "lora.enabled": True,
        },
    )
    engine = Engine(config)
    try:
        pool = engine.runner.lora
        assert pool is not None
        for target in pool.targets:
            matmul = target.linear.matmul
            assert isinstance(matmul, LoraMatmul)
            assert isinstance(matmul.update, NativeLoraUpdate)
    finally:
        engine.loaded.close()


# The update on AMX tiles (kernels/cpu_lora_amx.inc.c) from the factors' tile-packed copy
# (appliance.cpu.lora_tiles): rank 16 (half a tile's K: the next block's half multiplied by
# zeros) and 48 (a whole block and a half), the same odd parts and in features, 40 rows of one
# slot (three work items of at most 16 rows).
TILE_ROW_SLOTS = {**ROW_SLOTS, "forty rows of one slot": [1] * 20 + [-1] + [1] * 20}


def tile_factors(rank: int, seed: int) -> LoraFactors:
    """slot_factors at another rank: random A, B block-diagonal over PARTS, bf16; slot
    PADDED_SLOT holds an adapter of a lower rank (zero rows past it)."""
    g = torch.Generator().manual_seed(seed)
    width = rank * len(PARTS)
    a = torch.randn(SLOTS * width, IN_FEATURES, generator=g) / IN_FEATURES**0.5
    b_t = torch.zeros(SLOTS * width, sum(n for _, n in PARTS))
    for s in range(SLOTS):
        held = rank - 3 if s == PADDED_SLOT else rank
        for p, (first, n) in enumerate(PARTS):
            lo = s * width + p * rank
            b_t[lo : lo + held, first : first + n] = torch.randn(held, n, generator=g) * 0.5
            a[lo + held : lo + rank] = 0.0
    bf16 = torch.bfloat16
    return LoraFactors(a.to(bf16).contiguous(), b_t.to(bf16).contiguous(), rank, PARTS)


@pytest.mark.parametrize("rank", [16, 48])
@pytest.mark.parametrize("case", list(TILE_ROW_SLOTS))
def test_tile_update_matches_a_float64_reference(rank: int, case: str, threads: int) -> None:
    """out_i + bf16(x_i A_s^T) B_s^T within one bf16 rounding of the sum (the tiles round the
    shrink to bf16 before the expand, as torch's bf16 path does), base rows untouched; and
    close to the vector update (which keeps the shrink in float32)."""
    from appliance.kernels.cpu_features import detect

    from appliance.cpu.lora_tiles import LoraTileCopy
    from appliance.cpu.lora_update import NativeLoraUpdate

    cpu_lora.forget_builds()
    if not cpu_lora.tiles_ready():
        pytest.skip("no AMX tiles here (CPU, compiler or APPLIANCE_CPU_MASK)")
    slots = TILE_ROW_SLOTS[case]
    plain = tile_factors(rank, seed=len(slots) + rank)
    tiled = LoraFactors(plain.a, plain.b_t, rank, PARTS, LoraTileCopy(plain, SLOTS))
    g = torch.Generator().manual_seed(11)
    rows = len(slots)
    x = torch.randn(rows, IN_FEATURES + 12, generator=g).to(torch.bfloat16)[:, 5 : 5 + IN_FEATURES]
    base = torch.randn(rows, sum(n for _, n in PARTS), generator=g).to(torch.bfloat16)
    batch = LoraBatch(SLOTS)
    batch.set_rows(slots, torch.device("cpu"))

    update = NativeLoraUpdate(tiled, SLOTS, detect())
    assert update.kernel.tiles is not None
    got = update(base.clone(), x, tiled, batch)
    vector = NativeLoraUpdate(plain, SLOTS, detect())(base.clone(), x, plain, batch)

    w = rank * len(PARTS)
    expected = base.double().clone()
    for i, s in enumerate(slots):
        if s >= 0:
            a, b_t = plain.a[s * w : (s + 1) * w].double(), plain.b_t[s * w : (s + 1) * w].double()
            shrunk = (x[i].double() @ a.T).to(torch.bfloat16).double()
            expected[i] += shrunk @ b_t
    for i, s in enumerate(slots):
        if s < 0:
            assert torch.equal(got[i], base[i])
    ulp = expected.abs().clamp_min(1e-3) * 2**-8
    assert ((got.double() - expected).abs() <= ulp + 1e-3).all()
    torch.testing.assert_close(got.float(), vector.float(), rtol=0.03, atol=0.03)
    moved = (got.double() - base.double()).abs().amax(dim=1)
    assert all(moved[i] > 1e-2 for i, s in enumerate(slots) if s >= 0)

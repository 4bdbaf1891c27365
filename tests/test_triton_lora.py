"""The Triton segment LoRA shrink and expand (kernels/triton_lora.py) through the CUDA backend's
update (appliance.engine.cuda_lora.TritonLoraUpdate), against TorchLoraUpdate and a float64
reference built from each adapter's own per-projection factors (not the slot pool's stacked
layout): several slots with base rows interleaved, a single-slot batch, ranks padded to the
pool's, merged projections (q|k|v, gate|up), fp16/bf16/fp32; a wrong slot must fail.

Under TRITON_INTERPRET=1 (tests/conftest.py) on CPU tensors; on a GPU machine the GPU check
runs this file with the interpreter off (appliance.tools.gpu_check_env.CUDA_MODULES), on CUDA
tensors and compiled kernels."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from appliance.kernels.triton_lora import (
    BLOCK_M,
    lora_expand,
    lora_shrink,
    shrink_split,
    slot_segments,
)

from appliance.engine.cuda_lora import SegmentCache, TritonLoraUpdate
from appliance.layers.lora import LoraBatch, LoraFactors, LoraUpdate, TorchLoraUpdate

# The interpreter runs on CPU tensors; with it off, the kernels need the GPU's.
DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
# Of the output's largest magnitude: float32 sums in another order, and a 16-bit output's
# rounding (the factors, x and the result are each rounded once to the dtype).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass
class Pool:
    """One linear's slot pool, laid out as appliance.engine.lora_pool fills it, and the
    adapters it was filled from: adapters[slot][part] = (A (r, K), B (n_part, r)), float64."""

    factors: LoraFactors
    adapters: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]


def make_pool(
    k: int, part_widths: list[int], slots: int, rank: int, ranks: dict[int, int], dtype: torch.dtype
) -> Pool:
    """`ranks`: each filled slot's adapter rank (<= the pool's `rank`: zero padding)."""
    gen = torch.Generator().manual_seed(k * 31 + slots + rank)
    parts, offset = [], 0
    for n in part_widths:
        parts.append((offset, n))
        offset += n
    width = rank * len(parts)
    a = torch.zeros(slots * width, k, dtype=torch.float64)
    b_t = torch.zeros(slots * width, offset, dtype=torch.float64)
    adapters: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for slot, r in ranks.items():
        adapters[slot] = []
        for p, (first, n) in enumerate(parts):
            a_p = torch.randn(r, k, generator=gen, dtype=torch.float64) / k**0.5
            b_p = torch.randn(n, r, generator=gen, dtype=torch.float64)
            a_p, b_p = a_p.to(dtype).double(), b_p.to(dtype).double()  # what the pool holds
            row = slot * width + p * rank
            a[row : row + r] = a_p
            b_t[row : row + r, first : first + n] = b_p.T
            adapters[slot].append((a_p, b_p))
    factors = LoraFactors(a.to(dtype).to(DEVICE), b_t.to(dtype).to(DEVICE), rank, parts)
    return Pool(factors, adapters)


def reference(out: torch.Tensor, x: torch.Tensor, pool: Pool, slots: list[int]) -> torch.Tensor:
    """float64: out plus each adapter row's x A_p^T B_p^T into each part's columns."""
    want = out.double().cpu().reshape(len(slots), -1).clone()
    xs = x.double().cpu().reshape(len(slots), -1)
    for row, slot in enumerate(slots):
        if slot < 0:
            continue
        for (first, n), (a_p, b_p) in zip(pool.factors.parts, pool.adapters[slot], strict=True):
            want[row, first : first + n] += (xs[row] @ a_p.T) @ b_p.T
    return want


def run_update(
    update: LoraUpdate, out: torch.Tensor, x: torch.Tensor, pool: Pool, slots: list[int], num: int
) -> torch.Tensor:
    batch = LoraBatch(num)
    batch.set_rows(slots, DEVICE)
    got = out.clone()
    result = update(got, x, pool.factors, batch)
    assert result.data_ptr() == got.data_ptr()  # in place
    return got


def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = want.abs().max().item()
    torch.testing.assert_close(
        got.double().cpu().reshape(want.shape), want, rtol=0, atol=TOLERANCE[dtype] * scale
    )


# (name, K, part widths, slots in the pool, pool rank, {slot: adapter rank}, each row's slot)
CASES = [
    (
        "4 slots, base rows interleaved",
        48,
        [40],
        6,
        8,
        {0: 8, 2: 8, 3: 8, 5: 8},
        [0, -1, 2, 3, -1, 5, 0, 0, 3, -1, 2, 5, 5, 0, -1, 3, 2, 2, 0, -1, 5],
    ),
    ("single slot", 40, [24], 2, 4, {1: 4}, [1] * 7),
    ("padded ranks", 64, [33], 4, 16, {0: 3, 1: 16, 3: 5}, [3, 0, 1, -1, 1, 3, 0, -1, 3]),
    # A segment longer than BLOCK_M rows: several row blocks of one slot.
    ("long segment", 32, [20], 3, 8, {2: 8, 0: 8}, [2, -1] * (BLOCK_M + 3) + [0, 0]),
    ("merged q|k|v", 48, [32, 16, 16], 4, 8, {0: 8, 1: 4, 3: 2}, [1, 3, -1, 0, 0, 1, 3, -1, 1]),
    ("merged gate|up", 32, [56, 56], 3, 4, {1: 4, 2: 3}, [2, 1, -1, 2, 2, 1, -1, -1]),
    # A stacked width of 3 * 40 = 120 factor rows: tiled (MAX_BLOCK_R) in both kernels.
    ("wide q|k|v, rank 40", 40, [24, 16, 16], 2, 40, {1: 40, 0: 33}, [0, 1, -1, 1, 1, 0]),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_update_matches_torch_and_float64(case: tuple, dtype: torch.dtype) -> None:
    _, k, widths, num, rank, ranks, slots = case
    pool = make_pool(k, widths, num, rank, ranks, dtype)
    gen = torch.Generator().manual_seed(len(slots))
    x = torch.randn(len(slots), k, generator=gen).to(dtype).to(DEVICE)
    out = torch.randn(len(slots), sum(widths), generator=gen).to(dtype).to(DEVICE)
    want = reference(out, x, pool, slots)
    got = run_update(TritonLoraUpdate(SegmentCache()), out, x, pool, slots, num)
    torch_got = run_update(TorchLoraUpdate(), out, x, pool, slots, num)
    check(got, want, dtype)
    check(torch_got, want, dtype)
    # Base rows are left exactly as the base matmul wrote them.
    base = torch.tensor([s < 0 for s in slots], device=DEVICE)
    assert torch.equal(got[base], out[base])


def test_float32_activations_on_16_bit_factors_and_3d_input() -> None:
    """x of the model's (batch, tokens, K) shape and a dtype other than the factors'."""
    slots = [1, -1, 0, 1, 0, -1]
    pool = make_pool(48, [24, 8, 8], 2, 4, {0: 4, 1: 2}, torch.bfloat16)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, len(slots), 48, generator=gen).to(DEVICE)
    out = torch.randn(1, len(slots), 40, generator=gen).to(DEVICE)
    want = reference(out, x.to(torch.bfloat16), pool, slots)
    got = run_update(TritonLoraUpdate(SegmentCache()), out, x, pool, slots, 2)
    assert got.shape == out.shape and got.dtype == torch.float32
    check(got, want, torch.bfloat16)


def test_strided_input_and_an_output_the_kernels_cannot_flatten() -> None:
    """x a column slice of a wider tensor (its row stride is not K: the kernels read it in
    place); out a transposed view (no unit column stride: torch's update adds into it
    instead), and a plain one, both written in place."""
    slots = [0, -1, 1, 1, 0]
    pool = make_pool(32, [16], 2, 4, {0: 4, 1: 4}, torch.float32)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(len(slots), 48, generator=gen).to(DEVICE)[:, 8:40]
    out_t = torch.randn(16, len(slots), generator=gen).to(DEVICE)
    want = reference(out_t.T, x, pool, slots)
    update = TritonLoraUpdate(SegmentCache())
    batch = LoraBatch(2)
    batch.set_rows(slots, DEVICE)
    got = out_t.clone()
    assert update(got.T, x, pool.factors, batch).data_ptr() == got.data_ptr()
    check(got.T, want, torch.float32)
    contiguous = out_t.T.contiguous()
    check(run_update(update, contiguous, x, pool, slots, 2), want, torch.float32)


@pytest.mark.parametrize("split_k", [1, 2, 5])
def test_split_k_shrink_matches(split_k: int) -> None:
    """The shrink with K split over programs (atomic float32 adds) gives the same t; K=100 is
    no multiple of a split's range (the last split is short, a fifth one empty)."""
    slots = [0, 2, -1, 2, 0, 0]
    pool = make_pool(100, [16], 3, 8, {0: 8, 2: 6}, torch.float32)
    x = torch.randn(len(slots), 100, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    segments = slot_segments(torch.tensor(slots, dtype=torch.int32), DEVICE)
    t = lora_shrink(x, pool.factors.a, segments, pool.factors.width, split_k=split_k)
    rows = segments.rows.long().cpu()
    a = pool.factors.a.double().cpu()
    want = torch.stack(
        [x[r].double().cpu() @ a[slots[r] * 8 : slots[r] * 8 + 8].T for r in rows.tolist()]
    )
    torch.testing.assert_close(t.double().cpu(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="off the GPU the shrink never splits K")
def test_split_k_grows_for_few_rows_and_stays_within_k() -> None:
    few = slot_segments(torch.tensor([0, 1], dtype=torch.int32), DEVICE)
    many = slot_segments(torch.tensor([0] * 4096, dtype=torch.int32), DEVICE)
    assert shrink_split(few, 4096) > 1
    assert shrink_split(many, 4096) == 1
    assert shrink_split(few, 16) == 1  # one BLOCK_K step: nothing to split


def test_segments_group_rows_by_slot_in_batch_order() -> None:
    seg = slot_segments(torch.tensor([3, -1, 0, 3, -1, 0, 3], dtype=torch.int32), DEVICE)
    assert seg.rows.tolist() == [2, 5, 0, 3, 6]
    assert seg.slots.tolist() == [0, 3]
    assert seg.starts.tolist() == [0, 2]
    assert seg.counts.tolist() == [2, 3]
    assert seg.max_count == 3
    empty = slot_segments(torch.tensor([-1, -1], dtype=torch.int32), DEVICE)
    assert empty.num_segments == 0 and empty.num_rows == 0


def test_segment_cache_regroups_only_for_a_new_step() -> None:
    cache = SegmentCache()
    batch = LoraBatch(4)
    batch.set_rows([1, -1, 1], DEVICE)
    assert batch.slot_ids is not None
    first = cache.segments(batch.slot_ids, DEVICE)
    assert cache.segments(batch.slot_ids, DEVICE) is first  # the step's other linears
    batch.set_rows([2, 2, -1], DEVICE)
    assert batch.slot_ids is not None
    assert cache.segments(batch.slot_ids, DEVICE).slots.tolist() == [2]


def test_a_wrong_slot_fails_the_reference() -> None:
    """The mutant: the same kernels handed each segment its neighbour's slot. The check must
    see it (the test's tolerance is not loose enough to pass any LoRA-ish answer)."""
    slots = [0, 1, -1, 1, 0, 2]
    pool = make_pool(32, [24, 8], 3, 4, {0: 4, 1: 4, 2: 4}, torch.bfloat16)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(len(slots), 32, generator=gen).to(torch.bfloat16).to(DEVICE)
    out = torch.randn(len(slots), 32, generator=gen).to(torch.bfloat16).to(DEVICE)
    want = reference(out, x, pool, slots)
    segments = slot_segments(torch.tensor(slots, dtype=torch.int32), DEVICE)
    width = pool.factors.width
    right = out.clone()
    t = lora_shrink(x, pool.factors.a, segments, width)
    lora_expand(right, t, pool.factors.b_t, segments, width)
    check(right, want, torch.bfloat16)
    wrong = replace(segments, slots=segments.slots.roll(1))
    mutant = out.clone()
    t = lora_shrink(x, pool.factors.a, wrong, width)
    lora_expand(mutant, t, pool.factors.b_t, wrong, width)
    with pytest.raises(AssertionError):
        check(mutant, want, torch.bfloat16)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the interpreter's run of the CPU engine")
def test_engine_with_the_triton_update_matches_peft(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA backend's update in a whole model (every projection's real shapes and views,
    merged q|k|v and gate|up): the CPU engine handed TritonLoraUpdate instead of its own gives
    peft's greedy tokens for two adapters of different ranks and the base in one batch."""
    from appliance.cpu.backend import CpuBackend
    from tests.lora_fixtures import save_random_adapter
    from tests.test_lora_exact import lora_engine, mixed_batch_matches_peft

    cache = SegmentCache()
    chosen: list[LoraUpdate] = []

    def triton_update(self: CpuBackend, factors: LoraFactors, slots: int) -> LoraUpdate:
        chosen.append(TritonLoraUpdate(cache))
        return chosen[-1]

    monkeypatch.setattr(CpuBackend, "lora_update", triton_update)
    adapters = {
        "a": save_random_adapter(tiny_model_dir, tmp_path / "a", seed=1),
        "b": save_random_adapter(
            tiny_model_dir, tmp_path / "b", seed=2, rank=4, targets=["q_proj", "v_proj", "o_proj"]
        ),
    }
    engine = lora_engine(tiny_model_dir, adapters)
    assert len(chosen) == 4 * engine.loaded.args.num_layers  # qkv, o, gate|up, down
    mixed_batch_matches_peft(engine, tiny_model_dir, adapters, [[11, 12, 13, 14, 15], [7] * 19])


def test_the_cuda_backend_chooses_triton_and_falls_back_to_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CudaBackend.lora_update: the Triton update (one segment cache shared by every linear)
    where Triton imports, torch's where it does not. Nothing here touches a GPU."""
    import importlib.util

    from appliance.config import load_config
    from appliance.engine.cuda_backend import CudaBackend

    pool = make_pool(16, [16], 2, 4, {0: 4}, torch.float32)
    backend = CudaBackend(load_config(None, {}), torch.device("cuda"))
    first = backend.lora_update(pool.factors, 2)
    second = backend.lora_update(pool.factors, 2)
    assert isinstance(first, TritonLoraUpdate) and isinstance(second, TritonLoraUpdate)
    assert first.cache is second.cache
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    assert isinstance(backend.lora_update(pool.factors, 2), TorchLoraUpdate)

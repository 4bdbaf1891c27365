"""LoRA inside the CPU's fused native decode (kernels/cpu_decode.c with cpu_lora.inc.c;
appliance.cpu.fused_lora): a decode step whose rows mix adapter slots and base rows gives the
logits of the torch forward with torch's own LoRA update (TorchLoraUpdate, the reference of
appliance.layers.lora) from the same slot factors, and the same greedy tokens, for 1..33 rows:
the float32 forward, the bf16 forward with float32 activations (the tile decode off) and the
bf16 forward over tile-packed weights (where the CPU has AMX or AVX-512-BF16), the latter at
rank 8 (its vector update, on either back-end) and on AMX at rank 16 (its tile update over the
tile-packed copy, appliance.cpu.lora_tiles). A step of base rows
only with the LoRA arguments is the plain forward bit for bit; the slot pool's factors keep
their addresses through a fill, and a fill reaches the tile copy; and through the engine,
mixed batches now count as native decode steps and still give peft's tokens.
The engine-level peft equality on SmolLM2 (bf16 and float32) is tests/test_lora_exact.py."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from appliance.kernels import cpu_native
from appliance.kernels.cpu_features import MASK_ENV, read_features

from appliance.config import ApplianceConfig, load_config
from appliance.cpu.fused_decode import FusedCpuDecode
from appliance.engine.executor import load_model
from appliance.engine.llm_engine import Engine
from appliance.engine.loader import LoadedModel
from appliance.engine.lora_pool import LoraSlotPool
from appliance.layers.lora import LoraMatmul, TorchLoraUpdate
from appliance.sampling_params import SamplingParams
from tests.lora_fixtures import peft_greedy, save_random_adapter
from tests.paged_fixtures import decode_metadata, fill_random_kv

SLOTS = 4
# The pool's rank per fixture: 8 keeps the tile forward on its vector update, 16 (a multiple of
# the AMX tiles' rank granule) puts AMX's on tiles. "bfloat16": the matrix-vector forward (the
# tile decode off); "-tiles": this CPU's tile forward; "-vector-tiles": the AVX-512-BF16 one on
# an AMX CPU (AMX masked off; elsewhere it is "-tiles" itself).
RANKS = {
    "float32": 8,
    "bfloat16": 8,
    "bfloat16-tiles": 8,
    "bfloat16-vector-tiles": 8,
    "bfloat16-amx-tiles": 16,
}
UNMASKED = read_features("")
TILES_HERE, TILES_WHY = cpu_native.tile_decode_ready(UNMASKED)

# Relative logit error allowed against the torch forward (norm of the difference over the
# norm of the reference). float32: the same sums in another order (measured 2e-6). bf16: the
# torch forward rounds every op's output to bf16 (the LoRA update's included) where the fused
# forwards keep float32 activations, so the two part by ~2% with or without adapters (measured
# on Sapphire Rapids: 1.9-2.8% with adapter rows, the plain bf16 and AMX forwards alike);
# adapter rows may add at most half again of the base-only step's own gap.
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
BF16_LORA_OVER_BASE = 1.5
# Logit gaps a bf16 forward cannot order (logits of a few units, bf16 steps of 1/64-1/32):
# an argmax may differ from the reference's only where the reference's top two are closer.
BF16_TIE = 0.1


def slots_of(rows: int) -> list[int]:
    """Every slot and base rows, interleaved: -1, 2, 0, 3, 1, -1, ..."""
    return [(i * 3) % (SLOTS + 1) - 1 for i in range(rows)]


def lora_config(
    model_dir: Path, dtype: str, rank: int, tile_decode: bool = True
) -> ApplianceConfig:
    return load_config(
        None,
        {
            "model.path": str(model_dir),
            "model.dtype": dtype,
            "model.cpu_tile_decode": tile_decode,
            "cache.block_size": 16,
            "cache.kv_cache_memory": 0.2,
            "hardware.device": "cpu",
            "lora.enabled": True,
            "lora.max_loras": SLOTS,
            "lora.max_lora_rank": rank,
        },
    )


def fill_random_slots(pool: LoraSlotPool, seed: int) -> None:
    """Random factors in every slot, written in place as the pool's own fill writes them, B
    block-diagonal over a merged projection's parts (part p's rank rows feed only its own
    columns), scaled so that the adapters move the logits well beyond the tolerances; then
    each tile copy refilled, as after the pool's own fill."""
    gen = torch.Generator().manual_seed(seed)
    rank = pool.max_rank
    for t in pool.targets:
        t.a.copy_((torch.randn(t.a.shape, generator=gen) / t.a.shape[1] ** 0.5).to(t.a.dtype))
        b_t = torch.zeros(t.b_t.shape)
        width = rank * len(t.parts)
        for slot in range(SLOTS):
            for p, (_, offset, cols, _) in enumerate(t.parts):
                lo = slot * width + p * rank
                block = torch.randn(rank, cols, generator=gen) * 0.3 / rank**0.5
                b_t[lo : lo + rank, offset : offset + cols] = block
        t.b_t.copy_(b_t.to(t.b_t.dtype))
        for slot in range(SLOTS):
            if t.factors.tiles is not None:
                t.factors.tiles.refill(slot)


@pytest.fixture(scope="module", params=list(RANKS))
def loaded(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[LoadedModel]:
    """The tiny Llama with a LoRA slot pool of random factors: float32; bf16 with the tile
    decode off (the float32-activation bf16 forward); bf16 over tiles (the runner's fused
    decode is then the tile forward), with its vector update on either back-end and with AMX's
    tile update."""
    name = str(request.param)
    tiled = "tiles" in name
    if tiled and TILES_HERE is None:
        pytest.skip(f"the tile forward cannot run here: {TILES_WHY}")
    if name == "bfloat16-amx-tiles" and TILES_HERE != "amx":
        pytest.skip(f"the AMX tile update cannot run here: {UNMASKED.model_name} has no AMX")
    if name == "bfloat16-vector-tiles" and TILES_HERE != "amx":
        pytest.skip("the vector back-end is this CPU's own: bfloat16-tiles runs it")
    before = os.environ.get(MASK_ENV)
    if name == "bfloat16-vector-tiles":
        os.environ[MASK_ENV] = "amx"
    else:
        os.environ.pop(MASK_ENV, None)
    try:
        dtype = name.split("-")[0]
        config = lora_config(tiny_model_dir, dtype, RANKS[name], tile_decode=name != "bfloat16")
        result = load_model(config)
    finally:
        os.environ.pop(MASK_ENV, None) if before is None else os.environ.update({MASK_ENV: before})
    fused = result.runner.hooks.fused_decode
    if fused is None:
        result.close()
        pytest.skip("no fused native decode on this box (no compiler, or kernels off)")
    assert isinstance(fused, FusedCpuDecode)
    assert (fused.tiles is not None) == tiled
    assert result.runner.fused_lora, "the fused decode refused the slot pool's factors"
    assert result.runner.lora is not None
    tiles = [t.factors.tiles is not None for t in result.runner.lora.targets]
    assert all(tiles) if name == "bfloat16-amx-tiles" else not any(tiles), tiles
    assert result.runner.lora is not None
    fill_random_slots(result.runner.lora, seed=7)
    yield result
    result.close()


def decode_step(loaded: LoadedModel, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A random paged context in the cache and one decode token per row."""
    model, caches = loaded.model, loaded.runner.kv.device_caches
    gen = torch.Generator().manual_seed(seed)
    fill_random_kv(caches, gen)
    width = 4
    tables = torch.randperm(rows * width, generator=gen).view(rows, width)
    lens = torch.randint(1, width * 16, (rows,), generator=gen)
    pos = lens - 1
    slots = tables[torch.arange(rows), pos // 16] * 16 + pos % 16
    ids = torch.randint(0, model.args.vocab_size, (rows,), generator=gen)
    return ids, pos, slots, tables, lens


def torch_logits(loaded: LoadedModel, step: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The torch forward's logits, every LoRA linear adding its update with TorchLoraUpdate
    (the pool's batch already holds this step's rows)."""
    ids, pos, slots, tables, lens = step
    rows = ids.shape[0]
    meta = decode_metadata(slots, tables, lens)
    pool = loaded.runner.lora
    assert pool is not None
    wired = [t.linear.matmul for t in pool.targets]
    assert all(isinstance(m, LoraMatmul) for m in wired)
    updates = [m.update for m in wired if isinstance(m, LoraMatmul)]
    try:
        for m in wired:
            if isinstance(m, LoraMatmul):
                m.update = TorchLoraUpdate()
        with loaded.runner.hooks.matmuls(rows):
            model = loaded.model
            hidden = model(ids, pos, meta, loaded.runner.kv.device_caches)
            return model.compute_logits(hidden).float()
    finally:
        for m, update in zip(wired, updates, strict=True):
            if isinstance(m, LoraMatmul):
                m.update = update


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("rows", [1, 5, 17, 33])
def test_fused_decode_adds_each_rows_adapter_like_the_torch_forward(
    loaded: LoadedModel, rows: int
) -> None:
    """Logits within TOLERANCE of the torch forward with TorchLoraUpdate, mixed slots and base
    rows (bf16: also within 1.5x the two forwards' gap without adapters); the adapters' own
    effect is many times that (measured 74-88% of the logits' norm: a fused step that skips
    one projection's update fails, as a mutant without o's did); greedy tokens equal (bf16:
    away from ties)."""
    runner, pool = loaded.runner, loaded.runner.lora
    assert pool is not None
    fused = runner.hooks.fused_decode
    assert fused is not None
    assert isinstance(fused, FusedCpuDecode)
    dtype = "float32" if fused.dtype == torch.float32 else "bfloat16"
    step = decode_step(loaded, rows, seed=rows)
    row_slots = slots_of(rows)
    pool.batch.set_rows(row_slots, torch.device("cpu"))
    assert pool.batch.slot_ids is not None or rows == 1 and row_slots == [-1]
    lora_slots = pool.batch.slot_ids
    got = fused(*step, lora_slots)
    base_only = fused(*step)
    reference = torch_logits(loaded, step)
    err = relative(got, reference)
    assert err < TOLERANCE[dtype], (err, dtype)
    if dtype == "bfloat16":  # against the same two forwards' gap without adapters
        pool.batch.set_rows([-1] * rows, torch.device("cpu"))
        base_gap = relative(base_only, torch_logits(loaded, step))
        pool.batch.set_rows(row_slots, torch.device("cpu"))
        assert err <= BF16_LORA_OVER_BASE * base_gap + 1e-3, (err, base_gap)
    adapter_rows = [i for i, s in enumerate(row_slots) if s >= 0]
    base_rows = [i for i, s in enumerate(row_slots) if s < 0]
    if adapter_rows:
        effect = relative(base_only[adapter_rows], reference[adapter_rows])
        assert effect > 6 * TOLERANCE[dtype], (effect, "the adapters barely move the logits")
        assert relative(got[adapter_rows], reference[adapter_rows]) < TOLERANCE[dtype]
    if base_rows:  # base rows take nothing from the adapters
        assert relative(got[base_rows], base_only[base_rows]) < 1e-6
    top2 = reference.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > (BF16_TIE if dtype == "bfloat16" else 0.0)
    assert torch.equal(got.argmax(-1)[clear], reference.argmax(-1)[clear])
    assert int(clear.sum()) >= rows // 2


def test_base_rows_only_with_the_lora_arguments_is_the_plain_forward(
    loaded: LoadedModel,
) -> None:
    """Slots all -1 passed anyway: no update runs (the plan is empty), the logits are the plain
    call's bit for bit."""
    fused = loaded.runner.hooks.fused_decode
    assert fused is not None
    step = decode_step(loaded, 9, seed=99)
    base = torch.full((9,), -1, dtype=torch.int32)
    assert torch.equal(fused(*step, base), fused(*step))


def test_slot_factors_keep_their_addresses_through_a_fill(
    loaded: LoadedModel, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The fused decode holds the factors' addresses: filling a slot from an adapter writes
    into the same tensors, and the next step adds the new adapter's update (the AMX tile copy
    refreshed: a stale copy gives the old factors' logits)."""
    pool = loaded.runner.lora
    fused = loaded.runner.hooks.fused_decode
    assert pool is not None and isinstance(fused, FusedCpuDecode)
    before = [(t.a.data_ptr(), t.b_t.data_ptr()) for t in pool.targets]
    rank = pool.max_rank
    saved = save_random_adapter(tiny_model_dir, tmp_path / "x", seed=3, rank=rank)
    adapter = pool.read("x", str(saved))
    pool._fill(1, adapter)
    try:
        assert [(t.a.data_ptr(), t.b_t.data_ptr()) for t in pool.targets] == before
        step = decode_step(loaded, 6, seed=5)
        pool.batch.set_rows([1, -1, 1, 1, 0, 1], torch.device("cpu"))
        assert pool.batch.slot_ids is not None
        got = fused(*step, pool.batch.slot_ids)
        reference = torch_logits(loaded, step)
        tolerance = TOLERANCE["float32" if fused.dtype == torch.float32 else "bfloat16"]
        assert relative(got, reference) < tolerance
    finally:
        fill_random_slots(pool, seed=7)  # back to the module's factors


def test_mixed_batches_stay_on_the_native_decode_and_match_peft(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Through the engine (float32): two adapters and the base model decoding together, every
    decode step one native call (runner.native_decode_steps), tokens equal to peft's."""
    adapters = {
        "a": save_random_adapter(tiny_model_dir, tmp_path / "a", seed=1),
        "b": save_random_adapter(
            tiny_model_dir, tmp_path / "b", seed=2, rank=4, targets=["q_proj", "v_proj", "o_proj"]
        ),
    }
    engine = Engine(
        load_config(
            None,
            {
                "model.path": str(tiny_model_dir),
                "model.dtype": "float32",
                "cache.kv_cache_memory": 0.1,
                "hardware.device": "cpu",
                "lora.adapters": {name: str(p) for name, p in adapters.items()},
                "lora.max_loras": 2,
            },
        )
    )
    runner = engine.loaded.runner
    if runner.hooks.fused_decode is None:
        pytest.skip("no fused native decode on this box")
    assert runner.fused_lora
    rng = random.Random(3)
    vocab = engine.loaded.args.vocab_size
    per_name = max(1, min(2, runner.fused_max_batch // 3))
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in (6, 19)[:per_name]]
    names = [name for name in ("a", "b", "") for _ in prompts]
    new_tokens = 10
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts * 3, params, lora_names=names)
    # Every step after the prefill is a decode of all the rows together, on the native call.
    assert runner.native_decode_steps >= new_tokens - 1
    for name in ("a", "b", ""):
        got = [r.token_ids for n, r in zip(names, results, strict=True) if n == name]
        want = peft_greedy(tiny_model_dir, adapters.get(name), prompts, new_tokens)
        assert got == want, f"adapter {name or 'base'!r} diverged"


def test_the_plan_counts_the_tile_copy(loaded: LoadedModel, tiny_model_dir: Path) -> None:
    """Where the factors have their AMX tile copy, `appliance plan` knows it and counts it: the
    pool's bytes (factors and copies) are the plan's slot-pool bytes; elsewhere it counts none."""
    from appliance.plan import _lora_tiles_kept, lora_slot_params, lora_tile_params

    pool = loaded.runner.lora
    assert pool is not None
    args, rank = loaded.args, pool.max_rank
    tiles = pool.targets[0].factors.tiles is not None
    fused = loaded.runner.hooks.fused_decode
    assert isinstance(fused, FusedCpuDecode)
    config = lora_config(
        tiny_model_dir, "bfloat16" if fused.dtype == torch.bfloat16 else "float32", rank
    )
    if fused.dtype == torch.bfloat16 and fused.tiles is None:
        return  # the tile decode off for this fixture only
    assert _lora_tiles_kept(args, config) == tiles
    elem = 2 if fused.dtype == torch.bfloat16 else 4
    copies = 2 * lora_tile_params(args, 1, SLOTS, rank) if tiles else 0
    assert pool.nbytes == elem * lora_slot_params(args, 1, SLOTS, rank) + copies

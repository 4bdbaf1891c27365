"""GPU check, stage `kernels`, its LoRA part: the CUDA backend's update (Triton's segment shrink
and expand: appliance.engine.cuda_lora) at Llama-2-7B's projections (q|k|v and gate|up merged,
o, down) with 4 adapters of rank 16 in a pool of 8 slots, rows spread over the adapters and the
base, against torch's update on float32 copies of the same factors; on CUDA also each one's
time beside torch's 16-bit update (figures, not checks). The error is max |update - reference
update| / max |reference update|, the base output's own rounding aside.

On the CPU (the dry mode) the same code runs under TRITON_INTERPRET=1 at a tiny shape."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from appliance.layers.lora import LoraBatch, LoraFactors, LoraUpdate, TorchLoraUpdate

if TYPE_CHECKING:
    from appliance.tools.gpu_check import StageContext

SLOTS, RANK, ADAPTERS = 8, 16, 4
TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 2e-2, torch.float32: 1e-4}
# name: (in features, each part's output columns)
SHAPES_7B = {
    "q|k|v": (4096, [4096, 4096, 4096]),
    "o": (4096, [4096]),
    "gate|up": (4096, [11008, 11008]),
    "down": (11008, [4096]),
}
TINY_SHAPES = {"q|k|v": (32, [16, 8, 8]), "down": (40, [32])}


def random_factors(
    k: int, widths: list[int], dtype: torch.dtype, device: str, gen: torch.Generator
) -> LoraFactors:
    """The slot pool's layout: ADAPTERS slots filled (A stacked along the rank, B
    block-diagonal), the rest zero; B scaled so an update is about as large as x."""
    width = RANK * len(widths)
    a = torch.zeros(SLOTS * width, k)
    b_t = torch.zeros(SLOTS * width, sum(widths))
    for slot in range(ADAPTERS):
        first = 0
        for p, n in enumerate(widths):
            row = slot * width + p * RANK
            a[row : row + RANK] = torch.randn(RANK, k, generator=gen) / k**0.5
            b_t[row : row + RANK, first : first + n] = (
                torch.randn(RANK, n, generator=gen) / RANK**0.5
            )
            first += n
    parts, first = [], 0
    for n in widths:
        parts.append((first, n))
        first += n
    return LoraFactors(a.to(device, dtype), b_t.to(device, dtype), RANK, parts)


def _time_us(
    update: LoraUpdate,
    out: torch.Tensor,
    x: torch.Tensor,
    f: LoraFactors,
    batch: LoraBatch,
    iters: int = 20,
) -> float:
    for _ in range(3):
        update(out, x, f, batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        update(out, x, f, batch)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def check_lora(ctx: StageContext) -> list[float]:
    from appliance.engine.cuda_lora import SegmentCache, TritonLoraUpdate

    device = "cuda" if ctx.cuda else "cpu"
    gen = torch.Generator().manual_seed(9)
    shapes = SHAPES_7B if ctx.cuda else TINY_SHAPES
    # fp16 and odd shapes: tests/test_triton_lora.py, which the pytest-cuda stage runs compiled.
    dtypes = [torch.bfloat16] if ctx.cuda else [torch.float32]
    row_counts = (1, 64, 512) if ctx.cuda else (1, 5)
    errors: list[float] = []
    times: dict[str, dict[str, float]] = {}
    for name, (k, widths) in shapes.items():
        for dtype in dtypes:
            f = random_factors(k, widths, dtype, device, gen)
            f32 = LoraFactors(f.a.float(), f.b_t.float(), f.rank, f.parts)
            for rows in row_counts:
                # Round robin over the adapters and the base (-1), adapters first: a step of
                # base rows alone never reaches the update (LoraMatmul skips it).
                slots = [(i + 1) % (ADAPTERS + 1) - 1 for i in range(rows)]
                batch = LoraBatch(SLOTS)
                batch.set_rows(slots, torch.device(device))
                x = torch.randn(rows, k, generator=gen).to(device, dtype)
                out = torch.randn(rows, sum(widths), generator=gen).to(device, dtype)
                triton_update = TritonLoraUpdate(SegmentCache())
                got = triton_update(out.clone(), x, f, batch).float() - out.float()
                ref = TorchLoraUpdate()(out.float().clone(), x.float(), f32, batch) - out.float()
                err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                errors.append(err)
                dt = str(dtype).removeprefix("torch.")
                ctx.check(
                    f"lora {name} rows={rows} {dt}",
                    err < TOLERANCE[dtype],
                    rel_err=err,
                    tolerance=TOLERANCE[dtype],
                )
                if ctx.cuda:
                    scratch = out.clone()
                    times[f"{name} rows={rows}"] = {
                        "triton_us": round(_time_us(triton_update, scratch, x, f, batch), 1),
                        "torch_us": round(_time_us(TorchLoraUpdate(), scratch, x, f, batch), 1),
                    }
    if times:
        ctx.figure(lora_update_us_bf16=times)
    return errors

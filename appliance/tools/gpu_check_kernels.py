"""GPU check, stage `kernels`: the Triton kernels against their torch references at real
shapes. Attention: the head layouts of Llama-2-7B (32 heads / 32 KV heads / head_dim 128),
Llama-2-13B (40/40/128) and CodeLlama-34B (GQA, 64/8/128), blocks of 16 and 32 tokens, 16-bit
(fp16, bf16), FP8 (e4m3, e5m2), INT8 per-head and INT8 per-token caches, ragged contexts up to
2049 tokens: the KV write (bytes against the torch writer's), decode (split as the launcher
chooses, and forced into 256-token splits) and chunked prefill (with and without the chunk's
fresh K/V). The reference is `kernels/paged_attention.py` in float32 over the same stored
cache, the one tests/test_kernels.py uses; the error is max |out - ref| / max |ref|. Then the
dequantizing matmuls (kernels/triton_quant.py) at Llama-2-7B's linear shapes against x @ W^T
of the dequantized weight (tests/test_triton_quant.py's reference). Last, the segment LoRA
update at Llama-2-7B's projections (appliance.tools.gpu_check_lora).

On the CPU (the dry mode) the same code runs under TRITON_INTERPRET=1 at a tiny shape."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from appliance.tools.gpu_check_lora import check_lora

if TYPE_CHECKING:
    from appliance.tools.gpu_check import StageContext

# name: (num_heads, num_kv_heads, head_dim)
LAYOUTS = {
    "llama-2-7b": (32, 32, 128),
    "llama-2-13b": (40, 40, 128),
    "codellama-34b": (64, 8, 128),
}
TINY_LAYOUT = {"tiny": (4, 2, 32)}
DECODE_LENS = [1, 17, 333, 1024, 2049]
PREFILL_SEQ_LENS, PREFILL_QUERY_LENS = [300, 700, 45], [300, 128, 1]
TINY_DECODE_LENS = [1, 17, 40]
TINY_PREFILL_SEQ_LENS, TINY_PREFILL_QUERY_LENS = [40, 21], [40, 5]
FORCED_SPLIT = 256
TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 2e-2, torch.float32: 1e-3}
WRITE_EXACT_SHARE = 0.99  # bytes equal to the torch writer's (FP8/INT8 rounding ties aside)


@dataclass(frozen=True)
class Case:
    layout: str
    block_size: int
    fmt: str  # kv_cache_dtype: auto, fp8_e4m3, fp8_e5m2, int8, int8_token
    dtype: torch.dtype  # queries, K/V and the "auto" cache

    @property
    def name(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return f"{self.layout} bs{self.block_size} {self.fmt} {dt}"


def attention_cases(cuda: bool) -> list[Case]:
    """Most telling first: a stage stopped at its timeout keeps the earlier ones."""
    if not cuda:
        return [
            Case("tiny", 16, "auto", torch.float32),
            Case("tiny", 16, "int8_token", torch.float32),
        ]
    cases = [
        Case(layout, bs, fmt, torch.bfloat16)
        for bs in (16, 32)
        for layout in LAYOUTS
        for fmt in ("auto", "fp8_e4m3")
    ]
    cases[1:1] = [Case("llama-2-7b", 16, f, torch.bfloat16) for f in ("int8_token", "int8")]
    cases.insert(3, Case("llama-2-7b", 16, "auto", torch.float16))
    cases += [
        Case("llama-2-7b", 16, "fp8_e5m2", torch.bfloat16),
        Case("codellama-34b", 16, "int8_token", torch.bfloat16),
        Case("llama-2-13b", 32, "int8_token", torch.bfloat16),
        Case("codellama-34b", 32, "fp8_e4m3", torch.float16),
    ]
    return cases


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@dataclass
class Filled:
    """A cache of one case, written by the torch writer, and everything to read it back."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    keys: torch.Tensor  # the float K/V of every slot, [slots, kv_heads, head_dim]
    values: torch.Tensor
    table: torch.Tensor  # int32 [seqs, max_blocks]
    write_share: float


def fill_cache(case: Case, seq_lens: list[int], device: str, gen: torch.Generator) -> Filled:
    """K/V for every slot of a shuffled cache, written by both writers: the torch writer's cache
    is kept (the attention checks read it), the Triton writer's bytes are compared with it."""
    from appliance.kernels.paged_attention import FP8_MAX, INT8_MAX, write_kv
    from appliance.kernels.triton_kv import write_kv_triton

    _, kv_heads, head_dim = (LAYOUTS | TINY_LAYOUT)[case.layout]
    bs = case.block_size
    blocks = [-(-max(n, 1) // bs) for n in seq_lens]
    num_blocks = sum(blocks) + 3
    slots = num_blocks * bs

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device)

    # Heads of different ranges, as real K/V have; a few outliers.
    gain = torch.rand(kv_heads, generator=gen).to(device).mul(4).add(0.25).view(1, -1, 1)
    keys = (rand(slots, kv_heads, head_dim) * gain).to(case.dtype)
    values = (rand(slots, kv_heads, head_dim) * gain.flip(1)).to(case.dtype)
    keys[slots // 3] *= 20
    k_scale = v_scale = None
    if case.fmt == "int8_token":
        store = torch.int8
        k_scale, v_scale = (
            torch.empty(num_blocks, bs, kv_heads, dtype=torch.float16, device=device)
            for _ in range(2)
        )
    elif case.fmt != "auto":
        store = torch.int8 if case.fmt == "int8" else torch.uint8
        limit = INT8_MAX if case.fmt == "int8" else FP8_MAX[case.fmt]
        # Calibrated per head as the engine does: the head's absmax maps to the format's top.
        k_scale = keys.float().abs().amax((0, 2)) / limit
        v_scale = values.float().abs().amax((0, 2)) / limit
    else:
        store = case.dtype
    shape = (num_blocks, bs, kv_heads, head_dim)
    k, v, k2, v2 = (torch.empty(shape, dtype=store, device=device) for _ in range(4))
    all_slots = torch.arange(slots, device=device)
    write_kv(keys, values, k, v, all_slots, case.fmt, k_scale, v_scale)
    if case.fmt == "int8_token":
        assert k_scale is not None and v_scale is not None
        ks2, vs2 = torch.empty_like(k_scale), torch.empty_like(v_scale)
        write_kv_triton(keys, values, k2, v2, all_slots, case.fmt, ks2, vs2)
        pairs = [(k, k2), (v, v2), (k_scale, ks2), (v_scale, vs2)]
    else:
        write_kv_triton(keys, values, k2, v2, all_slots, case.fmt, k_scale, v_scale)
        pairs = [(k, k2), (v, v2)]
    share = min(
        (a.view(torch.uint8) == b.view(torch.uint8)).float().mean().item() for a, b in pairs
    )
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(seq_lens), max(blocks) + 1), generator=gen)
    first = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[first : first + n]
        first += n
    return Filled(k, v, k_scale, v_scale, keys, values, table.to(torch.int32).to(device), share)


def check_attention(ctx: StageContext, case: Case, gen: torch.Generator) -> list[float]:
    from appliance.kernels.paged_attention import paged_attention
    from appliance.kernels.triton_attention import paged_attention_decode, paged_attention_prefill

    device = "cuda" if ctx.cuda else "cpu"
    heads, _, head_dim = (LAYOUTS | TINY_LAYOUT)[case.layout]
    tol = TOLERANCE[case.dtype]
    scale = head_dim**-0.5
    errors = []
    decode_lens = DECODE_LENS if ctx.cuda else TINY_DECODE_LENS
    seq_lens = PREFILL_SEQ_LENS if ctx.cuda else TINY_PREFILL_SEQ_LENS
    query_lens = PREFILL_QUERY_LENS if ctx.cuda else TINY_PREFILL_QUERY_LENS

    # Decode over one cache, prefill over another (each its own block table).
    c = fill_cache(case, decode_lens, device, gen)
    ctx.check(
        f"write_kv {case.name}",
        c.write_share >= WRITE_EXACT_SHARE,
        bytes_equal_share=round(c.write_share, 6),
    )
    n = len(decode_lens)
    sl = torch.tensor(decode_lens, dtype=torch.int32, device=device)
    q = torch.randn(n, heads, head_dim, generator=gen).to(device, case.dtype)
    qsl = torch.arange(n + 1, device=device)
    common = (c.k, c.v, c.table)
    ref = paged_attention(
        q.float(),
        *common,
        sl.long(),
        qsl,
        scale,
        1,
        max(decode_lens),
        case.fmt,
        c.k_scale,
        c.v_scale,
    )
    for split in (None, FORCED_SPLIT if ctx.cuda else 16):
        out = torch.full_like(q, float("nan"))
        paged_attention_decode(
            q,
            *common,
            sl,
            scale,
            max(decode_lens),
            case.fmt,
            c.k_scale,
            c.v_scale,
            split_size=split,
            out=out,
        )
        err = rel_err(out, ref)
        finite = bool(torch.isfinite(out).all())
        errors.append(err)
        ctx.check(
            f"decode {case.name} split={split or 'auto'}",
            finite and err < tol,
            rel_err=err,
            tolerance=tol,
        )

    c = fill_cache(case, seq_lens, device, gen)
    bs = case.block_size
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    qsl = qsl.to(device)
    rows = int(sum(query_lens))
    q = torch.randn(rows, heads, head_dim, generator=gen).to(device, case.dtype)
    # The chunk's own K/V (what the engine passes as fresh), at its rows' slots.
    slots = [
        int(c.table[i, p // bs]) * bs + p % bs
        for i, (s, ql) in enumerate(zip(seq_lens, query_lens, strict=True))
        for p in range(s - ql, s)
    ]
    idx = torch.tensor(slots, device=device)
    fresh_k, fresh_v = c.keys[idx], c.values[idx]
    common = (c.k, c.v, c.table)
    for fresh in (False, True):
        kv: dict[str, Any] = {"key": fresh_k, "value": fresh_v} if fresh else {}
        ref = paged_attention(
            q.float(),
            *common,
            sl.long(),
            qsl.long(),
            scale,
            max(query_lens),
            max(seq_lens),
            case.fmt,
            c.k_scale,
            c.v_scale,
            **{k: t.float() for k, t in kv.items()},
        )
        out = torch.full_like(q, float("nan"))
        paged_attention_prefill(
            q,
            *common,
            sl,
            qsl,
            scale,
            max(query_lens),
            case.fmt,
            c.k_scale,
            c.v_scale,
            out=out,
            **kv,
        )
        err = rel_err(out, ref)
        errors.append(err)
        ctx.check(
            f"prefill {case.name}{' fresh K/V' if fresh else ''}",
            bool(torch.isfinite(out).all()) and err < tol,
            rel_err=err,
            tolerance=tol,
        )
    return errors


def quant_weights(cuda: bool) -> list[tuple[str, Any]]:
    """(name, QuantWeight) at Llama-2-7B's linear shapes (or a tiny one in the dry mode)."""
    from appliance.kernels.quant_weight import QuantWeight, pack_q4, quantize_int8

    device = "cuda" if cuda else "cpu"
    gen = torch.Generator().manual_seed(7)

    def q4(n: int, k: int, group: int, mins_dtype: torch.dtype) -> QuantWeight:
        values = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        scales = (torch.rand(n, k // group, generator=gen) * 0.1 + 0.01).half()
        mins = (torch.randn(n, k // group, generator=gen) * 0.1).to(mins_dtype)
        return QuantWeight(
            "q4", pack_q4(values).to(device), scales.to(device), mins.to(device), group, k
        )

    if not cuda:
        return [("int8 per-channel 17x75", quantize_int8(torch.randn(17, 75, generator=gen)))]
    return [
        ("q4 g32 fp16 mins 11008x4096 (GGUF Q4_1)", q4(11008, 4096, 32, torch.float16)),
        ("q4 g128 4096x4096 (AWQ/GPTQ)", q4(4096, 4096, 128, torch.float16)),
        ("q4 g128 4096x11008 (AWQ/GPTQ down)", q4(4096, 11008, 128, torch.float32)),
        (
            "int8 per-channel 11008x4096",
            quantize_int8(torch.randn(11008, 4096, generator=gen).to(device)),
        ),
    ]


def check_quant_matmul(ctx: StageContext) -> list[float]:
    from appliance.kernels.triton_quant import GEMV_MAX_ROWS, quant_matmul_triton

    device = "cuda" if ctx.cuda else "cpu"
    gen = torch.Generator().manual_seed(8)
    errors = []
    for name, w in quant_weights(ctx.cuda):
        ref_w = w.dequantize().float()
        dtypes = [torch.float16, torch.bfloat16] if ctx.cuda else [torch.float32]
        for rows in (1, GEMV_MAX_ROWS, 64) if ctx.cuda else (3,):
            for dtype in dtypes:
                x = torch.randn(rows, w.in_features, generator=gen).to(device, dtype)
                ref = x.float() @ ref_w.T
                got = quant_matmul_triton(x, w, None)
                err = rel_err(got, ref)
                errors.append(err)
                tol = TOLERANCE[dtype]
                dt = str(dtype).removeprefix("torch.")
                ctx.check(
                    f"quant_matmul {name} rows={rows} {dt}",
                    got.dtype == dtype and err < tol,
                    rel_err=err,
                    tolerance=tol,
                )
    return errors


def run_kernels(ctx: StageContext) -> None:
    import triton

    ctx.figure(triton=triton.__version__, interpreter=not ctx.cuda)
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    start = time.monotonic()
    for i, case in enumerate(attention_cases(ctx.cuda), 1):
        worst = max([worst, *check_attention(ctx, case, gen)])
        ctx.figure(
            attention_cases=i,
            worst_attention_rel_err=worst,
            attention_seconds=round(time.monotonic() - start, 1),
        )
    errors = check_quant_matmul(ctx)
    ctx.figure(quant_matmul_checks=len(errors), worst_quant_rel_err=max(errors, default=0.0))
    lora_errors = check_lora(ctx)
    ctx.figure(
        lora_checks=len(lora_errors),
        worst_lora_rel_err=max(lora_errors, default=0.0),
        checks=len(ctx.checks),
        failed=sum(not c["ok"] for c in ctx.checks),
    )

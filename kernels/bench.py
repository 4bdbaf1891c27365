"""GPU benchmark of the Triton paged-attention decode kernel: ``python -m appliance.kernels.bench``.

Times decode for a 7B/13B-like GQA shape (32 query heads, 8 KV heads, head_dim 128, block 16)
at batch 64 x 4K and batch 8 x 32K context, with bf16 and FP8 (e4m3) caches, against the
device's copy bandwidth (a large ``copy_``, timed with CUDA events). Achieved bandwidth counts
the bytes of K/V and queries read; share = achieved / copy bandwidth, where copy bandwidth is
(bytes read + bytes written) / time of the copy.

Before timing it checks the kernels against the torch reference on small CUDA inputs (decode
with and without split-K, chunked prefill, write_kv; per-token INT8 too); ``--no-check`` skips
that. ``--sweep``
also times a few launch configurations per case. ``--json`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
CASES = [(64, 4096), (8, 32768)]  # (batch, context tokens)
CACHE_DTYPES = ["auto", "fp8_e4m3"]  # auto = bf16 cache
SWEEP = [(32, 4, 2), (64, 4, 2), (64, 8, 2), (64, 8, 3), (128, 8, 2)]  # block_n, warps, stages


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m appliance.kernels.bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--iters", type=int, default=30, help="timed launches per case")
    parser.add_argument("--warmup", type=int, default=5, help="untimed launches per case")
    parser.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy test")
    parser.add_argument("--sweep", action="store_true", help="also time launch configurations")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness check")
    return parser.parse_args(argv)


def time_cuda(fn: Callable[[], Any], iters: int, warmup: int) -> float:
    """Median milliseconds of ``fn`` on the current stream, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(gib: float, iters: int, warmup: int) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + bytes written."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), iters, warmup)
    return 2 * n / (ms * 1e-3)


def make_decode_inputs(
    batch: int, context: int, kv_cache_dtype: str, device: str = "cuda"
) -> dict[str, Any]:
    """Random decode inputs: every sequence ``context`` tokens, block table shuffled."""
    from .paged_attention import cache_storage_dtype

    gen = torch.Generator(device=device).manual_seed(0)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    storage = cache_storage_dtype(kv_cache_dtype, torch.bfloat16)
    scales = None
    if storage == torch.bfloat16:
        k_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
        v_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    else:
        # Any finite e4m3 byte pattern (0x7F/0xFF are NaN): random codes 0..0x7E, random sign.
        def codes() -> torch.Tensor:
            mag = torch.randint(0, 0x7F, shape, generator=gen, device=device, dtype=torch.int32)
            sign = torch.randint(0, 2, shape, generator=gen, device=device, dtype=torch.int32)
            return (mag | (sign << 7)).to(torch.uint8)

        k_cache, v_cache = codes(), codes()
        scales = torch.full((NUM_KV_HEADS,), 1 / 64, device=device)
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    return {
        "query": torch.randn(
            batch, NUM_HEADS, HEAD_DIM, generator=gen, device=device, dtype=torch.bfloat16
        ),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": perm.view(batch, blocks_per_seq).to(torch.int32),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=device),
        "scale": HEAD_DIM**-0.5,
        "max_seq_len": context,
        "kv_cache_dtype": kv_cache_dtype,
        "k_scale": scales,
        "v_scale": scales,
    }


def bytes_read(inputs: dict[str, Any]) -> int:
    batch, context = inputs["seq_lens"].numel(), inputs["max_seq_len"]
    kv = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * inputs["k_cache"].element_size()
    return kv + inputs["query"].numel() * inputs["query"].element_size()


def check_correctness(device: str = "cuda") -> list[dict[str, Any]]:
    """Small cases against the torch reference: max |err| / max |ref| (rel_err)."""
    from .paged_attention import paged_attention, write_kv
    from .triton_attention import paged_attention_decode, paged_attention_prefill
    from .triton_kv import write_kv_triton

    results = []
    torch.manual_seed(0)
    for fmt in CACHE_DTYPES + ["fp8_e5m2", "int8"]:
        inputs = make_decode_inputs(4, 1000, "auto", device)
        kc, vc = inputs["k_cache"], inputs["v_cache"]
        scales = None if fmt == "auto" else torch.rand(NUM_KV_HEADS, device=device) * 0.02 + 0.01
        if fmt != "auto":  # quantize the same random K/V with both writers
            slots = torch.arange(kc.shape[0] * BLOCK_SIZE, device=device)
            flat = (slots.numel(), NUM_KV_HEADS, HEAD_DIM)
            store = torch.uint8 if fmt.startswith("fp8") else torch.int8
            kc_ref, vc_ref, kc, vc = (
                torch.empty(kc.shape, dtype=store, device=device) for _ in range(4)
            )
            write_kv(
                inputs["k_cache"].view(flat),
                inputs["v_cache"].view(flat),
                kc_ref,
                vc_ref,
                slots,
                fmt,
                scales,
                scales,
            )
            write_kv_triton(
                inputs["k_cache"].view(flat),
                inputs["v_cache"].view(flat),
                kc,
                vc,
                slots,
                fmt,
                scales,
                scales,
            )
            same = (kc == kc_ref).float().mean().item()
            results.append({"check": f"write_kv {fmt}", "bit_exact_share": same, "ok": same > 0.99})
        inputs.update(k_cache=kc, v_cache=vc, kv_cache_dtype=fmt, k_scale=scales, v_scale=scales)
        q, bt, sl = inputs["query"], inputs["block_tables"], inputs["seq_lens"]
        sl.copy_(torch.tensor([1000, 1, 517, 64], device=device))
        qsl = torch.arange(5, device=device, dtype=torch.int32)
        ref = paged_attention(
            q.float(), kc, vc, bt, sl, qsl, inputs["scale"], 1, 1000, fmt, scales, scales
        )
        for split in (None, 128):
            out = paged_attention_decode(
                q, kc, vc, bt, sl, inputs["scale"], 1000, fmt, scales, scales, split_size=split
            )
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            results.append(
                {"check": f"decode {fmt} split={split}", "rel_err": err, "ok": err < 2e-2}
            )
        qlens = torch.tensor([100, 1, 37, 64], device=device)
        qsl = torch.zeros(5, dtype=torch.int32, device=device)
        qsl[1:] = qlens.cumsum(0)
        qp = torch.randn(int(qlens.sum()), NUM_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        ref = paged_attention(
            qp.float(), kc, vc, bt, sl, qsl, inputs["scale"], 100, 1000, fmt, scales, scales
        )
        out = paged_attention_prefill(
            qp, kc, vc, bt, sl, qsl, inputs["scale"], 100, fmt, scales, scales
        )
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        results.append({"check": f"prefill {fmt}", "rel_err": err, "ok": err < 2e-2})
    return results + check_per_token(device)


def check_per_token(device: str = "cuda") -> list[dict[str, Any]]:
    """Per-token INT8 (int8_token): both writers' bytes and float16 scale caches, then decode
    and prefill over the Triton-written cache against the torch reference over the same."""
    from .kv_formats import PER_TOKEN_KIND
    from .paged_attention import paged_attention, write_kv
    from .triton_attention import paged_attention_decode, paged_attention_prefill
    from .triton_kv import write_kv_triton

    inputs = make_decode_inputs(4, 1000, "auto", device)
    kc16, bt, sl = inputs["k_cache"], inputs["block_tables"], inputs["seq_lens"]
    sl.copy_(torch.tensor([1000, 1, 517, 64], device=device))
    flat = (kc16.shape[0] * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key, value = kc16.view(flat), inputs["v_cache"].view(flat)
    slots = torch.arange(flat[0], device=device)

    def caches() -> list[torch.Tensor]:
        kv = [torch.empty(kc16.shape, dtype=torch.int8, device=device) for _ in range(2)]
        return kv + [
            torch.empty(kc16.shape[:3], dtype=torch.float16, device=device) for _ in range(2)
        ]

    ref_c, ours = caches(), caches()
    write_kv(key, value, ref_c[0], ref_c[1], slots, PER_TOKEN_KIND, ref_c[2], ref_c[3])
    write_kv_triton(key, value, ours[0], ours[1], slots, PER_TOKEN_KIND, ours[2], ours[3])
    same = min((a == b).float().mean().item() for a, b in zip(ours, ref_c, strict=True))
    results = [{"check": "write_kv int8_token", "bit_exact_share": same, "ok": same == 1.0}]
    q, scale = inputs["query"], inputs["scale"]
    k8, v8, k_scales, v_scales = ours
    qsl = torch.arange(5, device=device, dtype=torch.int32)
    ref = paged_attention(
        q.float(), k8, v8, bt, sl, qsl, scale, 1, 1000, PER_TOKEN_KIND, k_scales, v_scales
    )
    for split in (None, 128):
        out = paged_attention_decode(
            q, k8, v8, bt, sl, scale, 1000, PER_TOKEN_KIND, k_scales, v_scales, split_size=split
        )
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        results.append(
            {"check": f"decode int8_token split={split}", "rel_err": err, "ok": err < 2e-2}
        )
    qlens = torch.tensor([100, 1, 37, 64], device=device)
    qsl = torch.zeros(5, dtype=torch.int32, device=device)
    qsl[1:] = qlens.cumsum(0)
    qp = torch.randn(int(qlens.sum()), NUM_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    ref = paged_attention(
        qp.float(), k8, v8, bt, sl, qsl, scale, 100, 1000, PER_TOKEN_KIND, k_scales, v_scales
    )
    out = paged_attention_prefill(
        qp, k8, v8, bt, sl, qsl, scale, 100, PER_TOKEN_KIND, k_scales, v_scales
    )
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    results.append({"check": "prefill int8_token", "rel_err": err, "ok": err < 2e-2})
    return results


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from .triton_attention import (
        KernelConfig,
        choose_split_size,
        default_config,
        paged_attention_decode,
    )

    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "shape": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "query_dtype": "bfloat16",
        },
    }
    if not args.no_check:
        report["checks"] = check_correctness()
    copy_bw = copy_bandwidth(args.copy_gib, args.iters, args.warmup)
    report["copy_bandwidth_gbs"] = copy_bw / 1e9
    rows = []
    for batch, context in CASES:
        for fmt in CACHE_DTYPES:
            inputs = make_decode_inputs(batch, context, fmt)
            out = torch.empty_like(inputs["query"])
            configs: list[KernelConfig | None] = [None]
            if args.sweep:
                configs += [KernelConfig(*c) for c in SWEEP]
            for cfg in configs:

                def launch(
                    inputs: dict[str, Any] = inputs,
                    out: torch.Tensor = out,
                    cfg: KernelConfig | None = cfg,
                ) -> None:
                    paged_attention_decode(**inputs, out=out, config=cfg)

                block_n = (cfg or default_config(HEAD_DIM)).block_n
                split = choose_split_size(batch, NUM_KV_HEADS, context, out.device, block_n)
                ms = time_cuda(launch, args.iters, args.warmup)
                bw = bytes_read(inputs) / (ms * 1e-3)
                rows.append(
                    {
                        "batch": batch,
                        "context": context,
                        "kv_cache": "bf16" if fmt == "auto" else fmt,
                        "config": "default"
                        if cfg is None
                        else f"n{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}",
                        "splits": -(-context // split),
                        "time_ms": ms,
                        "bandwidth_gbs": bw / 1e9,
                        "share_of_copy": bw / copy_bw,
                    }
                )
    torch.cuda.empty_cache()
    report["decode"] = rows
    return report


def print_table(report: dict[str, Any]) -> None:
    print(f"device: {report['device']}  shape: {report['shape']}")
    for check in report.get("checks", []):
        detail = {k: round(v, 6) for k, v in check.items() if isinstance(v, float)}
        print(f"check {check['check']:<28} {'ok' if check['ok'] else 'FAILED'} {detail}")
    print(f"copy bandwidth (read+write): {report['copy_bandwidth_gbs']:.0f} GB/s")
    header = (
        f"{'batch':>5} {'context':>7} {'kv':>8} {'config':>10} {'splits':>6} "
        f"{'time ms':>9} {'GB/s':>8} {'of copy':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in report["decode"]:
        print(
            f"{r['batch']:>5} {r['context']:>7} {r['kv_cache']:>8} {r['config']:>10} "
            f"{r['splits']:>6} {r['time_ms']:>9.3f} {r['bandwidth_gbs']:>8.0f} "
            f"{r['share_of_copy']:>8.1%}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "appliance.kernels.bench: no CUDA device (torch.cuda.is_available() is False); "
            "this benchmark only runs on a GPU.",
            file=sys.stderr,
        )
        return 2
    report = run_bench(args)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0 if all(c["ok"] for c in report.get("checks", [])) else 1


if __name__ == "__main__":
    sys.exit(main())

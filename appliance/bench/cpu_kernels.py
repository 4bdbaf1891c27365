"""`appliance bench cpu-kernels`: the packed-weight CPU matmuls (kernels/cpu_quant.c) against
torch's float32 GEMM on the same shapes, at the row counts of a decode step (1), a decode batch
and a prefill (128).

Weights are random Q4 (4-bit, fp16 scale and min per 32 columns, as GGUF's Q4_1) and Q8 (int8,
fp16 scale per 32, as Q8_0), in the layout the engine serves: row tiles with int8 activations
where the CPU has the kernels (AVX2 and up), else row-major with float32 activations. Before it
times a case it checks the kernel's result against its torch reference (the bench refuses to
time a wrong kernel). Each figure is the best of `--repeats` calls, the packed kernel and the
GEMM interleaved, so the machine's drift hits both alike.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from appliance.kernels import cpu_quant
from appliance.kernels.quant_weight import QuantWeight, pack_q4, tile_rows_of, tileable

# SmolLM2-135M's linears (the real model at hand), [out_features, in_features].
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


class KernelMismatch(RuntimeError):
    pass


def random_weight(fmt: str, n: int, k: int, seed: int) -> QuantWeight:
    gen = torch.Generator().manual_seed(seed)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001).to(torch.float16)
    if fmt == "q4":
        values = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        mins = (-torch.rand(n, k // 32, generator=gen) * 0.1).to(torch.float16)
        return QuantWeight("q4", pack_q4(values), scales, mins, 32, k)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    return QuantWeight("q8", q, scales, None, 32, k)


def _once(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def run(
    shapes: dict[str, tuple[int, int]],
    formats: list[str],
    rows: list[int],
    repeats: int,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One result per shape, format and row count: packed and float32-GEMM seconds and rates."""
    act8 = cpu_quant.tiles_supported()
    results = []
    for name, (n, k) in shapes.items():
        for fmt in formats:
            w = random_weight(fmt, n, k, seed)
            if act8 and tileable(w):
                w = tile_rows_of(w)
            dense = w.dequantize()
            for m in rows:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + m))
                packed = cpu_quant.quant_matmul(x, w, None, act8=act8)
                ref = cpu_quant.act8_reference(x, w) if act8 else x @ dense.T
                if not torch.allclose(packed, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max())):
                    raise KernelMismatch(
                        f"{name} {fmt} at {m} rows: the packed kernel's result "
                        "differs from its torch reference"
                    )
                t_packed = t_gemm = float("inf")
                for _ in range(repeats):
                    t_packed = min(t_packed, _once(cpu_quant.quant_matmul, x, w, None, act8=act8))
                    t_gemm = min(t_gemm, _once(F.linear, x, dense))
                macs = m * n * k
                results.append(
                    dict(
                        shape=name,
                        n=n,
                        k=k,
                        format=fmt,
                        layout="row tiles, int8 x"
                        if w.tile_rows > 1
                        else ("row-major, int8 x" if act8 else "row-major, float32 x"),
                        rows=m,
                        packed_ms=t_packed * 1e3,
                        packed_gmacs=macs / t_packed / 1e9,
                        gemm_ms=t_gemm * 1e3,
                        gemm_gmacs=macs / t_gemm / 1e9,
                        weight_mb=w.nbytes() / 1e6,
                        dense_mb=dense.numel() * 4 / 1e6,
                    )
                )
    return results


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("cpu-kernels", help="packed-weight CPU matmuls vs torch's float32 GEMM")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    p.add_argument("--formats", default="q4,q8")
    p.add_argument("--rows", default="1,16,128", help="rows of x (tokens of a pass)")
    p.add_argument("--repeats", type=int, default=7, help="interleaved calls, best kept")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    names = [s for s in ns.shapes.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    formats = [f for f in ns.formats.split(",") if f]
    if unknown or not names or any(f not in ("q4", "q8") for f in formats) or not formats:
        print(
            f"bench cpu-kernels: --shapes takes {', '.join(SHAPES)}; --formats q4, q8",
            file=sys.stderr,
        )
        return 2
    rows = [int(r) for r in ns.rows.split(",") if r]
    results = run({s: SHAPES[s] for s in names}, formats, rows, max(1, ns.repeats))
    if ns.json:
        print(json.dumps({"threads": torch.get_num_threads(), "results": results}))
        return 0
    print(f"{torch.get_num_threads()} threads; best of {ns.repeats} interleaved calls")
    head = f"{'shape':8s} {'fmt':4s} {'layout':20s} {'rows':>5s} {'packed ms':>10s} {'GMAC/s':>7s} {'fp32 GEMM ms':>13s} {'GMAC/s':>7s} {'speedup':>8s}"  # noqa: E501
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r['shape']:8s} {r['format']:4s} {r['layout']:20s} {r['rows']:5d} {r['packed_ms']:10.3f} "
            f"{r['packed_gmacs']:7.1f} {r['gemm_ms']:13.3f} {r['gemm_gmacs']:7.1f} "
            f"{r['gemm_ms'] / r['packed_ms']:7.2f}x"
        )
    return 0

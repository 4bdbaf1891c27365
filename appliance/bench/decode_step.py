"""`appliance bench decode-step`: ms of one bf16 decode step by row count on the three CPU paths
a dense model can take: the torch forward (oneDNN prepacked bf16, the path above the fused
decode's limit), the fused native forward with its matrix-vector loops (kernels/
cpu_decode_forward.inc.c, CPUs with neither AMX nor AVX-512-BF16), and the same forward with
its products over tile-packed weights (kernels/cpu_decode_tiles.inc.c: AMX tiles, or the same
tiles in AVX-512-BF16 vectors). Where native stops beating torch is the fused decode's limit
for that path (appliance.cpu.choice: BF16_FUSED_MAX, TILE_FUSED_MAX).

The model is loaded once with the tile decode off (model.cpu_tile_decode = false), so it
keeps the row-major matrices the matrix-vector forward reads; the tile forward gets its own
tile-packed copy. Every row attends over `--context` tokens of random K/V (a list: the rows
take its lengths in turn, a step of long and short contexts as mixed traffic has). Before timing, the
tile forward's logits are checked against the other native forward's (the bench refuses to
time a wrong kernel). Each figure is the median of
`--repeats` calls, the paths interleaved, so the machine's drift hits all alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from appliance.config import load_config
from appliance.cpu.choice import TILE_ISA_NAMES
from appliance.cpu.fused_decode import FusedCpuDecode
from appliance.cpu.tile_weights import TileDecodeWeights
from appliance.engine.executor import load_model
from appliance.kernels import cpu_native
from appliance.kernels.cpu_features import read_features
from appliance.layers.attention import AttentionMetadata, PagedBatch

# Relative error (Frobenius) allowed between the tile forward's logits and the float32-activation
# forward's: it rounds each product's input rows to bf16 (measured ~1% on the demo models).
TILES_CHECK_RTOL = 0.05


class KernelMismatch(RuntimeError):
    pass


def _median_ms(fn: Callable[[], Any], times: list[float]) -> None:
    start = time.perf_counter()
    fn()
    times.append((time.perf_counter() - start) * 1e3)


def run(
    model: str,
    rows: list[int],
    context: list[int],
    repeats: int,
    kv_gib: float = 0.5,
    scatter: bool = False,
) -> dict[str, Any]:
    loaded = load_model(
        load_config(
            None,
            {
                "model.path": model,
                "model.dtype": "bfloat16",
                # The row-major matrices kept for the matrix-vector forward; the tile forward
                # gets its own copy below.
                "model.cpu_tile_decode": False,
                "cache.block_size": 16,
                "cache.kv_cache_memory": kv_gib,
                "hardware.device": "cpu",
            },
        )
    )
    try:
        return _time_paths(loaded, rows, context, repeats, scatter)
    finally:
        loaded.close()


def _time_paths(
    loaded: Any, rows: list[int], contexts: list[int], repeats: int, scatter: bool
) -> dict[str, Any]:
    context = max(contexts)
    if context + 1 > loaded.max_model_len:
        # Past the rotary table the positions read garbage: NaN logits, and slow arithmetic on
        # them (a 2,048-token context on a 2,048-position model timed 3x a 1,024 one).
        raise RuntimeError(
            f"--context {context}: a decode at position {context} is past the model's "
            f"max_model_len {loaded.max_model_len}; at most {loaded.max_model_len - 1}"
        )
    runner, model = loaded.runner, loaded.model
    caches = runner.kv.device_caches
    plain = runner.hooks.fused_decode
    if plain is None:
        raise RuntimeError("no native decode on this CPU/config: nothing to compare")
    features = read_features("")
    isa, why = cpu_native.tile_decode_ready(features)
    tiled = None
    if isa is not None:
        lib = cpu_native.load(features)
        assert lib is not None
        pairs = [(c.k, c.v) for c in caches]
        tiles = TileDecodeWeights.from_model(model)
        tiled = FusedCpuDecode(model, pairs, 16, torch.bfloat16, lib, tiles)
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-(context + 1) // 16)
    num_blocks = caches[0].k.shape[0]
    if max(rows) * blocks_per_seq > num_blocks:
        raise RuntimeError(
            f"KV pool of {num_blocks} blocks too small for the widest step: raise --kv-gib"
        )
    used = max(rows) * blocks_per_seq
    # A served engine's blocks, after requests came and went, lie anywhere in the pool: each
    # row's context is then 16-token runs apart, which the hardware prefetcher cannot follow.
    blocks = torch.randperm(num_blocks, generator=gen)[:used] if scatter else torch.arange(used)
    for c in caches:
        for cache in (c.k, c.v):
            noise = torch.randn((used, *cache.shape[1:]), generator=gen).to(cache.dtype)
            cache.index_copy_(0, blocks, noise)
    results = []
    for n in rows:
        tables = blocks[: n * blocks_per_seq].view(n, blocks_per_seq)
        lens = torch.tensor([contexts[i % len(contexts)] + 1 for i in range(n)])
        paths = _step_paths(runner, model, caches, plain, tiled, tables, lens, gen)
        times: dict[str, list[float]] = {name: [] for name in paths}
        for fn in paths.values():
            fn()  # warm: primitives, pages
        for _ in range(repeats):
            for name, fn in paths.items():
                _median_ms(fn, times[name])
        results.append({"rows": n, **{f"{k}_ms": statistics.median(v) for k, v in times.items()}})
    return {
        "scatter": scatter,
        "threads": torch.get_num_threads(),
        "cpu": features.model_name,
        "features": sorted(features.flags),
        "tiles": isa,
        "tiles_why_not": why,
        "context": contexts,
        "results": results,
    }


def _step_paths(
    runner: Any,
    model: Any,
    caches: list[Any],
    plain: Any,
    tiled: FusedCpuDecode | None,
    tables: torch.Tensor,
    lens: torch.Tensor,
    gen: torch.Generator,
) -> dict[str, Callable[[], Any]]:
    """One decode step of a row per block table, row i over lens[i] - 1 tokens and its new
    one, as a call per path; the tile forward's logits checked against the float32-activation
    forward's first."""
    n = tables.shape[0]
    pos = lens - 1
    slots = tables[torch.arange(n), pos // 16] * 16 + pos % 16
    ids = torch.randint(0, model.args.vocab_size, (n,), generator=gen)
    meta = AttentionMetadata(
        slot_mapping=slots,
        decode=PagedBatch(tables, lens, torch.arange(n + 1), 1, int(lens.max()), n),
        prefill=None,
    )

    def torch_step() -> torch.Tensor:
        with runner.hooks.matmuls(n):
            return model.compute_logits(model(ids, pos, meta, caches))

    def native_step() -> torch.Tensor:
        return plain(ids, pos, slots, tables, lens)

    paths: dict[str, Callable[[], Any]] = {"torch": torch_step, "native": native_step}
    if tiled is not None:
        forward = tiled

        def tiles_step() -> torch.Tensor:
            return forward(ids, pos, slots, tables, lens)

        reference = native_step()
        err = float((tiles_step() - reference).norm() / reference.norm())
        if not err <= TILES_CHECK_RTOL:
            raise KernelMismatch(f"tile forward at {n} rows: relative error {err:.3g}")
        paths["native_tiles"] = tiles_step
    return paths


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "decode-step",
        help="ms of a bf16 decode step by row count: torch, native, native over tiles",
    )
    p.add_argument("--model", required=True, help="an HF model directory (dense weights)")
    p.add_argument("--rows", default="1,2,4,6,8,12,16,24,32", help="sequences in the step")
    p.add_argument(
        "--context",
        default="256",
        help="tokens each row attends over; a list (2000,150,150) is taken in turn by the rows",
    )
    p.add_argument("--repeats", type=int, default=9, help="interleaved calls, median kept")
    p.add_argument("--kv-gib", type=float, default=0.5, help="the KV pool (random K/V)")
    p.add_argument(
        "--scatter",
        action="store_true",
        help="rows' blocks anywhere in the pool, as a served engine's are (default: in order)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch's and the kernels' (0: as set)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    try:
        rows = [int(r) for r in ns.rows.split(",") if r]
        contexts = [int(c) for c in ns.context.split(",") if c]
    except ValueError:
        rows = contexts = []
    if not rows or min(rows) < 1 or not contexts or min(contexts) < 1 or ns.repeats < 1:
        print(
            "bench decode-step: --rows and --context take positive integers (1,2,4), "
            "--repeats at least 1",
            file=sys.stderr,
        )
        return 2
    if ns.threads > 0:
        torch.set_num_threads(ns.threads)
    try:
        out = run(ns.model, rows, contexts, ns.repeats, ns.kv_gib, ns.scatter)
    except RuntimeError as exc:  # a setting this model or pool cannot take (KernelMismatch too)
        print(f"bench decode-step: {exc}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(out))
        return 0
    tiles = (
        f"tile forward on {TILE_ISA_NAMES[out['tiles']]}"
        if out["tiles"]
        else f"no tile forward ({out['tiles_why_not']})"
    )
    print(
        f"{out['cpu']}, {out['threads']} threads, {tiles}; context "
        f"{','.join(map(str, out['context']))}"
        f"{' in scattered blocks' if out['scatter'] else ''}; "
        f"median of {ns.repeats} interleaved calls"
    )
    head = f"{'rows':>5s} {'torch ms':>9s} {'native ms':>10s} {'tiles ms':>9s} {'torch/tiles':>12s}"
    print(head)
    print("-" * len(head))
    for r in out["results"]:
        tiles_ms = r.get("native_tiles_ms")
        print(
            f"{r['rows']:5d} {r['torch_ms']:9.2f} {r['native_ms']:10.2f} "
            + (f"{tiles_ms:9.2f} {r['torch_ms'] / tiles_ms:11.2f}x" if tiles_ms else f"{'-':>9s}")
        )
    return 0

"""Speed of INT8 KV per-head vs per-token scales, A/B interleaved (for a shared, loaded box:
alternating rounds, best of each, so a load change hits both): greedy generation through
`appliance.Engine` on a model directory, batch 1 and batch 16, 128-token prompts, 32 tokens.

    python -m appliance.tools.kv_scales_ab ~/.cache/appliance/models/small [threads]
"""

from __future__ import annotations

import sys
import time

import torch

from appliance import Engine, SamplingParams
from appliance.config import load_config

SCALES = ("per_head", "per_token")


def main(model: str, threads: int = 1, rounds: int = 3) -> None:
    torch.set_num_threads(threads)
    engines = {
        sc: Engine(
            load_config(
                None,
                {
                    "model.path": model,
                    "cache.kv_cache_dtype": "int8",
                    "cache.kv_cache_scales": sc,
                    "cache.kv_cache_memory": 0.25,
                    "cache.swap_space": 0.0,
                    "hardware.device": "cpu",
                    # Every round prefills again (a cached prefix would skip it in later rounds only).
                    "cache.enable_prefix_caching": False,
                },
            )
        )
        for sc in SCALES
    }
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    try:
        for batch in (1, 16):
            prompts = [[5 + (i * 7 + j) % 4000 for j in range(128)] for i in range(batch)]
            best = dict.fromkeys(SCALES, float("inf"))
            for _ in range(rounds):
                for sc, engine in engines.items():
                    start = time.perf_counter()
                    engine.generate(prompts, params)
                    best[sc] = min(best[sc], time.perf_counter() - start)
            tokens = batch * params.max_tokens
            print(
                f"batch {batch}: per_head {tokens / best['per_head']:.1f} tok/s, per_token "
                f"{tokens / best['per_token']:.1f} tok/s (per-token time "
                f"{100 * (best['per_token'] / best['per_head'] - 1):+.1f}%)",
                flush=True,
            )
    finally:
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)

"""Simulated KV-cache storage schemes on the serving path, to decide what is worth building.

Not a serving feature: each scheme runs through `appliance.Engine` (a fresh engine per scheme,
so no prefix-cache block of an earlier run is reused) over a float32 cache whose writes store
K/V as the scheme would read them back, while a prefill attends to its chunk's fresh K/V (the
layer's spec is int8 with unit scales: the torch reference then dequantizes as x * 1 and
substitutes the fresh K/V, as for a real quantized cache). Greedy answers to kv_answers'
questions, scored against the 16-bit cache's.

Schemes (FORMAT:MODE): `static` (the calibrated per-head scales, rotated as RotatedKV: the
control, which lands within a couple of answers of the real format), `token` (one scale per
token and KV head, the token's own absmax), `sink` (static, but each sequence's first block,
the attention-sink tokens, kept exact), `auto:bf16` / `auto:fp16` (elementwise 16-bit rounding,
no scales: what a 16-bit cache itself costs a float32 model).

    python -m appliance.tools.kv_sim int8:static int8:token int8:sink auto:bf16
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from appliance import Engine, SamplingParams
from appliance.config import ApplianceConfig, load_config
from appliance.engine.kv_quant import (
    FORMAT_MAX,
    calibrate_absmax,
    calibration_windows,
    scales_from_absmax,
)
from appliance.kernels.attention_api import AttentionBackend, WriteKV
from appliance.kernels.paged_attention import dequantize, quantize
from appliance.layers.attention import AttentionMetadata, KVCacheSpec, attend_over
from appliance.layers.kv_cache import LayerCache
from appliance.layers.quantized_kv import rotation_matrix
from appliance.tools.kv_answers import QUESTIONS, chat_prompts, score_answers

PARAMS = SamplingParams(max_tokens=64, temperature=0.0)


def fp32_config(model: str) -> ApplianceConfig:
    return load_config(
        None,
        {
            "model.path": model,
            "model.dtype": "float32",
            "model.max_model_len": 1024,
            "model.cpu_prepack_weights": False,
            "cache.kv_cache_memory": 0.25,
            "cache.swap_space": 0.0,
            "hardware.device": "cpu",
        },
    )


def stored_form(x: torch.Tensor, fmt: str, mode: str, head_scale: torch.Tensor) -> torch.Tensor:
    """K or V [tokens, heads, D] as the scheme reads it back."""
    if mode in ("bf16", "fp16"):
        return x.to(torch.bfloat16 if mode == "bf16" else torch.float16).to(x.dtype)
    rot = rotation_matrix(x.shape[-1], x.device)
    y = x.float() @ rot
    if mode == "token":
        scale = y.abs().amax(-1, keepdim=True).clamp_min(1e-6) / FORMAT_MAX[fmt]
        z = y / scale
        if fmt == "int8":
            q = z.round().clamp(-127, 127)
        else:
            q = z.clamp(-448, 448).to(torch.float8_e4m3fn).float()
        y = q * scale
    else:
        y = dequantize(quantize(y, fmt, head_scale), fmt, head_scale, torch.float32)
    return (y @ rot.T).to(x.dtype)


class SimulatedKV:
    """A 16-bit cache holding what a quantized one would give back (the simulated write), read
    as an INT8 cache of unit scales: the same bytes, and a prefill attends to its fresh K/V at
    full precision as over a quantized cache."""

    def __init__(self, kernels: AttentionBackend, simulated: AttentionBackend, heads: int) -> None:
        self.kernels = kernels
        self.simulated = simulated
        ones = torch.ones(heads)
        self.spec = KVCacheSpec("int8", ones, ones)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerCache,
        scale: float,
    ) -> torch.Tensor:
        return attend_over(self.simulated, q, k, v, meta, cache.k, cache.v, self.spec, scale)


def simulate(config: ApplianceConfig, fmt: str, mode: str, absmax: Any) -> list[list[int]]:
    with Engine(config) as engine:
        runner, bs = engine.runner, engine.loaded.block_size
        for i, attn in enumerate(engine.loaded.model.attention_layers()):
            base = attn.kernels
            ks, vs = (scales_from_absmax(m, fmt if fmt != "auto" else "int8") for m in absmax[i])

            def write_kv(
                key: torch.Tensor,
                value: torch.Tensor,
                k_cache: torch.Tensor,
                v_cache: torch.Tensor,
                slot_mapping: torch.Tensor,
                kv_cache_dtype: str = "auto",
                k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None,
                write: WriteKV = base.write_kv,
                ks: torch.Tensor = ks,
                vs: torch.Tensor = vs,
            ) -> None:
                fk, fv = stored_form(key, fmt, mode, ks), stored_form(value, fmt, mode, vs)
                if mode == "sink":
                    first = torch.tensor(sorted({t[0] for t in runner.block_tables.values()}))
                    exact = torch.isin(slot_mapping // bs, first)
                    fk[exact], fv[exact] = key[exact], value[exact]
                write(fk, fv, k_cache, v_cache, slot_mapping, "auto")

            simulated = AttentionBackend("simulated", write_kv, base.paged_attention)
            attn.wire(SimulatedKV(base, simulated, attn.num_kv_heads))
        prompts = chat_prompts(engine.tokenizer, QUESTIONS)
        return [r.token_ids for r in engine.generate(prompts, PARAMS)]


def main(schemes: list[str]) -> None:
    from appliance.tools.smollm2 import build_smollm2

    torch.set_num_threads(1)
    config = fp32_config(str(build_smollm2()))
    with Engine(config) as engine:
        reference = [r.token_ids for r in engine.generate(chat_prompts(engine.tokenizer), PARAMS)]
        windows = calibration_windows(engine.tokenizer, 1024)
        absmax = calibrate_absmax(
            engine.loaded.model, windows, 16, torch.device("cpu"), torch.float32
        )
    for scheme in schemes:
        fmt, mode = scheme.split(":")
        s = score_answers(scheme, reference, simulate(config, fmt, mode, absmax))
        print(
            f"{scheme}: {round(s.identical * s.answers)}/{s.answers} identical, "
            f"{100 * s.matched_prefix:.1f}% matched prefix",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])

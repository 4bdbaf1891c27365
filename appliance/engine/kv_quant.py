"""Quantized KV cache: which layers are quantized, what each layer stores, and the scales.

Scales: one float32 per layer, per KV head, for K and for V (``stored = x / scale``), fixed at
start-up by a calibration forward with 16-bit KV over text the package ships
(`appliance/models/data/corpus.txt`): ``scale = absmax * MARGIN / format_max``.

Why calibrated at start-up and not at write time:
- The cache layout has no room for per-token scales, and a per-head scale that changed while a
  sequence runs would silently re-scale every value already stored under the old one.
- A static scale is known before the first request, costs nothing per step, and makes the
  quantization deterministic: the same prompt gives the same bytes in every batch, so
  `appliance kv-eval` measures what serving does.
- Each tensor-parallel rank calibrates its own KV heads in the same lockstep forward (all ranks
  run `load_model`), so no scales travel between ranks.
The price: values beyond the calibrated range saturate (clamped to the format's max, which is
also what keeps FP8 NaN/inf byte patterns out of the cache). MARGIN leaves headroom for that.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from appliance.config import CacheConfig, ConfigError
from appliance.core.scheduler import ScheduledRequest, SchedulerOutput
from appliance.engine.model_runner import KVCachePool, ModelRunner
from appliance.kernels.paged_attention import cache_storage_dtype
from appliance.layers.attention import KVCacheSpec
from appliance.models.llama import LlamaForCausalLM
from appliance.sampling_params import SamplingParams

FORMAT_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}
# Headroom over the calibration absmax, for values the calibration text never produced (they
# would saturate). FP8 is floating point: its relative step is the same (2^-4 for e4m3) from
# 2^-6 up to the max, so headroom is free. Measured with kv-eval (trained tiny demo model,
# held-out text, all layers quantized): e4m3 KL 8.12e-3 / 8.05e-3 / 8.09e-3 / 8.05e-3 at margins
# 1 / 2 / 8 / 64. INT8's step is uniform, so headroom coarsens every value: KL 1.08e-3 / 1.45e-3 /
# 3.28e-3 at margins 1 / 1.25 / 2, hence only 10% there.
MARGIN = {"fp8_e4m3": 2.0, "fp8_e5m2": 2.0, "int8": 1.1}
# Two windows of the corpus: enough for a stable absmax per head (a few hundred tokens cover
# every head's range on the demo models), cheap even on the CPU (0.8 s for the small model).
CALIBRATION_WINDOWS = 2
CALIBRATION_WINDOW_TOKENS = 256
# A head that never produced a non-zero value still needs a usable (non-zero) scale.
MIN_ABSMAX = 1e-6


def layer_kv_dtypes(cache: CacheConfig, num_layers: int) -> list[str]:
    """kv_cache_dtype of each layer: "auto" (model dtype) for kv_cache_keep_16bit layers."""
    for index in cache.kv_cache_keep_16bit:
        if index >= num_layers:
            raise ConfigError(
                f"cache.kv_cache_keep_16bit: layer {index} does not exist: the model has "
                f"{num_layers} layers (valid indices 0..{num_layers - 1})"
            )
    keep = set(cache.kv_cache_keep_16bit)
    return ["auto" if i in keep else cache.kv_cache_dtype for i in range(num_layers)]


def storage_dtypes(kinds: Sequence[str], model_dtype: torch.dtype) -> list[torch.dtype]:
    return [cache_storage_dtype(kind, model_dtype) for kind in kinds]


def calibration_windows(tokenizer: object, max_len: int) -> list[list[int]]:
    """Token windows from the shipped corpus (spread over it, so several kinds of text)."""
    from appliance.tools.demo_spec import corpus_text

    text = corpus_text()
    size = max(2, min(CALIBRATION_WINDOW_TOKENS, max_len))
    windows = []
    for w in range(CALIBRATION_WINDOWS):
        start = len(text) * w // CALIBRATION_WINDOWS
        # ~8 characters per token is generous for English BPE: enough text for a full window.
        ids = list(tokenizer.encode(text[start : start + 8 * size]))  # type: ignore[attr-defined]
        windows.append(ids[:size])
    return [w for w in windows if w]


@torch.inference_mode()
def calibrate_absmax(
    model: LlamaForCausalLM,
    windows: list[list[int]],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (K absmax, V absmax) per KV head over the windows, with 16-bit KV: one
    batched prefill through the runner (the serving path), observing what each layer writes."""
    layers = model.attention_layers()
    heads = layers[0].num_kv_heads
    absmax = [
        (torch.zeros(heads, device=device), torch.zeros(heads, device=device)) for _ in layers
    ]
    saved = [(attn.write_kv, attn.paged_attention, attn.spec) for attn in layers]

    def observer(i: int, write: object) -> object:
        def write_kv(key: torch.Tensor, value: torch.Tensor, *rest: object) -> None:
            k_max, v_max = absmax[i]
            torch.maximum(k_max, key.abs().amax(dim=(0, 2)).float(), out=k_max)
            torch.maximum(v_max, value.abs().amax(dim=(0, 2)).float(), out=v_max)
            write(key, value, *rest)  # type: ignore[operator]

        return write_kv

    blocks_per_window = [math.ceil(len(w) / block_size) for w in windows]
    pool = KVCachePool(
        len(layers), sum(blocks_per_window), 0, block_size, heads, layers[0].head_dim, dtype, device
    )
    runner = ModelRunner(model, pool, block_size, device, frozenset())
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    scheduled, first = [], 0
    for n, (window, nb) in enumerate(zip(windows, blocks_per_window, strict=True)):
        block_ids = list(range(first, first + nb))
        first += nb
        scheduled.append(ScheduledRequest(f"kv-calibration-{n}", window, 0, block_ids, False, greedy, 0))
    try:
        for i, attn in enumerate(layers):
            attn.spec = KVCacheSpec()
            attn.set_backend(observer(i, attn.write_kv), attn.paged_attention)  # type: ignore[arg-type]
        tokens = sum(len(w) for w in windows)
        runner.execute(SchedulerOutput(scheduled=scheduled, num_scheduled_tokens=tokens))
    finally:
        for attn, (write, attend, spec) in zip(layers, saved, strict=True):
            attn.set_backend(write, attend)
            attn.spec = spec
    return absmax


def scales_from_absmax(absmax: torch.Tensor, kind: str) -> torch.Tensor:
    return (absmax.clamp_min(MIN_ABSMAX) * MARGIN[kind] / FORMAT_MAX[kind]).float().contiguous()


def apply_kv_specs(
    model: LlamaForCausalLM,
    kinds: Sequence[str],
    absmax: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
) -> None:
    """Give each attention layer its format and scales (16-bit layers need none)."""
    for i, (attn, kind) in enumerate(zip(model.attention_layers(), kinds, strict=True)):
        if kind == "auto":
            attn.spec = KVCacheSpec()
            continue
        assert absmax is not None, "quantized layers need calibrated absmax values"
        k_max, v_max = absmax[i]
        attn.spec = KVCacheSpec(kind, scales_from_absmax(k_max, kind), scales_from_absmax(v_max, kind))


def configure_kv_cache(
    model: LlamaForCausalLM,
    tokenizer: object,
    cache: CacheConfig,
    model_dtype: torch.dtype,
    device: torch.device,
    max_len: int,
) -> tuple[list[torch.dtype], list[tuple[torch.Tensor, torch.Tensor]] | None]:
    """Validate the keep-list, calibrate when any layer is quantized, set every layer's spec.

    Returns the per-layer storage dtypes (for the pool) and the calibration absmax (None when
    nothing is quantized), which `appliance kv-eval` reuses to try other keep-lists.
    """
    kinds = layer_kv_dtypes(cache, model.args.num_layers)
    absmax = None
    if any(kind != "auto" for kind in kinds):
        windows = calibration_windows(tokenizer, max_len)
        absmax = calibrate_absmax(model, windows, cache.block_size, device, model_dtype)
    apply_kv_specs(model, kinds, absmax)
    return storage_dtypes(kinds, model_dtype), absmax

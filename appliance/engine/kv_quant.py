"""Quantized KV cache: which layers are quantized, what each layer stores, and the scales.

Scales: one float32 per layer, per KV head, for K and for V (``stored = x / scale``), fixed at
start-up by a calibration forward with 16-bit KV over text the package ships
(`appliance/models/data/corpus.txt`): ``scale = absmax * MARGIN / format_max``.

Or, for INT8 with cache.kv_cache_scales = "per_token" (int8's default: "auto"), one float16
scale per token and KV head, the token's own absmax / 127, computed when the token is written
and stored in scale caches of the pool beside K/V (kernels/paged_attention.py; no
calibration): INT8's step is uniform, so a range fitted to each token keeps far more of it
(SmolLM2: README "KV-cache accuracy"). Every
backend reads them: the torch path on the CPU, the Triton kernels on CUDA (kernels/triton_kv.py
writes them with the CPU path's rounding).

Why per-head scales are calibrated at start-up and not at write time:
- A per-head scale that changed while a sequence runs would silently re-scale every value
  already stored under the old one.
- A static scale is known before the first request, costs nothing per step, and makes the
  quantization deterministic: the same prompt gives the same bytes in every batch, so
  `appliance kv-eval` measures what serving does.
- Each tensor-parallel rank calibrates its own KV heads in the same lockstep forward (all ranks
  run `load_model`), so no scales travel between ranks.
The price: values beyond the calibrated range saturate (clamped to the format's max, which is
also what keeps FP8 NaN/inf byte patterns out of the cache). MARGIN leaves headroom for that.

Rotation (appliance/layers/quantized_kv.py): a quantized layer stores K/V times an orthonormal
Hadamard matrix, which spreads the outlier channels of a trained model's K over all channels.
Measured on SmolLM2-135M-Instruct (16 chat answers, teacher forced, flipped greedy tokens):
int8 33 -> 16, fp8_e4m3 49 -> 46.
A prefill attends to the chunk's fresh K/V on every backend (`key=`/`value=` of the shared
attention signature): in the Triton prefill kernel on CUDA, the torch reference on the CPU.

Kept heads (cache.kv_cache_keep_16bit_heads): a quantized layer may hold some KV heads in a
16-bit side cache (appliance/kv_layout.py decides which, per rank); its scales then cover the
other heads only, and the layer's path runs the kept heads through the device's plain
pair over the side cache (`apply_layer_spec`, layers/quantized_kv.py's SplitHeadsKV).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from appliance.config import CacheConfig
from appliance.core.scheduler_output import ScheduledRequest, SchedulerOutput
from appliance.engine.kv_pool import KVCachePool
from appliance.engine.model_runner import ModelRunner
from appliance.kernels.attention_api import AttentionBackend, WriteKV
from appliance.kernels.kv_formats import PER_TOKEN_KIND
from appliance.kernels.paged_attention import cache_storage_dtype
from appliance.kv_layout import LayerKV
from appliance.kv_layout import layer_layout as kv_layer_layout
from appliance.layers.attention import Attention, KVCacheSpec, PlainKV
from appliance.layers.kv_cache import KVStorage
from appliance.layers.parallel import tp_rank, tp_size
from appliance.layers.quantized_kv import kv_path, rotation_matrix
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


def layer_layout(cache: CacheConfig, num_layers: int, num_kv_heads: int) -> list[LayerKV]:
    """This rank's format and kept KV heads per layer (appliance/kv_layout.py; the keep-lists
    checked against the model with messages naming the field and the entry)."""
    return kv_layer_layout(cache, num_layers, num_kv_heads, tp_size(), tp_rank())


def _as_layer(layer: LayerKV | str) -> LayerKV:
    return LayerKV(layer) if isinstance(layer, str) else layer


def kv_storage(layers: Sequence[LayerKV | str], model_dtype: torch.dtype) -> KVStorage:
    """What the pool allocates for `layers`: each cache's dtype and its 16-bit side heads."""
    specs = [_as_layer(x) for x in layers]
    return KVStorage(
        [cache_storage_dtype(x.kind, model_dtype) for x in specs],
        [len(x.kept_heads) for x in specs],
        cache_storage_dtype("auto", model_dtype),
        [x.kind == PER_TOKEN_KIND for x in specs],
    )


class TextEncoder(Protocol):
    """What calibration reads of a tokenizer (a transformers one has it)."""

    def encode(self, text: str) -> Iterable[int]: ...


def calibration_windows(tokenizer: TextEncoder, max_len: int) -> list[list[int]]:
    """Token windows from the shipped corpus (spread over it, so several kinds of text)."""
    from appliance.models.demo_spec import corpus_text

    text = corpus_text()
    size = max(2, min(CALIBRATION_WINDOW_TOKENS, max_len))
    windows = []
    for w in range(CALIBRATION_WINDOWS):
        start = len(text) * w // CALIBRATION_WINDOWS
        # ~8 characters per token is generous for English BPE: enough text for a full window.
        ids = list(tokenizer.encode(text[start : start + 8 * size]))
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
    saved = [attn.kv_path for attn in layers]
    # The range of what a quantized layer stores: the rotated K/V (layers/quantized_kv.py).
    rot = rotation_matrix(layers[0].head_dim, device)

    def observer(i: int, write: WriteKV) -> WriteKV:
        def write_kv(
            key: torch.Tensor,
            value: torch.Tensor,
            k_cache: torch.Tensor,
            v_cache: torch.Tensor,
            slot_mapping: torch.Tensor,
            kv_cache_dtype: str = "auto",
            k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None,
        ) -> None:
            k_max, v_max = absmax[i]
            torch.maximum(k_max, (key.float() @ rot).abs().amax(dim=(0, 2)), out=k_max)
            torch.maximum(v_max, (value.float() @ rot).abs().amax(dim=(0, 2)), out=v_max)
            write(key, value, k_cache, v_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)

        return write_kv

    blocks_per_window = [math.ceil(len(w) / block_size) for w in windows]
    pool = KVCachePool(
        len(layers), sum(blocks_per_window), 0, block_size, heads, layers[0].head_dim, dtype, device
    )
    runner = ModelRunner(model, pool, block_size, device)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    scheduled, first = [], 0
    for n, (window, nb) in enumerate(zip(windows, blocks_per_window, strict=True)):
        block_ids = list(range(first, first + nb))
        first += nb
        scheduled.append(
            ScheduledRequest(f"kv-calibration-{n}", window, 0, block_ids, False, greedy, 0)
        )
    try:
        for i, attn in enumerate(layers):
            base = attn.kernels
            observed = AttentionBackend(
                "calibration", observer(i, base.write_kv), base.paged_attention
            )
            attn.wire(PlainKV(observed))
        tokens = sum(len(w) for w in windows)
        runner.execute(SchedulerOutput(scheduled=scheduled, num_scheduled_tokens=tokens))
    finally:
        for attn, path in zip(layers, saved, strict=True):
            attn.wire(path)
    return absmax


def scales_from_absmax(absmax: torch.Tensor, kind: str) -> torch.Tensor:
    return (absmax.clamp_min(MIN_ABSMAX) * MARGIN[kind] / FORMAT_MAX[kind]).float().contiguous()


def apply_kv_specs(
    model: LlamaForCausalLM,
    layers: Sequence[LayerKV | str],
    absmax: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
    device: torch.device | None = None,
) -> None:
    """Give each attention layer its format, scales and backend (`apply_layer_spec`)."""
    for i, (attn, layer) in enumerate(zip(model.attention_layers(), layers, strict=True)):
        apply_layer_spec(attn, _as_layer(layer), absmax[i] if absmax is not None else None, device)


def apply_layer_spec(
    attn: Attention,
    layer: LayerKV,
    absmax: tuple[torch.Tensor, torch.Tensor] | None,
    device: torch.device | None = None,
) -> None:
    """Wire the layer's KV path over the device's pair it already has: 16-bit layers need no
    scales and attend through the pair as it is; quantized ones rotated, their kept heads over
    the 16-bit side cache (layers/quantized_kv.py). The rotation and the head split are built
    on `device`, else on the calibrated scales' device (the CPU without either: per-token
    layers have no calibration to take it from)."""
    if layer.kind == "auto":
        attn.wire(PlainKV(attn.kernels))
        return
    # The quantized cache holds the heads not kept, in order: their scales alone.
    quant = [h for h in range(attn.num_kv_heads) if h not in layer.kept_heads]
    assert quant, "a layer keeping every head is a 16-bit layer (kv_layout.layer_layout)"
    kept = tuple(sorted(layer.kept_heads))
    if layer.kind == PER_TOKEN_KIND:
        # Scales live in the pool's scale caches (written with each token), none calibrated.
        if device is None:
            device = absmax[0].device if absmax is not None else torch.device("cpu")
        spec = KVCacheSpec(layer.kind, kept_heads=kept)
    else:
        assert absmax is not None, "quantized layers need calibrated absmax values"
        k_max, v_max = absmax[0][quant], absmax[1][quant]
        if device is None:
            device = k_max.device
        spec = KVCacheSpec(
            layer.kind,
            scales_from_absmax(k_max, layer.kind),
            scales_from_absmax(v_max, layer.kind),
            kept,
        )
    attn.wire(kv_path(attn.kernels, spec, attn.num_heads, attn.num_kv_heads, attn.head_dim, device))


def configure_kv_cache(
    model: LlamaForCausalLM,
    tokenizer: TextEncoder,
    cache: CacheConfig,
    model_dtype: torch.dtype,
    device: torch.device,
    max_len: int,
) -> tuple[KVStorage, list[tuple[torch.Tensor, torch.Tensor]] | None]:
    """Validate the keep-lists, calibrate when any layer is quantized, set every layer's spec.

    Returns what the pool allocates and the calibration absmax (None when nothing is
    quantized), which `appliance kv-eval` reuses to try other keep-lists.
    """
    args = model.args
    layers = layer_layout(cache, args.num_layers, args.num_kv_heads)
    absmax = None
    if any(layer.kind not in ("auto", PER_TOKEN_KIND) for layer in layers):
        windows = calibration_windows(tokenizer, max_len)
        absmax = calibrate_absmax(model, windows, cache.block_size, device, model_dtype)
    apply_kv_specs(model, layers, absmax, device)
    return kv_storage(layers, model_dtype), absmax

"""What each layer of the KV cache stores, torch-free: the loader and `appliance plan` (which
the console imports, and which must not reach the engine) derive the same layout and count the
same bytes from `[cache]`.

A layer is either 16-bit ("auto": the model's KV dtype), or quantized (`kv_cache_dtype`) with
some of its KV heads kept 16-bit in a side cache of the layer (`kv_cache_keep_16bit_heads`):
same block table, only those heads' K/V, so they cost 16-bit bytes and the other heads 1 byte.
Under tensor parallelism each rank holds a share of the KV heads (or one replica when ranks
outnumber them), so a rank keeps the listed heads it holds; every rank sizes its pool with the
largest rank's block (they must hold the same number of blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.kernels.kv_formats import PER_TOKEN_KIND

if TYPE_CHECKING:
    from appliance.config import CacheConfig

QUANTIZED_BYTES = 1  # FP8 and INT8: one byte an element
TOKEN_SCALE_BYTES = 2


@dataclass(frozen=True)
class LayerKV:
    """One layer on one rank: its cache format and the local KV heads stored apart in 16-bit
    (empty for 16-bit layers, whose cache holds every head in 16-bit anyway)."""

    kind: str
    kept_heads: tuple[int, ...] = ()


def _config_error(message: str) -> Exception:
    from appliance.config import ConfigError

    return ConfigError(message)


def check_keep_lists(cache: CacheConfig, num_layers: int, num_kv_heads: int) -> None:
    """Indices against the model: a message naming the field, the entry and the valid range."""
    for index in cache.kv_cache_keep_16bit:
        if index >= num_layers:
            raise _config_error(
                f"cache.kv_cache_keep_16bit: layer {index} does not exist: the model has "
                f"{num_layers} layers (valid indices 0..{num_layers - 1})"
            )
    for entry, (layer, head) in zip(
        cache.kv_cache_keep_16bit_heads, cache.kept_heads(), strict=True
    ):
        if layer >= num_layers or head >= num_kv_heads:
            raise _config_error(
                f"cache.kv_cache_keep_16bit_heads: {entry!r} does not exist: the model has "
                f"{num_layers} layers of {num_kv_heads} KV heads (valid: layers "
                f"0..{num_layers - 1}, heads 0..{num_kv_heads - 1})"
            )


def rank_heads(num_kv_heads: int, tp: int, rank: int) -> list[int]:
    """The model's KV heads this rank holds, in its local order (appliance.models.llama)."""
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * num_kv_heads // tp]


def layer_layout(
    cache: CacheConfig, num_layers: int, num_kv_heads: int, tp: int = 1, rank: int = 0
) -> list[LayerKV]:
    """Per layer, this rank's format and kept local heads. A layer whose every local head is
    listed is simply a 16-bit layer (no empty quantized cache beside its side cache)."""
    check_keep_lists(cache, num_layers, num_kv_heads)
    whole = set(cache.kv_cache_keep_16bit)
    listed: dict[int, set[int]] = {}
    for layer, head in cache.kept_heads():
        listed.setdefault(layer, set()).add(head)
    held = rank_heads(num_kv_heads, tp, rank)
    out = []
    for i in range(num_layers):
        if cache.kv_cache_dtype == "auto" or i in whole:
            out.append(LayerKV("auto"))
            continue
        kept = tuple(local for local, head in enumerate(held) if head in listed.get(i, ()))
        if len(kept) == len(held):
            out.append(LayerKV("auto"))
        else:
            kind = PER_TOKEN_KIND if cache.scales() == "per_token" else cache.kv_cache_dtype
            out.append(LayerKV(kind, kept))
    return out


def layer_bytes_per_token(layer: LayerKV, heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of one token in one layer on one rank of `heads` KV heads."""
    if layer.kind == "auto":
        return 2 * heads * head_dim * dtype_bytes
    kept = len(layer.kept_heads)
    per_head = head_dim * QUANTIZED_BYTES + (
        TOKEN_SCALE_BYTES if layer.kind == PER_TOKEN_KIND else 0
    )
    return 2 * (kept * head_dim * dtype_bytes + (heads - kept) * per_head)


def kv_bytes_per_token(
    cache: CacheConfig,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    tp: int = 1,
) -> int:
    """K and V of one token over all layers, on the largest rank (what each rank sizes with)."""
    heads = max(1, num_kv_heads // tp)
    return max(
        sum(
            layer_bytes_per_token(layer, heads, head_dim, dtype_bytes)
            for layer in layer_layout(cache, num_layers, num_kv_heads, tp, rank)
        )
        for rank in range(tp)
    )

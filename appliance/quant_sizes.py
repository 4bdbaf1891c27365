"""Sizes of packed weights, torch-free: the loader's GPU check and `appliance plan` (which the
console imports, and which must not reach the engine) count them the same way."""

from __future__ import annotations


def bits_per_weight(kind: str, group: int = 128) -> float:
    """Bits a packed weight takes in the engine's layouts (appliance.layers.quant), scales and
    mins included: AWQ/GPTQ 4 bits + a fp16 scale and a float32 min per group; INT8 one byte
    (its per-row fp16 scale is negligible)."""
    if kind in ("awq", "gptq"):
        return 4 + 8 * (2 + 4) / group
    if kind == "int8":
        return 8.0
    raise ValueError(f"no packed size for {kind!r}")

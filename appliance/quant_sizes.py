"""Sizes of packed weights, torch-free: the loader's GPU check and `appliance plan` (which the
console imports, and which must not reach the engine) count them the same way."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from appliance.config import ApplianceConfig
    from appliance.models.args import ModelArgs


def bits_per_weight(kind: str, group: int = 128) -> float:
    """Bits a packed weight takes in the engine's layouts (appliance.kernels.quant_weight), scales and
    mins included: AWQ/GPTQ 4 bits + a fp16 scale and a float32 min per group; INT8 one byte
    (its per-row fp16 scale is negligible)."""
    if kind in ("awq", "gptq"):
        return 4 + 8 * (2 + 4) / group
    if kind == "int8":
        return 8.0
    raise ValueError(f"no packed size for {kind!r}")


def weight_format(config: ApplianceConfig, raw: dict[str, Any]) -> str:
    """ "awq", "gptq", "int8" or "" (16-bit): the installed config.json's quantization_config
    wins, else model.quantization states it."""
    qc = raw.get("quantization_config") or {}
    method = str(qc.get("quant_method", "")).lower()
    return method if method in ("awq", "gptq", "gguf") else config.model.quantization


def quantized_weight_bytes(
    spec: ModelArgs, tp: int, elem: int, fmt: str, qc: dict[str, Any] | None = None
) -> int:
    """Bytes of one rank's weights as the engine holds them packed (appliance.kernels.quant_weight):
    AWQ/GPTQ pack the layers' linears (embedding and LM head stay 16-bit); INT8 also packs
    the LM head (and the embedding it is tied to); GGUF packs what the file quantized, at the
    size `qc` (plan._gguf_config) counted."""
    if fmt == "gguf":
        qc = qc or {}
        dense = spec.params_per_rank(tp) - int(qc["packed_elements"])
        return int(qc["packed_bytes"]) + dense * elem
    linears = spec.linear_params_per_rank(tp)
    packed = linears
    if fmt == "int8":
        packed += spec.lm_head_params_per_rank(tp)  # a tied table is the head's, counted once
    rest = spec.params_per_rank(tp) - packed
    return int(packed * bits_per_weight(fmt) / 8) + rest * elem


def format_note(fmt: str, types: list[str] | None = None) -> str:
    if fmt == "gguf":
        kinds = ", ".join(types or []) or "unquantized"
        return f"GGUF {kinds} repacked (4-bit: + fp16 scale and min per 32), the rest 16-bit"
    if fmt == "int8":
        return "INT8 linears and LM head (1 byte + a fp16 scale a row), the rest 16-bit"
    return f"{fmt.upper()} 4-bit linears (group 128: + fp16 scale, fp32 min), embedding and LM head 16-bit"

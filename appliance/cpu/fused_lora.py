"""LoRA inside the CPU's fused native decode: the descriptor (kernels/cpu_lora.h) through which
the forwards of kernels/cpu_decode.c (float32/bf16 and AMX bf16) read every layer's slot
factors, so that a decode step with adapter rows stays one native call. After each projection
(q|k|v, o, gate|up before its SiLU, down) the forward adds its rows' updates with the same
kernel as the torch forward's per-linear update (kernels/cpu_lora.inc.c, appliance.cpu.
lora_update), from the same factors: zero-padded to the pool's rank, merged projections' A
stacked along the rank and B block-diagonal (appliance.layers.lora). Rows of slot -1 cost
nothing; a step without adapter rows passes no descriptor and runs the forward unchanged.

The descriptor holds the factors' addresses: the slot pool allocates them once and fills them
in place (appliance.engine.lora_pool), and the decode keeps this object alive with them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from appliance.kernels.cpu_lora import LORA_SHAPE_FIELDS
from appliance.layers.lora import LoraFactors, LoraLayerFactors

# The kinds of linear a layer has, in the LK_* order of kernels/cpu_lora.h.
LORA_KINDS = ("qkv", "o", "gate_up", "down")
# Parts of a merged projection the descriptor has room for (q|k|v: 3).
MAX_PARTS = 3
KIND_FIELDS = len(LORA_SHAPE_FIELDS) + 2 * MAX_PARTS


@dataclass(frozen=True)
class FusedShapes:
    """The fused forward's matrix shapes, which each kind's factors must match: (in, out)."""

    hidden: int
    qkv: int
    q: int
    inter: int

    def of(self, kind: str) -> tuple[int, int]:
        return {
            "qkv": (self.hidden, self.qkv),
            "o": (self.q, self.hidden),
            "gate_up": (self.hidden, 2 * self.inter),
            "down": (self.inter, self.hidden),
        }[kind]


def _kind_fields(factors: LoraFactors, slots: int) -> list[int]:
    in_f, out_f = factors.a.shape[1], factors.b_t.shape[1]
    values = {
        "rows": 0,  # the forward's own
        "in_features": in_f,
        "out_features": out_f,
        "x_stride": in_f,
        "out_stride": out_f,
        "width": factors.width,
        "rank": factors.rank,
        "parts": len(factors.parts),
        "slots": slots,
        "threads": 0,  # the forward's own
    }
    parts = [v for part in factors.parts for v in part]
    return [values[name] for name in LORA_SHAPE_FIELDS] + parts + [0] * (2 * MAX_PARTS - len(parts))


def lora_descriptor(
    layers: list[LoraLayerFactors],
    slots: int,
    dtype: torch.dtype,
    shapes: FusedShapes,
    tiles: bool = False,
) -> torch.Tensor:
    """The int64 descriptor of kernels/cpu_lora.h for these layers' factors, with the
    addresses of their tile copies (`tiles`: for the AMX forward, where every linear has one;
    else zeros: the vector update); ValueError naming what the fused forward cannot take (the
    runner then keeps adapter steps on torch)."""
    header: list[int] = []
    pointers: list[int] = []
    copies = [getattr(layer, kind).tiles for layer in layers for kind in LORA_KINDS]
    tiles = tiles and all(c is not None for c in copies)
    for kind in LORA_KINDS:
        first = getattr(layers[0], kind)
        if len(first.parts) > MAX_PARTS:
            raise ValueError(f"{kind}: {len(first.parts)} parts, at most {MAX_PARTS}")
        header += _kind_fields(first, slots)
    for index, layer in enumerate(layers):
        for k, kind in enumerate(LORA_KINDS):
            f: LoraFactors = getattr(layer, kind)
            where = f"layer {index} {kind}"
            for name, t in (("a", f.a), ("b_t", f.b_t)):
                if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
                    raise ValueError(
                        f"{where}: {name} must be a contiguous CPU {dtype} tensor "
                        f"(got {t.dtype} on {t.device})"
                    )
            if (f.a.shape[1], f.b_t.shape[1]) != shapes.of(kind):
                raise ValueError(
                    f"{where}: factors of (in, out) {(f.a.shape[1], f.b_t.shape[1])}, "
                    f"the forward's {shapes.of(kind)} (a tensor-parallel shard?)"
                )
            if _kind_fields(f, slots) != header[k * KIND_FIELDS : (k + 1) * KIND_FIELDS]:
                raise ValueError(f"{where}: rank or parts differ from layer 0's")
            if f.a.shape[0] != slots * f.width or f.b_t.shape[0] != slots * f.width:
                raise ValueError(f"{where}: {f.a.shape[0]} factor rows, not {slots} slots")
            copy = f.tiles if tiles else None
            packed = [copy.a.data_ptr(), copy.b.data_ptr()] if copy is not None else [0, 0]
            pointers += [f.a.data_ptr(), f.b_t.data_ptr(), *packed]
    return torch.tensor(header + pointers, dtype=torch.int64)

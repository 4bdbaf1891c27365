"""Sizes of the LoRA slot pool, torch-free: `appliance plan` (which the console imports, and which
must not reach the engine) counts what engine/lora_pool.py and the CPU's tile copy
(appliance.cpu.lora_tiles, which reads its layout constants here) allocate."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from appliance.models.args import ModelArgs

# The CPU's tile copy (appliance.cpu.lora_tiles): its rank granule, half a tile's K (a rank of
# 16 reads no zeros), and the zero elements after each copy: half a 1 KB tile, which a rank of
# 16's last block loads past its own end (multiplied by the shrink's zeros).
RANK_GRANULE = 16
TAIL = 256


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def _dims(spec: ModelArgs, tp: int) -> tuple[int, int, int, int]:
    """(hidden, intermediate, q and kv features) of one rank's shard."""
    q = spec.num_heads * spec.head_dim // tp
    kv = spec.kv_heads_per_rank(tp) * spec.head_dim
    return spec.hidden_size, spec.intermediate_size // tp, q, kv


def lora_slot_params(spec: ModelArgs, tp: int, slots: int, rank: int) -> int:
    """Elements of one rank's LoRA slot pool, as engine/lora_pool.py stacks them: per layer
    and slot, A and B of q|k|v and gate|up (parts stacked along the rank) and of o and down,
    each cut to this rank's shard."""
    h, inter, q, kv = _dims(spec, tp)
    qkv = 3 * rank * (h + q + 2 * kv)
    gate_up = 2 * rank * (h + 2 * inter)
    o_down = rank * (q + h) + rank * (inter + h)
    return slots * spec.num_layers * (qkv + gate_up + o_down)


def lora_tile_params(spec: ModelArgs, tp: int, slots: int, rank: int) -> int:
    """Elements of the CPU's tile-packed copy of that pool (appliance.cpu.lora_tiles): A with
    its in features padded to 32, each part's own block of B with its rows padded to 16, and
    each linear's two copies' zero tail."""
    h, inter, q, kv = _dims(spec, tp)
    a = 5 * rank * _up(h, 32) + rank * _up(q, 32) + rank * _up(inter, 32)
    b = rank * (_up(q, 16) + 2 * _up(kv, 16) + 2 * _up(inter, 16) + 2 * _up(h, 16))
    return slots * spec.num_layers * (a + b) + spec.num_layers * 4 * 2 * TAIL

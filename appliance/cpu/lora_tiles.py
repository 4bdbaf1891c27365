"""The tile-packed copy of a LoRA linear's slot factors that the update on AMX tiles reads
(kernels/cpu_lora_amx.inc.c: in the tile decode forward on AMX, and per linear in the torch
forward): made at load where the CPU backend's plan has AMX (CpuBackend.lora_tiles), and refreshed slot
by slot whenever the pool fills one (appliance.engine.lora_pool calls `refill`).

Per linear and slot: A [width, in] packed as the base weights are (appliance.cpu.tile_weights:
the shrink's columns are the factor rows), and each part's block of B [rows, rank] (B is
block-diagonal: only the parts' own blocks, not b_t's zeros) as [rows/16][rank/2][16][2], K
padded to 16 rather than 32, so that a rank-16 adapter reads no zeros. Each copy ends in 256
zero elements: a rank of 16 loads a whole tile, whose second half (multiplied by zeros) is the
next block's, past the last one for the last block.

What it costs: about the factors' own bytes again (b_t's zero blocks excepted), counted in
the pool's `nbytes`, and ~3 ms more per slot fill of SmolLM2's 120 linears; the tile update
needs ranks that are multiples of 16 (else the vector update, from the factors themselves)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from appliance.cpu.tile_weights import tile_pack
from appliance.layers.lora import LoraFactors
from appliance.lora_sizes import RANK_GRANULE, TAIL


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pack_b(block: torch.Tensor) -> torch.Tensor:
    """One part's B [rows, rank] -> [rows/16][rank/2][16][2] bf16, rows padded to 16."""
    rows, rank = block.shape
    padded = F.pad(block.to(torch.bfloat16), (0, 0, 0, _round_up(rows, 16) - rows))
    tiles = padded.view(-1, 16, rank // 2, 2).permute(0, 2, 1, 3)
    return tiles.contiguous().view(-1)


class LoraTileCopy:
    """One LoRA linear's factors, tile-packed, over every slot of the pool (`a`, `b`: flat
    bf16); the pool calls `refill` once it has written a slot."""

    def __init__(self, factors: LoraFactors, slots: int) -> None:
        self.factors = factors
        in_f = factors.a.shape[1]
        self.a_slot = factors.width * _round_up(in_f, 32)
        self.b_slot = sum(_round_up(rows, 16) * factors.rank for _, rows in factors.parts)
        self.a = torch.zeros(slots * self.a_slot + TAIL, dtype=torch.bfloat16)
        self.b = torch.zeros(slots * self.b_slot + TAIL, dtype=torch.bfloat16)
        for slot in range(slots):
            self.refill(slot)

    @staticmethod
    def fits(factors: LoraFactors) -> str | None:
        """None when the tile update can take these factors, else why not."""
        if factors.a.dtype != torch.bfloat16:
            return f"factors in {factors.a.dtype}, the tiles take bfloat16"
        if factors.rank % RANK_GRANULE:
            return f"rank {factors.rank} is not a multiple of {RANK_GRANULE}"
        return None

    def refill(self, slot: int) -> None:
        """Copy slot `slot`'s factors (as the pool has just written them) into the tiles."""
        f, w = self.factors, self.factors.width
        a = f.a[slot * w : (slot + 1) * w]
        self.a[slot * self.a_slot : (slot + 1) * self.a_slot].copy_(tile_pack(a))
        b_t = f.b_t[slot * w : (slot + 1) * w]
        at = slot * self.b_slot
        for p, (offset, rows) in enumerate(f.parts):
            block = b_t[p * f.rank : (p + 1) * f.rank, offset : offset + rows].t()
            packed = _pack_b(block)
            self.b[at : at + packed.numel()].copy_(packed)
            at += packed.numel()

    @property
    def nbytes(self) -> int:
        return (self.a.numel() + self.b.numel()) * 2

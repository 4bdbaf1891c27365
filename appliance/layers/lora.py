"""LoRA on a linear: a matmul strategy (appliance.layers.matmul's protocol) that runs the base
strategy it wraps, then adds each row's low-rank update x A^T B^T from the adapter slot that
row runs under. Which rows run which slot is set once per step (`LoraBatch`, which the
runner's slot pool fills: appliance.engine.lora_pool); how the update runs is a `LoraUpdate`
the device backend chose at load: the CPU's native kernel (appliance.cpu.lora_update), or
`TorchLoraUpdate`, a grouped (segment) matmul in torch (CUDA, no compiler, the reference).
Rows of the base model (slot -1) cost nothing.

The factors of a slot are zero-padded to the pool's rank, and a merged projection (q|k|v,
gate|up) stacks its parts' A along the rank and lays their B block-diagonally, so one shrink
and one expand serve all of its parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from appliance.layers.linear import MatmulWeight
from appliance.layers.matmul import Matmul, reference_quant_matmul

# Up to this many slots, a step whose rows run several adapters computes every slot's update
# and masks each row's own (DenseLora): 3 ops a linear instead of 4 a slot. Measured on a
# 2-core Sapphire Rapids (AMX), bf16, 64 rows over 4 slots of width 48 into 960 outputs:
# 113 us against 418 us for the per-slot segment loop. The flops grow with the slot count, so
# larger pools keep the segment loop.
DENSE_MAX_SLOTS = 8


class LoraBatch:
    """Which rows of the current forward run which adapter slot, shared by every LoRA linear
    of a model (the runner's slot pool sets it each step).

    `groups`: (slot, row indices, or None for every row); empty when no row runs an adapter.
    `slot_of_row`: the slot of each row (-1: the base model), for the dense path's masks."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.groups: list[tuple[int, torch.Tensor | None]] = []
        self.slot_of_row: torch.Tensor | None = None
        # Every row's slot as int32 (-1: the base model), for native kernels; None when no
        # row runs an adapter.
        self.slot_ids: torch.Tensor | None = None
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def set_rows(self, slots: list[int], device: torch.device) -> None:
        """One slot per row (-1: the base model): the groups for the next forwards."""
        self._masks = {}
        used = sorted({s for s in slots if s >= 0})
        self.slot_of_row = None
        self.slot_ids = torch.tensor(slots, dtype=torch.int32) if used else None
        if not used:
            self.groups = []
        elif len(used) == 1 and all(s == used[0] for s in slots):
            self.groups = [(used[0], None)]
        else:
            rows = torch.tensor(slots, device=device)
            self.slot_of_row = rows
            self.groups = [(s, (rows == s).nonzero().view(-1)) for s in used]

    @property
    def active(self) -> bool:
        return bool(self.groups)

    @property
    def dense(self) -> bool:
        """Several adapters in the step and a small pool: the masked all-slot path."""
        return len(self.groups) > 1 and self.num_slots <= DENSE_MAX_SLOTS

    def mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """(rows, slots * width): 1 where a column belongs to the row's own slot, built once
        per step and width."""
        key = (width, dtype)
        mask = self._masks.get(key)
        if mask is None:
            assert self.slot_of_row is not None
            slots = torch.arange(self.num_slots, device=self.slot_of_row.device)
            onehot = (self.slot_of_row.view(-1, 1) == slots.view(1, -1)).to(dtype)
            mask = self._masks[key] = onehot.repeat_interleave(width, dim=1)
        return mask


class ReferenceMatmul:
    """The torch reference of an unwired linear (MatmulWeight._matmul's own fallback), as a
    strategy LoraMatmul can wrap."""

    copy: torch.Tensor | None = None
    prepacked = False

    def __init__(self, module: MatmulWeight) -> None:
        self.module = module

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        quant = self.module.quant
        if quant is not None:
            return reference_quant_matmul(x, quant, bias)
        return F.linear(x, self.module.weight, bias)


class SlotCopy(Protocol):
    """A backend's own copy of a linear's factors in another layout (the CPU's AMX tiles:
    appliance.cpu.lora_tiles), `a` and `b` its flat tensors; the pool refills a slot of it
    whenever it has written that slot of the factors."""

    a: torch.Tensor
    b: torch.Tensor

    def refill(self, slot: int) -> None: ...


@dataclass
class LoraFactors:
    """One targeted linear's slot factors on the device (this rank's shards). `a`:
    (slots * width, in_features), slot s's rows at s * width; `b_t`: (slots * width,
    out_features), B transposed so that a slot's factor rows are contiguous, the adapter's
    scaling folded in. `parts`: each part's (first output column, output columns), part p
    owning factor rows [p * rank, (p + 1) * rank) of its slot (B is block-diagonal). `tiles`:
    the backend's copy of them for its tile update, where it keeps one."""

    a: torch.Tensor
    b_t: torch.Tensor
    rank: int
    parts: list[tuple[int, int]]
    tiles: SlotCopy | None = None

    @property
    def width(self) -> int:
        return self.rank * len(self.parts)


@dataclass
class LoraLayerFactors:
    """One decoder layer's targeted linears' slot factors, for a forward that adds the updates
    itself rather than through each linear's LoraMatmul (the CPU's fused native decode:
    appliance.cpu.fused_lora)."""

    qkv: LoraFactors
    o: LoraFactors
    gate_up: LoraFactors
    down: LoraFactors


class LoraUpdate(Protocol):
    def __call__(
        self, out: torch.Tensor, x: torch.Tensor, factors: LoraFactors, batch: LoraBatch
    ) -> torch.Tensor:
        """out plus each row's update (in place where it can), for a step with adapter rows."""
        ...


class TorchLoraUpdate:
    """The update in torch: several adapters over a small pool compute every slot's shrink and
    mask each row's own (DenseLora); otherwise one shrink and one expand per slot's rows."""

    def __call__(
        self, out: torch.Tensor, x: torch.Tensor, factors: LoraFactors, batch: LoraBatch
    ) -> torch.Tensor:
        a, b_t, w = factors.a, factors.b_t, factors.width
        xs = x.to(a.dtype)
        if batch.dense:
            shrunk = F.linear(xs, a).mul_(batch.mask(w, xs.dtype))
            return out.add_((shrunk @ b_t).to(out.dtype))
        for slot, rows in batch.groups:
            a_s, b_s = a[slot * w : (slot + 1) * w], b_t[slot * w : (slot + 1) * w]
            if rows is None:
                out.add_((F.linear(xs, a_s) @ b_s).to(out.dtype))
            else:
                delta = F.linear(xs.index_select(0, rows), a_s) @ b_s
                out.index_add_(0, rows, delta.to(out.dtype))
        return out


class LoraMatmul:
    """`inner` plus the rows' low-rank updates of `factors`, by `update`."""

    def __init__(
        self, inner: Matmul, factors: LoraFactors, batch: LoraBatch, update: LoraUpdate
    ) -> None:
        self.inner = inner
        self.factors = factors
        self.batch = batch
        self.update = update

    @property
    def copy(self) -> torch.Tensor | None:
        return self.inner.copy

    @property
    def prepacked(self) -> bool:
        return self.inner.prepacked

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = self.inner(x, bias)
        if not self.batch.groups:
            return out
        return self.update(out, x, self.factors, self.batch)

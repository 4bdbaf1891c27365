"""LoRA on a linear: a matmul strategy (appliance.layers.matmul's protocol) that runs the base
strategy it wraps, then adds each row's low-rank update x A^T B^T from the adapter slot that
row runs under. Rows are grouped by slot once per step (`LoraBatch`, which the runner's slot
pool fills: appliance.engine.lora_pool), and each group is one shrink and one expand matmul
over the slot's stacked factors: a grouped (segment) matmul in torch. Rows of the base model
(slot -1) belong to no group and cost nothing.

The factors of a slot are zero-padded to the pool's rank, and a merged projection (q|k|v,
gate|up) stacks its parts' A along the rank and lays their B block-diagonally, so one shrink
and one expand serve all of its parts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from appliance.layers.linear import MatmulWeight
from appliance.layers.matmul import Matmul, reference_quant_matmul


class LoraBatch:
    """Which rows of the current forward run which adapter slot, shared by every LoRA linear
    of a model. `groups`: (slot, row indices or None for every row); empty: no adapter rows."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor | None]] = []

    def set_rows(self, slots: list[int], device: torch.device) -> None:
        """One slot per row (-1: the base model): the groups for the next forwards."""
        used = sorted({s for s in slots if s >= 0})
        if not used:
            self.groups = []
        elif len(used) == 1 and all(s == used[0] for s in slots):
            self.groups = [(used[0], None)]
        else:
            rows = torch.tensor(slots, device=device)
            self.groups = [(s, (rows == s).nonzero().view(-1)) for s in used]

    @property
    def active(self) -> bool:
        return bool(self.groups)


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


class LoraMatmul:
    """`inner` plus the rows' low-rank updates. `a`: (slots, rank, in_features); `b`: (slots,
    out_features, rank), the adapter's scaling folded in (both this rank's shards)."""

    def __init__(self, inner: Matmul, a: torch.Tensor, b: torch.Tensor, batch: LoraBatch) -> None:
        self.inner = inner
        self.a = a
        self.b = b
        self.batch = batch

    @property
    def copy(self) -> torch.Tensor | None:
        return self.inner.copy

    @property
    def prepacked(self) -> bool:
        return self.inner.prepacked

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = self.inner(x, bias)
        for slot, rows in self.batch.groups:
            a, b = self.a[slot], self.b[slot]
            if rows is None:
                out.add_(F.linear(F.linear(x.to(a.dtype), a), b).to(out.dtype))
            else:
                delta = F.linear(F.linear(x.index_select(0, rows).to(a.dtype), a), b)
                out.index_add_(0, rows, delta.to(out.dtype))
        return out

"""The LoRA slot pool on the device: `lora.max_loras` slots of stacked A/B factors per targeted
linear (q|k|v, o, gate|up, down of every layer), zero-padded to `lora.max_lora_rank`, and the
adapters read from disk (host copies, float32) that the slots are filled from.

Built once at load, after the backend has wired each linear's matmul: each targeted linear is
re-wired to a LoraMatmul (appliance.layers.lora) around that strategy, with the LoRA update the
backend chose for it (`make_update`: the CPU's native kernel, or torch). Each step the runner
hands over its batch (`begin_step`): an adapter whose slot holds something else is copied in
(the scheduler gave it that slot: core/lora_slots.py), and the rows' slots are grouped for the
forward. The CPU's fused native decode adds the same updates from the same factors itself
(`layer_factors`, bound once by the runner); where it cannot (a packed base's decode), a step
with adapter rows runs the torch forward (the runner asks `begin_step`'s answer).

The factors' tensors are allocated once and filled in place (`_fill` copies into them), so
their addresses never change: the fused decode keeps them.

Tensor parallelism: each rank holds its shard of the factors, cut as the base weights are:
a column-parallel part (q/k/v, gate/up) keeps A whole and its rows of B; a row-parallel
projection (o, down) keeps its columns of A and B whole, and its partial update joins the
base's partial sums before their all-reduce."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from appliance.config import ConfigError, LoraConfig
from appliance.core.scheduler_output import ScheduledRequest
from appliance.layers.linear import MatmulWeight, MergedColumnLinear, RowParallelLinear
from appliance.layers.lora import (
    LoraBatch,
    LoraFactors,
    LoraLayerFactors,
    LoraMatmul,
    LoraUpdate,
    ReferenceMatmul,
    SlotCopy,
    TorchLoraUpdate,
)
from appliance.layers.parallel import tp_rank
from appliance.models.args import ModelArgs
from appliance.models.llama import LlamaForCausalLM
from appliance.models.peft_adapter import AdapterError, LoraAdapter, read_adapter

# Each merged linear's parts, as PEFT names the projections.
_PARTS = {
    "qkv_proj": {"q": "q_proj", "k": "k_proj", "v": "v_proj"},
    "gate_up_proj": {"gate": "gate_proj", "up": "up_proj"},
}


@dataclass
class _Target:
    layer: int
    linear: MatmulWeight
    # (PEFT projection name, output row offset, rows on this rank, shard index): the parts of a
    # merged linear; one entry (offset 0, shard -1) for a row-parallel one.
    parts: list[tuple[str, int, int, int]]
    a: torch.Tensor
    # B transposed: (slots * width, out features on this rank).
    b_t: torch.Tensor
    row_parallel: bool
    factors: LoraFactors


# (a linear's factors, slots) -> how it adds its rows' updates: the backend's `lora_update`.
UpdateFactory = Callable[[LoraFactors, int], LoraUpdate]
# (a linear's factors, slots) -> the backend's own copy of them, or None: its `lora_tiles`.
CopyFactory = Callable[[LoraFactors, int], SlotCopy | None]


def torch_update(factors: LoraFactors, slots: int) -> LoraUpdate:
    return TorchLoraUpdate()


def no_copy(factors: LoraFactors, slots: int) -> SlotCopy | None:
    return None


class LoraSlotPool:
    def __init__(
        self,
        config: LoraConfig,
        model: LlamaForCausalLM,
        dtype: torch.dtype,
        device: torch.device,
        make_update: UpdateFactory = torch_update,
        make_copy: CopyFactory = no_copy,
    ) -> None:
        self.config = config
        self.make_update = make_update
        self.make_copy = make_copy
        self.args: ModelArgs = model.args
        self.max_rank = config.max_lora_rank
        self.device = device
        self.batch = LoraBatch(config.max_loras)
        self.adapters: dict[str, LoraAdapter] = {}
        # Adapters being unloaded: no new request may name them (engine/lora_admin.py).
        self.draining: set[str] = set()
        # What each slot holds now (the scheduler's table says what it should hold).
        self.slot_names: list[str | None] = [None] * config.max_loras
        self.targets: list[_Target] = []
        slots, rank = config.max_loras, self.max_rank
        for index, layer in enumerate(model.model.layers):
            for merged in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
                names = _PARTS["qkv_proj" if merged is layer.self_attn.qkv_proj else "gate_up_proj"]
                parts = [
                    (names[p], merged.offsets[p][0], merged.offsets[p][1], merged.shard_index[p])
                    for p, _, _ in merged.parts
                ]
                # From the model's shape, not the weight's: a backend may have released it.
                shape = (self.args.hidden_size, merged.out_features, slots, rank)
                self._add(index, merged, parts, shape, False, dtype)
            for name, row in (
                ("o_proj", layer.self_attn.o_proj),
                ("down_proj", layer.mlp.down_proj),
            ):
                hidden = self.args.hidden_size
                shape = (row.in_per_rank, hidden, slots, rank)
                self._add(index, row, [(name, 0, hidden, -1)], shape, True, dtype)

    def _add(
        self,
        layer: int,
        linear: MergedColumnLinear | RowParallelLinear,
        parts: list[tuple[str, int, int, int]],
        shape: tuple[int, int, int, int],
        row_parallel: bool,
        dtype: torch.dtype,
    ) -> None:
        """Wire one linear: `shape` is (in_features, out_features on this rank, slots, rank)."""
        in_f, out_f, slots, rank = shape
        width = rank * len(parts)
        a = torch.zeros(slots * width, in_f, dtype=dtype, device=self.device)
        b_t = torch.zeros(slots * width, out_f, dtype=dtype, device=self.device)
        inner = linear.matmul if linear.matmul is not None else ReferenceMatmul(linear)
        factors = LoraFactors(a, b_t, rank, [(offset, rows) for _, offset, rows, _ in parts])
        factors.tiles = self.make_copy(factors, slots)
        update = self.make_update(factors, slots)
        linear.wire(LoraMatmul(inner, factors, self.batch, update))
        self.targets.append(_Target(layer, linear, parts, a, b_t, row_parallel, factors))

    def layer_factors(self) -> list[LoraLayerFactors]:
        """Every layer's four targeted linears' factors, in layer order (the fused decode's)."""
        by_part = {(t.layer, t.parts[0][0]): t.factors for t in self.targets}
        return [
            LoraLayerFactors(
                qkv=by_part[(layer, "q_proj")],
                o=by_part[(layer, "o_proj")],
                gate_up=by_part[(layer, "gate_proj")],
                down=by_part[(layer, "down_proj")],
            )
            for layer in range(self.args.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        """Device bytes of the slot pool (what `appliance plan` counts)."""
        total = 0
        for t in self.targets:
            total += t.a.numel() * t.a.element_size() + t.b_t.numel() * t.b_t.element_size()
            tiles = t.factors.tiles
            if tiles is not None:
                total += tiles.a.numel() * tiles.a.element_size()
                total += tiles.b.numel() * tiles.b.element_size()
        return total

    # -- adapters on the host --------------------------------------------------------------------
    def read(self, name: str, path: str) -> LoraAdapter:
        """Read and check an adapter against this model (AdapterError names the field)."""
        return read_adapter(name, path, self.args, self.max_rank)

    def add(self, adapter: LoraAdapter) -> None:
        """Keep an adapter on the host; it reaches a slot when a request needs it."""
        self.adapters[adapter.name] = adapter
        for slot, held in enumerate(self.slot_names):
            if held == adapter.name:  # new factors under the old name: refill on next use
                self.slot_names[slot] = None

    def place(self, adapter: LoraAdapter, slot: int) -> None:
        """Keep an adapter and fill `slot` with it now (a run-time load: the scheduler gave it
        that slot; engine/lora_ranks.py does this on every rank)."""
        self.add(adapter)
        # Marked empty first: a fill that stops half way leaves a slot no step will trust.
        self.slot_names[slot] = None
        self._fill(slot, adapter)

    def unload(self, name: str) -> None:
        self.adapters.pop(name, None)
        self.draining.discard(name)
        for slot, held in enumerate(self.slot_names):
            if held == name:
                self.slot_names[slot] = None

    # -- each step -------------------------------------------------------------------------------
    def begin_step(self, batch: Sequence[ScheduledRequest]) -> bool:
        """Fill the slots the batch names and group its rows (in batch order, each request's
        tokens in a row each); True when any row runs an adapter."""
        slots: list[int] = []
        for r in batch:
            if r.lora_slot >= 0 and self.slot_names[r.lora_slot] != r.lora_name:
                self._fill(r.lora_slot, self.adapters[r.lora_name])
            slots.extend([r.lora_slot] * len(r.token_ids))
        self.batch.set_rows(slots, self.device)
        return self.batch.active

    def _fill(self, slot: int, adapter: LoraAdapter) -> None:
        rank = self.max_rank
        for t in self.targets:
            base = slot * rank * len(t.parts)
            t.a[base : base + rank * len(t.parts)].zero_()
            t.b_t[base : base + rank * len(t.parts)].zero_()
            for i, (name, offset, rows, shard) in enumerate(t.parts):
                factors = adapter.modules.get((t.layer, name))
                if factors is None:
                    continue
                a, b, r = factors.a, factors.b, factors.rank
                if t.row_parallel:
                    cols = t.a.shape[1]
                    a = a.narrow(1, tp_rank() * cols, cols)
                else:
                    b = b.narrow(0, shard * rows, rows)
                lo = base + i * rank
                t.a[lo : lo + r].copy_(a)
                t.b_t[lo : lo + r, offset : offset + rows].copy_(b.t())
            if t.factors.tiles is not None:
                t.factors.tiles.refill(slot)
        self.slot_names[slot] = adapter.name


def make_lora_pool(
    config: LoraConfig,
    model: LlamaForCausalLM,
    dtype: torch.dtype,
    device: torch.device,
    make_update: UpdateFactory = torch_update,
    make_copy: CopyFactory = no_copy,
) -> LoraSlotPool | None:
    """The slot pool with the template's adapters read, or None when LoRA is off."""
    if not config.active:
        return None
    pool = LoraSlotPool(config, model, dtype, device, make_update, make_copy)
    for name, path in config.adapters.items():
        try:
            pool.add(pool.read(name, path))
        except AdapterError as exc:
            raise ConfigError(f"lora.adapters.{name}: {exc}") from None
    return pool

"""The CUDA backend's LoRA update (appliance.layers.lora's LoraUpdate): Triton's segment shrink
and expand (kernels/triton_lora.py), two launches a LoRA linear whatever the mix of adapters
and base rows, the update added into the base output in place.

The rows are grouped by slot once per step, not once per linear: every linear's update shares
one `SegmentCache`, which regroups when the batch's slot ids are a new tensor (the slot pool
sets a new one each step: LoraBatch.set_rows). Chosen once at load by
CudaBackend.lora_update where Triton imports; TorchLoraUpdate stays the reference and the
fallback."""

from __future__ import annotations

import torch

from appliance.kernels.triton_lora import SlotSegments, lora_expand, lora_shrink, slot_segments
from appliance.layers.lora import LoraBatch, LoraFactors, TorchLoraUpdate


class SegmentCache:
    """The current step's segments, keyed by the slot-ids tensor they were grouped from."""

    def __init__(self) -> None:
        self._ids: torch.Tensor | None = None
        self._segments: SlotSegments | None = None

    def segments(self, slot_ids: torch.Tensor, device: torch.device) -> SlotSegments:
        # Held by reference, not id(): a freed tensor's id can come back next step.
        if self._segments is None or self._ids is not slot_ids:
            self._segments = slot_segments(slot_ids, device)
            self._ids = slot_ids
        return self._segments


class TritonLoraUpdate:
    """The kernels over a base output they can write in place (unit column stride, rows
    flattenable without a copy: every linear's in this model); torch's update otherwise."""

    def __init__(self, cache: SegmentCache) -> None:
        self.cache = cache
        self.torch_update = TorchLoraUpdate()

    def __call__(
        self, out: torch.Tensor, x: torch.Tensor, factors: LoraFactors, batch: LoraBatch
    ) -> torch.Tensor:
        assert batch.slot_ids is not None  # LoraMatmul calls only for a step with adapter rows
        if out.stride(-1) != 1 or (out.dim() > 2 and not out.is_contiguous()):
            return self.torch_update(out, x, factors, batch)
        segments = self.cache.segments(batch.slot_ids, out.device)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        out2 = out.view(-1, out.shape[-1])
        t = lora_shrink(x2, factors.a, segments, factors.width)
        lora_expand(out2, t, factors.b_t, segments, factors.width)
        return out

"""The CPU backend's LoRA update (appliance.layers.lora's LoraUpdate): one native call a LoRA
linear a forward (kernels/cpu_lora.c) that shrinks and expands every adapter row of the batch
by its own slot's factors, straight into the base output. Torch's shrink, mask and expand
cost ~100 us a linear on two cores in op calls and thread wake-ups, 120 linears a step for
SmolLM2 (docs/benchmarks.md); the kernel does the same arithmetic in one call.

Chosen once at load by CpuBackend.lora_update where the native kernels are on and built and
the factors are bf16 or float32 (on AMX tiles where the factors have their tile copy:
CpuBackend.lora_tiles); a pass whose activations are of another dtype or laid out
with strided columns (none in this model's forward) takes the torch update instead."""

from __future__ import annotations

import torch

from appliance.kernels.cpu_features import CpuFeatures
from appliance.kernels.cpu_lora import LoraKernel
from appliance.layers.lora import LoraBatch, LoraFactors, TorchLoraUpdate


class NativeLoraUpdate:
    def __init__(self, factors: LoraFactors, slots: int, features: CpuFeatures) -> None:
        copy = factors.tiles
        self.kernel = LoraKernel(
            factors.a,
            factors.b_t,
            factors.parts,
            factors.rank,
            slots,
            features,
            tiles=(copy.a, copy.b) if copy is not None else None,
        )
        self.torch_update = TorchLoraUpdate()

    def __call__(
        self, out: torch.Tensor, x: torch.Tensor, factors: LoraFactors, batch: LoraBatch
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        out2 = out.view(-1, out.shape[-1])
        dtype = self.kernel.dtype
        if (
            batch.slot_ids is None
            or x2.dtype != dtype
            or out2.dtype != dtype
            or x2.stride(1) != 1
            or out2.stride(1) != 1
        ):
            return self.torch_update(out, x, factors, batch)
        self.kernel(out2, x2, batch.slot_ids)
        return out

"""The device seam: one backend per engine, chosen once at load (`make_backend`), asked for
everything that differs between devices: the dtypes, where packed weights live, how each
linear's matmul, its LoRA update and each layer's attention run, how many KV blocks fit, the fused decode where
there is one, and what to report. The loader and the runner hold no device branch beyond it.

Implementations: appliance.cpu.backend.CpuBackend (x86 CPUs: oneDNN matmuls, native C
kernels), appliance.engine.cuda_backend.CudaBackend (NVIDIA GPUs: Triton kernels).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from appliance.config import ApplianceConfig, ConfigError
from appliance.engine.model_runner import ForwardHooks
from appliance.layers.kv_cache import KVStorage, LayerCache
from appliance.layers.lora import LoraFactors, LoraUpdate, SlotCopy
from appliance.layers.parallel import tp_rank
from appliance.models.args import ModelArgs
from appliance.models.llama import LlamaForCausalLM


class Backend(ForwardHooks, Protocol):
    """One device's answers (module docstring)."""

    device: torch.device
    # The weights' storage dtype, the dtype activations and batched matmuls compute in, and the
    # KV cache's 16-bit storage dtype.
    weight_dtype: torch.dtype
    compute_dtype: torch.dtype
    kv_dtype: torch.dtype
    # Whether the host swap pool is pinned (page-locked: faster copies to a GPU).
    pin_host_memory: bool

    def summary(self) -> str:
        """One line for the start-up log."""
        ...

    def describe(self) -> dict[str, Any]:
        """The decisions, for /admin/stats and the benches."""
        ...

    def check_weights_fit(self, model: LlamaForCausalLM, hf_config: Any, packed_bytes: int) -> None:
        """Before the weights are allocated (the model is on the meta device): refuse with a
        message naming the numbers when they cannot fit."""
        ...

    def place_packed(self, model: LlamaForCausalLM) -> None:
        """Move the packed weights the checkpoint readers built on the CPU to where the kernels
        read them."""
        ...

    def prepare_model(self, model: LlamaForCausalLM, batch_hint: int) -> None:
        """After the weights are loaded: each linear's matmul, the element-wise ops, each
        attention layer's device pair (KV quantization then composes over it)."""
        ...

    def kv_blocks(
        self,
        model: LlamaForCausalLM,
        args: ModelArgs,
        storage: KVStorage,
        max_model_len: int,
        block_bytes: int,
    ) -> tuple[int, str]:
        """How many KV blocks the memory settings allow, and how that was reckoned ("" where
        it is one line of config)."""
        ...

    def cache_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One of the KV pool's tensors, zeroed, where the attention reads it best."""
        ...

    def wire(self, model: LlamaForCausalLM, caches: list[LayerCache], block_size: int) -> None:
        """With the KV cache allocated: whatever reads it in place (the fused decode)."""
        ...

    def warm(self, model: LlamaForCausalLM) -> None:
        """Load-time warm-up, after `wire`."""
        ...

    def lora_update(self, factors: LoraFactors, slots: int) -> LoraUpdate:
        """How one LoRA linear adds its rows' low-rank updates (appliance.layers.lora)."""
        ...

    def lora_tiles(self, factors: LoraFactors, slots: int) -> SlotCopy | None:
        """The backend's own copy of a LoRA linear's factors for its update, kept up to date
        by the slot pool; None where it reads the factors themselves."""
        ...


def device_type(config: ApplianceConfig) -> str:
    """The one device decision: "cuda" where asked for (or "auto" and a GPU is visible), else
    "cpu". The tensor-parallel executor asks it too (NCCL or gloo)."""
    wanted = config.hardware.device
    if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("hardware.device: 'cuda' asked for but no CUDA device is visible")
        return "cuda"
    return "cpu"


def make_backend(config: ApplianceConfig, args: ModelArgs) -> Backend:
    """This rank's backend for `device_type(config)`."""
    if device_type(config) == "cuda":
        from appliance.engine.cuda_backend import CudaBackend

        # One GPU per tensor-parallel rank; set_device makes NCCL and the kernels use it.
        device = torch.device("cuda", tp_rank())
        torch.cuda.set_device(device)
        return CudaBackend(config, device)
    from appliance.cpu.backend import CpuBackend

    return CpuBackend.create(config, args.num_heads, args.num_kv_heads)

"""The CUDA backend: 16-bit weights (bfloat16 unless model.dtype says otherwise), Triton
attention over the paged cache, Triton's dequantizing GEMV/GEMM for packed weights, torch
element-wise ops; the KV pool gets what the profiled forward leaves of
gpu_memory_utilization (engine/memory.py). Nothing here runs until a GPU is visible: the GPU
check (docs/gpu-check.md) is what exercises it."""

from __future__ import annotations

import importlib.util
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

from appliance.config import ApplianceConfig
from appliance.engine import memory
from appliance.engine.model_runner import FusedDecode
from appliance.layers.attention import PlainKV
from appliance.layers.kv_cache import KVStorage, LayerCache
from appliance.layers.lora import LoraFactors, LoraUpdate, SlotCopy, TorchLoraUpdate
from appliance.layers.matmul import PackedMatmul
from appliance.layers.ops import LayerOps
from appliance.models.args import ModelArgs
from appliance.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from appliance.engine.cuda_lora import SegmentCache

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class CudaBackend:
    pin_host_memory = True
    fused_decode: FusedDecode | None = None

    def __init__(self, config: ApplianceConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        dtype = torch.bfloat16 if config.model.dtype == "auto" else DTYPES[config.model.dtype]
        self.weight_dtype = self.compute_dtype = self.kv_dtype = dtype
        # Device bytes in use before the weights were loaded (check_weights_fit): the KV
        # plan's baseline for memory outside torch.
        self.used_before = 0
        # The step's rows grouped by adapter slot, shared by every LoRA linear's update.
        self.lora_segments: SegmentCache | None = None

    def summary(self) -> str:
        name = torch.cuda.get_device_name(self.device)
        dtype = str(self.weight_dtype).removeprefix("torch.")
        return f"CUDA {self.device} ({name}): weights {dtype}; Triton attention and packed matmuls"

    def describe(self) -> dict[str, Any]:
        return {
            "device": str(self.device),
            "gpu": torch.cuda.get_device_name(self.device),
            "weight_dtype": str(self.weight_dtype).removeprefix("torch."),
            "attention": "triton",
            "packed_matmul": "triton",
            "lora": "triton" if importlib.util.find_spec("triton") is not None else "torch",
        }

    def check_weights_fit(self, model: LlamaForCausalLM, hf_config: Any, packed_bytes: int) -> None:
        self.used_before = memory.check_weights_fit(
            model, self.weight_dtype, self.device, self.config, hf_config, extra_bytes=packed_bytes
        )

    def place_packed(self, model: LlamaForCausalLM) -> None:
        for module in model.linears():
            if "weight" in module._parameters and module.quant is not None:
                module.quant = module.quant.to(self.device)
        embed = model.model.embed_tokens
        if embed.quant is not None:
            embed.quant = embed.quant.to(self.device)

    def prepare_model(self, model: LlamaForCausalLM, batch_hint: int) -> None:
        # Imported here: importing triton needs a GPU-capable install (the CPU boxes never do).
        from appliance.kernels.triton_attention import TRITON_ATTENTION
        from appliance.kernels.triton_quant import quant_matmul_triton

        for module in model.linears():
            if module.quant is not None:
                module.wire(PackedMatmul(quant_matmul_triton, module.quant))
        model.wire(LayerOps())
        for attn in model.attention_layers():
            attn.wire(PlainKV(TRITON_ATTENTION))

    def kv_blocks(
        self,
        model: LlamaForCausalLM,
        args: ModelArgs,
        storage: KVStorage,
        max_model_len: int,
        block_bytes: int,
    ) -> tuple[int, str]:
        plan = memory.plan_gpu_kv(
            model,
            args,
            self.config,
            self.device,
            storage,
            max_model_len,
            block_bytes,
            self.used_before,
        )
        return plan.num_blocks, plan.describe()

    def cache_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def wire(self, model: LlamaForCausalLM, caches: list[LayerCache], block_size: int) -> None:
        """No fused decode on CUDA: every step runs the model's forward."""

    def warm(self, model: LlamaForCausalLM) -> None:
        """Triton compiles each kernel at its first call; nothing to fill ahead."""

    def fused_max_batch(self) -> int:
        return 0

    def fused_prompt_rows(self) -> int:
        return 0

    def lora_tiles(self, factors: LoraFactors, slots: int) -> SlotCopy | None:
        """None: Triton reads the factors themselves."""
        return None

    def lora_update(self, factors: LoraFactors, slots: int) -> LoraUpdate:
        """Triton's segment shrink and expand (appliance.engine.cuda_lora), every linear
        sharing one grouping of the step's rows; torch's grouped matmuls (cuBLAS) where
        Triton is absent."""
        if importlib.util.find_spec("triton") is None:
            return TorchLoraUpdate()
        from appliance.engine.cuda_lora import SegmentCache, TritonLoraUpdate

        if self.lora_segments is None:
            self.lora_segments = SegmentCache()
        return TritonLoraUpdate(self.lora_segments)

    def matmuls(self, rows: int) -> AbstractContextManager[None]:
        return nullcontext()

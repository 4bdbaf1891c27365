"""The CPU backend (engine/backend.py's Backend on x86 CPUs): carries out the plan
(appliance.cpu.plan) on the model: `prepare_model` (dtypes of the small parameters, one matmul
strategy per linear, the element-wise ops, the attention pair) before the KV cache is sized,
`wire` (the fused decode over the allocated cache) after.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from appliance.config import ApplianceConfig
from appliance.cpu.attention import cpu_attention
from appliance.cpu.choice import (
    BF16_FUSED_MAX,
    BF16_PROMPT_ROWS,
    QUANT_COPY_FUSED_MAX,
    QUANT_COPY_PROMPT_ROWS,
    QUANT_PROMPT_ROWS,
    TILE_ISA_NAMES,
)
from appliance.cpu.fused_decode import FusedCpuDecode
from appliance.cpu.huge_pages import zeros_on_huge_pages
from appliance.cpu.ops import NativeCpuOps
from appliance.cpu.plan import (
    BF16_GEMV_MAX_ROWS,
    TILED_FUSED_MAX,
    CpuPlan,
    plan_cpu,
)
from appliance.cpu.primitive_cache import bound_primitive_caches, warm_primitive_caches
from appliance.cpu.tile_weights import TileDecodeWeights
from appliance.kernels import cpu_native
from appliance.layers.attention import PlainKV
from appliance.layers.kv_cache import KVStorage, LayerCache
from appliance.layers.linear import MatmulWeight
from appliance.layers.lora import LoraFactors, LoraUpdate, SlotCopy, TorchLoraUpdate
from appliance.layers.matmul import (
    CopyMatmul,
    Matmul,
    PackedMatmul,
    QuantMatmul,
    reference_quant_matmul,
)
from appliance.layers.norm import RMSNorm
from appliance.layers.ops import LayerOps
from appliance.models.args import ModelArgs
from appliance.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from appliance.cpu.quant_decode import QuantFusedCpuDecode

log = logging.getLogger("appliance.cpu")

GiB = 1024**3


def _is_quantized(model: LlamaForCausalLM) -> bool:
    return any(m.quant is not None for m in model.linears())


class CpuBackend:
    pin_host_memory = False

    def __init__(self, plan: CpuPlan, act8: bool = False, kv_cache_memory: float = 0.0) -> None:
        self.plan = plan
        self.device = torch.device("cpu")
        # Whether lora_tiles has logged why the factors stay off the tiles (once a load).
        self._lora_tiles_refused = False
        self.weight_dtype = plan.weight_dtype
        self.compute_dtype = plan.compute_dtype
        self.kv_dtype = plan.kv_dtype
        # Packed weights' native dot products take int8 activations (cpu_quant_activations).
        self.act8 = act8
        # cache.kv_cache_memory: the KV pool's GiB (a CPU has no device memory to measure).
        self.kv_cache_memory = kv_cache_memory
        self.fused_decode: FusedCpuDecode | QuantFusedCpuDecode | None = None
        # A dense bf16 model on AMX or AVX-512-BF16: the tile-packed matrices the native decode
        # reads.
        self.tile_weights: TileDecodeWeights | None = None
        # oneDNN's and ideep's primitive cache capacities in force, and the load-time warm-up.
        self.primitive_caches: dict[str, str] = {}
        self.warm_matmuls = 0

    @classmethod
    def create(cls, config: ApplianceConfig, num_heads: int, num_kv_heads: int) -> CpuBackend:
        # Before any oneDNN primitive exists (the weights' reorder is the first): both caches
        # read their capacity once, at their first use.
        caches = bound_primitive_caches(config.hardware.onednn_cache_capacity)
        plan = plan_cpu(config, num_heads, num_kv_heads)
        log.info(plan.summary())
        for note in plan.notes:
            log.info("CPU backend: %s", note)
        if plan.warning:
            log.warning("%s", plan.warning)
        backend = cls(
            plan,
            act8=config.model.cpu_quant_activations == "int8",
            kv_cache_memory=config.cache.kv_cache_memory,
        )
        backend.primitive_caches = caches
        return backend

    def summary(self) -> str:
        return self.plan.summary()

    def check_weights_fit(self, model: LlamaForCausalLM, hf_config: Any, packed_bytes: int) -> None:
        """Host memory is not budgeted here: `appliance plan` shows what a template takes."""

    def place_packed(self, model: LlamaForCausalLM) -> None:
        """The checkpoint readers build packed weights on the CPU, where the kernels read them."""

    def prepare_model(self, model: LlamaForCausalLM, batch_hint: int) -> None:
        """After the weights are loaded in plan.weight_dtype: the compute dtype of the small
        parameters, one matmul strategy per linear, the element-wise ops and the attention
        kernels."""
        plan = self.plan
        linears = model.linears()
        if plan.compute_dtype != plan.weight_dtype:
            # Norms and biases (a few KB a layer) in the compute dtype, so the float32 forward
            # never mixes dtypes; the matrices stay 16-bit (the matmuls get their own copy).
            for module in model.modules():
                if isinstance(module, RMSNorm):
                    module.weight.data = module.weight.data.to(plan.compute_dtype)
            for linear in linears:
                bias = getattr(linear, "bias", None)
                if bias is not None:
                    bias.data = bias.data.to(plan.compute_dtype)
        # Packed weights: a dense copy for the torch forward on AMX (dequantized before the
        # packed bytes are reordered into row tiles), else the native dequantizing kernels
        # where built (cpu_quant.c), else the torch reference.
        copies: dict[MatmulWeight, Matmul] = {}
        if plan.choice.quant_dense_copy:
            copies = {
                m: self._quant_dense_copy(m, batch_hint) for m in linears if m.quant is not None
            }
        if plan.tile_decode and not _is_quantized(model):
            # Before _dense_matmul releases the row-major matrices this copy replaces.
            self.tile_weights = TileDecodeWeights.from_model(model)
            log.info(
                "native decode on %s: %.1f MB of tile-packed bf16 matrices",
                TILE_ISA_NAMES[plan.tile_decode],
                self.tile_weights.nbytes() / 1e6,
            )
        kernel = self._quant_matmul()
        if self.act8 and kernel is not reference_quant_matmul:
            self._tile_packed(model)
        for linear in linears:
            if linear.quant is not None:
                linear.wire(copies.get(linear) or PackedMatmul(kernel, linear.quant))
                continue
            dense = self._dense_matmul(linear, batch_hint)
            if dense is not None:
                linear.wire(dense)
        model.wire(
            NativeCpuOps(plan.compute_dtype, model.model.rotary)
            if plan.native_ops
            else LayerOps(plan.compute_dtype)
        )
        kernels = cpu_attention(
            native=plan.native_ops, native_prefill=plan.native_prefill_attention
        )
        for attn in model.attention_layers():
            attn.wire(PlainKV(kernels))

    def _tile_packed(self, model: torch.nn.Module) -> None:
        """int8 activations: every packed matrix whose shape allows it in the row-tile order
        (appliance.kernels.quant_weight), which the int8 kernels read 8 rows per instruction.
        The bytes are reordered, not copied: the row-major tensors are released."""
        from appliance.kernels import cpu_quant
        from appliance.layers.embedding import ParallelLMHead, VocabParallelEmbedding

        for module in model.modules():
            # A tied or own LM head reads its embedding's table (tiled as an embedding).
            if not isinstance(module, VocabParallelEmbedding | MatmulWeight):
                continue
            if isinstance(module, ParallelLMHead):
                continue
            if module.quant is not None:
                module.quant = cpu_quant.tiled_for_int8(module.quant, self.plan.features)

    def _quant_matmul(self) -> QuantMatmul:
        from appliance.kernels import cpu_quant

        if self.plan.native_ops and cpu_quant.load(self.plan.features) is not None:
            if self.act8:
                return cpu_quant.quant_matmul_act8
            return cpu_quant.quant_matmul
        return reference_quant_matmul

    def _quant_dense_copy(self, module: MatmulWeight, batch_hint: int) -> Matmul:
        """Packed weights on AMX: a prepacked copy in the compute dtype for the torch forward."""
        assert module.quant is not None and self.plan.prepack
        dense = module.quant.dequantize(self.plan.compute_dtype)
        return CopyMatmul(torch.ops.mkldnn._reorder_linear_weight(dense, batch_hint), True)

    def _dense_matmul(self, module: MatmulWeight, batch_hint: int) -> Matmul | None:
        """A 16-bit/float32 weight: oneDNN's prepacked copy where the plan prepacks, a plain
        copy in the compute dtype where that differs, else None (the weight as it is)."""
        plan = self.plan
        weight = module.weight.detach()
        compute = weight if weight.dtype == plan.compute_dtype else weight.to(plan.compute_dtype)
        if plan.prepack:
            copy, prepacked = torch.ops.mkldnn._reorder_linear_weight(compute, batch_hint), True
        elif compute is not weight:
            copy, prepacked = compute, False
        else:
            return None
        # The plain weight stays where something else reads it: the matrix-vector native decode
        # (every linear; the tile one reads its tile-packed copy) and the embedding lookup (the
        # LM head's weight is the embedding's).
        owns_weight = "weight" in module._parameters
        if owns_weight and (not plan.native_decode or self.tile_weights is not None):
            module.weight.data = torch.empty(0, dtype=weight.dtype)
            return CopyMatmul(copy, prepacked)
        gemv_rows = BF16_GEMV_MAX_ROWS if plan.compute_dtype == torch.bfloat16 and prepacked else 0
        return CopyMatmul(copy, prepacked, module.weight, gemv_rows)

    def kv_blocks(
        self,
        model: LlamaForCausalLM,
        args: ModelArgs,
        storage: KVStorage,
        max_model_len: int,
        block_bytes: int,
    ) -> tuple[int, str]:
        return int(self.kv_cache_memory * GiB // block_bytes), ""

    def cache_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # The decode attention reads the pool's blocks at random: 2 MiB pages, fewer TLB walks.
        return zeros_on_huge_pages(shape, dtype)

    def wire(
        self,
        model: LlamaForCausalLM,
        caches: list[LayerCache],
        block_size: int,
    ) -> None:
        """With the KV cache allocated: the fused decode over it (when the plan has it)."""
        if not all(cache.plain for cache in caches):
            # Heads kept apart and per-token scales live in quantized layers, and the plan has
            # no fused decode for a quantized cache (choice.py): this only guards the kernels'
            # one-cache layout.
            log.info(
                "native fused decode off: some layers keep KV heads in a side cache or "
                "per-token scales"
            )
            return
        pairs = [(cache.k, cache.v) for cache in caches]
        if self.plan.native_decode and _is_quantized(model):
            from appliance.cpu.quant_decode import QuantFusedCpuDecode
            from appliance.kernels import cpu_quant

            qlib = cpu_quant.load(self.plan.features)
            if qlib is not None and QuantFusedCpuDecode.supports(model):
                packed = QuantFusedCpuDecode(
                    model,
                    pairs,
                    block_size,
                    self.plan.weight_dtype,
                    qlib,
                    act8=self.act8,
                )
                self.fused_decode = packed
                if packed.tiled:
                    log.info(
                        "packed weights in row tiles: native decode for steps of up to %d "
                        "sequences",
                        self.fused_max_batch(),
                    )
            else:
                log.info(
                    "packed weights: no fused native decode (%s)",
                    cpu_quant.load_error(self.plan.features) or "some linears are dense",
                )
        elif self.plan.native_decode:
            lib = cpu_native.load(self.plan.features)
            assert lib is not None, "plan_cpu checked that the kernels built"
            self.fused_decode = FusedCpuDecode(
                model,
                pairs,
                block_size,
                self.plan.weight_dtype,
                lib,
                self.tile_weights,
            )

    def warm(self, model: LlamaForCausalLM) -> None:
        """Fill the bounded primitive caches now (appliance.cpu.primitive_cache), with the row
        counts just above what the native decode and ATen's GEMV take: the core's RSS after
        start-up then already holds them. After `wire` (the native decode's limit is known)."""
        first = max(self.fused_max_batch(), BF16_GEMV_MAX_ROWS) + 1
        self.warm_matmuls = warm_primitive_caches(model.modules(), first)
        log.info(
            "matmul primitive caches %s, filled with %d matmuls",
            self.primitive_caches,
            self.warm_matmuls,
        )

    def lora_tiles(self, factors: LoraFactors, slots: int) -> SlotCopy | None:
        """On AMX, with the native kernels on and built for tiles, a tile-packed copy of the
        factors (appliance.cpu.lora_tiles) for the update on tiles, per linear and in the AMX
        decode forward: ~4x faster than the vector update (docs/benchmarks.md). None where the
        rank or dtype does not fit the tiles (logged once)."""
        from appliance.cpu.lora_tiles import LoraTileCopy
        from appliance.kernels import cpu_lora

        if not (self.plan.native_ops and cpu_lora.tiles_ready(self.plan.features)):
            return None
        why_not = LoraTileCopy.fits(factors)
        if why_not is not None:
            if not self._lora_tiles_refused:
                log.info("LoRA on AMX: the vector update, not tiles: %s", why_not)
                self._lora_tiles_refused = True
            return None
        return LoraTileCopy(factors, slots)

    def lora_update(self, factors: LoraFactors, slots: int) -> LoraUpdate:
        """The native kernel (one call a linear: appliance.cpu.lora_update) where the native
        kernels are on and built for the factors' dtype, else torch's grouped matmuls."""
        from appliance.kernels import cpu_lora

        native = self.plan.native_ops and factors.a.dtype in cpu_lora.SUFFIX
        if native and cpu_lora.load(self.plan.features) is not None:
            from appliance.cpu.lora_update import NativeLoraUpdate

            return NativeLoraUpdate(factors, slots, self.plan.features)
        return TorchLoraUpdate()

    def fused_max_batch(self) -> int:
        if self.fused_decode is None:
            return 0
        if getattr(self.fused_decode, "tiled", False):
            if self.plan.choice.quant_dense_copy:
                return QUANT_COPY_FUSED_MAX  # wider steps read the dense copy (AMX)
            return max(self.plan.fused_max_batch, TILED_FUSED_MAX)
        if self.plan.tile_decode and self.tile_weights is None:
            return BF16_FUSED_MAX  # a packed model's decode: no tile forward of its own
        return self.plan.fused_max_batch

    def fused_prompt_rows(self) -> int:
        """Steps with a prompt's chunk take the fused decode up to this many rows in all, by
        the same paths as fused_max_batch (appliance.cpu.choice: TILE_PROMPT_ROWS)."""
        if self.fused_decode is None:
            return 0
        if getattr(self.fused_decode, "tiled", False):
            if self.act8:
                # Rows would round every prompt token's activations to int8, not only the
                # decode tokens': up to 1.7 in a top logprob, enough to turn SmolLM2's "The
                # capital of France is Paris." into "L'Étoile, la Cité..." after a cached
                # prefix. Prompts keep float precision through the torch forward
                # (docs/benchmarks.md, "Sapphire Rapids, Dec 5, noon").
                return 0
            amx_copy = self.plan.choice.quant_dense_copy and self.plan.features.has("amx_bf16")
            return QUANT_COPY_PROMPT_ROWS if amx_copy else QUANT_PROMPT_ROWS
        if self.plan.tile_decode and self.tile_weights is None:
            return BF16_PROMPT_ROWS
        return self.plan.fused_prompt_rows

    @contextmanager
    def matmuls(self, rows: int) -> Iterator[None]:
        """Around a forward over `rows` rows: plain bf16 matmuls of one or two rows go to
        ATen's GEMV, wider ones to oneDNN. The switch is global in torch, so it is restored on
        the way out for whatever runs next (kv-eval and calibration forwards)."""
        if self.plan.compute_dtype != torch.bfloat16:
            yield
            return
        before = torch.backends.mkldnn.enabled
        # torch's stubs type the module flag as its descriptor (ContextProp), not a bool.
        torch.backends.mkldnn.enabled = rows > BF16_GEMV_MAX_ROWS  # type: ignore[assignment]
        try:
            yield
        finally:
            torch.backends.mkldnn.enabled = before

    def describe(self) -> dict[str, Any]:
        info = self.plan.describe()
        info["native_decode_active"] = self.fused_decode is not None
        # What the wired decode takes (0 without one; a packed model's paths differ from
        # the plan's).
        info["fused_decode_max_batch"] = self.fused_max_batch()
        info["fused_prompt_rows"] = self.fused_prompt_rows()
        info["primitive_caches"] = dict(self.primitive_caches)
        info["warm_matmuls"] = self.warm_matmuls
        return info

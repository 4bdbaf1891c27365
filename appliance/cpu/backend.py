"""The CPU backend: what the engine runs on this CPU, decided once at load from what the CPU can
do (appliance.kernels.cpu_features) and the config, then wired into the model and the runner.

The decision (`plan_cpu`, pure):
- dtypes: the weights' and the KV cache's storage dtype, and the dtype activations and the
  batched matmuls compute in. Where bf16 arithmetic is native (AVX-512-BF16, AMX) all three are
  bf16. Where it is not (AVX2, AVX-512 without BF16) oneDNN has no bf16 GEMM and emulates it at
  ~5x the cost of float32 (64 rows x 576x1536 on a Zen 3: 9.0 vs 0.92 ms), so `dtype = "auto"`
  keeps 16-bit weights and KV (the native decode reads half the bytes, converting in registers)
  and computes prefills and wide decode batches in float32 on a float32 copy of the weights.
- matmuls: oneDNN's prepacked layout where oneDNN supports the dtype on this CPU.
- native kernels: built for this CPU (kernels/cpu_native.py); the fused decode for small decode
  steps, native decode attention and element-wise steps elsewhere.

`CpuBackend` carries it out: `prepare_model` (dtypes, matmul weights, ops, attention kernels)
before the KV cache is sized, `wire` (the fused decode over the allocated cache) after.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from appliance.config import ApplianceConfig
from appliance.cpu.attention import cpu_attention
from appliance.cpu.choice import QUANT_COPY_FUSED_MAX, CpuChoice, choose
from appliance.cpu.fused_decode import FusedCpuDecode
from appliance.cpu.primitive_cache import bound_primitive_caches, warm_primitive_caches
from appliance.kernels import cpu_native
from appliance.kernels.cpu_features import CpuFeatures, detect
from appliance.layers.attention import PlainKV
from appliance.layers.kv_cache import LayerCache
from appliance.layers.linear import MatmulWeight, QuantMatmul, reference_quant_matmul
from appliance.layers.norm import RMSNorm
from appliance.layers.ops import LayerOps
from appliance.layers.rotary import RotaryEmbedding
from appliance.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from appliance.cpu.quant_decode import QuantFusedCpuDecode

log = logging.getLogger("appliance.cpu")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Up to this many rows a bf16 pass reads the plain weight through ATen's GEMV, which beats
# oneDNN's bf16 GEMM there (Zen 4, small demo model's 3072x576: 205 vs 310 us at one row, 244
# vs 309 at two; from four rows on oneDNN wins: 465 vs 831 us at eight).
BF16_GEMV_MAX_ROWS = 2
# Decode steps of up to this many sequences take the fused native forward. Its matrix-vector
# loops read each weight row once for the whole batch but are not register-blocked as a GEMM
# is. ms a step of the small demo model, native vs torch:
# - bf16 compute (Zen 4, oneDNN bf16): 9.9 vs 27 (1), 19.6 vs 28.6 (4), 28.1 vs 32.6 (6),
#   35.6 vs 33.2 (8);
# - float32 compute over bf16 weights (Zen 3, AVX2, oneDNN fp32 prepacked, 2 threads, quiet):
#   29.9 vs 66.1 (1), 46.4 vs 96.4 (8), 84.8 vs 118.3 (16), 142.4 vs 180.1 (32),
#   242.7 vs 228.1 (48), 278.8 vs 248.3 (64).
BF16_FUSED_MAX = 6
FP32_FUSED_MAX = 32
# - packed weights in row tiles (int8 activations): both paths run the same tiled kernels, the
#   fused one without torch's per-operator overhead. SmolLM2 Q4_1, continuous 64 x 128/128,
#   1 thread, back to back: 114.9 tok/s with this limit at 64, 79.4 at 32.
TILED_FUSED_MAX = 64


@dataclass
class CpuPlan:
    """The decision (appliance.cpu.choice.CpuChoice, by dtype name) in torch dtypes, with the
    features it was made for and the fused decode's batch limit."""

    features: CpuFeatures
    choice: CpuChoice
    fused_max_batch: int

    @property
    def weight_dtype(self) -> torch.dtype:
        return DTYPES[self.choice.weight]

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.choice.compute]

    @property
    def kv_dtype(self) -> torch.dtype:
        return DTYPES[self.choice.kv]

    @property
    def prepack(self) -> bool:
        """oneDNN-prepacked weights for the batched matmuls (in compute_dtype)."""
        return self.choice.prepack

    @property
    def native_ops(self) -> bool:
        return self.choice.native_ops

    @property
    def native_decode(self) -> bool:
        return self.choice.native_decode

    @property
    def notes(self) -> list[str]:
        """Each choice's reason."""
        return self.choice.notes

    @property
    def warning(self) -> str:
        """Set when the configuration asks for something slow on this CPU (logged)."""
        return self.choice.warning

    @property
    def matmul(self) -> str:
        dtype = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}
        return f"{'oneDNN prepacked' if self.prepack else 'ATen'} {dtype[self.compute_dtype]}"

    @property
    def fp32_weight_copy(self) -> bool:
        """Whether the matmuls read a float32 copy beside the 16-bit weights."""
        return self.compute_dtype != self.weight_dtype

    def describe(self) -> dict[str, Any]:
        return {
            "cpu": self.features.describe(),
            "weight_dtype": str(self.weight_dtype).removeprefix("torch."),
            "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
            "kv_dtype": str(self.kv_dtype).removeprefix("torch."),
            "matmul": self.matmul,
            "fp32_weight_copy": self.fp32_weight_copy,
            "native_ops": self.native_ops,
            "native_decode": self.native_decode,
            "fused_decode_max_batch": self.fused_max_batch if self.native_decode else 0,
            "notes": list(self.notes),
            "warning": self.warning,
        }

    def summary(self) -> str:
        decode = (
            f"native decode for steps of up to {self.fused_max_batch} sequences"
            if self.native_decode
            else "torch decode"
        )
        return (
            f"CPU {self.features.model_name} ({self.features.isa}"
            + (f", masked {','.join(sorted(self.features.masked))}" if self.features.masked else "")
            + f"): weights {str(self.weight_dtype)[6:]}, compute {str(self.compute_dtype)[6:]}, "
            f"KV {str(self.kv_dtype)[6:]}; matmuls {self.matmul}; {decode}"
        )


def plan_cpu(
    config: ApplianceConfig,
    num_heads: int,
    num_kv_heads: int,
    features: CpuFeatures | None = None,
    native_available: bool | None = None,
    native_error: str | None = None,
) -> CpuPlan:
    """The decision (appliance.cpu.choice) in torch dtypes. `native_available` defaults to
    whether the kernels build here."""
    features = features or detect()

    def native_built() -> tuple[bool, str | None]:
        if native_available is not None:
            return native_available, native_error
        return cpu_native.load(features) is not None, cpu_native.load_error(features)

    c = choose(
        config,
        num_heads,
        num_kv_heads,
        features,
        torch.backends.mkldnn.is_available(),
        native_built,
    )
    fused_max = BF16_FUSED_MAX if c.compute == "bfloat16" else FP32_FUSED_MAX
    return CpuPlan(features=features, choice=c, fused_max_batch=fused_max)


class NativeCpuOps(LayerOps):
    """The element-wise steps through kernels/cpu_decode.c (one pass each instead of several
    torch operators)."""

    name = "native-cpu"

    def __init__(self, compute_dtype: torch.dtype, rotary: RotaryEmbedding) -> None:
        super().__init__(compute_dtype)
        # The kernel reads float32 tables and looks the positions up itself.
        self._cos = rotary.cos.float().contiguous()
        self._sin = rotary.sin.float().contiguous()

    def rope(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        return positions

    def rotate_qk(
        self, qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int, rope: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cpu_native.rotary_(qkv, q_heads + kv_heads, head_dim, self._cos, self._sin, rope)
        qk = qkv[:, : (q_heads + kv_heads) * head_dim].view(qkv.shape[0], -1, head_dim)
        q, k = qk.split([q_heads, kv_heads], dim=1)
        return q, k

    def add_rms_norm(
        self, hidden: torch.Tensor, add: torch.Tensor | None, norm: RMSNorm
    ) -> torch.Tensor:
        return cpu_native.add_rms_norm(hidden, add, norm.weight, norm.eps)

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        return cpu_native.silu_mul(gate_up)


def _is_quantized(model: torch.nn.Module) -> bool:
    return any(isinstance(m, MatmulWeight) and m.quant is not None for m in model.modules())


class CpuBackend:
    def __init__(self, plan: CpuPlan, act8: bool = False) -> None:
        self.plan = plan
        # Packed weights' native dot products take int8 activations (cpu_quant_activations).
        self.act8 = act8
        self.fused_decode: FusedCpuDecode | QuantFusedCpuDecode | None = None
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
        backend = cls(plan, act8=config.model.cpu_quant_activations == "int8")
        backend.primitive_caches = caches
        return backend

    def prepare_model(self, model: LlamaForCausalLM, batch_hint: int) -> None:
        """After the weights are loaded in plan.weight_dtype: the compute dtype of the small
        parameters, the matmul weights, the element-wise ops and the attention kernels."""
        plan = self.plan
        if plan.compute_dtype != plan.weight_dtype:
            # Norms and biases (a few KB a layer) in the compute dtype, so the float32 forward
            # never mixes dtypes; the matrices stay 16-bit (the matmuls get their own copy).
            for module in model.modules():
                if isinstance(module, RMSNorm):
                    module.weight.data = module.weight.data.to(plan.compute_dtype)
                bias = getattr(module, "bias", None)
                if isinstance(module, MatmulWeight) and bias is not None:
                    bias.data = bias.data.to(plan.compute_dtype)
        for module in model.modules():
            if isinstance(module, MatmulWeight) and module.quant is not None:
                # Packed weights: the native dequantizing kernels where built (cpu_quant.c),
                # else the torch reference; a dense copy for the torch forward on AMX.
                module.quant_matmul = self._quant_matmul()
                if plan.choice.quant_dense_copy:
                    self._set_quant_dense_copy(module, batch_hint)
            elif isinstance(module, MatmulWeight):
                self._set_matmul_weight(module, batch_hint)
        if self.act8 and self._quant_matmul() is not reference_quant_matmul:
            self._tile_packed(model)
        model.model.embed_tokens.quant_out_dtype = plan.compute_dtype
        rotary = model.model.rotary
        model.set_ops(
            NativeCpuOps(plan.compute_dtype, rotary)
            if plan.native_ops
            else LayerOps(plan.compute_dtype)
        )
        kernels = cpu_attention(native=plan.native_ops)
        for attn in model.attention_layers():
            attn.wire(PlainKV(kernels))

    def _tile_packed(self, model: torch.nn.Module) -> None:
        """int8 activations: every packed matrix whose shape allows it in the row-tile order
        (appliance.kernels.quant_weight), which the int8 kernels read 8 rows per instruction. The
        bytes are reordered, not copied: the row-major tensors are released."""
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

    def _set_quant_dense_copy(self, module: MatmulWeight, batch_hint: int) -> None:
        """Packed weights on AMX: a prepacked copy in the compute dtype for the torch forward
        (dequantized once, before the packed bytes are reordered into row tiles)."""
        assert module.quant is not None and self.plan.prepack
        dense = module.quant.dequantize(self.plan.compute_dtype)
        module.matmul_weight = torch.ops.mkldnn._reorder_linear_weight(dense, batch_hint)
        module.onednn_packed = True

    def _set_matmul_weight(self, module: MatmulWeight, batch_hint: int) -> None:
        plan = self.plan
        weight = module.weight.detach()
        compute = weight if weight.dtype == plan.compute_dtype else weight.to(plan.compute_dtype)
        if plan.prepack:
            module.matmul_weight = torch.ops.mkldnn._reorder_linear_weight(compute, batch_hint)
            module.onednn_packed = True
        elif compute is not weight:
            module.matmul_weight = compute
        if plan.compute_dtype == torch.bfloat16 and plan.prepack:
            module.plain_max_rows = BF16_GEMV_MAX_ROWS
        # The plain weight stays where something else reads it: the native decode (every
        # linear) and the embedding lookup (the LM head's weight is the embedding's).
        owns_weight = "weight" in module._parameters
        if module.matmul_weight is not None and owns_weight and not plan.native_decode:
            module.weight.data = torch.empty(0, dtype=weight.dtype)

    def wire(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[LayerCache],
        block_size: int,
    ) -> None:
        """With the KV cache allocated: the fused decode over it (when the plan has it)."""
        if not all(cache.plain for cache in kv_caches):
            # Heads kept apart and per-token scales live in quantized layers, and the plan has
            # no fused decode for
            # a quantized cache (choice.py): this only guards the kernels' one-cache layout.
            log.info(
                "native fused decode off: some layers keep KV heads in a side cache or "
                "per-token scales"
            )
            return
        pairs = [(cache.k, cache.v) for cache in kv_caches]
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
            )

    def warm(self, model: torch.nn.Module) -> None:
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

    def fused_max_batch(self) -> int:
        if self.fused_decode is None:
            return 0
        if getattr(self.fused_decode, "tiled", False):
            if self.plan.choice.quant_dense_copy:
                return QUANT_COPY_FUSED_MAX  # wider steps read the dense copy (AMX)
            return max(self.plan.fused_max_batch, TILED_FUSED_MAX)
        return self.plan.fused_max_batch

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
        info["primitive_caches"] = dict(self.primitive_caches)
        info["warm_matmuls"] = self.warm_matmuls
        return info

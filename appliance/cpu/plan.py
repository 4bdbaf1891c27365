"""The CPU backend's decision, made once at load from what the CPU can do
(appliance.kernels.cpu_features) and the config (`plan_cpu`, pure; the rules in
appliance.cpu.choice, torch-free for `appliance plan`):
- dtypes: the weights' and the KV cache's storage dtype, and the dtype activations and the
  batched matmuls compute in. Where bf16 arithmetic is native (AVX-512-BF16, AMX) all three are
  bf16. Where it is not (AVX2, AVX-512 without BF16) oneDNN has no bf16 GEMM and emulates it at
  ~5x the cost of float32 (64 rows x 576x1536 on a Zen 3: 9.0 vs 0.92 ms), so `dtype = "auto"`
  keeps 16-bit weights and KV (the native decode reads half the bytes, converting in registers)
  and computes prefills and wide decode batches in float32 on a float32 copy of the weights.
- matmuls: oneDNN's prepacked layout where oneDNN supports the dtype on this CPU.
- native kernels: built for this CPU (kernels/cpu_native.py); the fused decode for small decode
  steps, native decode attention and element-wise steps elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from appliance.config import ApplianceConfig
from appliance.cpu.choice import (
    BF16_FUSED_MAX,
    BF16_PROMPT_ROWS,
    FP32_PROMPT_ROWS,
    TILE_FUSED_MAX,
    TILE_PROMPT_ROWS,
    CpuChoice,
    choose,
)
from appliance.kernels import cpu_native
from appliance.kernels.cpu_features import CpuFeatures, detect

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Up to this many rows a bf16 pass reads the plain weight through ATen's GEMV, which beats
# oneDNN's bf16 GEMM there (Zen 4, small demo model's 3072x576: 205 vs 310 us at one row, 244
# vs 309 at two; from four rows on oneDNN wins: 465 vs 831 us at eight).
BF16_GEMV_MAX_ROWS = 2
# Decode steps of up to this many sequences take the fused native forward, by path: bf16 with
# matrix-vector loops and over tile-packed weights in appliance.cpu.choice (BF16_FUSED_MAX, TILE_FUSED_MAX);
# float32 compute over bf16 weights (Zen 3, AVX2, oneDNN fp32 prepacked, 2 threads, quiet), ms
# a step of the small demo model, native vs torch: 29.9 vs 66.1 (1), 46.4 vs 96.4 (8),
# 84.8 vs 118.3 (16), 142.4 vs 180.1 (32), 242.7 vs 228.1 (48), 278.8 vs 248.3 (64).
FP32_FUSED_MAX = 32
# - packed weights in row tiles (int8 activations): both paths run the same tiled kernels, the
#   fused one without torch's per-operator overhead. SmolLM2 Q4_1, continuous 64 x 128/128,
#   1 thread, back to back: 114.9 tok/s with this limit at 64, 79.4 at 32.
TILED_FUSED_MAX = 64


@dataclass
class CpuPlan:
    """The decision (appliance.cpu.choice.CpuChoice, by dtype name) in torch dtypes, with the
    features it was made for, the fused decode's batch limit and how many rows a step with a
    prompt's chunk may have on it (appliance.cpu.choice: TILE_PROMPT_ROWS)."""

    features: CpuFeatures
    choice: CpuChoice
    fused_max_batch: int
    fused_prompt_rows: int

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
    def native_prefill_attention(self) -> bool:
        """Prefill chunks through the native pair-dot-product attention (no AMX)."""
        return self.choice.native_prefill_attention

    @property
    def tile_decode(self) -> str:
        """The native decode's products over tile-packed weights: "amx", "avx512_bf16", or ""
        (the matrix-vector decode)."""
        return self.choice.tile_decode

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
            "tile_decode": self.tile_decode,
            "native_prefill_attention": self.native_prefill_attention,
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
        lambda: cpu_native.tile_decode_ready(features),
    )
    if c.tile_decode:
        fused_max, prompt_rows = TILE_FUSED_MAX, TILE_PROMPT_ROWS[c.tile_decode]
    elif c.compute == "bfloat16":
        fused_max, prompt_rows = BF16_FUSED_MAX, BF16_PROMPT_ROWS
    else:
        fused_max, prompt_rows = FP32_FUSED_MAX, FP32_PROMPT_ROWS
    return CpuPlan(
        features=features, choice=c, fused_max_batch=fused_max, fused_prompt_rows=prompt_rows
    )

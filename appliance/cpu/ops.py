"""The element-wise steps of a decoder layer through kernels/cpu_decode.c."""

from __future__ import annotations

from typing import Any

import torch

from appliance.kernels import cpu_native
from appliance.layers.norm import RMSNorm
from appliance.layers.ops import LayerOps
from appliance.layers.rotary import RotaryEmbedding


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

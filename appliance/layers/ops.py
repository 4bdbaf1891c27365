"""The element-wise steps of a decoder layer, behind one object the model is given at load time
(wired by the device backend, as each attention layer's KV path is): torch operators by default (GPU,
and the reference), the native CPU kernels when the CPU backend has built them.

Both sides compute the same thing and round where torch's model-dtype operators round, so a
model has one forward whichever ops it holds.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from appliance.layers.norm import RMSNorm
from appliance.layers.rotary import RotaryEmbedding, apply_rotary


class LayerOps:
    """torch operators."""

    name = "torch"

    def __init__(self, compute_dtype: torch.dtype | None = None) -> None:
        # The dtype activations run in; None keeps the embedding's (the weights' dtype). A CPU
        # without bf16 arithmetic runs float32 activations over 16-bit weights and KV.
        self.compute_dtype = compute_dtype

    def rope(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """Whatever `rotate_qk` needs for these positions, computed once per forward."""
        return rotary.cos_sin(positions, dtype)

    def rotate_qk(
        self, qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int, rope: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary on the q and k columns of the merged qkv rows -> (q, k) as [T, heads, D]."""
        tokens = qkv.shape[0]
        qk = qkv[:, : (q_heads + kv_heads) * head_dim].view(tokens, -1, head_dim)
        # q and k rotated together, as one [T, Hq + Hk, D] tensor: half the small ops.
        q, k = apply_rotary(qk, *rope).split([q_heads, kv_heads], dim=1)
        return q, k

    def add_rms_norm(
        self, hidden: torch.Tensor, add: torch.Tensor | None, norm: RMSNorm
    ) -> torch.Tensor:
        """With `add`, hidden += add in place (the residual stream); then norm(hidden)."""
        if add is not None:
            hidden.add_(add)
        return norm(hidden)

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up

"""Linear layers split across tensor-parallel ranks.

Column-parallel layers shard their output features (q/k/v, gate/up), row-parallel layers
their input features (o, down) and all-reduce the partial sums. Each takes full Hugging Face
tensors through `load(part, tensor)` and keeps only this rank's slice.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from appliance.layers.parallel import all_reduce, tp_rank, tp_size

# Up to this many rows, ATen's own GEMV beats oneDNN's bf16 GEMM on the CPU (Zen 4, small demo
# model's 3072x576 weights: 205 vs 310 us at one row, 244 vs 309 at two); from four rows on,
# oneDNN wins by a widening margin (465 vs 831 us at eight).
NATIVE_GEMM_MAX_ROWS = 2


@contextmanager
def cpu_gemm_for(rows: int, device: torch.device) -> Iterator[None]:
    """Route the matmuls of a pass over `rows` rows to the faster CPU kernel. The switch is
    global in torch, so it is restored on the way out for whatever runs next."""
    if device.type != "cpu":
        yield
        return
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = rows > NATIVE_GEMM_MAX_ROWS
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


class _CpuPackable(nn.Module):
    """A linear whose weight can be reordered once into oneDNN's blocked layout on the CPU."""

    weight: nn.Parameter
    packed: torch.Tensor | None = None

    def pack_for_cpu(self, batch_hint: int, keep_plain: bool = False) -> None:
        """Add oneDNN's prepacked weight, which every matmul then uses (bit-identical results).
        A plain bf16 weight is reordered on every call: prepacked, a 64-row matmul of the small
        demo model takes 631 instead of 841 us, an 8-row one 176 instead of 361 us; one row
        pays 146 against ATen's GEMV's 118 us. The plain copy is released (one layout in
        memory) unless `keep_plain`: the native CPU decode reads it."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), batch_hint)
        if not keep_plain:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


def cpu_prepack_supported(dtype: torch.dtype) -> bool:
    return (
        # bf16 only: oneDNN's fp16 kernels need CPU support that many hosts lack.
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_linears_for_cpu(model: nn.Module, batch_hint: int, keep_plain: bool = False) -> None:
    """Prepack every q/k/v, o, gate/up and down weight, and the LM head's."""
    for module in model.modules():
        if isinstance(module, _CpuPackable):
            module.pack_for_cpu(batch_hint, keep_plain)
        elif hasattr(module, "pack_for_cpu"):  # the LM head (embedding.py imports this module)
            module.pack_for_cpu(batch_hint)


class MergedColumnLinear(_CpuPackable):
    """Several column-parallel projections in one matmul (q|k|v or gate|up).

    `parts` are (name, rows on this rank, head size for replicated-head slicing or 0)."""

    def __init__(self, in_features: int, parts: list[tuple[str, int, int]], bias: bool) -> None:
        super().__init__()
        self.parts = parts
        self.offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, rows, _ in parts:
            self.offsets[name] = (offset, rows)
            offset += rows
        self.out_features = offset
        self.weight = nn.Parameter(torch.empty(offset, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(offset), requires_grad=False) if bias else None
        # For heads replicated across ranks (more ranks than KV heads): which shard to take.
        self.shard_index: dict[str, int] = {name: tp_rank() for name, _, _ in parts}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def load(self, part: str, tensor: torch.Tensor, is_bias: bool = False) -> None:
        offset, rows = self.offsets[part]
        shard = self.shard_index[part]
        piece = tensor.narrow(0, shard * rows, rows)
        target = self.bias if is_bias else self.weight
        assert target is not None, f"{part}: checkpoint has a bias the model does not expect"
        target.data[offset : offset + rows].copy_(piece)


class RowParallelLinear(_CpuPackable):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        size = tp_size()
        self.in_per_rank = in_features // size
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(self._matmul(x, None))
        return out + self.bias if self.bias is not None else out

    def load(self, tensor: torch.Tensor, is_bias: bool = False) -> None:
        if is_bias:
            assert self.bias is not None
            self.bias.data.copy_(tensor)
            return
        start = tp_rank() * self.in_per_rank
        self.weight.data.copy_(tensor.narrow(1, start, self.in_per_rank))

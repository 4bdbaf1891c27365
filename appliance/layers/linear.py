"""Linear layers split across tensor-parallel ranks.

Column-parallel layers shard their output features (q/k/v, gate/up), row-parallel layers
their input features (o, down) and all-reduce the partial sums. Each takes full Hugging Face
tensors through `load(part, tensor)` and keeps only this rank's slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from appliance.layers.parallel import all_reduce, tp_rank, tp_size


class MatmulWeight(nn.Module):
    """A module whose matmul can read another copy of its weight than `weight` itself.

    The CPU backend (appliance.cpu.backend) sets `matmul_weight`: oneDNN's prepacked layout
    (`onednn_packed`), or a plain tensor in the compute dtype (float32 on CPUs without bf16
    arithmetic). `weight` keeps the checkpoint's values for whatever else reads them (the
    native decode, the embedding) and may be released when nothing does. Passes of up to
    `plain_max_rows` rows read `weight` itself where it is still held in the input's dtype
    (ATen's GEMV beats a prepacked GEMM at one or two rows)."""

    weight: nn.Parameter
    matmul_weight: torch.Tensor | None = None
    onednn_packed: bool = False
    plain_max_rows: int = 0

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = self.matmul_weight
        if w is None or (
            x.shape[0] <= self.plain_max_rows
            and self.weight.numel() > 0
            and self.weight.dtype == x.dtype
        ):
            return F.linear(x, self.weight, bias)
        if self.onednn_packed:
            return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
        return F.linear(x, w, bias)


class MergedColumnLinear(MatmulWeight):
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


class RowParallelLinear(MatmulWeight):
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

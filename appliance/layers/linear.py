"""Linear layers split across tensor-parallel ranks.

Column-parallel layers shard their output features (q/k/v, gate/up), row-parallel layers
their input features (o, down) and all-reduce the partial sums. Each takes full Hugging Face
tensors through `load(part, tensor)` and keeps only this rank's slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from appliance.kernels.quant_weight import QuantWeight
from appliance.layers.matmul import Matmul, reference_quant_matmul
from appliance.layers.parallel import all_reduce, tp_rank, tp_size


class MatmulWeight(nn.Module):
    """A linear whose matmul the device backend chooses at load (`wire`, one strategy object
    per weight: appliance.layers.matmul). `weight` keeps the checkpoint's values for whatever
    else reads them (the native decode, the embedding) and may be released when nothing does.

    A quantized checkpoint sets `quant` (packed integers and scales,
    appliance.kernels.quant_weight) and leaves `weight` empty: no dequantized copy is held
    unless the backend's strategy keeps one (AMX); the packed bytes also serve the fused native
    decode. Until wired, the torch reference runs (dense, or dequantize-then-matmul)."""

    weight: nn.Parameter
    quant: QuantWeight | None = None
    matmul: Matmul | None = None
    # The dense shape a quantized module would have had (expect_quantized).
    dense_shape: tuple[int, int] = (0, 0)

    def wire(self, matmul: Matmul) -> None:
        self.matmul = matmul

    def expect_quantized(self) -> None:
        """Before the model is materialized: drop the dense weight so it is never allocated
        (the checkpoint brings a QuantWeight; a dense tensor still finds room, `_dense`)."""
        rows, cols = self.weight.shape
        self.dense_shape = (rows, cols)
        self.weight = nn.Parameter(torch.empty(0, device=self.weight.device), requires_grad=False)

    def _dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight to copy a checkpoint tensor into, allocated now if it was dropped."""
        if self.weight.numel() == 0 and self.dense_shape != (0, 0):
            self.weight.data = torch.empty(self.dense_shape, dtype=dtype)
        return self.weight.data

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.matmul is not None:
            return self.matmul(x, bias)
        if self.quant is not None:
            return reference_quant_matmul(x, self.quant, bias)
        return F.linear(x, self.weight, bias)


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
        self._quant_parts: dict[str, QuantWeight] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def load(self, part: str, tensor: torch.Tensor | QuantWeight, is_bias: bool = False) -> None:
        offset, rows = self.offsets[part]
        if isinstance(tensor, QuantWeight):
            # Packed parts are merged once all have arrived (rows concatenate; TP is 1).
            if tensor.out_features != rows:
                raise ValueError(
                    f"{part}: quantized weight has {tensor.out_features} rows, expected {rows}"
                )
            self._quant_parts[part] = tensor
            if len(self._quant_parts) == len(self.parts):
                self.quant = QuantWeight.cat_rows([self._quant_parts[p] for p, _, _ in self.parts])
                self._quant_parts = {}
            return
        shard = self.shard_index[part]
        piece = tensor.narrow(0, shard * rows, rows)
        if is_bias:
            assert self.bias is not None, f"{part}: checkpoint has a bias the model does not expect"
            self.bias.data[offset : offset + rows].copy_(piece)
        else:
            self._dense(tensor.dtype)[offset : offset + rows].copy_(piece)


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

    def load(self, tensor: torch.Tensor | QuantWeight, is_bias: bool = False) -> None:
        if isinstance(tensor, QuantWeight):
            self.quant = tensor
            return
        if is_bias:
            assert self.bias is not None
            self.bias.data.copy_(tensor)
            return
        start = tp_rank() * self.in_per_rank
        self._dense(tensor.dtype).copy_(tensor.narrow(1, start, self.in_per_rank))

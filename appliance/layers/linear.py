"""Linear layers split across tensor-parallel ranks.

Column-parallel layers shard their output features (q/k/v, gate/up), row-parallel layers
their input features (o, down) and all-reduce the partial sums. Each takes full Hugging Face
tensors through `load(part, tensor)` and keeps only this rank's slice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from appliance.kernels.quant_weight import QuantWeight
from appliance.layers.parallel import all_reduce, tp_rank, tp_size

# (x, packed weight, bias) -> x @ W^T + bias: the backend's dequantizing matmul.
QuantMatmul = Callable[[torch.Tensor, QuantWeight, "torch.Tensor | None"], torch.Tensor]


def reference_quant_matmul(
    x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """The torch reference (and the fallback where no kernel is wired): dequantize, then a
    plain matmul. The dequantized matrix lives only for this call."""
    dense = w.dequantize(torch.float32)
    out = F.linear(x.float(), dense, None if bias is None else bias.float())
    return out.to(x.dtype)


class MatmulWeight(nn.Module):
    """A module whose matmul can read another copy of its weight than `weight` itself.

    The CPU backend (appliance.cpu.backend) sets `matmul_weight`: oneDNN's prepacked layout
    (`onednn_packed`), or a plain tensor in the compute dtype (float32 on CPUs without bf16
    arithmetic). `weight` keeps the checkpoint's values for whatever else reads them (the
    native decode, the embedding) and may be released when nothing does. Passes of up to
    `plain_max_rows` rows read `weight` itself where it is still held in the input's dtype
    (ATen's GEMV beats a prepacked GEMM at one or two rows).

    A quantized checkpoint sets `quant` (packed integers and scales, appliance.kernels.quant_weight)
    and leaves `weight` empty: no dequantized copy is held; `quant_matmul` (the backend's
    kernel, the torch reference by default) reads the packed bytes. Where the backend also gives
    it a dense `matmul_weight` (AMX), this module's passes read that, and the packed bytes serve
    the fused native decode only."""

    weight: nn.Parameter
    matmul_weight: torch.Tensor | None = None
    onednn_packed: bool = False
    plain_max_rows: int = 0
    quant: QuantWeight | None = None
    quant_matmul: QuantMatmul = staticmethod(reference_quant_matmul)
    # The dense shape a quantized module would have had (expect_quantized).
    dense_shape: tuple[int, int] = (0, 0)

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
        w = self.matmul_weight
        if self.quant is not None and w is None:
            return self.quant_matmul(x, self.quant, bias)
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

"""How one linear's matmul runs: one strategy object per weight, chosen by the device backend
at load (appliance.cpu.backend, appliance.engine.cuda_backend) and wired into the module.

- `CopyMatmul`: a dense copy beside the checkpoint's weight: oneDNN's prepacked layout, or a
  plain tensor in the compute dtype (float32 over 16-bit weights on CPUs without bf16
  arithmetic), or a dequantized copy of packed weights (AMX). Passes of up to
  `plain_max_rows` rows may read the weight itself (ATen's GEMV beats a prepacked GEMM at one
  or two rows).
- `PackedMatmul`: a backend's dequantizing kernel over the packed bytes (no dense copy).
A module no backend wired runs the torch reference (MatmulWeight._matmul).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from appliance.kernels.quant_weight import QuantWeight

# (x, packed weight, bias) -> x @ W^T + bias: a backend's dequantizing matmul.
QuantMatmul = Callable[[torch.Tensor, QuantWeight, "torch.Tensor | None"], torch.Tensor]


def reference_quant_matmul(
    x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """The torch reference (and the fallback where no kernel is wired): dequantize, then a
    plain matmul. The dequantized matrix lives only for this call."""
    dense = w.dequantize(torch.float32)
    out = F.linear(x.float(), dense, None if bias is None else bias.float())
    return out.to(x.dtype)


class Matmul(Protocol):
    @property
    def copy(self) -> torch.Tensor | None:
        """The dense copy it reads, where it holds one (what the load-time warm-up and the
        memory figures count)."""
        ...

    @property
    def prepacked(self) -> bool:
        """Whether that copy is in oneDNN's prepacked layout."""
        ...

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class CopyMatmul:
    def __init__(
        self,
        copy: torch.Tensor,
        prepacked: bool,
        plain: torch.Tensor | None = None,
        plain_max_rows: int = 0,
    ) -> None:
        self.copy = copy
        self.prepacked = prepacked
        # The weight as the checkpoint gave it, for the narrowest passes (None: released).
        self.plain = plain
        self.plain_max_rows = plain_max_rows

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        plain = self.plain
        if plain is not None and x.shape[0] <= self.plain_max_rows and plain.dtype == x.dtype:
            return F.linear(x, plain, bias)
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.copy, bias, "none", [], "")
        return F.linear(x, self.copy, bias)


class PackedMatmul:
    copy: torch.Tensor | None = None
    prepacked = False

    def __init__(self, kernel: QuantMatmul, quant: QuantWeight) -> None:
        self.kernel = kernel
        self.quant = quant

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernel(x, self.quant, bias)

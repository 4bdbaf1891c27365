"""Wide passes (prefills) over row-tiled packed weights as dequantize + float32 GEMM.

With int8 activations every row-tiled matrix takes the tile kernel of cpu_quant_tiles.h at
every width. From some number of rows on, a float32 GEMM (oneDNN's, through torch) on the
dequantized weight is faster: the kernel's integer products run at ~21 a cycle on one thread
and scale poorly on two, while the GEMM's cost per row falls with the row count and the
dequantization is paid once per pass, not once per row (vLLM's GGUF path does the same on
GPUs above a batch size). `DenseWidePasses` holds ONE float32 scratch buffer, reused by every
matrix and every call: a slice of a matrix's output rows is dequantized into it, multiplied,
and overwritten by the next slice, so no dequantized copy outlives a call and the packed
weights' memory win stays (the scratch is `nbytes()`, counted where the backend reports it).

Exact weights, float32 activations: this path is closer to the float32 reference than the
int8-activation kernel it replaces (no activation rounding).
"""

from __future__ import annotations

import ctypes

import torch

from appliance.layers.quant import QuantWeight
from appliance.quant_sizes import DENSE_SCRATCH_BYTES

from . import cpu_native, cpu_quant

# Floats of the scratch: one slice of output rows at a time. 256 Ki floats (1 MiB) holds 455
# rows of SmolLM2's K = 576 (gate_up in 7 slices) and keeps a slice in a Zen 3 core's share
# of L3 while the GEMM reads it back.
SLICE_FLOATS = DENSE_SCRATCH_BYTES // 4


class DenseWidePasses:
    """The int8-activation matmul of the CPU backend (a `QuantMatmul`): passes of at least
    `min_rows` rows over row-tiled weights dequantize slice by slice into the one scratch and
    run torch's float32 GEMM; everything else (fewer rows, row-major weights) calls
    cpu_quant.quant_matmul_act8. `min_rows` 0: never (the int8 kernel at every width)."""

    def __init__(self, min_rows: int, slice_floats: int = SLICE_FLOATS) -> None:
        assert min_rows >= 0 and slice_floats > 0
        self.min_rows = min_rows
        self.scratch = torch.empty(slice_floats if min_rows else 0, dtype=torch.float32)
        # Wide passes taken (tests check which path ran).
        self.dense_passes = 0

    def nbytes(self) -> int:
        return self.scratch.numel() * self.scratch.element_size()

    def takes(self, rows: int, w: QuantWeight) -> bool:
        return bool(self.min_rows) and rows >= self.min_rows and w.tile_rows != 1

    def __call__(self, x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if not self.takes(x2.shape[0], w):
            return cpu_quant.quant_matmul_act8(x, w, bias)
        self.dense_passes += 1
        out = self._dense(x2.float().contiguous(), w, None if bias is None else bias.float())
        return out.to(x.dtype).reshape(*lead, w.out_features)

    def _dense(self, x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
        n, k = w.out_features, w.in_features
        # Slices of whole row tiles (8 rows; a tiled matrix's rows are a multiple of 8). Only a
        # K over 32 Ki columns would not fit 8 rows in the scratch: it grows to that once.
        step = min(n, self.scratch.numel() // k // 8 * 8)
        if step < 8:
            self.scratch = torch.empty(8 * k, dtype=torch.float32)
            step = 8
        desc = cpu_quant.descriptor(w)
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        for start in range(0, n, step):
            end = min(n, start + step)
            tile = dequant_tiles(w, start, end, self.scratch, desc)
            if step == n:  # one slice: straight into out
                torch.mm(x, tile.t(), out=out)
            else:
                out[:, start:end] = torch.mm(x, tile.t())
        if bias is not None:
            out += bias
        return out


def dequant_tiles(
    w: QuantWeight, start: int, end: int, into: torch.Tensor, desc: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows start..end-1 of row-tiled w in float32, written over the front of `into` (whole
    tiles: start and end multiples of 8) and returned as a [end - start, K] view of it."""
    k = w.in_features
    assert w.tile_rows == 8 and start % 8 == 0 and end % 8 == 0 and 0 <= start < end <= w.out_features
    assert into.dtype == torch.float32 and into.is_contiguous() and into.numel() >= (end - start) * k
    desc = cpu_quant.descriptor(w) if desc is None else desc
    tile = into[: (end - start) * k].view(end - start, k)
    cpu_quant._lib().quant_dequant_tiles(
        cpu_native.ptr(desc), ctypes.c_int64(start), ctypes.c_int64(end), cpu_native.ptr(tile),
        ctypes.c_int64(torch.get_num_threads()),
    )  # fmt: skip
    return tile

"""Quantized weight matrices as the engine holds them: packed integers plus per-group scales,
never a dequantized copy.

Every checkpoint format is repacked at load into one of two layouts, so each kernel (native
CPU, Triton, the torch reference here) has two cases, not one per format:

- ``q4``: ``qweight`` uint8 [N, K/2]. Each run of 32 columns is 16 bytes: byte i holds column
  i in its low nibble and column i + 16 in its high nibble (ggml's Q4_0/Q4_1 order; Q4_K, AWQ
  and GPTQ are reordered at load). ``scales`` and ``mins`` fp16 [N, K/group]; a weight is
  ``q * scale + min``. Q4_0 is min = -8 scale, AWQ/GPTQ min = -zero * scale (float32 mins
  there: that product is exact in float32, not in fp16), Q4_K scale = d * sc and min =
  -dmin * m of each 32-column sub-block. ``group`` is a multiple of 32.
- ``q8``: ``qweight`` int8 [N, K], ``scales`` fp16 [N, ceil(K/group)], a weight is
  ``q * scale`` (Q8_0: group 32; Q6_K: its 16-column sub-blocks, q - 32 in int8; the INT8
  weight-only mode: one group per row).

Quantization is per output row, so rows can be concatenated (q|k|v) and permuted (GGUF's q/k
order) on the packed bytes.

``tile_rows = 8`` (set by the CPU backend for int8-activation kernels, `tile_rows_of`) holds
the same bytes in row tiles: every 8 rows x 32 columns are contiguous, as chunks of 4 columns
of each of the 8 rows (q4: 4 bytes of ggml's block order; q8: 4 int8), and the scales and mins
of a tile's 8 rows sit side by side per group ([N/8, groups, 8]). One 32-byte load then holds
8 output rows, so a dot product sums 8 rows per instruction and the per-group scales are
applied as one vector (kernels/cpu_quant_tiles.h). Tensor shapes do not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("q4", "q8")
# Rows of a tile in the row-tile order (QuantWeight.tile_rows).
TILE_ROWS = 8


@dataclass
class QuantWeight:
    """A [out_features, in_features] weight in one of the layouts above."""

    fmt: str
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    group: int
    in_features: int
    # Which checkpoint format it came from, for logs and the plan ("gguf:Q4_1", "awq", "int8").
    source: str = ""
    # 1: row-major as above; TILE_ROWS: the row-tile order (tile_rows_of).
    tile_rows: int = 1

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"quantized weight format {self.fmt!r}: expected one of {FORMATS}")
        n = self.qweight.shape[0]
        k = self.in_features
        if self.fmt == "q4":
            if self.group % 32 or k % self.group:
                raise ValueError(f"q4: group {self.group} must be a multiple of 32 dividing K={k}")
            assert self.qweight.dtype == torch.uint8 and self.qweight.shape == (n, k // 2)
            assert self.mins is not None and self.mins.shape == self.scales.shape
            assert self.mins.dtype in (torch.float16, torch.float32), self.mins.dtype
        else:
            assert self.qweight.dtype == torch.int8 and self.qweight.shape == (n, k)
        assert self.scales.shape == (n, -(-k // self.group)), (self.scales.shape, n, k, self.group)
        if self.tile_rows != 1:
            assert self.tile_rows == TILE_ROWS and tileable(self), (
                self.tile_rows,
                n,
                k,
                self.group,
            )

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def nbytes(self) -> int:
        """Bytes a pass over the whole matrix reads (packed values and scales)."""
        extra = self.mins.nbytes if self.mins is not None else 0
        return self.qweight.nbytes + self.scales.nbytes + extra

    def take_rows(self, index: torch.Tensor) -> QuantWeight:
        """The rows `index` (a permutation or a shard), still packed."""
        assert self.tile_rows == 1, "take_rows on row tiles"
        mins = self.mins[index].contiguous() if self.mins is not None else None
        return QuantWeight(
            self.fmt,
            self.qweight[index].contiguous(),
            self.scales[index].contiguous(),
            mins,
            self.group,
            self.in_features,
            self.source,
        )

    def to(self, device: torch.device | str) -> QuantWeight:
        mins = self.mins.to(device) if self.mins is not None else None
        return QuantWeight(
            self.fmt,
            self.qweight.to(device),
            self.scales.to(device),
            mins,
            self.group,
            self.in_features,
            self.source,
            self.tile_rows,
        )

    @staticmethod
    def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
        """Row-wise concatenation (merged q|k|v, gate|up); all parts in one layout."""
        first = parts[0]
        assert all(p.tile_rows == 1 for p in parts), "cat_rows on row tiles"
        for p in parts[1:]:
            if (p.fmt, p.group, p.in_features) != (first.fmt, first.group, first.in_features):
                raise ValueError(
                    f"cannot merge quantized parts of different layouts: {first.fmt}/g{first.group} "
                    f"({first.source}) and {p.fmt}/g{p.group} ({p.source})"
                )
        mins = torch.cat([p.mins for p in parts]) if first.mins is not None else None  # type: ignore[misc]
        return QuantWeight(
            first.fmt,
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
            mins,
            first.group,
            first.in_features,
            first.source,
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The torch reference: the full matrix in `dtype` (tests, the GPU's fallback, and
        transient tiles; the engine never keeps its result)."""
        return dequantize_rows(self, None).to(dtype)


def unpack_q4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] in the q4 layout -> uint8 values [N, K]."""
    n, half = qweight.shape
    blocks = qweight.view(n, half // 16, 16)
    lo, hi = blocks & 0x0F, blocks >> 4
    return torch.cat([lo, hi], dim=2).reshape(n, half * 2)


def pack_q4(values: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] (K a multiple of 32) -> the q4 layout [N, K/2]."""
    n, k = values.shape
    blocks = values.to(torch.uint8).view(n, k // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def dequantize_rows(w: QuantWeight, rows: torch.Tensor | None) -> torch.Tensor:
    """float32 [len(rows) or N, K]: the embedding lookup of a quantized table, and the
    reference every kernel is tested against."""
    if w.tile_rows != 1:
        w, rows = untile_rows(w, rows), None
    q = w.qweight if rows is None else w.qweight[rows]
    scales = (w.scales if rows is None else w.scales[rows]).float()
    k = w.in_features
    if w.fmt == "q4":
        values = unpack_q4(q).float()
        assert w.mins is not None  # a q4 weight carries mins (checked at construction)
        mins = (w.mins if rows is None else w.mins[rows]).float()
        scale = scales.repeat_interleave(w.group, dim=1)
        return values * scale + mins.repeat_interleave(w.group, dim=1)
    scale = scales.repeat_interleave(w.group, dim=1)[:, :k]
    return q.float() * scale


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """Per-output-channel symmetric INT8 (weight-only): scale = max|w| / 127 of each row,
    rounded to fp16 first so that q * scale is what every kernel computes."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8)
    scale = (amax / 127.0).to(torch.float16)
    q = torch.round(w / scale.float()).clamp_(-127, 127).to(torch.int8)
    return QuantWeight(
        "q8", q.contiguous(), scale.contiguous(), None, w.shape[1], w.shape[1], "int8"
    )


def tileable(w: QuantWeight) -> bool:
    """Whether w's shape has a row-tile order: whole tiles of rows, K and the groups in whole
    32-column blocks (the int8-activation kernels' blocks)."""
    return w.out_features % TILE_ROWS == 0 and w.in_features % 32 == 0 and w.group % 32 == 0


def _chunks(w: QuantWeight) -> tuple[int, int]:
    """(32-column blocks a row, 4-byte chunks a block) of w's packed values."""
    return w.in_features // 32, 4 if w.fmt == "q4" else 8


def tile_rows_of(w: QuantWeight) -> QuantWeight:
    """w in the row-tile order (a permutation of its bytes; w itself is left as it was)."""
    assert w.tile_rows == 1 and tileable(w), (w.shape, w.group)
    n, t = w.out_features, TILE_ROWS
    blocks, chunks = _chunks(w)
    # [tile, row, block, chunk, byte] -> [tile, block, chunk, row, byte]
    q = w.qweight.view(n // t, t, blocks, chunks, 4).permute(0, 2, 3, 1, 4)

    def side(a: torch.Tensor) -> torch.Tensor:  # [tile, row, group] -> [tile, group, row]
        return a.view(n // t, t, -1).permute(0, 2, 1).reshape(a.shape).contiguous()

    mins = side(w.mins) if w.mins is not None else None
    return QuantWeight(
        w.fmt,
        q.reshape(w.qweight.shape).contiguous(),
        side(w.scales),
        mins,
        w.group,
        w.in_features,
        w.source,
        TILE_ROWS,
    )


def untile_rows(w: QuantWeight, rows: torch.Tensor | None = None) -> QuantWeight:
    """Rows `rows` (all when None) of a row-tiled w, back in the row-major order."""
    n, t = w.out_features, w.tile_rows
    blocks, chunks = _chunks(w)
    idx = torch.arange(n) if rows is None else rows.to(torch.int64).reshape(-1)
    tile, lane = idx // t, idx % t
    # Advanced indices split by slices come first: [len(idx), block, chunk, byte].
    q = w.qweight.view(n // t, blocks, chunks, t, 4)[tile, :, :, lane]

    def side(a: torch.Tensor) -> torch.Tensor:
        return a.view(n // t, -1, t)[tile, :, lane]

    mins = side(w.mins) if w.mins is not None else None
    return QuantWeight(
        w.fmt,
        q.reshape(len(idx), -1).contiguous(),
        side(w.scales).contiguous(),
        None if mins is None else mins.contiguous(),
        w.group,
        w.in_features,
        w.source,
    )

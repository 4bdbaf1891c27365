"""The tile-packed bf16 copy of a dense model's matrices that the tile decode forward reads
(kernels/cpu_decode_tiles.inc.c: AMX tile products, or the same products in AVX-512-BF16
vectors, whose B-tile rows are one K pair of 16 columns): made once at load, before the
row-major weights are released.

A matrix [N, K] (rows = output features) becomes [N/16][K/32][16][16][2]: each (block of 16
output columns, block of 32 K) is one 1 KB B tile in VNNI-2 order (pairs of K interleaved), a
column block's tiles one after the other. N is padded to 16 and K to 32 with zeros. gate|up
interleaves its halves block by block (gate 0, up 0, gate 1, ...), so one of the kernel's work
items holds both halves of 16 outputs of the MLP.

What it costs: the same bytes as the row-major matrices it replaces (plus padding, none for
SmolLM2's shapes), except the LM head of a tied model, whose row-major table the embedding
lookup keeps reading (SmolLM2-135M: 56.6 MB more).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from appliance.models.llama import LlamaForCausalLM

# Matrices of a layer the tile forward reads tile-packed, by their decode_tensors() names.
PACKED_FIELDS = ("wqkv", "wo", "wgu", "wdown")
COLUMN_BLOCK, K_BLOCK = 16, 32


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def tile_pack(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the flat bf16 tiles of the kernel's layout (module docstring)."""
    n, k = w.shape
    n_pad, k_pad = _round_up(n, COLUMN_BLOCK), _round_up(k, K_BLOCK)
    padded = F.pad(w.detach().to(torch.bfloat16), (0, k_pad - k, 0, n_pad - n))
    # (column block, column, K block, K pair, pair member) -> (column block, K block, K pair,
    # column, pair member): rows of a B tile are K pairs, each 16 columns x 2 values.
    tiles = padded.view(n_pad // 16, 16, k_pad // 32, 16, 2).permute(0, 2, 3, 1, 4)
    return tiles.contiguous().view(-1)


def tile_pack_gate_up(w: torch.Tensor, inter: int) -> torch.Tensor:
    """gate|up [2 * inter, K] -> tiles with gate block j and up block j side by side."""
    k = w.shape[1]
    inter_pad = _round_up(inter, COLUMN_BLOCK)
    halves = [F.pad(half, (0, 0, 0, inter_pad - inter)) for half in (w[:inter], w[inter:])]
    blocks = torch.stack([h.reshape(inter_pad // 16, 16, k) for h in halves], dim=1)
    return tile_pack(blocks.reshape(2 * inter_pad, k))


@dataclass
class TileDecodeWeights:
    """Every matrix the decode forward multiplies by, tile-packed: per layer by field name
    (PACKED_FIELDS), and the LM head with its row count."""

    layers: list[dict[str, torch.Tensor]]
    lm_head: torch.Tensor
    vocab: int

    @classmethod
    def from_model(cls, model: LlamaForCausalLM) -> TileDecodeWeights:
        layers, top = model.decode_tensors()
        inter = model.model.layers[0].mlp.inter
        packed = []
        for tensors in layers:
            row: dict[str, torch.Tensor] = {}
            for name in PACKED_FIELDS:
                w = tensors[name]
                assert w is not None and w.numel() > 0, f"{name}: no row-major weight to pack"
                row[name] = tile_pack_gate_up(w, inter) if name == "wgu" else tile_pack(w)
            packed.append(row)
        head = top["lm_head"]
        return cls(packed, tile_pack(head), head.shape[0])

    def nbytes(self) -> int:
        tensors = [t for row in self.layers for t in row.values()] + [self.lm_head]
        return sum(t.numel() * t.element_size() for t in tensors)

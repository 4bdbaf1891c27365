"""ggml's quantized blocks -> the engine's packed layouts (appliance.kernels.quant_weight), on the packed
bytes: the integers are re-ordered, never dequantized. Block layouts as ggml-quants.h defines
them; `gguf.quants.dequantize` is the reference the tests hold these against.

Q8_0, Q4_0 and Q4_1 convert exactly (fp16 scales stay fp16). Q4_K's scale d * sc and min
dmin * m and Q6_K's d * sc are products of an fp16 and a 6- or 8-bit integer, rounded here to
fp16 (relative error <= 2^-11 of a scale, far below the quantization step).
"""

from __future__ import annotations

import numpy as np
import torch

from appliance.kernels.quant_weight import QuantWeight, pack_q4
from appliance.models.gguf_meta import ENGINE_BITS

# ggml type name -> (elements, bytes) of one block.
BLOCKS = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
}
# gguf_meta (torch-free, read by `appliance plan`) sizes the same types as repacked here.
assert set(BLOCKS) == set(ENGINE_BITS), (set(BLOCKS), set(ENGINE_BITS))


def _blocks(raw: np.ndarray, name: str, k: int) -> torch.Tensor:
    """uint8 [N, row bytes] -> uint8 [N, blocks, block bytes]."""
    elems, size = BLOCKS[name]
    if k % elems:
        raise ValueError(f"{name}: row length {k} is not a multiple of its block ({elems})")
    # A copy: the reader's arrays are read-only views of the memory-mapped file.
    data = torch.from_numpy(np.array(raw, copy=True)).view(torch.uint8)
    return data.reshape(raw.shape[0], k // elems, size)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] (little-endian) -> fp16 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def convert(raw: np.ndarray, name: str, k: int, source: str) -> QuantWeight:
    """One GGUF tensor's bytes [N, row bytes] of ggml type `name` -> a QuantWeight [N, k]."""
    b = _blocks(raw, name, k)
    n = b.shape[0]
    if name == "Q8_0":
        scales = _f16(b[..., 0:2])
        q = b[..., 2:34].contiguous().view(torch.int8).reshape(n, k)
        return QuantWeight("q8", q, scales.contiguous(), None, 32, k, source)
    if name in ("Q4_0", "Q4_1"):
        d = _f16(b[..., 0:2])
        if name == "Q4_0":
            mins, qs = d * -8.0, b[..., 2:18]
        else:
            mins, qs = _f16(b[..., 2:4]), b[..., 4:20]
        return QuantWeight(
            "q4",
            qs.reshape(n, k // 2).contiguous(),
            d.contiguous(),
            mins.contiguous(),
            32,
            k,
            source,
        )
    if name == "Q4_K":
        return _q4_k(b, n, k, source)
    if name == "Q6_K":
        return _q6_k(b, n, k, source)
    raise ValueError(f"GGUF tensor type {name} is not supported (supported: {', '.join(BLOCKS)})")


def _q4_k(b: torch.Tensor, n: int, k: int, source: str) -> QuantWeight:
    # block_q4_K: d, dmin (fp16), scales[12] (eight 6-bit scales and mins), qs[128].
    d = _f16(b[..., 0:2]).float()
    dmin = _f16(b[..., 2:4]).float()
    s = b[..., 4:16].to(torch.int32)
    # get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7; sub-blocks 4-7
    # take their low 4 bits from bytes 8-11 and their top 2 from the high bits of bytes 0-7.
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    scales = (d.unsqueeze(-1) * sc).reshape(n, -1).to(torch.float16)
    mins = (-(dmin.unsqueeze(-1) * m)).reshape(n, -1).to(torch.float16)
    # qs: four runs of 32 bytes; run j holds sub-block 2j in its low nibbles and 2j + 1 in
    # its high ones.
    qs = b[..., 16:144].reshape(n, -1, 4, 1, 32)
    values = torch.cat([qs & 0xF, qs >> 4], dim=3).reshape(n, k)
    return QuantWeight("q4", pack_q4(values), scales.contiguous(), mins.contiguous(), 32, k, source)


def _q6_k(b: torch.Tensor, n: int, k: int, source: str) -> QuantWeight:
    # block_q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8), d (fp16).
    ql = b[..., 0:128].reshape(n, -1, 2, 64).to(torch.int16)
    qh = b[..., 128:192].reshape(n, -1, 2, 32).to(torch.int16)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[..., 208:210]).float()
    # Each 128-column half: columns l, l+32, l+64, l+96 (l < 32) from ql[l], ql[l+32] low and
    # high nibbles and the 2-bit fields of qh[l] in that order.
    lo, hi = ql[..., :32], ql[..., 32:]
    parts = [
        (lo & 0xF) | ((qh & 3) << 4),
        (hi & 0xF) | (((qh >> 2) & 3) << 4),
        (lo >> 4) | (((qh >> 4) & 3) << 4),
        (hi >> 4) | (((qh >> 6) & 3) << 4),
    ]
    q = (torch.stack(parts, dim=3) - 32).reshape(n, k).to(torch.int8)
    scales = (d.unsqueeze(-1) * sc).reshape(n, -1).to(torch.float16)
    return QuantWeight("q8", q.contiguous(), scales.contiguous(), None, 16, k, source)

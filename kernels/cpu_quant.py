"""The packed-weight CPU kernels of `cpu_quant.c`, built by cpu_native's machinery (same flags,
same cache, the same APPLIANCE_CPU_MASK handling) into their own library, and called through
ctypes on the packed tensors of an appliance.kernels.quant_weight.QuantWeight.

- `quant_matmul(x, w, bias, act8)`: the batched matmul of a quantized linear. Up to DENSE_TILE_ROWS
  rows it reads the packed bytes (GEMV-like, bound by the weight read); wider passes
  (prefills) dequantize the matrix into a transient float32 tile and hand it to torch's GEMM,
  where the dequantization is amortized over the rows and the GEMM is compute-bound anyway.
  Row-tiled weights (int8 activations) take their packed kernel at every width: its integer
  products (32 per maddubs) beat dequantizing plus a float32 GEMM at any row count.
- `dequant_rows(w, rows)`: float32 rows (embedding lookups, the tiles above).
- `qdecode_forward_*`: the whole decode forward over packed linears (appliance.cpu.quant_decode).
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

from . import cpu_native
from .cpu_features import CpuFeatures, detect
from .quant_weight import QuantWeight, tile_rows_of, tileable, untile_rows

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_quant.c")
# Order of the per-layer pointer row of the quantized decode (the Q_ enum in the C file).
QLAYER_FIELDS = ("ln1", "wqkv", "bqkv", "wo", "ln2", "wgu", "wdown", "k_cache", "v_cache")
# Passes wider than this dequantize a transient tile and use torch's GEMM. On a Zen 3 (AVX2,
# 2 threads) the packed kernel re-reads each weight row per 4 rows of x and stops gaining
# from batching at about this many rows; a float32 GEMM does ~120 GFLOP/s there. Row-tiled
# weights never take the tile: SmolLM2's gate_up (3072 x 576) at 128 rows, 1 thread, took
# 5.2 ms packed vs 8.0 ms dequantized + GEMM (16 rows: 0.64 vs 1.45; row-major int8: 13.5).
DENSE_TILE_ROWS = 16
# Up to this many rows dequant_rows runs on the calling thread alone.
SERIAL_DEQUANT_ROWS = 64

_loaded: dict[tuple[str, ...], tuple[ctypes.CDLL | None, str | None]] = {}


def load(features: CpuFeatures | None = None) -> ctypes.CDLL | None:
    """The library built for `features` (default: this CPU under the mask), or None."""
    features = features or detect()
    key = tuple(cpu_native.build_flags(features))
    if key not in _loaded:
        try:
            path = cpu_native.build(features, SOURCE)
            lib: ctypes.CDLL | None = ctypes.CDLL(str(path))
            error = None
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            lib, error = None, str(exc)
            log.warning("packed-weight CPU kernels unavailable, using the torch path: %s", exc)
        if lib is not None:
            for name in (
                "quant_matmul",
                "qdecode_forward_bf16",
                "qdecode_forward_f32",
                "quant_tiles_supported",
            ):
                getattr(lib, name).restype = ctypes.c_int
        _loaded[key] = (lib, error)
    return _loaded[key][0]


def load_error(features: CpuFeatures | None = None) -> str | None:
    load(features)
    return _loaded[tuple(cpu_native.build_flags(features or detect()))][1]


def forget_builds() -> None:
    _loaded.clear()


def descriptor(w: QuantWeight, act8: bool = False) -> torch.Tensor:
    """The C side's QW struct (int64 fields; pointers into w's tensors, which must outlive
    every call that gets it). `act8`: int8 activations where the shape allows (K and group
    in whole 32-column blocks; other weights keep the float32 dot). Row-tiled weights
    (tile_rows 8) always take int8 activations: only their kernels read that order."""
    assert (
        w.qweight.is_contiguous() and w.scales.dtype == torch.float16 and w.scales.is_contiguous()
    )
    mins, mins_f32 = 0, 0
    if w.fmt == "q4":
        assert w.mins is not None and w.mins.is_contiguous()
        mins, mins_f32 = w.mins.data_ptr(), int(w.mins.dtype == torch.float32)
    bits = 4 if w.fmt == "q4" else 8
    return torch.tensor(
        [
            bits,
            w.out_features,
            w.in_features,
            w.group,
            w.qweight.data_ptr(),
            w.scales.data_ptr(),
            mins,
            mins_f32,
            int(act8),
            w.tile_rows if w.tile_rows > 1 else 0,
        ],
        dtype=torch.int64,
    )


def tiles_supported(features: CpuFeatures | None = None) -> bool:
    """Whether the library built for `features` has the row-tile kernels (AVX2 and up)."""
    lib = load(features)
    return lib is not None and bool(lib.quant_tiles_supported())


def tiled_for_int8(w: QuantWeight, features: CpuFeatures | None = None) -> QuantWeight:
    """w in the row-tile order where the kernels and its shape take it, else w: what the CPU
    backend holds under model.cpu_quant_activations = "int8" (the same bytes, reordered)."""
    if w.tile_rows == 1 and tileable(w) and tiles_supported(features):
        return tile_rows_of(w)
    return w


def _lib() -> ctypes.CDLL:
    lib = load()
    assert lib is not None, "packed-weight CPU kernels unavailable"
    return lib


def dequant_rows(w: QuantWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [len(rows) or N, K]; the torch reference is quant.dequantize_rows."""
    idx = None if rows is None else rows.to(torch.int64).contiguous()
    n = w.out_features if idx is None else idx.numel()
    out = torch.empty(n, w.in_features, dtype=torch.float32)
    desc = descriptor(w)
    p = cpu_native.ptr
    # A decode step's few embedding rows are a microsecond of work each: on the calling thread,
    # without waking OpenMP's other threads (a wake-up through the kernel under
    # OMP_WAIT_POLICY=PASSIVE costs more than the rows).
    threads = 1 if n <= SERIAL_DEQUANT_ROWS else torch.get_num_threads()
    _lib().quant_dequant_rows(p(desc), p(idx), ctypes.c_int64(n), p(out), ctypes.c_int64(threads))
    return out


def quant_matmul(
    x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, act8: bool = False
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) in float32, returned in x's dtype; `act8` as `descriptor`
    (the narrow passes only: the dense tile's GEMM stays float32)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    fbias = None if bias is None else bias.float().contiguous()
    if rows > DENSE_TILE_ROWS and w.tile_rows == 1:
        out = F.linear(x2.float(), dequant_rows(w), fbias)
    else:
        xf = x2.float().contiguous()
        out = torch.empty(rows, w.out_features, dtype=torch.float32)
        desc = descriptor(w, act8)
        p = cpu_native.ptr
        rc = _lib().quant_matmul(
            p(desc),
            p(xf),
            p(fbias),
            p(out),
            ctypes.c_int64(rows),
            ctypes.c_int64(torch.get_num_threads()),
        )
        if rc != 0:
            raise MemoryError("quant_matmul: out of memory for its scratch buffer")
    return out.to(x.dtype).reshape(*lead, w.out_features)


def quant_matmul_act8(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """quant_matmul with int8 activations (model.cpu_quant_activations = "int8")."""
    return quant_matmul(x, w, bias, act8=True)


def act8_reference(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """What the int8-activation kernels compute, in torch: x rounded to int8 per 32 columns
    (scale max|x| / 127) meets q * scale, the min term meets x itself."""
    if w.tile_rows != 1:
        w = untile_rows(w)
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xq = torch.round(blocks * inv).clamp(-127, 127) * d
    xq = xq.reshape(rows, k)
    scale = w.scales.float().repeat_interleave(w.group, dim=1)[:, :k]
    if w.fmt == "q4":
        from .quant_weight import unpack_q4

        q = unpack_q4(w.qweight).float()
        assert w.mins is not None  # a q4 weight carries mins (checked at construction)
        mins = w.mins.float().repeat_interleave(w.group, dim=1)
        return xq @ (q * scale).T + x.float() @ mins.T
    return xq @ (w.qweight.float() * scale).T

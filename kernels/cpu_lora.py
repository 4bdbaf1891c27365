"""The batched LoRA update of `cpu_lora.c`, built by cpu_native's machinery (same flags, same
cache, the same APPLIANCE_CPU_MASK handling) into its own library and called through ctypes:
one call a LoRA linear a forward, for every row of the batch, instead of torch's shrink, mask
and expand (appliance.layers.lora's TorchLoraUpdate, the reference the tests hold it to).

`LoraKernel` binds one linear's factors once (their pointers and shapes); each call passes the
forward's x, the base output it adds to in place, and the slot of each row (int32, -1: none).
Given the factors' tile-packed copy (appliance.cpu.lora_tiles) on a build that targets AMX, a
bf16 call runs the update on tiles (kernels/cpu_lora_amx.inc.c) instead of in vectors.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

import torch

from . import cpu_native
from .cpu_features import CpuFeatures, detect

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_lora.c")
# Order of the shape vector (the L_ enum in cpu_lora.c).
LORA_SHAPE_FIELDS = (
    "rows",
    "in_features",
    "out_features",
    "x_stride",
    "out_stride",
    "width",
    "rank",
    "parts",
    "slots",
    "threads",
)
_FIELD = {name: i for i, name in enumerate(LORA_SHAPE_FIELDS)}
_ROWS, _X_STRIDE, _OUT_STRIDE, _THREADS = (
    _FIELD[name] for name in ("rows", "x_stride", "out_stride", "threads")
)
SUFFIX = cpu_native.SUFFIX

_loaded: dict[tuple[str, ...], tuple[ctypes.CDLL | None, str | None]] = {}


def load(features: CpuFeatures | None = None) -> ctypes.CDLL | None:
    """The library built for `features` (default: this CPU under the mask), or None (with the
    reason in `load_error()`)."""
    features = features or detect()
    key = tuple(cpu_native.build_flags(features))
    if key not in _loaded:
        try:
            lib: ctypes.CDLL | None = ctypes.CDLL(str(cpu_native.build(features, SOURCE)))
            error = None
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            lib, error = None, str(exc)
            log.warning("native LoRA kernel unavailable, using the torch path: %s", exc)
        if lib is not None:
            for suffix in SUFFIX.values():
                fn = getattr(lib, f"lora_update_{suffix}")
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p] * 7
            lib.lora_dpbf16.restype = ctypes.c_int
            lib.lora_tiles_compiled.restype = ctypes.c_int
            lib.lora_update_tiles_bf16.restype = ctypes.c_int
            lib.lora_update_tiles_bf16.argtypes = [ctypes.c_void_p] * 7
        _loaded[key] = (lib, error)
    return _loaded[key][0]


def load_error(features: CpuFeatures | None = None) -> str | None:
    load(features)
    return _loaded[tuple(cpu_native.build_flags(features or detect()))][1]


def forget_builds() -> None:
    _loaded.clear()


def tiles_ready(features: CpuFeatures | None = None) -> bool:
    """Whether the update can run on AMX tiles here: this library built for them and the
    process granted the tile state (cpu_native.amx_ready asks Linux once)."""
    lib = load(features)
    if lib is None or not lib.lora_tiles_compiled():
        return False
    return cpu_native.amx_ready(features)[0]


def uses_dpbf16(features: CpuFeatures | None = None) -> bool:
    """Whether the bf16 shrink of this build uses AVX-512-BF16's pair dot products."""
    lib = load(features)
    return lib is not None and bool(lib.lora_dpbf16())


class LoraKernel:
    """One LoRA linear's native update. `a`: (slots * width, in_features); `b_t`:
    (slots * width, out_features), both contiguous, in one dtype of SUFFIX, filled in place
    later (only their pointers are bound). `parts`: each part's (first output column, output
    columns), part p owning factor rows [p * rank, (p + 1) * rank) of a slot's width."""

    def __init__(
        self,
        a: torch.Tensor,
        b_t: torch.Tensor,
        parts: list[tuple[int, int]],
        rank: int,
        slots: int,
        features: CpuFeatures | None = None,
        tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        lib = load(features)
        assert lib is not None, "native LoRA kernel unavailable"
        assert a.dtype == b_t.dtype and a.dtype in SUFFIX, (a.dtype, b_t.dtype)
        assert a.is_contiguous() and b_t.is_contiguous()
        width = a.shape[0] // slots
        assert width == rank * len(parts) and b_t.shape[0] == a.shape[0]
        self.a, self.b_t, self.dtype = a, b_t, a.dtype
        self._fn = getattr(lib, f"lora_update_{SUFFIX[a.dtype]}")
        # The tile-packed (a, b) copy and the tile entry, where the caller has one (bf16, AMX).
        self.tiles = tiles
        if tiles is not None:
            assert a.dtype == torch.bfloat16 and lib.lora_tiles_compiled()
            self._fn = lib.lora_update_tiles_bf16
        self._parts = torch.tensor([v for part in parts for v in part], dtype=torch.int64)
        self._shape = (ctypes.c_int64 * len(LORA_SHAPE_FIELDS))()
        fixed = {
            "in_features": a.shape[1],
            "out_features": b_t.shape[1],
            "width": width,
            "rank": rank,
            "parts": len(parts),
            "slots": slots,
        }
        for name, value in fixed.items():
            self._shape[_FIELD[name]] = value

    def __call__(self, out: torch.Tensor, x: torch.Tensor, slot_of_row: torch.Tensor) -> None:
        """out[i] += x[i] A_s^T B_s^T for each row i of slot s = slot_of_row[i] >= 0, in place.
        x and out: 2-D, rows contiguous inside, in the factors' dtype; slot_of_row: int32,
        contiguous, one a row."""
        rows = x.shape[0]
        assert x.dtype == out.dtype == self.dtype and x.stride(1) == 1 and out.stride(1) == 1
        assert out.shape[0] == rows == slot_of_row.numel() and slot_of_row.dtype == torch.int32
        shape = self._shape
        shape[_ROWS] = rows
        shape[_X_STRIDE] = x.stride(0)
        shape[_OUT_STRIDE] = out.stride(0)
        shape[_THREADS] = torch.get_num_threads()
        a, b = self.tiles if self.tiles is not None else (self.a, self.b_t)
        rc = self._fn(
            shape,
            x.data_ptr(),
            out.data_ptr(),
            a.data_ptr(),
            b.data_ptr(),
            slot_of_row.data_ptr(),
            self._parts.data_ptr(),
        )
        if rc != 0:
            raise MemoryError("lora_update: out of memory for its row order")

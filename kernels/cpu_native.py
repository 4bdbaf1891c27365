"""The CPU decode kernels of `cpu_decode.c`: built once per machine with the box's C compiler,
cached, and called through ctypes on tensors' memory.

`-march=native` ties a build to the CPU it was made on, so the cache key holds the source, the
flags, the compiler and the CPU's feature flags. No compiler, or a failed build, leaves the
engine on its torch path (`load()` returns None and `load_error()` says why).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fPIC",
    "-shared",
    # Reassociation lets the dot products vectorize; NaN/inf semantics stay IEEE.
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
]
# Order of the per-layer pointer row and the shape vector (the enums / struct in the C file).
LAYER_FIELDS = ("ln1", "wqkv", "bqkv", "wo", "ln2", "wgu", "wdown", "k_cache", "v_cache")
SHAPE_FIELDS = (
    "batch", "layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "vocab",
    "block_size", "table_stride", "threads",
)  # fmt: skip
SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
MAX_QUERY_HEADS = 64

_error: str | None = None


def cache_dir() -> Path:
    root = os.environ.get("APPLIANCE_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "appliance" / "kernels"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build_key(cc: str) -> str:
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(), _cpu_flags().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def build() -> Path:
    """Compile the kernels (or find this machine's cached build); raises on failure."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    target = cache_dir() / f"cpu_decode-{_build_key(cc)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent engines never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None (with the reason in `load_error()`)."""
    global _error
    _error = None
    if os.environ.get("APPLIANCE_CPU_KERNELS", "1") == "0":
        _error = "disabled by APPLIANCE_CPU_KERNELS=0"
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _error = str(exc)
        log.warning("CPU decode kernels unavailable, using the torch path: %s", exc)
        return None
    for suffix in SUFFIX.values():
        getattr(lib, f"decode_forward_{suffix}").restype = ctypes.c_int
        getattr(lib, f"paged_decode_attention_{suffix}").restype = ctypes.c_int
    return lib


def load_error() -> str | None:
    load()
    return _error


def ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


def shape_vector(**values: int) -> torch.Tensor:
    missing = set(SHAPE_FIELDS) - values.keys()
    if missing:
        raise ValueError(f"shape_vector: missing {sorted(missing)}")
    return torch.tensor([values[name] for name in SHAPE_FIELDS], dtype=torch.int64)


def supports(dtype: torch.dtype, group: int) -> bool:
    """Whether the kernels take this dtype and number of query heads per KV head."""
    return dtype in SUFFIX and group <= MAX_QUERY_HEADS and load() is not None


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its paged context (model-dtype cache): query
    [batch, heads, head_dim] -> the same shape. The torch reference is
    `paged_attention.paged_attention` with max_query_len 1."""
    lib = load()
    assert lib is not None and query.dtype in SUFFIX and query.dtype == k_cache.dtype
    batch, heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    q = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    shape = shape_vector(
        batch=batch, layers=0, hidden=0, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        inter=0, vocab=0, block_size=block_size, table_stride=tables.shape[1],
        threads=torch.get_num_threads(),
    )  # fmt: skip
    fn = getattr(lib, f"paged_decode_attention_{SUFFIX[query.dtype]}")
    rc = fn(ptr(shape), ptr(q), ptr(k_cache), ptr(v_cache), ptr(tables), ptr(lens),
            ctypes.c_float(scale), ptr(out))  # fmt: skip
    if rc != 0:
        raise MemoryError("paged_decode_attention: out of memory for its scratch buffers")
    return out


# -- element-wise steps of the torch forward (DEFINE_LAYER_OPS in cpu_decode.c) -----------------


def _op(name: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    lib = load()
    assert lib is not None and dtype in SUFFIX, f"{name}: native kernels unavailable for {dtype}"
    return getattr(lib, f"{name}_{SUFFIX[dtype]}")


def add_rms_norm(
    x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of x [rows, hidden] (contiguous) as appliance.layers.norm computes it; with
    `add`, first x += add in place (the residual stream)."""
    assert x.is_contiguous() and weight.dtype == x.dtype
    if add is not None:
        add = add.contiguous()
        assert add.shape == x.shape and add.dtype == x.dtype
    out = torch.empty_like(x)
    rows, hidden = x.shape
    _op("add_rms_norm", x.dtype)(
        ptr(x), ptr(add), ptr(weight), ptr(out), ctypes.c_int64(rows), ctypes.c_int64(hidden),
        ctypes.c_float(eps), ctypes.c_int64(torch.get_num_threads()),
    )  # fmt: skip
    return out


def rotary_(
    x: torch.Tensor,
    heads: int,
    head_dim: int,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Rotate-half rotary, in place, on the first `heads` heads of each row of x [rows, width]
    (rows contiguous inside; q then k in the merged qkv output). Tables: float32
    [max_position, head_dim]."""
    assert x.stride(1) == 1 and cos_table.dtype == torch.float32 and cos_table.is_contiguous()
    pos = positions.to(torch.int64).contiguous()
    _op("rotary", x.dtype)(
        ptr(x), ctypes.c_int64(x.shape[0]), ctypes.c_int64(x.stride(0)), ctypes.c_int64(heads),
        ctypes.c_int64(head_dim), ptr(cos_table), ptr(sin_table), ptr(pos),
        ctypes.c_int64(torch.get_num_threads()),
    )  # fmt: skip


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * inter] -> silu(gate) * up, [rows, inter]."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    _op("silu_mul", gate_up.dtype)(
        ptr(gate_up), ptr(out), ctypes.c_int64(rows), ctypes.c_int64(width // 2),
        ctypes.c_int64(torch.get_num_threads()),
    )  # fmt: skip
    return out

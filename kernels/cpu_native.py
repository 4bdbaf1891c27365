"""The CPU decode kernels of `cpu_decode.c`: built once per machine with the box's C compiler,
cached, and called through ctypes on tensors' memory.

A build targets the CPU it runs on (`-march=native`) less the features `APPLIANCE_CPU_MASK`
hides (`-mno-...`, see appliance.kernels.cpu_features), so one machine can build and test the AVX2 code
of another. The cache key holds the source, the flags, the compiler and the visible feature
flags. No compiler, or a failed build, leaves the engine on its torch path (`load()` returns
None and `load_error()` says why).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from .cpu_features import NATIVE_MAX_QUERY_HEADS, CpuFeatures, c_compiler, detect

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
    # A call to a function not yet defined fails the build, not the library's load.
    "-Werror=implicit-function-declaration",
]
# Order of the per-layer pointer row and the shape vector (the enums / struct in the C file).
LAYER_FIELDS = ("ln1", "wqkv", "bqkv", "wo", "ln2", "wgu", "wdown", "k_cache", "v_cache")
SHAPE_FIELDS = (
    "batch",
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "head_dim",
    "inter",
    "vocab",
    "block_size",
    "table_stride",
    "threads",
)
SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
MAX_QUERY_HEADS = NATIVE_MAX_QUERY_HEADS

# Build flags -> (library or None, why not).
_loaded: dict[tuple[str, ...], tuple[ctypes.CDLL | None, str | None]] = {}


def cache_dir() -> Path:
    root = os.environ.get("APPLIANCE_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "appliance" / "kernels"


def compiler() -> str | None:
    return c_compiler()


def build_flags(features: CpuFeatures | None = None) -> list[str]:
    return [*FLAGS, *(features or detect()).compiler_flags()]


def _build_key(
    cc: str, flags: list[str], features: CpuFeatures, sources: tuple[Path, ...] = (SOURCE,)
) -> str:
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    digest = hashlib.sha256()
    cpu = " ".join(sorted(features.raw_flags))
    parts = [*(src.read_bytes() for src in sources), " ".join(flags).encode()]
    for part in (*parts, version.encode(), cpu.encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def kernel_sources() -> tuple[Path, ...]:
    """Every C file, template (*.inc.c) and header of this folder, all part of each build's
    cache key: the files #include one another (both libraries include cpu_decode_steps.inc.c
    and the headers)."""
    return tuple(sorted(SOURCE.parent.glob("cpu_*.[ch]")))


def build(features: CpuFeatures | None = None, source: Path = SOURCE) -> Path:
    """Compile the kernels for `features` (default: this CPU under the environment's mask), or
    find the cached build; raises on failure. `source` is another C file of this folder for
    kernels/cpu_quant.py."""
    features = features or detect()
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    flags = build_flags(features)
    key = _build_key(cc, flags, features, (source, *kernel_sources()))
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent engines never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [cc, *flags, str(source), "-o", tmp, "-lm"],
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


def load(features: CpuFeatures | None = None) -> ctypes.CDLL | None:
    """The library built for `features` (default: this CPU under the environment's mask), or
    None (with the reason in `load_error()`). Built and opened once per set of build flags."""
    features = features or detect()
    key = tuple(build_flags(features))
    if key not in _loaded:
        try:
            lib: ctypes.CDLL | None = ctypes.CDLL(str(build(features)))
            error = None
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            lib, error = None, str(exc)
            log.warning("CPU decode kernels unavailable, using the torch path: %s", exc)
        if lib is not None:
            for suffix in SUFFIX.values():
                for name in (
                    "decode_forward",
                    "paged_decode_attention",
                    "paged_decode_attention_f32q",
                ):
                    getattr(lib, f"{name}_{suffix}").restype = ctypes.c_int
            for name in (
                "decode_forward_tiles_bf16",
                "tiles_compiled",
                "amx_request_tiles",
                "prefill_attention_bf16",
                "prefill_attention_compiled",
            ):
                getattr(lib, name).restype = ctypes.c_int
        _loaded[key] = (lib, error)
    return _loaded[key][0]


def load_error(features: CpuFeatures | None = None) -> str | None:
    load(features)
    return _loaded[tuple(build_flags(features or detect()))][1]


# What tiles_compiled() returns (kernels/cpu_decode.h), by the back-end's name.
TILE_ISAS = {1: "amx", 2: "avx512_bf16"}


def tile_decode_ready(features: CpuFeatures | None = None) -> tuple[str | None, str | None]:
    """Which back-end the bf16 decode forward over tile-packed weights runs on here ("amx":
    tile products; "avx512_bf16": the same products in vectors, CPUs with AVX-512-BF16 and no
    AMX), or (None, why): the library built for neither (compiler or APPLIANCE_CPU_MASK), or
    Linux refusing AMX's tile state (asked once; a process keeps the grant)."""
    lib = load(features)
    if lib is None:
        return None, load_error(features)
    isa = TILE_ISAS.get(lib.tiles_compiled())
    if isa is None:
        return None, "the native build targets neither AMX nor AVX-512-BF16 (compiler or mask)"
    if isa == "amx" and lib.amx_request_tiles() != 0:
        return None, "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return isa, None


def amx_ready(features: CpuFeatures | None = None) -> tuple[bool, str | None]:
    """Whether the kernels can run AMX tile products here (the LoRA update on tiles): the
    tile decode's back-end is AMX. (False, why) otherwise."""
    isa, why = tile_decode_ready(features)
    if isa == "amx":
        return True, None
    return False, why or "the native build does not target AMX (compiler or APPLIANCE_CPU_MASK)"


def forget_builds() -> None:
    """Drop the opened libraries' records (tests that change the compiler or the mask)."""
    _loaded.clear()


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


def _attention_shape(
    batch: int, heads: int, k_cache: torch.Tensor, table_stride: int
) -> torch.Tensor:
    """The Shape an attention-only call reads: the cache's block size, KV heads and head size,
    the query heads, this many threads; no layers, matrices or vocabulary."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    return shape_vector(
        batch=batch,
        layers=0,
        hidden=0,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        inter=0,
        vocab=0,
        block_size=block_size,
        table_stride=table_stride,
        threads=torch.get_num_threads(),
    )


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its paged context (a 16- or 32-bit cache): query
    [batch, heads, head_dim] -> the same shape, in the query's dtype (the cache's, or float32
    over a bf16 cache). The torch reference is `paged_attention.paged_attention` with
    max_query_len 1."""
    lib = load()
    assert lib is not None and k_cache.dtype in SUFFIX
    assert query.dtype in (k_cache.dtype, torch.float32), (query.dtype, k_cache.dtype)
    batch, heads, _ = query.shape
    q = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    shape = _attention_shape(batch, heads, k_cache, tables.shape[1])
    mixed = query.dtype != k_cache.dtype
    name = "paged_decode_attention_f32q" if mixed else "paged_decode_attention"
    fn = getattr(lib, f"{name}_{SUFFIX[k_cache.dtype]}")
    rc = fn(
        ptr(shape),
        ptr(q),
        ptr(k_cache),
        ptr(v_cache),
        ptr(tables),
        ptr(lens),
        ctypes.c_float(scale),
        ptr(out),
    )
    if rc != 0:
        raise MemoryError("paged_decode_attention: out of memory for its scratch buffers")
    return out


# -- element-wise steps of the torch forward (cpu_decode_ops.inc.c) ---------------------------


def _op(name: str, dtype: torch.dtype) -> Callable[..., object]:
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
        ptr(x),
        ptr(add),
        ptr(weight),
        ptr(out),
        ctypes.c_int64(rows),
        ctypes.c_int64(hidden),
        ctypes.c_float(eps),
        ctypes.c_int64(torch.get_num_threads()),
    )
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
        ptr(x),
        ctypes.c_int64(x.shape[0]),
        ctypes.c_int64(x.stride(0)),
        ctypes.c_int64(heads),
        ctypes.c_int64(head_dim),
        ptr(cos_table),
        ptr(sin_table),
        ptr(pos),
        ctypes.c_int64(torch.get_num_threads()),
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * inter] -> silu(gate) * up, [rows, inter]."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    _op("silu_mul", gate_up.dtype)(
        ptr(gate_up),
        ptr(out),
        ctypes.c_int64(rows),
        ctypes.c_int64(width // 2),
        ctypes.c_int64(torch.get_num_threads()),
    )
    return out


def prefill_attention_available(k_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether `prefill_attention` takes this cache: bf16, a head size that is a multiple of
    32 (the pair dot products' rows), and a build for AVX-512-BF16."""
    if k_cache.dtype != torch.bfloat16 or head_dim % 32 or head_dim > 256:
        return False
    lib = load()
    return lib is not None and bool(lib.prefill_attention_compiled())


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    scale: float,
) -> torch.Tensor:
    """One sequence's prefill chunk, causal over its paged bf16 context: query [n, heads,
    head_dim] at positions start .. start+n-1 (their K/V already written) -> the same shape.
    The torch reference is `paged_attention.paged_attention` (SDPA) for one sequence."""
    lib = load()
    assert lib is not None and query.dtype == k_cache.dtype == torch.bfloat16
    n, heads, head_dim = query.shape
    q = query.contiguous()
    table = block_table.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    shape = _attention_shape(1, heads, k_cache, table.shape[0])
    rc = lib.prefill_attention_bf16(
        ptr(shape),
        ptr(q),
        ptr(k_cache),
        ptr(v_cache),
        ptr(table),
        ctypes.c_int64(start),
        ctypes.c_int64(n),
        ctypes.c_float(scale),
        ptr(out),
    )
    if rc != 0:
        raise (
            MemoryError("native prefill attention: out of memory")
            if rc == -1
            else ValueError(f"native prefill attention: head size {head_dim} not taken")
        )
    return out

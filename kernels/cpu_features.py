"""What this CPU can do, read once: the instruction-set features the fast paths depend on, core
count and cache sizes, and the answers to the questions those paths ask.

`APPLIANCE_CPU_MASK` (comma-separated feature names, or the groups `avx512` and `amx`) hides
features, so one machine can run the code paths of another: `APPLIANCE_CPU_MASK=avx512,amx`
makes a Sapphire Rapids box take the paths of an AVX2-only one. Masking a feature also masks
those that need it (no AVX-512 without AVX2). An unknown name is an error naming it.

Torch-free: the decision is made from flags, not by trying an instruction and catching a crash.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

MASK_ENV = "APPLIANCE_CPU_MASK"
# Query heads per KV head the native decode attention takes (its per-group accumulators are
# sized by it); the CPU plan turns the native kernels off above it.
NATIVE_MAX_QUERY_HEADS = 64


def c_compiler() -> str | None:
    """The compiler the native kernels are built with: $CC, else cc or gcc on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


# The features the appliance's paths ask about, as /proc/cpuinfo spells them, with the gcc
# switch that turns each off in a native build (`-march=native -mno-...`).
KNOWN_FEATURES: dict[str, str] = {
    "avx2": "-mno-avx2",
    "fma": "-mno-fma",
    "f16c": "-mno-f16c",
    "avx512f": "-mno-avx512f",
    "avx512bw": "-mno-avx512bw",
    "avx512vl": "-mno-avx512vl",
    "avx512dq": "-mno-avx512dq",
    "avx512_bf16": "-mno-avx512bf16",
    "avx512_vnni": "-mno-avx512vnni",
    "avx512_fp16": "-mno-avx512fp16",
    "avx_vnni": "-mno-avxvnni",
    "avx_ne_convert": "-mno-avxneconvert",
    "amx_tile": "-mno-amx-tile",
    "amx_bf16": "-mno-amx-bf16",
    "amx_int8": "-mno-amx-int8",
}
GROUPS: dict[str, tuple[str, ...]] = {
    "avx512": tuple(f for f in KNOWN_FEATURES if f.startswith("avx512")),
    "amx": tuple(f for f in KNOWN_FEATURES if f.startswith("amx")),
}
# Masking the key masks these too: they cannot exist (or be used) without it.
_NEEDS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx512f", "avx_vnni", "avx_ne_convert", "amx_tile"),
    "fma": ("avx512f",),
    "f16c": ("avx512f", "avx_ne_convert"),
    "avx512f": GROUPS["avx512"],
    "amx_tile": GROUPS["amx"],
}


class CpuMaskError(ValueError):
    """APPLIANCE_CPU_MASK names something that is not a feature."""


def parse_mask(text: str) -> frozenset[str]:
    """Feature names (and groups) -> the closed set of features they hide."""
    masked: set[str] = set()
    for raw in text.replace(" ", ",").split(","):
        name = raw.strip().lower()
        if not name:
            continue
        if name in GROUPS:
            masked.update(GROUPS[name])
        elif name in KNOWN_FEATURES:
            masked.add(name)
        else:
            known = ", ".join([*GROUPS, *KNOWN_FEATURES])
            raise CpuMaskError(f"{MASK_ENV}: unknown CPU feature {name!r}; known: {known}")
    pending = list(masked)
    while pending:
        for dependent in _NEEDS.get(pending.pop(), ()):
            if dependent not in masked:
                masked.add(dependent)
                pending.append(dependent)
    return frozenset(masked)


@dataclass(frozen=True)
class CpuFeatures:
    model_name: str
    # Features the CPU reports and the mask leaves visible (only names in KNOWN_FEATURES).
    flags: frozenset[str]
    masked: frozenset[str] = frozenset()
    cores: int = 1
    # Bytes per core (L1d, L2) and in all (L3); 0 where the kernel does not say.
    l1d_bytes: int = 0
    l2_bytes: int = 0
    l3_bytes: int = 0
    # Everything /proc/cpuinfo lists, masked features removed: the native build's cache key.
    raw_flags: frozenset[str] = field(default_factory=frozenset)

    def has(self, feature: str) -> bool:
        if feature not in KNOWN_FEATURES:
            raise KeyError(f"unknown CPU feature {feature!r}")
        return feature in self.flags

    @property
    def avx512(self) -> bool:
        return all(self.has(f) for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))

    @property
    def onednn_bf16_prepack(self) -> bool:
        """Whether oneDNN can reorder bf16 weights for its GEMM here (its own requirement:
        AVX-512 BW/VL/DQ or AVX-NE-CONVERT; without them the reorder raises)."""
        return self.avx512 or self.has("avx_ne_convert")

    @property
    def native_bf16_compute(self) -> bool:
        """Whether bf16 GEMMs run on bf16 hardware (AVX-512-BF16 dot products or AMX tiles)
        rather than being emulated in fp32 at several times the cost."""
        return self.has("avx512_bf16") or self.has("amx_bf16")

    @property
    def isa(self) -> str:
        """The widest vector path the native kernels are built for."""
        if self.has("amx_bf16"):
            return "amx"
        if self.avx512:
            return "avx512-bf16" if self.has("avx512_bf16") else "avx512"
        if self.has("avx2") and self.has("fma"):
            return "avx2"
        return "sse"

    def compiler_flags(self) -> list[str]:
        """gcc switches that keep a `-march=native` build off the masked features."""
        return [KNOWN_FEATURES[f] for f in sorted(self.masked)]

    def describe(self) -> dict[str, object]:
        return {
            "model_name": self.model_name,
            "isa": self.isa,
            "features": sorted(self.flags),
            "masked": sorted(self.masked),
            "cores": self.cores,
            "l1d_kib": self.l1d_bytes // 1024,
            "l2_kib": self.l2_bytes // 1024,
            "l3_mib": self.l3_bytes // 2**20,
            "onednn_bf16_prepack": self.onednn_bf16_prepack,
            "native_bf16_compute": self.native_bf16_compute,
        }


def _read_cpuinfo(path: Path) -> tuple[str, frozenset[str]]:
    name, flags = "unknown CPU", ""
    try:
        text = path.read_text()
    except OSError:
        return name, frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name == "unknown CPU":
            name = value.strip()
        elif key == "flags" and not flags:
            flags = value
    return name, frozenset(flags.split())


def _cache_bytes(root: Path) -> tuple[int, int, int]:
    sizes = {"L1d": 0, "L2": 0, "L3": 0}
    for index in sorted(root.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        key = "L1d" if level == "1" and kind == "Data" else f"L{level}" if kind == "Unified" else ""
        if key in sizes and size:
            unit = {"K": 1024, "M": 2**20}.get(size[-1], 1)
            sizes[key] = int(size.rstrip("KM")) * unit
    return sizes["L1d"], sizes["L2"], sizes["L3"]


def read_features(
    mask: str | None = None,
    cpuinfo: Path = Path("/proc/cpuinfo"),
    cache_root: Path = Path("/sys/devices/system/cpu/cpu0/cache"),
) -> CpuFeatures:
    """This machine's features under `mask` (default: the environment's)."""
    masked = parse_mask(os.environ.get(MASK_ENV, "") if mask is None else mask)
    name, raw = _read_cpuinfo(cpuinfo)
    visible = raw - masked
    l1d, l2, l3 = _cache_bytes(cache_root)
    return CpuFeatures(
        model_name=name,
        flags=frozenset(f for f in KNOWN_FEATURES if f in visible),
        masked=frozenset(f for f in masked if f in raw),
        cores=len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count() or 1,
        l1d_bytes=l1d,
        l2_bytes=l2,
        l3_bytes=l3,
        raw_flags=visible,
    )


def onednn_isa_limit(mask: str) -> str:
    """The ONEDNN_MAX_CPU_ISA value that keeps oneDNN's own kernels off the features `mask`
    hides ("" when it hides none oneDNN dispatches on), so a masked run is the other CPU's
    path end to end, not only in the appliance's own decisions."""
    masked = parse_mask(mask)
    if "avx2" in masked:
        return "SSE41"
    if "avx512f" in masked:
        return "AVX2_VNNI" if "avx_vnni" not in masked else "AVX2"
    if "amx_tile" in masked:
        return "AVX512_CORE_BF16" if "avx512_bf16" not in masked else "AVX512_CORE_VNNI"
    return ""


def limit_onednn_to_mask() -> None:
    """Set ONEDNN_MAX_CPU_ISA from APPLIANCE_CPU_MASK unless the operator set it; oneDNN reads
    it once, at its first use, so this runs before torch is imported (appliance/__init__.py).
    A bad mask is left for the engine to report (with the feature named)."""
    mask = os.environ.get(MASK_ENV, "")
    if not mask or "ONEDNN_MAX_CPU_ISA" in os.environ:
        return
    try:
        limit = onednn_isa_limit(mask)
    except CpuMaskError:
        return
    if limit:
        os.environ["ONEDNN_MAX_CPU_ISA"] = limit


@cache
def _detected(mask: str) -> CpuFeatures:
    return read_features(mask)


def detect() -> CpuFeatures:
    """This machine's features under the environment's mask, read once per mask value."""
    return _detected(os.environ.get(MASK_ENV, ""))

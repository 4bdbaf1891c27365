"""GPUs (pynvml) and the host (psutil) of the machine the console runs on.

NVML raises `NVMLError` subclasses for every way a GPU can be missing (no driver, no library,
no device); all of them become "no GPU" with the reason, never a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import psutil
import pynvml


@dataclass
class GpuInfo:
    index: int
    name: str
    util_pct: float
    mem_used: int
    mem_total: int
    temp_c: float
    power_w: float | None
    power_limit_w: float | None


@dataclass
class HostInfo:
    gpus: list[GpuInfo] = field(default_factory=list)
    # Why no GPU is shown ("" when GPUs were read).
    no_gpu_reason: str = ""
    cpu_pct: float = 0.0
    cpu_count: int = 0
    mem_used: int = 0
    mem_total: int = 0


def _nvml_reason(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


def read_gpus() -> tuple[list[GpuInfo], str]:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [], _nvml_reason(exc)
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            util = pynvml.nvmlDeviceGetUtilizationRates(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            temp = pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
            try:  # some boards (and MIG slices) do not report power
                power = pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0
                limit = pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0
            except pynvml.NVMLError:
                power = limit = None
            gpus.append(
                GpuInfo(
                    i,
                    name.decode() if isinstance(name, bytes) else str(name),
                    float(util.gpu),
                    int(mem.used),
                    int(mem.total),
                    float(temp),
                    power,
                    limit,
                )
            )
        return gpus, "" if gpus else "NVML found no device"
    except pynvml.NVMLError as exc:
        return [], _nvml_reason(exc)
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def read_host() -> HostInfo:
    gpus, reason = read_gpus()
    vm = psutil.virtual_memory()
    return HostInfo(
        gpus=gpus,
        no_gpu_reason=reason,
        # Since the previous call (the previous poll): non-blocking, unlike interval=...
        cpu_pct=psutil.cpu_percent(interval=None),
        cpu_count=psutil.cpu_count() or 0,
        mem_used=int(vm.total - vm.available),
        mem_total=int(vm.total),
    )

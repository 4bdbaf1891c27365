"""install.sh's system mode, staged with --destdir: the layout, modes and contents it lays out,
that a second run changes nothing, that configuration and keys survive, that --uninstall and
--purge remove it, that it touches nothing outside DESTDIR; and the observability files."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
INSTALL = REPO / "install.sh"
UNITS = [
    "appliance@.service",
    "appliance.target",
    "appliance-router.service",
    "appliance-inspect@.service",
    "appliance-inspect@.timer",
]
KEY_RE = re.compile(r"^sk-[0-9a-f]{64}\n$")


def fake_bin(tmp: Path, gpus: int = 0) -> tuple[dict[str, str], Path]:
    """PATH with stubs that log any call to commands a --destdir run must not make, and an
    nvidia-smi listing `gpus` GPUs (none: the command is absent)."""
    bindir = tmp / "fakebin"
    bindir.mkdir(exist_ok=True)
    calls = tmp / "calls.log"
    for cmd in ("useradd", "userdel", "groupadd", "systemctl", "chown"):
        (bindir / cmd).write_text(f'#!/bin/sh\necho "{cmd} $*" >> {calls}\n')
        (bindir / cmd).chmod(0o755)
    if gpus:
        lines = "\\n".join(f"GPU {i}: NVIDIA A10 (UUID: GPU-{i})" for i in range(gpus))
        (bindir / "nvidia-smi").write_text(f'#!/bin/sh\nprintf "{lines}\\n"\n')
        (bindir / "nvidia-smi").chmod(0o755)
    path = [p for p in os.environ["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists()]
    return {**os.environ, "PATH": f"{bindir}:{':'.join(path)}"}, calls


def run_install(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(INSTALL), *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def snapshot(root: Path) -> dict[str, tuple[str, str, int]]:
    """Every path under root: (mode, sha256 or link target, mtime_ns)."""
    out: dict[str, tuple[str, str, int]] = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        if p.is_symlink():
            what = "-> " + os.readlink(p)
        elif p.is_file():
            what = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            what = "dir"
        out[str(p.relative_to(root))] = (stat.filemode(st.st_mode), what, st.st_mtime_ns)
    return out


def mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


@pytest.fixture
def staged(tmp_path: Path) -> tuple[Path, dict[str, str], Path]:
    env, calls = fake_bin(tmp_path)
    dest = tmp_path / "dest"
    run_install("--destdir", str(dest), "--no-venv", env=env)
    return dest, env, calls


def test_destdir_lays_out_every_file_with_its_mode(
    staged: tuple[Path, dict[str, str], Path],
) -> None:
    dest, _, calls = staged
    files = {str(p.relative_to(dest)) for p in dest.rglob("*") if not p.is_dir()}
    templates = {f"etc/appliance/templates/{p.name}" for p in (REPO / "templates").glob("*.toml")}
    expected = {
        *(f"etc/systemd/system/{u}" for u in UNITS),
        *templates,
        "etc/appliance/realtime.env",
        "etc/appliance/long.env",
        "etc/appliance/batch.env",
        "etc/appliance/router.toml",
        "etc/appliance/keys/api.key",
        "etc/appliance/keys/admin.token",
        "opt/appliance/bin/appliance",
        "opt/appliance/share/doc/operations.md",
        "opt/appliance/share/observability/prometheus.yml",
        "opt/appliance/share/observability/grafana-dashboard.json",
        "opt/appliance/share/install-manifest",
    }
    assert files == expected
    assert len(templates) >= 5
    for f in expected - {"opt/appliance/bin/appliance"}:
        want = 0o600 if "/keys/" in f else 0o644
        assert mode(dest / f) == want, f
    assert mode(dest / "etc/appliance/keys") == 0o750
    assert os.readlink(dest / "opt/appliance/bin/appliance") == "../venv/bin/appliance"
    # --destdir: no user, no systemctl, no chown.
    assert not calls.exists(), calls.read_text()


def test_contents_units_env_files_keys(staged: tuple[Path, dict[str, str], Path]) -> None:
    dest, _, _ = staged
    for unit in UNITS:  # the default prefix: shipped as they are
        assert (dest / "etc/systemd/system" / unit).read_text() == (
            REPO / "systemd" / unit
        ).read_text()
    for t in (REPO / "templates").glob("*.toml"):
        assert (dest / "etc/appliance/templates" / t.name).read_bytes() == t.read_bytes()
    for name, port in (("realtime", 8001), ("long", 8002), ("batch", 8003)):
        env = parse_env(dest / f"etc/appliance/{name}.env")
        assert env == {
            "APPLIANCE_TEMPLATE": "cpu-demo",
            "APPLIANCE_HOST": "127.0.0.1",
            "APPLIANCE_PORT": str(port),
            "CUDA_VISIBLE_DEVICES": "",
            "APPLIANCE_ARGS": "",
        }
    keys = [(dest / "etc/appliance/keys" / k).read_text() for k in ("api.key", "admin.token")]
    assert all(KEY_RE.match(k) for k in keys) and keys[0] != keys[1]
    for src in ("prometheus.yml", "grafana-dashboard.json"):
        assert (dest / "opt/appliance/share/observability" / src).read_bytes() == (
            REPO / "templates/observability" / src
        ).read_bytes()
    from appliance.tools.router import load_router_config

    cfg = load_router_config(str(dest / "etc/appliance/router.toml"), {})
    assert cfg.pools == {
        "realtime": "http://127.0.0.1:8001",
        "long": "http://127.0.0.1:8002",
        "batch": "http://127.0.0.1:8003",
    }
    assert (cfg.default_pool, cfg.long_pool, cfg.classes, cfg.port) == (
        "realtime",
        "long",
        {"batch": "batch"},
        8000,
    )


def parse_env(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def test_second_run_changes_nothing(staged: tuple[Path, dict[str, str], Path]) -> None:
    dest, env, _ = staged
    before = snapshot(dest)
    run_install("--destdir", str(dest), "--no-venv", env=env)
    assert snapshot(dest) == before


def test_operator_files_and_keys_are_never_overwritten(
    staged: tuple[Path, dict[str, str], Path],
) -> None:
    dest, env, _ = staged
    envf, key, unit = (
        dest / "etc/appliance/realtime.env",
        dest / "etc/appliance/keys/api.key",
        dest / "etc/systemd/system/appliance@.service",
    )
    envf.write_text(
        envf.read_text().replace("APPLIANCE_TEMPLATE=cpu-demo", "APPLIANCE_TEMPLATE=13b-a10")
    )
    key.write_text("sk-operator-chosen\n")
    key.chmod(0o644)
    unit.write_text("stale\n")
    run_install("--destdir", str(dest), "--no-venv", env=env)
    assert "APPLIANCE_TEMPLATE=13b-a10" in envf.read_text()
    assert key.read_text() == "sk-operator-chosen\n" and mode(key) == 0o600  # mode repaired only
    assert unit.read_text() == (REPO / "systemd/appliance@.service").read_text()  # ours: replaced


def test_uninstall_keeps_keys_and_edits_then_purge_removes_all(
    staged: tuple[Path, dict[str, str], Path],
) -> None:
    dest, env, calls = staged
    keys = {k: (dest / "etc/appliance/keys" / k).read_text() for k in ("api.key", "admin.token")}
    edited = dest / "etc/appliance/long.env"
    edited.write_text(edited.read_text() + "# the operator's\n")
    models = dest / "var/lib/appliance/models/m"  # as the service would have created it
    models.mkdir(parents=True)
    (models / "config.json").write_text("{}")
    wants = dest / "etc/systemd/system/appliance.target.wants"
    wants.mkdir()
    (wants / "appliance@realtime.service").symlink_to("/etc/systemd/system/appliance@.service")
    run_install("--destdir", str(dest), "--uninstall", env=env)
    left = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if not p.is_dir())
    assert left == [
        "etc/appliance/keys/admin.token",
        "etc/appliance/keys/api.key",
        "etc/appliance/long.env",
        "var/lib/appliance/models/m/config.json",
    ]
    assert {k: (dest / "etc/appliance/keys" / k).read_text() for k in keys} == keys
    assert not (dest / "opt").exists() and not (dest / "etc/systemd").exists()
    run_install("--destdir", str(dest), "--purge", env=env)
    assert list(dest.iterdir()) == []
    assert not calls.exists()


def test_prefix_instances_and_gpu_detection(tmp_path: Path) -> None:
    env, calls = fake_bin(tmp_path, gpus=2)
    dest = tmp_path / "dest"
    run_install(
        "--destdir",
        str(dest),
        "--no-venv",
        "--prefix",
        "/srv/llm",
        "--instance",
        "chat:9001",
        "--instance",
        "long:9002",
        "--instance",
        "batch:9003:1,0",
        "--router-port",
        "9000",
        env=env,
    )
    unit = (dest / "etc/systemd/system/appliance@.service").read_text()
    assert "ExecStart=/srv/llm/bin/appliance up " in unit and "/opt/appliance" not in unit
    assert (dest / "srv/llm/bin").is_dir() and not (dest / "opt").exists()
    # A GPU box: the GPU template, GPUs dealt round robin unless given.
    got = {n: parse_env(dest / f"etc/appliance/{n}.env") for n in ("chat", "long", "batch")}
    assert {n: e["CUDA_VISIBLE_DEVICES"] for n, e in got.items()} == {
        "chat": "0",
        "long": "1",
        "batch": "1,0",
    }
    assert {e["APPLIANCE_TEMPLATE"] for e in got.values()} == {"7b-a10"}
    assert got["batch"]["APPLIANCE_PORT"] == "9003"
    router = (dest / "etc/appliance/router.toml").read_text()
    assert "port = 9000" in router and 'default_pool = "chat"' in router
    assert not calls.exists()


def test_bad_options_are_refused(tmp_path: Path) -> None:
    for args in (
        ["--prefix", "relative"],
        ["--torch", "rocm"],
        ["--system", "--dev"],
        ["--destdir", str(tmp_path), "--no-venv", "--instance", "bad name:1"],
        ["--destdir", str(tmp_path), "--instance", "x:notaport"],
        ["--bogus"],
    ):
        proc = subprocess.run([str(INSTALL), *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert proc.stderr.startswith("install.sh: ")


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_install_sh_is_shellcheck_clean() -> None:
    proc = subprocess.run(["shellcheck", str(INSTALL)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("APPLIANCE_TEST_REAL_INSTALL") != "1",
    reason="a real venv install (2 GB, ~1.5 min on 2 cores): set APPLIANCE_TEST_REAL_INSTALL=1",
)
def test_real_install_into_destdir(tmp_path: Path) -> None:
    """The venv step: CPU torch, the package installed (not editable), scripts naming the venv
    where it will live; a second run finds it up to date."""
    dest = tmp_path / "dest"
    try:
        check_real_install(dest, tmp_path)
    finally:
        shutil.rmtree(dest, ignore_errors=True)  # 2 GB


def check_real_install(dest: Path, tmp_path: Path) -> None:
    run_install("--destdir", str(dest), "--torch", "cpu", "--torch-index", "")
    venv = dest / "opt/appliance/venv"
    assert (venv / "bin/appliance").read_text().splitlines()[
        0
    ] == "#!/opt/appliance/venv/bin/python"
    assert not subprocess.run(
        ["grep", "-rlI", str(dest), str(venv / "bin"), str(venv / "pyvenv.cfg")],
        capture_output=True,
    ).stdout
    out = subprocess.run(
        [
            str(venv / "bin/python"),
            "-c",
            "import appliance, torch; print(appliance.__file__); print(torch.__version__)",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout.split()
    assert out[0].startswith(str(venv / "lib")) and out[1].endswith("+cpu")
    # The service cannot write into its venv: what it imports was byte-compiled at install,
    # the package itself too (pip's own compile is off; install.sh's compile_venv does it).
    site = Path(out[0]).parent.parent
    for module in (
        "torch/__init__.py",
        "appliance/engine/llm_engine.py",
        "transformers/models/llama/modeling_llama.py",
    ):
        src = site / module
        assert list((src.parent / "__pycache__").glob(f"{src.stem}.*.pyc")), module
    again = run_install("--destdir", str(dest), "--torch", "cpu", "--torch-index", "")
    assert "up to date" in again.stdout


# ---------------------------------------------------------------------------------------------
# Observability files (the live check of the metric names is in test_router.py)

DASHBOARD = REPO / "templates/observability/grafana-dashboard.json"


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_grafana_dashboard_is_valid_dashboard_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    assert {v["name"] for v in dash["templating"]["list"]} >= {"datasource", "pool"}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["type"] in {"row", "timeseries", "heatmap", "stat", "gauge"}
        assert (
            set(p["gridPos"]) == {"h", "w", "x", "y"}
            and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        )
        for t in p.get("targets", []):
            assert t["refId"] and t["expr"] and t["datasource"]["uid"] == "${datasource}"
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for topic in (
        "throughput",
        "time to first token",
        "time per output token",
        "kv cache",
        "batch size",
        "preemptions by mode",
        "queue time",
        "rejected",
    ):
        assert topic in titles, topic
    heat = [p for p in dash["panels"] if "batch size" in p["title"].lower()]
    assert heat and heat[0]["type"] == "heatmap"


def test_prometheus_config_scrapes_the_default_instances() -> None:
    doc = yaml.safe_load((REPO / "templates/observability/prometheus.yml").read_text())
    job = doc["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    targets = {t["labels"]["pool"]: t["targets"] for t in job["static_configs"]}
    assert targets == {
        "realtime": ["127.0.0.1:8001"],
        "long": ["127.0.0.1:8002"],
        "batch": ["127.0.0.1:8003"],
    }

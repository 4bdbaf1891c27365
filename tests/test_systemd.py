"""The systemd units, as install.sh installs them: `systemd-analyze verify` with an empty
stderr, `systemd-analyze security` at 3.0 or better, and `appliance@test` run for real by a
private systemd (PID 1 of new PID and mount namespaces): READY, /health, the watchdog held,
a reload, a restart after a crash, a clean stop."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import free_port, write_template

REPO = Path(__file__).resolve().parents[1]
ANALYZE = shutil.which("systemd-analyze")
SYSTEMD = Path("/lib/systemd/systemd")
WATCHDOG_S = 4  # WatchdogSec= of the test's drop-in
needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze is not installed (Debian: apt-get install systemd)"
)


def install(dest: Path, *args: str) -> None:
    proc = subprocess.run(
        [str(REPO / "install.sh"), "--destdir", str(dest), "--no-venv", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def units(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The units installed with a prefix whose bin/appliance exists here (verify checks that
    ExecStart= is executable): the repo venv's."""
    tmp = tmp_path_factory.mktemp("units")
    prefix = tmp / "prefix"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin/appliance").symlink_to(Path(sys.executable).parent / "appliance")
    install(tmp / "dest", "--prefix", str(prefix))
    return tmp / "dest/etc/systemd/system"


@needs_analyze
def test_units_pass_systemd_analyze_verify_with_empty_stderr(units: Path) -> None:
    names = [
        "appliance@test.service",
        "appliance.target",
        "appliance-router.service",
        "appliance-inspect@test.service",
        "appliance-inspect@test.timer",
    ]
    proc = subprocess.run(
        [ANALYZE, "verify", "--man=no", *names],
        cwd=units,  # type: ignore[list-item]
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr


@needs_analyze
@pytest.mark.parametrize(
    "unit", ["appliance@test.service", "appliance-router.service", "appliance-inspect@test.service"]
)
def test_units_score_3_or_better_in_systemd_analyze_security(units: Path, unit: str) -> None:
    proc = subprocess.run(
        [ANALYZE, "security", "--offline=true", "--no-pager", str(units / unit)],  # type: ignore[list-item]
        capture_output=True,
        text=True,
        timeout=60,
    )
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert m, proc.stdout + proc.stderr
    assert float(m.group(1)) <= 3.0, proc.stdout


def test_unit_promises() -> None:
    """What the service relies on: notify with a watchdog, reload by SIGHUP, drain on SIGTERM
    within TimeoutStopSec, hardening, the env file of the instance, the NVIDIA devices."""
    text = (REPO / "systemd/appliance@.service").read_text()
    keys: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            k, _, v = line.partition("=")
            keys.setdefault(k, []).append(v)
    one = {k: v[-1] for k, v in keys.items()}
    assert one["Type"] == "notify" and int(one["WatchdogSec"]) > 0
    assert one["ExecReload"] == "/bin/kill -HUP $MAINPID" and one["KillSignal"] == "SIGTERM"
    assert one["Restart"] == "on-failure" and one["EnvironmentFile"] == "/etc/appliance/%i.env"
    check_timeout_stop_leaves_the_drain_its_time(int(one["TimeoutStopSec"]))
    for k, v in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "DevicePolicy": "closed",
    }.items():
        assert one[k] == v, k
    assert "char-nvidia* rw" in keys["DeviceAllow"] and int(one["LimitNOFILE"]) >= 65536
    assert "/var/lib/appliance" in one["ReadWritePaths"] and one["WantedBy"] == "appliance.target"


def check_timeout_stop_leaves_the_drain_its_time(timeout_stop_s: int) -> None:
    """systemd kills the service TimeoutStopSec after SIGTERM: that must cover the default
    drain_timeout_s and every shipped template's, plus what the stop takes after the drain
    (cut streams' last chunks, the engine's shutdown, uvicorn's; state.STOP_AFTER_DRAIN_S)."""
    from appliance.config import ServerConfig, load_config
    from appliance.config_sources import list_templates
    from appliance.server.state import STOP_AFTER_DRAIN_S

    drains = {"default": ServerConfig().drain_timeout_s}
    for name in list_templates():
        drains[name] = load_config(name).server.drain_timeout_s
    assert len(drains) > 1
    for name, drain in drains.items():
        assert timeout_stop_s >= drain + STOP_AFTER_DRAIN_S, (name, drain, timeout_stop_s)


def test_timeout_stop_check_refuses_a_drain_longer_than_the_unit_allows() -> None:
    from appliance.config import ServerConfig
    from appliance.server.state import STOP_AFTER_DRAIN_S

    tight = int(ServerConfig().drain_timeout_s + STOP_AFTER_DRAIN_S) - 1
    with pytest.raises(AssertionError):
        check_timeout_stop_leaves_the_drain_its_time(tight)


# ---------------------------------------------------------------------------------------------
# A private systemd as PID 1

# The checkout the tests run from (an editable install imports its sources from here).
CHECKOUT = Path(__file__).resolve().parents[1]

BOOT = r"""
set -eu
mount --make-rprivate /
mount -t tmpfs tmpfs /run
mkdir -p /run/nstest/etc /run/nstest/model /run/nstest/units
# The installed /etc (env file, keys, templates) over a copy of this /etc, with the system
# user install.sh would create.
cp -a /etc/. /run/nstest/etc/
cp -a "$DEST/etc/." /run/nstest/etc/
echo "appliance:x:$SVC_ID:$SVC_ID:LLM inference appliance:/var/lib/appliance:/usr/sbin/nologin" >> /run/nstest/etc/passwd
echo "appliance:x:$SVC_ID:" >> /run/nstest/etc/group
chgrp "$SVC_ID" /run/nstest/etc/appliance/keys      # what install.sh does on a live system
chown "$SVC_ID:$SVC_ID" /run/nstest/etc/appliance/keys/*
mount --bind /run/nstest/etc /etc
mount --bind "$MODEL" /run/nstest/model
cp -a "$PREFIX_DIR" /run/nstest/prefix
# The unit search path is ours alone (SYSTEMD_UNIT_PATH): the installed units, the test's
# drop-in, and empty stand-ins for the targets a service is ordered after. Nothing of the
# host's sysinit.target (tmpfiles, sysctl, journald ...) can start in here.
cp -a "$DEST/etc/systemd/system/." "$UNITS/." /run/nstest/units/
for u in sysinit.target basic.target shutdown.target network-online.target; do
  printf '[Unit]\nDefaultDependencies=no\n' > "/run/nstest/units/$u"
done
printf '[Unit]\nDefaultDependencies=no\nWants=appliance@test.service appliance-router.service\n' > /run/nstest/units/nstest.target
# Private /tmp, /var/* and /opt; the installed prefix there, its venv this checkout's.
# A checkout (and its venv) under one of those stays visible at its own path: scripts in a
# venv name their interpreter by absolute path.
# (An editable install also needs the checkout's sources.)
mkdir -p /run/nstest/venv /run/nstest/checkout
mount --bind "$VENV" /run/nstest/venv
mount --bind "$CHECKOUT" /run/nstest/checkout
for d in /tmp /var/lib /var/cache /var/log /var/tmp /opt; do mount -t tmpfs tmpfs "$d"; done
mkdir -p "$CHECKOUT" "$VENV"
mount --bind /run/nstest/checkout "$CHECKOUT"
mount --bind /run/nstest/venv "$VENV"
cp -a /run/nstest/prefix /opt/appliance
ln -s "$VENV" /opt/appliance/venv
export container=unshare SYSTEMD_UNIT_PATH=/run/nstest/units
exec /lib/systemd/systemd --system --unit=nstest.target --log-target=null --show-status=no
"""


def unshare_refusal() -> str | None:
    if os.geteuid() != 0:
        return "needs root (a private systemd in new PID and mount namespaces)"
    if not SYSTEMD.exists() or shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "systemd, unshare or nsenter is missing"
    proc = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount", "--uts", "--ipc", "--mount-proc", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if proc.returncode != 0:
        return f"the kernel refuses the namespaces: {proc.stderr.strip()}"
    return None


class PrivateSystemd:
    def __init__(self, boot: Path, env: dict[str, str], boot_log: Path) -> None:
        self.boot_log = boot_log
        with open(boot_log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    "unshare",
                    "--pid",
                    "--fork",
                    "--mount",
                    "--uts",
                    "--ipc",
                    "--mount-proc",
                    "bash",
                    str(boot),
                ],
                env={**os.environ, **env},
                start_new_session=True,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.pid = self._find_pid1()

    def service_log(self) -> str:
        """The unit's output, read through the namespace's root."""
        path = Path(f"/proc/{self.pid}/root/run/nstest/service.log")
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""

    def _find_pid1(self) -> int:
        deadline = time.monotonic() + 60  # the boot script copies /etc first: slow on a slow disk
        while time.monotonic() < deadline:
            out = subprocess.run(
                ["pgrep", "-P", str(self.proc.pid), "-x", "systemd"], capture_output=True, text=True
            ).stdout.split()
            if out:
                return int(out[0])
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError("the private systemd did not start: " + self.boot_log.read_text())

    def run(self, *args: str, check: bool = False) -> str:
        proc = subprocess.run(
            ["nsenter", "-t", str(self.pid), "-m", "-p", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check:
            assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout.strip()

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", unit, "-p", ",".join(props))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait(self, unit: str, what: str, cond: object, timeout_s: float = 120.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        props = [
            "ActiveState",
            "SubState",
            "Result",
            "NRestarts",
            "MainPID",
            "StatusText",
            "ExecMainStatus",
        ]
        state: dict[str, str] = {}
        while time.monotonic() < deadline:
            state = self.show(unit, *props)
            if state and cond(state):  # type: ignore[operator]
                return state
            if state.get("ActiveState") == "failed":
                break
            time.sleep(0.2)
        raise AssertionError(
            f"{unit} never {what}: {state}\n{self.run('systemctl', 'status', '--no-pager', unit)}\n"
            f"{self.run('systemctl', 'list-jobs', '--no-pager')}\n"
            f"--- service log ---\n{self.service_log()}"
        )

    def close(self) -> None:
        for pid in (self.pid, self.proc.pid):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait(10)


@pytest.fixture
def private_systemd(
    tmp_path: Path, tiny_model_dir: Path
) -> Iterator[tuple[PrivateSystemd, int, int, Path]]:
    reason = unshare_refusal()
    if reason:
        pytest.skip(reason)
    port, router_port = free_port(), free_port()
    dest = tmp_path / "dest"
    install(
        dest,
        "--instance",
        f"test:{port}",
        "--template",
        "nstest",
        "--router-port",
        str(router_port),
    )
    conf = dest / "etc/appliance/router.toml"  # the operator keeps the router on loopback here
    conf.write_text(conf.read_text().replace('host = "0.0.0.0"', 'host = "127.0.0.1"'))
    # An operator template in /etc/appliance/templates, naming the model where it is mounted.
    write_template(dest / "etc/appliance/templates/nstest.toml", Path("/run/nstest/model"))
    tiny_model_dir.chmod(0o755)
    units = tmp_path / "units"
    dropins = units / "appliance@test.service.d"
    dropins.mkdir(parents=True)
    # journald does not run in there: the service writes its log into the namespace's /run.
    common = ["[Service]", "StandardOutput=append:/run/nstest/service.log", "StandardError=inherit"]
    python_home = Path(os.path.realpath(sys.executable)).parents[1]
    if str(python_home).startswith(("/root/", "/home/")):
        # This checkout's interpreter lives in a home directory (pyenv): show just it.
        common += ["ProtectHome=tmpfs", f"BindReadOnlyPaths={python_home}"]
    venv = Path(sys.executable).parents[1]
    for path in (CHECKOUT, venv):
        if str(path).startswith(("/tmp/", "/var/tmp/")):
            # A checkout under /tmp: the unit's PrivateTmp would hide it from the service.
            common.append(f"BindReadOnlyPaths={path}")
    # A short watchdog, so that the test would see a kill during loading or serving.
    (dropins / "test.conf").write_text("\n".join([*common, f"WatchdogSec={WATCHDOG_S}"]) + "\n")
    (units / "appliance-router.service.d").mkdir()
    (units / "appliance-router.service.d/test.conf").write_text("\n".join(common) + "\n")
    boot = tmp_path / "boot.sh"
    boot.write_text(BOOT)
    env = {
        "DEST": str(dest),
        "PREFIX_DIR": str(dest / "opt/appliance"),
        "MODEL": str(tiny_model_dir),
        "VENV": str(Path(sys.executable).parents[1]),
        "CHECKOUT": str(CHECKOUT),
        "UNITS": str(units),
        "SVC_ID": "61234",
    }
    ns = PrivateSystemd(boot, env, tmp_path / "boot.log")
    try:
        yield ns, port, router_port, dest
    finally:
        ns.close()


@pytest.mark.slow
def test_appliance_test_runs_under_a_private_systemd(
    private_systemd: tuple[PrivateSystemd, int, int, Path],
) -> None:
    ns, port, router_port, dest = private_systemd
    unit = "appliance@test.service"
    url = f"http://127.0.0.1:{port}"
    state = ns.wait(unit, "became active (READY=1)", lambda s: s["ActiveState"] == "active")
    active_at = time.monotonic()
    # READY=1 comes after the weights are loaded: the engine answers at once.
    assert state["StatusText"].startswith("serving"), state
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    assert httpx.get(url + "/ready", timeout=5).status_code == 200
    user = ns.run("ps", "-o", "user=", "-p", state["MainPID"])
    assert user in ("appliance", "61234"), user
    # appliance-router.service (DynamicUser, its own hardening) routes to the instance.
    router = f"http://127.0.0.1:{router_port}"
    ns.wait(
        "appliance-router.service",
        "became active",
        lambda s: s["SubState"] == "running",
        timeout_s=60,
    )
    api = {"Authorization": "Bearer " + (dest / "etc/appliance/keys/api.key").read_text().strip()}
    models = httpx.get(router + "/v1/models", headers=api, timeout=10)
    assert models.status_code == 200 and models.headers["x-appliance-pool"] == "test", models.text
    assert httpx.get(router + "/v1/models", timeout=10).status_code == 401  # keys enforced
    # The watchdog held through loading, and holds while serving: a full WatchdogSec (and a
    # margin) since READY, however quickly the checks above went, with no kill or restart.
    time.sleep(max(0.0, active_at + WATCHDOG_S + 1.5 - time.monotonic()))
    again = ns.show(unit, "NRestarts", "MainPID", "ActiveState")
    assert again == {"NRestarts": "0", "MainPID": state["MainPID"], "ActiveState": "active"}

    # systemctl reload: SIGHUP re-applies the template from disk (here: a new max_num_seqs).
    admin = {
        "Authorization": "Bearer " + (dest / "etc/appliance/keys/admin.token").read_text().strip()
    }
    template = dest / "etc/appliance/templates/nstest.toml"
    ns.run(
        "sed",
        "-i",
        "s/^max_num_seqs = 16$/max_num_seqs = 7/",
        f"/etc/appliance/templates/{template.name}",
        check=True,
    )
    ns.run("systemctl", "reload", unit, check=True)

    def reloaded() -> bool:
        try:
            r = httpx.get(url + "/admin/config", headers=admin, timeout=5)
        except httpx.TransportError:
            return False
        return r.status_code == 200 and '"max_num_seqs":7' in r.text.replace(" ", "")

    deadline = time.monotonic() + 60
    while not reloaded():
        assert time.monotonic() < deadline, ns.service_log()
        time.sleep(0.2)
    assert ns.show(unit, "NRestarts", "MainPID")["MainPID"] == state["MainPID"]

    # A crash (SIGKILL to the main process) is restarted: Restart=on-failure.
    ns.run("kill", "-9", state["MainPID"], check=True)
    restarted = ns.wait(
        unit,
        "restarted",
        lambda s: (
            s["NRestarts"] == "1"
            and s["ActiveState"] == "active"
            and s["MainPID"] not in ("0", state["MainPID"])
        ),
    )
    assert httpx.get(url + "/health", timeout=5).status_code == 200

    # systemctl stop: SIGTERM drains and the service exits 0.
    ns.run("systemctl", "stop", unit, check=True)
    stopped = ns.show(unit, "ActiveState", "Result", "ExecMainStatus", "ExecMainCode")
    assert stopped["ActiveState"] == "inactive" and stopped["Result"] == "success", stopped
    assert stopped["ExecMainStatus"] == "0", stopped
    assert restarted["NRestarts"] == "1"
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)
    # Stopping appliance.target stops what is PartOf it: the router.
    ns.run("systemctl", "stop", "appliance.target", check=True)
    gone = ns.wait(
        "appliance-router.service",
        "stopped",
        lambda s: s["ActiveState"] == "inactive",
        timeout_s=60,
    )
    assert gone["Result"] == "success", gone

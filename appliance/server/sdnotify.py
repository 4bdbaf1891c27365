"""systemd's notify protocol (sd_notify(3)) without libsystemd: one datagram to $NOTIFY_SOCKET.

No-op when the variable is unset (not under systemd, or Type= is not notify), so callers never
need to check.
"""

from __future__ import annotations

import os
import socket


def notify(msg: str) -> bool:
    """Send e.g. "READY=1", "STATUS=loading weights", "RELOADING=1". True if sent."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    # "@" marks an abstract-namespace socket (a leading NUL byte).
    addr = "\0" + path[1:] if path.startswith("@") else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(addr)
            sock.sendall(msg.encode())
    except OSError:
        return False
    return True


def watchdog_interval_s() -> float | None:
    """Seconds between pings systemd expects (half its WatchdogSec), or None without one."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 1e6 / 2
    except ValueError:
        return None


def watchdog_ping() -> bool:
    """WATCHDOG=1 when systemd asked for a watchdog (WATCHDOG_USEC set for this process)."""
    if watchdog_interval_s() is None:
        return False
    return notify("WATCHDOG=1")

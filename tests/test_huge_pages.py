"""The CPU KV pool on transparent huge pages (appliance/cpu/huge_pages.py): zeros whatever the
memory held before, and, where the kernel grants huge pages to marked ranges, an engine's KV
pool actually backed by them (read back from /proc/self/smaps)."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import pytest
import torch

from appliance.cpu.huge_pages import HUGE_PAGE_BYTES, zeros_on_huge_pages
from tests.test_preemption import engine_for

MiB = 1 << 20


def thp_setting(name: str) -> str | None:
    """The bracketed choice of /sys/kernel/mm/transparent_hugepage/NAME; None without THP."""
    path = Path("/sys/kernel/mm/transparent_hugepage") / name
    if not path.exists():
        return None
    chosen = re.search(r"\[([^\]]+)\]", path.read_text())
    return chosen.group(1) if chosen else None


def huge_kib_around(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def thp_allowed_here() -> bool:
    """Whether this process may get huge pages (a parent's prctl(PR_SET_THP_DISABLE) is
    inherited; /proc/self/status says so from Linux 5.0)."""
    status = Path("/proc/self/status").read_text()
    found = re.search(r"^THP_enabled:\s*(\d)", status, re.MULTILINE)
    return found is None or found.group(1) == "1"


# Marked ranges get huge pages at their first touch where THP is on for them and a fault may
# compact memory to find one (defrag not "never").
grants_huge_pages = pytest.mark.skipif(
    thp_setting("enabled") not in ("always", "madvise")
    or thp_setting("defrag") in (None, "never")
    or not thp_allowed_here(),
    reason="transparent huge pages are off for madvise'd ranges here",
)


def test_zeros_even_in_reused_memory() -> None:
    for _ in range(3):
        t = zeros_on_huge_pages((3, 5 * MiB // 4), torch.float32)
        assert t.shape == (3, 5 * MiB // 4) and t.dtype == torch.float32
        assert not t.any()
        t.fill_(float("nan"))  # freed dirty: the next one must still come back zeroed
        del t
    small = zeros_on_huge_pages((7,), torch.bfloat16)  # under one huge page: small pages
    assert small.dtype == torch.bfloat16 and not small.any()


@grants_huge_pages
def test_a_large_tensor_is_backed_by_huge_pages() -> None:
    t = zeros_on_huge_pages((16 * MiB,), torch.float32)  # 64 MiB
    assert huge_kib_around(t.data_ptr() + 32 * MiB) >= 2048
    # The comparison: without the mark, madvise mode leaves a fresh mapping on small pages.
    # A mapping of its own, touched here: torch.zeros took memory whose history depended on
    # the tests run before it in the process (in the full suite, once, 26 MiB of huge pages).
    if thp_setting("enabled") == "madvise":
        mapping = mmap.mmap(-1, 64 * MiB)
        plain = torch.frombuffer(mapping, dtype=torch.uint8)
        plain.fill_(1)
        assert huge_kib_around(plain.data_ptr() + 32 * MiB) == 0
        del plain
        mapping.close()


@grants_huge_pages
def test_the_engines_cpu_kv_pool_is_on_huge_pages(tiny_model_dir: Path) -> None:
    engine = engine_for(tiny_model_dir, cache__kv_cache_memory=0.25)
    k = engine.runner.kv.device_caches[0].k
    nbytes = k.numel() * k.element_size()
    assert nbytes >= 4 * HUGE_PAGE_BYTES, "pool layer too small for the check"
    assert huge_kib_around(k.data_ptr() + nbytes // 2) >= 2048
    # ...and it serves: the pool starts zeroed and holds what the forward writes.
    out = engine.generate([[5, 6, 7, 8]], None)[0]
    assert out.token_ids

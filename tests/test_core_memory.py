"""The engine core's memory stays flat under ever new batch shapes (issue 15's soak):
oneDNN's primitive caches are bounded and filled at load (appliance.cpu.primitive_cache), and
freed heap goes back to the OS when the core idles and every few busy seconds
(appliance.engine.heap)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from appliance.cpu.primitive_cache import CAPACITY_ENV
from appliance.engine.heap import HeapTrimmer

# A fresh interpreter per capacity: both caches read theirs once, at their first use. Four
# prepacked float32 weights of the small demo model's shapes (qkv, o, gate|up, down), warmed
# as the backend does, then 40 row counts the warm-up never saw, as prefill chunks and decode
# batches bring them; the malloc'd bytes in use (glibc mallinfo2) before and after.
_CHILD = r"""
import ctypes, json, sys
import torch
from appliance.cpu.primitive_cache import bound_primitive_caches, warm_primitive_caches
from appliance.layers.linear import RowParallelLinear
from appliance.layers.matmul import CopyMatmul
from appliance.layers.matmul import CopyMatmul

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info

def in_use():
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd

bound_primitive_caches(int(sys.argv[1]))
torch.manual_seed(0)
mods, widths = [], []
for out_f, in_f in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
    m = RowParallelLinear(in_f, out_f)
    m.wire(CopyMatmul(torch.ops.mkldnn._reorder_linear_weight(torch.randn(out_f, in_f), 64), True))
    mods.append(m)
    widths.append(in_f)
warm = warm_primitive_caches(mods, 33)
before = in_use()
with torch.inference_mode():
    for rows in range(200, 240):
        for m, in_f in zip(mods, widths):
            m._matmul(torch.zeros(rows, in_f), None)
print(json.dumps({"warm": warm, "growth_mib": (in_use() - before) / 2**20}))
"""


def _growth(capacity: int) -> dict[str, float]:
    # The capacity under test, not one from this environment (which would win).
    child_env = {k: v for k, v in os.environ.items() if k not in CAPACITY_ENV}
    child_env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(capacity)],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env,
        cwd=Path(__file__).parent,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_new_matmul_shapes_do_not_grow_memory_past_the_bounded_caches() -> None:
    bounded = _growth(64)
    # The warm-up filled the caches: 16 row counts x 4 weights >= 64 entries.
    assert bounded["warm"] == 64
    # 160 new (rows, weight) primitives replace evicted ones: memory stays where it was.
    assert bounded["growth_mib"] < 10.0, bounded
    # The libraries' default keeps every one of them (~0.57 MiB each on a Zen 3; the check
    # that the measurement sees what it is there to see).
    unbounded = _growth(1024)
    assert unbounded["growth_mib"] > 3 * max(bounded["growth_mib"], 10.0), (bounded, unbounded)


def test_heap_trimmer_trims_when_idle_and_on_an_interval_while_busy() -> None:
    now = [0.0]
    trimmer = HeapTrimmer(30.0, clock=lambda: now[0])
    calls: list[int] = []
    trimmer._trim = lambda pad: calls.append(pad) or 1  # type: ignore[assignment]
    trimmer.idle()  # after the load: its garbage goes back once
    trimmer.idle()  # nothing stepped since: nothing to give
    assert len(calls) == 1
    for t in (1.0, 10.0, 29.0):  # busy, within the interval
        now[0] = t
        trimmer.stepped()
    assert len(calls) == 1
    now[0] = 31.0
    trimmer.stepped()  # 30 s since the last trim
    assert len(calls) == 2
    trimmer.idle()  # nothing stepped since that trim
    now[0] = 32.0
    trimmer.stepped()
    trimmer.idle()  # a step ran: its activations go back
    assert len(calls) == 3 and trimmer.trims == 3


def test_heap_trimmer_off_at_zero() -> None:
    trimmer = HeapTrimmer(0.0)
    assert not trimmer.enabled
    trimmer.stepped()
    trimmer.idle()
    assert trimmer.trims == 0

"""Host tensors the decode attention reads at random: on transparent huge pages.

The KV pool's blocks lie anywhere in it and each decode row reads its blocks in a 16-token
run, so a step over 2k-token contexts touches a new 4 KiB page every few rows read: one TLB
walk each. On 2 MiB pages the same reads take 4-6% less time (docs/benchmarks.md, "Sapphire
Rapids, afternoon"). Linux backs a range with huge pages on first touch only where the range
was marked (madvise(MADV_HUGEPAGE)) and the system's policy allows it (`enabled` = always or
madvise); elsewhere the mark is a no-op and the tensor is the same zeroed tensor on small
pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
# (Linux; 14 in its headers)
_MADV_HUGEPAGE: int = getattr(mmap, "MADV_HUGEPAGE", 14)


def _madvise() -> Callable[[int, int, int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    fn = ctypes.CDLL(name, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def huge_page_span(start: int, nbytes: int) -> tuple[int, int] | None:
    """The whole 2 MiB pages inside [start, start + nbytes): (first address, bytes); None when
    the range holds none (a small tensor stays on small pages)."""
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = (start + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return (first, last - first) if last > first else None


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the host, its whole 2 MiB pages marked for huge pages
    before the zeros first touch them (a large allocation comes from a fresh mapping that no
    page backs yet)."""
    tensor = torch.empty(shape, dtype=dtype)
    span = huge_page_span(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    if span is not None and _MADVISE is not None and _MADVISE(span[0], span[1], _MADV_HUGEPAGE):
        # EINVAL where the kernel has no transparent huge pages: small pages, as before.
        log.debug("madvise(MADV_HUGEPAGE): errno %d", ctypes.get_errno())
    return tensor.zero_()

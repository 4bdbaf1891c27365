"""Host tensors the decode attention reads at random: on transparent huge pages.

The KV pool's blocks lie anywhere in it and each decode row reads its blocks in a 16-token
run, so a step over 2k-token contexts touches a new 4 KiB page every few rows read: one TLB
walk each. On 2 MiB pages the same reads take 3-6% less time (docs/benchmarks.md, "Sapphire
Rapids, afternoon"). Linux backs a range with huge pages on first touch only where the range
was marked (madvise(MADV_HUGEPAGE)) and the system's policy allows it (`enabled` = always or
madvise); elsewhere the mark is a no-op and the tensor is the same zeroed tensor on small
pages. The tensor gets a mapping of its own: memory from the allocator may have been touched
before (a freed heap region it reuses), and touched small pages stay small.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap

import torch

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
# (Linux only; elsewhere the tensors stay on the allocator's pages)
_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the host, in an anonymous mapping of its own marked for
    huge pages before the zeros first touch it, starting on a 2 MiB boundary. A tensor under
    one huge page, or a system without MADV_HUGEPAGE, gets plain torch.zeros."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE_BYTES or _MADV_HUGEPAGE is None:
        return torch.zeros(shape, dtype=dtype)
    # One huge page more than needed: the tensor starts at the first 2 MiB boundary in it.
    # Private: a shared anonymous mapping is shmem, whose huge pages follow another setting.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(_MADV_HUGEPAGE)
    except OSError as exc:  # EINVAL where the kernel has no transparent huge pages
        log.debug("madvise(MADV_HUGEPAGE): %s", exc)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    offset = -base % HUGE_PAGE_BYTES
    # The tensor keeps the mapping alive (frombuffer holds a reference to it).
    flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(dtype).view(shape).zero_()

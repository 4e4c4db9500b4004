"""Best-effort transparent huge pages for memory allocated during a block of code (Linux).

Used by `engine.models.cpu_linear.pack_linears` for the prepacked weights: a batch-1 decode
step streams every weight once (~78 MB for the bench model), and with 4 KiB pages each page
starts with a TLB miss and a cold hardware prefetcher. Backing the weights with 2 MiB pages
makes decode faster (torch's own THP_MEM_ALLOC_ENABLE=1 must be set before torch starts;
this does the same after the fact). Packed oneDNN tensors expose no
data pointer, so the ranges come from diffing /proc/self/maps around the allocation,
and are collapsed with madvise(MADV_COLLAPSE)
(Linux >= 6.1; contents are preserved, it only changes the page size). A heap that grew
is collapsed whole (any unpopulated gap in it gets populated), so this costs some RSS and
~0.5 s once for the bench model. Anything that fails leaves the memory as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25


def _anon_ranges() -> set[tuple[int, int]]:
    """Writable anonymous mappings (heap included) as (start, end)."""
    ranges: set[tuple[int, int]] = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 5 or parts[4] != "0" or "w" not in parts[1]:
                continue
            if len(parts) > 5 and parts[5] != "[heap]":
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            ranges.add((start, end))
    return ranges


@contextlib.contextmanager
def huge_pages_for_new_memory(min_bytes: int = 8 << 20) -> Iterator[None]:
    """Collapse memory mapped (or grown) inside the block into 2 MiB pages, if it adds up
    to at least `min_bytes`."""
    if not sys.platform.startswith("linux"):
        yield
        return
    try:
        before = _anon_ranges()
    except OSError:
        yield
        return
    yield
    try:
        new = sorted(_anon_ranges() - before)
        if sum(end - start for start, end in new) < min_bytes:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        collapsed = 0
        for start, end in new:
            lo, hi = -(-start // _HUGE) * _HUGE, end // _HUGE * _HUGE
            if hi - lo < _HUGE:
                continue
            libc.madvise(lo, hi - lo, _MADV_HUGEPAGE)
            if libc.madvise(lo, hi - lo, _MADV_COLLAPSE) == 0:
                collapsed += hi - lo
        logger.debug("huge pages: collapsed %.1f MiB", collapsed / (1 << 20))
    except (OSError, AttributeError) as e:  # no madvise / no /proc: keep 4 KiB pages
        logger.debug("huge pages unavailable: %s", e)

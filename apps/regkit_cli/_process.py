"""Process-wide settings of the ``regkit`` commands, made once at start-up (before torch is imported)."""

from __future__ import annotations

import ctypes
import os
import sys

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit systems


def configure_process() -> None:
    """Make the settings under which regkit's CPU path was measured, unless the user made their own:

    * ``OMP_WAIT_POLICY=PASSIVE``: idle OpenMP threads sleep instead of spinning; on a busy machine spinning threads
      made a registration ~8x slower (measured on a shared 2-core box). Takes effect only before torch is imported.
    * glibc's allocator keeps freed memory for reuse: blocks up to 32 MiB come from the heap instead of fresh
      ``mmap`` pages, and the heap is trimmed only past 1 GiB of free space. Each iteration of a registration allocates
      and frees image-sized buffers; by default every one of them comes back as new zeroed pages, whose page faults
      cost the local NCC's forward a quarter of its time on a 2 mm brain (``docs/benchmarks/cpu_pieces.py``). Skipped
      where the C library has no ``mallopt`` or ``MALLOC_*`` variables are set.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if not sys.platform.startswith("linux") or any(name.startswith("MALLOC_") for name in os.environ):
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return
    mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    mallopt(_M_TOP_PAD, 256 << 20)

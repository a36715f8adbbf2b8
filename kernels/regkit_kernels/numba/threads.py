"""What the numba kernels share: how they run in parallel, with as many threads as torch uses.

The CPAB, filter, local NCC and MI kernels are compiled without ``parallel=True``: numba's parfors compile each
kernel's loop body a second time, as a gufunc, which made the first use of the CPU kernels (``regkit demo``) compile
about three times as long. Instead each of them is a serial ``nogil`` function of a range ``[first, last)`` of its
outer loop, and :func:`parallel_for` splits that loop into one contiguous range per thread, as numba's static
scheduling of a ``prange`` does. These kernels take ``error_model="numpy"``, as numba's parfor bodies do: a float
division by zero gives inf or NaN, without a check in the loops. Their helpers called per point or voxel take scalars
and tuples, never arrays: an array passed to a function is reference-counted on every call, atomically, on a count
that all threads share. The sampling kernels (``sampling``), small ones whose parfors compile is short, keep
``prange`` with :func:`use_torch_threads`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numba
import torch

_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the process that made it, the pool)


def torch_threads() -> int:
    """As many threads as torch uses (``torch.set_num_threads``; ``OMP_NUM_THREADS`` sets it), at most
    ``NUMBA_NUM_THREADS`` (numba's limit, the CPU count unless set)."""
    return max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]


def _executor() -> ThreadPoolExecutor:
    """The worker threads of :func:`parallel_for`, made on first use and anew in a forked child (a pool's threads do
    not survive ``fork``)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        workers = max(1, numba.config.NUMBA_NUM_THREADS - 1)  # type: ignore[attr-defined]
        _pool = (os.getpid(), ThreadPoolExecutor(workers, thread_name_prefix="regkit-numba"))
    return _pool[1]


def parallel_for(kernel: Callable[..., None], count: int, *args: Any) -> None:
    """``kernel(first, last, *args)`` for ``range(count)`` split into :func:`torch_threads` contiguous ranges (fewer
    when ``count`` is smaller), the first on the calling thread and the others on worker threads; returns when all
    are done. ``kernel`` is a ``nogil`` numba function whose ranges write disjoint outputs."""
    tasks = max(1, min(torch_threads(), count))
    bounds = [task * count // tasks for task in range(tasks + 1)]
    others = [_executor().submit(kernel, bounds[t], bounds[t + 1], *args) for t in range(1, tasks)]
    kernel(bounds[0], bounds[1], *args)
    for other in others:
        other.result()


def use_torch_threads() -> int:
    """Let the next ``parallel=True`` kernels (``sampling``) use :func:`torch_threads` threads of numba's pool;
    returns that number."""
    threads = torch_threads()
    before = torch.get_num_threads()
    numba.set_num_threads(threads)
    if torch.get_num_threads() != before:  # starting numba's OpenMP pool can reset the OpenMP thread count torch reads
        torch.set_num_threads(before)
    return threads

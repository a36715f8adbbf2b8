"""What the numba kernels share: their thread count follows torch's."""

from __future__ import annotations

import numba
import torch


def use_torch_threads() -> int:
    """Let the next numba parallel kernels use as many threads as torch does (``torch.set_num_threads``, the CLI's
    ``--threads``), at most numba's pool size; returns that number."""
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    numba.set_num_threads(threads)
    return threads

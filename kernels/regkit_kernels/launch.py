"""What the Triton launchers share: the interpreter check and block-size arithmetic.

This module imports neither triton nor torch, so that ``regkit._backend`` can ask whether Triton's interpreter is on
without importing the kernels.
"""

from __future__ import annotations

import os


def interpreter_on() -> bool:
    """True when Triton's interpreter is switched on (``TRITON_INTERPRET=1``): the kernels then run, slowly, on CPU
    tensors (the tests do so). Read at every call, since tests switch it per case."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def pow2(n: int) -> int:
    """The smallest power of 2 that is at least ``n`` (1 for ``n <= 1``): a block that covers ``n`` elements."""
    return 1 << max(n - 1, 0).bit_length()

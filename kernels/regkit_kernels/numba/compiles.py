"""What numba compiles while a block of code runs: the first-use notice of the ``regkit`` commands.

numba compiles a kernel on its first call for each argument type and keeps the result in its cache
(``NUMBA_CACHE_DIR``); a call that finds its kernel in the cache compiles nothing and emits no event here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from numba.core import event

NOTICE = "compiling CPU kernels (first run only) ..."


class _Compiles(event.Listener):
    """Counts numba's top-level compiles (a kernel compiles the functions it calls inside its own event) and their
    seconds; says ``NOTICE`` when the first one starts."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.depth = 0
        self.count = 0
        self.seconds = 0.0
        self.began = 0.0

    def on_start(self, event: event.Event) -> None:
        if self.depth == 0:
            if self.count == 0:
                self.say(NOTICE)
            self.began = time.perf_counter()
        self.depth += 1

    def on_end(self, event: event.Event) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.count += 1
            self.seconds += time.perf_counter() - self.began


@contextmanager
def announce(say: Callable[[str], None]) -> Iterator[None]:
    """While the block runs, ``say`` the notice before numba's first compile, and at the end how many kernels were
    compiled in how many seconds (nothing when every kernel came from the cache)."""
    compiles = _Compiles(say)
    with event.install_listener("numba:compile", compiles):
        yield
    if compiles.count:
        kernels = "kernel" if compiles.count == 1 else "kernels"
        say(f"compiled {compiles.count} CPU {kernels} in {compiles.seconds:.1f} s (cached for later runs)")

"""Process-wide settings under which regkit's CPU path is fast, and where compiled kernels are cached.

They are made by the ``regkit`` commands at start-up, by :func:`regkit.register` on its first call and by batch
workers (``regkit.batch``), each time only where the user has not made their own:

* ``OMP_WAIT_POLICY=PASSIVE``: idle OpenMP threads sleep instead of spinning; on a busy machine spinning threads made
  a registration several times slower. It takes effect only if set before torch is imported, so ``import regkit``
  sets it when torch is not imported yet (import regkit first, or set the variable yourself).
* glibc's allocator keeps freed memory for reuse: blocks up to 32 MiB come from the heap instead of fresh ``mmap``
  pages, and the heap is trimmed only past 1 GiB of free space. Each iteration of a registration allocates and frees
  image-sized buffers; by default every one of them comes back as new zeroed pages, whose page faults cost the local
  NCC a quarter of its time on a 2 mm brain. Each parameter is left alone where its ``MALLOC_*_`` variable is set.
* numba's compiled kernels are cached in a per-user folder (``NUMBA_CACHE_DIR``, by default ``<cache>/numba`` with
  ``<cache>`` from :func:`cache_root`), never next to the installed sources. Triton keeps its own per-user cache
  (``TRITON_CACHE_DIR``, by default ``~/.triton/cache``); batch workers point both at node-local disk.

Set ``REGKIT_PROCESS_SETTINGS=0`` to make none of them (the cache folders are still respected where set).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

OPT_OUT = "REGKIT_PROCESS_SETTINGS"
"""Environment variable: ``0`` turns the wait policy and the allocator settings off."""

# glibc's mallopt parameters (malloc.h), each with the environment variable that sets it and regkit's value
_MALLOPT = (
    ("MALLOC_MMAP_THRESHOLD_", -3, 32 << 20),  # M_MMAP_THRESHOLD, glibc's ceiling on 64-bit systems
    ("MALLOC_TRIM_THRESHOLD_", -1, 1 << 30),  # M_TRIM_THRESHOLD
    ("MALLOC_TOP_PAD_", -2, 256 << 20),  # M_TOP_PAD
)

_done: set[str] = set()  # what this process has already made: "allocator"


def enabled() -> bool:
    """False where the user opted out (``REGKIT_PROCESS_SETTINGS=0``)."""
    return os.environ.get(OPT_OUT, "1").strip() != "0"


def set_wait_policy() -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user set it, opted out, or torch is already imported (too late:
    OpenMP reads it once, when torch loads). Returns True when the variable is PASSIVE afterwards."""
    if enabled() and "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"


def tune_allocator(*, override_env: tuple[str, ...] = ()) -> list[str]:
    """Apply regkit's glibc allocator parameters once per process (Linux with glibc only; nothing where the user opted
    out). A parameter whose ``MALLOC_*_`` variable is set keeps the user's value, unless that variable is named in
    ``override_env`` (batch workers override dask's ``MALLOC_TRIM_THRESHOLD_``). Returns the variables applied."""
    if "allocator" in _done or not enabled() or not sys.platform.startswith("linux"):
        return []
    _done.add("allocator")
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return []
    applied = []
    for variable, parameter, value in _MALLOPT:
        if variable in os.environ and variable not in override_env:
            continue
        if mallopt(parameter, value) == 1:
            applied.append(variable)
    return applied


def cache_root() -> Path:
    """The per-user cache folder of regkit: ``REGKIT_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/regkit`` or
    ``~/.cache/regkit`` (Linux and others), ``~/Library/Caches/regkit`` (macOS), ``%LOCALAPPDATA%\\regkit\\Cache``
    (Windows)."""
    if os.environ.get("REGKIT_CACHE_DIR"):
        return Path(os.environ["REGKIT_CACHE_DIR"]).expanduser()
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "regkit" / "Cache"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "regkit"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "regkit"


def configure_caches(root: str | os.PathLike | None = None) -> dict[str, str]:
    """Point numba's kernel cache at ``<root or cache_root()>/numba`` unless ``NUMBA_CACHE_DIR`` is set; with an
    explicit ``root`` (a batch worker's node-local disk) point ``TRITON_CACHE_DIR`` at ``<root>/triton`` too, and
    override both. Effective for numba only before the kernels are imported (``regkit._backend`` loads them
    lazily). Returns the two variables as they are afterwards (unset ones omitted)."""
    base = Path(root) if root is not None else cache_root()
    numba_dir, triton_dir = str(base / "numba"), str(base / "triton")
    if root is not None:
        os.environ["NUMBA_CACHE_DIR"] = numba_dir
        os.environ["TRITON_CACHE_DIR"] = triton_dir
    else:
        os.environ.setdefault("NUMBA_CACHE_DIR", numba_dir)
    numba = sys.modules.get("numba")
    if numba is not None:  # imported already: its configuration read the environment at that time
        numba.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]
    return {k: os.environ[k] for k in ("NUMBA_CACHE_DIR", "TRITON_CACHE_DIR") if k in os.environ}


@contextmanager
def announce_compiles(say: Callable[[str], None]) -> Iterator[None]:
    """While the block runs, ``say`` a line before the CPU kernels' first compile and one with its duration at the end
    (``regkit_kernels.numba.compiles``); nothing where numba is missing or every kernel came from its cache."""
    from regkit._backend import BackendError, load_kernels

    try:
        compiles = load_kernels("numba.compiles")
    except BackendError:
        yield
        return
    with compiles.announce(say):
        yield


def configure_process() -> None:
    """Everything above, once: the wait policy (if torch is not imported yet), the allocator and the cache folders."""
    set_wait_policy()
    tune_allocator()
    configure_caches()

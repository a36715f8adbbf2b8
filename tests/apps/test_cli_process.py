"""The process settings every ``regkit`` command makes at start-up (Linux, glibc)."""

import os
import subprocess
import sys

import pytest

# Prints the wait policy, then whether a 20 MiB block comes from the heap ([heap] in /proc/self/maps) rather than
# from a fresh mapping of its own.
CHECK = """
import ctypes, os
from regkit_cli._process import configure_process
configure_process()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
block = libc.malloc(20 << 20)
with open("/proc/self/maps") as maps:
    heap = [line.split()[0].split("-") for line in maps if line.rstrip().endswith("[heap]")]
print(os.environ["OMP_WAIT_POLICY"], any(int(lo, 16) <= block < int(hi, 16) for lo, hi in heap))
libc.free(block)
"""


def _run(**extra: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY" and not k.startswith("MALLOC_")}
    result = subprocess.run(
        [sys.executable, "-c", CHECK], env={**env, **extra}, capture_output=True, text=True, check=True
    )
    return result.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_configure_process_sets_wait_policy_and_heap_allocation_unless_the_user_did():
    assert _run() == ["PASSIVE", "True"]
    assert _run(OMP_WAIT_POLICY="ACTIVE", MALLOC_ARENA_MAX="2") == ["ACTIVE", "False"]

"""The process settings of ``regkit.process``: made by the commands, by ``import regkit`` and ``register``, and by batch
workers; each left alone where the user set its variable, all of them off with ``REGKIT_PROCESS_SETTINGS=0``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Prints the wait policy, then whether a 20 MiB block comes from the heap ([heap] in /proc/self/maps) rather than
# from a fresh mapping of its own.
CHECK = """
import ctypes, os
{setup}
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
block = libc.malloc(20 << 20)
with open("/proc/self/maps") as maps:
    heap = [line.split()[0].split("-") for line in maps if line.rstrip().endswith("[heap]")]
print(os.environ.get("OMP_WAIT_POLICY", "unset"), any(int(lo, 16) <= block < int(hi, 16) for lo, hi in heap))
libc.free(block)
"""

COMMANDS = "from regkit.process import configure_process\nconfigure_process()"
LIBRARY = "import regkit, regkit.process\nregkit.process.tune_allocator()"


def _clean_env() -> dict[str, str]:
    drop = ("OMP_WAIT_POLICY", "REGKIT_PROCESS_SETTINGS", "NUMBA_CACHE_DIR", "TRITON_CACHE_DIR", "REGKIT_CACHE_DIR")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("MALLOC_")}


def _run(setup: str = COMMANDS, **extra: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", CHECK.format(setup=setup)],
        env={**_clean_env(), **extra},
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.split()


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")


@linux_only
def test_configure_process_sets_wait_policy_and_heap_allocation_unless_the_user_did():
    assert _run() == ["PASSIVE", "True"]
    assert _run(OMP_WAIT_POLICY="ACTIVE", MALLOC_MMAP_THRESHOLD_="131072") == ["ACTIVE", "False"]


@linux_only
def test_unrelated_malloc_variables_do_not_turn_the_allocator_settings_off():
    """dask sets ``MALLOC_TRIM_THRESHOLD_`` in its workers: the other parameters still apply."""
    assert _run(MALLOC_ARENA_MAX="2") == ["PASSIVE", "True"]
    assert _run(MALLOC_TRIM_THRESHOLD_="65536") == ["PASSIVE", "True"]


@linux_only
def test_the_library_applies_the_same_settings_as_the_commands():
    assert _run(LIBRARY) == ["PASSIVE", "True"]


@linux_only
def test_opting_out_makes_no_setting():
    assert _run(REGKIT_PROCESS_SETTINGS="0") == ["unset", "False"]
    assert _run(LIBRARY, REGKIT_PROCESS_SETTINGS="0") == ["unset", "False"]


def test_wait_policy_is_not_claimed_once_torch_is_imported():
    setup = "import torch, regkit.process\nprint(regkit.process.set_wait_policy())"
    out = subprocess.run(
        [sys.executable, "-c", setup], env=_clean_env(), capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False"]


def _cache_vars(code: str, **extra: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], env={**_clean_env(), **extra}, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_numba_cache_goes_to_the_user_cache_folder_never_next_to_the_sources(tmp_path: Path):
    code = "import regkit, numba, os; print(os.environ['NUMBA_CACHE_DIR'], numba.config.CACHE_DIR)"
    assert _cache_vars(code, REGKIT_CACHE_DIR=str(tmp_path)).split() == [str(tmp_path / "numba")] * 2
    assert _cache_vars(code, NUMBA_CACHE_DIR=str(tmp_path / "mine")).split() == [str(tmp_path / "mine")] * 2


def test_numba_imported_before_regkit_still_caches_in_the_user_folder(tmp_path: Path):
    code = "import numba, regkit; print(numba.config.CACHE_DIR)"
    assert _cache_vars(code, REGKIT_CACHE_DIR=str(tmp_path)) == str(tmp_path / "numba")


def test_an_explicit_root_overrides_both_caches(tmp_path: Path):
    """A batch worker's node-local folder wins over the shared ones."""
    code = (
        f"import regkit.process as p; c = p.configure_caches({str(tmp_path)!r}); "
        "print(c['NUMBA_CACHE_DIR'], c['TRITON_CACHE_DIR'])"
    )
    got = _cache_vars(code, NUMBA_CACHE_DIR="/shared/numba", TRITON_CACHE_DIR="/shared/triton").split()
    assert got == [str(tmp_path / "numba"), str(tmp_path / "triton")]


def test_cache_root_follows_regkit_cache_dir_then_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from regkit import process

    monkeypatch.setenv("REGKIT_CACHE_DIR", str(tmp_path))
    assert process.cache_root() == tmp_path
    monkeypatch.delenv("REGKIT_CACHE_DIR")
    if sys.platform.startswith("linux"):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert process.cache_root() == tmp_path / "xdg" / "regkit"

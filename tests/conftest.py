"""Shared test set-up.

Triton runs on CPUs only through its interpreter, which must be switched on before triton is first imported; triton is
also imported before any napari test opens a GL context (importing it afterwards crashes the process).
"""

import os

import pytest

if not os.environ.get("REGKIT_TEST_CUDA"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401  (imported first on purpose, see above)
except ImportError:  # triton is Linux-only; kernel tests skip themselves where it is missing
    pass

import torch

# The tests use small tensors: one thread per process avoids oversubscribing the CPU (the suite runs with
# pytest-xdist, one worker per core).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when no CUDA device is present (CI never has one)."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)

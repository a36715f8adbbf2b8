"""Shared test set-up.

Triton runs on CPUs only through its interpreter, which must be switched on before triton is first imported; triton is
also imported before any napari test opens a GL context (importing it afterwards crashes the process). Every test runs
with one torch thread (:func:`one_torch_thread`); :func:`float_dtype` and :func:`device` run a test per floating dtype
and per device.
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

try:  # started before the setting below (see one_torch_thread)
    import numba

    numba.get_num_threads()
except ImportError:
    pass

# The tests use small tensors: one thread per process avoids oversubscribing the CPU (the suite runs with
# pytest-xdist, one worker per core).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_torch_thread() -> None:
    """One torch thread in every test, whatever the tests before it did.

    Needed because torch's thread count does not stay where it was set: numba's OpenMP threading layer, when it starts
    (once per process, from some of its parallel kernels), sets OpenMP's thread count, which torch shares, to numba's
    (the CPU count unless ``NUMBA_NUM_THREADS`` says otherwise). It is started above, before
    ``torch.set_num_threads(1)``, so that this cannot happen in the middle of a test; this fixture also undoes what a
    test sets itself (the CLI's ``--threads``, an in-process dask worker). Without it a test's thread count depended on
    the tests before it in its worker, and so could its results: tiny problems only lose time to intra-op threads (4x
    on a busy 2-core machine), and sums in another order change the first Adam steps of a registration wherever the
    gradient is close to zero."""
    torch.set_num_threads(1)


@pytest.fixture(params=[torch.float32, torch.float64], ids=["float32", "float64"])
def float_dtype(request: pytest.FixtureRequest) -> torch.dtype:
    """Each floating-point dtype regkit computes in: the test runs once per dtype."""
    return request.param


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """The CPU, then a CUDA device (that run is marked ``gpu``, so it is skipped without one)."""
    return request.param


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when no CUDA device is present (CI never has one)."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)

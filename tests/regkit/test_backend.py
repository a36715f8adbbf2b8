import os
import subprocess
import sys

import pytest
import torch

from regkit._backend import BackendError, import_cpu_kernels, kernels_module, load_kernels, resolve_backend


def test_auto_on_cpu_picks_numba_else_the_fastest_pytorch_face():
    assert resolve_backend("auto", "cpu", "cpab", faces=("reference", "torch", "triton")) == "torch"
    assert resolve_backend("auto", "cpu", "cpab", faces=("reference", "torch", "numba", "triton")) == "numba"
    assert resolve_backend("auto", "cpu", "wtconv", faces=("reference", "triton")) == "reference"


def test_auto_integration_backend_on_the_cpu_is_numba():
    pytest.importorskip("numba")
    from regkit.cpab.integrate import FACES

    assert resolve_backend("auto", "cpu", "cpab", faces=FACES) == "numba"


def test_explicit_faces_are_kept():
    assert resolve_backend("reference", "cpu", "cpab", faces=("reference", "torch")) == "reference"


def test_unknown_and_unoffered_backends_are_errors():
    with pytest.raises(BackendError, match="unknown backend 'cuda'"):
        resolve_backend("cuda", "cpu", "cpab", faces=("reference", "torch"))
    with pytest.raises(BackendError, match="not offered"):
        resolve_backend("torch", "cpu", "wtconv", faces=("reference", "triton"))


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendError, match="needs CUDA"):
        resolve_backend("triton", torch.device("cpu"), "cpab", faces=("reference", "triton"))


def test_numba_needs_cpu_tensors():
    with pytest.raises(BackendError, match="needs CPU"):
        resolve_backend("numba", torch.device("cuda"), "cpab", faces=("reference", "torch", "numba", "triton"))


def test_missing_kernel_module_is_a_clear_error():
    with pytest.raises(BackendError, match=r"regkit_kernels\.nonexistent"):
        load_kernels("nonexistent")


def test_import_cpu_kernels_finds_the_numba_modules():
    pytest.importorskip("numba")
    names = import_cpu_kernels()
    assert names == ["numba.cpab", "numba.filters", "numba.lncc", "numba.mi", "numba.sampling"]
    assert [kernels_module("numba", op) for op in ("cpab", "filters", "lncc", "mi", "sampling")] == names
    assert kernels_module("triton", "cpab") == "cpab"


def test_import_regkit_loads_no_kernels():
    """The kernels, triton and numba are imported on first use, never by ``import regkit``; asking for the fused face
    on the CPU without the interpreter is refused after reading only ``regkit_kernels.launch`` (no imports of its
    own)."""
    code = """
import sys, regkit
from regkit._backend import BackendError, resolve_backend
assert not [m for m in sys.modules if m.split(".")[0] in ("regkit_kernels", "triton", "numba")]
try:
    resolve_backend("triton", "cpu", "cpab", faces=("reference", "triton"))
except BackendError:
    pass
loaded = [m for m in sys.modules if m.split(".")[0] in ("regkit_kernels", "triton", "numba")]
assert set(loaded) == {"regkit_kernels", "regkit_kernels.launch"}, loaded
"""
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "0"})


def test_gpu_without_triton_falls_back_to_pytorch_with_one_line(monkeypatch, caplog):
    """Where the user's torch brings no triton, CUDA tensors take the PyTorch face, announced once per process."""
    import regkit._backend as backend

    monkeypatch.setattr(backend, "kernels_available", lambda name: False)
    backend.announce_gpu_without_triton.cache_clear()
    faces = ("reference", "torch", "numba", "triton")
    with caplog.at_level("WARNING", logger="regkit"):
        assert resolve_backend("auto", torch.device("cuda"), "cpab", faces=faces) == "torch"
        assert resolve_backend("auto", torch.device("cuda"), "wtconv", faces=("reference", "triton")) == "reference"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "triton is not available" in lines[0] and "\n" not in lines[0]

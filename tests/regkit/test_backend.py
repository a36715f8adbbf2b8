import pytest
import torch

from regkit._backend import BackendError, import_cpu_kernels, load_kernels, resolve_backend


def test_auto_on_cpu_picks_numba_else_the_fastest_pytorch_face():
    assert resolve_backend("auto", "cpu", "cpab", faces=("reference", "torch", "triton")) == "torch"
    assert resolve_backend("auto", "cpu", "cpab", faces=("reference", "torch", "numba", "triton")) == "numba"
    assert resolve_backend("auto", "cpu", "wtconv", faces=("reference", "triton")) == "reference"


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
    names = import_cpu_kernels()
    assert {"cpab_numba", "filters_numba", "lncc_numba", "mi_numba", "sampling_numba"} <= set(names)


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

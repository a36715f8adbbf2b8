"""Backend selection: the one place where regkit reaches the optional compiled kernels (``regkit_kernels``).

Every fast op has up to four faces with one signature: ``"reference"`` (readable pure PyTorch, the spec),
``"torch"`` (a factorized PyTorch path, where the algorithm has one), ``"numba"`` (compiled CPU kernels,
``regkit_kernels.numba.<op>``, where the op has them) and ``"triton"`` (fused kernels, ``regkit_kernels.<op>``,
CUDA only). The backend is an explicit argument threaded from the configuration, never a global switch.

The kernels are imported on first use, never by ``import regkit``; :func:`load_kernels` returns each module typed as
its face (``regkit._kernel_faces``), so that mypy checks the calls into it.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, get_args, overload

import torch

from regkit.errors import RegkitError

if TYPE_CHECKING:
    from regkit._kernel_faces import (
        CompilesNumba,
        CpabFused,
        CpabNumba,
        FiltersNumba,
        LnccNumba,
        MiNumba,
        SamplingNumba,
        WtconvFused,
    )

BACKENDS = ("auto", "reference", "torch", "numba", "triton")

NumbaKernels = Literal["numba.cpab", "numba.filters", "numba.lncc", "numba.mi", "numba.sampling"]
"""The numba kernel modules of ``regkit_kernels`` (``numba.<op>``, :func:`kernels_module`)."""


class BackendError(RegkitError):
    """A requested backend that cannot run here (e.g. ``triton`` without CUDA or without the triton package)."""


@overload
def load_kernels(name: Literal["cpab"]) -> CpabFused: ...
@overload
def load_kernels(name: Literal["wtconv"]) -> WtconvFused: ...
@overload
def load_kernels(name: Literal["numba.cpab"]) -> CpabNumba: ...
@overload
def load_kernels(name: Literal["numba.filters"]) -> FiltersNumba: ...
@overload
def load_kernels(name: Literal["numba.lncc"]) -> LnccNumba: ...
@overload
def load_kernels(name: Literal["numba.mi"]) -> MiNumba: ...
@overload
def load_kernels(name: Literal["numba.sampling"]) -> SamplingNumba: ...
@overload
def load_kernels(name: Literal["numba.compiles"]) -> CompilesNumba: ...
def load_kernels(name: str) -> Any:
    """Import ``regkit_kernels.<name>`` (``"cpab"``, ``"wtconv"``, ``"numba.cpab"``, ..., ``"numba.compiles"``), typed
    as its face; raise BackendError if it cannot be imported (triton or numba missing)."""
    return _import_kernels(name)


def _import_kernels(name: str) -> ModuleType:
    try:
        return importlib.import_module(f"regkit_kernels.{name}")
    except ImportError as exc:
        raise BackendError(f"the kernels 'regkit_kernels.{name}' cannot be imported: {exc}") from exc


def import_cpu_kernels() -> list[str]:
    """Import every numba kernel module of ``regkit_kernels`` (:data:`NumbaKernels`) and return their names; none
    where numba is missing. For benchmarks, which start their timers after the tools' imports: the first call of each
    kernel still loads or compiles it."""
    return [name for name in get_args(NumbaKernels) if kernels_available(name)]


def kernels_module(face: str, kernels: str) -> str:
    """The ``regkit_kernels`` submodule of an op's compiled face: ``<kernels>`` for triton, ``numba.<kernels>`` for
    numba."""
    return f"numba.{kernels}" if face == "numba" else kernels


def kernels_available(name: str) -> bool:
    """True when ``regkit_kernels.<name>`` imports (its compiler installed and the kernels present)."""
    try:
        _import_kernels(name)
    except BackendError:
        return False
    return True


def resolve_backend(requested: str, device: torch.device | str, kernels: str, *, faces: tuple[str, ...]) -> str:
    """Pick the concrete backend for an op.

    Args:
        requested: ``"auto"`` or one of the op's ``faces``.
        device: where the op's tensors live.
        kernels: the op's kernels: ``regkit_kernels.<kernels>`` holds its Triton face,
            ``regkit_kernels.numba.<kernels>`` its numba face (:func:`kernels_module`).
        faces: the concrete backends the op offers, fastest PyTorch face last among ``reference``/``torch``.

    ``auto`` means ``triton`` for CUDA tensors and ``numba`` for CPU tensors when the op has that face and its kernels
    import, else the op's fastest PyTorch face. Asking for ``triton`` on a CPU tensor is allowed only under
    ``TRITON_INTERPRET=1`` (the tests), for ``numba`` on a CUDA tensor never.
    """
    if requested not in BACKENDS:
        raise BackendError(f"unknown backend '{requested}'; choose one of {', '.join(BACKENDS)}")
    if requested != "auto" and requested not in faces:
        raise BackendError(f"backend '{requested}' is not offered here; choose one of auto, {', '.join(faces)}")
    device = torch.device(device)
    if requested == "auto":
        compiled = "triton" if device.type == "cuda" else "numba"
        if compiled in faces and kernels_available(kernels_module(compiled, kernels)):
            return compiled
        if compiled == "triton" and "triton" in faces:
            announce_gpu_without_triton()
        return "torch" if "torch" in faces else "reference"
    if requested == "numba":
        if device.type != "cpu":
            raise BackendError("backend 'numba' needs CPU tensors")
        _import_kernels(kernels_module("numba", kernels))
    if requested == "triton":
        if device.type != "cuda":
            from regkit_kernels.launch import interpreter_on  # imports nothing itself (no triton)

            if not interpreter_on():
                raise BackendError("backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 for testing on the CPU)")
        _import_kernels(kernels)
    return requested


@functools.cache
def announce_gpu_without_triton() -> None:
    """One line, once per process, where a GPU run falls back to the PyTorch path (no usable triton)."""
    logging.getLogger("regkit").warning(
        "regkit: triton is not available, so the GPU runs the PyTorch path (slower); install the triton that your "
        "torch build names (CUDA builds of torch from pytorch.org bring it)"
    )


@functools.lru_cache(maxsize=1024)
def device_constant(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1D tensor of ``dtype`` on ``device``, cached; callers never write to it. Made anew on every
    call, it would be a host-to-device copy, which waits for the GPU and cannot be part of a CUDA graph (the engine
    captures its optimizer iterations on CUDA)."""
    return torch.tensor(values, dtype=dtype, device=device)


def capturing(tensor: torch.Tensor) -> bool:
    """True while a CUDA graph is being captured on ``tensor``'s device (checks that wait for the GPU must not run)."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()

"""Backend selection: the one place where regkit reaches the optional Triton kernels (``regkit_kernels``).

Every fast op has up to three faces with one signature: ``"reference"`` (readable pure PyTorch, the spec and the CPU
path), ``"torch"`` (a factorized PyTorch path, where the algorithm has one) and ``"triton"`` (fused kernels, CUDA only).
The backend is an explicit argument threaded from the configuration, never a global switch.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from regkit.errors import RegkitError

BACKENDS = ("auto", "reference", "torch", "triton")


class BackendError(RegkitError):
    """A requested backend that cannot run here (e.g. ``triton`` without CUDA or without the triton package)."""


def load_kernels(name: str) -> ModuleType:
    """Import ``regkit_kernels.<name>`` (e.g. ``"cpab"``, ``"wtconv"``); raise BackendError if it cannot be imported."""
    try:
        return importlib.import_module(f"regkit_kernels.{name}")
    except ImportError as exc:
        raise BackendError(f"the Triton kernels 'regkit_kernels.{name}' cannot be imported: {exc}") from exc


def triton_available(name: str) -> bool:
    """True when ``regkit_kernels.<name>`` imports (triton installed and the kernels present)."""
    try:
        load_kernels(name)
    except BackendError:
        return False
    return True


def resolve_backend(requested: str, device: torch.device | str, kernels: str, *, faces: tuple[str, ...]) -> str:
    """Pick the concrete backend for an op.

    Args:
        requested: ``"auto"`` or one of the op's ``faces``.
        device: where the op's tensors live.
        kernels: the ``regkit_kernels`` submodule holding the op's Triton face.
        faces: the concrete backends the op offers, fastest PyTorch face last among ``reference``/``torch``.

    ``auto`` means ``triton`` for CUDA tensors when the kernels import, else the op's fastest PyTorch face. Asking for
    ``triton`` on a CPU tensor is allowed only under ``TRITON_INTERPRET=1`` (the tests); otherwise it is an error.
    """
    if requested not in BACKENDS:
        raise BackendError(f"unknown backend '{requested}'; choose one of {', '.join(BACKENDS)}")
    if requested != "auto" and requested not in faces:
        raise BackendError(f"backend '{requested}' is not offered here; choose one of auto, {', '.join(faces)}")
    device = torch.device(device)
    if requested == "auto":
        if "triton" in faces and device.type == "cuda" and triton_available(kernels):
            return "triton"
        return "torch" if "torch" in faces else "reference"
    if requested == "triton":
        import os

        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise BackendError("backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 for testing on the CPU)")
        load_kernels(kernels)
    return requested


@functools.lru_cache(maxsize=1024)
def device_constant(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1D tensor of ``dtype`` on ``device``, cached; callers never write to it. Made anew on every
    call, it would be a host-to-device copy, which waits for the GPU and cannot be part of a CUDA graph (the engine
    captures its optimizer iterations on CUDA)."""
    return torch.tensor(values, dtype=dtype, device=device)


def capturing(tensor: torch.Tensor) -> bool:
    """True while a CUDA graph is being captured on ``tensor``'s device (checks that wait for the GPU must not run)."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()

"""Separable filters on image tensors shaped ``(B, C, *spatial)`` with spatial layout ``[z, y, x]`` or ``[y, x]``.

Per-axis arguments (window sizes, sigmas) are given in index order (x, y[, z]), like ``Grid.spacing``; a single number
applies to every axis. All filters are differentiable and work in float32/float64 on CPU and CUDA.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from regkit._backend import load_kernels, resolve_backend

_BOX_FACES = ("torch", "numba")
# A sampled Gaussian is truncated at this many sigmas (the discarded tail holds < 1e-4 of the mass).
_GAUSS_TRUNCATE = 4.0


def per_axis(value: float | Sequence[float], ndim: int, name: str) -> tuple[float, ...]:
    """Expand a scalar or an index-order sequence to one value per spatial axis, in index order (x, y[, z])."""
    if isinstance(value, (int, float, numbers.Real)):
        return (float(value),) * ndim
    values = tuple(float(v) for v in value)
    if len(values) != ndim:
        raise ValueError(f"{name} needs 1 or {ndim} values, got {len(values)}: {values}")
    return values


def _tensor_axis(image: torch.Tensor, index_axis: int) -> int:
    """Tensor dimension of index axis ``index_axis`` (0 = x) for an image ``(B, C, *spatial)``."""
    return image.dim() - 1 - index_axis


def _check_image(image: torch.Tensor) -> int:
    if image.dim() not in (4, 5):
        raise ValueError(
            f"expected an image tensor (B, C, *spatial) with 2 or 3 spatial axes, got {tuple(image.shape)}"
        )
    return image.dim() - 2


def box_sum(image: torch.Tensor, window: int | Sequence[int], backend: str = "auto") -> torch.Tensor:
    """Sum over a centred box window around every voxel (zero outside the image), same shape as ``image``.

    ``window`` is odd, in voxels, in index order. ``backend``: ``"torch"`` computes each axis as a difference of
    cumulative sums (the cost does not depend on the window size); ``"numba"`` (CPU tensors,
    ``regkit_kernels.numba.filters``) keeps running sums along x and z and adds the buffered rows along y, in two
    passes over memory, several times faster on the CPU; ``"auto"`` takes numba on the CPU where it imports. The
    filter is self-adjoint, and its backward pass is the same box sum.
    """
    ndim = _check_image(image)
    sizes = tuple(int(k) for k in per_axis(window, ndim, "window"))
    if any(k < 1 or k % 2 == 0 for k in sizes):
        raise ValueError(f"box window sizes must be odd positive integers, got {sizes}")
    return _BoxSum.apply(image, sizes, resolve_backend(backend, image.device, "filters", faces=_BOX_FACES))


def _box_sum(image: torch.Tensor, sizes: tuple[int, ...], backend: str) -> torch.Tensor:
    if backend == "numba":
        return load_kernels("numba.filters").box_sums(image, sizes)
    out = image
    for index_axis, k in enumerate(sizes):
        if k == 1:
            continue
        dim = _tensor_axis(image, index_axis)
        n = image.shape[dim]
        pad = [0, 0] * (image.dim() - 1 - dim) + [k // 2 + 1, k // 2]
        csum = F.pad(out, pad).cumsum(dim)
        out = csum.narrow(dim, k, n) - csum.narrow(dim, 0, n)
    return out


class _BoxSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, image: torch.Tensor, sizes: tuple[int, ...], backend: str) -> torch.Tensor:
        ctx.sizes, ctx.backend = sizes, backend
        return _box_sum(image, sizes, backend)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _BoxSum.apply(grad, ctx.sizes, ctx.backend), None, None


def gaussian_kernel1d(sigma: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Normalised sampled Gaussian of standard deviation ``sigma`` voxels, truncated at 4 sigma (scipy's radius)."""
    radius = max(1, int(_GAUSS_TRUNCATE * sigma + 0.5))
    x = torch.arange(-radius, radius + 1, dtype=dtype, device=device)
    kernel = torch.exp(-0.5 * (x / sigma) ** 2)
    return kernel / kernel.sum()


def gaussian_smooth(image: torch.Tensor, sigma: float | Sequence[float], backend: str = "auto") -> torch.Tensor:
    """Convolve ``image`` ``(B, C, *spatial)`` with a Gaussian of standard deviation ``sigma`` voxels per axis.

    ``sigma`` is in voxels, index order (x, y[, z]); an axis with sigma 0 is left alone. The image is extended by
    replicating its border voxels, so a constant image stays constant. ``backend``: ``"torch"`` (``conv1d`` over
    lines, differentiable), ``"numba"`` (CPU tensors that need no gradient; several times faster) or ``"auto"``
    (numba where it applies and imports).
    """
    ndim = _check_image(image)
    sigmas = per_axis(sigma, ndim, "sigma")
    if any(s < 0 for s in sigmas):
        raise ValueError(f"sigma must be non-negative, got {sigmas}")
    kernels = [None if s == 0 else gaussian_kernel1d(s, image.dtype, image.device) for s in sigmas]
    chosen = resolve_backend(backend, image.device, "filters", faces=_BOX_FACES)
    if chosen == "numba" and not (image.requires_grad and torch.is_grad_enabled()):
        return load_kernels("numba.filters").separable(image, kernels, edge=True)
    out = image
    for index_axis, kernel in enumerate(kernels):
        if kernel is None:
            continue
        r = kernel.numel() // 2
        moved = out.movedim(_tensor_axis(image, index_axis), -1)
        lines = moved.reshape(-1, 1, moved.shape[-1])
        smoothed = F.conv1d(F.pad(lines, (r, r), mode="replicate"), kernel.view(1, 1, -1))
        out = smoothed.reshape(moved.shape).movedim(-1, _tensor_axis(image, index_axis))
    return out

"""Separable filters on the CPU, compiled with numba: the CPU face of ``regkit.spatial.filters.box_sum`` and
``gaussian_smooth`` (reached through ``regkit._backend`` as the ``"numba"`` backend of the ``filters`` op).

Images are ``(B, C, *spatial)`` with spatial layout ``[z, y, x]`` or ``[y, x]``; per-axis arguments are in index order
(x, y[, z]). One pass per axis correlates with an odd 1D kernel, adding one shifted row of the image at a time, so that
the contiguous x axis is always the innermost loop and vectorises; outside the image the signal is zero (box sums) or
its border value (Gaussian smoothing). Box sums add the window's voxels directly along x and keep running sums of
whole rows along y and z (two operations per voxel; the PyTorch face's cumulative sums over whole lines lose more to
cancellation). Results equal the PyTorch faces' up to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numba
import numpy as np
import torch

from regkit_kernels._numba import use_torch_threads


@numba.njit(parallel=True, cache=True)
def _correlate(src: np.ndarray, dst: np.ndarray, kernel: np.ndarray, axis: int, edge: bool) -> None:
    """``dst = `` the correlation of ``src (P, Z, Y, X)`` along ``axis`` (1: z, 2: y, 3: x) with the odd ``kernel``;
    beyond the border the signal is zero, or the border value when ``edge``."""
    P, Z, Y, X = src.shape
    r = kernel.shape[0] // 2
    for pz in numba.prange(P * Z):
        p, z = pz // Z, pz % Z
        for y in range(Y):
            for x in range(X):
                dst[p, z, y, x] = 0
            for d in range(-r, r + 1):
                w = kernel[d + r]
                if axis == 3:
                    lo, hi = min(max(-d, 0), X), max(min(X - d, X), 0)
                    for x in range(lo, hi):
                        dst[p, z, y, x] += w * src[p, z, y, x + d]
                    if edge:
                        for x in range(lo):
                            dst[p, z, y, x] += w * src[p, z, y, 0]
                        for x in range(hi, X):
                            dst[p, z, y, x] += w * src[p, z, y, X - 1]
                    continue
                q = (y if axis == 2 else z) + d
                size = Y if axis == 2 else Z
                if q < 0 or q >= size:
                    if not edge:
                        continue
                    q = min(max(q, 0), size - 1)
                if axis == 2:
                    for x in range(X):
                        dst[p, z, y, x] += w * src[p, z, q, x]
                else:
                    for x in range(X):
                        dst[p, z, y, x] += w * src[p, q, y, x]


@numba.njit(parallel=True, cache=True)
def _box_rows(src: np.ndarray, dst: np.ndarray, radius: int) -> None:
    """``dst = `` the box sum of ``src (P, A, L, X)`` along its axis 2 with half-width ``radius``, zero beyond the
    border: a running sum of whole x rows (add the row entering the window, subtract the one leaving it), two
    operations per voxel whatever the window. The z pass hands in views with z and y swapped."""
    P, A, L, X = src.shape
    for line in numba.prange(P * A):
        p, a = line // A, line % A
        acc = np.zeros(X, dtype=src.dtype)
        for q in range(min(radius, L)):
            for x in range(X):
                acc[x] += src[p, a, q, x]
        for i in range(L):
            if i + radius < L:
                for x in range(X):
                    acc[x] += src[p, a, i + radius, x]
            if i - radius - 1 >= 0:
                for x in range(X):
                    acc[x] -= src[p, a, i - radius - 1, x]
            for x in range(X):
                dst[p, a, i, x] = acc[x]


def _correlation(kernel: torch.Tensor, axis: int, edge: bool) -> Callable[[np.ndarray, np.ndarray], None]:
    """A pass of :func:`_correlate` with ``kernel`` along ``axis``."""
    weights = kernel.contiguous().numpy()
    return lambda src, dst: _correlate(src, dst, weights, axis, edge)


def _passes(image: torch.Tensor, passes: list[Callable[[np.ndarray, np.ndarray], None]]) -> torch.Tensor:
    """Run ``passes`` (each ``(src, dst)`` over ``(P, Z, Y, X)`` arrays) one after the other on a CPU ``image
    (B, C, *spatial)``; same shape and dtype; the caller's image is never written."""
    use_torch_threads()
    spatial = image.shape[2:]
    src = image.detach().reshape(-1, *((1,) * (3 - len(spatial))), *spatial).contiguous().numpy()
    out, spare = src, np.empty_like(src)
    for run in passes:
        run(out, spare)
        out, spare = spare, (np.empty_like(src) if out is src else out)
    return torch.from_numpy(out.copy() if out is src else out).view(image.shape)


def box_sums(image: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Box sums of a CPU ``image (B, C, *spatial)`` over windows of ``sizes`` voxels (odd, index order x, y[, z]),
    zero outside the image; same shape and dtype. The x axis adds the window's voxels directly (as
    :func:`separable`), the y and z axes keep running sums of whole rows (float error grows with the axis length,
    about 1e-6 relative in float32 for a few hundred voxels). Not differentiable."""
    radii = [k // 2 for k in sizes]
    passes: list[Callable[[np.ndarray, np.ndarray], None]] = []
    if radii[0]:
        passes.append(_correlation(torch.ones(sizes[0], dtype=image.dtype), 3, False))
    if len(radii) > 1 and radii[1]:
        passes.append(lambda src, dst: _box_rows(src, dst, radii[1]))
    if len(radii) > 2 and radii[2]:
        passes.append(lambda src, dst: _box_rows(src.swapaxes(1, 2), dst.swapaxes(1, 2), radii[2]))
    return _passes(image, passes)


def separable(image: torch.Tensor, kernels: Sequence[torch.Tensor | None], edge: bool) -> torch.Tensor:
    """Correlate a CPU ``image (B, C, *spatial)`` along each index axis (x, y[, z]) with its odd 1D kernel (``None``:
    leave the axis alone); zero beyond the border, or the border value when ``edge``. Same shape and dtype; not
    differentiable (the callers' autograd covers that)."""
    passes: list[Callable[[np.ndarray, np.ndarray], None]] = []
    for index_axis, kernel in enumerate(kernels):
        if kernel is not None:
            passes.append(_correlation(kernel.to(image.dtype), 3 - index_axis, edge))
    return _passes(image, passes)

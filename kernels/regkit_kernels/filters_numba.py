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

from collections.abc import Sequence

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
def _box_rows(src: np.ndarray, dst: np.ndarray, radius: int, axis: int) -> None:
    """``dst = `` the box sum of ``src (P, Z, Y, X)`` along ``axis`` (1: z, 2: y) with half-width ``radius``, zero
    beyond the border: a running sum of whole x rows (add the row entering the window, subtract the one leaving it),
    two operations per voxel whatever the window."""
    P, Z, Y, X = src.shape
    lines, length = (P * Z, Y) if axis == 2 else (P * Y, Z)
    for line in numba.prange(lines):
        p = line // (Z if axis == 2 else Y)
        other = line % (Z if axis == 2 else Y)
        acc = np.zeros(X, dtype=src.dtype)
        for q in range(min(radius, length)):
            for x in range(X):
                acc[x] += src[p, other, q, x] if axis == 2 else src[p, q, other, x]
        for i in range(length):
            enter, leave = i + radius, i - radius - 1
            if axis == 2:
                if enter < length:
                    for x in range(X):
                        acc[x] += src[p, other, enter, x]
                if leave >= 0:
                    for x in range(X):
                        acc[x] -= src[p, other, leave, x]
                for x in range(X):
                    dst[p, other, i, x] = acc[x]
            else:
                if enter < length:
                    for x in range(X):
                        acc[x] += src[p, enter, other, x]
                if leave >= 0:
                    for x in range(X):
                        acc[x] -= src[p, leave, other, x]
                for x in range(X):
                    dst[p, i, other, x] = acc[x]


def box_sums(image: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Box sums of a CPU ``image (B, C, *spatial)`` over windows of ``sizes`` voxels (odd, index order x, y[, z]),
    zero outside the image; same shape and dtype. The x axis adds the window's voxels directly (as
    :func:`separable`), the y and z axes keep running sums of whole rows (float error grows with the axis length,
    about 1e-6 relative in float32 for a few hundred voxels). Not differentiable."""
    use_torch_threads()
    spatial = image.shape[2:]
    volume = image.detach().reshape(-1, *((1,) * (3 - len(spatial))), *spatial).contiguous()
    src = volume.numpy()
    out, spare = src, np.empty_like(src)
    for index_axis, k in enumerate(sizes):
        if k == 1:
            continue
        if index_axis == 0:
            _correlate(out, spare, np.ones(k, dtype=src.dtype), 3, False)
        else:
            _box_rows(out, spare, k // 2, 3 - index_axis)
        out, spare = spare, (np.empty_like(src) if out is src else out)  # never write into the caller's image
    return torch.from_numpy(out.copy() if out is src else out).view(image.shape)


def separable(image: torch.Tensor, kernels: Sequence[torch.Tensor | None], edge: bool) -> torch.Tensor:
    """Correlate a CPU ``image (B, C, *spatial)`` along each index axis (x, y[, z]) with its odd 1D kernel (``None``:
    leave the axis alone); zero beyond the border, or the border value when ``edge``. Same shape and dtype; not
    differentiable (the callers' autograd covers that)."""
    use_torch_threads()
    spatial = image.shape[2:]
    volume = image.detach().reshape(-1, *((1,) * (3 - len(spatial))), *spatial).contiguous()
    src = volume.numpy()
    out, spare = src, np.empty_like(src)
    for index_axis, kernel in enumerate(kernels):
        if kernel is None:
            continue
        _correlate(out, spare, kernel.to(image.dtype).contiguous().numpy(), 3 - index_axis, edge)
        out, spare = spare, (np.empty_like(src) if out is src else out)  # never write into the caller's image
    return torch.from_numpy(out.copy() if out is src else out).view(image.shape)

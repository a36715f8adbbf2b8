"""Separable filters on the CPU, compiled with numba: the CPU face of ``regkit.spatial.filters.box_sum`` and
``gaussian_smooth`` (reached through ``regkit._backend`` as the ``"numba"`` backend of the ``filters`` op).

Images are ``(B, C, *spatial)`` with spatial layout ``[z, y, x]`` or ``[y, x]``; per-axis arguments are in index order
(x, y[, z]). Gaussian smoothing runs one pass per axis, correlating with an odd 1D kernel one shifted row of the image
at a time, so that the contiguous x axis is always the innermost loop; beyond the border the signal is its border
value. Box sums (zero beyond the border) take two passes: per plane, running sums along x rows and direct sums of the
buffered rows along y; then running sums along z over bundles of lines (two operations per voxel; the PyTorch face's
cumulative sums over whole lines lose more to cancellation). Results equal the PyTorch faces' up to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numba
import numpy as np
import torch

from regkit_kernels.numba.threads import parallel_for


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _correlate(
    first: int, last: int, src: np.ndarray, dst: np.ndarray, kernel: np.ndarray, axis: int, edge: bool
) -> None:
    """``dst = `` the correlation of ``src (P, Z, Y, X)`` along ``axis`` (1: z, 2: y, 3: x) with the odd ``kernel``,
    for the planes ``first`` to ``last - 1`` of the ``P Z`` (p, z) planes; beyond the border the signal is zero, or the
    border value when ``edge``."""
    Z, Y, X = src.shape[1:]
    r = kernel.shape[0] // 2
    for pz in range(first, last):
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


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _box_planes(first: int, last: int, src: np.ndarray, dst: np.ndarray, rx: int, ry: int) -> None:
    """``dst = `` the 2D box sum of planes ``first`` to ``last - 1`` of ``src (N, Y, X)`` (C-contiguous) with
    half-widths ``rx, ry``, zero beyond the border. Per plane: a running sum along each x row into a plane buffer (two
    operations per voxel), then each output row adds the ``2 ry + 1`` buffered rows it covers, the x loop innermost so
    that it vectorises."""
    Y, X = src.shape[1:]
    for n in range(first, last):
        rows = np.empty((Y, X), dtype=src.dtype)
        for y in range(Y):
            acc = src.dtype.type(0)
            for x in range(min(rx, X)):
                acc += src[n, y, x]
            for x in range(X):
                if x + rx < X:
                    acc += src[n, y, x + rx]
                if x - rx - 1 >= 0:
                    acc -= src[n, y, x - rx - 1]
                rows[y, x] = acc
        for y in range(Y):
            lo, hi = max(y - ry, 0), min(y + ry, Y - 1)
            for x in range(X):
                dst[n, y, x] = rows[lo, x]
            for q in range(lo + 1, hi + 1):
                for x in range(X):
                    dst[n, y, x] += rows[q, x]


_LINE_CHUNK = 1024  # voxels of a z line bundle: one bundle's running sums stay in L1


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _box_lines(first: int, last: int, src: np.ndarray, dst: np.ndarray, rz: int) -> None:
    """``dst = `` the box sum of ``src (P, Z, M)`` (C-contiguous) along its axis 1 with half-width ``rz``, zero beyond
    the border, for bundles ``first`` to ``last - 1`` of the ``P ceil(M / _LINE_CHUNK)`` bundles of up to
    ``_LINE_CHUNK`` neighbouring z lines: running sums over a bundle (add the plane entering the window, subtract the
    one leaving it)."""
    Z, M = src.shape[1:]
    chunks = (M + _LINE_CHUNK - 1) // _LINE_CHUNK
    for job in range(first, last):
        p, m0 = job // chunks, (job % chunks) * _LINE_CHUNK
        m1 = min(M, m0 + _LINE_CHUNK)
        acc = np.zeros(m1 - m0, dtype=src.dtype)
        for q in range(min(rz, Z)):
            for m in range(m0, m1):
                acc[m - m0] += src[p, q, m]
        for z in range(Z):
            if z + rz < Z:
                for m in range(m0, m1):
                    acc[m - m0] += src[p, z + rz, m]
            if z - rz - 1 >= 0:
                for m in range(m0, m1):
                    acc[m - m0] -= src[p, z - rz - 1, m]
            for m in range(m0, m1):
                dst[p, z, m] = acc[m - m0]


def _correlation(kernel: torch.Tensor, axis: int, edge: bool) -> Callable[[np.ndarray, np.ndarray], None]:
    """A pass of :func:`_correlate` with ``kernel`` along ``axis``."""
    weights = kernel.contiguous().numpy()
    return lambda src, dst: parallel_for(_correlate, src.shape[0] * src.shape[1], src, dst, weights, axis, edge)


def _passes(image: torch.Tensor, passes: list[Callable[[np.ndarray, np.ndarray], None]]) -> torch.Tensor:
    """Run ``passes`` (each ``(src, dst)`` over ``(P, Z, Y, X)`` arrays) one after the other on a CPU ``image
    (B, C, *spatial)``; same shape and dtype; the caller's image is never written."""
    spatial = image.shape[2:]
    src = image.detach().reshape(-1, *((1,) * (3 - len(spatial))), *spatial).contiguous().numpy()
    out, spare = src, np.empty_like(src)
    for run in passes:
        run(out, spare)
        out, spare = spare, (np.empty_like(src) if out is src else out)
    return torch.from_numpy(out.copy() if out is src else out).view(image.shape)


def box_sums(image: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Box sums of a CPU ``image (B, C, *spatial)`` over windows of ``sizes`` voxels (odd, index order x, y[, z]),
    zero outside the image; same shape and dtype. Running sums along x and z, direct sums of whole rows along y (float
    error grows with the x and z lengths, about 1e-6 relative in float32 for a few hundred voxels). Not
    differentiable."""
    radii = [k // 2 for k in sizes] + [0] * (3 - len(sizes))
    Y, X = image.shape[-2:]
    src = image.detach().contiguous().numpy()
    planes = np.empty_like(src)
    planes_in = src.reshape(-1, Y, X)
    parallel_for(_box_planes, planes_in.shape[0], planes_in, planes.reshape(-1, Y, X), radii[0], radii[1])
    if image.dim() == 4 or radii[2] == 0:
        return torch.from_numpy(planes)
    out = np.empty_like(src)
    Z = image.shape[2]
    lines = planes.reshape(-1, Z, Y * X)
    bundles = lines.shape[0] * ((Y * X + _LINE_CHUNK - 1) // _LINE_CHUNK)
    parallel_for(_box_lines, bundles, lines, out.reshape(-1, Z, Y * X), radii[2])
    return torch.from_numpy(out)


def separable(image: torch.Tensor, kernels: Sequence[torch.Tensor | None], edge: bool) -> torch.Tensor:
    """Correlate a CPU ``image (B, C, *spatial)`` along each index axis (x, y[, z]) with its odd 1D kernel (``None``:
    leave the axis alone); zero beyond the border, or the border value when ``edge``. Same shape and dtype; not
    differentiable (the callers' autograd covers that)."""
    passes: list[Callable[[np.ndarray, np.ndarray], None]] = []
    for index_axis, kernel in enumerate(kernels):
        if kernel is not None:
            passes.append(_correlation(kernel.to(image.dtype), 3 - index_axis, edge))
    return _passes(image, passes)

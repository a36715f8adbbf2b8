"""Linear interpolation of images at continuous voxel indices on the CPU, compiled with numba: the CPU face of
``regkit.spatial.sampling.sample_image(mode="linear")`` for images that need no gradient (reached through
``regkit._backend`` as the ``"numba"`` backend of the ``sampling`` op).

``values (C, Z, Y, X)`` (a 2D image is ``Z = 1`` with index ``z = 0``), ``index (P, 3)`` in (x, y, z) order with
integers at voxel centres; outside the image every voxel reads 0 (``grid_sample``'s ``padding_mode="zeros"`` with
``align_corners=True``, which the PyTorch face calls after normalising the indices to [-1, 1]). One point at a time:
its 8 corners, their trilinear weights, and in the backward pass the gradient with respect to the index from the same
corners. Equal to the PyTorch face up to float rounding (it interpolates from the index directly, without the
normalisation round trip).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch

from regkit_kernels.numba.threads import use_torch_threads


@numba.njit(cache=True, inline="always")
def _corner(values: np.ndarray, c: int, z: int, y: int, x: int) -> float:
    Z, Y, X = values.shape[1:]
    if 0 <= z < Z and 0 <= y < Y and 0 <= x < X:
        return values[c, z, y, x]
    return 0.0


@numba.njit(cache=True, inline="always")
def _cell(index: np.ndarray, p: int) -> tuple[int, int, int, float, float, float]:
    """The voxel below point ``p`` (the corner with the lowest indices) and the point's fractions from it."""
    x, y, z = index[p, 0], index[p, 1], index[p, 2]
    x0, y0, z0 = np.floor(x), np.floor(y), np.floor(z)
    return int(x0), int(y0), int(z0), x - x0, y - y0, z - z0


@numba.njit(parallel=True, cache=True)
def _sample(values: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:
    C = values.shape[0]
    for p in numba.prange(index.shape[0]):
        i, j, k, fx, fy, fz = _cell(index, p)
        for c in range(C):
            acc = 0.0
            for dz in range(2):
                wz = fz if dz else 1.0 - fz
                for dy in range(2):
                    wy = fy if dy else 1.0 - fy
                    for dx in range(2):
                        wx = fx if dx else 1.0 - fx
                        acc += wz * wy * wx * _corner(values, c, k + dz, j + dy, i + dx)
            out[c, p] = acc


@numba.njit(parallel=True, cache=True)
def _sample_backward(values: np.ndarray, index: np.ndarray, grad: np.ndarray, grad_index: np.ndarray) -> None:
    """``grad_index[p] = sum_c grad[c, p] d(sample_c)/d(index_p)``."""
    C = values.shape[0]
    for p in numba.prange(index.shape[0]):
        i, j, k, fx, fy, fz = _cell(index, p)
        gx = gy = gz = 0.0
        for c in range(C):
            g = grad[c, p]
            if g == 0:
                continue
            for dz in range(2):
                wz = fz if dz else 1.0 - fz
                sz = 1.0 if dz else -1.0
                for dy in range(2):
                    wy = fy if dy else 1.0 - fy
                    sy = 1.0 if dy else -1.0
                    for dx in range(2):
                        wx = fx if dx else 1.0 - fx
                        sx = 1.0 if dx else -1.0
                        v = g * _corner(values, c, k + dz, j + dy, i + dx)
                        gx += v * sx * wy * wz
                        gy += v * wx * sy * wz
                        gz += v * wx * wy * sz
        grad_index[p, 0], grad_index[p, 1], grad_index[p, 2] = gx, gy, gz


def _volumes(values: torch.Tensor, index: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``values (C, *spatial)`` as ``(C, Z, Y, X)`` and ``index (P, n)`` as ``(P, 3)``, contiguous arrays."""
    if index.shape[-1] == 2:
        values = values.unsqueeze(1)
        index = torch.cat([index, index.new_zeros(index.shape[0], 1)], dim=1)
    return values.detach().contiguous().numpy(), index.detach().contiguous().numpy()


class LinearSample(torch.autograd.Function):
    """``LinearSample.apply(values (C, *spatial), index (P, n)) -> (C, P)``: (bi/tri)linear samples at continuous
    voxel indices ((x, y[, z]) order, zero outside); differentiable with respect to ``index`` only."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        use_torch_threads()
        ctx.save_for_backward(values, index)
        volume, points = _volumes(values, index)
        out = np.empty((volume.shape[0], points.shape[0]), dtype=volume.dtype)
        _sample(volume, points, out)
        return torch.from_numpy(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None]:
        if not ctx.needs_input_grad[1]:
            return None, None
        use_torch_threads()
        values, index = ctx.saved_tensors
        volume, points = _volumes(values, index)
        grad_index = np.empty((points.shape[0], 3), dtype=points.dtype)
        _sample_backward(volume, points, grad.detach().contiguous().numpy(), grad_index)
        return None, torch.from_numpy(grad_index[:, : index.shape[1]])


def linear(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Samples ``(C, P)`` of CPU ``values (C, *spatial)`` at ``index (P, n)`` (same float dtype); see
    :class:`LinearSample`."""
    return LinearSample.apply(values, index)

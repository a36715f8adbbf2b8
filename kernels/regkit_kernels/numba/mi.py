"""The Parzen-window joint histogram of mutual information on the CPU, compiled with numba: the CPU face of
``regkit.similarity._JointHistogram`` (reached through ``regkit._backend`` as the ``"numba"`` backend of the ``mi``
op).

``H[k] = sum_v w[k, v] P(t_f[k, v]) P(t_g[k, v])^T`` for intensities ``t`` in [0, 1] of ``(images, voxels)`` arrays,
where ``P(t)`` are the cubic B-spline memberships of ``regkit.similarity._parzen`` (4 neighbouring bins of
``u = 1 + t (bins - 3)``). Per voxel the 4 x 4 products go straight into the histogram (one float64 table per thread,
summed at the end), and the backward pass forms the voxel's gradient from the 4 x 4 block of ``dL/dH`` it touched:
``O(16)`` work per voxel and no dense ``(voxels, bins)`` memberships, where the PyTorch face builds them in chunks and
multiplies them. The results equal the PyTorch face's up to float rounding.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from regkit_kernels.numba.threads import parallel_for, torch_threads


@numba.njit(cache=True, inline="always")
def _spline(t: float, bins: int) -> tuple[int, float, float, float, float, float, float, float, float]:
    """First bin and the 4 memberships of intensity ``t``, and their derivatives with respect to ``t``."""
    u = 1.0 + t * (bins - 3)
    start = min(np.floor(u), bins - 3.0)
    s = u - start
    r = 1.0 - s
    scale = bins - 3.0
    return (
        int(start) - 1,
        r * r * r / 6.0,
        2.0 / 3.0 - s * s + s * s * s / 2.0,
        2.0 / 3.0 - r * r + r * r * r / 2.0,
        s * s * s / 6.0,
        -0.5 * r * r * scale,
        s * (1.5 * s - 2.0) * scale,
        r * (2.0 - 1.5 * r) * scale,
        0.5 * s * s * scale,
    )


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _histogram(
    first_task: int, last_task: int, t_f: np.ndarray, t_g: np.ndarray, w: np.ndarray, bins: int, tables: np.ndarray
) -> None:
    """``tables (tasks, K, bins, bins)`` float64: task ``j`` (of ``first_task`` to ``last_task - 1``) sums its share
    of the voxels of every image."""
    K, V = t_f.shape
    tasks = tables.shape[0]
    for task in range(first_task, last_task):
        pf = np.empty(4)
        pg = np.empty(4)
        for k in range(K):
            for v in range(task * V // tasks, (task + 1) * V // tasks):
                wv = w[k, v]
                if wv == 0:
                    continue
                a0, pf[0], pf[1], pf[2], pf[3], _, _, _, _ = _spline(t_f[k, v], bins)
                b0, pg[0], pg[1], pg[2], pg[3], _, _, _, _ = _spline(t_g[k, v], bins)
                for a in range(4):
                    wa = wv * pf[a]
                    for b in range(4):
                        tables[task, k, a0 + a, b0 + b] += wa * pg[b]


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _histogram_backward(
    first: int,
    last: int,
    t_f: np.ndarray,
    t_g: np.ndarray,
    w: np.ndarray,
    grad: np.ndarray,
    bins: int,
    grad_f: np.ndarray,
    grad_g: np.ndarray,
    grad_w: np.ndarray,
) -> None:
    """Per voxel ``k V + v`` from ``first`` to ``last - 1``, from ``grad = dL/dH (K, bins, bins)``: ``dL/dt_f``,
    ``dL/dt_g`` and ``dL/dw`` (each written when its array is not empty)."""
    V = t_f.shape[1]
    need_f, need_g, need_w = grad_f.shape[0] > 0, grad_g.shape[0] > 0, grad_w.shape[0] > 0
    for kv in range(first, last):
        k, v = kv // V, kv % V
        a0, f0, f1, f2, f3, df0, df1, df2, df3 = _spline(t_f[k, v], bins)
        b0, g0, g1, g2, g3, dg0, dg1, dg2, dg3 = _spline(t_g[k, v], bins)
        pf = (f0, f1, f2, f3)
        pg = (g0, g1, g2, g3)
        dpf = (df0, df1, df2, df3)
        dpg = (dg0, dg1, dg2, dg3)
        sum_f = 0.0  # sum_a dpf[a] (sum_b G[a, b] pg[b])
        sum_g = 0.0  # sum_b dpg[b] (sum_a pf[a] G[a, b])
        sum_w = 0.0  # sum_a pf[a] (sum_b G[a, b] pg[b])
        for a in range(4):
            row = 0.0
            for b in range(4):
                gab = grad[k, a0 + a, b0 + b]
                row += gab * pg[b]
                sum_g += dpg[b] * pf[a] * gab
            sum_f += dpf[a] * row
            sum_w += pf[a] * row
        wv = w[k, v]
        if need_f:
            grad_f[k, v] = wv * sum_f
        if need_g:
            grad_g[k, v] = wv * sum_g
        if need_w:
            grad_w[k, v] = sum_w


def _array(x: torch.Tensor) -> np.ndarray:
    return x.detach().contiguous().numpy()


def joint_histogram(t_f: torch.Tensor, t_g: torch.Tensor, w: torch.Tensor, bins: int) -> torch.Tensor:
    """Joint histograms ``(images, bins, bins)`` of CPU intensities ``t_f, t_g (images, voxels)`` in [0, 1] with
    voxel weights ``w`` of the same shape, in their dtype (summed in float64). Not differentiable by itself."""
    tasks = max(1, min(torch_threads(), t_f.shape[1] // 4096))
    tables = np.zeros((tasks, t_f.shape[0], bins, bins))
    parallel_for(_histogram, tasks, _array(t_f), _array(t_g), _array(w), bins, tables)
    return torch.from_numpy(tables.sum(axis=0)).to(t_f.dtype)


def joint_histogram_backward(
    t_f: torch.Tensor, t_g: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, bins: int, needs: tuple[bool, ...]
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``dL/dt_f``, ``dL/dt_g``, ``dL/dw`` (None where ``needs`` is false) for ``grad = dL/dH (images, bins, bins)``."""
    K, V = t_f.shape
    dtype = _array(t_f).dtype
    grad_f, grad_g, grad_w = (np.empty((K, V) if need else (0, 0), dtype=dtype) for need in needs[:3])
    parallel_for(
        _histogram_backward, K * V, _array(t_f), _array(t_g), _array(w), _array(grad), bins, grad_f, grad_g, grad_w
    )
    return (
        torch.from_numpy(grad_f) if needs[0] else None,
        torch.from_numpy(grad_g) if needs[1] else None,
        torch.from_numpy(grad_w) if needs[2] else None,
    )

"""Local normalised cross-correlation on the CPU, compiled with numba: the CPU face of the squared local NCC map of
``regkit.similarity.LocalNCC`` (``_local_cc2`` and its closed-form image gradient), reached through ``regkit._backend``
as the ``"numba"`` backend of the ``lncc`` op.

Images ``f``, ``g`` are ``(B, C, *spatial)`` with spatial layout ``[z, y, x]`` or ``[y, x]``, voxel weights ``w`` ``(B |
1, 1, *spatial)``; window sizes are odd, in index order (x, y[, z]). The forward pass forms the six weighted moments
(``w, w f, w g, w f^2, w g^2, w f g``) in one pass, box-sums all of them in one call (``filters.box_sums``: zero outside
the image) and turns them into the window statistics and ``cc^2 = min(1, cov^2 / ((var_f + eps) (var_g + eps)))`` in a
second pass (0 in a window whose weight sum is below ``min_weight``: it holds no voxel of the mask, only the rounding of
the box sums); the statistics are kept for the backward pass, which forms its four (or seven, with the gradient for
``f``) adjoint maps in one pass, box-sums them in one call and combines them in a last pass. The formulas are those of
``regkit.similarity._LocalCC2`` (its docstring derives the gradient); the results equal the PyTorch face's up to float
rounding (different summation orders, float64 for the scalar factors). Each per-voxel kernel takes a range ``[first,
last)`` of the flat index ``p V + v`` over the ``P = B C`` planes of ``V`` voxels, which ``threads.parallel_for`` splits
over the threads (over voxels, not planes: a registration has one plane).
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np
import torch

from regkit_kernels.numba.filters import box_sums
from regkit_kernels.numba.threads import parallel_for


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _moments(first: int, last: int, f: np.ndarray, g: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    """``out[p] = (w, w f, w g, w f f, w g g, w f g)`` for planes ``f, g (P, V)``, weights ``w (Pw, V)`` (plane
    ``p`` takes row ``p * Pw // P``: one row per batch element), ``out (P, 6, V)``."""
    P, V = f.shape
    for pv in range(first, last):
        p, v = pv // V, pv % V
        wv, fv, gv = w[p * w.shape[0] // P, v], f[p, v], g[p, v]
        out[p, 0, v] = wv
        out[p, 1, v] = wv * fv
        out[p, 2, v] = wv * gv
        out[p, 3, v] = wv * fv * fv
        out[p, 4, v] = wv * gv * gv
        out[p, 5, v] = wv * fv * gv


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _statistics(first: int, last: int, sums: np.ndarray, eps: float, min_weight: float, cc2: np.ndarray) -> None:
    """Box sums ``(P, 6, V)`` -> in place ``(count, mean_f, mean_g, var_f, var_g, cov)``; ``cc2 (P, V)``. A window
    whose ``cc^2`` takes no gradient (weight sum below ``min_weight``, or ``cc^2`` clamped at 1) keeps count 0."""
    V = sums.shape[2]
    for pv in range(first, last):
        p, v = pv // V, pv % V
        count = sums[p, 0, v]
        if count < min_weight:
            cc2[p, v] = 0.0
            for k in range(6):
                sums[p, k, v] = 0.0
            continue
        mf, mg = sums[p, 1, v] / count, sums[p, 2, v] / count
        var_f = sums[p, 3, v] / count - mf * mf
        var_g = sums[p, 4, v] / count - mg * mg
        cov = sums[p, 5, v] / count - mf * mg
        raw = cov * cov / ((max(var_f, 0.0) + eps) * (max(var_g, 0.0) + eps))
        cc2[p, v] = min(raw, 1.0)
        sums[p, 0, v], sums[p, 1, v], sums[p, 2, v] = (count if raw <= 1.0 else 0.0), mf, mg
        sums[p, 3, v], sums[p, 4, v], sums[p, 5, v] = var_f, var_g, cov


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _adjoint_maps(
    first: int, last: int, stats: np.ndarray, grad: np.ndarray, eps: float, need_f: bool, out: np.ndarray
) -> None:
    """Per window centre, from the statistics ``(P, 6, V)`` and ``dL/dcc2 (P, V)``: ``out (P, 4 | 7, V)`` =
    ``a, a mean_f, b_g, b_g mean_g`` (and ``a mean_g, b_f, b_f mean_f`` when ``need_f``), where
    ``a = 2 cov grad / (V_f V_g count)`` and ``b_x = a cov / V_x [var_x >= 0]`` (``V = max(var, 0) + eps``); all 0 in a
    window of count 0 (:func:`_statistics`)."""
    V = stats.shape[2]
    for pv in range(first, last):
        p, v = pv // V, pv % V
        count, mf, mg = stats[p, 0, v], stats[p, 1, v], stats[p, 2, v]
        if count == 0.0:
            for k in range(out.shape[1]):
                out[p, k, v] = 0.0
            continue
        var_f, var_g, cov = stats[p, 3, v], stats[p, 4, v], stats[p, 5, v]
        vf, vg = max(var_f, 0.0) + eps, max(var_g, 0.0) + eps
        a = 2.0 * cov * grad[p, v] / (vf * vg * count)
        b_g = a * cov / vg if var_g >= 0 else 0.0
        out[p, 0, v] = a
        out[p, 1, v] = a * mf
        out[p, 2, v] = b_g
        out[p, 3, v] = b_g * mg
        if need_f:
            b_f = a * cov / vf if var_f >= 0 else 0.0
            out[p, 4, v] = a * mg
            out[p, 5, v] = b_f
            out[p, 6, v] = b_f * mf


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _combine(
    first: int,
    last: int,
    f: np.ndarray,
    g: np.ndarray,
    w: np.ndarray,
    boxed: np.ndarray,
    need_f: bool,
    grad_f: np.ndarray,
    grad_g: np.ndarray,
) -> None:
    """``grad_g = w (f box(a) - box(a mf) - g box(b_g) + box(b_g mg))`` and, when ``need_f``, the same for ``f``."""
    P, V = f.shape
    for pv in range(first, last):
        p, v = pv // V, pv % V
        wp = p * w.shape[0] // P
        wv, fv, gv = w[wp, v], f[p, v], g[p, v]
        box_a = boxed[p, 0, v]
        grad_g[p, v] = wv * (fv * box_a - boxed[p, 1, v] - gv * boxed[p, 2, v] + boxed[p, 3, v])
        if need_f:
            grad_f[p, v] = wv * (gv * box_a - boxed[p, 4, v] - fv * boxed[p, 5, v] + boxed[p, 6, v])


def _planes(x: torch.Tensor) -> np.ndarray:
    return x.detach().contiguous().reshape(x.shape[0] * x.shape[1], -1).numpy()


def _box(maps: np.ndarray, spatial: tuple[int, ...], window: Sequence[int]) -> np.ndarray:
    """Box sums of ``maps (P, K, V)`` over ``window`` (zero outside the image), same shape."""
    P, K, _ = maps.shape
    volume = torch.from_numpy(maps).view(P * K, 1, *spatial)
    return box_sums(volume, window).reshape(P, K, -1).numpy()


def local_cc2(
    f: torch.Tensor, g: torch.Tensor, w: torch.Tensor, window: Sequence[int], eps: float, min_weight: float
) -> tuple[torch.Tensor, np.ndarray]:
    """The squared local NCC map ``(B, C, *spatial)`` of CPU images ``f, g`` with weights ``w (B | 1, 1, *spatial)``
    over ``window`` (odd, index order; windows of weight sum below ``min_weight`` give 0), and the window statistics
    ``(B C, 6, voxels)`` for :func:`local_cc2_backward`.
    Not differentiable by itself (``regkit.similarity._LocalCC2`` wraps it)."""
    f_np, g_np, w_np = _planes(f), _planes(g), _planes(w)
    P, V = f_np.shape
    spatial = tuple(f.shape[2:])
    moments = np.empty((P, 6, V), dtype=f_np.dtype)
    parallel_for(_moments, P * V, f_np, g_np, w_np, moments)
    stats = _box(moments, spatial, window)
    cc2 = np.empty((P, V), dtype=f_np.dtype)
    parallel_for(_statistics, P * V, stats, float(eps), float(min_weight), cc2)
    return torch.from_numpy(cc2).view(f.shape), stats


def local_cc2_backward(
    f: torch.Tensor,
    g: torch.Tensor,
    w: torch.Tensor,
    stats: np.ndarray,
    grad: torch.Tensor,
    window: Sequence[int],
    eps: float,
    need_f: bool,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``dL/df`` (when ``need_f``, else None) and ``dL/dg`` for ``grad = dL/dcc2 (B, C, *spatial)``, from the
    statistics :func:`local_cc2` returned (the weights are constants)."""
    f_np, g_np, w_np = _planes(f), _planes(g), _planes(w)
    P, V = f_np.shape
    maps = np.empty((P, 7 if need_f else 4, V), dtype=f_np.dtype)
    parallel_for(_adjoint_maps, P * V, stats, _planes(grad), float(eps), need_f, maps)
    boxed = _box(maps, tuple(f.shape[2:]), window)
    grad_g = np.empty((P, V), dtype=f_np.dtype)
    grad_f = np.empty((P, V) if need_f else (0, 0), dtype=f_np.dtype)
    parallel_for(_combine, P * V, f_np, g_np, w_np, boxed, need_f, grad_f, grad_g)
    return (torch.from_numpy(grad_f).view(f.shape) if need_f else None), torch.from_numpy(grad_g).view(g.shape)

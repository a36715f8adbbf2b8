"""The ``lncc`` similarity: ``1 - mean(cc^2)`` with ``cc`` the local NCC in a box window (the ANTs / VoxelMorph
convention), in [0, 1] (options: :class:`LnccSimilarity`). On the CPU the squared local NCC map and its gradient run in
fused numba kernels (``regkit_kernels.numba.lncc``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from regkit import _backend
from regkit.errors import ConfigError
from regkit.similarity.base import Similarity, masked_mean, standardise
from regkit.spatial.filters import box_sum, per_axis

__all__ = ["LNCC_FACES", "MIN_WINDOW_WEIGHT", "LocalNormalizedCrossCorrelation"]

LNCC_FACES = ("torch", "numba")
"""The implementations of the squared local NCC map: PyTorch, or fused numba kernels on the CPU."""

MIN_WINDOW_WEIGHT = 0.5
"""A window whose mask weight sum is below this (less than half a voxel) holds no voxel of the mask, only the rounding
of the box sums (in float32 about 1e-5 of a line's total): its ``cc^2`` is 0 and takes no gradient."""


class LocalNormalizedCrossCorrelation(Similarity):
    """``1 - mean(cc^2)`` with ``cc`` the normalised cross-correlation in a box window centred on each voxel.

    Args:
        window: odd window size in voxels, one number or one per axis in index order (x, y[, z]).
        eps: added to each local variance (images are first standardised globally, so it is relative to the global
            variance); damps flat regions, where ``cc^2`` goes to 0.

    Window statistics are weighted by the mask and ignore voxels outside the image; the mean of ``cc^2`` is weighted by
    the mask. A window with no mask voxel (weight sum below :data:`MIN_WINDOW_WEIGHT`) has ``cc^2 = 0``, and ``cc^2`` is
    clamped at 1 (which it exceeds only by rounding, where a window's variances are tiny), both without gradient, so
    that masks work in float32. Box sums come from cumulative sums, so the cost does not grow with the window. The
    gradient with respect to the images is computed in closed form from box sums (recomputing the window statistics), so
    only the two standardised images are kept for the backward pass; a mask that requires a gradient takes the autograd
    path.
    """

    def __init__(self, window: int | Sequence[int] = 9, eps: float = 1e-5) -> None:
        super().__init__()
        sizes = (window,) if isinstance(window, int) else tuple(window)
        if not sizes or any(not isinstance(k, int) or k < 1 or k % 2 == 0 for k in sizes):
            raise ConfigError(f"lncc window must be odd positive integers (voxels), got {window}")
        if eps <= 0:
            raise ConfigError(f"lncc eps must be positive, got {eps}")
        self.window = window
        self.eps = eps

    def weighted_loss(self, fixed: torch.Tensor, warped: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        window = tuple(int(k) for k in per_axis(self.window, fixed.dim() - 2, "lncc window"))
        f = standardise(fixed, weights)
        g = standardise(warped, weights)
        if weights.requires_grad:
            cc2 = _local_cc2(f, g, weights, window, self.eps)
        else:
            cc2 = _LocalCC2.apply(f, g, weights, window, self.eps)
        return 1.0 - masked_mean(cc2, weights).mean()


def _window_stats(
    f: torch.Tensor, g: torch.Tensor, weights: torch.Tensor, window: tuple[int, ...]
) -> tuple[torch.Tensor, ...]:
    """Mask-weighted window statistics of ``f`` and ``g``: whether the window holds mask voxels, voxel weight sum (1
    where it holds none), means, variances, covariance.

    One box sum at a time, so that no more than a few image-sized temporaries exist at once.
    """
    count = box_sum(weights, window)
    empty = count < MIN_WINDOW_WEIGHT
    count = count.masked_fill(empty, 1.0)
    mf = box_sum(weights * f, window) / count
    mg = box_sum(weights * g, window) / count
    var_f = box_sum(weights * f * f, window) / count - mf * mf
    var_g = box_sum(weights * g * g, window) / count - mg * mg
    cov = box_sum(weights * f * g, window) / count - mf * mg
    return ~empty, count, mf, mg, var_f, var_g, cov


def _raw_cc2(var_f: torch.Tensor, var_g: torch.Tensor, cov: torch.Tensor, eps: float) -> torch.Tensor:
    return cov * cov / ((var_f.clamp_min(0.0) + eps) * (var_g.clamp_min(0.0) + eps))


def _local_cc2(
    f: torch.Tensor, g: torch.Tensor, weights: torch.Tensor, window: tuple[int, ...], eps: float
) -> torch.Tensor:
    """Squared local NCC map ``min(1, cov^2 / ((var_f + eps) (var_g + eps)))``, 0 in windows without mask voxels
    (autograd reference)."""
    full, _, _, _, var_f, var_g, cov = _window_stats(f, g, weights, window)
    return _raw_cc2(var_f, var_g, cov, eps).clamp_max(1.0) * full


class _LocalCC2(torch.autograd.Function):
    """``_local_cc2`` with a closed-form backward for the images (the weights are constants here).

    With ``a = 2 cov / (Vf Vg W) * grad`` and ``b_g = 2 cov^2 / (Vf Vg^2 W) * grad`` per window centre (``V = var +
    eps``, ``W`` the window's weight sum; 0 where ``cc^2`` takes no gradient), the adjoint of the window sums gives
    ``d/dg = w (f box(a) - box(a mf) - g box(b_g) + box(b_g mg))``, and symmetrically for ``f``. On the CPU the same
    formulas run fused in numba (``regkit_kernels.numba.lncc``; the window statistics are kept for the backward pass).
    """

    @staticmethod
    def forward(
        ctx: Any,
        f: torch.Tensor,
        g: torch.Tensor,
        weights: torch.Tensor,
        window: tuple[int, ...],
        eps: float,
    ) -> torch.Tensor:
        ctx.save_for_backward(f, g, weights)
        ctx.window, ctx.eps = window, eps
        ctx.numba = _backend.resolve_backend("auto", f.device, "lncc", faces=LNCC_FACES) == "numba"
        if ctx.numba:
            cc2, ctx.stats = _backend.load_kernels("numba.lncc").local_cc2(
                f, g, weights, window, eps, MIN_WINDOW_WEIGHT
            )
            return cc2
        return _local_cc2(f, g, weights, window, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        f, g, weights = ctx.saved_tensors
        window, eps = ctx.window, ctx.eps
        if ctx.numba:
            df, dg = _backend.load_kernels("numba.lncc").local_cc2_backward(
                f, g, weights, ctx.stats, grad, window, eps, ctx.needs_input_grad[0]
            )
            return df, (dg if ctx.needs_input_grad[1] else None), None, None, None
        full, count, mf, mg, var_f, var_g, cov = _window_stats(f, g, weights, window)
        vf, vg = var_f.clamp_min(0.0) + eps, var_g.clamp_min(0.0) + eps
        live = full & (_raw_cc2(var_f, var_g, cov, eps) <= 1.0)  # the windows whose cc^2 takes a gradient
        a = 2.0 * cov * grad * live / (vf * vg * count)
        grad_f = grad_g = None
        if ctx.needs_input_grad[0]:
            b_f = a * cov / vf * (var_f >= 0)
            grad_f = g * box_sum(a, window) - box_sum(a * mg, window)
            grad_f = weights * (grad_f - f * box_sum(b_f, window) + box_sum(b_f * mf, window))
        if ctx.needs_input_grad[1]:
            b_g = a * cov / vg * (var_g >= 0)
            grad_g = f * box_sum(a, window) - box_sum(a * mf, window)
            grad_g = weights * (grad_g - g * box_sum(b_g, window) + box_sum(b_g * mg, window))
        return grad_f, grad_g, None, None, None

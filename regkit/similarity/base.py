"""The base class of the similarity measures, and the masked statistics they share.

Every measure is an ``nn.Module`` called as ``loss = sim(fixed, warped, mask=None)``:

* ``fixed``, ``warped``: tensors ``(B, C, *spatial)`` of equal shape, 2D (``[y, x]``) or 3D (``[z, y, x]``), on the
  fixed grid, float32 or float64, CPU or CUDA;
* ``mask``: optional weights ``(B or 1, 1, *spatial)`` in [0, 1] (the fixed mask times the warped moving mask) that
  restrict every statistic to the masked region; an all-zero mask (for any batch element) raises ``ImageValueError``;
* the result is a scalar tensor, the mean over batch and channels, differentiable with respect to both images and the
  mask. Constant images give finite values and gradients.

A measure is evaluated on an already warped image (``forward``), or through :meth:`Similarity.loss_at_points` from
the moving image and the world points where the transformation samples it, which a measure may override to avoid
resampling the moving image itself (``features`` in its ``warp_features`` mode).
"""

from __future__ import annotations

import torch
from torch import nn

from regkit import _backend
from regkit.errors import ImageValueError
from regkit.spatial.grid import Grid
from regkit.spatial.sampling import sample_image

__all__ = ["EPS_REL", "TINY", "Similarity", "mask_weights", "masked_mean", "standardise"]

EPS_REL = 1e-9
"""Standardisation floor: the variance gets ``EPS_REL * mean square`` added, so that a constant image standardises to
(nearly) zero instead of amplified rounding noise."""
TINY = 1e-12
"""Keeps square roots and divisions finite for all-zero input."""


class Similarity(nn.Module):
    """Base class of the similarity losses; subclasses implement :meth:`weighted_loss`."""

    def forward(self, fixed: torch.Tensor, warped: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Loss between ``fixed`` and ``warped`` ``(B, C, *spatial)``, restricted to ``mask`` ``(B|1, 1, *spatial)``."""
        return self.weighted_loss(fixed, warped, mask_weights(fixed, warped, mask))

    def weighted_loss(self, fixed: torch.Tensor, warped: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The loss of checked inputs with voxel weights ``(B|1, 1, *spatial)`` (from :func:`mask_weights`)."""
        raise NotImplementedError

    def loss_at_points(
        self,
        fixed: torch.Tensor,
        moving: torch.Tensor,
        moving_grid: Grid,
        points: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Loss between ``fixed`` ``(1, C, *S)`` and ``moving`` ``(C, *moving_grid.shape)`` sampled (linear, zero
        outside) at LPS world points ``points`` ``(*S, n)``, one per fixed voxel; ``mask`` as in :meth:`forward`.
        Differentiable with respect to ``points``. This default warps the moving image and calls :meth:`forward`."""
        return self(fixed, sample_image(moving, moving_grid, points)[None], mask)


def mask_weights(fixed: torch.Tensor, warped: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Check the inputs and return voxel weights ``(B|1, 1, *spatial)`` in the images' dtype (ones without a mask)."""
    if fixed.dim() not in (4, 5) or fixed.shape != warped.shape:
        raise ValueError(
            f"similarity needs fixed and warped of one shape (B, C, *spatial) with 2 or 3 spatial axes, "
            f"got {tuple(fixed.shape)} and {tuple(warped.shape)}"
        )
    if not fixed.is_floating_point() or fixed.dtype != warped.dtype:
        raise ValueError(f"similarity needs floating images of one dtype, got {fixed.dtype} and {warped.dtype}")
    spatial = fixed.shape[2:]
    if mask is None:
        return torch.ones((1, 1, *spatial), dtype=fixed.dtype, device=fixed.device)
    if (
        mask.dim() != fixed.dim()
        or mask.shape[1] != 1
        or mask.shape[2:] != spatial
        or mask.shape[0] not in (1, fixed.shape[0])
    ):
        raise ValueError(f"mask must have shape (B or 1, 1, *{tuple(spatial)}), got {tuple(mask.shape)}")
    weights = mask.to(fixed.dtype)
    # Not checked while a CUDA graph is captured (the check waits for the GPU): an empty mask then gives a NaN loss,
    # which the engine reports.
    if not _backend.capturing(weights) and bool((weights.flatten(1).sum(1) <= 0).any()):
        raise ImageValueError("the similarity mask is empty: the fixed and (warped) moving masks share no voxel")
    return weights


def masked_mean(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted mean over the spatial axes of ``x`` ``(B, C, *spatial)``, shaped ``(B, C, 1, ...)``."""
    dims = tuple(range(2, x.dim()))
    return (x * weights).sum(dims, keepdim=True) / weights.sum(dims, keepdim=True)


def standardise(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-9 * mean square)`` with masked statistics per batch element and channel.

    NCC and LNCC are invariant to this map (up to the floor), which makes their epsilons dimensionless and keeps the
    box-filter sums well conditioned whatever the intensity units.
    """
    mean = masked_mean(x, weights)
    centred = x - mean
    var = masked_mean(centred * centred, weights)
    return centred / torch.sqrt(var + EPS_REL * (var + mean * mean) + TINY)

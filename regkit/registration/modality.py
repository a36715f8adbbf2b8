"""Telling same-contrast from multi-modal pairs, on the pair itself: how linearly the fixed intensities explain the
moving ones once the earlier stages have aligned them.

``r^2 / eta^2``: Pearson's squared correlation of the fixed and the mapped moving intensities over the correlation
ratio ``eta^2`` (the share of the moving intensities' variance explained by the fixed intensity, in ``BINS`` bins), on
the voxels where either image has signal (rescaled intensity above ``SIGNAL``). ``r^2 <= eta^2`` up to the binning;
the ratio is about 1 when the relation is linear (one contrast up to gain and offset, what the local NCC assumes) and
falls when it is not (another contrast). Intensities are rescaled as every similarity sees them
(``regkit.intensity.rescale_intensities``).
"""

from __future__ import annotations

import torch

from regkit.intensity import rescale_intensities
from regkit.spatial.grid import Grid
from regkit.spatial.sampling import sample_image

__all__ = ["BINS", "SIGNAL", "linearity", "mapped_linearity"]

BINS = 32
SIGNAL = 0.05


def linearity(fixed: torch.Tensor, moving: torch.Tensor) -> float:
    """``r^2 / eta^2`` of two intensity vectors in about [0, 1] (``eta^2`` of ``moving`` given ``fixed``); 1.0 when
    either is constant (nothing to tell)."""
    fixed, moving = fixed.double(), moving.double()
    if fixed.numel() < 2 or float(fixed.var()) == 0 or float(moving.var()) == 0:
        return 1.0
    r = float(torch.corrcoef(torch.stack([fixed, moving]))[0, 1])
    bins = torch.clamp((fixed * BINS).long(), 0, BINS - 1)
    counts = torch.bincount(bins, minlength=BINS).clamp_min(1)
    means = torch.zeros(BINS, dtype=moving.dtype, device=moving.device).scatter_add(0, bins, moving) / counts
    eta2 = float(((means[bins] - moving.mean()) ** 2).mean() / moving.var())
    return 1.0 if eta2 <= 0 else min(r * r / eta2, 1.0)


def mapped_linearity(fixed: torch.Tensor, moving: torch.Tensor, moving_grid: Grid, mapped: torch.Tensor) -> float:
    """:func:`linearity` of ``fixed`` (any shape) and ``moving`` (on ``moving_grid``, ``[z, y, x]``) sampled at
    ``mapped``, the moving world points (LPS mm) of ``fixed``'s voxels (``(*fixed.shape, n)``)."""
    f = rescale_intensities(fixed).flatten()
    m = sample_image(rescale_intensities(moving), moving_grid, mapped).flatten()
    signal = (f > SIGNAL) | (m > SIGNAL)
    return linearity(f[signal], m[signal])

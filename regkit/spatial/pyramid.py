"""Multi-resolution image pyramids: Gaussian smoothing then shrinking by integer factors, with ITK's grid geometry.

Shrink convention (ITK's ``ShrinkImageFilter``): along an axis of ``n`` voxels shrunk by ``f``, the coarse grid has
``m = max(1, floor(n / f))`` voxels of spacing ``spacing * f`` and the same direction, and its origin is shifted so
that the coarse and fine grids share their centre point. When ``f`` divides ``n`` the coarse voxel centres sit at the
centres of consecutive ``f``-voxel blocks: coarse voxel ``j`` is at fine index ``f j + (f - 1) / 2``; in general at
fine index ``start + f j`` with ``start = (n - f m + f - 1) / 2``. Coarse values are the smoothed image at those
points (linear interpolation between the two neighbouring fine voxels when ``start`` is a half-integer; ITK would pick
one of them).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from regkit.spatial.filters import gaussian_smooth, per_axis
from regkit.spatial.grid import Grid


def _factors(shrink: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    factors = per_axis(shrink, ndim, "shrink")
    if any(f < 1 or f != int(f) for f in factors):
        raise ValueError(f"shrink factors must be positive integers, got {factors}")
    return tuple(int(f) for f in factors)


def _starts(grid: Grid, factors: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Coarse sizes and the fine index of coarse voxel 0, per axis in index order."""
    sizes = tuple(max(1, n // f) for n, f in zip(grid.size, factors, strict=True))
    starts = tuple((n - f * m + f - 1) / 2.0 for n, f, m in zip(grid.size, factors, sizes, strict=True))
    return sizes, starts


def shrink_grid(grid: Grid, shrink: int | Sequence[int]) -> Grid:
    """The coarse grid of ``grid`` shrunk by integer factors (one, or one per axis in index order x, y[, z]).

    Follows ITK's ShrinkImageFilter (see the module docstring); world coordinates are LPS mm.
    """
    factors = _factors(shrink, grid.ndim)
    sizes, starts = _starts(grid, factors)
    origin = grid.index_to_world(torch.tensor(starts, dtype=torch.float64)).tolist()
    spacing = [s * f for s, f in zip(grid.spacing, factors, strict=True)]
    return Grid.create(sizes, spacing, origin, grid.direction)


def downsample(image: torch.Tensor, grid: Grid, shrink: int | Sequence[int]) -> tuple[torch.Tensor, Grid]:
    """Sample ``image`` ``(B, C, *grid.shape)`` at the voxel centres of ``shrink_grid(grid, shrink)``, no smoothing.

    Returns the coarse image ``(B, C, *coarse.shape)`` and its grid. Differentiable.
    """
    if image.dim() != grid.ndim + 2 or tuple(image.shape[2:]) != grid.shape:
        raise ValueError(f"expected an image (B, C, *{grid.shape}) on the grid, got shape {tuple(image.shape)}")
    factors = _factors(shrink, grid.ndim)
    sizes, starts = _starts(grid, factors)
    out = image
    for axis, (f, m, start) in enumerate(zip(factors, sizes, starts, strict=True)):
        dim = image.dim() - 1 - axis
        first = int(np.floor(start))
        picked = out.narrow(dim, first, f * (m - 1) + 1)[(slice(None),) * dim + (slice(None, None, f),)]
        if start != first:
            nxt = out.narrow(dim, first + 1, f * (m - 1) + 1)[(slice(None),) * dim + (slice(None, None, f),)]
            picked = 0.5 * (picked + nxt)
        out = picked
    return out, shrink_grid(grid, factors)


def build_pyramid(
    image: torch.Tensor,
    grid: Grid,
    levels: Sequence[tuple[int | Sequence[int], float | Sequence[float]]],
) -> list[tuple[torch.Tensor, Grid]]:
    """One ``(image, grid)`` per level ``(shrink, sigma)``, in the order given (usually coarse to fine).

    Each level smooths ``image`` ``(B, C, *grid.shape)`` with a Gaussian of ``sigma`` voxels of the INPUT grid (one
    number or one per axis in index order; 0 = no smoothing) and then shrinks it (``downsample``). ``(1, 0)`` returns
    the input image itself.
    """
    return [downsample(gaussian_smooth(image, sigma), grid, shrink) for shrink, sigma in levels]

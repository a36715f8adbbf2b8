"""Resampling through a transformation: ``out(x) = image(T(x))`` on a fixed-space grid, 0 outside (pull-back).

Images keep their own grids (LPS millimetres, ``[z, y, x]`` tensors); world points are ``(..., n)`` in (x, y[, z])
order.
"""

from __future__ import annotations

import dataclasses

import torch

from regkit.errors import ImageDimensionError
from regkit.io.image import Image
from regkit.spatial.grid import Grid
from regkit.spatial.sampling import sample_image
from regkit.transform import Transformation

__all__ = ["resample", "sample_world"]


def resample(
    transform: Transformation,
    image: Image,
    reference: Grid | None = None,
    mode: str = "linear",
    device: torch.device | str | None = None,
) -> Image:
    """``image`` (in the moving world space, any grid) resampled onto ``reference`` (default: the transformation's
    fixed grid) through ``transform``: ``out(x) = image(T(x))``, 0 outside. ``"linear"`` gives a float image
    (float64 stays float64), ``"nearest"`` keeps the voxel type (label sets are preserved)."""
    grid = reference or transform.fixed_grid
    if image.ndim != grid.ndim:
        raise ImageDimensionError(f"the image is {image.ndim}D but the reference grid is {grid.ndim}D")
    on_grid = dataclasses.replace(transform, fixed_grid=grid)
    data = image.data if device is None else image.data.to(device)
    if mode == "linear" and data.dtype != torch.float64:
        data = data.float()
    return Image(on_grid.warp(data, image.grid, mode=mode).cpu(), grid)


def sample_world(image: Image, world: torch.Tensor, mode: str = "linear") -> torch.Tensor:
    """``image`` at world points ``(..., n)`` (on their device), returned on the CPU: float for linear, the voxel
    type for nearest; 0 outside."""
    data = image.data.to(world.device)
    if mode == "linear" and not data.is_floating_point():
        data = data.float()
    return sample_image(data, image.grid, world, mode=mode).cpu()

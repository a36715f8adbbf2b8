"""Sampling images at world points (the one interpolation routine that warping, resampling and similarity share).

Conventions: image tensors are ``[z, y, x]`` (3D) or ``[y, x]`` (2D), optionally with a leading channel axis; world
points are LPS millimetres in (x, y[, z]) order; ``grid`` is the image's geometry, so a point is first mapped to
continuous voxel indices (i, j[, k]) by ``grid.world_to_index`` (integers at voxel centres).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from regkit._backend import device_constant, load_kernels, resolve_backend
from regkit.errors import ImageDimensionError
from regkit.spatial.grid import Grid

SAMPLING_MODES = ("linear", "nearest")
_LINEAR_FACES = ("torch", "numba")  # linear sampling: grid_sample, or numba on the CPU for images needing no gradient


def sample_image(
    image: torch.Tensor,
    grid: Grid,
    world_points: torch.Tensor,
    mode: str = "linear",
    padding: float = 0.0,
) -> torch.Tensor:
    """Values of ``image`` (on ``grid``) at LPS world points ``(..., ndim)``: ``(...)``, or ``(C, ...)`` with channels.

    ``image`` is ``(*grid.shape)`` or ``(C, *grid.shape)`` (``[z, y, x]`` layout). ``mode``: ``"linear"``
    ((bi/tri)linear interpolation between voxel centres) or ``"nearest"`` (the voxel whose centre is nearest; exact
    halves round to even, as ``torch.round``). Outside, the image continues with voxels of value ``padding``: linear
    interpolation fades from the outermost voxel to ``padding`` over one voxel (index -1 or ``size``) and is
    ``padding`` further out. Axes of size 1 behave alike (the voxel's value at index 0, ``padding`` from +-1 on).

    Differentiable with respect to ``world_points`` and ``image`` (``torch.nn.functional.grid_sample`` with
    ``align_corners=True``, index ``i`` on an axis of size ``s`` mapping to ``2 i / (s - 1) - 1``). On the CPU, linear
    sampling of an image that needs no gradient runs in numba (``regkit_kernels.numba.sampling``: the same values up
    to rounding, differentiable with respect to the points). Integer images
    (label maps) are sampled in float32 and, with ``mode="nearest"``, returned in their own dtype.
    """
    n = grid.ndim
    if mode not in SAMPLING_MODES:
        raise ValueError(f"unknown sampling mode {mode!r}; choose one of {', '.join(SAMPLING_MODES)}")
    if image.shape[-n:] != grid.shape or image.ndim not in (n, n + 1):
        raise ImageDimensionError(
            f"image of shape {tuple(image.shape)} does not match grid shape {grid.shape} (optionally channel-first)"
        )
    if world_points.shape[-1] != n:
        raise ValueError(f"world points must have shape (..., {n}), got {tuple(world_points.shape)}")
    values = image if image.is_floating_point() else image.to(torch.float32)
    values = values.reshape(-1, *grid.shape) - padding  # (C, *spatial); outside reads as 0 here, padding below
    index = grid.world_to_index(world_points).to(values.dtype)
    # Axes of size 1: add one zero voxel on each side (index shifts by one), so they interpolate like the others.
    thin = [s == 1 for s in grid.size]  # (x, y[, z]) order
    pads: list[int] = []
    for axis_is_thin in thin:  # F.pad lists the last tensor axis (x) first
        pads += [1, 1] if axis_is_thin else [0, 0]
    if any(thin):
        values = F.pad(values.unsqueeze(0), pads).squeeze(0)
        index = index + device_constant(tuple(float(v) for v in thin), index.dtype, index.device)
    batch_shape = world_points.shape[:-1]
    face = resolve_backend("auto", values.device, "sampling", faces=_LINEAR_FACES)
    if mode == "linear" and face == "numba" and not (values.requires_grad and torch.is_grad_enabled()):
        out = load_kernels("numba.sampling").linear(values, index.reshape(-1, n)).reshape(-1, *batch_shape) + padding
        return out.squeeze(0) if image.ndim == n else out
    sizes = device_constant(
        tuple(3.0 if v else float(s) for v, s in zip(thin, grid.size, strict=True)), index.dtype, index.device
    )
    normalised = 2 * index / (sizes - 1) - 1
    sample_grid = normalised.reshape(1, *([1] * (n - 1)), -1, n)
    sampled = F.grid_sample(
        values.unsqueeze(0),
        sample_grid,
        mode="bilinear" if mode == "linear" else "nearest",
        padding_mode="zeros",
        align_corners=True,
    )  # (1, C, 1[, 1], P)
    out = sampled.reshape(values.shape[0], *batch_shape) + padding
    if image.ndim == n:
        out = out.squeeze(0)
    if mode == "nearest" and not image.is_floating_point():
        out = out.round().to(image.dtype)
    return out

"""The registrations the tests of regkit.results read: small 2D and 3D scenes on oblique, anisotropic grids, their
label maps and configurations, and helpers to compare grids and to find the voxels well inside the moving image."""

from __future__ import annotations

import math

import numpy as np
import SimpleITK as sitk
import torch

from regkit.config import load_config
from regkit.io import Image
from regkit.spatial.grid import Grid


def rotation(angle: float, ndim: int) -> np.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    r = np.eye(ndim)
    r[:2, :2] = [[c, -s], [s, c]]
    return r


def scene(grid: Grid, warp: float) -> Image:
    """Three Gaussian blobs evaluated in world space (mm), optionally at smoothly displaced points."""
    p = grid.world_points(torch.float64)
    n = grid.ndim
    q = p + warp * torch.stack([torch.sin(p[..., (a + 1) % n] / 6.0) for a in range(n)], dim=-1)
    centres = torch.tensor([[10.0, 12.0, 14.0], [18.0, 10.0, 12.0], [12.0, 20.0, 18.0]])[:, :n]
    image = sum(w * torch.exp(-((q - c) ** 2).sum(-1) / 32.0) for c, w in zip(centres, (1.0, 0.7, 0.5), strict=True))
    return Image(image.float(), grid)


def label_map(image: Image) -> Image:
    return Image((image.data > 0.3).to(torch.int16) + (image.data > 0.7).to(torch.int16), image.grid)


def registration_config(ndim: int, **outputs_flags: bool):
    single = [{"shrink": 1, "smoothing": 0.0}]
    stages = [
        {"type": "moments"},
        {
            "type": "affine",
            "similarity": {"name": "ncc"},
            "pyramid": single,
            "optimizer": {"iterations": 8, "learning_rate": 0.5},
        },
        {
            "type": "cpab",
            "similarity": {"name": "lncc", "window": 5},
            "pyramid": single,
            "optimizer": {"iterations": 8, "learning_rate": 0.2},
            "tessellation": [3],
            "steps": 10,
        },
    ]
    return load_config("quick-2d", overrides={"dim": ndim, "stages": stages, "outputs": outputs_flags})


def same_grid(a: Grid, b: Grid) -> bool:
    """Equal up to NIfTI's float32 geometry."""
    return a.size == b.size and all(
        np.allclose(getattr(a, key), getattr(b, key), atol=1e-5) for key in ("spacing", "origin", "direction")
    )


def sitk_read(path) -> sitk.Image:
    return sitk.ReadImage(str(path))


def inside_moving(result, margin: float = 1.0) -> np.ndarray:
    """Fixed voxels whose moving sample point lies at least ``margin`` voxels inside the moving grid."""
    y = result.transform.transform_world(result.fixed.grid.world_points(torch.float64))
    index = result.moving.grid.world_to_index(y)
    size = torch.tensor(result.moving.grid.size, dtype=torch.float64)
    return ((index >= margin) & (index <= size - 1 - margin)).all(dim=-1).numpy()

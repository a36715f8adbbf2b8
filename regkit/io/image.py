"""The in-memory image: a tensor of voxels with its geometry.

Conventions (those of ITK, see :mod:`regkit.spatial.grid`): the tensor is in ``[z, y, x]`` (3D) or ``[y, x]`` (2D)
layout, and ``world = origin + direction @ (spacing * index)`` with index (i, j[, k]) and world points in LPS
millimetres. Orientation lives in the grid only; reading and writing (:mod:`regkit.io.files`) never flip or transpose
voxels to "fix" it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from regkit.errors import GeometryError
from regkit.spatial.grid import Grid

__all__ = ["Image"]


@dataclass(frozen=True, eq=False)
class Image:
    """A scalar image with its geometry.

    ``data`` is a ``[z, y, x]`` (3D) or ``[y, x]`` (2D) tensor, ``grid`` the geometry (size in (x, y[, z]) order,
    spacing, origin, direction; LPS millimetres, ITK conventions). ``data.shape`` must equal ``grid.shape``. Images
    are not compared with ``==``: compare ``data`` (``torch.equal``) and ``grid``.
    """

    data: torch.Tensor
    grid: Grid

    def __post_init__(self) -> None:
        if tuple(self.data.shape) != self.grid.shape:
            raise GeometryError(
                f"image data of shape {tuple(self.data.shape)} does not match its grid: size {self.grid.size} "
                f"needs a tensor of shape {self.grid.shape} ([z, y, x] = size reversed)"
            )

    @property
    def ndim(self) -> int:
        """Number of spatial dimensions (2 or 3)."""
        return self.grid.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        """Tensor shape, ``[z, y, x]`` or ``[y, x]``."""
        return self.grid.shape

    @property
    def spacing(self) -> np.ndarray:
        """Voxel spacing in millimetres, (x, y[, z]) order."""
        return np.asarray(self.grid.spacing)

    @property
    def origin(self) -> np.ndarray:
        """LPS world position of the centre of voxel index 0, in millimetres."""
        return np.asarray(self.grid.origin)

    @property
    def direction(self) -> np.ndarray:
        """``ndim x ndim`` matrix whose columns are the LPS directions of the index axes i, j[, k]."""
        return np.asarray(self.grid.direction)

    def index_to_world(self, index: torch.Tensor) -> torch.Tensor:
        """Map continuous indices ``(..., ndim)`` in (i, j[, k]) order to LPS world points (see :class:`Grid`)."""
        return self.grid.index_to_world(index)

    def world_to_index(self, world: torch.Tensor) -> torch.Tensor:
        """Map LPS world points ``(..., ndim)`` to continuous indices in (i, j[, k]) order (see :class:`Grid`)."""
        return self.grid.world_to_index(world)

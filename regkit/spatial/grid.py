"""The geometry of a sampled image: size, spacing, origin and direction, with index <-> world maps.

Conventions (the ITK ones):

* ``world = origin + direction @ (spacing * index)``, with ``index`` in (i, j[, k]) order (i runs along the x axis of
  the array, i.e. the *last* tensor axis) and integer indices at voxel centres.
* World coordinates are LPS millimetres. ``direction`` is an ``ndim x ndim`` matrix whose *columns* are the unit
  directions of the index axes in world space.
* ``size`` is in index order (x, y[, z]); the matching tensor shape is ``size[::-1]``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from regkit.errors import GeometryError

_ORTHO_TOL = 1e-4


@dataclass(frozen=True)
class Grid:
    """A regular grid of voxel centres in world space (see the module docstring for conventions)."""

    size: tuple[int, ...]
    spacing: tuple[float, ...]
    origin: tuple[float, ...]
    direction: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        n = len(self.size)
        if n not in (2, 3):
            raise GeometryError(f"a grid must be 2D or 3D, got size {self.size}")
        if len(self.spacing) != n or len(self.origin) != n or np.shape(self.direction) != (n, n):
            raise GeometryError(
                f"inconsistent grid: size {self.size}, spacing {self.spacing}, origin {self.origin}, "
                f"direction shape {np.shape(self.direction)}"
            )
        if any(int(s) < 1 for s in self.size):
            raise GeometryError(f"grid size must be positive, got {self.size}")
        if not all(np.isfinite(self.spacing)) or any(s <= 0 for s in self.spacing):
            raise GeometryError(f"spacing must be finite and positive, got {self.spacing}")
        if not all(np.isfinite(self.origin)):
            raise GeometryError(f"origin must be finite, got {self.origin}")
        d = np.asarray(self.direction, dtype=np.float64)
        if not np.all(np.isfinite(d)) or abs(np.linalg.det(d)) < 1e-6:
            raise GeometryError(f"direction matrix is singular: {d.tolist()}")
        if np.abs(d.T @ d - np.eye(n)).max() > _ORTHO_TOL:
            raise GeometryError(f"direction matrix is not orthonormal: {d.tolist()}")

    @classmethod
    def create(
        cls,
        size: tuple[int, ...] | list[int],
        spacing: tuple[float, ...] | list[float] | None = None,
        origin: tuple[float, ...] | list[float] | None = None,
        direction: np.ndarray | list | tuple | None = None,
    ) -> Grid:
        """Build a grid from array-likes; spacing defaults to 1, origin to 0 and direction to the identity."""
        n = len(size)
        sp = (1.0,) * n if spacing is None else tuple(float(s) for s in spacing)
        org = (0.0,) * n if origin is None else tuple(float(o) for o in origin)
        dmat = np.eye(n) if direction is None else np.asarray(direction, dtype=np.float64).reshape(n, n)
        return cls(tuple(int(s) for s in size), sp, org, tuple(tuple(float(v) for v in row) for row in dmat))

    @property
    def ndim(self) -> int:
        return len(self.size)

    @property
    def shape(self) -> tuple[int, ...]:
        """Tensor shape of an image on this grid: ``size`` reversed ([z, y, x] or [y, x])."""
        return tuple(reversed(self.size))

    def affine(self) -> np.ndarray:
        """``(ndim + 1) x (ndim + 1)`` homogeneous matrix mapping (i, j[, k], 1) to LPS world (x, y[, z], 1)."""
        n = self.ndim
        m = np.eye(n + 1)
        m[:n, :n] = np.asarray(self.direction) * np.asarray(self.spacing)[None, :]
        m[:n, n] = self.origin
        return m

    def index_to_world(self, index: torch.Tensor) -> torch.Tensor:
        """Map continuous indices ``(..., ndim)`` in (i, j[, k]) order to LPS world points ``(..., ndim)``."""
        m = _affine_on(self, False, index.dtype, index.device)
        n = self.ndim
        return index @ m[:n, :n].T + m[:n, n]

    def world_to_index(self, world: torch.Tensor) -> torch.Tensor:
        """Map LPS world points ``(..., ndim)`` to continuous indices ``(..., ndim)`` in (i, j[, k]) order."""
        m = _affine_on(self, True, world.dtype, world.device)
        n = self.ndim
        return world @ m[:n, :n].T + m[:n, n]

    def index_points(
        self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """All voxel-centre indices as a tensor of shape ``(*self.shape, ndim)`` in (i, j[, k]) order."""
        axes = [torch.arange(s, dtype=dtype, device=device) for s in self.shape]  # z, y, x
        mesh = torch.meshgrid(*axes, indexing="ij")
        return torch.stack(mesh[::-1], dim=-1)

    def world_points(
        self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """All voxel centres in LPS world coordinates, shape ``(*self.shape, ndim)``."""
        return self.index_to_world(self.index_points(torch.float64, device)).to(dtype)


@functools.lru_cache(maxsize=512)
def _affine_on(grid: Grid, inverse: bool, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``grid.affine()`` (or its inverse) as a tensor of ``dtype`` on ``device``; cached and never written to. Made
    from host values, it would be a host-to-device copy on every map: that copy waits for the GPU to catch up and
    cannot be part of a CUDA graph (``regkit.registration`` captures optimizer iterations)."""
    m = grid.affine()
    return torch.as_tensor(np.linalg.inv(m) if inverse else m, dtype=dtype, device=device)

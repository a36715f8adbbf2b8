"""The plugin's computations as plain functions: no Qt, no napari, testable without a viewer.

napari frame. napari orders a layer's axes as its array's axes, ``[z, y, x]`` (or ``[y, x]``), and its world axes in
the same order. The plugin's napari world is therefore LPS millimetres with the coordinates reversed, ``(z, y, x)``:
:func:`napari_affine` maps a voxel's data coordinates ``(k, j, i)`` to ``(z, y, x)``, and every point these functions
return for a Shapes, Vectors or Points layer is in that order. :func:`to_napari` reverses LPS ``(x, y[, z])`` points.
"""

from __future__ import annotations

import numpy as np
import torch

from regkit.cpab.module import CPAB
from regkit.spatial.grid import Grid
from regkit.transform import Transformation

__all__ = [
    "checkerboard",
    "deformed_grid_lines",
    "flow_at",
    "grid_from_napari_affine",
    "jacobian_layer",
    "napari_affine",
    "tessellation_lines",
    "to_napari",
    "velocity_vectors",
]


def to_napari(points: np.ndarray | torch.Tensor) -> np.ndarray:
    """LPS world points ``(..., n)`` in (x, y[, z]) order -> napari world points ``(..., n)`` in (z, y, x) order
    (float64); the map is its own inverse."""
    values = points.detach().cpu().numpy() if isinstance(points, torch.Tensor) else np.asarray(points)
    return np.ascontiguousarray(values[..., ::-1], dtype=np.float64)


def napari_affine(grid: Grid) -> np.ndarray:
    """``(n + 1) x (n + 1)`` affine for a napari layer on ``grid``: data coordinates ``(k, j, i)`` (the tensor's
    ``[z, y, x]`` axes) -> napari world ``(z, y, x)`` (LPS millimetres reversed): ``grid.affine()`` with the first
    ``n`` rows and columns reversed."""
    n = grid.ndim
    order = [*range(n)[::-1], n]
    return grid.affine()[np.ix_(order, order)]


def grid_from_napari_affine(affine: np.ndarray, shape: tuple[int, ...]) -> Grid:
    """The :class:`Grid` of a napari layer of data shape ``shape`` (``[z, y, x]``) whose data-to-world affine is
    ``affine`` (data ``(k, j, i)`` -> napari world ``(z, y, x)``, as :func:`napari_affine` makes it).

    Raises ``regkit.errors.GeometryError`` when the affine has shear, which a grid cannot hold (its columns must be
    orthogonal)."""
    n = len(shape)
    order = [*range(n)[::-1], n]
    lps = np.asarray(affine, dtype=np.float64)[np.ix_(order, order)]
    columns = lps[:n, :n]
    spacing = np.linalg.norm(columns, axis=0)
    return Grid.create(tuple(reversed(shape)), spacing, lps[:n, n], columns / spacing)


def deformed_grid_lines(transform: Transformation, grid: Grid, spacing_vox: int) -> list[np.ndarray]:
    """The lines of ``grid`` every ``spacing_vox`` voxels, pushed through ``transform``, as napari paths.

    Each line runs along one index axis through voxel centres (one point per voxel), at indices ``0, spacing_vox,
    2 spacing_vox, ...`` on the other axes. Its points ``x`` (fixed space) are mapped to ``y = transform(x)`` (moving
    space, see :mod:`regkit.transform`), so the lines show where the fixed grid samples the moving image: draw them
    over the moving image. Returns a list of ``(N_i, n)`` float64 arrays in napari world order (module docstring).
    """
    if spacing_vox < 1:
        raise ValueError(f"spacing_vox must be a positive number of voxels, got {spacing_vox}")
    n = grid.ndim
    lines: list[torch.Tensor] = []
    for axis in range(n):
        others = [torch.arange(0, grid.size[a], spacing_vox, dtype=torch.float64) for a in range(n) if a != axis]
        along = torch.arange(grid.size[axis], dtype=torch.float64)
        for fixed in torch.cartesian_prod(*others).reshape(-1, n - 1):
            index = torch.empty(along.shape[0], n, dtype=torch.float64)
            index[:, axis] = along
            index[:, [a for a in range(n) if a != axis]] = fixed
            lines.append(grid.index_to_world(index))
    moved = transform.transform_world(torch.cat(lines))
    return [to_napari(part) for part in moved.split([len(line) for line in lines])]


def jacobian_layer(transform: Transformation) -> tuple[np.ndarray, tuple[float, float], np.ndarray]:
    """The Jacobian determinant of ``transform`` on its fixed grid, for a colour-mapped napari image.

    Returns ``(det, limits, folded)``: ``det`` the ``fixed_grid.shape`` (``[z, y, x]``) float32 determinant,
    ``limits`` contrast limits symmetric about 1 (no volume change) that span all values, for a diverging colormap,
    and ``folded`` the boolean mask of ``det <= 0`` (folding) for a Labels layer that highlights it.
    """
    det = transform.jacobian_determinant().cpu().numpy()
    reach = max(float(np.abs(det - 1.0).max()), 1e-6)
    return det, (1.0 - reach, 1.0 + reach), det <= 0


def tessellation_lines(cpab: CPAB) -> np.ndarray:
    """Every edge of ``cpab``'s cells (2D triangles, 3D tetrahedra) as ``(E, 2, n)`` float64 napari paths.

    Each edge appears once; its end points are the cell vertices mapped from the domain to LPS world (the CPAB's
    frame), in napari world order (module docstring).
    """
    n = cpab.tess.ndim
    ids = cpab.tess.cell_vertex_ids()
    pairs = torch.combinations(torch.arange(n + 1), 2)
    edges = ids[:, pairs].reshape(-1, 2).sort(dim=-1).values.unique(dim=0)
    world = cpab.domain_to_world(cpab.tess.vertices())
    return to_napari(world[edges])


@torch.no_grad()
def velocity_vectors(cpab: CPAB, grid: Grid, step: int) -> np.ndarray:
    """The CPAB velocity field at ``grid``'s voxel centres every ``step`` voxels, as napari Vectors data.

    Returns ``(N, 2, n)`` float64: for each vector its start point and its velocity (millimetres per unit time, LPS
    components rotated from the CPAB's domain frame to world), both in napari world order (module docstring).
    """
    if step < 1:
        raise ValueError(f"step must be a positive number of voxels, got {step}")
    n = grid.ndim
    index = grid.index_points(torch.float64)[(slice(None, None, step),) * n].reshape(-1, n)
    world = grid.index_to_world(index)
    velocity = cpab.velocity(cpab.world_to_domain(world.to(cpab.theta.dtype))).to(torch.float64)
    velocity_world = velocity @ cpab.direction.to(torch.float64).T
    return np.stack([to_napari(world), to_napari(velocity_world)], axis=1)


def flow_at(transform: Transformation, t: float) -> Transformation:
    """The transformation at time ``t`` in [0, 1] of a path from the identity (``t = 0``) to ``transform`` (``t = 1``).

    Every CPAB flow is taken at time ``t``: the flow of ``t theta`` for unit time, which is exactly the flow of
    ``theta`` for time ``t`` (the velocity is linear in ``theta``), also for the discrete scheme with the same number of
    steps. The linear part is interpolated linearly, ``(1 - t) I + t M`` (invertible for the small rotations and
    scalings registrations find). The flows act first, as in ``transform``; the result is a :class:`Transformation`,
    so :func:`deformed_grid_lines`, ``warp`` and ``jacobian_determinant`` animate with it.
    """
    if not 0.0 <= t <= 1.0:
        raise ValueError(f"t must lie in [0, 1], got {t}")
    matrix = (1.0 - t) * np.eye(transform.ndim + 1) + t * transform.matrix
    flows = []
    for flow in transform.cpab:
        moved = flow.inverse()  # a copy sharing the tessellation and basis, with theta = -theta
        with torch.no_grad():
            moved.theta.mul_(-t)
        flows.append(moved)
    return Transformation(transform.fixed_grid, matrix, flows)


def checkerboard(fixed: np.ndarray, warped: np.ndarray, tiles: int) -> np.ndarray:
    """A checkerboard of two images on the same grid (``[z, y, x]`` or ``[y, x]``), ``tiles`` tiles per axis.

    Each image is rescaled to [0, 1] by its own minimum and maximum (the pair may differ in contrast); tiles whose
    index sum is even show ``fixed``, the others ``warped``. Returns float32 of the images' shape.
    """
    if fixed.shape != warped.shape:
        raise ValueError(f"the images must have the same shape, got {fixed.shape} and {warped.shape}")
    if tiles < 1:
        raise ValueError(f"tiles must be positive, got {tiles}")

    def rescaled(image: np.ndarray) -> np.ndarray:
        values = np.asarray(image, dtype=np.float32)
        low, high = float(values.min()), float(values.max())
        return (values - low) / (high - low) if high > low else np.zeros_like(values)

    tile_index = np.indices(fixed.shape) * tiles // np.asarray(fixed.shape).reshape(-1, *([1] * fixed.ndim))
    even = tile_index.sum(axis=0) % 2 == 0
    return np.where(even, rescaled(fixed), rescaled(warped))

"""The napari plugin's logic, without napari: frames, deformed grid, Jacobian, tessellation, velocity, flow, tiles."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from napari_regkit._logic import (
    checkerboard,
    deformed_grid_lines,
    flow_at,
    grid_from_napari_affine,
    jacobian_layer,
    napari_affine,
    tessellation_lines,
    to_napari,
    velocity_vectors,
)
from regkit.cpab.module import CPAB
from regkit.errors import GeometryError
from regkit.spatial.grid import Grid
from regkit.transform import Transformation


def _oblique_grid() -> Grid:
    angle = 0.3
    rotation = np.array(
        [[np.cos(angle), -np.sin(angle), 0.0], [np.sin(angle), np.cos(angle), 0.0], [0.0, 0.0, 1.0]]
    ) @ np.diag([1.0, -1.0, -1.0])
    return Grid.create((7, 5, 4), (1.5, 0.8, 2.0), (10.0, -20.0, 5.5), rotation)


def _random_cpab(grid: Grid, seed: int = 0) -> CPAB:
    cpab = CPAB.for_grid(grid, 2).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        cpab.theta.copy_(torch.randn(cpab.theta.shape, generator=generator, dtype=torch.float64))
    return cpab


def _translation(ndim: int, shift: list[float]) -> np.ndarray:
    matrix = np.eye(ndim + 1)
    matrix[:ndim, ndim] = shift
    return matrix


def test_napari_affine_maps_data_coordinates_to_reversed_world() -> None:
    grid = _oblique_grid()
    affine = napari_affine(grid)
    index = torch.tensor([[0.0, 0.0, 0.0], [6.0, 4.0, 3.0], [2.5, 1.0, 0.5]], dtype=torch.float64)  # (i, j, k)
    data = np.concatenate([index.numpy()[:, ::-1], np.ones((3, 1))], axis=1)  # (k, j, i, 1)
    expected = to_napari(grid.index_to_world(index))
    np.testing.assert_allclose((data @ affine.T)[:, :3], expected, atol=1e-12)


def test_grid_from_napari_affine_inverts_napari_affine() -> None:
    grid = _oblique_grid()
    back = grid_from_napari_affine(napari_affine(grid), grid.shape)
    assert back.size == grid.size
    np.testing.assert_allclose(back.affine(), grid.affine(), atol=1e-12)


def test_grid_from_napari_affine_refuses_shear() -> None:
    affine = np.eye(3)
    affine[0, 1] = 0.5
    with pytest.raises(GeometryError):
        grid_from_napari_affine(affine, (4, 5))


def test_to_napari_reverses_the_last_axis() -> None:
    points = np.arange(12.0).reshape(2, 2, 3)
    np.testing.assert_array_equal(to_napari(torch.from_numpy(points)), points[..., ::-1])


def test_deformed_grid_lines_identity_lie_on_the_grid() -> None:
    grid = Grid.create((9, 6), (1.0, 2.0), (3.0, 4.0))
    lines = deformed_grid_lines(Transformation(grid, np.eye(3)), grid, 4)
    # along x: lines at j = 0, 4 (2 lines of 9 points); along y: lines at i = 0, 4, 8 (3 lines of 6 points)
    assert [line.shape for line in lines] == [(9, 2)] * 2 + [(6, 2)] * 3
    np.testing.assert_allclose(lines[1][:, 0], 4.0 + 2.0 * 4)  # napari (y, x): y of the row j = 4
    np.testing.assert_allclose(lines[1][:, 1], 3.0 + np.arange(9))
    np.testing.assert_allclose(lines[4][:, 1], 3.0 + 8)


def test_deformed_grid_lines_follow_the_transformation() -> None:
    grid = _oblique_grid()
    transform = Transformation(grid, _translation(3, [1.0, -2.0, 0.5]), [_random_cpab(grid)])
    lines = deformed_grid_lines(transform, grid, 3)
    assert len(lines) == 2 * 2 + 3 * 2 + 3 * 2  # (j, k) in {0,3}x{0,3}; (i, k) in {0,3,6}x{0,3}; (i, j) {0,3,6}x{0,3}
    first = grid.index_to_world(torch.stack([torch.arange(7.0), torch.zeros(7), torch.zeros(7)], dim=-1).double())
    np.testing.assert_allclose(lines[0], to_napari(transform.transform_world(first)), atol=1e-10)
    assert np.abs(lines[0] - to_napari(first)).max() > 0.1


def test_deformed_grid_lines_refuse_zero_spacing() -> None:
    grid = Grid.create((4, 4))
    with pytest.raises(ValueError, match="spacing_vox"):
        deformed_grid_lines(Transformation(grid, np.eye(3)), grid, 0)


def test_jacobian_layer_identity_and_reflection() -> None:
    grid = Grid.create((5, 4))
    det, limits, folded = jacobian_layer(Transformation(grid, np.eye(3)))
    assert det.shape == grid.shape and det.dtype == np.float32
    np.testing.assert_allclose(det, 1.0)
    assert limits[0] < 1.0 < limits[1] and np.isclose(limits[0] + limits[1], 2.0)
    assert not folded.any()
    _, limits, folded = jacobian_layer(Transformation(grid, np.diag([-1.0, 1.0, 1.0])))
    assert folded.all()
    assert np.isclose(limits[0], -1.0) and np.isclose(limits[1], 3.0)


def test_jacobian_layer_of_a_cpab_is_positive() -> None:
    grid = Grid.create((8, 6))
    det, limits, folded = jacobian_layer(Transformation(grid, np.eye(3), [_random_cpab(grid)]))
    assert (det > 0).all() and not folded.any()
    assert limits[0] <= det.min() and det.max() <= limits[1]


def test_tessellation_lines_2d_edges_once_in_world() -> None:
    grid = Grid.create((6, 9), (1.0, 1.0), (10.0, 20.0))
    cpab = CPAB.for_grid(grid, (2, 3))
    lines = tessellation_lines(cpab)
    # rectangle edges: 2 * 4 along x, 3 * 3 along y; plus 4 spokes to each of the 6 centres
    assert lines.shape == (8 + 9 + 24, 2, 2)
    assert len({tuple(sorted(map(tuple, edge.round(9)))) for edge in lines}) == len(lines)
    np.testing.assert_allclose(lines.reshape(-1, 2).min(axis=0), [19.5, 9.5])  # napari (y, x): the voxel edges
    np.testing.assert_allclose(lines.reshape(-1, 2).max(axis=0), [28.5, 15.5])


def test_tessellation_lines_3d() -> None:
    cpab = CPAB.for_grid(_oblique_grid(), 1)
    lines = tessellation_lines(cpab)
    # one cube, 5 tetrahedra: its 12 edges and the 6 face diagonals of the central tetrahedron
    assert lines.shape == (18, 2, 3)
    corners = cpab.domain_to_world(cpab.tess.vertices())
    assert {tuple(p) for p in lines.reshape(-1, 3).round(9)} == {tuple(p) for p in to_napari(corners).round(9)}


def test_velocity_vectors() -> None:
    grid = _oblique_grid()
    cpab = _random_cpab(grid)
    vectors = velocity_vectors(cpab, grid, 3)
    assert vectors.shape == (3 * 2 * 2, 2, 3)
    starts = grid.index_to_world(torch.tensor([[3.0, 0.0, 0.0]], dtype=torch.float64))
    np.testing.assert_allclose(vectors[1, 0], to_napari(starts)[0])  # x varies fastest
    # the velocity is the derivative of the flow at t = 0, in world millimetres
    h = 1e-5
    derivative = (cpab.transform_world(starts, t=h) - starts) / h
    np.testing.assert_allclose(vectors[1, 1], to_napari(derivative)[0], rtol=1e-3, atol=1e-6)
    zero = CPAB.for_grid(grid, 2)
    assert not velocity_vectors(zero, grid, 2)[:, 1].any()


def test_flow_at_ends_and_middle() -> None:
    grid = _oblique_grid()
    cpab = _random_cpab(grid)
    transform = Transformation(grid, _translation(3, [2.0, 0.0, -1.0]), [cpab])
    points = grid.world_points(torch.float64).reshape(-1, 3)
    torch.testing.assert_close(flow_at(transform, 0.0).transform_world(points), points)
    torch.testing.assert_close(flow_at(transform, 1.0).transform_world(points), transform.transform_world(points))
    halfway = cpab.transform_world(points, t=0.5) + torch.tensor([1.0, 0.0, -0.5], dtype=torch.float64)
    torch.testing.assert_close(flow_at(transform, 0.5).transform_world(points), halfway)
    assert torch.equal(cpab.theta, transform.cpab[0].theta)  # the original is untouched
    with pytest.raises(ValueError, match="t must"):
        flow_at(transform, 1.5)


def test_checkerboard() -> None:
    fixed = np.zeros((4, 6), dtype=np.int16)
    fixed[0, 0] = 10
    warped = np.full((4, 6), 5.0)
    warped[0, 0] = 7.0
    board = checkerboard(fixed, warped, 2)
    assert board.shape == (4, 6) and board.dtype == np.float32
    tiles_from_fixed = np.add.outer(np.arange(4) // 2, np.arange(6) // 3) % 2 == 0
    expected = np.where(tiles_from_fixed, (fixed == 10).astype(np.float32), (warped - 5.0) / 2.0)
    np.testing.assert_allclose(board, expected)
    with pytest.raises(ValueError, match="same shape"):
        checkerboard(fixed, warped[:2], 2)

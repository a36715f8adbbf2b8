"""regkit.cpab.module.CPAB: frames, displacement fields, warping, Jacobians, inverse, sampling, prior."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from regkit.cpab.integrate import integrate
from regkit.cpab.module import CPAB
from regkit.cpab.tessellation import Tessellation
from regkit.spatial.grid import Grid
from tests.helpers import rotation

F64 = torch.float64


def _grid(ndim: int) -> Grid:
    size = (12, 9, 7)[:ndim]
    return Grid.create(
        size, spacing=(1.5, 0.8, 2.0)[:ndim], origin=(-20.0, 31.0, 7.5)[:ndim], direction=rotation(0.4, ndim, tilt=-0.3)
    )


def _translation_theta(cpab: CPAB, shift: torch.Tensor) -> torch.Tensor:
    """theta of the constant velocity ``shift`` (domain units per unit time), by least squares on the dense basis."""
    A = torch.zeros(cpab.tess.n_cells, cpab.tess.ndim, cpab.tess.ndim + 1, dtype=F64)
    A[..., -1] = shift
    basis = cpab.basis.matrix.to_dense()
    theta = torch.linalg.lstsq(basis, A.flatten()[:, None]).solution[:, 0]
    torch.testing.assert_close(basis @ theta, A.flatten())  # representable: a "free" boundary is needed
    return theta


@pytest.mark.parametrize("ndim", [2, 3])
def test_for_grid_frame_round_trips_and_box_spans_the_voxel_edges(ndim: int) -> None:
    grid = _grid(ndim)
    cpab = CPAB.for_grid(grid, 2).double()
    world = grid.world_points(F64)
    domain = cpab.world_to_domain(world)
    torch.testing.assert_close(cpab.domain_to_world(domain), world)
    matrix = cpab.domain_to_world_matrix(world)  # the same map as one homogeneous matrix
    torch.testing.assert_close(domain @ matrix[:ndim, :ndim].T + matrix[:ndim, ndim], world)
    assert matrix[ndim].tolist() == [0.0] * ndim + [1.0]
    spacing = torch.tensor(grid.spacing, dtype=F64)
    torch.testing.assert_close(domain, grid.index_points(F64) * spacing)  # voxel centre i at i * spacing
    corners = grid.index_to_world(torch.tensor([[-0.5] * ndim, [s - 0.5 for s in grid.size]], dtype=F64))
    torch.testing.assert_close(
        cpab.world_to_domain(corners), torch.tensor([cpab.tess.lower, cpab.tess.upper], dtype=F64)
    )
    assert cpab.tess.shape == (2,) * ndim


@pytest.mark.parametrize("ndim", [2, 3])
def test_zero_theta_gives_zero_displacement_and_unit_jacobian(ndim: int) -> None:
    grid = _grid(ndim)
    cpab = CPAB.for_grid(grid, 3, batch_size=2)
    u = cpab.transform_grid(grid)
    assert u.shape == (2, *grid.shape, ndim)
    assert u.abs().max().item() < 1e-4  # float32 round trip world -> domain -> world, origin at ~30 mm
    assert torch.equal(cpab.jacobian_determinant(grid), torch.ones(2, *grid.shape))


def test_warp_with_a_known_translation() -> None:
    """A constant velocity v flows to the translation by v: warped(x) = image(x + R v), exactly two voxels here."""
    grid = _grid(2)
    cpab = CPAB.for_grid(grid, 2, boundary="free").double()
    shift = torch.tensor([2 * grid.spacing[0], -1 * grid.spacing[1]], dtype=F64)  # +2 voxels in x, -1 in y
    with torch.no_grad():
        cpab.theta.copy_(_translation_theta(cpab, shift))
    image = torch.randn(grid.shape, dtype=F64)
    warped = cpab.warp(image, grid, grid)
    torch.testing.assert_close(warped[1:, :-2], image[:-1, 2:], rtol=0, atol=1e-9)
    world_shift = torch.tensor(rotation(0.4, 2), dtype=F64) @ shift
    u = cpab.transform_grid(grid)
    torch.testing.assert_close(u, world_shift.expand_as(u), rtol=0, atol=1e-9)
    torch.testing.assert_close(cpab.jacobian_determinant(grid), torch.ones(grid.shape, dtype=F64), rtol=0, atol=1e-12)
    labels = (image > 0).to(torch.int64)
    warped_labels = cpab.warp(labels, grid, grid, mode="nearest", padding=-1)
    assert warped_labels.dtype == torch.int64
    assert torch.equal(warped_labels[1:, :-2], labels[:-1, 2:])
    assert (warped_labels[:, -2:] == -1).all()  # sampled beyond the moving image's edge


def test_warp_is_differentiable_and_batched_with_channels() -> None:
    grid = _grid(2)
    cpab = CPAB.for_grid(grid, 3, batch_size=2)
    with torch.no_grad():
        cpab.theta.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    image = torch.rand(3, *grid.shape)
    warped = cpab.warp(image, grid, grid)
    assert warped.shape == (2, 3, *grid.shape)
    warped.square().mean().backward()
    assert cpab.theta.grad is not None and cpab.theta.grad.abs().sum() > 0
    single = CPAB.for_grid(grid, 3)
    with torch.no_grad():
        single.theta.copy_(cpab.theta[1])
    torch.testing.assert_close(single.warp(image, grid, grid), warped[1].detach())


@pytest.mark.parametrize("ndim", [2, 3])
def test_transform_world_is_the_domain_flow_in_the_frame(ndim: int) -> None:
    grid = _grid(ndim)
    cpab = CPAB.for_grid(grid, 2, steps=20).double()
    sampled = cpab.sample(torch.Generator().manual_seed(1), scale=0.5)
    world = grid.world_points(F64).reshape(-1, ndim)
    moved = sampled.transform_world(world)
    expected = integrate(sampled.world_to_domain(world), sampled.cell_matrices(), sampled.tess, steps=20)
    torch.testing.assert_close(sampled.world_to_domain(moved), expected)
    assert sampled.transform_points(sampled.world_to_domain(world)).shape == world.shape
    assert (sampled.jacobian_determinant(sampled.world_to_domain(world)) > 0).all()


def test_inverse_round_trip_and_sampling() -> None:
    cpab = CPAB((4, 4), steps=100, batch_size=3).double()
    gen = torch.Generator().manual_seed(3)
    sampled = cpab.sample(gen, scale=1.0)
    assert sampled.theta.shape == (3, cpab.basis.d) and sampled.basis is cpab.basis
    again = cpab.sample(torch.Generator().manual_seed(3))
    assert torch.equal(again.theta, sampled.theta)
    assert torch.equal(cpab.theta, torch.zeros_like(cpab.theta))  # sampling does not touch the original
    points = torch.rand(50, 2, dtype=F64)
    forward = sampled.transform_points(points)
    assert (forward - points).abs().max() > 1e-3  # a real deformation
    back = sampled.inverse().transform_points(forward, per_batch=True)
    torch.testing.assert_close(back, points.expand(3, -1, -1), rtol=0, atol=1e-4)
    assert torch.equal(sampled.inverse().theta, -sampled.theta)


def test_prior_energy_velocity_and_jacobian_shapes() -> None:
    cpab = CPAB(Tessellation((3, 2)), boundary="normal", batch_size=2)
    assert torch.equal(cpab.prior_energy(), torch.zeros(2))
    with torch.no_grad():
        cpab.theta.normal_(generator=torch.Generator().manual_seed(0))
    energy = cpab.prior_energy()
    assert energy.shape == (2,) and (energy > 0).all()
    energy.sum().backward()
    assert cpab.theta.grad is not None
    points = torch.rand(4, 5, 2)
    assert cpab.velocity(points).shape == (2, 4, 5, 2)
    torch.testing.assert_close(cpab.velocity(points)[1], cpab.basis.velocity(cpab.theta[1], points))
    J = cpab.jacobian(points)
    assert J.shape == (2, 4, 5, 2, 2)
    torch.testing.assert_close(torch.linalg.det(J), cpab.jacobian_determinant(points), rtol=1e-4, atol=1e-6)
    assert "d=" in repr(cpab)


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="lower/upper"):
        CPAB(Tessellation((2, 2)), lower=(0, 0))
    with pytest.raises(ValueError, match="direction"):
        CPAB((2, 2), direction=np.eye(3))
    cpab = CPAB((2, 2))
    with pytest.raises(ValueError, match="points must have shape"):
        cpab.transform_points(torch.zeros(4, 3))
    with pytest.raises(ValueError, match="per_batch"):
        cpab.transform_points(torch.zeros(4, 2), per_batch=True)

"""The vertex prior (``VertexPrior``): its Kronecker-factored whitening against the dense definition, energy,
gradients, sampling, marginal standard deviations and the cell-map prior's scale."""

from __future__ import annotations

import math

import pytest
import torch

from regkit.cpab.basis import cpa_basis
from regkit.cpab.prior import CPABPrior, VertexPrior, _vertex_index_grid
from regkit.cpab.tessellation import Tessellation

CASES = [
    (Tessellation((3, 4, 2), (0.0, 1.0, 2.0), (1.0, 4.0, 2.5)), "normal"),  # Kronecker, a different set per component
    (Tessellation((4, 4, 4)), "zero"),  # Kronecker
    (Tessellation((2, 3, 2)), "free"),  # Kronecker
    (Tessellation((3, 3), (0.0, 0.0), (2.0, 1.0)), "free"),  # 2D: centres, dense
    (Tessellation((4, 3)), "zero"),  # 2D: dense
]


def case_id(case: tuple[Tessellation, str]) -> str:
    return f"{'x'.join(map(str, case[0].shape))}-{case[1]}"


@pytest.fixture(scope="module", params=CASES, ids=case_id)
def prior(request: pytest.FixtureRequest) -> VertexPrior:
    return VertexPrior(cpa_basis(*request.param), length_scale=0.3, variance=2.0, jitter=1e-6)


def dense_covariance(prior: VertexPrior) -> torch.Tensor:
    """``Sigma_theta`` built entry by entry from the class docstring (jitter on each 1D factor in 3D)."""
    basis, tess = prior.basis, prior.basis.tess
    lower, upper = (torch.tensor(v, dtype=torch.float64) for v in (tess.lower, tess.upper))
    unit = (tess.vertices() - lower) / (upper - lower)
    points = unit[basis.free_vertex]
    per_theta = basis.scale / (upper - lower)[basis.free_axis]
    sq = (points[:, None, :] - points[None, :, :]).square()
    scale = 2 * prior.length_scale**2
    if tess.ndim == 3:
        kernel = torch.ones(len(points), len(points), dtype=torch.float64)
        for axis in range(3):
            kernel = kernel * (torch.exp(-sq[..., axis] / scale) + prior.jitter * (sq[..., axis] == 0))
    else:
        kernel = torch.exp(-sq.sum(-1) / scale) + prior.jitter * torch.eye(len(points), dtype=torch.float64)
    same = basis.free_axis[:, None] == basis.free_axis[None, :]
    amplitude = prior.variance * prior.length_scale**2
    return amplitude * kernel * same / (per_theta[:, None] * per_theta[None, :])


def test_3d_vertex_sets_are_kronecker_and_2d_are_not() -> None:
    basis = cpa_basis(Tessellation((3, 4, 2)), "normal")
    axes = _vertex_index_grid(basis, torch.nonzero(basis.free_axis == 0).flatten())
    assert axes is not None and [a.tolist() for a in axes] == [[1, 2], [0, 1, 2, 3, 4], [0, 1, 2]]
    basis_2d = cpa_basis(Tessellation((3, 3)), "free")
    assert _vertex_index_grid(basis_2d, torch.nonzero(basis_2d.free_axis == 0).flatten()) is None


def test_covariance_matches_the_dense_definition(prior: VertexPrior) -> None:
    expected = dense_covariance(prior)
    cov = prior.covariance_theta
    torch.testing.assert_close(cov, expected, rtol=1e-10, atol=1e-12 * float(expected.abs().max()))
    torch.testing.assert_close(prior.marginal_std(), expected.diagonal().sqrt(), rtol=1e-10, atol=0.0)


def test_energy_whitening_and_gradient_match_the_dense_form(prior: VertexPrior) -> None:
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(3, prior.basis.d, generator=gen, dtype=torch.float64)
    cov = dense_covariance(prior)
    expected = 0.5 * (theta * torch.linalg.solve(cov, theta.T).T).sum(dim=1)
    torch.testing.assert_close(prior.energy(theta), expected, rtol=1e-6, atol=0.0)
    z = torch.randn(3, prior.basis.d, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(prior.whiten(prior.unwhiten(z)), z, rtol=0.0, atol=1e-8)
    torch.testing.assert_close(prior.energy(prior.unwhiten(z)), 0.5 * z.square().sum(dim=1), rtol=1e-8, atol=0.0)
    leaf = theta[0].clone().requires_grad_(True)
    prior.energy(leaf).backward()
    grad = leaf.grad
    assert grad is not None
    torch.testing.assert_close(grad, torch.linalg.solve(cov, theta[0]), rtol=1e-5, atol=1e-8)


def test_whitening_is_differentiable_in_float64_and_keeps_float32() -> None:
    prior = VertexPrior(cpa_basis(Tessellation((2, 3, 2)), "normal"), length_scale=0.4)
    z = torch.randn(2, prior.basis.d, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(prior.unwhiten, (z,))
    assert torch.autograd.gradcheck(prior.whiten, (z,))
    theta = prior.sample_theta(generator=torch.Generator().manual_seed(2))
    energy = prior.energy(theta.float())
    assert energy.dtype == torch.float32
    torch.testing.assert_close(energy.double(), prior.energy(theta), rtol=1e-3, atol=0.0)
    with pytest.raises(ValueError, match=rf"expected shape \(\.\.\., {prior.basis.d}\)"):
        prior.unwhiten(torch.zeros(3))


def test_sampling_is_deterministic_and_has_the_covariance() -> None:
    prior = VertexPrior(cpa_basis(Tessellation((3, 2, 2)), "free"), length_scale=0.4)
    one = prior.sample_theta(generator=torch.Generator().manual_seed(7))
    assert torch.equal(one, prior.sample_theta(generator=torch.Generator().manual_seed(7)))
    samples = prior.sample_theta(20000, generator=torch.Generator().manual_seed(3))
    cov = prior.covariance_theta
    std = cov.diagonal().sqrt()
    empirical = samples.T @ samples / len(samples)
    assert ((empirical - cov) / (std[:, None] * std[None, :])).abs().max() < 5 * (2 / len(samples)) ** 0.5


def test_the_velocity_scale_is_independent_of_the_box_and_the_tessellation() -> None:
    """Interior vertex velocities (box extents per unit time) have std ``sqrt(variance) length_scale``, on any box,
    close to the cell-map prior's at the same settings."""
    for tess in (Tessellation((6, 6, 6)), Tessellation((12, 8, 6), (-90.0, 0.0, 10.0), (90.0, 120.0, 200.0))):
        basis = cpa_basis(tess)
        std = VertexPrior(basis, length_scale=0.1, variance=4.0, jitter=0.0).marginal_std()
        extent = (torch.tensor(tess.upper) - torch.tensor(tess.lower)).double()
        velocity_std = std * basis.scale / extent[basis.free_axis]
        torch.testing.assert_close(velocity_std, torch.full_like(velocity_std, 0.2), rtol=1e-12, atol=0.0)
    basis = cpa_basis(Tessellation((6, 6, 6)))
    cells, vertices = CPABPrior(basis, 0.1).marginal_std(), VertexPrior(basis, 0.1).marginal_std()
    assert 0.5 < float((cells / vertices).median()) < 1.0


def test_fine_3d_tessellation_is_cheap() -> None:
    """24^3 cells (36,501 parameters): no dense d x d or V x V matrix is built."""
    prior = VertexPrior(cpa_basis(Tessellation((24, 24, 24))), length_scale=0.1)
    assert all(f.shape[0] <= 25 for _, _, roots, _ in prior._blocks for f in roots)
    z = torch.randn(prior.basis.d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    theta = prior.unwhiten(z)
    torch.testing.assert_close(prior.whiten(theta), z, rtol=0.0, atol=1e-6)
    assert math.isclose(float(prior.energy(theta)), 0.5 * float(z.square().sum()), rel_tol=1e-8)


def test_invalid_arguments() -> None:
    basis = cpa_basis(Tessellation((2, 2)))
    for kwargs in ({"length_scale": 0.0}, {"variance": -1.0}, {"jitter": -1e-3}):
        with pytest.raises(ValueError, match="CPAB prior"):
            VertexPrior(basis, **kwargs)
    with pytest.raises(ValueError, match="nodal basis"):
        VertexPrior(cpa_basis(Tessellation((3, 3)), "normal", volume_preserving=True))


@pytest.mark.gpu
def test_cuda_matches_cpu() -> None:
    prior = VertexPrior(cpa_basis(Tessellation((4, 3, 2)), "normal"))
    theta = prior.sample_theta(3, generator=torch.Generator().manual_seed(6))
    for dtype in (torch.float32, torch.float64):
        energy = prior.energy(theta.to(device="cuda", dtype=dtype))
        assert energy.is_cuda and energy.dtype == dtype
        torch.testing.assert_close(energy.cpu().double(), prior.energy(theta), rtol=1e-3, atol=0.0)

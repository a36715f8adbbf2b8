"""regkit.cpab.prior: the cell-map prior (``CPABPrior``) against its dense definition ``Sigma_theta = B^T Sigma_A B``,
sampling, whitening and scale, and the vertex prior (``VertexPrior``): its Kronecker-factored whitening against the
dense definition, energy, gradients, sampling, marginal standard deviations and the cell-map prior's scale."""

from __future__ import annotations

import math

import pytest
import torch

from regkit.cpab.basis import CPABasis, cpa_basis, dense_svd_basis
from regkit.cpab.prior import CPABPrior, VertexPrior, unit_box_jacobian, vertex_index_grid
from regkit.cpab.tessellation import Tessellation

# ----------------------------------------------------------------------------------------------------------------------
# CPABPrior

CASES = [
    (Tessellation((2, 2)), "zero", False),
    (Tessellation((3, 2), (-1.0, 0.0), (2.0, 3.0)), "normal", False),
    (Tessellation((2, 2, 2)), "free", False),
    (Tessellation((2, 3, 2), (0.0, 1.0, 2.0), (1.0, 4.0, 2.5)), "normal", False),
    (Tessellation((3, 3), (0.0, 0.0), (2.0, 1.0)), "normal", True),
    (Tessellation((2, 1, 2), (0.0, 0.0, 0.0), (1.0, 2.0, 3.0)), "free", True),
]


def case_id(case: tuple[Tessellation, str, bool]) -> str:
    tess, boundary, vp = case
    return f"{'x'.join(map(str, tess.shape))}-{boundary}{'-vp' if vp else ''}"


@pytest.fixture(scope="module", params=CASES, ids=case_id)
def prior(request: pytest.FixtureRequest) -> CPABPrior:
    return CPABPrior(cpa_basis(*request.param), length_scale=0.3, variance=2.0)


def dense_parts(prior: CPABPrior) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense ``B̂`` (theta -> vec(Â)), ``Sigma_Â`` and the module docstring's ``Sigma_theta`` with jitter."""
    tess = prior.basis.tess
    jac = torch.block_diag(*[unit_box_jacobian(prior.basis)] * tess.n_cells)
    b_hat = jac @ prior.basis.matrix.to_dense()
    sigma_hat = jac @ prior.covariance_A() @ jac.T
    m, g = b_hat.T @ sigma_hat @ b_hat, b_hat.T @ b_hat
    m = m + torch.diag(prior.jitter * m.diagonal())
    return b_hat, sigma_hat, torch.linalg.solve(g, torch.linalg.solve(g, m).T)


def test_covariance_matches_the_dense_definition(prior: CPABPrior) -> None:
    cov = prior.covariance_theta
    _, _, expected = dense_parts(prior)
    assert cov.shape == (prior.basis.d, prior.basis.d)
    assert torch.allclose(cov, expected, rtol=1e-9, atol=1e-12 * float(expected.abs().max()))
    assert torch.allclose(cov, cov.T, rtol=1e-12, atol=0)
    assert torch.linalg.eigvalsh(cov).min() > 0


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_covariance_is_the_projected_kernel_without_jitter(case: tuple[Tessellation, str, bool]) -> None:
    """With no jitter, Sigma_theta is the covariance of the least-squares coordinates pinv(B̂) vec(Â)."""
    prior = CPABPrior(cpa_basis(*case), length_scale=0.5, variance=2.0, jitter=0.0)
    b_hat, sigma_hat, _ = dense_parts(prior)
    pinv = torch.linalg.pinv(b_hat)
    expected = pinv @ sigma_hat @ pinv.T
    assert torch.allclose(prior.covariance_theta, expected, rtol=1e-6, atol=1e-9 * float(expected.abs().max()))


def test_unit_box_covariance_A_is_the_plain_kernel() -> None:
    tess = Tessellation((3, 2))
    prior = CPABPrior(cpa_basis(tess), length_scale=0.2, variance=1.5)
    centres = tess.centers()
    kernel = 1.5 * torch.exp(-torch.cdist(centres, centres).square() / (2 * 0.2**2))
    assert torch.allclose(prior.covariance_A(), torch.kron(kernel, torch.eye(6, dtype=torch.float64)), atol=1e-14)


@pytest.mark.parametrize(("shape", "boundary"), [((2, 2), "zero"), ((2, 3), "free"), ((2, 2, 1), "normal")])
def test_energy_is_libcpabs_for_an_orthonormal_basis(shape: tuple[int, ...], boundary: str) -> None:
    """On the unit box the energy of a field equals libcpab's 1/2 t^T (U^T Sigma_A U)^-1 t, U orthonormal."""
    tess = Tessellation(shape)
    prior = CPABPrior(cpa_basis(tess, boundary), length_scale=0.5, jitter=0.0)
    theta = torch.randn(3, prior.basis.d, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    fields = (prior.basis.matrix @ theta.T).T
    u = dense_svd_basis(tess, boundary)
    coords = fields @ u
    expected = 0.5 * (coords * torch.linalg.solve(u.T @ prior.covariance_A() @ u, coords.T).T).sum(dim=1)
    assert torch.allclose(prior.energy(theta), expected, rtol=1e-6)


def test_energy_matches_dense_formula(prior: CPABPrior) -> None:
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(4, prior.basis.d, generator=gen, dtype=torch.float64)
    _, _, cov = dense_parts(prior)
    expected = 0.5 * (theta * torch.linalg.solve(cov, theta.T).T).sum(dim=1)
    energy = prior.energy(theta)
    assert energy.shape == (4,)
    assert torch.allclose(energy, expected, rtol=1e-8)
    assert torch.allclose(prior.energy(theta[2]), expected[2], rtol=1e-8)


def test_whitening_round_trip_and_gradient(prior: CPABPrior) -> None:
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(3, prior.basis.d, generator=gen, dtype=torch.float64)
    theta = prior.unwhiten(z)
    assert torch.allclose(prior.whiten(theta), z, atol=1e-8)
    assert torch.allclose(prior.energy(theta), 0.5 * z.square().sum(dim=1), rtol=1e-8)
    theta = theta[0].clone().requires_grad_(True)
    prior.energy(theta).backward()
    expected = torch.linalg.solve(dense_parts(prior)[2], theta.detach())
    assert torch.allclose(theta.grad, expected, rtol=1e-6, atol=1e-8)


def test_energy_gradcheck_and_dtype() -> None:
    prior = CPABPrior(cpa_basis(Tessellation((2, 3)), "normal"))
    theta = torch.randn(2, prior.basis.d, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(prior.energy, (theta,))
    assert torch.autograd.gradcheck(prior.unwhiten, (theta,))
    theta32 = prior.sample_theta(generator=torch.Generator().manual_seed(2)).float()
    energy = prior.energy(theta32)
    assert energy.dtype == torch.float32
    assert torch.allclose(energy.double(), prior.energy(theta32.double()), rtol=1e-3)
    with pytest.raises(ValueError, match=r"expected shape \(\.\.\., 22\)"):
        prior.energy(torch.zeros(3))


def test_sampling_is_deterministic() -> None:
    prior = CPABPrior(cpa_basis(Tessellation((3, 3)), "zero"))
    one = prior.sample_theta(generator=torch.Generator().manual_seed(7))
    again = prior.sample_theta(generator=torch.Generator().manual_seed(7))
    other = prior.sample_theta(generator=torch.Generator().manual_seed(8))
    assert one.shape == (prior.basis.d,) and one.dtype == torch.float64
    assert torch.equal(one, again) and not torch.equal(one, other)
    many = prior.sample_theta(5, generator=torch.Generator().manual_seed(7))
    doubled = prior.sample_theta(5, generator=torch.Generator().manual_seed(7), scale=2.0)
    assert many.shape == (5, prior.basis.d)
    assert torch.allclose(doubled, 2.0 * many)


def test_sample_covariance(prior: CPABPrior) -> None:
    samples = prior.sample_theta(20000, generator=torch.Generator().manual_seed(3))
    empirical = samples.T @ samples / len(samples)
    cov = prior.covariance_theta
    std = cov.diagonal().sqrt()
    # each entry's sampling error is at most sqrt(2 cov_ii cov_jj / n): allow 5 of those
    assert ((empirical - cov) / (std[:, None] * std[None, :])).abs().max() < 5 * (2 / len(samples)) ** 0.5


def test_prior_is_independent_of_the_box_units() -> None:
    """The same normalised field has the same energy on the unit box and on a box in millimetres."""
    unit = cpa_basis(Tessellation((3, 2, 2)), "normal")
    box = cpa_basis(Tessellation((3, 2, 2), (-90.0, 10.0, 0.0), (90.0, 130.0, 200.0)), "normal")
    extent = torch.tensor([180.0, 120.0, 200.0], dtype=torch.float64)
    theta_unit = torch.randn(unit.d, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    velocities = unit.vertex_velocities(theta_unit) * extent  # the same field, in millimetres per unit time
    theta_box = velocities[box.free_vertex, box.free_axis] / box.scale
    assert torch.allclose(box.vertex_velocities(theta_box), velocities)
    energies = [CPABPrior(b, 0.3).energy(t) for b, t in ((unit, theta_unit), (box, theta_box))]
    assert torch.allclose(energies[0], energies[1], rtol=1e-8)


def test_empty_basis_and_invalid_arguments() -> None:
    prior = CPABPrior(cpa_basis(Tessellation((1, 1, 1)), "zero"))
    assert prior.basis.d == 0
    assert prior.sample_theta(3, generator=torch.Generator()).shape == (3, 0)
    assert prior.energy(torch.zeros(2, 0)).tolist() == [0.0, 0.0]
    basis = cpa_basis(Tessellation((2, 2)))
    for kwargs in ({"length_scale": 0.0}, {"variance": -1.0}, {"length_scale": float("nan")}, {"jitter": -1e-3}):
        with pytest.raises(ValueError, match="CPAB prior"):
            CPABPrior(basis, **kwargs)
    with pytest.raises(ValueError, match="increase jitter"):
        CPABPrior(cpa_basis(Tessellation((16, 16))), length_scale=1.0, jitter=0.0)


def check_large(basis: CPABasis) -> None:
    prior = CPABPrior(basis)
    gen = torch.Generator().manual_seed(5)
    theta = prior.sample_theta(2, generator=gen)
    z = prior.whiten(theta)
    assert torch.allclose(prior.unwhiten(z), theta, atol=1e-8 * float(theta.abs().max()))
    assert torch.all(prior.energy(theta) > 0)


@pytest.mark.parametrize("shape", [(32, 32), (8, 8, 8)])
def test_large_priors(shape: tuple[int, ...]) -> None:
    check_large(cpa_basis(Tessellation(shape)))


@pytest.mark.slow
def test_prior_3d_16() -> None:
    check_large(cpa_basis(Tessellation((16, 16, 16))))


@pytest.mark.gpu
def test_cuda_matches_cpu() -> None:
    prior = CPABPrior(cpa_basis(Tessellation((4, 3, 2)), "normal", volume_preserving=True))
    theta = prior.sample_theta(3, generator=torch.Generator().manual_seed(6))
    for dtype in (torch.float32, torch.float64):
        energy = prior.energy(theta.to(device="cuda", dtype=dtype))
        assert energy.is_cuda and energy.dtype == dtype
        assert torch.allclose(energy.cpu().double(), prior.energy(theta), rtol=1e-3)
    cuda_sample = prior.sample_theta(generator=torch.Generator(device="cuda").manual_seed(0))
    assert cuda_sample.is_cuda


# ----------------------------------------------------------------------------------------------------------------------
# VertexPrior

VERTEX_CASES = [
    (Tessellation((3, 4, 2), (0.0, 1.0, 2.0), (1.0, 4.0, 2.5)), "normal"),  # Kronecker, a different set per component
    (Tessellation((4, 4, 4)), "zero"),  # Kronecker
    (Tessellation((2, 3, 2)), "free"),  # Kronecker
    (Tessellation((3, 3), (0.0, 0.0), (2.0, 1.0)), "free"),  # 2D: centres, dense
    (Tessellation((4, 3)), "zero"),  # 2D: dense
]


def vertex_case_id(case: tuple[Tessellation, str]) -> str:
    return f"{'x'.join(map(str, case[0].shape))}-{case[1]}"


@pytest.fixture(scope="module", params=VERTEX_CASES, ids=vertex_case_id)
def vertex_prior(request: pytest.FixtureRequest) -> VertexPrior:
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
    axes = vertex_index_grid(basis, torch.nonzero(basis.free_axis == 0).flatten())
    assert axes is not None and [a.tolist() for a in axes] == [[1, 2], [0, 1, 2, 3, 4], [0, 1, 2]]
    basis_2d = cpa_basis(Tessellation((3, 3)), "free")
    assert vertex_index_grid(basis_2d, torch.nonzero(basis_2d.free_axis == 0).flatten()) is None


def test_vertex_covariance_matches_the_dense_definition(vertex_prior: VertexPrior) -> None:
    expected = dense_covariance(vertex_prior)
    cov = vertex_prior.covariance_theta
    torch.testing.assert_close(cov, expected, rtol=1e-10, atol=1e-12 * float(expected.abs().max()))
    torch.testing.assert_close(vertex_prior.marginal_std(), expected.diagonal().sqrt(), rtol=1e-10, atol=0.0)


def test_energy_whitening_and_gradient_match_the_dense_form(vertex_prior: VertexPrior) -> None:
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(3, vertex_prior.basis.d, generator=gen, dtype=torch.float64)
    cov = dense_covariance(vertex_prior)
    expected = 0.5 * (theta * torch.linalg.solve(cov, theta.T).T).sum(dim=1)
    torch.testing.assert_close(vertex_prior.energy(theta), expected, rtol=1e-6, atol=0.0)
    z = torch.randn(3, vertex_prior.basis.d, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(vertex_prior.whiten(vertex_prior.unwhiten(z)), z, rtol=0.0, atol=1e-8)
    torch.testing.assert_close(
        vertex_prior.energy(vertex_prior.unwhiten(z)), 0.5 * z.square().sum(dim=1), rtol=1e-8, atol=0.0
    )
    leaf = theta[0].clone().requires_grad_(True)
    vertex_prior.energy(leaf).backward()
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
    assert all(side <= 25 for sides in prior.factor_sizes for side in sides)
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
def test_vertex_prior_cuda_matches_cpu() -> None:
    prior = VertexPrior(cpa_basis(Tessellation((4, 3, 2)), "normal"))
    theta = prior.sample_theta(3, generator=torch.Generator().manual_seed(6))
    for dtype in (torch.float32, torch.float64):
        energy = prior.energy(theta.to(device="cuda", dtype=dtype))
        assert energy.is_cuda and energy.dtype == dtype
        torch.testing.assert_close(energy.cpu().double(), prior.energy(theta), rtol=1e-3, atol=0.0)

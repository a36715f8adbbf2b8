"""The CPAB prior against its dense definition ``Sigma_theta = B^T Sigma_A B``, sampling, whitening and scale."""

from __future__ import annotations

import pytest
import torch

from regkit.cpab.basis import CPABasis, cpa_basis, dense_svd_basis
from regkit.cpab.prior import CPABPrior, unit_box_jacobian
from regkit.cpab.tessellation import Tessellation

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

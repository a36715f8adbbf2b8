"""regkit.cpab.integrate: the facet-resolved scheme, its factorized adjoint and the baselines, on real tessellations.

The scheme is the exact flow (any number of steps, inverted by ``-A``, continuous across facets). The factorized
gradient holds cells and hit times fixed, so it equals unrolled autograd through ``integrate_reference`` to rounding
(also on facets and outside the box); it is the flow's gradient because the field is continuous, which ``gradcheck``
checks through facet crossings.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import pytest
import torch
from scipy.integrate import solve_ivp

from regkit._backend import BackendError
from regkit.cpab.baselines import forward_sensitivity_gradient, integrate_accurate
from regkit.cpab.basis import CPABasis, cpa_basis
from regkit.cpab.integrate import (
    count_crossings,
    integrate,
    integrate_chain,
    integrate_reference,
    integrate_trajectory,
    jacobian,
    log_jacobian_determinant,
)
from regkit.cpab.scheme import step_matrices
from regkit.cpab.tessellation import Tessellation

F64 = torch.float64
SHAPES = [(3, 2), (2, 2, 2)]
BOUNDARIES = ["zero", "normal", "free"]


@cache
def _basis(shape: tuple[int, ...], boundary: str = "zero", volume_preserving: bool = False) -> CPABasis:
    return cpa_basis(Tessellation(shape), boundary, volume_preserving)


def _theta(basis: CPABasis, *batch: int, scale: float = 0.5, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*batch, basis.d, generator=gen, dtype=F64)


def _random_points(tess: Tessellation, count: int, seed: int = 1, spread: float = 0.9) -> torch.Tensor:
    """Uniform points in the box shrunk by ``spread`` about its centre (``spread > 1``: partly outside)."""
    gen = torch.Generator().manual_seed(seed)
    lower, upper = torch.tensor(tess.lower, dtype=F64), torch.tensor(tess.upper, dtype=F64)
    u = 0.5 + spread * (torch.rand(count, tess.ndim, generator=gen, dtype=F64) - 0.5)
    return lower + (upper - lower) * u


def _special_points(tess: Tessellation) -> torch.Tensor:
    """Mesh vertices, facet midpoints, cell centres and points outside the box (below, above, diagonal)."""
    verts = tess.vertices()
    _, facet_ids = tess.facets()
    midpoints = verts[facet_ids].mean(1)
    lower, upper = torch.tensor(tess.lower, dtype=F64), torch.tensor(tess.upper, dtype=F64)
    outside = torch.stack([lower - 0.3, upper + 0.2, 0.5 * (lower + upper) + torch.linspace(-0.8, 0.9, tess.ndim)])
    return torch.cat([verts, midpoints, tess.centers(), outside])


# ---- forward ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_factorized_forward_equals_reference_exactly(shape: tuple[int, ...]) -> None:
    basis = _basis(shape)
    A = basis.to_A(_theta(basis, 2))
    points = torch.cat([_random_points(basis.tess, 30, spread=1.3), _special_points(basis.tess)])
    reference = integrate_reference(points, A, basis.tess, steps=11)
    assert reference.shape == (2, points.shape[0], len(shape))
    for every in (1, 3, 8, 11, 40):
        assert torch.equal(
            integrate(points, A, basis.tess, steps=11, checkpoint_every=every, backend="torch"), reference
        )
    trajectory = integrate_trajectory(points, A, basis.tess, steps=11)
    assert trajectory.shape == (12, *reference.shape)
    assert torch.equal(trajectory[-1], reference)
    assert torch.equal(trajectory[0], points.expand_as(reference))


@pytest.mark.parametrize("shape", SHAPES)
def test_batch_shapes(shape: tuple[int, ...]) -> None:
    """Unbatched inputs give unbatched results; a batch of A or of points broadcasts against the other."""
    basis = _basis(shape)
    theta = _theta(basis, 3)
    A = basis.to_A(theta)
    points = _random_points(basis.tess, 7)
    batched = integrate(points, A, basis.tess, steps=5)
    for b in range(3):
        single = integrate(points, A[b], basis.tess, steps=5)
        assert single.shape == points.shape
        torch.testing.assert_close(single, batched[b], rtol=0, atol=1e-15)
    per_batch = integrate(points.expand(3, -1, -1), A, basis.tess, steps=5)
    torch.testing.assert_close(per_batch, batched, rtol=0, atol=0)
    shared_A = integrate(points.expand(2, -1, -1), A[0], basis.tess, steps=5)
    torch.testing.assert_close(shared_A, batched[:1].expand(2, -1, -1), rtol=0, atol=1e-15)


@pytest.mark.parametrize("shape", SHAPES)
def test_zero_theta_is_the_identity(shape: tuple[int, ...]) -> None:
    basis = _basis(shape, "free")
    points = torch.cat([_random_points(basis.tess, 20, spread=1.4), _special_points(basis.tess)])
    A = basis.to_A(torch.zeros(basis.d, dtype=F64))
    assert torch.equal(integrate(points, A, basis.tess), points)
    assert torch.equal(integrate_reference(points, A, basis.tess), points)


@pytest.mark.parametrize("shape", SHAPES)
def test_time_zero_is_the_identity_and_time_one_the_default(shape: tuple[int, ...]) -> None:
    basis = _basis(shape)
    theta = _theta(basis)
    A = basis.to_A(theta)
    points = _random_points(basis.tess, 25)
    assert torch.equal(integrate(points, A, basis.tess, t=0.0), points)
    assert torch.equal(integrate(points, A, basis.tess, t=1.0), integrate(points, A, basis.tess))
    # phi(x, t) moves continuously with t: between neighbouring times no point moves much more than max|v| dt
    times = torch.linspace(0, 1, 41).tolist()
    path = torch.stack([integrate(points, A, basis.tess, t=t) for t in times])
    speed = basis.velocity(theta, path).norm(dim=-1).amax()
    jumps = (path[1:] - path[:-1]).norm(dim=-1)
    assert jumps.amax() <= 1.1 * speed * (times[1] - times[0])


@pytest.mark.parametrize("shape", SHAPES)
def test_is_the_exact_flow_for_any_number_of_steps(shape: tuple[int, ...]) -> None:
    """Facet crossings are resolved: few steps give the flow of solve_ivp, as the bisection variant does."""
    basis = _basis(shape)
    theta = _theta(basis, scale=2.0)  # large enough that several points cross facets
    A = basis.to_A(theta)
    points = _random_points(basis.tess, 12, seed=4, spread=0.8)

    def rhs(_: float, y: np.ndarray) -> np.ndarray:
        return basis.velocity(theta, torch.from_numpy(y)).numpy()

    exact = torch.from_numpy(
        np.stack(
            [solve_ivp(rhs, (0.0, 1.0), p.numpy(), method="DOP853", rtol=1e-12, atol=1e-12).y[:, -1] for p in points]
        )
    )
    assert count_crossings(points, A, basis.tess, steps=2) > 0
    for steps in (2, 5, 40):
        torch.testing.assert_close(integrate(points, A, basis.tess, steps=steps), exact, rtol=0, atol=1e-9)
    torch.testing.assert_close(integrate_accurate(points, A, basis.tess, steps=5), exact, rtol=0, atol=1e-9)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_flow_of_minus_A_inverts_to_rounding(shape: tuple[int, ...]) -> None:
    basis = _basis(shape)
    A = basis.to_A(_theta(basis, scale=1.5))
    points = _random_points(basis.tess, 200)
    for steps in (2, 5, 50):
        there = integrate(points, A, basis.tess, steps=steps)
        back = integrate_chain(there, [A], basis.tess, steps=steps, inverse=True)
        torch.testing.assert_close(back, points, rtol=0, atol=1e-12)
    assert count_crossings(points, A, basis.tess, steps=2) > 20


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("shape", SHAPES)
def test_continuous_across_facets(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Along lines sampled finely through many cells, consecutive images move no more than the flow's Lipschitz
    bound allows: no jump where a step's end moves into another cell."""
    basis = _basis(shape)
    theta = _theta(basis, scale=1.5)
    A = basis.to_A(theta).to(dtype)
    ends = _random_points(basis.tess, 2 * 20, seed=6, spread=0.95).view(20, 2, -1)
    s = torch.linspace(0, 1, 2001, dtype=F64).view(1, -1, 1)
    lines = (ends[:, :1] + s * (ends[:, 1:] - ends[:, :1])).to(dtype)  # (20, 2001, n)
    spacing = (ends[:, 1] - ends[:, 0]).norm(dim=-1).max().item() / 2000
    images = integrate(lines.reshape(-1, len(shape)), A, basis.tess, steps=2).view(*lines.shape).double()
    steps = (images[:, 1:] - images[:, :-1]).norm(dim=-1)
    lipschitz = math.exp(float(torch.linalg.matrix_norm(basis.to_A(theta)[..., :-1], ord=2).amax()))  # exp(L t)
    rounding = 1e-5 if dtype == torch.float32 else 1e-12
    assert steps.max().item() <= lipschitz * spacing + rounding
    assert count_crossings(lines.reshape(-1, len(shape)), A, basis.tess, steps=2) > 100


@pytest.mark.parametrize("shape", SHAPES)
def test_chain_applies_stages_in_order_and_inverts(shape: tuple[int, ...]) -> None:
    fine = _basis(tuple(2 * s for s in shape))
    coarse = _basis(shape)
    A1, A2 = coarse.to_A(_theta(coarse, seed=1)), fine.to_A(_theta(fine, seed=2))
    points = _random_points(coarse.tess, 15)
    chained = integrate_chain(points, [A1, A2], [coarse.tess, fine.tess], steps=30)
    expected = integrate(integrate(points, A1, coarse.tess, steps=30), A2, fine.tess, steps=30)
    assert torch.equal(chained, expected)
    back = integrate_chain(chained, [A1, A2], [coarse.tess, fine.tess], steps=30, inverse=True)
    torch.testing.assert_close(back, points, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="tessellations"):
        integrate_chain(points, [A1, A2], [coarse.tess])


@pytest.mark.parametrize("shape", SHAPES)
def test_jacobian_is_analytic_and_positive(shape: tuple[int, ...]) -> None:
    basis = _basis(shape, "free")
    A = basis.to_A(_theta(basis, 2, scale=3.0))  # large velocities: many crossings, strong compression
    points = torch.cat([_random_points(basis.tess, 200, spread=1.2), _special_points(basis.tess)])
    logdet = log_jacobian_determinant(points, A, basis.tess, steps=20)
    J = jacobian(points, A, basis.tess, steps=20)
    assert J.shape == (2, points.shape[0], len(shape), len(shape))
    assert (torch.linalg.det(J) > 0).all()
    torch.testing.assert_close(torch.linalg.det(J).log(), logdet, rtol=0, atol=1e-10)
    autograd = torch.stack(
        [
            torch.autograd.functional.jacobian(lambda p: integrate_reference(p, A[0], basis.tess, steps=20), point)
            for point in points.unsqueeze(1)
        ]
    )  # (N, 1, n, 1, n)
    torch.testing.assert_close(J[0], autograd[:, 0, :, 0], rtol=0, atol=1e-11)


# ---- gradients -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("boundary", BOUNDARIES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gradcheck_factorized(shape: tuple[int, ...], boundary: str) -> None:
    basis = _basis(shape, boundary)
    theta = _theta(basis, 2, scale=1.5)
    points = _random_points(basis.tess, 12, seed=3)
    assert count_crossings(points, basis.to_A(theta), basis.tess, steps=2) > 0

    def run(p: torch.Tensor, th: torch.Tensor) -> torch.Tensor:
        return integrate(p, basis.to_A(th), basis.tess, steps=2, checkpoint_every=1, backend="torch")

    inputs = (points.requires_grad_(True), theta.requires_grad_(True))
    assert torch.autograd.gradcheck(run, inputs, fast_mode=len(shape) == 3)  # fast mode: a random projection of J


def test_gradcheck_volume_preserving() -> None:
    basis = _basis((3, 3), "zero", True)
    theta = _theta(basis, scale=2.0)
    points = _random_points(basis.tess, 6, seed=5)
    assert count_crossings(points, basis.to_A(theta), basis.tess, steps=5) > 0

    def run(p: torch.Tensor, th: torch.Tensor) -> torch.Tensor:
        return integrate(p, basis.to_A(th), basis.tess, steps=5, backend="torch")

    assert torch.autograd.gradcheck(run, (points.requires_grad_(True), theta.requires_grad_(True)))
    logdet = log_jacobian_determinant(points.detach(), basis.to_A(theta.detach()), basis.tess, steps=5)
    torch.testing.assert_close(logdet, torch.zeros_like(logdet), rtol=0, atol=1e-12)


@pytest.mark.parametrize("boundary", BOUNDARIES)
@pytest.mark.parametrize("shape", SHAPES)
def test_factorized_gradient_equals_unrolled_autograd(shape: tuple[int, ...], boundary: str) -> None:
    """Also on facets, at vertices and outside the box, for batched theta with shared points."""
    basis = _basis(shape, boundary)
    theta = _theta(basis, 2, scale=1.5, seed=7).requires_grad_(True)
    points = torch.cat([_random_points(basis.tess, 50, spread=1.5), _special_points(basis.tess)]).requires_grad_(True)
    weights = torch.randn(2, points.shape[0], len(shape), dtype=F64, generator=torch.Generator().manual_seed(8))
    grads = {}
    for backend in ("reference", "torch"):
        out = integrate(points, basis.to_A(theta), basis.tess, steps=17, backend=backend, checkpoint_every=5)
        grads[backend] = torch.autograd.grad((out * weights).sum(), (points, theta))
    for fast, ref in zip(grads["torch"], grads["reference"], strict=True):
        torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("shape", SHAPES)
def test_theta_gradient_is_the_projection_of_the_A_gradient(shape: tuple[int, ...]) -> None:
    """The factorization's last step: dL/dtheta = B^T vec(dL/dA) (CPABasis.project), as autograd of to_A gives."""
    basis = _basis(shape, "normal")
    theta = _theta(basis, 2).requires_grad_(True)
    A = basis.to_A(theta)
    points = _random_points(basis.tess, 30)
    out = integrate(points, A, basis.tess, steps=7)
    grad_A, grad_theta = torch.autograd.grad((out * out).sum(), (A, theta))
    torch.testing.assert_close(basis.project(grad_A), grad_theta, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_checkpoint_interval_does_not_change_gradients(shape: tuple[int, ...]) -> None:
    basis = _basis(shape)
    A = basis.to_A(_theta(basis, 2)).requires_grad_(True)
    points = _random_points(basis.tess, 30).requires_grad_(True)
    weights = torch.randn(2, 30, len(shape), dtype=F64)
    grads = [
        torch.autograd.grad(
            (integrate(points, A, basis.tess, steps=13, checkpoint_every=k, backend="torch") * weights).sum(),
            (points, A),
        )
        for k in (1, 4, 13, 50)
    ]
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("shape", SHAPES)
def test_gradient_wrt_one_input_only(shape: tuple[int, ...]) -> None:
    basis = _basis(shape)
    A = basis.to_A(_theta(basis))
    points = _random_points(basis.tess, 10)
    assert integrate(points, A, basis.tess).grad_fn is None
    p = points.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(integrate(p, A, basis.tess).sum(), p)
    (g_ref,) = torch.autograd.grad(integrate_reference(p, A, basis.tess).sum(), p)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("boundary", ["zero", "free"])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_sensitivity_equals_factorized(shape: tuple[int, ...], boundary: str) -> None:
    basis = _basis(shape, boundary)
    points = _random_points(basis.tess, 25, spread=1.2)
    for theta in (_theta(basis, seed=3), _theta(basis, 2, seed=4)):
        th = theta.clone().requires_grad_(True)
        out = integrate(points, basis.to_A(th), basis.tess, steps=9)
        weights = torch.randn_like(out)
        (factorized,) = torch.autograd.grad((out * weights).sum(), th)
        sensitivity = forward_sensitivity_gradient(points, theta, basis, weights, steps=9)
        assert sensitivity.shape == theta.shape
        torch.testing.assert_close(sensitivity, factorized, rtol=1e-10, atol=1e-10)


def test_float32_factorized_gradient_close_to_float64() -> None:
    basis = _basis((4, 4))
    theta = _theta(basis, 2)
    points = _random_points(basis.tess, 500)
    weights = torch.randn(2, 500, 2, dtype=F64)
    grads = []
    for dtype in (torch.float32, F64):
        th = theta.to(dtype).requires_grad_(True)
        out = integrate(points.to(dtype), basis.to_A(th), basis.tess, backend="torch")
        grads.append(torch.autograd.grad((out * weights.to(dtype)).sum(), th)[0].double())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-3 * grads[1].abs().max().item())


# ---- arguments -------------------------------------------------------------------------------------------------------


def test_step_matrices_are_the_exact_in_cell_flow() -> None:
    basis = _basis((2, 2))
    A = basis.to_A(_theta(basis))
    E = step_matrices(A, 0.3)
    assert E.shape == A.shape
    torch.testing.assert_close(step_matrices(A, 0.0), torch.eye(2, 3, dtype=F64).expand_as(A), rtol=0, atol=0)
    x = _random_points(basis.tess, A.shape[0]).unsqueeze(-1)  # one point per cell
    ones = torch.ones_like(x[:, :1])
    inner = step_matrices(A, 0.2) @ torch.cat([x, ones], 1)
    torch.testing.assert_close(step_matrices(A, 0.1) @ torch.cat([inner, ones], 1), E @ torch.cat([x, ones], 1))


def test_argument_errors() -> None:
    basis = _basis((2, 2))
    A = basis.to_A(_theta(basis))
    points = _random_points(basis.tess, 4)
    with pytest.raises(BackendError, match="unknown backend"):
        integrate(points, A, basis.tess, backend="cuda-magic")
    with pytest.raises(ValueError, match="A must have shape"):
        integrate(points, A[:-1], basis.tess)
    with pytest.raises(ValueError, match="points must have shape"):
        integrate(points[:, :1], A, basis.tess)
    with pytest.raises(ValueError, match="must match"):
        integrate(points.float(), A, basis.tess)
    with pytest.raises(ValueError, match="batch sizes"):
        integrate(points.expand(3, -1, -1), A.expand(2, -1, -1, -1), basis.tess)
    with pytest.raises(ValueError, match="steps"):
        integrate(points, A, basis.tess, steps=0)
    with pytest.raises(ValueError, match="checkpoint_every"):
        integrate(points, A, basis.tess, checkpoint_every=0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_matches_the_cpu(shape: tuple[int, ...]) -> None:
    basis = _basis(shape, "normal")
    theta = _theta(basis, 3, scale=1.5)
    points = _random_points(basis.tess, 200, spread=1.3)  # off facets: rounding may pick other cells on them
    weights = torch.randn(3, points.shape[0], len(shape), dtype=F64)
    results = []
    for device in ("cpu", "cuda"):
        th = theta.to(device).requires_grad_(True)
        p = points.to(device).requires_grad_(True)
        out = integrate(p, basis.to_A(th), basis.tess, steps=23, backend="torch")
        grads = torch.autograd.grad((out * weights.to(device)).sum(), (p, th))
        sensitivity = forward_sensitivity_gradient(p.detach(), theta.to(device), basis, weights.to(device), steps=23)
        results.append([t.cpu() for t in (out, *grads, sensitivity)])
    for cpu, cuda in zip(*results, strict=True):
        torch.testing.assert_close(cuda, cpu, rtol=1e-10, atol=1e-10)

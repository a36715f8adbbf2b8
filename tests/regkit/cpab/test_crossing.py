"""regkit.cpab.crossing: the in-cell flow's Taylor polynomial, facet hit times, and the closed-form piece adjoint."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from regkit.cpab.crossing import (
    MAX_DEGREE,
    TAYLOR_TOLERANCE,
    barycentric,
    evaluate,
    flow_coefficients,
    hit_times,
    linear_norm,
    piece_jacobian,
    piece_jvp,
    piece_vjp,
    taylor_degree,
)
from regkit.cpab.tessellation import Tessellation

F64 = torch.float64


def _pieces(n: int, count: int = 9, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(count, n, n + 1, generator=gen, dtype=F64)
    x = torch.rand(count, n, generator=gen, dtype=F64)
    tau = 0.6 * torch.rand(count, generator=gen, dtype=F64)
    return A, x, tau


def test_taylor_degree_bounds_the_first_dropped_term() -> None:
    for dtype, tol in TAYLOR_TOLERANCE.items():
        for rho in (0.0, 0.1, 1.0, 3.0):
            K = taylor_degree(rho, dtype)
            term = rho ** (K + 1) / torch.arange(1, K + 2, dtype=F64).prod().item()
            assert term <= tol
    assert taylor_degree(1e3, F64) == MAX_DEGREE


@pytest.mark.parametrize("n", [2, 3])
def test_polynomial_is_the_matrix_exponential(n: int) -> None:
    A, x, tau = _pieces(n)
    degree = taylor_degree(float((tau * linear_norm(A)).max()), F64)
    y = evaluate(flow_coefficients(A, x, degree), tau)
    square = torch.cat([A, torch.zeros(len(A), 1, n + 1, dtype=F64)], 1)
    expm = torch.from_numpy(
        np.stack([scipy.linalg.expm(float(t) * m.numpy()) for m, t in zip(square, tau, strict=True)])
    )
    expected = (expm[:, :n, :n] @ x.unsqueeze(-1)).squeeze(-1) + expm[:, :n, n]
    torch.testing.assert_close(y, expected, rtol=1e-14, atol=1e-14)
    J = piece_jacobian(A, tau, torch.eye(n, dtype=F64).expand(len(tau), n, n), degree)
    torch.testing.assert_close(J, expm[:, :n, :n], rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("n", [2, 3])
def test_piece_adjoint_and_tangent_equal_autograd(n: int) -> None:
    A, x, tau = _pieces(n, seed=1)
    degree = 9  # any degree: the closed forms differentiate the polynomial of that degree
    lam = torch.randn_like(x)
    A_, x_ = A.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y = evaluate(flow_coefficients(A_, x_, degree), tau)
    grad_x, grad_A = torch.autograd.grad((y * lam).sum(), (x_, A_))
    closed_x, closed_A = piece_vjp(A, x, tau, lam, degree)
    torch.testing.assert_close(closed_x, grad_x, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(closed_A, grad_A, rtol=1e-13, atol=1e-13)
    dA = torch.randn(4, *A.shape, dtype=F64)
    tangent = torch.stack(
        [torch.func.jvp(lambda a: evaluate(flow_coefficients(a, x, degree), tau), (A,), (d,))[1] for d in dA]
    )
    torch.testing.assert_close(piece_jvp(A, x, tau, dA, degree), tangent, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("shape", [(2, 2), (2, 2, 2)])
def test_hit_times_land_on_the_first_facet_left(shape: tuple[int, ...]) -> None:
    tess = Tessellation(shape)
    n = tess.ndim
    planes, _ = tess.facet_planes()
    gen = torch.Generator().manual_seed(2)
    cells = torch.arange(tess.n_cells)
    x = tess.centers()
    A = torch.randn(tess.n_cells, n, n + 1, generator=gen, dtype=F64)
    left = torch.full((tess.n_cells,), 1.0, dtype=F64)
    q = flow_coefficients(A, x, taylor_degree(float(linear_norm(A).max()), F64))
    leaving = barycentric(planes[cells], evaluate(q, left)) < 0
    tau, facet = hit_times(q, planes[cells], leaving, left)
    hit = leaving.any(-1)
    assert hit.sum() > tess.n_cells // 2 and torch.isinf(tau[~hit]).all()
    at_hit = barycentric(planes[cells[hit]], evaluate(q[:, hit], tau[hit]))
    on_facet = at_hit.gather(1, facet[hit, None]).squeeze(1)
    torch.testing.assert_close(on_facet, torch.zeros_like(on_facet), rtol=0, atol=1e-13)
    # the first of the facets left: none of them was crossed earlier (on a fine time grid)
    grid = torch.linspace(0, 1, 200, dtype=F64)[:-1]
    along = torch.stack([barycentric(planes[cells[hit]], evaluate(q[:, hit], g * tau[hit])) for g in grid])
    assert (along[:, leaving[hit]] > -1e-12).all()


def test_piece_adjoint_is_finite_in_float32_at_high_degree() -> None:
    A = torch.zeros(1, 2, 3)
    A[0, 0, 0] = A[0, 1, 1] = 40.0
    grad_x, grad_A = piece_vjp(A, torch.ones(1, 2), torch.tensor([0.01]), torch.ones(1, 2), 40)
    assert grad_x.dtype == torch.float32 and torch.isfinite(grad_x).all() and torch.isfinite(grad_A).all()
    torch.testing.assert_close(grad_x, torch.full((1, 2), float(torch.tensor(0.4).exp())))

"""The numba CPAB kernels (the CPU's ``"numba"`` backend) against the PyTorch paths: end points bit-equal to the
reference scheme from the same step matrices, step matrices and their adjoint equal to ``torch.linalg.matrix_exp``'s,
point and theta gradients equal to the reference's, 2D and 3D, float32 and float64, every boundary mode, batches,
shared points, points on vertices, facets and outside the domain."""

import pytest
import torch

pytest.importorskip("numba")

from regkit.cpab import CPAB
from regkit.cpab.basis import BOUNDARY_MODES
from regkit.cpab.integrate import integrate, integrate_reference
from regkit.cpab.scheme import step_matrices, step_matrices_vjp
from regkit.cpab.tessellation import Tessellation
from regkit_kernels.numba import cpab as cpab_numba
from tests.helpers import assert_relative_close, relative_tolerance
from tests.regkit_kernels.cpab_cases import TESSELLATIONS, awkward_points, case


def _tol(dtype: torch.dtype) -> float:
    """Largest |numba - reference| of a gradient relative to the largest |reference|, from the same step matrices:
    the shared tolerance, ten times tighter in float32, since the paths differ only in the order in which the moments
    are summed (in float64 here, in the points' dtype there)."""
    return relative_tolerance(dtype, tighter=10.0 if dtype == torch.float32 else 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ndim,which", [(2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (3, 2)])
def test_forward_is_bit_equal_to_the_reference_from_the_same_step_matrices(ndim, which, dtype):
    basis, theta, points = case(ndim, which, "zero", dtype)
    A = basis.to_A(theta)
    E = step_matrices(A, 1.0 / 9)
    out = cpab_numba.integrate_forward(points, E, basis.tess, 9)
    assert torch.equal(out, integrate_reference(points, A, basis.tess, steps=9))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ndim", [2, 3])
def test_step_matrices_and_their_adjoint_equal_matrix_exp(ndim, dtype):
    torch.manual_seed(ndim)
    # from tiny to large norms: no squaring up to several squarings
    A = (
        torch.randn(300, ndim, ndim + 1, dtype=torch.float64)
        * torch.logspace(-3, 1.5, 300, dtype=torch.float64)[:, None, None]
    )
    A = A.to(dtype)
    truth_A = A.double().requires_grad_(True)  # float64 matrix_exp: float32's own error grows with the norm
    h = 0.7
    reference = step_matrices(truth_A, h)
    E = cpab_numba.step_matrices(A, h)
    assert E.dtype == dtype
    scale = reference.detach().abs().amax((-2, -1), keepdim=True)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    assert ((E - reference.detach()).abs() / scale).max() < tol
    grad_E = torch.randn_like(reference)
    (expected,) = torch.autograd.grad(reference, truth_A, grad_E)
    got = cpab_numba.step_matrices_vjp(A, h, grad_E.to(dtype))
    scale = expected.abs().amax((-2, -1), keepdim=True)
    assert ((got - expected).abs() / scale).max() < (1e-5 if dtype == torch.float32 else 1e-11)


@pytest.fixture
def same_step_matrices(monkeypatch):
    """The numba path with PyTorch's step matrices (``torch.linalg.matrix_exp``) and their autograd adjoint instead of
    its own, so that both paths step with bit-equal ``E``, visit the same cells and can be compared tightly (points on
    facets included, where one ulp of ``E`` can change a cell and with it the discontinuous point Jacobian; these
    tests' large velocities also make the flows expand, which magnifies any difference, and float32 matrix_exp's own
    adjoint error). The numba step matrices and adjoint are tested on their own above and in
    ``test_own_step_matrices_on_moderate_velocities``."""
    monkeypatch.setattr(cpab_numba, "step_matrices", lambda A, h: step_matrices(A.detach(), h))
    monkeypatch.setattr(cpab_numba, "step_matrices_vjp", step_matrices_vjp)


def _gradients(points, theta, basis, grad, backend, steps):
    points = points.detach().requires_grad_(True)
    theta = theta.detach().requires_grad_(True)
    out = integrate(points, basis.to_A(theta), basis.tess, steps=steps, backend=backend)
    return (out, *torch.autograd.grad(out, (points, theta), grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("boundary", BOUNDARY_MODES)
@pytest.mark.parametrize("ndim", [2, 3])
def test_gradients_equal_the_reference(ndim, boundary, dtype, same_step_matrices):
    basis, theta, points = case(ndim, 2, boundary, dtype)
    grad = torch.randn_like(points)
    out, grad_points, grad_theta = _gradients(points, theta, basis, grad, "numba", 7)
    ref, ref_points, ref_theta = _gradients(points, theta, basis, grad, "reference", 7)
    assert torch.equal(out, ref)
    assert_relative_close(grad_points, ref_points, _tol(dtype), "dL/dpoints")
    assert_relative_close(grad_theta, ref_theta, _tol(dtype), "dL/dtheta")


@pytest.mark.parametrize("ndim", [2, 3])
def test_own_step_matrices_on_moderate_velocities(ndim):
    """The whole numba path (its own step matrices) against the reference, float64, velocities of a few cells."""
    basis, theta, points = case(ndim, 0, "zero", torch.float64)
    theta = 0.1 * theta
    grad = torch.randn_like(points)
    out, grad_points, grad_theta = _gradients(points, theta, basis, grad, "numba", 7)
    ref, ref_points, ref_theta = _gradients(points, theta, basis, grad, "reference", 7)
    same = (grad_points - ref_points).abs().amax(-1) <= 1e-9 * ref_points.abs().max()
    assert same.float().mean() > 0.97  # the others start on facets and took the neighbouring cell
    assert_relative_close(out[same], ref[same], 1e-12)
    assert_relative_close(grad_theta, ref_theta, 1e-6)


@pytest.mark.parametrize("ndim", [2, 3])
def test_shared_points_batches_and_partial_gradients(ndim, same_step_matrices):
    """Points shared by the batch (a stride-0 broadcast) get the batch's summed gradient; a gradient asked for one
    input alone (points or theta) equals that part of the full one."""
    basis, theta, points = case(ndim, 2, "zero", torch.float64, batch=3)
    shared = points[0].clone().requires_grad_(True)
    th = theta.clone().requires_grad_(True)
    grad = torch.randn(3, *shared.shape, dtype=torch.float64)
    out = integrate(shared, basis.to_A(th), basis.tess, steps=5, backend="numba")
    ref = integrate(shared, basis.to_A(th), basis.tess, steps=5, backend="reference")
    assert torch.equal(out, ref)
    g_points, g_theta = torch.autograd.grad(out, (shared, th), grad)
    r_points, r_theta = torch.autograd.grad(ref, (shared, th), grad)
    assert_relative_close(g_points, r_points, 1e-12)
    assert_relative_close(g_theta, r_theta, 1e-11)
    only_theta = integrate(shared.detach(), basis.to_A(th), basis.tess, steps=5, backend="numba")
    assert_relative_close(torch.autograd.grad(only_theta, th, grad)[0], g_theta, 1e-14)


def test_unbatched_module_path_and_nan_points():
    """Through ``CPAB`` on one transformation: the numba and reference backends agree; a NaN coordinate is treated as
    the box's lower bound by the cell lookup, so it integrates without error and stays NaN."""
    tess_shape, _, _ = TESSELLATIONS[3][0]
    flow = CPAB(Tessellation(tess_shape), steps=6, backend="numba").double()
    with torch.no_grad():
        flow.theta.normal_(0.0, 0.5)
    points = awkward_points(flow.tess, 50, 1, torch.float64, "cpu")[0]
    points[0, 1] = float("nan")
    out = flow.transform_points(points)
    reference = CPAB(Tessellation(tess_shape), steps=6, backend="reference").double()
    reference.load_state_dict(flow.state_dict())
    expected = reference.transform_points(points)
    assert torch.isnan(out[0]).any() and torch.isnan(expected[0]).any()
    assert torch.allclose(out[1:], expected[1:], rtol=0, atol=1e-12)


@pytest.mark.parametrize("ndim", [2, 3])
def test_points_and_cells_without_gradient_are_skipped_exactly(ndim, same_step_matrices):
    """Points whose dL/dx_T is zero (a registration's background) and cells no such point visits contribute exactly
    zero; skipping them gives the reference's gradients."""
    basis, theta, points = case(ndim, 2, "zero", torch.float64)
    grad = torch.randn_like(points)
    grad[:, ::3] = 0.0
    grad[:, : points.shape[1] // 2] = 0.0
    _, grad_points, grad_theta = _gradients(points, theta, basis, grad, "numba", 5)
    _, ref_points, ref_theta = _gradients(points, theta, basis, grad, "reference", 5)
    assert torch.equal(grad_points[grad.abs().sum(-1) == 0], torch.zeros_like(grad_points[grad.abs().sum(-1) == 0]))
    assert_relative_close(grad_points, ref_points, _tol(torch.float64), "dL/dpoints")
    assert_relative_close(grad_theta, ref_theta, _tol(torch.float64), "dL/dtheta")


@pytest.mark.parametrize("ndim", [2, 3])
def test_more_threads_split_the_work_without_changing_the_results(ndim, monkeypatch):
    """The kernels' loops split over threads (``regkit_kernels.numba.threads.parallel_for``; the suite runs one thread):
    end points, point gradients and step matrices are bit-equal to one thread's, the theta gradient (per-thread
    moment tables, summed at the end) equal up to rounding."""
    basis, theta, points = case(ndim, 2, "zero", torch.float64, n_random=6000)
    grad = torch.randn_like(points)
    results = []
    for threads in (1, 2):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        E = cpab_numba.step_matrices(basis.to_A(theta), 0.2)
        results.append((E, *_gradients(points, theta, basis, grad, "numba", 5)))
    (E1, out1, points1, theta1), (E2, out2, points2, theta2) = results
    assert torch.equal(E1, E2) and torch.equal(out1, out2) and torch.equal(points1, points2)
    assert_relative_close(theta2, theta1, 1e-13)

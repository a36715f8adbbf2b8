"""The numba CPAB kernels (the CPU's ``"numba"`` backend) against the PyTorch spec of the facet-resolved expm-step
scheme (``regkit.cpab.scheme``): regular steps bit-equal to the spec's from the same step matrices, steps in pieces
(facet crossings) equal to rounding, step matrices and their adjoint equal to ``torch.linalg.matrix_exp``'s, point,
A and theta gradients equal to the factorized torch adjoint's and to unrolled autograd's; 2D and 3D, float32 and
float64, every boundary mode, batches, shared points, points on vertices, facets, outside the domain and NaN; a
gradcheck, the inverse flow and thread splitting."""

import pytest
import torch

pytest.importorskip("numba")

from regkit.cpab import CPAB, crossing, scheme
from regkit.cpab.basis import BOUNDARY_MODES, CPABasis, cpa_basis
from regkit.cpab.integrate import count_crossings, integrate, integrate_reference
from regkit.cpab.scheme import step_matrices, step_matrices_vjp, take_step
from regkit.cpab.tessellation import Tessellation
from regkit_kernels.numba import cpab as cpab_numba
from tests.helpers import assert_relative_close, relative_tolerance
from tests.regkit_kernels.cpab_cases import TESSELLATIONS, awkward_points, case

F64 = torch.float64


def _tol(dtype: torch.dtype) -> float:
    """Largest |numba - reference| of a gradient relative to the largest |reference|, from the same step matrices:
    the shared tolerance, ten times tighter in float32, since the paths differ only in the order in which sums are
    taken (the moments and the pieces' dL/dA in float64 here, in the points' dtype there) and in the pieces' rounding
    (their own Taylor degrees, the adjoint by reverse mode instead of the closed form)."""
    return relative_tolerance(dtype, tighter=10.0 if dtype == torch.float32 else 1.0)


def _regular(points: torch.Tensor, A: torch.Tensor, tess: Tessellation, steps: int) -> torch.Tensor:
    """``(B, N)`` bool: the points whose every step of the spec is a regular step (no facet crossed)."""
    h = 1.0 / steps
    E = step_matrices(A, h)
    x, regular = points, torch.ones(points.shape[:2], dtype=torch.bool)
    with torch.no_grad():
        for _ in range(steps):
            x, step = take_step(E, A, x, tess, h)
            regular &= step.regular
    return regular


def test_constants_are_those_of_the_spec() -> None:
    assert cpab_numba.MAX_CROSSINGS == scheme.MAX_CROSSINGS
    assert cpab_numba.MAX_DEGREE == crossing.MAX_DEGREE
    assert cpab_numba.NEWTON_ITERATIONS == crossing.NEWTON_ITERATIONS
    assert cpab_numba.TAYLOR_TOLERANCE == crossing.TAYLOR_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("ndim,which", [(2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (3, 2)])
def test_forward_equals_the_spec_from_the_same_step_matrices(ndim, which, dtype):
    """Trajectories of regular steps only are bit-equal to the spec's; the others (in pieces) equal to rounding."""
    basis, theta, points = case(ndim, which, "zero", dtype)
    A = basis.to_A(theta)
    out = cpab_numba.integrate_forward(points, A, step_matrices(A, 1.0 / 9), basis.tess, 1.0 / 9, 9)
    ref = integrate_reference(points, A, basis.tess, steps=9)
    regular = _regular(points, A, basis.tess, 9)
    assert regular.float().mean() > 0.5 and not regular.all()
    assert torch.equal(out[regular], ref[regular])
    assert_relative_close(out, ref, 1e-5 if dtype == torch.float32 else 1e-14)


def _crossing_case(ndim: int, dtype: torch.dtype) -> tuple[CPABasis, torch.Tensor, torch.Tensor]:
    """A basis on a 4^2 or 3^3 tessellation of an odd box, large velocities (points cross several facets in a step,
    some ``MAX_CROSSINGS``), ``awkward_points`` (some start outside the box), two of them NaN."""
    torch.manual_seed(ndim)
    shape = (4, 4) if ndim == 2 else (3, 3, 3)
    tess = Tessellation(shape, (-1.0,) * ndim, (0.5,) * ndim)
    basis = cpa_basis(tess, "zero")
    theta = (8.0 * torch.randn(2, basis.d, dtype=F64)).to(dtype)
    points = awkward_points(tess, 300, 2, dtype, "cpu")
    points[0, 3, 1] = float("nan")
    points[1, -1] = float("nan")
    return basis, theta, points


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("ndim", [2, 3])
def test_forward_matches_the_spec_across_many_facets(ndim, dtype):
    """One or two steps of large velocities: a facet crossed per point and step on average, some steps stopped by
    ``MAX_CROSSINGS``; NaN points stay NaN, points outside the box take regular steps."""
    basis, theta, points = _crossing_case(ndim, dtype)
    A = basis.to_A(theta)
    _, step = take_step(step_matrices(A, 1.0), A, points, basis.tess, 1.0)
    assert len(step.pieces) == cpab_numba.MAX_CROSSINGS + 1  # some points took the last round of pieces
    for steps in (1, 2):
        assert count_crossings(points, A, basis.tess, steps=steps) > points.shape[0] * points.shape[1]
        out = integrate(points, A, basis.tess, steps=steps, backend="numba")
        ref = integrate(points, A, basis.tess, steps=steps, backend="torch")
        nan = ref.isnan().any(-1)
        assert torch.equal(out.isnan().any(-1), nan) and nan.sum() == 2
        assert_relative_close(out[~nan], ref[~nan], 1e-5 if dtype == torch.float32 else 1e-12)


@pytest.fixture
def same_step_matrices(monkeypatch):
    """The numba path with PyTorch's step matrices (``torch.linalg.matrix_exp``) and their autograd adjoint instead of
    its own, so that both paths step with bit-equal ``E``, visit the same cells and can be compared tightly (points on
    facets included, where one ulp of ``E`` can change a cell; these tests' large velocities also make the flows
    expand, which magnifies any difference, and float32 matrix_exp's own adjoint error). The numba step matrices and
    adjoint are tested on their own in ``test_step_matrices_and_their_adjoint_equal_matrix_exp`` and
    ``test_own_step_matrices_on_moderate_velocities``."""
    monkeypatch.setattr(cpab_numba, "step_matrices", lambda A, h: step_matrices(A.detach(), h))
    monkeypatch.setattr(cpab_numba, "step_matrices_vjp", step_matrices_vjp)


def _gradients(points, theta, basis, grad, backend, steps):
    points = points.detach().requires_grad_(True)
    theta = theta.detach().requires_grad_(True)
    out = integrate(points, basis.to_A(theta), basis.tess, steps=steps, backend=backend)
    return (out, *torch.autograd.grad(out, (points, theta), grad))


def _reference(points, theta, basis, grad, steps, out, tol):
    """Unrolled autograd through the spec (``backend="reference"``): end points, dL/dpoints and dL/dtheta for
    ``L = sum(grad * end)``, with the few points whose end differs from ``out`` (the numba face's) by more than ``tol``
    (relative) taken again one at a time. The spec sums each round of pieces to the largest Taylor degree a piece of
    the round needs, so a point whose flow runs along a facet can decide a crossing otherwise within a batch than on
    its own, by more than rounding; the numba face takes each piece's own degree, as the spec does for a point alone."""
    apart = (out - integrate_reference(points, basis.to_A(theta), basis.tess, steps=steps)).abs().amax(-1)
    apart = apart > tol * out.abs().max()
    assert apart.float().mean() < 0.02
    together = torch.where(apart.unsqueeze(-1), torch.zeros_like(grad), grad)
    ref, ref_points, ref_theta = (r.clone() for r in _gradients(points, theta, basis, together, "reference", steps))
    for b, p in apart.nonzero().tolist():
        alone = _gradients(
            points[b : b + 1, p : p + 1], theta[b : b + 1], basis, grad[b : b + 1, p : p + 1], "reference", steps
        )
        ref[b, p], ref_points[b, p] = alone[0][0, 0], alone[1][0, 0]
        ref_theta[b] += alone[2][0]
    return ref, ref_points, ref_theta


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("boundary", BOUNDARY_MODES)
@pytest.mark.parametrize("ndim", [2, 3])
def test_gradients_equal_the_reference(ndim, boundary, dtype, same_step_matrices):
    basis, theta, points = case(ndim, 2, boundary, dtype)
    grad = torch.randn_like(points)
    out, grad_points, grad_theta = _gradients(points, theta, basis, grad, "numba", 7)
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    ref, ref_points, ref_theta = _reference(points, theta, basis, grad, 7, out, tol)
    assert_relative_close(out, ref, tol, "points")
    assert_relative_close(grad_points, ref_points, _tol(dtype), "dL/dpoints")
    assert_relative_close(grad_theta, ref_theta, _tol(dtype), "dL/dtheta")


@pytest.mark.parametrize("ndim", [2, 3])
def test_point_A_and_theta_gradients_across_many_facets_equal_the_torch_adjoint(ndim, same_step_matrices):
    """float64, steps in pieces almost everywhere: dL/dpoints, dL/dA (A a leaf) and dL/dtheta (through
    ``basis.to_A``) equal the factorized torch adjoint's (``integrate(..., backend="torch")``)."""
    basis, theta, points = _crossing_case(ndim, F64)
    points = points[:, :-1]  # no NaN: its gradient would spread NaN over its cells' dL/dA
    points[0, 3, 1] = 0.0
    grad = torch.randn_like(points)
    results = {}
    for backend in ("numba", "torch"):
        A = basis.to_A(theta).detach().requires_grad_(True)
        p = points.clone().requires_grad_(True)
        grad_points, grad_A = torch.autograd.grad(integrate(p, A, basis.tess, steps=2, backend=backend), (p, A), grad)
        results[backend] = (grad_points, grad_A, _gradients(points, theta, basis, grad, backend, 2)[2])
    for got, want, name in zip(results["numba"], results["torch"], ("dL/dpoints", "dL/dA", "dL/dtheta"), strict=True):
        assert_relative_close(got, want, 1e-10, name)


@pytest.mark.parametrize("ndim", [2, 3])
def test_gradcheck_across_facets(ndim):
    """float64 ``gradcheck`` of the whole numba face (its own step matrices and their adjoint) in theta, 2 steps,
    trajectories that cross facets: the gradient with the cells and hit times fixed is the flow's gradient."""
    torch.manual_seed(10 + ndim)
    basis = cpa_basis(Tessellation((3, 2) if ndim == 2 else (2, 2, 3)), "zero")
    theta = 3.0 * torch.randn(basis.d, dtype=F64)
    points = 0.1 + 0.8 * torch.rand(8, ndim, dtype=F64)
    assert count_crossings(points, basis.to_A(theta), basis.tess, steps=2) >= 4

    def flow(th: torch.Tensor) -> torch.Tensor:
        return integrate(points, basis.to_A(th), basis.tess, steps=2, backend="numba")

    assert torch.autograd.gradcheck(flow, (theta.requires_grad_(True),), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("ndim", [2, 3])
def test_the_flow_of_minus_A_inverts_it(ndim):
    """Pieces follow the exact flow, so ``phi_{-A} o phi_A`` is the identity to rounding inside the box, for any
    number of steps."""
    torch.manual_seed(20 + ndim)
    basis = cpa_basis(Tessellation((4, 3) if ndim == 2 else (3, 3, 3)), "zero")
    A = basis.to_A(2.5 * torch.randn(basis.d, dtype=F64))
    points = torch.rand(300, ndim, dtype=F64)
    for steps in (2, 5):
        assert count_crossings(points, A, basis.tess, steps=steps) > 100
        there = integrate(points, A, basis.tess, steps=steps, backend="numba")
        back = integrate(there, -A, basis.tess, steps=steps, backend="numba")
        torch.testing.assert_close(back, points, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("ndim", [2, 3])
def test_step_matrices_and_their_adjoint_equal_matrix_exp(ndim, dtype):
    torch.manual_seed(ndim)
    # from tiny to large norms: no squaring up to several squarings
    A = torch.randn(300, ndim, ndim + 1, dtype=F64) * torch.logspace(-3, 1.5, 300, dtype=F64)[:, None, None]
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


@pytest.mark.parametrize("ndim", [2, 3])
def test_own_step_matrices_on_moderate_velocities(ndim):
    """The whole numba path (its own step matrices) against the reference, float64, velocities of a few cells."""
    basis, theta, points = case(ndim, 0, "zero", F64)
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
    basis, theta, points = case(ndim, 2, "zero", F64, batch=3)
    shared = points[0].clone().requires_grad_(True)
    th = theta.clone().requires_grad_(True)
    grad = torch.randn(3, *shared.shape, dtype=F64)
    out = integrate(shared, basis.to_A(th), basis.tess, steps=5, backend="numba")
    ref = integrate(shared, basis.to_A(th), basis.tess, steps=5, backend="reference")
    assert_relative_close(out, ref, 1e-14)
    g_points, g_theta = torch.autograd.grad(out, (shared, th), grad)
    r_points, r_theta = torch.autograd.grad(ref, (shared, th), grad)
    assert_relative_close(g_points, r_points, 1e-12)
    assert_relative_close(g_theta, r_theta, 1e-11)
    only_theta = integrate(shared.detach(), basis.to_A(th), basis.tess, steps=5, backend="numba")
    assert_relative_close(torch.autograd.grad(only_theta, th, grad)[0], g_theta, 1e-14)
    only_points = integrate(shared, basis.to_A(th).detach(), basis.tess, steps=5, backend="numba")
    assert torch.equal(torch.autograd.grad(only_points, shared, grad)[0], g_points)


def test_unbatched_module_path_and_nan_points():
    """Through ``CPAB`` on one transformation: the numba and reference backends agree; a NaN coordinate is treated as
    the box's lower bound by the cell lookup, so it integrates without error and stays NaN."""
    tess_shape, _, _ = TESSELLATIONS[3][0]
    flow = CPAB(Tessellation(tess_shape), steps=6, backend="numba").double()
    with torch.no_grad():
        flow.theta.normal_(0.0, 0.5)
    points = awkward_points(flow.tess, 50, 1, F64, "cpu")[0]
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
    basis, theta, points = case(ndim, 2, "zero", F64)
    grad = torch.randn_like(points)
    grad[:, ::3] = 0.0
    grad[:, : points.shape[1] // 2] = 0.0
    _, grad_points, grad_theta = _gradients(points, theta, basis, grad, "numba", 5)
    _, ref_points, ref_theta = _gradients(points, theta, basis, grad, "reference", 5)
    assert torch.equal(grad_points[grad.abs().sum(-1) == 0], torch.zeros_like(grad_points[grad.abs().sum(-1) == 0]))
    assert_relative_close(grad_points, ref_points, _tol(F64), "dL/dpoints")
    assert_relative_close(grad_theta, ref_theta, _tol(F64), "dL/dtheta")


@pytest.mark.parametrize("ndim", [2, 3])
def test_more_threads_split_the_work_without_changing_the_results(ndim, monkeypatch):
    """The kernels' loops split over threads (``regkit_kernels.numba.threads.parallel_for``; the suite runs one thread):
    end points, point gradients and step matrices are bit-equal to one thread's, the theta gradient (per-thread
    moment and piece tables, summed at the end) equal up to rounding; many of the steps cross facets."""
    basis, theta, points = case(ndim, 2, "zero", F64, n_random=6000)
    assert count_crossings(points, basis.to_A(theta), basis.tess, steps=5) > points.shape[1] // 2
    grad = torch.randn_like(points)
    results = []
    for threads in (1, 2):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        E = cpab_numba.step_matrices(basis.to_A(theta), 0.2)
        results.append((E, *_gradients(points, theta, basis, grad, "numba", 5)))
    (E1, out1, points1, theta1), (E2, out2, points2, theta2) = results
    assert torch.equal(E1, E2) and torch.equal(out1, out2) and torch.equal(points1, points2)
    assert_relative_close(theta2, theta1, 1e-13)

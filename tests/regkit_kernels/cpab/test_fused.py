"""Fused CPAB kernels against the PyTorch paths: end points and checkpoints bit-equal to the reference scheme (hence
the same visited cells), point and theta gradients equal to the factorized PyTorch adjoint's, 2D and 3D, float32 and
float64, every boundary mode, batches, points on vertices, facets and outside the domain.

On CPU the kernels run in Triton's interpreter (slow): tiny tessellations, a few hundred points, T <= 10, one program
per batch element. The ``gpu`` cases run realistic sizes (set REGKIT_TEST_CUDA=1 so that the conftest leaves the
interpreter off).
"""

import pytest
import torch

pytest.importorskip("triton")

from regkit.cpab.basis import BOUNDARY_MODES, cpa_basis
from regkit.cpab.integrate import integrate, integrate_reference, integrate_trajectory
from regkit.cpab.scheme import step_matrices, step_matrices_vjp
from regkit.cpab.tessellation import Tessellation
from regkit_kernels.cpab import cpab_fwd
from tests.helpers import assert_relative_close, relative_tolerance
from tests.regkit_kernels.cpab_cases import TESSELLATIONS, awkward_points, case

# Largest |triton - torch| of a float32 dL/dtheta, relative to the largest |torch| (every other gradient comparison
# holds to ``_rounding_bounds``): the shared float32 tolerance. The fused adjoint of the matrix exponential (float64
# inside) and matrix_exp's float32 autograd differ by up to ~5e-6 per matrix at the large velocities of these tests
# (torch's error; the fused one is ~1e-6), summed over cells by the basis projection. In float32 the rounding bound is
# no test: torch's adjoint squares about ||dL/dE||_1 times, and the bound reaches 10-80% of the largest dL/dtheta here.
_TOL = relative_tolerance(torch.float32)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def same_step_matrices(monkeypatch):
    """The fused path with PyTorch's step matrices (``torch.linalg.matrix_exp``) instead of its own kernel, so that
    both paths step with bit-equal ``E``, visit the same cells and can be compared bit for bit (points on facets
    included, where one ulp of ``E`` can change a cell and with it the discontinuous point Jacobian). The fused step
    matrices are tested on their own (``test_step_matrices_equal_matrix_exp``, ``test_fused_path_with_own_steps``)."""
    import regkit_kernels.cpab.ops as ops

    monkeypatch.setattr(ops, "step_matrices", step_matrices)


def _gradients(points, theta, basis, grad, backend, steps, checkpoint_every):
    points = points.detach().requires_grad_(True)
    theta = theta.detach().requires_grad_(True)
    out = integrate(
        points, basis.to_A(theta), basis.tess, t=1.0, steps=steps, backend=backend, checkpoint_every=checkpoint_every
    )
    return (out, *torch.autograd.grad(out, (points, theta), grad))


def _assert_close(got: torch.Tensor, want: torch.Tensor, name: str, tol: float = _TOL) -> None:
    assert_relative_close(got, want, tol, name)


def _rounding_bounds(points, theta, basis, grad, steps):
    """Elementwise bounds on ``|triton - torch|`` of dL/dpoints and dL/dtheta (float64 tensors shaped as they are),
    for ``theta (B, d)``, ``grad = dL/dx_T (B, N, n)``, ``t = 1`` and the same step matrices on both paths.

    Both paths visit the same cells with bit-equal ``E`` and ``x_s`` (asserted), so they differ by rounding alone, in
    sums of unspecified order: a sum of ``m`` terms in any order is within ``(m - 1) u sum |t_i|`` (``u`` the unit
    roundoff; first order in ``u`` throughout). Let ``mu_T = |grad|``, ``mu_s = |E_lin(c_s)|^T mu_{s+1}`` (the adjoint
    sweep in absolute values: ``mu_s >= |lambda_s|``) and ``S_c = sum mu_{s+1} [|x_s|; 1]^T`` over the ``N_c``
    (point, step) pairs in cell ``c``. Per path:

    * ``lambda_s = E_lin^T lambda_{s+1}``, ``n``-term dot products whose errors propagate through ``|E_lin|^T``:
      ``|error of lambda_s| <= (T - s) n u mu_s``. dL/dpoints is ``lambda_0`` (a shared point's, summed over the batch).
    * ``M_c = sum lambda_{s+1} [x_s; 1]^T``: ``|error| <= (N_c + T n) u S_c`` (the sum, the products, lambda's error).
    * ``dL/dA = L*_A(M)``, the adjoint of ``A -> E`` (``step_matrices_vjp``: ``h int e^(r X^T) M' e^((1-r) X^T) dr``
      over ``r`` in [0, 1], ``X = h [A; 0]``), is linear in ``M`` and ``|L*_A(G)| <= L*_|A|(|G|)`` entrywise, as
      ``|e^Y| <= e^|Y|``. Both paths take it by scaling and squaring: ``s`` squarings, each doubling the error
      relative to the same computation in absolute values and adding that of a ``2Q``-term product, after a
      polynomial at norm <= 1 (within ``20 u``): ``|error| <= 2^s (2 Q + 20) u L*_|A|(|M|)``. The fused kernel
      scales ``X`` alone (``2^s < 2 ||X||_inf``), the autograd of ``torch.linalg.matrix_exp`` the block matrix
      ``[[X^T, M'], [0, X^T]]`` (``2^s < 2 ||.||_1``, at most ``2 (||X||_inf + ||M||_1)``): dominated by the
      moments' size, torch's error is the larger by far.
    * ``dL/dtheta = B^T vec(dL/dA)``, at most ``K`` terms a parameter (nonzeros of a column of ``B``): the errors pass
      through ``|B|^T``, plus ``K u |B|^T |dL/dA|``.

    Twice each path's error bounds the difference (``alpha`` below, per cell; ``Q = n + 1``). It stays a test: in these
    cases a single (point, step) term missing from ``M``, or added to another cell, moves dL/dtheta by at least ~7e3
    times the bound (wherever it moves it at all: a point held by a zero or normal boundary does not).
    """
    tess, n = basis.tess, basis.tess.ndim
    u = torch.finfo(theta.dtype).eps / 2
    A = basis.to_A(theta.detach())
    x = integrate_trajectory(points.detach(), A, tess, t=1.0, steps=steps)  # (T + 1, B, N, n): the visited cells
    cells = tess.locate(x[:-1])
    A, x, h = A.double(), x.double(), 1.0 / steps
    batch, n_cells = A.shape[:2]
    abs_E = step_matrices(A, h).abs()
    mu = grad.double().abs()
    S = A.new_zeros(batch, n_cells, n * (n + 1))
    count = A.new_zeros(batch, n_cells)  # N_c
    for s in reversed(range(steps)):
        term = torch.cat([mu.unsqueeze(-1) * x[s].abs().unsqueeze(-2), mu.unsqueeze(-1)], dim=-1)
        S.scatter_add_(1, cells[s].unsqueeze(-1).expand(-1, -1, n * (n + 1)), term.flatten(-2))
        count.scatter_add_(1, cells[s], torch.ones_like(cells[s], dtype=count.dtype))
        at_cells = torch.gather(abs_E.flatten(-2), 1, cells[s].unsqueeze(-1).expand(-1, -1, n * (n + 1)))
        mu = (at_cells.view(batch, -1, n, n + 1)[..., :n] * mu.unsqueeze(-1)).sum(-2)  # |E_lin(c_s)|^T mu
    S = S.view(batch, n_cells, n, n + 1)
    abs_B = basis.matrix.to_dense().abs()  # (C n (n + 1), d)
    K = (abs_B > 0).sum(0).max().item()
    squarings = 2 * (h * A.abs().sum(-1).amax(-1) + S.sum(-2).amax(-1)).clamp_min(1.0)  # >= 2^s of both paths
    alpha = 2 * u * (count + steps * n + (2 * (n + 1) + 20) * squarings + K)
    theta_bound = step_matrices_vjp(A.abs(), h, alpha[..., None, None] * S).flatten(-3) @ abs_B
    if points.ndim == 2:  # shared points: their gradient sums the batch's
        return 2 * (steps * n + batch - 1) * u * mu.sum(0), theta_bound
    return 2 * steps * n * u * mu, theta_bound


def _assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, name: str) -> None:
    diff = (got - want).abs().double()
    worst = (diff / bound.clamp_min(torch.finfo(bound.dtype).tiny)).max().item()
    assert (diff <= bound).all(), f"{name}: |triton - torch| reaches {worst:.3g} times its rounding bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ndim,which", [(2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (3, 2)])
def test_forward_equals_reference(ndim, which, dtype):
    """End points and every checkpoint are bit-equal to the reference scheme, so every step used the same cell."""
    basis, theta, points = case(ndim, which, "free", dtype, _device())
    tess = basis.tess
    steps, every = 10, 3
    E = step_matrices(basis.to_A(theta), 1.0 / steps)
    out, checkpoints = cpab_fwd(points, E, tess, steps, every)
    trajectory = integrate_trajectory(points, basis.to_A(theta), tess, t=1.0, steps=steps)
    assert (points - trajectory[0]).abs().max() == 0
    assert torch.equal(out, integrate_reference(points, basis.to_A(theta), tess, t=1.0, steps=steps))
    assert torch.equal(checkpoints, trajectory[every:steps:every])
    assert torch.equal(out, trajectory[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("boundary", BOUNDARY_MODES)
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.usefixtures("same_step_matrices")
def test_gradients_equal_factorized_torch(ndim, boundary, dtype):
    """Values, dL/dpoints and dL/dtheta of integrate(backend="triton") equal those of backend="torch"."""
    basis, theta, points = case(ndim, 1 if boundary == "normal" else 0, boundary, dtype, _device())
    grad = torch.randn(points.shape, dtype=dtype, device=points.device)
    want = _gradients(points, theta, basis, grad, "torch", 10, 4)
    got = _gradients(points, theta, basis, grad, "triton", 10, 4)
    points_bound, theta_bound = _rounding_bounds(points, theta, basis, grad, 10)
    assert torch.equal(got[0], want[0])
    _assert_within(got[1], want[1], points_bound, "dL/dpoints")
    if dtype == torch.float64:
        _assert_within(got[2], want[2], theta_bound, "dL/dtheta")
    else:
        _assert_close(got[2], want[2], "dL/dtheta")


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("sort", [False, True])
@pytest.mark.usefixtures("same_step_matrices")
def test_shared_points_and_partial_gradients(ndim, sort, monkeypatch):
    """Unbatched points shared by a batch of theta (a stride-0 batch), segments longer than the run, and each
    gradient alone; with ``sort``, the kernels take the points in the order of their starting cells."""
    import regkit_kernels.cpab.ops as ops

    monkeypatch.setattr(ops, "SORT_MIN", 0 if sort else 1 << 30)
    basis, theta, points = case(ndim, 1, "free", torch.float64, _device(), n_random=100, batch=3)
    order = ops.point_order(points[0].expand(3, -1, -1), basis.tess)
    assert (order is not None) == sort
    if sort:
        assert not torch.equal(order.long(), torch.arange(len(order)))
        assert torch.equal(order.long().sort().values, torch.arange(len(order)))
    shared = points[0]
    grad = torch.randn(3, *shared.shape, dtype=torch.float64)
    want = _gradients(shared, theta, basis, grad, "torch", 5, 8)
    got = _gradients(shared, theta, basis, grad, "triton", 5, 8)
    points_bound, theta_bound = _rounding_bounds(shared, theta, basis, grad, 5)
    assert torch.equal(got[0], want[0])
    _assert_within(got[1], want[1], points_bound, "dL/dpoints")
    _assert_within(got[2], want[2], theta_bound, "dL/dtheta")
    A = basis.to_A(theta)
    p = shared.detach().requires_grad_(True)
    (only_points,) = torch.autograd.grad(integrate(p, A, basis.tess, steps=5, backend="triton"), p, grad)
    _assert_within(only_points, want[1], points_bound, "dL/dpoints alone")
    th = theta.detach().requires_grad_(True)
    out = integrate(shared, basis.to_A(th), basis.tess, steps=5, backend="triton")
    (only_theta,) = torch.autograd.grad(out, th, grad)
    _assert_within(only_theta, want[2], theta_bound, "dL/dtheta alone")


@pytest.mark.parametrize("ndim,which", [(2, 1), (2, 2), (3, 2)])
@pytest.mark.parametrize("every", [8, 10, 25])
@pytest.mark.usefixtures("same_step_matrices")
def test_long_checkpoint_spacing(ndim, which, every):
    """Stored segments longer than the backward kernel's unrolled sub-segments (10 steps: checkpoints every 8 steps,
    one stored segment of 10, none stored): the register checkpoints give the same gradients."""
    basis, theta, points = case(ndim, which, "zero", torch.float64, _device(), n_random=100)
    grad = torch.randn(points.shape, dtype=torch.float64)
    want = _gradients(points, theta, basis, grad, "torch", 10, 4)
    got = _gradients(points, theta, basis, grad, "triton", 10, every)
    points_bound, theta_bound = _rounding_bounds(points, theta, basis, grad, 10)
    assert torch.equal(got[0], want[0])
    _assert_within(got[1], want[1], points_bound, "dL/dpoints")
    _assert_within(got[2], want[2], theta_bound, "dL/dtheta")


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.usefixtures("same_step_matrices")
def test_flush_skip(ndim, monkeypatch):
    """A slow flow in programs of 16 points, so that at most steps no point of a program changes cell (and at some one
    does): the backward kernel that skips the moment flush program-wide at those steps (``UNIFORM``) gives the same
    gradients as the one that flushes at every step (bit-equal in the interpreter, where the atomics add in order),
    equal to the torch path's."""
    import regkit_kernels.cpab.ops as ops

    monkeypatch.setattr(ops, "INTERPRETER_BLOCK", 16)
    basis, theta, _ = case(ndim, 0, "zero", torch.float64, _device())
    theta = (0.2 if ndim == 2 else 1.0) * theta
    torch.manual_seed(ndim)
    points = torch.rand(2, 48, ndim, dtype=torch.float64, device=theta.device)
    steps = 10
    cells = basis.tess.locate(integrate_trajectory(points, basis.to_A(theta), basis.tess, t=1.0, steps=steps))
    changed = (cells[1:] != cells[:-1]).reshape(steps, 2, 3, 16).any(-1)  # per step, batch element and program
    assert changed.any() and not changed.all()
    grad = torch.randn(points.shape, dtype=torch.float64, device=theta.device)
    want = _gradients(points, theta, basis, grad, "torch", steps, 4)
    results = []
    for uniform in (False, True):
        monkeypatch.setattr(ops, "UNIFORM", uniform)
        results.append(_gradients(points, theta, basis, grad, "triton", steps, steps))
    flushing, skipping = results
    points_bound, theta_bound = _rounding_bounds(points, theta, basis, grad, steps)
    assert torch.equal(skipping[0], want[0]) and torch.equal(skipping[1], flushing[1])
    if points.is_cuda:  # the moments' float atomics add in another order
        _assert_within(skipping[2], flushing[2], theta_bound, "dL/dtheta")
    else:
        assert torch.equal(skipping[2], flushing[2])
    _assert_within(skipping[1], want[1], points_bound, "dL/dpoints")
    _assert_within(skipping[2], want[2], theta_bound, "dL/dtheta")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "ndim,shape,batch,every,shared",
    [
        (2, (16, 16), 4, 5, False),
        (2, (16, 16), 4, 5, True),
        (2, (5, 7), 2, 50, False),
        (3, (8, 8, 8), 2, 5, True),
        (3, (8, 8, 8), 2, 50, False),
        (3, (3, 4, 5), 2, 8, False),
    ],
)
@pytest.mark.usefixtures("same_step_matrices")
def test_realistic_sizes_gpu(ndim, shape, batch, every, shared):
    """Realistic sizes on the GPU: end points equal the reference, gradients equal the torch path's (float32), and two
    runs give gradients equal up to the reordering of float atomics; every output element is written. Checkpoints
    every 5 steps, every 8 and none (every 50 of 50 steps); points of their own per batch element, or shared (then the
    kernels take them sorted by cell)."""
    torch.manual_seed(sum(shape))
    tess = Tessellation(shape, (-1.0,) * ndim, (2.0,) * ndim)
    basis = cpa_basis(tess, "zero")
    theta = 3.0 * torch.randn(batch, basis.d, device="cuda")
    points = awkward_points(tess, 50_000, batch, torch.float32, "cuda")
    points = points[0] if shared else points
    grad = torch.randn(batch, *points.shape[-2:], device="cuda")
    want = _gradients(points, theta, basis, grad, "torch", 50, 5)
    got = _gradients(points, theta, basis, grad, "triton", 50, every)
    again = _gradients(points, theta, basis, grad, "triton", 50, every)
    assert torch.equal(got[0], want[0])
    assert all(torch.isfinite(g).all() for g in got)
    # theta's gradient sums 50 steps x 50k points per cell in float32, in another order (atomics): measured on the
    # H200, 3e-5 relative at 16x16 cells; 2e-4 bounds that reordering, far below any real error.
    _assert_close(got[1], want[1], "dL/dpoints")
    for name, g, a in zip(("dL/dpoints", "dL/dtheta"), got[1:], again[1:], strict=True):
        _assert_close(a, g, f"{name} (second run)", tol=2e-4)
    # dL/dtheta against the torch path: at these large velocities its float32 adjoint of the matrix exponential is off
    # by up to 2e-3 (measured on the H200), the fused one (float64 inside) much less. So both are held against the
    # float64 torch path: the fused gradient must be at least as close to it as the float32 torch gradient.
    truth = _gradients(points.double(), theta.double(), basis, grad.double(), "torch", 50, 5)[2]
    scale = truth.abs().max().item()
    fused_error = (got[2].double() - truth).abs().max().item() / scale
    torch_error = (want[2].double() - truth).abs().max().item() / scale
    assert fused_error <= max(1.5 * torch_error, 1e-4), f"dL/dtheta: fused {fused_error:.2e}, torch {torch_error:.2e}"


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.usefixtures("same_step_matrices")
def test_several_programs_per_batch_element(ndim, monkeypatch):
    """Blocks smaller than the point count (as on the GPU): every program writes its own points and moments."""
    import regkit_kernels.cpab.ops as ops

    monkeypatch.setattr(ops, "INTERPRETER_BLOCK", 64)
    basis, theta, points = case(ndim, 0, "normal", torch.float64, _device(), n_random=150)
    grad = torch.randn(points.shape, dtype=torch.float64)
    want = _gradients(points, theta, basis, grad, "torch", 6, 4)
    got = _gradients(points, theta, basis, grad, "triton", 6, 4)
    points_bound, theta_bound = _rounding_bounds(points, theta, basis, grad, 6)
    assert torch.equal(got[0], want[0])
    _assert_within(got[1], want[1], points_bound, "dL/dpoints")
    _assert_within(got[2], want[2], theta_bound, "dL/dtheta")


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("boundary", BOUNDARY_MODES)
@pytest.mark.parametrize("ndim", [2, 3])
def test_cell_velocities_equal_to_A(ndim, boundary, batched):
    """The fused basis map and its adjoint against ``CPABasis.to_A`` and its autograd (float64; float32 to rounding),
    on the odd boxes of ``cpab_cases``, batched and not."""
    from regkit_kernels.cpab import cell_velocities

    for which in range(len(TESSELLATIONS[ndim])):
        basis, theta, _ = case(ndim, which, boundary, torch.float64, _device())
        theta = theta if batched else theta[0]
        grad = torch.randn((*theta.shape[:-1], basis.tess.n_cells, ndim, ndim + 1), dtype=torch.float64)
        grad = grad.to(theta.device)
        for dtype, tol in ((torch.float64, 1e-13), (torch.float32, 1e-6)):
            th = theta.to(dtype).requires_grad_(True)
            want = basis.to_A(th)
            (want_grad,) = torch.autograd.grad(want, th, grad.to(dtype))
            th = theta.to(dtype).requires_grad_(True)
            got = cell_velocities(basis, th)
            (got_grad,) = torch.autograd.grad(got, th, grad.to(dtype))
            assert got.shape == want.shape and got_grad.shape == want_grad.shape
            _assert_close(got, want, "A", tol)
            if basis.d:  # 3D zero boundary on one cube: no parameters
                _assert_close(got_grad, want_grad, "dL/dtheta", tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ndim", [2, 3])
def test_step_matrices_equal_matrix_exp(ndim, dtype):
    """The fused step matrices and their adjoint against ``torch.linalg.matrix_exp`` and its autograd, for velocities
    from 1e-3 to 3e2 (no to many squarings), zero matrices, more matrices than one program takes, and a NaN matrix
    (NaN out, the others untouched, and no endless squaring)."""
    from regkit_kernels.cpab import step_matrices as fused
    from regkit_kernels.cpab import step_matrices_vjp as fused_vjp

    torch.manual_seed(ndim)
    A = torch.randn(3, 13, ndim, ndim + 1, dtype=dtype) * torch.logspace(-3, 2.5, 13, dtype=dtype)[:, None, None]
    A[1, 0] = 0.0
    A[2, 1, 0, 0] = float("nan")
    grad = torch.randn_like(A)
    tol = 2e-5 if dtype == torch.float32 else 1e-13
    got = fused(A.to(_device()), 0.1).cpu()[..., : ndim + 1]  # padded rows of 4
    got_vjp = fused_vjp(A.to(_device()), 0.1, grad.to(_device())).cpu()
    assert got[2, 1].isnan().any() and not got_vjp[2, 1].isfinite().all()
    finite = torch.ones(3, 13, dtype=torch.bool)
    finite[2, 1] = False
    for name, g, w in (("E", got, step_matrices(A, 0.1)), ("dL/dA", got_vjp, step_matrices_vjp(A, 0.1, grad))):
        g, w = g[finite], w[finite]
        error = ((g - w).abs().amax((-1, -2)) / w.abs().amax((-1, -2)).clamp_min(1e-300)).max().item()
        assert error <= tol, f"{name}: largest relative error per matrix {error:.2e}"


@pytest.mark.parametrize("ndim", [2, 3])
def test_fused_path_with_own_steps(ndim):
    """The fused path as used (its own step matrices) on points off the facets: end points and gradients agree with
    the PyTorch path to float32 rounding (an ulp of ``E`` moves a point by about an ulp; no cell changes)."""
    basis, theta, _ = case(ndim, 0, "zero", torch.float32, _device())
    torch.manual_seed(7)
    points = (0.05 + 0.9 * torch.rand(2, 300, ndim)).to(_device())
    grad = torch.randn(points.shape, device=points.device)
    want = _gradients(points, theta, basis, grad, "torch", 10, 4)
    got = _gradients(points, theta, basis, grad, "triton", 10, 4)
    for name, g, w in zip(("end points", "dL/dpoints", "dL/dtheta"), got, want, strict=True):
        _assert_close(g, w, name, tol=1e-4)


_COMPILE_SCRIPT = """
import time
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from regkit_kernels.cpab.expm import step_matrices_kernel, step_matrices_vjp_kernel
from regkit_kernels.cpab.kernels import cpab_bwd_kernel, cpab_fwd_kernel

point_kernels = [
    (cpab_fwd_kernel, {"DIVIDE": True, "PERMUTED": False}),
    (cpab_fwd_kernel, {"DIVIDE": False, "PERMUTED": True}),
    (cpab_bwd_kernel, {"SEG": 5, "SLOTS": 1, "UNIFORM": False, "MOMENTS": True, "POINTS": True, "DIVIDE": True,
                        "PERMUTED": False}),
    (cpab_bwd_kernel, {"SEG": 5, "SLOTS": 10, "UNIFORM": True, "MOMENTS": True, "POINTS": False, "DIVIDE": False,
                        "PERMUTED": True}),
]
for kernel, consts in point_kernels + [(step_matrices_kernel, {"DEG": 12}), (step_matrices_vjp_kernel, {"DEG": 12})]:
    for ndim in (2, 3):
        start = time.perf_counter()
        constexprs = {"NDIM": ndim, "BLOCK": 128, **consts}
        signature = {
            name: "constexpr" if name in constexprs else "*i32" if name == "perm_ptr" else
            "*fp32" if name.endswith("_ptr") else
            "fp32" if name in ("h0", "h1", "h2") else "i32"
            for name in kernel.arg_names
        }
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        contract = kernel not in (step_matrices_kernel, step_matrices_vjp_kernel)
        options = {"enable_fp_fusion": False} if contract else {}
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        ptx = compiled.asm["ptx"]
        assert "cubin" in compiled.asm, (kernel.__name__, ndim)
        if contract:  # the backward kernel's adjoint sweep takes explicit fused multiply-adds; its positions do not
            assert ("div.rn.f32" in ptx) == consts["DIVIDE"], (kernel.__name__, ndim)
            assert (kernel is cpab_bwd_kernel) or "fma." not in ptx, (kernel.__name__, ndim)
        print(kernel.__name__, ndim, consts, f"{time.perf_counter() - start:.1f} s", compiled.metadata.num_warps)
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_contraction():
    """Without a GPU: the kernels compile for sm_90 (through ptxas); the forward kernel with no fused multiply-adds
    (the backward kernel recomputes positions with the same code, under the same options), the point kernels with IEEE
    division where the box's extents are not powers of two (else a multiplication by their exact inverses): the
    arithmetic the bit-equality with PyTorch rests on (a subprocess, since the interpreter is on in this one)."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]

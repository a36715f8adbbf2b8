"""Fused CPAB kernels against the PyTorch spec of the facet-resolved expm-step scheme (``regkit.cpab.scheme``):
trajectories of regular steps only bit-equal to the reference's (hence the same visited cells), steps in pieces (facet
crossings, large velocities) equal to rounding, point, A and theta gradients equal to the factorized PyTorch
adjoint's, a gradcheck across facets, checkpoint spacings that change nothing, 2D and 3D, float32 and float64, every
boundary mode, batches, shared points, points on facets, outside the domain and NaN.

On CPU the kernels run in Triton's interpreter (slow, and slowest where points cross facets: every piece sums a
Taylor polynomial of tens of terms per Newton iteration): tiny tessellations, a few dozen points, T <= 10, one program
per batch element. The ``gpu`` cases run realistic sizes (set REGKIT_TEST_CUDA=1 so that the conftest leaves the
interpreter off).

Points are drawn off the mesh's vertices and edges (facet centroids, cell centres, random points): where a flow
starts on several facets at once, which of them a piece leaves through is decided by rounding (ties at hit time 0),
and the spec decides it for a whole round of pieces at once (at the largest Taylor degree a piece of the round needs),
the kernels for each lane alone (at its own degree), so that the two can follow different cells there.
"""

import pytest
import torch

pytest.importorskip("triton")

from regkit.cpab import crossing, scheme
from regkit.cpab.basis import BOUNDARY_MODES, CPABasis, cpa_basis
from regkit.cpab.integrate import count_crossings, integrate, integrate_trajectory
from regkit.cpab.scheme import step_matrices, step_matrices_vjp, take_step
from regkit.cpab.tessellation import Tessellation
from regkit_kernels.cpab import cpab_fwd, kernels
from tests.helpers import assert_relative_close, relative_tolerance
from tests.regkit_kernels.cpab_cases import TESSELLATIONS, case

F64 = torch.float64


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _tol(dtype: torch.dtype) -> float:
    """Largest |triton - torch| of an output or gradient relative to the largest |torch|: the shared tolerance. The
    paths differ in the order of their sums (the moments, the pieces' dL/dA, float atomics), in the pieces' rounding
    (Taylor terms summed one by one to each lane's own degree instead of by Horner's rule to a round's largest) and,
    for dL/dtheta in float32, in the adjoint of the matrix exponential (float64 inside the fused one; matrix_exp's
    float32 autograd is off by up to ~5e-6 per matrix at these velocities, summed over cells by the projection)."""
    return relative_tolerance(dtype)


def _points(
    tess: Tessellation, n_facets: int, n_random: int, batch: int, dtype: torch.dtype, seed: int
) -> torch.Tensor:
    """``(batch, N, n)`` domain points off the mesh's vertices and edges: ``n_facets`` facet centroids (on facets
    shared by two cells or on the box boundary), then ``n_random`` random points of a box 20% larger than the domain
    on each side (some start outside), each batch element its own."""
    torch.manual_seed(seed)
    corners = tess.cell_vertices()  # (C, n + 1, n)
    n = tess.ndim
    centroids = ((corners.sum(1, keepdim=True) - corners) / n).reshape(-1, n)  # facet f: the mean of the others
    lower = torch.tensor(tess.lower, dtype=F64)
    upper = torch.tensor(tess.upper, dtype=F64)
    pick = torch.stack([torch.randperm(len(centroids))[:n_facets] for _ in range(batch)])
    random = lower + (upper - lower) * (1.4 * torch.rand(batch, n_random, n, dtype=F64) - 0.2)
    return torch.cat([centroids[pick], random], dim=1).to(dtype=dtype, device=_device())


def _crossing_case(
    ndim: int, dtype: torch.dtype, boundary: str = "free", batch: int = 2, n_points: int = 24
) -> tuple[CPABasis, torch.Tensor, torch.Tensor]:
    """``cpab_cases.case``'s basis on an odd box (in 3D with the zero boundary, which leaves that box no parameters,
    the box of power-of-two extents) and its large velocities (a point crosses facets at most steps of 1/2, several at
    some), with :func:`_points` (a third of them facet centroids)."""
    which = 2 if ndim == 3 and boundary == "zero" else 1
    basis, theta, _ = case(ndim, which, boundary, dtype, _device(), batch=batch)
    return basis, theta, _points(basis.tess, n_points // 3, n_points - n_points // 3, batch, dtype, 10 * ndim + batch)


def _regular(points: torch.Tensor, A: torch.Tensor, tess: Tessellation, steps: int) -> torch.Tensor:
    """``(B, N)`` bool: the points whose every step of the spec is a regular step (no facet crossed)."""
    h = 1.0 / steps
    E = step_matrices(A, h)
    x, regular = points, torch.ones(points.shape[:2], dtype=torch.bool, device=points.device)
    with torch.no_grad():
        for _ in range(steps):
            x, step = take_step(E, A, x, tess, h)
            regular &= step.regular
    return regular


@pytest.fixture
def same_step_matrices(monkeypatch):
    """The fused path with PyTorch's step matrices (``torch.linalg.matrix_exp``) instead of its own kernel, so that
    both paths step with bit-equal ``E``: regular steps are then bit-equal, visit the same cells and take their pieces
    at the same steps (one ulp of ``E`` can move a point across a facet, and these tests' large velocities make the
    flows expand, which magnifies any difference). The fused step matrices are tested on their own
    (``test_step_matrices_equal_matrix_exp``, ``test_fused_path_with_own_steps``)."""
    import regkit_kernels.cpab.ops as ops

    monkeypatch.setattr(ops, "step_matrices", step_matrices)


def _gradients(points, theta, basis, grad, backend, steps, checkpoint_every):
    points = points.detach().requires_grad_(True)
    theta = theta.detach().requires_grad_(True)
    out = integrate(
        points, basis.to_A(theta), basis.tess, t=1.0, steps=steps, backend=backend, checkpoint_every=checkpoint_every
    )
    return (out, *torch.autograd.grad(out, (points, theta), grad))


def _assert_same(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Bit-equal in the interpreter, where the atomics add in program order; to rounding on the GPU."""
    if got.is_cuda:
        assert_relative_close(got, want, _tol(got.dtype), name)
    else:
        assert torch.equal(got, want), name


def test_constants_are_those_of_the_spec() -> None:
    assert kernels.MAX_CROSSINGS.value == scheme.MAX_CROSSINGS
    assert kernels.MAX_DEGREE.value == crossing.MAX_DEGREE
    assert kernels.NEWTON_ITERATIONS.value == crossing.NEWTON_ITERATIONS
    tolerances = {torch.float32: kernels.TOLERANCE_F32.value, F64: kernels.TOLERANCE_F64.value}
    assert tolerances == crossing.TAYLOR_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("ndim,which", [(2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (3, 2)])
def test_forward_equals_reference(ndim, which, dtype):
    """Slow flows (few crossings): the trajectories of regular steps only are bit-equal to the reference's at the end
    and at every checkpoint (the same cell lookup and step arithmetic; odd boxes divide by their extents, boxes of
    power-of-two extents multiply by the inverses), the others equal to rounding."""
    basis, theta, _ = case(ndim, which, "free", dtype, _device())
    A = basis.to_A(0.05 * theta)
    tess = basis.tess
    points = torch.cat([tess.centers().to(dtype).expand(2, -1, -1).to(_device()), _points(tess, 0, 60, 2, dtype, 1)], 1)
    steps, every = 10, 3
    E = step_matrices(A, 1.0 / steps)
    out, checkpoints = cpab_fwd(points, A, E, tess, 1.0 / steps, steps, every)
    trajectory = integrate_trajectory(points, A, tess, t=1.0, steps=steps)
    regular = _regular(points, A, tess, steps)
    assert regular.float().mean() > 0.7 and not regular.all()
    assert torch.equal(out[regular], trajectory[-1][regular])
    assert torch.equal(checkpoints[:, regular], trajectory[every:steps:every][:, regular])
    assert_relative_close(out, trajectory[-1], _tol(dtype), "end points")
    assert_relative_close(checkpoints, trajectory[every:steps:every], _tol(dtype), "checkpoints")


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("ndim", [2, 3])
def test_forward_matches_the_spec_across_many_facets(ndim, dtype):
    """Large velocities, two steps: about a facet crossed per point, up to several in a step (a point on a facet
    leaves it at hit time 0); end points and the checkpoint equal the reference's to rounding; NaN points stay
    NaN, points outside the box take regular steps."""
    basis, theta, points = _crossing_case(ndim, dtype)
    points[1, -1, 0] = float("nan")
    A = basis.to_A(theta)
    h = 0.5
    _, step = take_step(step_matrices(A, h), A, points, basis.tess, h)
    assert len(step.pieces) >= 3
    assert count_crossings(points, A, basis.tess, steps=2) > points.shape[0] * points.shape[1] / 2
    out, checkpoints = cpab_fwd(points, A, step_matrices(A, h), basis.tess, h, 2, 1)
    trajectory = integrate_trajectory(points, A, basis.tess, t=1.0, steps=2)
    nan = trajectory[-1].isnan().any(-1)
    assert nan.sum() == 1 and torch.equal(out.isnan().any(-1), nan)
    assert_relative_close(out[~nan], trajectory[-1][~nan], _tol(dtype), "end points")
    assert_relative_close(checkpoints[0][~nan], trajectory[1][~nan], _tol(dtype), "checkpoint")


def test_forward_stops_after_max_crossings():
    """One step of very large velocities on a fine tessellation: a point crosses ``MAX_CROSSINGS`` facets and takes
    the time left in the last cell, as the spec does. Points whose flow slides along a facet (pieces of hit time 0 to
    and fro between its two cells, until the cap) are left out: which cell takes the time left is decided by
    rounding there."""
    torch.manual_seed(6)
    tess = Tessellation((6, 6), (-1.0, -1.0), (1.0, 0.5))
    basis = cpa_basis(tess, "zero")
    A = basis.to_A(12.0 * torch.randn(1, basis.d, dtype=F64)).to(_device())
    points = _points(tess, 0, 16, 1, F64, 3)
    ref, step = take_step(step_matrices(A, 1.0), A, points, tess, 1.0)
    assert len(step.pieces) == scheme.MAX_CROSSINGS + 1
    sliding = torch.zeros(points.shape[1], dtype=torch.bool, device=points.device)
    for piece in step.pieces:
        sliding[piece.rows[piece.durations == 0]] = True
    assert sliding.sum() <= 2 and not sliding[step.pieces[-1].rows].all()
    out, _ = cpab_fwd(points, A, step_matrices(A, 1.0), tess, 1.0, 1, 1)
    assert_relative_close(out[:, ~sliding], ref[:, ~sliding], _tol(F64), "end points")


@pytest.mark.parametrize(  # float32 on one boundary mode: the boundary modes change A, not the kernels
    "boundary,dtype", [(mode, F64) for mode in BOUNDARY_MODES] + [("free", torch.float32)]
)
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.usefixtures("same_step_matrices")
def test_gradients_equal_factorized_torch(ndim, boundary, dtype):
    """Across many facets: values, dL/dpoints, dL/dA (``A`` a leaf) and dL/dtheta (through ``basis.to_A``) of
    ``integrate(backend="triton")`` equal those of ``backend="torch"``. In float32 against the float64 torch path:
    the spec's closed-form adjoint of a piece (``crossing.piece_vjp``) forms ``(A_lin^T)^j lam`` and ``tau^j / j!``
    apart, which overflow and underflow float32 at the high degrees of these velocities (NaN gradients)."""
    basis, theta, points = _crossing_case(ndim, dtype, boundary, batch=1)
    assert count_crossings(points, basis.to_A(theta), basis.tess, steps=2) > points.shape[1] / 2
    grad = torch.randn(points.shape, dtype=dtype, device=points.device)
    results = {}
    for backend, precision in (("triton", dtype), ("torch", F64)):
        A = basis.to_A(theta.to(precision)).detach().requires_grad_(True)
        p = points.to(precision).requires_grad_(True)
        out = integrate(p, A, basis.tess, steps=2, backend=backend, checkpoint_every=1)
        results[backend] = (out, *torch.autograd.grad(out, (p, A), grad.to(precision)))
        results[backend] += (
            _gradients(points.to(precision), theta.to(precision), basis, grad.to(precision), backend, 2, 1)[2],
        )
    got, want = results["triton"], results["torch"]
    for name, g, w in zip(("end points", "dL/dpoints", "dL/dA", "dL/dtheta"), got, want, strict=True):
        assert_relative_close(g, w, _tol(dtype), name)


@pytest.mark.parametrize("ndim", [2, 3])
def test_gradcheck_across_facets(ndim):
    """float64 ``gradcheck`` of the whole fused face (its own step matrices and their adjoint) in theta, 2 steps,
    trajectories that cross facets: the gradient with the cells and hit times fixed is the flow's gradient."""
    torch.manual_seed(10 + ndim)
    basis = cpa_basis(Tessellation((3, 2) if ndim == 2 else (2, 2, 3)), "zero")
    theta = (3.0 * torch.randn(basis.d, dtype=F64)).to(_device())
    points = (0.1 + 0.8 * torch.rand(8, ndim, dtype=F64)).to(_device())
    assert count_crossings(points, basis.to_A(theta), basis.tess, steps=2) >= 4

    def flow(th: torch.Tensor) -> torch.Tensor:
        return integrate(points, basis.to_A(th), basis.tess, steps=2, backend="triton")

    theta.requires_grad_(True)
    assert torch.autograd.gradcheck(flow, (theta,), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("sort", [False, True])
@pytest.mark.usefixtures("same_step_matrices")
def test_shared_points_and_partial_gradients(ndim, sort, monkeypatch):
    """Unbatched points shared by a batch of theta (a stride-0 batch), segments longer than the run, and each
    gradient alone; with ``sort``, the kernels take the points in the order of their starting cells."""
    import regkit_kernels.cpab.ops as ops

    monkeypatch.setattr(ops, "SORT_MIN", 0 if sort else 1 << 30)
    basis, theta, _ = case(ndim, 1, "free", F64, _device(), batch=2)
    theta = 0.3 * theta
    shared = _points(basis.tess, 4, 12, 1, F64, ndim)[0]
    A = basis.to_A(theta)
    order = ops.point_order(shared.expand(2, -1, -1), step_matrices(A, 1 / 3), basis.tess, 3)
    assert (order is not None) == sort
    if sort:
        assert not torch.equal(order.long().cpu(), torch.arange(len(order)))
        assert torch.equal(order.long().sort().values.cpu(), torch.arange(len(order)))
    assert count_crossings(shared, basis.to_A(theta), basis.tess, steps=3) > 0
    grad = torch.randn(2, *shared.shape, dtype=F64, device=shared.device)
    want = _gradients(shared, theta, basis, grad, "torch", 3, 8)
    got = _gradients(shared, theta, basis, grad, "triton", 3, 8)
    for name, g, w in zip(("end points", "dL/dpoints", "dL/dtheta"), got, want, strict=True):
        assert_relative_close(g, w, _tol(F64), name)
    p = shared.detach().requires_grad_(True)
    (only_points,) = torch.autograd.grad(integrate(p, A, basis.tess, steps=3, backend="triton"), p, grad)
    _assert_same(only_points, got[1], "dL/dpoints alone")
    th = theta.detach().requires_grad_(True)
    out = integrate(shared, basis.to_A(th), basis.tess, steps=3, backend="triton")
    (only_theta,) = torch.autograd.grad(out, th, grad)
    _assert_same(only_theta, got[2], "dL/dtheta alone")


@pytest.mark.parametrize("ndim", [2, 3])
def test_point_order_groups_points_by_predicted_crossing_step(ndim, monkeypatch):
    """``point_order`` is the cell order stably partitioned by the first step at which the starting cell's exact
    flow (its regular steps, repeated) leaves the cell, the earliest over the batch: checked against that definition
    in PyTorch, over several programs."""
    import regkit_kernels.cpab.ops as ops

    monkeypatch.setattr(ops, "SORT_MIN", 0)
    monkeypatch.setattr(ops, "INTERPRETER_BLOCK", 16)
    basis, theta, _ = case(ndim, 1, "zero", F64, _device(), batch=2)
    tess, steps = basis.tess, 4
    A = basis.to_A(0.5 * theta)
    points = _points(tess, 4, 12, 1, F64, ndim)[0].expand(2, -1, -1)
    E = step_matrices(A, 1 / steps)
    order = ops.point_order(points, E, tess, steps)
    assert order is not None
    by_cell = ops.cell_order(points, tess).long().cpu()
    planes, neighbors = tess.facet_planes()
    x = points[0].cpu()
    cells = tess.locate(x)
    first = torch.full((len(x),), steps)
    for b in range(2):
        y = x
        for s in range(steps):
            y = scheme.affine(E[b].cpu()[cells], y)
            left = ((crossing.barycentric(planes[cells], y) < 0) & (neighbors[cells] >= 0)).any(-1)
            first = torch.where(left & (first > s), s, first)
    bucket = torch.where(first < steps, first * (ops._BUCKETS - 1) // steps, ops._BUCKETS - 1)[by_cell]
    want = by_cell[torch.sort(bucket, stable=True).indices]
    assert 0 < int((first < steps).sum()) < len(x)
    assert torch.equal(order.long().cpu(), want)


@pytest.mark.parametrize("ndim,which", [(2, 1), (2, 2), (3, 2)])
@pytest.mark.usefixtures("same_step_matrices")
def test_checkpoint_spacing_changes_nothing(ndim, which):
    """Checkpoints every step, every 3 (sub-segments of 3), every 8 (register checkpoints in stored segments longer
    than the unrolled sub-segments) and none (25 > 10 steps), with facets crossed: the same end points and gradients
    (bit for bit in the interpreter), equal to the torch path's."""
    basis, theta, _ = case(ndim, which, "zero", F64, _device(), batch=1)
    theta = 0.4 * theta
    points = _points(basis.tess, 4, 12, 1, F64, which)
    assert count_crossings(points, basis.to_A(theta), basis.tess, steps=10) >= 3
    grad = torch.randn(points.shape, dtype=F64, device=points.device)
    want = _gradients(points, theta, basis, grad, "torch", 10, 4)
    first = _gradients(points, theta, basis, grad, "triton", 10, 1)
    for name, g, w in zip(("end points", "dL/dpoints", "dL/dtheta"), first, want, strict=True):
        assert_relative_close(g, w, _tol(F64), name)
    for every in (3, 8, 25):
        got = _gradients(points, theta, basis, grad, "triton", 10, every)
        assert torch.equal(got[0], first[0])
        for name, g, f in zip(("dL/dpoints", "dL/dtheta"), got[1:], first[1:], strict=True):
            _assert_same(g, f, f"{name}, checkpoints every {every}")


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.usefixtures("same_step_matrices")
def test_flush_skip(ndim, monkeypatch):
    """A slow flow in programs of 16 points, so that at most steps no point of a program changes cell (and at some one
    does, by crossing a facet): the backward kernel that skips the moment flush program-wide at those steps
    (``UNIFORM``) gives the same gradients as the one that flushes at every step (bit-equal in the interpreter, where
    the atomics add in order), equal to the torch path's."""
    import regkit_kernels.cpab.ops as ops

    monkeypatch.setattr(ops, "INTERPRETER_BLOCK", 16)
    basis, theta, _ = case(ndim, 0, "zero", F64, _device())
    theta = (0.2 if ndim == 2 else 1.0) * theta
    torch.manual_seed(ndim)
    points = torch.rand(2, 48, ndim, dtype=F64, device=theta.device)
    steps = 4
    cells = basis.tess.locate(integrate_trajectory(points, basis.to_A(theta), basis.tess, t=1.0, steps=steps))
    changed = (cells[1:] != cells[:-1]).reshape(steps, 2, 3, 16).any(-1)  # per step, batch element and program
    assert changed.any() and not changed.all()
    grad = torch.randn(points.shape, dtype=F64, device=theta.device)
    want = _gradients(points, theta, basis, grad, "torch", steps, 4)
    results = []
    for uniform in (False, True):
        monkeypatch.setattr(ops, "UNIFORM", uniform)
        results.append(_gradients(points, theta, basis, grad, "triton", steps, steps))
    flushing, skipping = results
    assert torch.equal(skipping[0], flushing[0]) and torch.equal(skipping[1], flushing[1])
    _assert_same(skipping[2], flushing[2], "dL/dtheta")
    for name, g, w in zip(("end points", "dL/dpoints", "dL/dtheta"), skipping, want, strict=True):
        assert_relative_close(g, w, _tol(F64), name)


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
    """Realistic sizes on the GPU, facets crossed at many steps: end points and gradients equal the torch path's
    (float32), and two runs give gradients equal up to the reordering of float atomics; every output element is
    written. Checkpoints every 5 steps, every 8 and none (every 50 of 50 steps); points of their own per batch
    element, or shared (then the kernels take them sorted by cell)."""
    torch.manual_seed(sum(shape))
    tess = Tessellation(shape, (-1.0,) * ndim, (2.0,) * ndim)
    basis = cpa_basis(tess, "zero")
    theta = 2.0 * torch.randn(batch, basis.d, device="cuda")
    points = -1.6 + 4.2 * torch.rand(batch, 50_000, ndim, device="cuda")  # some outside the box
    points = points[0] if shared else points
    grad = torch.randn(batch, *points.shape[-2:], device="cuda")
    assert count_crossings(points[..., :2000, :], basis.to_A(theta), tess, steps=50) > 250
    want = _gradients(points, theta, basis, grad, "torch", 50, 5)
    got = _gradients(points, theta, basis, grad, "triton", 50, every)
    again = _gradients(points, theta, basis, grad, "triton", 50, every)
    assert all(torch.isfinite(g).all() for g in got)
    # Regular steps are bit-equal, pieces equal to float32 rounding; the flows' expansion over 50 steps magnifies
    # that, at a few points (those whose trajectories pass closest to an edge) up to a visible difference. So: the
    # end points and dL/dpoints of 99.9% of the points to float32 rounding (relative to the largest).
    for name, g, w in zip(("end points", "dL/dpoints"), got[:2], want[:2], strict=True):
        close = (g - w).abs().amax(-1) <= _tol(torch.float32) * w.abs().max()
        assert close.float().mean() >= 0.999, f"{name}: {close.float().mean().item():.4%} close"
    # theta's gradient sums 50 steps x 50k points per cell in float32, in another order (atomics): measured on the
    # H200, 3e-5 relative at 16x16 cells; 2e-4 bounds that reordering, far below any real error.
    for name, g, a in zip(("dL/dpoints", "dL/dtheta"), got[1:], again[1:], strict=True):
        assert_relative_close(a, g, 2e-4, f"{name} (second run)")
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
    """Blocks smaller than the point count (as on the GPU): every program writes its own points and moments, and
    adds its own pieces' dL/dA."""
    import regkit_kernels.cpab.ops as ops

    monkeypatch.setattr(ops, "INTERPRETER_BLOCK", 16)
    basis, theta, _ = case(ndim, 0, "normal", F64, _device())
    theta = 0.4 * theta
    points = _points(basis.tess, 8, 32, 2, F64, 7)
    assert count_crossings(points, basis.to_A(theta), basis.tess, steps=3) > 0
    grad = torch.randn(points.shape, dtype=F64, device=points.device)
    want = _gradients(points, theta, basis, grad, "torch", 3, 2)
    got = _gradients(points, theta, basis, grad, "triton", 3, 2)
    for name, g, w in zip(("end points", "dL/dpoints", "dL/dtheta"), got, want, strict=True):
        assert_relative_close(g, w, _tol(F64), name)


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
            assert_relative_close(got, want, tol, "A")
            if basis.d:  # 3D zero boundary on one cube: no parameters
                assert_relative_close(got_grad, want_grad, tol, "dL/dtheta")


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
    """The fused path as used (its own step matrices), float32, facets crossed: end points and gradients agree with
    the PyTorch path to float32 rounding (an ulp of ``E`` moves a point by about an ulp)."""
    basis, theta, _ = case(ndim, 0, "zero", torch.float32, _device())
    theta = 0.3 * theta
    torch.manual_seed(7)
    points = (0.05 + 0.9 * torch.rand(2, 40, ndim)).to(_device())
    assert count_crossings(points, basis.to_A(theta), basis.tess, steps=4) > 0
    grad = torch.randn(points.shape, device=points.device)
    want = _gradients(points, theta, basis, grad, "torch", 4, 2)
    got = _gradients(points, theta, basis, grad, "triton", 4, 2)
    for name, g, w in zip(("end points", "dL/dpoints", "dL/dtheta"), got, want, strict=True):
        assert_relative_close(g, w, _tol(torch.float32), name)


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
            name: "constexpr" if name in constexprs else "*i32" if name in ("perm_ptr", "nb_ptr") else
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
    arithmetic the bit-equality of regular steps with PyTorch rests on (a subprocess, since the interpreter is on in
    this one)."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]

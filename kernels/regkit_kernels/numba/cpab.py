"""CPAB integration on the CPU, compiled with numba: the expm-step scheme and its factorized adjoint, one point at a
time through all steps, so that nothing of the trajectory goes through memory.

The CPU counterpart of ``regkit_kernels.cpab`` (Triton, CUDA), reached from ``regkit.cpab.integrate`` as the
``"numba"`` backend through ``regkit._backend``. It computes exactly the scheme of ``regkit.cpab.integrate`` (read its
module docstring first): ``T`` steps ``x <- E_c [x; 1]`` with ``c = tess.locate(x)`` and ``E_c`` the top ``n`` rows of
``expm(h [A_c; 0])``, in domain coordinates, (x, y[, z]) order. Per point it reproduces the PyTorch path's arithmetic
operation by operation in the points' dtype (the same cell lookup, the same evaluation order, no fused multiply-adds),
so from the same step matrices it gives bit-identical positions. The step matrices themselves are computed here in
float64 (scaling and squaring of a Taylor series, 8 cells side by side in SIMD lanes) and rounded to the points'
dtype, so they differ from ``torch.linalg.matrix_exp``'s by about one rounding.

Backward (the factorized adjoint): each point's trajectory is recomputed from its start into a small per-thread buffer
(no checkpoints in memory: on the CPU a step costs little next to a pass over memory), then swept backward: the
per-cell moments ``M_c += lambda_{s+1} [x_s; 1]^T`` go into one float64 table per thread (summed at the end: the
result does not depend on the thread schedule beyond that final sum's fixed order), and ``lambda_s = E_lin(c_s)^T
lambda_{s+1}``. ``dL/dA`` is then ``M`` pulled back through the matrix exponential by its Frechet derivative at
``(h Ã)^T`` (the adjoint of ``expm``), computed by the same scaling and squaring. Points whose ``dL/dx_T`` is zero
(a registration's background, where neither image varies) and cells whose moments are zero are skipped: their
contributions are exactly zero.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
import torch

from regkit_kernels.numba.threads import parallel_for, torch_threads

_TAYLOR_DEGREE = 12
_TAYLOR_NORM = 0.25  # scale the linear part of h Ã by 2^-s until its 1-norm is at most this: degree 12 then leaves
# a truncation error below 1e-17
_LANES = 8  # cells computed side by side (SIMD lanes, innermost) by the matrix-exponential kernels


# ---------------------------------------------------------------------------------------------------------------------
# The matrix exponential and its adjoint (float64, per cell)
# ---------------------------------------------------------------------------------------------------------------------


@numba.njit(cache=True)
def _matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out = a @ b`` lane by lane for ``(m, m, _LANES)`` arrays (the lanes innermost: one SIMD operation each)."""
    m = a.shape[0]
    for i in range(m):
        for j in range(m):
            for w in range(_LANES):
                out[i, j, w] = 0.0
            for k in range(m):
                for w in range(_LANES):
                    out[i, j, w] += a[i, k, w] * b[k, j, w]


@numba.njit(cache=True)
def _squarings(X: np.ndarray) -> int:
    """The number of squarings ``s`` that brings the 1-norm of the leading ``(m - 1) x (m - 1)`` block of every lane
    of ``X (m, m, _LANES)`` (the linear part of an affine generator, or of its transpose) to at most
    ``_TAYLOR_NORM``. The series of ``exp([[L, b], [0, 0]])`` and of its transpose converge at the rate set by ``L``
    alone (the ``b`` part of ``X^k`` is ``L^(k-1) b``), so the translation, however large in domain units, costs no
    squarings. One count for all lanes: more squarings than a lane needs change its result only by rounding."""
    m = X.shape[0]
    norm = 0.0
    for w in range(_LANES):
        for j in range(m - 1):
            col = 0.0
            for i in range(m - 1):
                col += abs(X[i, j, w])
            norm = max(norm, col)
    if norm <= _TAYLOR_NORM:
        return 0
    return math.ceil(math.log2(norm / _TAYLOR_NORM))


@numba.njit(cache=True)
def _converged(term: np.ndarray, total: np.ndarray, tol: float) -> bool:
    """Whether, in every lane, the largest entry of ``term`` is at most ``tol`` times the largest of ``total``."""
    m = term.shape[0]
    for w in range(_LANES):
        largest_term = 0.0
        largest_total = 0.0
        for i in range(m):
            for j in range(m):
                largest_term = max(largest_term, abs(term[i, j, w]))
                largest_total = max(largest_total, abs(total[i, j, w]))
        if largest_term > tol * largest_total:
            return False
    return True


@numba.njit(cache=True)
def _expm_frechet(
    X: np.ndarray, G: np.ndarray, P: np.ndarray, Q: np.ndarray, work: np.ndarray, tol: float, frechet: bool
) -> None:
    """For each of the ``_LANES`` lanes of ``X (m, m, _LANES)`` (float64, an affine generator or its transpose):
    ``P = expm(X)`` and, when ``frechet``, ``Q = L(X, G)``, the Frechet derivative of ``expm`` at ``X`` in the
    direction ``G``. Taylor series of ``X / 2^s`` and its derivative (``T_k = Y T_{k-1} / k``, ``D_k = (Y D_{k-1} +
    G' T_{k-1}) / k``, ``G' = G / 2^s``), up to degree ``_TAYLOR_DEGREE`` or until every lane's terms fall below
    ``tol`` of its sums (the precision the caller keeps), then ``s`` squarings ``(P, Q) <- (P P, P Q + Q P)``.
    ``work``: scratch ``(5, m, m, _LANES)``."""
    m = X.shape[0]
    s = _squarings(X)
    scale = 0.5**s
    Y, term, dterm, tmp, Gs = work[0], work[1], work[2], work[3], work[4]
    for i in range(m):
        for j in range(m):
            for w in range(_LANES):
                Y[i, j, w] = X[i, j, w] * scale
                term[i, j, w] = 1.0 if i == j else 0.0
                P[i, j, w] = term[i, j, w]
                if frechet:
                    Gs[i, j, w] = G[i, j, w] * scale
                    dterm[i, j, w] = 0.0
                    Q[i, j, w] = 0.0
    for k in range(1, _TAYLOR_DEGREE + 1):
        inverse = 1.0 / k
        if frechet:  # D_k from D_{k-1} and T_{k-1}: before T_k overwrites T_{k-1}
            _matmul(Y, dterm, tmp)
            _matmul(Gs, term, dterm)
            for i in range(m):
                for j in range(m):
                    for w in range(_LANES):
                        dterm[i, j, w] = (dterm[i, j, w] + tmp[i, j, w]) * inverse
                        Q[i, j, w] += dterm[i, j, w]
        _matmul(Y, term, tmp)
        for i in range(m):
            for j in range(m):
                for w in range(_LANES):
                    term[i, j, w] = tmp[i, j, w] * inverse
                    P[i, j, w] += term[i, j, w]
        if _converged(term, P, tol) and (not frechet or _converged(dterm, Q, tol)):
            break
    for _ in range(s):
        if frechet:
            _matmul(P, Q, tmp)
            _matmul(Q, P, term)
            for i in range(m):
                for j in range(m):
                    for w in range(_LANES):
                        Q[i, j, w] = tmp[i, j, w] + term[i, j, w]
        _matmul(P, P, tmp)
        for i in range(m):
            for j in range(m):
                for w in range(_LANES):
                    P[i, j, w] = tmp[i, j, w]


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _exponentials(
    first: int,
    last: int,
    A: np.ndarray,
    h: float,
    grad_E: np.ndarray,
    cells: np.ndarray,
    out: np.ndarray,
    tol: float,
    adjoint: bool,
) -> None:
    """For the ``cells`` listed, ``_LANES`` at a time (blocks ``first`` to ``last - 1`` of them; lanes past the last
    cell hold zeros; the other rows of ``out`` are left alone), from ``A (K, n, n + 1)``: the step matrices ``out[c] =
    expm(h [A_c; 0])[:n]`` or, when ``adjoint``, ``dL/dA_c = out[c] = h L((h Ã_c)^T, [dL/dE_c; 0])[:n]`` from
    ``grad_E (K, n, n + 1)`` (not read otherwise). All arrays float64. One kernel for both directions, so that numba
    compiles it and ``_expm_frechet`` once."""
    _, n, m = A.shape
    count = cells.shape[0]
    X = np.empty((m, m, _LANES))
    G = np.empty((m, m, _LANES))
    P = np.empty((m, m, _LANES))
    Q = np.empty((m, m, _LANES))
    work = np.empty((5, m, m, _LANES))
    for block in range(first, last):
        X[:] = 0.0
        G[:] = 0.0
        start = block * _LANES
        lanes = min(_LANES, count - start)
        for w in range(lanes):
            c = cells[start + w]
            for i in range(n):
                for j in range(m):
                    if adjoint:
                        X[j, i, w] = h * A[c, i, j]
                        G[i, j, w] = grad_E[c, i, j]
                    else:
                        X[i, j, w] = h * A[c, i, j]
        _expm_frechet(X, G, P, Q, work, tol, adjoint)
        for w in range(lanes):
            c = cells[start + w]
            for i in range(n):
                for j in range(m):
                    out[c, i, j] = h * Q[i, j, w] if adjoint else P[i, j, w]


# ---------------------------------------------------------------------------------------------------------------------
# Cell lookup and steps (the points' dtype, operation for operation as regkit.cpab)
# ---------------------------------------------------------------------------------------------------------------------


@numba.njit(cache=True, inline="always")
def _axis(x: Any, lower: Any, extent: Any, count: Any, zero: Any, one: Any) -> tuple[int, Any]:
    """Box index along one axis and the local coordinate in it (``Tessellation.locate``: NaN counts as ``lower``,
    the projection onto the box for points outside, ``x == upper`` in the last box)."""
    t = (x - lower) / extent
    if t != t:
        t = zero
    t = min(max(t, zero), one) * count
    box = min(np.floor(t), count - one)
    return int(box), min(max(t - box, zero), one)


@numba.njit(cache=True, inline="always")
def _cell2(x0: Any, x1: Any, geom: tuple[Any, ...], nx: int) -> int:
    zero, one = geom[9], geom[10]
    i, lx = _axis(x0, geom[0], geom[3], geom[6], zero, one)
    j, ly = _axis(x1, geom[1], geom[4], geom[7], zero, one)
    above_main = ly > lx
    above_anti = ly > one - lx
    return 4 * (i + nx * j) + 2 * int(above_main) + int(above_main != above_anti)


@numba.njit(cache=True, inline="always")
def _cell3(x0: Any, x1: Any, x2: Any, geom: tuple[Any, ...], nx: int, ny: int) -> int:
    zero, one, two = geom[9], geom[10], geom[11]
    i, lx = _axis(x0, geom[0], geom[3], geom[6], zero, one)
    j, ly = _axis(x1, geom[1], geom[4], geom[7], zero, one)
    k, lz = _axis(x2, geom[2], geom[5], geom[8], zero, one)
    if (i + j + k) & 1:  # the box indices are never negative
        lx = one - lx
    local = int(lx - ly - lz > zero) + 2 * int(ly - lx - lz > zero) + 3 * int(lz - lx - ly > zero)
    local += 4 * int(lx + ly + lz > two)
    return 5 * (i + nx * (j + ny * k)) + local


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _forward2(
    first: int,
    last: int,
    points: np.ndarray,
    E: np.ndarray,
    geom: tuple[Any, ...],
    nx: int,
    steps: int,
    out: np.ndarray,
) -> None:
    """End points ``out (B, N, 2)`` of points ``first`` to ``last - 1`` of every batch element."""
    B = out.shape[0]
    shared = points.shape[0] == 1
    for b in range(B):
        src = 0 if shared else b
        for p in range(first, last):
            x0, x1 = points[src, p, 0], points[src, p, 1]
            for _ in range(steps):
                c = _cell2(x0, x1, geom, nx)
                x0, x1 = (
                    (E[b, c, 0, 0] * x0 + E[b, c, 0, 1] * x1) + E[b, c, 0, 2],
                    (E[b, c, 1, 0] * x0 + E[b, c, 1, 1] * x1) + E[b, c, 1, 2],
                )
            out[b, p, 0], out[b, p, 1] = x0, x1


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _forward3(
    first: int,
    last: int,
    points: np.ndarray,
    E: np.ndarray,
    geom: tuple[Any, ...],
    nx: int,
    ny: int,
    steps: int,
    out: np.ndarray,
) -> None:
    """End points ``out (B, N, 3)`` of points ``first`` to ``last - 1`` of every batch element."""
    B = out.shape[0]
    shared = points.shape[0] == 1
    for b in range(B):
        src = 0 if shared else b
        for p in range(first, last):
            x0, x1, x2 = points[src, p, 0], points[src, p, 1], points[src, p, 2]
            for _ in range(steps):
                c = _cell3(x0, x1, x2, geom, nx, ny)
                x0, x1, x2 = (
                    ((E[b, c, 0, 0] * x0 + E[b, c, 0, 1] * x1) + E[b, c, 0, 2] * x2) + E[b, c, 0, 3],
                    ((E[b, c, 1, 0] * x0 + E[b, c, 1, 1] * x1) + E[b, c, 1, 2] * x2) + E[b, c, 1, 3],
                    ((E[b, c, 2, 0] * x0 + E[b, c, 2, 1] * x1) + E[b, c, 2, 2] * x2) + E[b, c, 2, 3],
                )
            out[b, p, 0], out[b, p, 1], out[b, p, 2] = x0, x1, x2


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _backward(
    first_task: int,
    last_task: int,
    points: np.ndarray,
    E: np.ndarray,
    geom: tuple[Any, ...],
    nx: int,
    ny: int,
    steps: int,
    grad_out: np.ndarray,
    grad_points: np.ndarray,
    moments: np.ndarray,
    want_moments: bool,
) -> None:
    """Per point of tasks ``first_task`` to ``last_task - 1``: recompute the trajectory, sweep the adjoint back;
    ``moments (tasks, B, C, n, n + 1)`` float64, one table per task (the points split into ``tasks`` contiguous
    ranges)."""
    B, N, n = grad_out.shape
    tasks = moments.shape[0]
    shared = points.shape[0] == 1
    total = B * N
    for task in range(first_task, last_task):
        xs = np.empty((steps + 1, n), dtype=grad_out.dtype)
        cells = np.empty(steps, dtype=np.int64)
        lam = np.empty(n, dtype=grad_out.dtype)
        new = np.empty(n, dtype=grad_out.dtype)
        table = moments[task]
        first = task * total // tasks
        b, p = first // N, first % N - 1
        for _ in range(first, (task + 1) * total // tasks):
            p += 1  # (b, p) walks the task's range without an integer division per point
            if p == N:
                b, p = b + 1, 0
            moved = False  # whether dL/dx_T is not zero (else lambda stays 0: no moment, no point gradient)
            for i in range(n):
                moved = moved or grad_out[b, p, i] != 0
            if not moved:  # the background voxels
                for i in range(n):
                    grad_points[b, p, i] = 0.0
                continue
            src = 0 if shared else b
            for i in range(n):
                xs[0, i] = points[src, p, i]
            for s in range(steps):
                if n == 2:
                    c = _cell2(xs[s, 0], xs[s, 1], geom, nx)
                else:
                    c = _cell3(xs[s, 0], xs[s, 1], xs[s, 2], geom, nx, ny)
                cells[s] = c
                for i in range(n):
                    acc = E[b, c, i, 0] * xs[s, 0]
                    for j in range(1, n):
                        acc = acc + E[b, c, i, j] * xs[s, j]
                    xs[s + 1, i] = acc + E[b, c, i, n]
            for i in range(n):
                lam[i] = grad_out[b, p, i]
            for s in range(steps - 1, -1, -1):
                c = cells[s]
                if want_moments:
                    for i in range(n):
                        li = np.float64(lam[i])
                        for j in range(n):
                            table[b, c, i, j] += li * xs[s, j]
                        table[b, c, i, n] += li
                for j in range(n):
                    acc = E[b, c, 0, j] * lam[0]
                    for i in range(1, n):
                        acc = acc + E[b, c, i, j] * lam[i]
                    new[j] = acc
                for j in range(n):
                    lam[j] = new[j]
            for i in range(n):
                grad_points[b, p, i] = lam[i]


# ---------------------------------------------------------------------------------------------------------------------
# Launchers and the autograd Function
# ---------------------------------------------------------------------------------------------------------------------


def _tolerance(dtype: torch.dtype) -> float:
    """Where the Taylor series stop: far below the rounding of the dtype the results are kept in."""
    return 1e-17 if dtype == torch.float64 else 1e-10


def _blocks(cells: np.ndarray) -> int:
    """How many blocks of ``_LANES`` cells :func:`_exponentials` takes for ``cells``."""
    return (cells.shape[0] + _LANES - 1) // _LANES


def step_matrices(A: torch.Tensor, h: float) -> torch.Tensor:
    """Per-cell step matrices ``E (..., C, n, n + 1)`` = the top ``n`` rows of ``expm(h [A_c; 0])``, in ``A``'s dtype
    (computed in float64, to ``_tolerance(dtype)``, and rounded once to ``A``'s dtype). ``A (..., C, n, n + 1)``: the
    cells' affine velocities, domain coordinates. Not differentiable (:class:`CPABIntegrateNumba` differentiates
    through :func:`step_matrices_vjp`)."""
    flat = A.detach().reshape(-1, *A.shape[-2:]).to(torch.float64).contiguous().numpy()
    E = np.empty_like(flat)
    cells = np.arange(flat.shape[0])
    no_grad = np.empty((0, *flat.shape[1:]))
    parallel_for(_exponentials, _blocks(cells), flat, float(h), no_grad, cells, E, _tolerance(A.dtype), False)
    return torch.from_numpy(E).to(A.dtype).view(A.shape)


def step_matrices_vjp(A: torch.Tensor, h: float, grad_E: torch.Tensor) -> torch.Tensor:
    """``dL/dA`` for ``dL/dE`` through :func:`step_matrices` (the adjoint of the matrix exponential), float64 inside,
    returned in ``A``'s dtype and shape."""
    flat_A = A.detach().reshape(-1, *A.shape[-2:]).to(torch.float64).contiguous()
    flat_grad = grad_E.reshape(flat_A.shape).to(torch.float64).contiguous()
    out = torch.zeros_like(flat_A)
    # the adjoint is linear in dL/dE: cells no point moved through keep zeros
    cells = flat_grad.flatten(1).ne(0).any(1).nonzero()[:, 0].numpy()
    parallel_for(
        _exponentials, _blocks(cells), flat_A.numpy(), float(h), flat_grad.numpy(), cells, out.numpy(),
        _tolerance(A.dtype), True,
    )  # fmt: skip
    return out.to(A.dtype).view(A.shape)


def _geometry(tess: Any, dtype: torch.dtype) -> tuple[Any, ...]:
    """``(lower (3), extent (3), counts (3), 0, 1, 2)``, (x, y, z) order, as numpy scalars of ``dtype``, rounded as
    ``Tessellation.locate`` rounds them (``extent = upper - lower`` computed in ``dtype``); a 2D tessellation's z
    entries are 0, 1, 1 (unused). The constants keep the kernels' arithmetic in ``dtype``. A tuple of one length for
    2D and 3D: the cell lookup reads its entries without an array's reference counting (per point and step), and one
    compiled :func:`_backward` serves both."""
    pad = 3 - len(tess.shape)
    lower = torch.tensor((*tess.lower, *(0.0,) * pad), dtype=dtype)
    extent = torch.tensor((*tess.upper, *(1.0,) * pad), dtype=dtype) - lower
    counts = torch.tensor((*map(float, tess.shape), *(1.0,) * pad), dtype=dtype)
    constants = torch.tensor([0.0, 1.0, 2.0], dtype=dtype)
    return tuple(torch.cat([lower, extent, counts, constants]).numpy())


def _source(points: torch.Tensor) -> torch.Tensor:
    """``points (B, N, n)`` as a contiguous ``(1, N, n)`` when the batch shares them (stride 0), else ``(B, N, n)``."""
    return (points[:1] if points.shape[0] > 1 and points.stride(0) == 0 else points).detach().contiguous()


def integrate_forward(points: torch.Tensor, E: torch.Tensor, tess: Any, steps: int) -> torch.Tensor:
    """End points ``(B, N, n)`` of ``steps`` scheme steps from ``points (B, N, n)`` (the batch may be a stride-0
    broadcast) with step matrices ``E (B, C, n, n + 1)`` of the same dtype; domain coordinates."""
    B, N, n = points.shape
    out = torch.empty((B, N, n), dtype=points.dtype)
    source, table, geom = _source(points).numpy(), E.detach().contiguous().numpy(), _geometry(tess, points.dtype)
    if n == 2:
        parallel_for(_forward2, N, source, table, geom, tess.shape[0], steps, out.numpy())
    else:
        parallel_for(_forward3, N, source, table, geom, tess.shape[0], tess.shape[1], steps, out.numpy())
    return out


def integrate_backward(
    points: torch.Tensor, E: torch.Tensor, tess: Any, steps: int, grad_out: torch.Tensor, moments: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The factorized adjoint for ``grad_out = dL/dx_T (B, N, n)``: ``dL/dpoints (B, N, n)`` and, when ``moments``,
    ``dL/dE (B, C, n, n + 1)`` (the per-cell moments ``sum lambda_{s+1} [x_s; 1]^T``, summed in float64)."""
    threads = torch_threads()
    B, N, n = grad_out.shape
    grad_points = torch.empty((B, N, n), dtype=grad_out.dtype)
    tasks = max(1, min(threads, B * N // 4096)) if moments else max(1, min(4 * threads, B * N // 4096))
    table = np.zeros((tasks, *E.shape) if moments else (tasks, 0, 0, 0, 0))
    ny = tess.shape[1] if n == 3 else 1
    parallel_for(
        _backward, tasks, _source(points).numpy(), E.detach().contiguous().numpy(), _geometry(tess, E.dtype),
        tess.shape[0], ny, steps, grad_out.detach().contiguous().numpy(), grad_points.numpy(), table, moments,
    )  # fmt: skip
    if not moments:
        return grad_points, None
    return grad_points, torch.from_numpy(table.sum(axis=0)).to(E.dtype)


class CPABIntegrateNumba(torch.autograd.Function):
    """``CPABIntegrateNumba.apply(points (B, N, n), A (B, C, n, n + 1), tess, t, steps) -> (B, N, n)``: the expm-step
    scheme and its exact factorized adjoint on CPU tensors (module docstring), with the signature of
    ``regkit.cpab.integrate.CPABIntegrate`` less ``checkpoint_every`` (nothing is checkpointed)."""

    @staticmethod
    def forward(ctx: Any, points: torch.Tensor, A: torch.Tensor, tess: Any, t: float, steps: int) -> torch.Tensor:
        E = step_matrices(A, t / steps)
        ctx.save_for_backward(points, A, E)
        ctx.tess, ctx.t, ctx.steps = tess, t, steps
        return integrate_forward(points, E, tess, steps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        need_points, need_A = ctx.needs_input_grad[:2]
        if not (need_points or need_A):
            return None, None, None, None, None
        points, A, E = ctx.saved_tensors
        grad_points, grad_E = integrate_backward(points, E, ctx.tess, ctx.steps, grad_out, need_A)
        grad_A = None if grad_E is None else step_matrices_vjp(A, ctx.t / ctx.steps, grad_E)
        return (grad_points if need_points else None), grad_A, None, None, None


def cpab_integrate(
    points: torch.Tensor, A: torch.Tensor, tess: Any, *, t: float = 1.0, steps: int = 50
) -> torch.Tensor:
    """Integrate ``points (B, N, n)`` through ``A (B, C, n, n + 1)`` (CPU tensors, float32 or float64) for time ``t``
    in ``steps`` steps; differentiable in both (the factorized adjoint)."""
    if points.device.type != "cpu" or A.device.type != "cpu":
        raise ValueError("the numba CPAB kernels need CPU tensors")
    if points.dtype not in (torch.float32, torch.float64) or A.dtype != points.dtype:
        raise ValueError(f"points and A must share a float32/float64 dtype, got {points.dtype} and {A.dtype}")
    return CPABIntegrateNumba.apply(points, A, tess, float(t), int(steps))

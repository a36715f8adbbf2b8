"""CPAB integration on the CPU, compiled with numba: the facet-resolved expm-step scheme and its factorized adjoint,
one point at a time through all steps, so that nothing of the trajectory goes through memory.

The CPU counterpart of ``regkit_kernels.cpab`` (Triton, CUDA), reached from ``regkit.cpab.integrate`` as the
``"numba"`` backend through ``regkit._backend``. It computes the scheme of ``regkit.cpab.scheme`` (read its module
docstring first), in domain coordinates, (x, y[, z]) order: ``T`` steps of ``h = t / T``; a step from ``x`` in cell
``c = tess.locate(x)`` tries ``y = E_c [x; 1]``, ``E_c`` the top ``n`` rows of ``expm(h [A_c; 0])``. If ``x`` is in
the box and ``y`` has a negative barycentric coordinate for an interior facet of ``c``, the step is taken in *pieces*
instead (``regkit.cpab.crossing``): the in-cell flow as its Taylor polynomial in time up to the first time it reaches
one of those facets (secant start, then safeguarded Newton on the barycentric polynomial), then on in the neighbour
across that facet for the time left, until a piece ends inside its cell or after ``MAX_CROSSINGS`` crossings.

Regular steps reproduce the PyTorch path's arithmetic operation by operation in the points' dtype (the same cell
lookup, the same evaluation order, no fused multiply-adds), so from the same step matrices they give bit-identical
positions. Pieces follow the spec's formulas in the points' dtype, each with a Taylor degree of its own (the smallest
meeting the spec's bound for that piece; the spec takes the largest of a round of pieces): they agree with the spec
to rounding. The step matrices themselves are computed here in float64 (scaling and squaring of a Taylor series,
8 cells side by side in SIMD lanes) and rounded to the points' dtype, so they differ from ``torch.linalg.matrix_exp``'s
by about one rounding.

Backward (the factorized adjoint, with the visited cells and hit times fixed): each point's trajectory is recomputed
from its start into small per-thread buffers (each step's start and cell, each piece's cell, start, time and degree;
no checkpoints in memory: on the CPU a step costs little next to a pass over memory), then swept backward. A regular
step adds its moments ``M_c += lambda_{s+1} [x_s; 1]^T`` and sets ``lambda_s = E_lin(c_s)^T lambda_{s+1}``; a step in
pieces pulls ``lambda`` back through its pieces, the last first, each adding its ``dL/dA`` directly (the quantities
of ``regkit.cpab.crossing.piece_vjp``, by reverse mode through the Taylor recurrence: :func:`_piece_vjp`). Both go
into float64 tables, one of each per thread (summed at the end: the result does not depend on the thread schedule
beyond that final sum's fixed order). ``dL/dA`` is then ``M`` pulled back through the matrix exponential by its
Frechet derivative at ``(h Ã)^T`` (the adjoint of ``expm``), computed by the same scaling and squaring, plus the
pieces' table. Points whose ``dL/dx_T`` is zero (a registration's background, where neither image varies) and cells
whose moments are zero are skipped: their contributions are exactly zero.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import numba
import numpy as np
import torch

from regkit_kernels.numba.threads import parallel_for, torch_threads

MAX_CROSSINGS = 8
"""Facet crossings followed within one step; the time left after them is taken in the last cell
(``regkit.cpab.scheme.MAX_CROSSINGS``)."""
MAX_DEGREE = 60
"""Degree cap of the pieces' Taylor polynomials (``regkit.cpab.crossing.MAX_DEGREE``)."""
NEWTON_ITERATIONS = 8
"""Safeguarded Newton iterations per hit time (``regkit.cpab.crossing.NEWTON_ITERATIONS``)."""
TAYLOR_TOLERANCE = {torch.float32: 1e-10, torch.float64: 1e-17}
"""Where the Taylor series stop, far below the rounding of the dtype the results are kept in: the step matrices' and,
as ``regkit.cpab.crossing.TAYLOR_TOLERANCE``, the pieces' (the first dropped term relative to the step)."""

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
# Cell lookup, regular steps and pieces (the points' dtype, as regkit.cpab.scheme and regkit.cpab.crossing)
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


@numba.njit(cache=True, inline="always")
def _in_box(x0: Any, x1: Any, x2: Any, geom: tuple[Any, ...], n: int) -> bool:
    """Whether ``lower <= x <= upper`` in each of the ``n`` coordinates of ``x = (x0, x1[, x2])`` (false for NaN), as
    ``take_step``."""
    inside = geom[0] <= x0 <= geom[12] and geom[1] <= x1 <= geom[13]
    return inside and (n == 2 or geom[2] <= x2 <= geom[14])


@numba.njit(cache=True, inline="always")
def _leaving(planes: np.ndarray, c: int, y0: Any, y1: Any, y2: Any, zero: Any) -> int:
    """The facets of cell ``c`` with a negative barycentric coordinate ``planes[c, f, :n] . y + planes[c, f, n]`` at
    ``y = (y0, y1[, y2])`` (``y2`` unused in 2D), as a bit mask (bit ``f``: the facet opposite vertex ``f``). Only
    interior facets can be set: the rows of box-boundary facets are the constant 1 (:func:`_facet_tables`)."""
    n = planes.shape[2] - 1
    mask = 0
    for f in range(n + 1):
        acc = planes[c, f, 0] * y0 + planes[c, f, 1] * y1
        if n == 3:
            acc = acc + planes[c, f, 2] * y2
        if acc + planes[c, f, n] < zero:
            mask |= 1 << f
    return mask


@numba.njit(cache=True, inline="always")
def _degree(rho: float, tol: float) -> int:
    """``regkit.cpab.crossing.taylor_degree``: the smallest ``K >= 1`` with ``rho^(K + 1) / (K + 1)! <= tol``, at
    most ``MAX_DEGREE``."""
    term = rho
    for degree in range(1, MAX_DEGREE):
        term *= rho / (degree + 1)
        if term <= tol:
            return degree
    return MAX_DEGREE


@numba.njit(cache=True, inline="always")
def _linear_norm(A: np.ndarray, b: int, c: int) -> float:
    """``||A_lin||_1`` (largest column sum of absolute values) of cell ``c``'s velocity, in float64."""
    n = A.shape[2]
    norm = 0.0
    for j in range(n):
        col = 0.0
        for i in range(n):
            col += abs(np.float64(A[b, c, i, j]))
        norm = max(norm, col)
    return norm


@numba.njit(cache=True, inline="always")
def _flow_coefficients(A: np.ndarray, b: int, c: int, x: np.ndarray, degree: int, q: np.ndarray, one: Any) -> None:
    """``q[k] (n,)``, ``k = 0 .. degree``: the Taylor coefficients of cell ``c``'s flow from ``x (n,)``,
    ``q_0 = x``, ``q_1 = A_lin x + a``, ``q_k = A_lin q_{k-1} / k`` (``regkit.cpab.crossing.flow_coefficients``)."""
    n = x.shape[0]
    for i in range(n):
        q[0, i] = x[i]
    for i in range(n):
        acc = A[b, c, i, 0] * x[0]
        for j in range(1, n):
            acc = acc + A[b, c, i, j] * x[j]
        q[1, i] = acc + A[b, c, i, n]
    k = one
    for order in range(2, degree + 1):
        k = k + one
        for i in range(n):
            acc = A[b, c, i, 0] * q[order - 1, 0]
            for j in range(1, n):
                acc = acc + A[b, c, i, j] * q[order - 1, j]
            q[order, i] = acc / k


@numba.njit(cache=True, inline="always")
def _evaluate(q: np.ndarray, degree: int, tau: Any, out: np.ndarray) -> None:
    """``out (n,) = sum_{k <= degree} tau^k q[k]`` by Horner's rule (``regkit.cpab.crossing.evaluate``)."""
    for i in range(out.shape[0]):
        acc = q[degree, i]
        for k in range(degree - 1, -1, -1):
            acc = acc * tau + q[k, i]
        out[i] = acc


@numba.njit(cache=True, inline="always")
def _horner(coef: np.ndarray, degree: int, tau: Any) -> Any:
    """``sum_{k <= degree} tau^k coef[k]`` by Horner's rule."""
    acc = coef[degree]
    for k in range(degree - 1, -1, -1):
        acc = acc * tau + coef[k]
    return acc


@numba.njit(cache=True, inline="always")
def _hit_time(
    q: np.ndarray,
    degree: int,
    planes: np.ndarray,
    c: int,
    f: int,
    left: Any,
    coef: np.ndarray,
    dcoef: np.ndarray,
    geom: tuple[Any, ...],
) -> Any:
    """The time in ``[0, left]`` at which the flow ``q`` (:func:`_flow_coefficients`) first reaches facet ``f`` of
    cell ``c``, whose barycentric coordinate is negative at ``left`` (``regkit.cpab.crossing.hit_times`` for one
    facet): ``0`` where it is not positive at the start, else the secant estimate refined by at most
    ``NEWTON_ITERATIONS`` safeguarded Newton steps on the barycentric polynomial (stopping early at a fixed point,
    where the remaining steps would keep it). ``coef``, ``dcoef``: scratch ``(MAX_DEGREE + 1,)``."""
    n = q.shape[1]
    zero, one, two = geom[9], geom[10], geom[11]
    for k in range(degree + 1):
        acc = q[k, 0] * planes[c, f, 0]
        for i in range(1, n):
            acc = acc + q[k, i] * planes[c, f, i]
        coef[k] = acc
    coef[0] = coef[0] + planes[c, f, n]
    start = coef[0]
    if not start > zero:
        return zero
    tau = left * start / (start - _horner(coef, degree, left))  # the secant estimate
    if tau != tau:
        tau = zero
    tau = min(max(tau, zero), left)
    k = zero
    for order in range(1, degree + 1):
        k = k + one
        dcoef[order - 1] = coef[order] * k
    lo, hi = zero, left  # tau stays in [lo, hi]
    for _ in range(NEWTON_ITERATIONS):
        g, slope = coef[degree], dcoef[degree - 1]  # both polynomials by Horner's rule, side by side
        for order in range(degree - 1, 0, -1):
            g = g * tau + coef[order]
            slope = slope * tau + dcoef[order - 1]
        g = g * tau + coef[0]
        if g > zero:
            lo = tau
        else:
            hi = tau
        newton = tau - g / slope
        if newton == tau:
            break
        tau = newton if lo <= newton <= hi else (lo + hi) / two
    return tau


@numba.njit(cache=True, inline="always")
def _pieces(
    b: int,
    c: int,
    x: np.ndarray,
    leaving: int,
    A: np.ndarray,
    planes: np.ndarray,
    neighbors: np.ndarray,
    geom: tuple[Any, ...],
    h: Any,
    tol: float,
    work: tuple[np.ndarray, ...],
    record: tuple[np.ndarray, ...],
    offset: int,
) -> int:
    """A step of batch element ``b`` in pieces from ``x (n,)`` in cell ``c``, whose regular step leaves ``c``
    through the facets of the bit mask ``leaving`` (:func:`_leaving`): overwrites ``x`` with the step's end and returns
    the number of pieces, whose cells, starts, times and degrees it writes at ``offset``, ``offset + 1``, ... of
    ``record = (cells, starts (., n), times, degrees)``. Each piece's degree is ``taylor_degree`` of its own time
    times its cell's ``||A_lin||_1``. ``work = (y (n,), q (MAX_DEGREE + 1, n), coef, dcoef (MAX_DEGREE + 1,))``:
    scratch in the points' dtype (:func:`_step_work`)."""
    n = x.shape[0]
    y, q, coef, dcoef = work
    cells, starts, times, degrees = record
    zero = geom[9]
    cell, left = c, h
    for crossed in range(MAX_CROSSINGS + 1):
        degree = _degree(np.float64(left) * _linear_norm(A, b, cell), tol)
        _flow_coefficients(A, b, cell, x, degree, q, geom[10])
        if crossed:
            _evaluate(q, degree, left, y)
            leaving = _leaving(planes, cell, y[0], y[1], y[n - 1], zero)
        piece = offset + crossed
        cells[piece], degrees[piece] = cell, degree
        for i in range(n):
            starts[piece, i] = x[i]
        if leaving == 0 or crossed == MAX_CROSSINGS:
            times[piece] = left
            _evaluate(q, degree, left, x)
            return crossed + 1
        facet, tau = -1, zero
        for f in range(n + 1):
            if (leaving >> f) & 1:
                hit = _hit_time(q, degree, planes, cell, f, left, coef, dcoef, geom)
                if facet < 0 or hit < tau:  # the first facet of the earliest hit, as torch.min
                    facet, tau = f, hit
        times[piece] = tau
        _evaluate(q, degree, tau, x)
        cell, left = neighbors[cell, facet], left - tau
    return MAX_CROSSINGS + 1  # not reached: the last round ends the step


@numba.njit(cache=True, inline="always")
def _piece_vjp(
    A: np.ndarray,
    b: int,
    c: int,
    x: np.ndarray,
    tau: Any,
    degree: int,
    lam: np.ndarray,
    table: np.ndarray,
    want_A: bool,
    geom: tuple[Any, ...],
    work: tuple[np.ndarray, ...],
) -> None:
    """The adjoint of a piece of batch element ``b`` in cell ``c`` from ``x (n,)`` for time ``tau`` (degree
    ``degree``, ``tau`` fixed): ``lam (n,)`` goes from ``dL/dy`` to ``dL/dx`` in place and, when ``want_A``,
    ``dL/dA`` is added to ``table[b, c] (n, n + 1)`` (float64). The quantities of ``regkit.cpab.crossing.piece_vjp``
    (its closed form, to rounding), by reverse mode through the Taylor recurrence in ``O(K n^2)`` instead of
    ``O(K^2 n)``: with ``z_0 = x``, ``z_1 = tau (A_lin x + a)`` and ``z_k = s_k A_lin z_{k-1}``, ``s_k = tau / k``
    (so that ``y = sum_k z_k``), the adjoints are ``zbar_K = lam``, ``zbar_{k-1} = lam + s_k A_lin^T zbar_k`` down to
    ``dL/dx = zbar_0``, ``dL/dA_lin = sum_k s_k zbar_k z_{k-1}^T`` and ``dL/da = s_1 zbar_1``. ``work``: scratch
    (:func:`_vjp_work`)."""
    n = lam.shape[0]
    one = geom[10]
    z, zbar, previous, G = work
    for i in range(n):
        z[0, i] = x[i]
    for i in range(n):
        acc = A[b, c, i, 0] * x[0]
        for j in range(1, n):
            acc = acc + A[b, c, i, j] * x[j]
        z[1, i] = tau * (acc + A[b, c, i, n])
    k = one
    for order in range(2, degree + 1):
        k = k + one
        scale = tau / k
        for i in range(n):
            acc = A[b, c, i, 0] * z[order - 1, 0]
            for j in range(1, n):
                acc = acc + A[b, c, i, j] * z[order - 1, j]
            z[order, i] = scale * acc
    if want_A:
        for r in range(n):
            for j in range(n + 1):
                G[r, j] = 0.0
    for i in range(n):
        zbar[i] = lam[i]
    for order in range(degree, 0, -1):
        scale = tau / k
        k = k - one
        if want_A:
            for r in range(n):
                weight = np.float64(scale * zbar[r])
                for j in range(n):
                    G[r, j] += weight * z[order - 1, j]
                if order == 1:
                    G[r, n] += weight
        for j in range(n):
            acc = A[b, c, 0, j] * zbar[0]
            for r in range(1, n):
                acc = acc + A[b, c, r, j] * zbar[r]
            previous[j] = lam[j] + scale * acc
        for j in range(n):
            zbar[j] = previous[j]
    for i in range(n):
        lam[i] = zbar[i]
    if want_A:
        for r in range(n):
            for j in range(n + 1):
                table[b, c, r, j] += G[r, j]


@numba.njit(cache=True, inline="always")
def _step_work(n: int, dtype: Any) -> tuple[np.ndarray, ...]:
    """Scratch of :func:`_pieces` in ``dtype``: ``y (n,)``, ``q (MAX_DEGREE + 1, n)``, ``coef``, ``dcoef``."""
    return (
        np.empty(n, dtype=dtype),
        np.empty((MAX_DEGREE + 1, n), dtype=dtype),
        np.empty(MAX_DEGREE + 1, dtype=dtype),
        np.empty(MAX_DEGREE + 1, dtype=dtype),
    )


@numba.njit(cache=True, inline="always")
def _vjp_work(n: int, dtype: Any) -> tuple[np.ndarray, ...]:
    """Scratch of :func:`_piece_vjp`: ``z (MAX_DEGREE + 1, n)``, ``zbar``, ``previous (n,)`` in ``dtype``, ``G (n,
    n + 1)`` float64."""
    return (
        np.empty((MAX_DEGREE + 1, n), dtype=dtype),
        np.empty(n, dtype=dtype),
        np.empty(n, dtype=dtype),
        np.empty((n, n + 1)),
    )


@numba.njit(cache=True, inline="always")
def _records(pieces: int, n: int, dtype: Any) -> tuple[np.ndarray, ...]:
    """Room for ``pieces`` pieces (:func:`_pieces`): cells, starts ``(pieces, n)``, times and degrees."""
    return (
        np.empty(pieces, dtype=np.int64),
        np.empty((pieces, n), dtype=dtype),
        np.empty(pieces, dtype=dtype),
        np.empty(pieces, dtype=np.int64),
    )


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _forward(
    first: int,
    last: int,
    points: np.ndarray,
    A: np.ndarray,
    E: np.ndarray,
    planes: np.ndarray,
    neighbors: np.ndarray,
    geom: tuple[Any, ...],
    nx: int,
    ny: int,
    h: Any,
    tol: float,
    steps: int,
    out: np.ndarray,
) -> None:
    """End points ``out (B, N, n)`` of points ``first`` to ``last - 1`` of every batch element. The point is kept in
    scalars, ``x2`` (and ``y2``) zero in 2D: the branches on ``n`` are the same for every point and step. A step in
    pieces goes through the array ``x``; the pieces' records are scratch here."""
    B, _, n = out.shape
    zero = geom[9]
    shared = points.shape[0] == 1
    x = np.empty(n, dtype=out.dtype)
    work, record = _step_work(n, out.dtype), _records(MAX_CROSSINGS + 1, n, out.dtype)
    for b in range(B):
        src = 0 if shared else b
        for p in range(first, last):
            x0, x1, x2 = points[src, p, 0], points[src, p, 1], zero
            if n == 3:
                x2 = points[src, p, 2]
            for _ in range(steps):
                if n == 2:
                    c = _cell2(x0, x1, geom, nx)
                    y0, y1, y2 = (
                        (E[b, c, 0, 0] * x0 + E[b, c, 0, 1] * x1) + E[b, c, 0, 2],
                        (E[b, c, 1, 0] * x0 + E[b, c, 1, 1] * x1) + E[b, c, 1, 2],
                        zero,
                    )
                else:
                    c = _cell3(x0, x1, x2, geom, nx, ny)
                    y0, y1, y2 = (
                        ((E[b, c, 0, 0] * x0 + E[b, c, 0, 1] * x1) + E[b, c, 0, 2] * x2) + E[b, c, 0, 3],
                        ((E[b, c, 1, 0] * x0 + E[b, c, 1, 1] * x1) + E[b, c, 1, 2] * x2) + E[b, c, 1, 3],
                        ((E[b, c, 2, 0] * x0 + E[b, c, 2, 1] * x1) + E[b, c, 2, 2] * x2) + E[b, c, 2, 3],
                    )
                leaving = _leaving(planes, c, y0, y1, y2, zero)
                if leaving == 0 or not _in_box(x0, x1, x2, geom, n):
                    x0, x1, x2 = y0, y1, y2
                    continue
                x[0], x[1] = x0, x1
                if n == 3:
                    x[2] = x2
                _pieces(b, c, x, leaving, A, planes, neighbors, geom, h, tol, work, record, 0)
                x0, x1 = x[0], x[1]
                if n == 3:
                    x2 = x[2]
            out[b, p, 0], out[b, p, 1] = x0, x1
            if n == 3:
                out[b, p, 2] = x2


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _backward(
    first_task: int,
    last_task: int,
    points: np.ndarray,
    A: np.ndarray,
    E: np.ndarray,
    planes: np.ndarray,
    neighbors: np.ndarray,
    geom: tuple[Any, ...],
    nx: int,
    ny: int,
    h: Any,
    tol: float,
    steps: int,
    grad_out: np.ndarray,
    grad_points: np.ndarray,
    moments: np.ndarray,
    direct: np.ndarray,
    want_A: bool,
) -> None:
    """Per point of tasks ``first_task`` to ``last_task - 1``: recompute the trajectory, sweep the adjoint back;
    ``moments`` and ``direct (tasks, B, C, n, n + 1)`` float64, one table of each per task (the points split into
    ``tasks`` contiguous ranges): the regular steps' ``dL/dE`` and the pieces' ``dL/dA``. A step's pieces are
    recorded at ``first_piece[s]`` to ``first_piece[s + 1] - 1`` (none for a regular step)."""
    B, N, n = grad_out.shape
    dtype = grad_out.dtype
    zero = geom[9]
    tasks = moments.shape[0]
    shared = points.shape[0] == 1
    total = B * N
    for task in range(first_task, last_task):
        xs = np.empty((steps + 1, n), dtype=dtype)
        cells = np.empty(steps, dtype=np.int64)
        first_piece = np.zeros(steps + 1, dtype=np.int64)
        x = np.empty(n, dtype=dtype)
        work, record = _step_work(n, dtype), _records(steps * (MAX_CROSSINGS + 1), n, dtype)
        piece_cells, piece_starts, piece_times, piece_degrees = record
        vjp_work = _vjp_work(n, dtype)
        lam = np.empty(n, dtype=dtype)
        new = np.empty(n, dtype=dtype)
        table, piece_table = moments[task], direct[task]
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
                first_piece[s + 1] = first_piece[s]
                leaving = _leaving(planes, c, xs[s + 1, 0], xs[s + 1, 1], xs[s + 1, n - 1], zero)
                if leaving == 0 or not _in_box(xs[s, 0], xs[s, 1], xs[s, n - 1], geom, n):
                    continue
                for i in range(n):
                    x[i] = xs[s, i]
                first_piece[s + 1] += _pieces(
                    b, c, x, leaving, A, planes, neighbors, geom, h, tol, work, record, first_piece[s]
                )
                for i in range(n):
                    xs[s + 1, i] = x[i]
            for i in range(n):
                lam[i] = grad_out[b, p, i]
            for s in range(steps - 1, -1, -1):
                if first_piece[s + 1] > first_piece[s]:  # a step in pieces: back through them, the last first
                    for piece in range(first_piece[s + 1] - 1, first_piece[s] - 1, -1):
                        _piece_vjp(
                            A, b, piece_cells[piece], piece_starts[piece], piece_times[piece], piece_degrees[piece],
                            lam, piece_table, want_A, geom, vjp_work,
                        )  # fmt: skip
                    continue
                c = cells[s]
                if want_A:
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


def _blocks(cells: np.ndarray) -> int:
    """How many blocks of ``_LANES`` cells :func:`_exponentials` takes for ``cells``."""
    return (cells.shape[0] + _LANES - 1) // _LANES


def step_matrices(A: torch.Tensor, h: float) -> torch.Tensor:
    """Per-cell step matrices ``E (..., C, n, n + 1)`` = the top ``n`` rows of ``expm(h [A_c; 0])``, in ``A``'s dtype
    (computed in float64, to ``TAYLOR_TOLERANCE[dtype]``, and rounded once to ``A``'s dtype). ``A (..., C, n,
    n + 1)``: the cells' affine velocities, domain coordinates. Not differentiable (:class:`CPABIntegrateNumba`
    differentiates through :func:`step_matrices_vjp`)."""
    flat = A.detach().reshape(-1, *A.shape[-2:]).to(torch.float64).contiguous().numpy()
    E = np.empty_like(flat)
    cells = np.arange(flat.shape[0])
    no_grad = np.empty((0, *flat.shape[1:]))
    parallel_for(_exponentials, _blocks(cells), flat, float(h), no_grad, cells, E, TAYLOR_TOLERANCE[A.dtype], False)
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
        TAYLOR_TOLERANCE[A.dtype], True,
    )  # fmt: skip
    return out.to(A.dtype).view(A.shape)


def _geometry(tess: Any, dtype: torch.dtype) -> tuple[Any, ...]:
    """``(lower (3), extent (3), counts (3), 0, 1, 2, upper (3))``, (x, y, z) order, as numpy scalars of ``dtype``,
    rounded as ``Tessellation.locate`` and ``take_step`` round them (``extent = upper - lower`` computed in ``dtype``);
    a 2D tessellation's z entries are 0, 1, 1, 1 (unused). The constants keep the kernels' arithmetic in ``dtype``.
    A tuple of one length for 2D and 3D: the kernels read its entries without an array's reference counting (per
    point and step), and one compiled kernel serves both."""
    pad = 3 - len(tess.shape)
    lower = torch.tensor((*tess.lower, *(0.0,) * pad), dtype=dtype)
    upper = torch.tensor((*tess.upper, *(1.0,) * pad), dtype=dtype)
    counts = torch.tensor((*map(float, tess.shape), *(1.0,) * pad), dtype=dtype)
    constants = torch.tensor([0.0, 1.0, 2.0], dtype=dtype)
    return tuple(torch.cat([lower, upper - lower, counts, constants, upper]).numpy())


@cache
def _facet_tables(tess: Any, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """``tess.facet_planes()`` as the kernels read it: ``planes (C, n + 1, n + 1)`` in ``dtype`` (row ``f`` of cell
    ``c`` gives the barycentric coordinate of its vertex ``f``, ``planes[c, f, :n] . x + planes[c, f, n]`` at a
    domain point ``x``) and ``neighbors (C, n + 1)`` int64 (the cell across the facet opposite vertex ``f``, ``-1``
    on the box boundary). The rows of box-boundary facets are replaced by the constant 1: those facets never stop a
    piece, and a step's test for leaving its cell then needs no neighbour lookup. Cached per tessellation and
    dtype."""
    planes, neighbors = tess.facet_planes()
    n = planes.shape[-1] - 1
    constant = torch.zeros(n + 1, dtype=planes.dtype)
    constant[n] = 1.0
    planes[neighbors < 0] = constant
    return planes.to(dtype).contiguous().numpy(), neighbors.to(torch.int64).contiguous().numpy()


def _source(points: torch.Tensor) -> torch.Tensor:
    """``points (B, N, n)`` as a contiguous ``(1, N, n)`` when the batch shares them (stride 0), else ``(B, N, n)``."""
    return (points[:1] if points.shape[0] > 1 and points.stride(0) == 0 else points).detach().contiguous()


def _scheme(A: torch.Tensor, E: torch.Tensor, tess: Any, h: float) -> tuple[Any, ...]:
    """The kernels' arguments after the points: ``A``, ``E`` (contiguous numpy), the facet tables, the geometry,
    ``nx``, ``ny``, the step ``h`` as a scalar of the dtype and the Taylor tolerance of the pieces."""
    dtype = A.dtype
    planes, neighbors = _facet_tables(tess, dtype)
    ny = tess.shape[1] if len(tess.shape) == 3 else 1
    step = torch.tensor([h], dtype=dtype).numpy()[0]
    return (
        A.detach().contiguous().numpy(), E.detach().contiguous().numpy(), planes, neighbors,
        _geometry(tess, dtype), tess.shape[0], ny, step, TAYLOR_TOLERANCE[dtype],
    )  # fmt: skip


def integrate_forward(
    points: torch.Tensor, A: torch.Tensor, E: torch.Tensor, tess: Any, h: float, steps: int
) -> torch.Tensor:
    """End points ``(B, N, n)`` of ``steps`` scheme steps of ``h`` from ``points (B, N, n)`` (the batch may be a
    stride-0 broadcast) through the velocities ``A (B, C, n, n + 1)`` with step matrices ``E (B, C, n, n + 1)``
    (``expm(h [A_c; 0])[:n]``), all of one dtype; domain coordinates."""
    B, N, n = points.shape
    out = torch.empty((B, N, n), dtype=points.dtype)
    parallel_for(_forward, N, _source(points).numpy(), *_scheme(A, E, tess, h), steps, out.numpy())
    return out


def integrate_backward(
    points: torch.Tensor,
    A: torch.Tensor,
    E: torch.Tensor,
    tess: Any,
    h: float,
    steps: int,
    grad_out: torch.Tensor,
    want_A: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The factorized adjoint for ``grad_out = dL/dx_T (B, N, n)`` (arguments as :func:`integrate_forward`):
    ``dL/dpoints (B, N, n)`` and, when ``want_A``, the regular steps' ``dL/dE (B, C, n, n + 1)`` (the per-cell moments
    ``sum lambda_{s+1} [x_s; 1]^T``) and the pieces' ``dL/dA (B, C, n, n + 1)``, both summed in float64."""
    threads = torch_threads()
    B, N, n = grad_out.shape
    grad_points = torch.empty((B, N, n), dtype=grad_out.dtype)
    tasks = max(1, min(threads, B * N // 4096)) if want_A else max(1, min(4 * threads, B * N // 4096))
    shape = (tasks, *E.shape) if want_A else (tasks, 0, 0, 0, 0)
    moments, direct = np.zeros(shape), np.zeros(shape)
    parallel_for(
        _backward, tasks, _source(points).numpy(), *_scheme(A, E, tess, h), steps,
        grad_out.detach().contiguous().numpy(), grad_points.numpy(), moments, direct, want_A,
    )  # fmt: skip
    if not want_A:
        return grad_points, None, None
    return grad_points, torch.from_numpy(moments.sum(axis=0)).to(E.dtype), torch.from_numpy(direct.sum(axis=0))


class CPABIntegrateNumba(torch.autograd.Function):
    """``CPABIntegrateNumba.apply(points (B, N, n), A (B, C, n, n + 1), tess, t, steps) -> (B, N, n)``: the
    facet-resolved expm-step scheme and its exact factorized adjoint on CPU tensors (module docstring), with the
    signature of ``regkit.cpab.integrate.CPABIntegrate`` less ``checkpoint_every`` (nothing is checkpointed)."""

    @staticmethod
    def forward(ctx: Any, points: torch.Tensor, A: torch.Tensor, tess: Any, t: float, steps: int) -> torch.Tensor:
        h = t / steps
        E = step_matrices(A, h)
        ctx.save_for_backward(points, A, E)
        ctx.tess, ctx.h, ctx.steps = tess, h, steps
        return integrate_forward(points, A, E, tess, h, steps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        need_points, need_A = ctx.needs_input_grad[:2]
        if not (need_points or need_A):
            return None, None, None, None, None
        points, A, E = ctx.saved_tensors
        grad_points, grad_E, direct = integrate_backward(points, A, E, ctx.tess, ctx.h, ctx.steps, grad_out, need_A)
        grad_A = None
        if grad_E is not None and direct is not None:
            grad_A = (step_matrices_vjp(A, ctx.h, grad_E).to(torch.float64) + direct).to(A.dtype)
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

"""Following a CPA flow across facets: the in-cell flow as a polynomial in time, the time it reaches a facet, and the
adjoint of one piece of it.

Coordinates and shapes. Points are domain points ``(P, n)``, one per *piece* (a stretch of a trajectory inside one
cell); ``A (P, n, n + 1)`` is each piece's cell velocity, ``v(x) = A [x; 1] = A_lin x + a``; times ``(P,)``.

The in-cell flow from ``x`` for time ``tau`` is ``expm(tau Ã) [x; 1]`` with ``Ã = [A; 0]``, summed here as its Taylor
polynomial in ``tau``: ``phi(tau) = sum_{k=0..K} tau^k q_k`` with ``q_0 = x``, ``q_1 = v(x)``,
``q_k = A_lin q_{k-1} / k`` (:func:`flow_coefficients`). The degree ``K`` (:func:`taylor_degree`) makes the first
dropped term at most ``TAYLOR_TOLERANCE[dtype]`` relative to the step: for ``rho = tau ||A_lin||_1`` it is the
smallest ``K`` with ``rho^(K + 1) / (K + 1)! <= tol``, so the polynomial is the exact in-cell flow to the dtype's
rounding. Barycentric coordinates along the flow are polynomials too, and a facet's hit time is the first root of
one of them (:func:`hit_times`, safeguarded Newton).

Gradients. :func:`piece_vjp` is the exact adjoint of ``phi`` at a fixed ``tau``, in closed form (what the compiled
kernels compute point by point); :func:`evaluate` of :func:`flow_coefficients` is differentiable by autograd and gives
the same. Hit times need no derivative of their own: the field is continuous across facets, so moving a hit time
moves the end of one piece and the start of the next by the same velocity, and the two terms cancel.
"""

from __future__ import annotations

import math

import torch

TAYLOR_TOLERANCE = {torch.float32: 1e-10, torch.float64: 1e-17}
"""Bound on the first dropped Taylor term of a piece's flow, relative to its step (far below each dtype's rounding)."""
MAX_DEGREE = 60
"""Degree cap of the Taylor polynomials (reached at ``rho`` about 20: a step far longer than any useful one)."""
NEWTON_ITERATIONS = 8
"""Safeguarded Newton iterations per hit time (from the secant estimate; quadratic convergence)."""


def taylor_degree(rho: float, dtype: torch.dtype) -> int:
    """The smallest degree ``K >= 1`` with ``rho^(K + 1) / (K + 1)! <= TAYLOR_TOLERANCE[dtype]`` (capped at
    ``MAX_DEGREE``), for ``rho = tau ||A_lin||_1`` the longest piece's time times its velocity gradient's norm."""
    tol = TAYLOR_TOLERANCE[dtype]
    term = rho  # rho^1 / 1!
    for degree in range(1, MAX_DEGREE):
        term *= rho / (degree + 1)
        if term <= tol:
            return degree
    return MAX_DEGREE


def linear_norm(A: torch.Tensor) -> torch.Tensor:
    """``||A_lin||_1`` (largest column sum of absolute values) of velocities ``A (..., n, n + 1)``: ``(...,)``."""
    return A[..., :-1].abs().sum(-2).amax(-1)


def flow_coefficients(A: torch.Tensor, x: torch.Tensor, degree: int) -> torch.Tensor:
    """``q (degree + 1, P, n)``: ``phi(tau) = sum_k tau^k q_k`` is the in-cell flow of ``A (P, n, n + 1)`` from
    ``x (P, n)`` (module docstring). Differentiable in ``A`` and ``x``."""
    n = x.shape[-1]
    lin = A[..., :n]
    q = [x, torch.einsum("pij,pj->pi", lin, x) + A[..., n]]
    for k in range(2, degree + 1):
        q.append(torch.einsum("pij,pj->pi", lin, q[-1]) / k)
    return torch.stack(q)


def evaluate(q: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """``sum_k tau^k q_k`` for coefficients ``q (K + 1, P, ...)`` and times ``tau (P,)``, by Horner's rule."""
    t = tau.reshape(-1, *([1] * (q.ndim - 2)))
    out = q[-1]
    for k in range(q.shape[0] - 2, -1, -1):
        out = out * t + q[k]
    return out


def barycentric(planes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Barycentric coordinates ``(..., n + 1)`` of points ``x (..., n)`` in cells with rows ``planes (..., n + 1,
    n + 1)`` (``Tessellation.facet_planes``)."""
    n = x.shape[-1]
    return torch.einsum("...fi,...i->...f", planes[..., :n], x) + planes[..., n]


def hit_times(
    q: torch.Tensor, planes: torch.Tensor, leaving: torch.Tensor, left: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """When and where pieces first reach a facet they leave through: ``(tau (P,), facet (P,) int64)``.

    ``q (K + 1, P, n)``: the pieces' flows (:func:`flow_coefficients`); ``planes (P, n + 1, n + 1)``: their cells'
    barycentric rows; ``leaving (P, n + 1)`` bool: the facets whose barycentric coordinate is negative at the end of
    the time ``left (P,)``. For each such facet the root of its barycentric polynomial in ``[0, left]`` is found by
    safeguarded Newton (bracketed, bisecting when a step leaves the bracket; ``0`` when the point starts on or past
    the facet); the earliest wins. Pieces that leave through no facet get ``tau = inf``.
    """
    n = q.shape[-1]
    coef = torch.einsum("kpi,pfi->kpf", q, planes[..., :n])  # (K + 1, P, n + 1): barycentric polynomials
    coef[0] += planes[..., n]
    start = coef[0]
    end = evaluate(coef, left)
    span = left.unsqueeze(-1).expand_as(start)
    lo, hi = torch.zeros_like(start), span.clone()
    tau = (span * start / (start - end)).nan_to_num(0.0).clamp(min=0.0).minimum(span)  # the secant estimate
    dcoef = coef[1:] * torch.arange(1, coef.shape[0], dtype=q.dtype, device=q.device).view(-1, 1, 1)
    for _ in range(NEWTON_ITERATIONS):
        g = _poly(coef, tau)
        slope = _poly(dcoef, tau)
        inside = g > 0
        lo, hi = torch.where(inside, tau, lo), torch.where(inside, hi, tau)
        newton = tau - g / slope
        tau = torch.where((newton >= lo) & (newton <= hi), newton, 0.5 * (lo + hi))
    tau = torch.where(start > 0, tau, torch.zeros_like(tau))
    tau = torch.where(leaving, tau, torch.full_like(tau, math.inf))
    first, facet = tau.min(-1)
    return first, facet


def _poly(coef: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """``sum_k tau^k coef_k`` elementwise, for ``coef (K + 1, *S)`` and ``tau (*S)``, by Horner's rule."""
    out = coef[-1]
    for k in range(coef.shape[0] - 2, -1, -1):
        out = out * tau + coef[k]
    return out


def piece_vjp(
    A: torch.Tensor, x: torch.Tensor, tau: torch.Tensor, lam: torch.Tensor, degree: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The adjoint of a piece ``y = phi(tau)`` (degree ``degree``) at a fixed ``tau``: for ``lam = dL/dy (P, n)``,
    returns ``dL/dx (P, n)`` and ``dL/dA (P, n, n + 1)``.

    With ``alpha_j = (A_lin^T)^j lam``, ``b_0 = [x; 1]``, ``b_i = [A_lin^(i-1) v(x); 0]`` and ``w_k = tau^k / k!``:
    ``dL/dx = sum_{k=0..K} w_k alpha_k`` and ``dL/dA = sum_{j=0..K-1} alpha_j c_j^T`` with
    ``c_j = sum_{i=0..K-1-j} w_{i+j+1} b_i`` (the derivative of ``sum_k w_k Ã^k [x; 1]``, term by term). Summed in
    float64 (``alpha_j`` grows like ``||A||^j`` while ``w_j`` shrinks like ``tau^j / j!``) and returned in the inputs'
    dtype.
    """
    dtype = x.dtype
    A, x, tau, lam = A.double(), x.double(), tau.double(), lam.double()  # (A^T)^j lam may overflow float32
    n = x.shape[-1]
    K = degree
    lin, lin_t = A[..., :n], A[..., :n].transpose(-1, -2)
    alpha = [lam]
    for _ in range(K):
        alpha.append(torch.einsum("pij,pj->pi", lin_t, alpha[-1]))
    b = [torch.cat([x, torch.ones_like(x[..., :1])], -1)]
    m = torch.einsum("pij,pj->pi", lin, x) + A[..., n]
    for _ in range(1, K):
        b.append(torch.cat([m, torch.zeros_like(m[..., :1])], -1))
        m = torch.einsum("pij,pj->pi", lin, m)
    w = [torch.ones_like(tau)]
    for k in range(1, K + 1):
        w.append(w[-1] * tau / k)
    grad_x = alpha[0].clone()
    for k in range(1, K + 1):
        grad_x = grad_x + w[k].unsqueeze(-1) * alpha[k]
    grad_A = torch.zeros_like(A)
    for j in range(K):
        c = w[j + 1].unsqueeze(-1) * b[0]
        for i in range(1, K - j):
            c = c + w[i + j + 1].unsqueeze(-1) * b[i]
        grad_A = grad_A + alpha[j].unsqueeze(-1) * c.unsqueeze(-2)
    return grad_x.to(dtype), grad_A.to(dtype)


def piece_jacobian(A: torch.Tensor, tau: torch.Tensor, J: torch.Tensor, degree: int) -> torch.Tensor:
    """``d phi / dx @ J`` for a piece of time ``tau (P,)``: ``expm(tau A_lin) J`` summed to degree ``degree``, for
    ``J (P, n, m)``."""
    n = A.shape[-2]
    lin = A[..., :n]
    t = tau.view(-1, 1, 1)
    term, out = J, J
    for k in range(1, degree + 1):
        term = lin @ term * (t / k)
        out = out + term
    return out


def piece_jvp(A: torch.Tensor, x: torch.Tensor, tau: torch.Tensor, dA: torch.Tensor, degree: int) -> torch.Tensor:
    """The derivative of a piece's end ``phi(tau)`` (degree ``degree``, ``tau`` fixed) along velocity directions
    ``dA (m, P, n, n + 1)``, with ``x`` fixed: ``(m, P, n)``, from ``dq_1 = dA [x; 1]``,
    ``dq_k = (dA_lin q_{k-1} + A_lin dq_{k-1}) / k``."""
    n = x.shape[-1]
    lin, dlin = A[..., :n], dA[..., :n]
    q = torch.einsum("pij,pj->pi", lin, x) + A[..., n]
    dq = torch.einsum("mpij,pj->mpi", dlin, x) + dA[..., n]
    w = tau.unsqueeze(-1)
    out = w * dq
    for k in range(2, degree + 1):
        dq = (torch.einsum("mpij,pj->mpi", dlin, q) + torch.einsum("pij,mpj->mpi", lin, dq)) / k
        q = torch.einsum("pij,pj->pi", lin, q) / k
        w = w * tau.unsqueeze(-1)
        out = out + w * dq
    return out

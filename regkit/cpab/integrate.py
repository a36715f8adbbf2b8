"""Integration of CPA velocity fields and the exact factorized gradient: the functions users call.

Coordinates and shapes. Every point is in *domain* coordinates of the tessellation (the box ``[lower, upper]``), in
(x, y[, z]) order. ``A`` holds one affine velocity per cell, ``v(x) = A_c [x; 1]``: shape ``(C, n, n + 1)`` for one
transformation or ``(B, C, n, n + 1)`` for a batch of ``B``. Points are ``(N, n)`` (shared by the whole batch) or
``(B, N, n)`` (one set per transformation). Results are ``(B, N, n)`` when either input has a batch dimension, else
``(N, n)``.

Every function here computes the facet-resolved expm-step scheme of ``regkit.cpab.scheme`` (read its docstring): the
exact flow of the CPA field, followed from cell to cell, in ``steps`` steps that cost one matrix product each where
no facet is crossed. Gradients hold the visited cells and hit times fixed (the exact flow's gradient, the field being
continuous): :func:`integrate_reference` by autograd through every step, :class:`CPABIntegrate` by the factorized
adjoint (per-cell moments, then once through the matrix exponential, then ``B^T`` by autograd of
``CPABasis.to_A``), the compiled faces by the same in kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from regkit._backend import load_kernels, resolve_backend
from regkit.cpab.scheme import (
    DEFAULT_STEPS,
    batched,
    check_steps,
    step_jacobian,
    step_log_determinant,
    step_matrices,
    step_matrices_vjp,
    step_vjp,
    take_step,
    unbatched,
)
from regkit.cpab.tessellation import Tessellation

FACES = ("reference", "torch", "numba", "triton")
"""The integration backends offered here; ``"auto"`` picks ``"triton"`` for CUDA tensors and ``"numba"`` for CPU
tensors where their kernels import, else ``"torch"`` (``regkit._backend.resolve_backend``)."""

DEFAULT_CHECKPOINT_EVERY = 5
"""Steps per recomputed segment of the backward passes: ``ceil(T / 5) - 1`` stored positions of the points (9 at
T = 50). ``checkpoint_every >= steps`` stores none, and the backward recomputes the trajectory: about a quarter of the
peak memory for one more forward pass (H200, 2D 32x32 batch 16: 42 instead of 180 MiB, 0.81 instead of 0.72 ms; the
fused kernels' compile time no longer depends on the spacing)."""


def integrate_reference(
    points: torch.Tensor, A: torch.Tensor, tess: Tessellation, *, t: float = 1.0, steps: int = DEFAULT_STEPS
) -> torch.Tensor:
    """Integrate domain points through the CPA field ``A`` for time ``t`` (``regkit.cpab.scheme``).

    The readable reference: a plain loop of :func:`~regkit.cpab.scheme.take_step`, differentiable by autograd through
    every step ("unrolled autograd"; memory ``O(T N)``). Shapes: ``points (N, n) | (B, N, n)``,
    ``A (C, n, n + 1) | (B, C, n, n + 1)`` -> ``(B?, N, n)``.
    """
    check_steps(steps)
    x, A4, keep = batched(points, A, tess)
    h = t / steps
    E = step_matrices(A4, h)
    for _ in range(steps):
        x, _ = take_step(E, A4, x, tess, h)
    return unbatched(x, keep)


def integrate_trajectory(
    points: torch.Tensor, A: torch.Tensor, tess: Tessellation, *, t: float = 1.0, steps: int = DEFAULT_STEPS
) -> torch.Tensor:
    """All ``steps + 1`` positions of the scheme, ``(steps + 1, B?, N, n)`` in domain coordinates.

    Entry ``s`` is the position at time ``s t / steps``; the last entry equals :func:`integrate_reference`.
    Differentiable by autograd; keeps the whole trajectory, so meant for display and tests.
    """
    check_steps(steps)
    x, A4, keep = batched(points, A, tess)
    h = t / steps
    E = step_matrices(A4, h)
    trajectory = [x]
    for _ in range(steps):
        x, _ = take_step(E, A4, x, tess, h)
        trajectory.append(x)
    stacked = torch.stack(trajectory)  # (steps + 1, B, N, n)
    return stacked if keep else stacked.squeeze(1)


def count_crossings(
    points: torch.Tensor, A: torch.Tensor, tess: Tessellation, *, t: float = 1.0, steps: int = DEFAULT_STEPS
) -> int:
    """How many facets the points' trajectories cross in all (summed over points and batch elements)."""
    check_steps(steps)
    with torch.no_grad():
        x, A4, _ = batched(points, A, tess)
        h = t / steps
        E = step_matrices(A4, h)
        total = 0
        for _ in range(steps):
            x, step = take_step(E, A4, x, tess, h)
            total += step.crossings
    return total


def jacobian(
    points: torch.Tensor, A: torch.Tensor, tess: Tessellation, *, t: float = 1.0, steps: int = DEFAULT_STEPS
) -> torch.Tensor:
    """Jacobian matrices ``d phi / d x`` of the scheme at domain points: ``(B?, N, n, n)``.

    Analytic: the product of the steps' (and pieces') linear parts, ``E_lin(c)`` or ``expm(tau A_lin(c))``, with
    ``[i, j]`` = ``d phi_i / d x_j`` (domain coordinates; in a rotated frame ``R`` it is ``R J R^T`` with the same
    determinant).
    """
    check_steps(steps)
    x, A4, keep = batched(points, A, tess)
    n = tess.ndim
    h = t / steps
    E = step_matrices(A4, h)
    J = torch.eye(n, dtype=x.dtype, device=x.device).expand(*x.shape[:-1], n, n)
    for _ in range(steps):
        x, step = take_step(E, A4, x, tess, h)
        J = step_jacobian(E, A4, step, J)
    return unbatched(J, keep)


def log_jacobian_determinant(
    points: torch.Tensor, A: torch.Tensor, tess: Tessellation, *, t: float = 1.0, steps: int = DEFAULT_STEPS
) -> torch.Tensor:
    """``log det(d phi / d x)`` of the scheme at domain points: ``(B?, N)``.

    Analytic and exact for the scheme: ``tr A_lin(c)`` integrated along the trajectory over the visited cells'
    pieces (``h tr A_lin(c)`` per regular step); the determinant ``exp(.)`` is positive by construction.
    """
    check_steps(steps)
    x, A4, keep = batched(points, A, tess)
    h = t / steps
    E = step_matrices(A4, h)
    logdet = x.new_zeros(x.shape[:-1])
    for _ in range(steps):
        x, step = take_step(E, A4, x, tess, h)
        logdet = logdet + step_log_determinant(A4, h, step)
    return unbatched(logdet, keep)


class CPABIntegrate(torch.autograd.Function):
    """The scheme with the exact factorized adjoint (backward ``O(T N)`` work, ``O(C)`` memory beyond points).

    ``CPABIntegrate.apply(points (B, N, n), A (B, C, n, n + 1), tess, t, steps, checkpoint_every) -> (B, N, n)``,
    domain coordinates. Use :func:`integrate`, which also handles unbatched shapes and the backend choice.

    Forward: the scheme, keeping the step matrices ``E`` and the points every ``checkpoint_every`` steps (never the
    whole trajectory). Backward, for ``lambda_T = dL/dx_T``: each segment is recomputed from its checkpoint
    (bit-identical to the forward, so the same cells, pieces and hit times), then swept backward
    (``regkit.cpab.scheme.step_vjp``):

    * a regular step adds ``lambda_{s+1} [x_s; 1]^T`` to its cell's moments ``M = dL/dE`` and sets
      ``lambda_s = E_lin(c_s)^T lambda_{s+1}``;
    * a step in pieces adds each piece's ``dL/dA`` to its cell (``regkit.cpab.crossing.piece_vjp``) and pulls
      ``lambda`` back through the pieces; ``dL/dpoints = lambda_0``.

    Then, once per call, ``dL/dA`` is ``M`` pulled back through the matrix exponential (:func:`step_matrices_vjp`)
    plus the pieces' sum. The factorization is ``moments M -> dL/dA -> dL/dtheta``: the last arrow is
    ``B^T vec(dL/dA)`` (``CPABasis.project``), applied by autograd of ``CPABasis.to_A`` when ``A`` came from
    ``to_A(theta)``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        points: torch.Tensor,
        A: torch.Tensor,
        tess: Tessellation,
        t: float,
        steps: int,
        checkpoint_every: int,
    ) -> torch.Tensor:
        h = t / steps
        E = step_matrices(A, h)
        x = points
        checkpoints = [x]
        for s in range(1, steps + 1):
            x, _ = take_step(E, A, x, tess, h)
            if s % checkpoint_every == 0 and s < steps:
                checkpoints.append(x)
        ctx.save_for_backward(A, E, *checkpoints)
        ctx.tess, ctx.t, ctx.steps, ctx.checkpoint_every = tess, t, steps, checkpoint_every
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        need_points, need_A = ctx.needs_input_grad[:2]
        if not (need_points or need_A):
            return None, None, None, None, None, None
        A, E, *checkpoints = ctx.saved_tensors
        tess, steps, K = ctx.tess, ctx.steps, ctx.checkpoint_every
        h = ctx.t / steps
        B, C, n, m = E.shape
        moments = E.new_zeros(B, C, n * m) if need_A else None  # dL/dE, one row per (batch element, cell)
        direct = E.new_zeros(B * C, n, m) if need_A else None  # the pieces' dL/dA
        lam = grad_out.contiguous()
        for seg in reversed(range(len(checkpoints))):
            xs, records = [checkpoints[seg]], []
            for _ in range(min(K, steps - seg * K)):
                x_next, record = take_step(E, A, xs[-1], tess, h)
                xs.append(x_next)
                records.append(record)
            for x, record in zip(reversed(xs[:-1]), reversed(records), strict=True):
                lam = step_vjp(E, A, x, record, lam, moments, direct)
        grad_A = None
        if moments is not None and direct is not None:
            grad_A = step_matrices_vjp(A, h, moments.view(E.shape)) + direct.view(E.shape)
        return (lam if need_points else None), grad_A, None, None, None, None


def integrate(
    points: torch.Tensor,
    A: torch.Tensor,
    tess: Tessellation,
    *,
    t: float = 1.0,
    steps: int = DEFAULT_STEPS,
    backend: str = "auto",
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
) -> torch.Tensor:
    """Integrate domain points through the CPA field ``A`` for time ``t`` (the scheme of ``regkit.cpab.scheme``).

    ``points (N, n) | (B, N, n)``, ``A (C, n, n + 1) | (B, C, n, n + 1)`` -> ``(B?, N, n)``, domain coordinates.
    ``backend``: ``"reference"`` (:func:`integrate_reference`, unrolled autograd), ``"torch"`` (:class:`CPABIntegrate`,
    the factorized adjoint, ``checkpoint_every`` steps per recomputed segment), ``"numba"`` (the same compiled for the
    CPU, ``regkit_kernels.numba.cpab``; it recomputes each point's trajectory and ignores ``checkpoint_every``),
    ``"triton"`` (the same in fused kernels, ``regkit_kernels.cpab``; CUDA) or ``"auto"`` (``"triton"`` on CUDA,
    ``"numba"`` on the CPU, ``"torch"`` where their kernels do not import).
    All backends return the same values and the same gradients (``"numba"`` and ``"triton"`` up to the rounding of
    their step matrices, which they compute in their own kernels).
    """
    check_steps(steps)
    if isinstance(checkpoint_every, bool) or int(checkpoint_every) != checkpoint_every or checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be a positive integer, got {checkpoint_every!r}")
    chosen = resolve_backend(backend, points.device, "cpab", faces=FACES)
    if chosen == "reference":
        return integrate_reference(points, A, tess, t=t, steps=steps)
    P, A4, keep = batched(points, A, tess)
    if chosen == "triton":
        fused = load_kernels("cpab").cpab_integrate
        return unbatched(fused(P, A4, tess, t=t, steps=steps, checkpoint_every=checkpoint_every), keep)
    if chosen == "numba":
        return unbatched(load_kernels("numba.cpab").cpab_integrate(P, A4, tess, t=t, steps=steps), keep)
    return unbatched(CPABIntegrate.apply(P, A4, tess, float(t), int(steps), int(checkpoint_every)), keep)


def integrate_chain(
    points: torch.Tensor,
    stages: Sequence[torch.Tensor],
    tess: Tessellation | Sequence[Tessellation],
    *,
    t: float = 1.0,
    steps: int = DEFAULT_STEPS,
    backend: str = "auto",
    inverse: bool = False,
) -> torch.Tensor:
    """Compose CPA flows: ``phi_K o ... o phi_1`` (stage ``A_1`` applied first) at domain points.

    ``stages[k]`` is stage ``k``'s ``A`` on ``tess`` (one tessellation for all, or one per stage, sharing the domain
    box). ``inverse=True`` applies the inverse chain ``phi_1^-1 o ... o phi_K^-1``, i.e. the negated stages in reverse
    order (each ``phi^-1 = phi_{-A}``: exact for the flow, which the scheme computes to the dtype's rounding).
    Shapes and ``backend`` as :func:`integrate`.
    """
    tessellations = [tess] * len(stages) if isinstance(tess, Tessellation) else list(tess)
    if len(tessellations) != len(stages):
        raise ValueError(f"got {len(stages)} stages but {len(tessellations)} tessellations")
    order = list(zip(stages, tessellations, strict=True))
    if inverse:
        order = [(-A, ts) for A, ts in reversed(order)]
    x = points
    for A, ts in order:
        x = integrate(x, A, ts, t=t, steps=steps, backend=backend)
    return x

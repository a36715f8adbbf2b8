"""Integration of CPA velocity fields, the exact factorized gradient, and the baselines it is measured against.

Coordinates and shapes. Every point is in *domain* coordinates of the tessellation (the box ``[lower, upper]``), in
(x, y[, z]) order. ``A`` holds one affine velocity per cell, ``v(x) = A_c [x; 1]``: shape ``(C, n, n + 1)`` for one
transformation or ``(B, C, n, n + 1)`` for a batch of ``B``. Points are ``(N, n)`` (shared by the whole batch) or
``(B, N, n)`` (one set per transformation). Results are ``(B, N, n)`` when either input has a batch dimension, else
``(N, n)``.

The scheme ("expm steps"), which every function here computes: ``T = steps`` steps of ``h = t / T``; at each step
``c = tess.locate(x)`` and ``x <- E_c [x; 1]``, where ``E_c`` is the top ``n`` rows of ``expm(h Ã_c)`` and ``Ã_c`` is
the ``(n + 1) x (n + 1)`` matrix ``[A_c; 0]``. Inside one cell a step is the exact flow of the cell's field; the only
error comes from steps whose flow crosses a facet (they keep the starting cell's field). ``E`` is computed once per call
for all cells, in the working dtype. Per point, component ``i`` of a step is evaluated as
``((E_i0 x_0 + E_i1 x_1) [+ E_i2 x_2]) + e_i``. ``E_c = [E_lin | e]`` with ``E_lin = expm(h A_lin)``, so each step has
Jacobian ``E_lin(c)`` and determinant ``exp(h tr A_lin(c)) > 0``.

Gradients. Cell ids are piecewise constant in the points and in ``A``; every gradient here differentiates the discrete
scheme with the visited cells ``c_0 .. c_{T-1}`` held fixed, which is exactly what autograd through
:func:`integrate_reference` computes. :class:`CPABIntegrate` computes it by the factorized adjoint (per-cell moments,
then once through the matrix exponential, then ``B^T`` by autograd of ``CPABasis.to_A``);
:func:`forward_sensitivity_gradient` by the earlier libraries' forward sensitivities (``O(d T N)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from regkit._backend import load_kernels, resolve_backend
from regkit.cpab.tessellation import Tessellation

if TYPE_CHECKING:
    from regkit.cpab.basis import CPABasis

FACES = ("reference", "torch", "numba", "triton")
"""The integration backends offered here; ``"auto"`` picks ``"triton"`` for CUDA tensors and ``"numba"`` for CPU
tensors where their kernels import, else ``"torch"`` (``regkit._backend.resolve_backend``)."""

DEFAULT_STEPS = 50
DEFAULT_CHECKPOINT_EVERY = 5
"""Steps per recomputed segment of the backward passes: ``ceil(T / 5) - 1`` stored positions of the points (9 at
T = 50). ``checkpoint_every >= steps`` stores none, and the backward recomputes the trajectory: about a quarter of the
peak memory for one more forward pass (H200, 2D 32x32 batch 16: 42 instead of 180 MiB, 0.81 instead of 0.72 ms; the
fused kernels' compile time no longer depends on the spacing)."""
_CHUNK_ELEMENTS = 2**25  # forward sensitivities: temporaries of at most ~this many elements per chunk of columns
_EXPM_CHUNK = 2**15  # cells per chunk of the matrix-exponential adjoint (bounds its temporaries to ~100 MB)


# ---------------------------------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------------------------------


def _batched(points: torch.Tensor, A: torch.Tensor, tess: Tessellation) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Check shapes; return ``points (B, N, n)``, ``A (B, C, n, n + 1)`` (broadcast views) and whether to keep ``B``."""
    n, C = tess.ndim, tess.n_cells
    if A.shape[-3:] != (C, n, n + 1) or A.ndim not in (3, 4):
        raise ValueError(f"A must have shape (C, n, n + 1) or (B, C, n, n + 1) with C={C}, n={n}, got {tuple(A.shape)}")
    if points.shape[-1] != n or points.ndim not in (2, 3):
        raise ValueError(f"points must have shape (N, {n}) or (B, N, {n}), got {tuple(points.shape)}")
    if points.dtype != A.dtype or points.device != A.device:
        raise ValueError(f"points ({points.dtype}, {points.device}) and A ({A.dtype}, {A.device}) must match")
    keep_batch = A.ndim == 4 or points.ndim == 3
    A4 = A if A.ndim == 4 else A.unsqueeze(0)
    P3 = points if points.ndim == 3 else points.unsqueeze(0)
    B = max(A4.shape[0], P3.shape[0])
    if A4.shape[0] not in (1, B) or P3.shape[0] not in (1, B):
        raise ValueError(f"batch sizes of points {tuple(points.shape)} and A {tuple(A.shape)} do not match")
    return P3.expand(B, -1, -1), A4.expand(B, -1, -1, -1), keep_batch


def _unbatched(x: torch.Tensor, keep_batch: bool) -> torch.Tensor:
    return x if keep_batch else x.squeeze(0)


def _check_steps(steps: int) -> None:
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")


def step_matrices(A: torch.Tensor, h: float) -> torch.Tensor:
    """Per-cell step matrices ``E (..., C, n, n + 1)``: the top ``n`` rows of ``expm(h [A_c; 0])``.

    ``A (..., C, n, n + 1)`` are the cells' affine velocities in domain coordinates; ``E_c [x; 1]`` is the exact flow of
    cell ``c``'s field for time ``h`` from ``x``. Differentiable (forward and reverse mode) through
    ``torch.linalg.matrix_exp``.
    """
    n = A.shape[-2]
    square = torch.cat([A, A.new_zeros((*A.shape[:-2], 1, n + 1))], dim=-2)
    return torch.linalg.matrix_exp(h * square)[..., :n, :]


def _select(E: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    """``E (B, C, n, n + 1)`` at per-point cells ``(B, N)``: ``(B, N, n, n + 1)``."""
    B, _, n, m = E.shape
    flat = torch.gather(E.reshape(B, -1, n * m), 1, cells.unsqueeze(-1).expand(-1, -1, n * m))
    return flat.view(B, -1, n, m)


def _linear(M: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``M[..., :n] x`` for per-point matrices ``M (..., n, n + 1)`` and vectors ``x (..., n)`` (broadcasting).

    Unrolled over the ``n`` columns: tiny batched matmuls are far slower on GPUs and no faster on CPUs."""
    n = x.shape[-1]
    out = M[..., 0] * x[..., :1]
    for j in range(1, n):
        out = out + M[..., j] * x[..., j : j + 1]
    return out


def _linear_transposed(M: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``M[..., :n]^T y`` for per-point matrices ``M (..., n, n + 1)`` and vectors ``y (..., n)``."""
    n = y.shape[-1]
    out = M[..., 0, :n] * y[..., :1]
    for i in range(1, n):
        out = out + M[..., i, :n] * y[..., i : i + 1]
    return out


def _affine(M: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``M [x; 1]`` for per-point matrices ``M (..., n, n + 1)`` and points ``x (..., n)``."""
    return _linear(M, x) + M[..., x.shape[-1]]


def _step(E: torch.Tensor, x: torch.Tensor, tess: Tessellation) -> tuple[torch.Tensor, torch.Tensor]:
    """One scheme step from ``x (B, N, n)``: returns the new points and the cells ``(B, N)`` the step used."""
    cells = tess.locate(x)
    return _affine(_select(E, cells), x), cells


# ---------------------------------------------------------------------------------------------------------------------
# Reference integration (the spec) and its relatives
# ---------------------------------------------------------------------------------------------------------------------


def integrate_reference(
    points: torch.Tensor, A: torch.Tensor, tess: Tessellation, *, t: float = 1.0, steps: int = DEFAULT_STEPS
) -> torch.Tensor:
    """Integrate domain points through the CPA field ``A`` for time ``t`` by the expm-step scheme (module docstring).

    The readable reference: a plain loop, differentiable by autograd through every step ("unrolled autograd"; memory
    ``O(T N)``). Shapes: ``points (N, n) | (B, N, n)``, ``A (C, n, n + 1) | (B, C, n, n + 1)`` -> ``(B?, N, n)``.
    """
    _check_steps(steps)
    x, A4, keep = _batched(points, A, tess)
    E = step_matrices(A4, t / steps)
    for _ in range(steps):
        x, _ = _step(E, x, tess)
    return _unbatched(x, keep)


def integrate_trajectory(
    points: torch.Tensor, A: torch.Tensor, tess: Tessellation, *, t: float = 1.0, steps: int = DEFAULT_STEPS
) -> torch.Tensor:
    """All ``steps + 1`` positions of the expm-step scheme, ``(steps + 1, B?, N, n)`` in domain coordinates.

    Entry ``s`` is the position at time ``s t / steps``; the last entry equals :func:`integrate_reference`.
    Differentiable by autograd; keeps the whole trajectory, so meant for display and tests.
    """
    _check_steps(steps)
    x, A4, keep = _batched(points, A, tess)
    E = step_matrices(A4, t / steps)
    trajectory = [x]
    for _ in range(steps):
        x, _ = _step(E, x, tess)
        trajectory.append(x)
    stacked = torch.stack(trajectory)  # (steps + 1, B, N, n)
    return stacked if keep else stacked.squeeze(1)


def jacobian(
    points: torch.Tensor, A: torch.Tensor, tess: Tessellation, *, t: float = 1.0, steps: int = DEFAULT_STEPS
) -> torch.Tensor:
    """Jacobian matrices ``d phi / d x`` of the expm-step scheme at domain points: ``(B?, N, n, n)``.

    Analytic: the product ``E_lin(c_{T-1}) ... E_lin(c_0)`` of the visited cells' linear parts, with ``[i, j]`` =
    ``d phi_i / d x_j`` (domain coordinates; in a rotated frame ``R`` it is ``R J R^T`` with the same determinant).
    """
    _check_steps(steps)
    x, A4, keep = _batched(points, A, tess)
    n = tess.ndim
    E = step_matrices(A4, t / steps)
    J = torch.eye(n, dtype=x.dtype, device=x.device).expand(*x.shape[:-1], n, n)
    for _ in range(steps):
        M = _select(E, tess.locate(x))
        x = _affine(M, x)
        J = M[..., :n] @ J
    return _unbatched(J, keep)


def log_jacobian_determinant(
    points: torch.Tensor, A: torch.Tensor, tess: Tessellation, *, t: float = 1.0, steps: int = DEFAULT_STEPS
) -> torch.Tensor:
    """``log det(d phi / d x)`` of the expm-step scheme at domain points: ``(B?, N)``.

    Analytic and exact for the scheme: ``det E_lin(c) = exp(h tr A_lin(c))``, so the log determinant is
    ``h sum_s tr A_lin(c_s)`` over the visited cells; the determinant ``exp(.)`` is positive by construction.
    """
    _check_steps(steps)
    x, A4, keep = _batched(points, A, tess)
    n = tess.ndim
    h = t / steps
    E = step_matrices(A4, h)
    trace = A4[..., :n].diagonal(dim1=-2, dim2=-1).sum(-1)  # (B, C)
    logdet = x.new_zeros(x.shape[:-1])
    for _ in range(steps):
        x, cells = _step(E, x, tess)
        logdet = logdet + h * torch.gather(trace, 1, cells)
    return _unbatched(logdet, keep)


def integrate_accurate(
    points: torch.Tensor,
    A: torch.Tensor,
    tess: Tessellation,
    *,
    t: float = 1.0,
    steps: int = DEFAULT_STEPS,
    bisections: int = 50,
    max_crossings: int = 8,
) -> torch.Tensor:
    """A more accurate integration of the same flow, for reference only (slow: one ``matrix_exp`` per point per try).

    Each of the ``steps`` steps of ``h = t / steps`` is taken in exact in-cell pieces: from ``x`` in cell ``c`` with
    time ``r`` left, the exact flow ``expm(r Ã_c) [x; 1]`` is accepted when it ends in ``c``; otherwise the time at
    which it leaves ``c`` is found by ``bisections`` halvings (to ``|r| 2^-bisections``), the point moves just past
    the facet and the rest of the step continues in the new cell. After ``max_crossings`` crossings within one step
    the remainder is taken in the current cell. A flow that leaves a cell and comes back within one piece is not
    detected (negligible for small ``h``). Not differentiable through the cell crossings; shapes as
    :func:`integrate_reference`.
    """
    _check_steps(steps)
    P, A4, keep = _batched(points, A, tess)
    B, N, n = P.shape
    square = torch.cat([A4, A4.new_zeros((B, tess.n_cells, 1, n + 1))], dim=-2)  # (B, C, n+1, n+1)
    batch = torch.arange(B, device=P.device).repeat_interleave(N)
    x = P.reshape(B * N, n).clone()
    h = t / steps

    def flow(M: torch.Tensor, y: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        return _affine(torch.linalg.matrix_exp(tau[:, None, None] * M)[:, :n, :], y)

    for _ in range(steps):
        left = torch.full((B * N,), h, dtype=x.dtype, device=x.device)  # signed time left in this step
        active = torch.ones(B * N, dtype=torch.bool, device=x.device)
        for crossing in range(max_crossings + 1):
            ids = active.nonzero().squeeze(-1)
            if ids.numel() == 0:
                break
            y, r = x[ids], left[ids]
            cells = tess.locate(y)
            M = square[batch[ids], cells]
            end = flow(M, y, r)
            stays = (tess.locate(end) == cells) | (crossing == max_crossings)
            x[ids[stays]] = end[stays]
            active[ids[stays]] = False
            leave = ~stays
            ids, y, r, M, cells = ids[leave], y[leave], r[leave], M[leave], cells[leave]
            lo = torch.zeros_like(r)  # fractions of r: the flow is inside the cell at lo, outside at hi
            hi = torch.ones_like(r)
            for _ in range(bisections):
                mid = 0.5 * (lo + hi)
                inside = tess.locate(flow(M, y, mid * r)) == cells
                lo, hi = torch.where(inside, mid, lo), torch.where(inside, hi, mid)
            x[ids] = flow(M, y, hi * r)
            left[ids] = r * (1 - hi)
    return _unbatched(x.view(B, N, n), keep)


# ---------------------------------------------------------------------------------------------------------------------
# The factorized adjoint
# ---------------------------------------------------------------------------------------------------------------------


def step_matrices_vjp(A: torch.Tensor, h: float, grad_E: torch.Tensor) -> torch.Tensor:
    """``dL/dA (..., C, n, n + 1)`` from ``grad_E = dL/dE (..., C, n, n + 1)`` through :func:`step_matrices` (the
    adjoint of the matrix exponential, which the compiled kernels' ``step_matrices_vjp`` compute in kernels of their
    own), by autograd over chunks of ``_EXPM_CHUNK`` cells: ``matrix_exp``'s backward works on doubled matrices with
    many temporaries."""
    shape = A.shape
    flat_A, flat_grad = A.detach().reshape(-1, *shape[-2:]), grad_E.reshape(-1, *shape[-2:])
    out = torch.empty_like(flat_A)
    with torch.enable_grad():
        for start in range(0, flat_A.shape[0], _EXPM_CHUNK):
            part = flat_A[start : start + _EXPM_CHUNK].requires_grad_(True)
            grad = flat_grad[start : start + _EXPM_CHUNK]
            out[start : start + _EXPM_CHUNK] = torch.autograd.grad(step_matrices(part, h), part, grad)[0]
    return out.view(shape)


class CPABIntegrate(torch.autograd.Function):
    """The expm-step scheme with the exact factorized adjoint (backward ``O(T N)`` work, ``O(C)`` memory beyond points).

    ``CPABIntegrate.apply(points (B, N, n), A (B, C, n, n + 1), tess, t, steps, checkpoint_every) -> (B, N, n)``,
    domain coordinates. Use :func:`integrate`, which also handles unbatched shapes and the backend choice.

    Forward: the scheme of the module docstring, keeping the step matrices ``E`` and the points every
    ``checkpoint_every`` steps (never the whole trajectory). Backward, for ``lambda_T = dL/dx_T``: each segment is
    recomputed from its checkpoint (bit-identical to the forward, so the same cells ``c_s``), then swept backward:

    * ``M_{c_s} += lambda_{s+1} [x_s; 1]^T``, per batch element (a ``scatter_add_`` over cells): ``M = dL/dE``;
    * ``lambda_s = E_lin(c_s)^T lambda_{s+1}``; ``dL/dpoints = lambda_0``.

    Then, once per call, ``dL/dA`` is ``M`` pulled back through the matrix exponential (``torch.autograd.grad`` of
    :func:`step_matrices` on the ``(B, C)`` small matrices). The factorization is ``moments M -> dL/dA -> dL/dtheta``:
    the last arrow is ``B^T vec(dL/dA)`` (``CPABasis.project``), applied by autograd of ``CPABasis.to_A`` when ``A``
    came from ``to_A(theta)``. This differentiates exactly the discrete scheme the forward computes (cells fixed).
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
        E = step_matrices(A, t / steps)
        x = points
        checkpoints = [x]
        for s in range(1, steps + 1):
            x, _ = _step(E, x, tess)
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
        B, C, n, m = E.shape
        moments = E.new_zeros(B, C, n * m) if need_A else None  # dL/dE, one row per (batch element, cell)
        outer = E.new_empty((*grad_out.shape, m))  # lambda_{s+1} [x_s; 1]^T, per point
        lam = grad_out.contiguous()
        for seg in reversed(range(len(checkpoints))):
            xs, cells = [checkpoints[seg]], []
            for _ in range(min(K, steps - seg * K)):
                x_next, c = _step(E, xs[-1], tess)
                xs.append(x_next)
                cells.append(c)
            for x, c in zip(reversed(xs[:-1]), reversed(cells), strict=True):
                if moments is not None:
                    torch.mul(lam.unsqueeze(-1), x.unsqueeze(-2), out=outer[..., :n])
                    outer[..., n] = lam
                    moments.scatter_add_(1, c.unsqueeze(-1).expand(-1, -1, n * m), outer.view(B, -1, n * m))
                lam = _linear_transposed(_select(E, c), lam)
        grad_A = None if moments is None else step_matrices_vjp(A, ctx.t / steps, moments.view(E.shape))
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
    """Integrate domain points through the CPA field ``A`` for time ``t`` (the expm-step scheme, module docstring).

    ``points (N, n) | (B, N, n)``, ``A (C, n, n + 1) | (B, C, n, n + 1)`` -> ``(B?, N, n)``, domain coordinates.
    ``backend``: ``"reference"`` (:func:`integrate_reference`, unrolled autograd), ``"torch"`` (:class:`CPABIntegrate`,
    the factorized adjoint, ``checkpoint_every`` steps per recomputed segment), ``"numba"`` (the same compiled for the
    CPU, ``regkit_kernels.numba.cpab``; it recomputes each point's trajectory and ignores ``checkpoint_every``),
    ``"triton"`` (the same in fused kernels, ``regkit_kernels.cpab``; CUDA) or ``"auto"`` (``"triton"`` on CUDA,
    ``"numba"`` on the CPU, ``"torch"`` where their kernels do not import).
    All backends return the same values and the same gradients (``"numba"`` and ``"triton"`` up to the rounding of
    their step matrices, which they compute in their own kernels).
    """
    _check_steps(steps)
    if isinstance(checkpoint_every, bool) or int(checkpoint_every) != checkpoint_every or checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be a positive integer, got {checkpoint_every!r}")
    chosen = resolve_backend(backend, points.device, "cpab", faces=FACES)
    if chosen == "reference":
        return integrate_reference(points, A, tess, t=t, steps=steps)
    P, A4, keep = _batched(points, A, tess)
    if chosen == "triton":
        fused = load_kernels("cpab").cpab_integrate
        return _unbatched(fused(P, A4, tess, t=t, steps=steps, checkpoint_every=checkpoint_every), keep)
    if chosen == "numba":
        return _unbatched(load_kernels("numba.cpab").cpab_integrate(P, A4, tess, t=t, steps=steps), keep)
    return _unbatched(CPABIntegrate.apply(P, A4, tess, float(t), int(steps), int(checkpoint_every)), keep)


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
    order (each ``phi^-1 = phi_{-A}``, exact for the flow and up to the scheme's error for ``steps`` steps).
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


# ---------------------------------------------------------------------------------------------------------------------
# Baseline: forward sensitivities
# ---------------------------------------------------------------------------------------------------------------------


def forward_sensitivity_gradient(
    points: torch.Tensor,
    theta: torch.Tensor,
    basis: CPABasis,
    grad_output: torch.Tensor,
    *,
    t: float = 1.0,
    steps: int = DEFAULT_STEPS,
) -> torch.Tensor:
    """``dL/dtheta`` by forward sensitivities, the gradient of earlier CPAB libraries (a baseline; ``O(d T N)``).

    Integrates ``q_k = dx/dtheta_k`` for every basis coordinate ``k`` alongside ``x`` through the expm-step scheme,
    ``q_k <- E_lin(c) q_k + (dE_c/dtheta_k) [x; 1]``, with ``dE/dtheta_k`` the forward-mode derivative (jvp) of
    :func:`step_matrices` along basis column ``k`` (a chunk of columns at a time); then
    ``dL/dtheta_k = sum_points q_k . grad_output``. Memory: a ``(d, B, N, n)`` buffer plus ``(d, B, C, n, n + 1)``
    step-matrix derivatives.

    ``points (N, n) | (B, N, n)`` in domain coordinates, ``theta (d,) | (B, d)``, ``grad_output`` = ``dL/dx_T`` with
    the shape of the integrated points. Returns ``dL/dtheta`` with the shape of ``theta`` (summed over the batch for
    a shared ``theta``); equal to the factorized gradient of :func:`integrate`.
    """
    _check_steps(steps)
    h = t / steps
    with torch.no_grad():
        A = basis.to_A(theta)
        x, A4, _ = _batched(points, A, basis.tess)
        B, N, n = x.shape
        g = grad_output.reshape(B, N, n)
        eye = torch.eye(basis.d, dtype=theta.dtype, device=theta.device)
        columns = basis.to_A(eye)  # (d, C, n, n + 1): dA/dtheta_k
        E = step_matrices(A4, h)
        chunk = max(1, _CHUNK_ELEMENTS // (B * basis.tess.n_cells * (n + 1) ** 2))
        dE = torch.cat(
            [
                torch.func.jvp(
                    lambda a: step_matrices(a, h),
                    (A4.expand(len(cols), *A4.shape).contiguous(),),
                    (cols.unsqueeze(1).expand(-1, B, -1, -1, -1).contiguous(),),
                )[1]
                for cols in columns.split(chunk)
            ]
        )  # (d, B, C, n, n + 1)
        chunk = max(1, _CHUNK_ELEMENTS // (B * N * n))
        flat_dE = dE.flatten(1, 2)  # (d, B * C, n, n + 1)
        offset = (basis.tess.n_cells * torch.arange(B, device=x.device)).unsqueeze(1)
        q = x.new_zeros((basis.d, B, N, n))
        for _ in range(steps):
            cells = basis.tess.locate(x)
            M = _select(E, cells)  # (B, N, n, n + 1)
            rows = cells + offset
            for qk, dEk in zip(q.split(chunk), flat_dE.split(chunk), strict=True):
                update = _linear(M, qk) + dEk[..., n][:, rows]  # E_lin q_k + de_k: (chunk, B, N, n)
                for j in range(n):
                    update += dEk[..., j][:, rows] * x[..., j : j + 1]  # + dE_lin_k x
                qk.copy_(update)
            x = _affine(M, x)
        grad = torch.einsum("kbpi,bpi->bk", q, g)  # (B, d)
    return grad.sum(0) if theta.ndim == 1 else grad

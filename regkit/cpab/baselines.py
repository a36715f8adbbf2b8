"""Independent checks of and baselines for the scheme of ``regkit.cpab.scheme``: a bisection integration of the same
flow, and the forward-sensitivity gradient of earlier CPAB libraries.

Coordinates and shapes as ``regkit.cpab.integrate``: domain points ``(N, n) | (B, N, n)``, velocities
``A (C, n, n + 1) | (B, C, n, n + 1)``, (x, y[, z]) order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from regkit.cpab.crossing import piece_jacobian, piece_jvp
from regkit.cpab.scheme import (
    DEFAULT_STEPS,
    affine,
    batched,
    check_steps,
    linear,
    select,
    step_matrices,
    take_step,
    unbatched,
)
from regkit.cpab.tessellation import Tessellation

if TYPE_CHECKING:
    from regkit.cpab.basis import CPABasis

_CHUNK_ELEMENTS = 2**25  # forward sensitivities: temporaries of at most ~this many elements per chunk of columns


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
    """The same flow by bisection on cell membership, an independent check of the scheme (slow: one ``matrix_exp``
    per point per try).

    Each of the ``steps`` steps of ``h = t / steps`` is taken in exact in-cell pieces: from ``x`` in cell ``c`` with
    time ``r`` left, the exact flow ``expm(r Ã_c) [x; 1]`` is accepted when it ends in ``c``; otherwise the time at
    which it leaves ``c`` is found by ``bisections`` halvings (to ``|r| 2^-bisections``), the point moves just past
    the facet and the rest of the step continues in the new cell. After ``max_crossings`` crossings within one step
    the remainder is taken in the current cell. A flow that leaves a cell and comes back within one piece is not
    detected (negligible for small ``h``). Not differentiable through the cell crossings; shapes as
    ``regkit.cpab.integrate.integrate_reference``.
    """
    check_steps(steps)
    P, A4, keep = batched(points, A, tess)
    B, N, n = P.shape
    square = torch.cat([A4, A4.new_zeros((B, tess.n_cells, 1, n + 1))], dim=-2)  # (B, C, n+1, n+1)
    batch = torch.arange(B, device=P.device).repeat_interleave(N)
    x = P.reshape(B * N, n).clone()
    h = t / steps

    def flow(M: torch.Tensor, y: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        return affine(torch.linalg.matrix_exp(tau[:, None, None] * M)[:, :n, :], y)

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
    return unbatched(x.view(B, N, n), keep)


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

    Integrates ``q_k = dx/dtheta_k`` for every basis coordinate ``k`` alongside ``x`` through the scheme: a regular
    step ``q_k <- E_lin(c) q_k + (dE_c/dtheta_k) [x; 1]``, with ``dE/dtheta_k`` the forward-mode derivative (jvp) of
    :func:`~regkit.cpab.scheme.step_matrices` along basis column ``k`` (a chunk of columns at a time); a piece
    ``q_k <- expm(tau A_lin) q_k + dphi/dA [dA_k]`` (``regkit.cpab.crossing.piece_jvp``); then
    ``dL/dtheta_k = sum_points q_k . grad_output``. Memory: a ``(d, B, N, n)`` buffer plus ``(d, B, C, n, n + 1)``
    step-matrix derivatives.

    ``points (N, n) | (B, N, n)`` in domain coordinates, ``theta (d,) | (B, d)``, ``grad_output`` = ``dL/dx_T`` with
    the shape of the integrated points. Returns ``dL/dtheta`` with the shape of ``theta`` (summed over the batch for
    a shared ``theta``); equal to the factorized gradient of ``regkit.cpab.integrate.integrate``.
    """
    check_steps(steps)
    h = t / steps
    with torch.no_grad():
        A = basis.to_A(theta)
        x, A4, _ = batched(points, A, basis.tess)
        B, N, n = x.shape
        C = basis.tess.n_cells
        g = grad_output.reshape(B, N, n)
        eye = torch.eye(basis.d, dtype=theta.dtype, device=theta.device)
        columns = basis.to_A(eye)  # (d, C, n, n + 1): dA/dtheta_k
        flat_columns = columns.unsqueeze(1).expand(-1, B, -1, -1, -1).reshape(basis.d, B * C, n, n + 1)
        E = step_matrices(A4, h)
        chunk = max(1, _CHUNK_ELEMENTS // (B * C * (n + 1) ** 2))
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
        offset = (C * torch.arange(B, device=x.device)).unsqueeze(1)
        flat_A = A4.reshape(B * C, n, n + 1)
        q = x.new_zeros((basis.d, B, N, n))
        for _ in range(steps):
            x_next, step = take_step(E, A4, x, basis.tess, h)
            M = select(E, step.cells)  # (B, N, n, n + 1)
            rows = step.cells + offset
            pieces = q.flatten(1, 2).transpose(0, 1).clone()  # (B N, d, n): the pieces' sensitivities
            for piece in step.pieces:
                cell_A = flat_A[piece.cells]
                moved = piece_jacobian(cell_A, piece.durations, pieces[piece.rows].transpose(1, 2), piece.degree)
                for cols in range(0, basis.d, chunk):
                    dA = flat_columns[cols : cols + chunk][:, piece.cells]
                    jvp = piece_jvp(cell_A, piece.start, piece.durations, dA, piece.degree)  # (m, P, n)
                    moved[..., cols : cols + chunk] += jvp.permute(1, 2, 0)
                pieces[piece.rows] = moved.transpose(1, 2)
            for qk, dEk, pk in zip(q.split(chunk), flat_dE.split(chunk), pieces.split(chunk, 1), strict=True):
                update = linear(M, qk) + dEk[..., n][:, rows]  # E_lin q_k + de_k: (chunk, B, N, n)
                for j in range(n):
                    update += dEk[..., j][:, rows] * x[..., j : j + 1]  # + dE_lin_k x
                from_pieces = pk.transpose(0, 1).reshape(qk.shape)
                qk.copy_(torch.where(step.regular.unsqueeze(-1), update, from_pieces))
            x = x_next
        grad = torch.einsum("kbpi,bpi->bk", q, g)  # (B, d)
    return grad.sum(0) if theta.ndim == 1 else grad

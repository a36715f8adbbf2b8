"""The integration scheme every CPAB face computes: facet-resolved expm steps, one step at a time, and its adjoint.

Coordinates and shapes. Every point is in *domain* coordinates of the tessellation (the box ``[lower, upper]``), in
(x, y[, z]) order. ``A`` holds one affine velocity per cell, ``v(x) = A_c [x; 1]``: ``(B, C, n, n + 1)`` here
(:func:`batched` makes every input batched). Points are ``(B, N, n)``.

The scheme. ``T = steps`` steps of ``h = t / T``. A step from ``x`` in cell ``c = tess.locate(x)`` first tries the
cell's exact flow for the whole step, ``y = E_c [x; 1]`` with ``E_c`` the top ``n`` rows of ``expm(h [A_c; 0])``
(:func:`step_matrices`, once per call for all cells). If ``y`` is still in ``c`` (no barycentric coordinate of an
interior facet is negative), the step is ``y`` (a *regular* step). Otherwise the flow left ``c``: the step is taken in
*pieces*, each the exact in-cell flow (``regkit.cpab.crossing``) up to the time it first reaches a facet (the hit
time), then on in the cell across that facet for the time left, until a piece ends inside its cell; after
``MAX_CROSSINGS`` crossings in one step the time left is taken in the last cell. The computed map is thus the exact
flow of the CPA field, up to the rounding of the dtype: continuous, and inverted by the flow of ``-A``.

Facets on the box boundary do not stop a piece (the cell's field continues beyond the box), and a step that starts
outside the box is always a regular step of the cell ``locate`` gives its projection onto the box. A flow that leaves
a cell and comes back within one piece is not seen (the piece keeps its cell's field: an error of second order in
how far it left).

Gradients differentiate the computed map with the visited cells and the hit times held fixed: that is the exact
gradient of the flow, because the velocity field is continuous across facets (``regkit.cpab.crossing``). Each step's
Jacobian is ``E_lin(c)`` for a regular step, the product of the pieces' ``expm(tau A_lin)`` otherwise; its
determinant ``exp(h tr A_lin)`` (regular) or ``exp(sum tau_k tr A_lin(c_k))`` is positive by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from regkit.cpab.crossing import (
    barycentric,
    evaluate,
    flow_coefficients,
    hit_times,
    linear_norm,
    piece_jacobian,
    piece_vjp,
    taylor_degree,
)
from regkit.cpab.tessellation import Tessellation

DEFAULT_STEPS = 50
MAX_CROSSINGS = 8
"""Facet crossings followed within one step; the time left after them is taken in the last cell."""


def check_steps(steps: int) -> None:
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")


def batched(points: torch.Tensor, A: torch.Tensor, tess: Tessellation) -> tuple[torch.Tensor, torch.Tensor, bool]:
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


def unbatched(x: torch.Tensor, keep_batch: bool) -> torch.Tensor:
    return x if keep_batch else x.squeeze(0)


def step_matrices(A: torch.Tensor, h: float) -> torch.Tensor:
    """Per-cell step matrices ``E (..., C, n, n + 1)``: the top ``n`` rows of ``expm(h [A_c; 0])``.

    ``A (..., C, n, n + 1)`` are the cells' affine velocities in domain coordinates; ``E_c [x; 1]`` is the exact flow of
    cell ``c``'s field for time ``h`` from ``x``. Differentiable (forward and reverse mode) through
    ``torch.linalg.matrix_exp``.
    """
    n = A.shape[-2]
    square = torch.cat([A, A.new_zeros((*A.shape[:-2], 1, n + 1))], dim=-2)
    return torch.linalg.matrix_exp(h * square)[..., :n, :]


_EXPM_CHUNK = 2**15  # cells per chunk of the matrix-exponential adjoint (bounds its temporaries to ~100 MB)


def step_matrices_vjp(A: torch.Tensor, h: float, grad_E: torch.Tensor) -> torch.Tensor:
    """``dL/dA (..., C, n, n + 1)`` from ``grad_E = dL/dE (..., C, n, n + 1)`` through :func:`step_matrices` (the
    adjoint of the matrix exponential, which the compiled kernels compute in kernels of their own), by autograd over
    chunks of cells: ``matrix_exp``'s backward works on doubled matrices with many temporaries."""
    shape = A.shape
    flat_A, flat_grad = A.detach().reshape(-1, *shape[-2:]), grad_E.reshape(-1, *shape[-2:])
    out = torch.empty_like(flat_A)
    with torch.enable_grad():
        for start in range(0, flat_A.shape[0], _EXPM_CHUNK):
            part = flat_A[start : start + _EXPM_CHUNK].requires_grad_(True)
            grad = flat_grad[start : start + _EXPM_CHUNK]
            out[start : start + _EXPM_CHUNK] = torch.autograd.grad(step_matrices(part, h), part, grad)[0]
    return out.view(shape)


def select(E: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    """``E (B, C, n, m)`` at per-point cells ``(B, N)``: ``(B, N, n, m)``."""
    B, _, n, m = E.shape
    flat = torch.gather(E.reshape(B, -1, n * m), 1, cells.unsqueeze(-1).expand(-1, -1, n * m))
    return flat.view(B, -1, n, m)


def linear(M: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``M[..., :n] x`` for per-point matrices ``M (..., n, n + 1)`` and vectors ``x (..., n)`` (broadcasting).

    Unrolled over the ``n`` columns: tiny batched matmuls are far slower on GPUs and no faster on CPUs."""
    n = x.shape[-1]
    out = M[..., 0] * x[..., :1]
    for j in range(1, n):
        out = out + M[..., j] * x[..., j : j + 1]
    return out


def linear_transposed(M: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``M[..., :n]^T y`` for per-point matrices ``M (..., n, n + 1)`` and vectors ``y (..., n)``."""
    n = y.shape[-1]
    out = M[..., 0, :n] * y[..., :1]
    for i in range(1, n):
        out = out + M[..., i, :n] * y[..., i : i + 1]
    return out


def affine(M: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``M [x; 1]`` for per-point matrices ``M (..., n, n + 1)`` and points ``x (..., n)``."""
    return linear(M, x) + M[..., x.shape[-1]]


@cache
def _facet_tables(tess: Tessellation, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``planes (C, n + 1, n + 1)`` in ``dtype``, ``neighbors (C, n + 1)``, ``interior (C, n + 1)`` bool, and the box
    ``lower``, ``upper`` ``(n,)``, on ``device``."""
    planes, neighbors = tess.facet_planes()
    assert tess.lower is not None and tess.upper is not None
    box = torch.tensor([tess.lower, tess.upper], dtype=dtype)
    return planes.to(dtype).to(device), neighbors.to(device), (neighbors >= 0).to(device), *box.to(device)


@dataclass(frozen=True)
class Pieces:
    """One round of pieces of the steps that crossed facets: row ``rows[p]`` of the flattened ``(B N)`` points went
    from ``start[p]`` in flat cell ``cells[p]`` (``b C + c``) for time ``durations[p]``, its flow summed to degree
    ``degree``. A point's pieces are in consecutive rounds, in the order taken."""

    rows: torch.Tensor
    start: torch.Tensor
    cells: torch.Tensor
    durations: torch.Tensor
    degree: int


@dataclass(frozen=True)
class Step:
    """What one step did: the start cells ``(B, N)``, which points took a regular step ``(B, N)`` bool, and the
    rounds of pieces of the others."""

    cells: torch.Tensor
    regular: torch.Tensor
    pieces: tuple[Pieces, ...]

    @property
    def crossings(self) -> int:
        """Facets crossed in this step, over all points."""
        return sum(p.rows.numel() for p in self.pieces) - (0 if not self.pieces else self.pieces[0].rows.numel())


def take_step(
    E: torch.Tensor, A: torch.Tensor, x: torch.Tensor, tess: Tessellation, h: float
) -> tuple[torch.Tensor, Step]:
    """One facet-resolved step (module docstring) from ``x (B, N, n)`` with step matrices ``E`` and velocities ``A``
    (both ``(B, C, n, n + 1)``): the new points and what the step did. Differentiable in ``E``, ``A`` and ``x`` with
    the cells and hit times fixed."""
    B, N, n = x.shape
    C = E.shape[1]
    planes, neighbors, interior, lower, upper = _facet_tables(tess, x.dtype, x.device)
    cells = tess.locate(x)
    y = affine(select(E, cells), x)
    with torch.no_grad():
        inside_box = ((x >= lower) & (x <= upper)).all(-1)
        leaving = (barycentric(planes[cells], y) < 0) & interior[cells]
        crossing = inside_box & leaving.any(-1)
        rows = crossing.flatten().nonzero().squeeze(-1)
    if rows.numel() == 0:
        return y, Step(cells, ~crossing, ())
    flat_A = A.reshape(B * C, n, n + 1)
    out = y.reshape(B * N, n)
    local = cells.flatten()[rows]
    flat_cells = local + C * torch.div(rows, N, rounding_mode="floor")
    start = x.reshape(B * N, n)[rows]
    left = torch.full_like(rows, h, dtype=x.dtype)
    leaving = leaving.flatten(0, 1)[rows]
    rounds = []
    for crossed in range(MAX_CROSSINGS + 1):
        cell_A = flat_A[flat_cells]
        with torch.no_grad():
            degree = taylor_degree(float((left * linear_norm(cell_A)).max()), x.dtype)
        q = flow_coefficients(cell_A, start, degree)
        with torch.no_grad():
            cell_planes = planes[local]
            if crossed:
                leaving = (barycentric(cell_planes, evaluate(q, left)) < 0) & interior[local]
            done = ~leaving.any(-1) if crossed < MAX_CROSSINGS else torch.ones_like(rows, dtype=torch.bool)
            tau, facet = hit_times(q.detach(), cell_planes, leaving, left)
            durations = torch.where(done, left, tau)
        rounds.append(Pieces(rows, start, flat_cells, durations, degree))
        end = evaluate(q, durations)
        out = out.index_put((rows[done],), end[done])
        if bool(done.all()):
            break
        with torch.no_grad():
            go = ~done
            next_local = neighbors[local[go], facet[go]]
            flat_cells = flat_cells[go] - local[go] + next_local
            local, rows, left = next_local, rows[go], (left - tau)[go]
        start = end[go]
    return out.view(B, N, n), Step(cells, ~crossing, tuple(rounds))


def step_vjp(
    E: torch.Tensor,
    A: torch.Tensor,
    x: torch.Tensor,
    step: Step,
    lam: torch.Tensor,
    moments: torch.Tensor | None,
    direct: torch.Tensor | None,
) -> torch.Tensor:
    """The adjoint of one step taken from ``x (B, N, n)`` (the factorized adjoint): for ``lam = dL/dx_{s+1}``
    returns ``dL/dx_s`` and accumulates, in place, the regular steps' moments ``moments (B, C, n (n + 1))`` (``dL/dE``,
    ``lambda [x; 1]^T`` per point at its cell) and the pieces' ``dL/dA`` into ``direct (B C, n, n + 1)`` (skipped when
    ``None``)."""
    B, N, n = x.shape
    regular = step.regular.unsqueeze(-1)
    if moments is not None:
        weight = torch.where(regular, lam, torch.zeros_like(lam))
        outer = torch.cat([weight.unsqueeze(-1) * x.unsqueeze(-2), weight.unsqueeze(-1)], -1)
        moments.scatter_add_(1, step.cells.unsqueeze(-1).expand(-1, -1, n * (n + 1)), outer.view(B, N, -1))
    back = linear_transposed(select(E, step.cells), lam)
    if not step.pieces:
        return back
    flat_lam = lam.reshape(B * N, n).clone()
    flat_A = A.reshape(-1, n, n + 1)
    for piece in reversed(step.pieces):
        grad_x, grad_A = piece_vjp(
            flat_A[piece.cells], piece.start, piece.durations, flat_lam[piece.rows], piece.degree
        )
        flat_lam[piece.rows] = grad_x
        if direct is not None:
            direct.index_add_(0, piece.cells, grad_A)
    return torch.where(regular, back, flat_lam.view(B, N, n))


def step_jacobian(E: torch.Tensor, A: torch.Tensor, step: Step, J: torch.Tensor) -> torch.Tensor:
    """``d x_{s+1} / d x_s @ J`` for one step and ``J (B, N, n, n)``."""
    B, N, n, _ = J.shape
    regular = select(E, step.cells)[..., :n] @ J
    if not step.pieces:
        return regular
    flat = J.reshape(B * N, n, n).clone()
    flat_A = A.reshape(-1, n, n + 1)
    for piece in step.pieces:
        flat[piece.rows] = piece_jacobian(flat_A[piece.cells], piece.durations, flat[piece.rows], piece.degree)
    return torch.where(step.regular[..., None, None], regular, flat.view(B, N, n, n))


def step_log_determinant(A: torch.Tensor, h: float, step: Step) -> torch.Tensor:
    """``log det(d x_{s+1} / d x_s)`` of one step, ``(B, N)``: ``h tr A_lin(c)`` or ``sum_k tau_k tr A_lin(c_k)``."""
    n = A.shape[-2]
    trace = A[..., :n].diagonal(dim1=-2, dim2=-1).sum(-1)  # (B, C)
    out = h * torch.gather(trace, 1, step.cells)
    if not step.pieces:
        return out
    flat, flat_trace = torch.zeros_like(out).flatten(), trace.flatten()
    for piece in step.pieces:
        flat.index_add_(0, piece.rows, piece.durations * flat_trace[piece.cells])
    return torch.where(step.regular, out, flat.view_as(out))

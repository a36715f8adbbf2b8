"""Fused CPAB integration: launchers, the autograd Function and the functional entry point.

The scheme is the facet-resolved expm-step scheme of ``regkit.cpab.scheme`` (domain coordinates, (x, y[, z]) order).
The launchers work on the cells' affine velocities ``A (B, C, n, n + 1)`` and their step-matrix table
``E (B, C, n, n + 1)`` for the step ``h``; the Function takes ``A`` as ``regkit.cpab.integrate.CPABIntegrate`` does,
computes ``E``, and turns the backward kernel's two tables into ``dL/dA``: the regular steps' per-cell moments
``dL/dE``, pulled back with the kernels of ``expm.py``, plus the pieces' ``dL/dA``, added as they are.
``tess`` is any object with ``shape`` (per-axis box counts, x first), ``lower``, ``upper`` and ``facet_planes()``
(``regkit``'s ``Tessellation``, the :class:`Box` protocol); the cell numbering is that of ``Tessellation.locate``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import triton
from torch import Tensor
from torch.autograd.function import once_differentiable

from regkit_kernels.cpab.expm import padded_rows, split_float, step_matrices, step_matrices_vjp
from regkit_kernels.cpab.kernels import (
    cell_kernel,
    cpab_bwd_kernel,
    cpab_fwd_kernel,
    crossing_step_kernel,
    partition_kernel,
)
from regkit_kernels.launch import interpreter_on, pow2

# Module state read at every call, public: the tests set the tunables to reach the GPU's tilings and code paths in the
# interpreter, and the benchmarks clear the point orders to time the sort.
INTERPRETER_BLOCK = 1 << 12
"""Points per program under Triton's interpreter, where every program costs Python overhead: few, large ones."""
UNIFORM = True
"""Whether the backward kernel skips the moment flush program-wide at steps where no point of a program changes cell
(else each point flushes at every step)."""
SORT_MIN = 1 << 14
"""Shared points are ordered (:func:`point_order`) from this many on; fewer are not worth it."""
POINT_ORDERS: dict[tuple[Any, ...], Tensor] = {}
"""The cell orders of the last few point tensors, as :func:`cell_order` computed them (any order gives the same
results); clear it to make the next call sort again."""

FORWARD_BLOCK = 32
"""Points per program of the forward kernel on the GPU."""
FORWARD_WARPS = 1
"""Warps per forward program: one, so that only the warps with a point that crosses a facet take a step's pieces
(the 160 x 192 x 224 grid at 16^3, 5 steps, in the order of point_order: 2.65 ms on an H200, against 4.8 with programs
of 2 warps and 5.8 with 4; ``benchmarks/scripts/cpab_order.py`` times the shapes)."""
_ORDER_BLOCK = 1024  # points per program of the ordering kernels
_BUCKETS = 16  # groups of predicted first-crossing steps in point_order
# The backward kernel's programs are one warp, with the program-wide flush skip (``UNIFORM``): a reduction over a
# program is then a few warp shuffles (over 4 warps it takes a barrier) and a flush is skipped per warp. On the H200
# (registration grid, 16^3 cells, checkpoints every 5 steps) the backward kernel took 1.55 ms so; with programs of 4
# warps and no skip 1.72-1.79 (1.88-1.90 capped at 96 registers); capped, one warp with the skip 1.75, 4 warps 2.40.
_BWD_BLOCK = 32
_BWD_WARPS = 1
# Register cap of the float32 backward kernel (None: ptxas's choice). A cap of 96 (for 5 programs of 128 threads per
# SM) made the grid's backward with checkpoints every 5 steps slower on the H200: 1.90 ms against 1.72.
_MAXNREG: int | None = None
_DTYPES = (torch.float32, torch.float64)
_SEGMENT = 5  # steps per unrolled sub-segment of the backward kernel (compile time grows about as its cube)
_GEOMETRY: dict[tuple[Any, ...], tuple[Tensor, bool]] = {}
_FACETS: dict[tuple[Any, ...], tuple[Tensor, Tensor]] = {}
_ORDERS_KEPT = 4  # entries of POINT_ORDERS


class Box(Protocol):
    """The tessellation geometry the kernels need (``regkit.cpab.tessellation.Tessellation`` satisfies it)."""

    shape: tuple[int, ...]
    lower: Sequence[float]
    upper: Sequence[float]

    def facet_planes(self) -> tuple[Tensor, Tensor]:
        """Per cell, the barycentric rows ``(C, n + 1, n + 1)`` (float64; row ``f`` gives vertex ``f``'s coordinate
        ``row[:n] . x + row[n]`` at a domain point ``x``) and the neighbours ``(C, n + 1)`` across the facets opposite
        the vertices, ``-1`` on the box boundary."""
        ...


def _key(tess: Box, dtype: torch.dtype, device: torch.device) -> tuple[Any, ...]:
    return (tuple(tess.shape), tuple(map(float, tess.lower)), tuple(map(float, tess.upper)), dtype, device)


def _geometry(tess: Box, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, bool]:
    """The kernels' geometry table and whether they must divide (``kernels._axis``): ``lower``, ``scale``, ``shape``,
    ``shape - 1`` and ``upper`` in ``dtype`` on ``device``, ``lower`` and ``extent = upper - lower`` rounded exactly
    as ``Tessellation.locate`` rounds them, ``scale = 1 / extent`` when every extent is a power of two (then
    ``x * scale`` is ``x / extent`` bit for bit), else ``extent``; ``upper`` as ``regkit.cpab.scheme`` rounds it for
    the box test. Cached per box, dtype and device: a table made from host values is a host-to-device copy, which
    would stall the host until the GPU has caught up."""
    key = _key(tess, dtype, device)
    if key not in _GEOMETRY:
        lower = torch.tensor(tess.lower, dtype=dtype)
        extent = torch.tensor(tess.upper, dtype=dtype) - lower
        mantissa, _ = torch.frexp(extent)
        inverse = 1 / extent
        divide = not bool(
            ((mantissa == 0.5) & (extent * inverse == 1) & (inverse.abs() >= torch.finfo(dtype).tiny)).all()
        )
        scale = extent if divide else inverse
        shape = torch.tensor(tess.shape, dtype=dtype)
        table = torch.cat([lower, scale, shape, shape - 1, torch.tensor(tess.upper, dtype=dtype)]).to(device)
        _GEOMETRY[key] = (table, divide)
    return _GEOMETRY[key]


def _facets(tess: Box, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """The kernels' facet tables (``kernels`` module docstring): ``planes (C, n + 1, 4)`` in ``dtype`` (the rows of
    ``tess.facet_planes()`` rounded to ``dtype`` as ``regkit.cpab.scheme`` rounds them, padded; ``(0, .., 0, 1)`` for
    facets on the box boundary, whose barycentric coordinate is then 1, so that they never stop a piece, as the spec's
    ``interior`` mask has it) and ``neighbors (C, 4)`` int32 (padded with -1), on ``device``. Cached as
    :func:`_geometry`."""
    key = _key(tess, dtype, device)
    if key not in _FACETS:
        planes, neighbors = tess.facet_planes()
        n = planes.shape[-1] - 1
        planes = planes.to(dtype)
        boundary = neighbors < 0
        planes[boundary] = torch.eye(n + 1, dtype=dtype)[n]
        planes = torch.nn.functional.pad(planes, (0, 4 - (n + 1)))
        neighbors = torch.nn.functional.pad(neighbors, (0, 4 - (n + 1)), value=-1).to(torch.int32)
        _FACETS[key] = (planes.contiguous().to(device), neighbors.contiguous().to(device))
    return _FACETS[key]


def _check(points: Tensor, A: Tensor, E: Tensor, tess: Box, steps: int, checkpoint_every: int) -> None:
    n = len(tess.shape)
    cells = (4 if n == 2 else 5) * math.prod(tess.shape)
    if n not in (2, 3) or points.ndim != 3 or points.shape[-1] != n:
        raise ValueError(f"points must be (B, N, n) with n = {n} in (2, 3), got {tuple(points.shape)}")
    for name, M in (("A", A), ("E", E)):
        if M.shape[:-1] != (points.shape[0], cells, n) or M.shape[-1] not in (n + 1, 4):
            raise ValueError(f"{name} must be ({points.shape[0]}, {cells}, {n}, {n + 1} or 4), got {tuple(M.shape)}")
        if points.dtype not in _DTYPES or M.dtype != points.dtype or M.device != points.device:
            raise ValueError(
                f"points and {name} must share a float32/float64 dtype and a device, got {points.dtype}, {M.dtype}"
            )
    if points.device.type != "cuda" and not interpreter_on():
        raise ValueError("the fused CPAB kernels need CUDA tensors (or TRITON_INTERPRET=1 with CPU tensors)")
    if steps < 1 or checkpoint_every < 1:
        raise ValueError(f"steps and checkpoint_every must be positive, got {steps} and {checkpoint_every}")


def _rows(points: Tensor) -> Tensor:
    """``points (B, N, n)`` with contiguous rows of contiguous points (the batch may stay a stride-0 broadcast)."""
    n = points.shape[-1]
    return points if points.stride(-1) == 1 and points.stride(-2) == n else points.contiguous()


def _or(table: Tensor, fallback: Tensor) -> Tensor:
    """``table``, or any valid tensor in its place when it is empty (a kernel argument that is never read)."""
    return table if table.numel() else fallback


def _launch_args(points: Tensor, tess: Box, gpu_block: int) -> tuple[tuple[int, int], int, int, int]:
    """Grid, block (``gpu_block`` on the GPU), and the x / y box counts."""
    B, N, _ = points.shape
    block = min(INTERPRETER_BLOCK, pow2(N)) if points.device.type == "cpu" else gpu_block
    return (triton.cdiv(N, block), B), block, tess.shape[0], tess.shape[1]


def point_order(points: Tensor, E: Tensor, tess: Box, steps: int) -> Tensor | None:
    """The order in which the kernels take points shared by the batch (int32 ``(N,)``, a permutation), or ``None``
    where ordering does not pay: unless ``points (B, N, n)`` are shared (``B == 1`` or a stride-0 batch) and
    ``N >= SORT_MIN``. Any order gives the same results; this one is for speed, on two counts:

    * the points are sorted by starting cell (:func:`cell_order`), so that neighbouring lanes read neighbouring rows
      of the step-matrix table through all steps (random points: about half the kernels' time);
    * then stably partitioned by the step at which each is predicted to first cross a facet
      (``kernels.crossing_step_kernel``, from the step matrices ``E (B, C, n, 4)`` of ``steps`` steps), so that the
      points that take pieces at a step share programs, and the programs of points that never cross take no pieces.
      A program takes the pieces of a step where any of its points crosses (the 160 x 192 x 224 grid at 16^3, unit
      theta, 5 steps, on the H200: forward 2.8 ms in this order, 7.8 ms by cell alone)."""
    B, N, n = points.shape
    if (B > 1 and points.stride(0) != 0) or N < SORT_MIN:
        return None
    by_cell = cell_order(points, tess)
    shared = _rows(points)[0]
    geometry, divide = _geometry(tess, points.dtype, points.device)
    planes, _neighbors = _facets(tess, points.dtype, points.device)
    block = min(INTERPRETER_BLOCK, pow2(N)) if points.device.type == "cpu" else _ORDER_BLOCK
    programs = triton.cdiv(N, block)
    bucket = torch.empty(N, dtype=torch.int32, device=points.device)
    counts = torch.empty((_BUCKETS, programs), dtype=torch.int32, device=points.device)
    shape = tuple(tess.shape)
    crossing_step_kernel[(programs,)](
        shared, by_cell, padded_rows(E), planes, geometry, bucket, counts, B, N, E.shape[1], shape[0], shape[1],
        steps, NDIM=n, DIVIDE=divide, BUCKETS=_BUCKETS, BLOCK=block, num_warps=4,
    )  # fmt: skip
    flat = counts.flatten()
    offsets = (flat.cumsum(0) - flat).to(torch.int32)
    order = torch.empty_like(by_cell)
    partition_kernel[(programs,)](by_cell, bucket, offsets, order, N, BUCKETS=_BUCKETS, BLOCK=block, num_warps=4)
    return order


def cell_order(points: Tensor, tess: Box) -> Tensor:
    """The shared points ``points (B, N, n)`` (batch 0) sorted by starting cell: int32 ``(N,)``. The order of the
    same, unmodified tensor is reused (``POINT_ORDERS``)."""
    _B, N, n = points.shape
    shape = tuple(tess.shape)
    key = (
        points.device,
        points.dtype,
        points.data_ptr(),
        points._version,
        N,
        n,
        shape,
        tuple(map(float, tess.lower)),
        tuple(map(float, tess.upper)),
    )
    if key not in POINT_ORDERS:
        shared = _rows(points)[0]
        geometry, divide = _geometry(tess, points.dtype, points.device)
        cells = torch.empty(N, dtype=torch.int32, device=points.device)
        block = min(INTERPRETER_BLOCK, pow2(N)) if points.device.type == "cpu" else _ORDER_BLOCK
        cell_kernel[(triton.cdiv(N, block),)](
            shared, geometry, cells, N, shape[0], shape[1], NDIM=n, DIVIDE=divide, BLOCK=block, num_warps=4
        )
        if len(POINT_ORDERS) >= _ORDERS_KEPT:
            del POINT_ORDERS[next(iter(POINT_ORDERS))]
        POINT_ORDERS[key] = torch.argsort(cells).to(torch.int32)
    return POINT_ORDERS[key]


def cpab_fwd(
    points: Tensor,
    A: Tensor,
    E: Tensor,
    tess: Box,
    h: float,
    steps: int,
    checkpoint_every: int,
    order: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The facet-resolved expm-step scheme for ``steps`` steps of ``h`` through the velocities ``A (B, C, n, n + 1)``
    with their step matrices ``E = expm.step_matrices(A, h)`` (both may come in padded rows, ``expm.padded_rows``) from
    ``points (B, N, n)`` (domain coordinates; the batch dimension may be a stride-0 broadcast). Returns the end points
    ``(B, N, n)`` and the checkpoints ``(S - 1, B, N, n)``: the positions after ``K, 2K, ...`` steps,
    ``S = ceil(steps / K)`` (the backward pass takes the points themselves for the first segment; ``K >= steps``
    stores none). ``order`` (int32 ``(N,)``, a permutation, :func:`point_order`) assigns the points to the kernel's
    lanes; the checkpoints are kept in its order (pass the same to :func:`cpab_bwd`)."""
    _check(points, A, E, tess, steps, checkpoint_every)
    B, N, n = points.shape
    points, A, E = _rows(points), padded_rows(A), padded_rows(E)
    geometry, divide = _geometry(tess, points.dtype, points.device)
    planes, neighbors = _facets(tess, points.dtype, points.device)
    out = points.new_empty((B, N, n))
    checkpoints = points.new_empty((-(-steps // checkpoint_every) - 1, B, N, n))
    grid, block, nx, ny = _launch_args(points, tess, FORWARD_BLOCK)
    cpab_fwd_kernel[grid](
        points, points.stride(0), points if order is None else order, E, A, planes, neighbors, geometry, out,
        _or(checkpoints, points), *split_float(h), B, N, E.shape[1], nx, ny, steps, checkpoint_every,
        NDIM=n, DIVIDE=divide, PERMUTED=order is not None, BLOCK=block, num_warps=FORWARD_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    return out, checkpoints


def cpab_bwd(
    points: Tensor,
    checkpoints: Tensor,
    grad_out: Tensor,
    A: Tensor,
    E: Tensor,
    tess: Box,
    h: float,
    steps: int,
    checkpoint_every: int,
    moments: bool,
    point_grad: bool = True,
    order: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The fused factorized adjoint for ``grad_out = dL/dx_T (B, N, n)``, given the forward pass's points and
    checkpoints (every ``checkpoint_every`` steps, as :func:`cpab_fwd` stores them, for the same ``A``, ``E`` and
    ``h``): returns, when ``point_grad``, ``dL/dpoints (B, N, n)`` and, when ``moments``, ``dL/dE (B, C, n, 4)`` in
    padded rows (the regular steps' per-cell moments ``sum lambda_{s+1} [x_s; 1]^T``) and the pieces' ``dL/dA``
    ``(B, C, n, 4)``, also padded (float atomics, so the summation order varies between runs). Then
    ``dL/dA = expm.step_matrices_vjp(A, h, dL/dE) + dL/dA(pieces)``. The kernel sweeps sub-segments of
    ``min(checkpoint_every, 5)`` unrolled steps; longer stored segments are first recomputed into register checkpoints
    (one more pass of the scheme over them, in exchange for less memory). ``order``: the forward pass's."""
    B, N, n = grad_out.shape
    checkpoint_every = min(checkpoint_every, steps)
    points, grad_out, A, E = _rows(points), grad_out.contiguous(), padded_rows(A), padded_rows(E)
    geometry, divide = _geometry(tess, E.dtype, E.device)
    planes, neighbors = _facets(tess, E.dtype, E.device)
    grad_points = torch.empty_like(grad_out) if point_grad else None
    grad_E = torch.zeros_like(E) if moments else None
    direct = torch.zeros_like(E) if moments else None
    segment = min(checkpoint_every, _SEGMENT)
    grid, block, nx, ny = _launch_args(grad_out, tess, _BWD_BLOCK)
    cpab_bwd_kernel[grid](
        points, points.stride(0), points if order is None else order, _or(checkpoints, points), grad_out, E, A, planes,
        neighbors, geometry, grad_out if grad_points is None else grad_points, E if grad_E is None else grad_E,
        E if direct is None else direct, *split_float(h), B, N, E.shape[1], nx, ny, steps, checkpoint_every,
        NDIM=n, SEG=segment, SLOTS=-(-checkpoint_every // segment), UNIFORM=UNIFORM and moments, MOMENTS=moments,
        POINTS=point_grad, DIVIDE=divide, PERMUTED=order is not None, BLOCK=block, num_warps=_BWD_WARPS,
        enable_fp_fusion=False,
        maxnreg=_MAXNREG if E.dtype == torch.float32 else None,
    )  # fmt: skip
    return grad_points, grad_E, direct


class CPABIntegrateTriton(torch.autograd.Function):
    """The facet-resolved expm-step scheme with the fused factorized adjoint.

    ``CPABIntegrateTriton.apply(points (B, N, n), A (B, C, n, n + 1), tess, t, steps, checkpoint_every) -> (B, N, n)``,
    domain coordinates: the signature and the values of ``regkit.cpab.integrate.CPABIntegrate``, up to rounding (the
    step matrices are ``E = expm.step_matrices(A, t / steps)``, one kernel, instead of ``torch.linalg.matrix_exp``,
    and the pieces sum their Taylor polynomials in another order). The gradients differentiate the scheme with the
    visited cells and hit times fixed: the backward kernel writes ``dL/dE``, the regular steps' per-cell moment table,
    which ``expm.step_matrices_vjp`` turns into ``dL/dA``, and adds the pieces' ``dL/dA`` to it. Shared points are
    taken in the order of :func:`point_order` (saved for the backward pass with the checkpoints).
    """

    @staticmethod
    def forward(ctx: Any, points: Tensor, A: Tensor, tess: Box, t: float, steps: int, checkpoint_every: int) -> Tensor:
        h = t / steps
        E = step_matrices(A, h)
        order = point_order(points, E, tess, steps)
        out, checkpoints = cpab_fwd(points, A, E, tess, h, steps, checkpoint_every, order)
        ctx.save_for_backward(points, A, E, checkpoints, order)
        ctx.tess, ctx.h, ctx.steps, ctx.checkpoint_every = tess, h, steps, checkpoint_every
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        need_points, need_A = ctx.needs_input_grad[:2]
        if not (need_points or need_A):
            return None, None, None, None, None, None
        points, A, E, checkpoints, order = ctx.saved_tensors
        grad_points, grad_E, direct = cpab_bwd(
            points, checkpoints, grad_out, A, E, ctx.tess, ctx.h, ctx.steps, ctx.checkpoint_every, need_A,
            need_points, order,
        )  # fmt: skip
        grad_A = None
        if grad_E is not None and direct is not None:
            grad_A = step_matrices_vjp(A, ctx.h, grad_E) + direct[..., : A.shape[-1]]
        return grad_points, grad_A, None, None, None, None


def cpab_integrate(
    points: Tensor, A: Tensor, tess: Box, *, t: float = 1.0, steps: int, checkpoint_every: int
) -> Tensor:
    """Integrate ``points (B, N, n)`` (domain coordinates) for time ``t`` in ``steps`` facet-resolved expm steps
    through the CPA field ``A (B, C, n, n + 1)`` of ``tess``; differentiable with respect to both
    (:class:`CPABIntegrateTriton`). ``checkpoint_every`` sets the memory of the backward pass: the forward stores the
    points every so many steps (``ceil(steps / checkpoint_every) - 1`` copies); at most 5 it costs no recomputation
    beyond one pass of the scheme, longer spacings cost one more pass. Without a graph to record (no gradient wanted)
    none are stored."""
    if not (torch.is_grad_enabled() and (points.requires_grad or A.requires_grad)):
        checkpoint_every = steps
    return CPABIntegrateTriton.apply(points, A, tess, float(t), int(steps), int(checkpoint_every))

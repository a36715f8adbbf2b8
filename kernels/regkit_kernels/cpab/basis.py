"""The CPA basis map ``theta -> A`` (``regkit.cpab.basis.CPABasis.to_A``) and its adjoint, one kernel each.

``A = B theta`` with ``B`` in nodal form: row ``(c, a, m)`` of ``B`` (cell ``c``, velocity component ``a``, column
``m`` of ``A_c``) has a nonzero for each corner ``k`` of the cell whose component ``a`` is free, of value
``scale[j] inv(M_c)[k, m]`` in the column ``j`` of that nodal coordinate. So ``B`` is stored as an ELL table, ``n + 1``
columns per row pair ``(c, a)`` shared by the ``n + 1`` values of ``m``: ``index (C n, n + 1)`` (int32, ``-1`` where the
component is fixed) and ``weight (C n, n + 1, n + 1)`` = ``scale[j] inv(M_c)[k, :]``. The forward kernel gathers
``n + 1`` coordinates per row pair; the adjoint ``B^T G`` gathers, per nodal coordinate, over its incidences (a CSR
table of the transposed index, built once), so it is deterministic and takes no atomics or zero fill. This replaces
the PyTorch face's ~10 launches (``index_copy``, a gather, an ``einsum``, and in the backward an accumulating
``index_put_`` that sorts its indices) by one launch each way.

Works on plain tensors (``BasisTables``); :func:`basis_tables` builds them from any object with the fields of
``CPABasis`` (``tess`` with ``ndim``, ``n_cells`` and ``cell_vertex_ids()``, ``free_vertex``, ``free_axis``,
``scale``, ``cell_inverse``; no volume-preserving reduction).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

_BLOCK = 128
_TABLES: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], BasisTables]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class BasisTables:
    """``B`` as ELL rows (``index``, ``weight``) and the CSR of its transpose (``rowptr``, ``entries``: per nodal
    coordinate, the flat ``(row pair, corner)`` positions ``r (n + 1) + k`` where it appears), in one dtype and
    device; ``degree`` is the largest number of incidences of a coordinate."""

    ndim: int
    cells: int
    d: int
    index: Tensor  # (C n, n + 1) int32
    weight: Tensor  # (C n, n + 1, n + 1)
    rowptr: Tensor  # (d + 1,) int32
    entries: Tensor  # (nnz,) int32
    degree: int


def basis_tables(basis: Any, dtype: torch.dtype, device: torch.device) -> BasisTables:
    """The tables of ``basis`` (a ``CPABasis`` without reduction) in ``dtype`` on ``device``, cached per basis."""
    if getattr(basis, "reduction", None) is not None:
        raise ValueError("volume-preserving bases (with a reduction) are not supported by the fused basis map")
    cache = _TABLES.setdefault(basis, {})
    key = (dtype, torch.device(device))
    if key not in cache:
        tess = basis.tess
        n, C = tess.ndim, tess.n_cells
        ids = np.asarray(tess.cell_vertex_ids())  # (C, n + 1)
        column = np.full(tess.n_vertices * n, -1, dtype=np.int64)
        free = (basis.free_vertex * n + basis.free_axis).numpy()
        column[free] = np.arange(len(free))
        index = column[ids[:, None, :] * n + np.arange(n)[None, :, None]]  # (C, n, n + 1): [c, a, k]
        scale = np.append(basis.scale.numpy(), 0.0)[index]  # index -1 (fixed): 0
        inverse = basis.cell_inverse.numpy()  # (C, n + 1, n + 1): [c, k, m]
        weight = scale[..., None] * inverse[:, None, :, :]  # [c, a, k, m]
        flat = index.reshape(-1)
        order = np.argsort(flat, kind="stable")
        order = order[flat[order] >= 0]
        counts = np.bincount(flat[order], minlength=len(free))
        rowptr = np.concatenate([[0], np.cumsum(counts)])
        cache[key] = BasisTables(
            ndim=n,
            cells=C,
            d=len(free),
            index=torch.from_numpy(index.reshape(C * n, n + 1).astype(np.int32)).to(device),
            weight=torch.from_numpy(weight.reshape(C * n, n + 1, n + 1)).to(device=device, dtype=dtype),
            rowptr=torch.from_numpy(rowptr.astype(np.int32)).to(device),
            entries=torch.from_numpy(order.astype(np.int32)).to(device),
            degree=int(counts.max(initial=0)),
        )
    return cache[key]


@triton.jit(do_not_specialize=["R", "d"])
def _to_a_kernel(theta_ptr, index_ptr, weight_ptr, out_ptr, R, d, Q: tl.constexpr, BLOCK: tl.constexpr):
    """``out[b, r, m] = sum_k theta[b, index[r, k]] weight[r, k, m]`` for the row pairs ``r`` of program 0's block and
    batch element ``program_id(1)``; fixed components (index -1) add nothing."""
    b = tl.program_id(1).to(tl.int64)
    r = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    ok = r < R
    m = tl.arange(0, 4)  # the columns, padded to a power of two
    mask = ok[:, None] & (m < Q)[None, :]
    acc = tl.zeros([BLOCK, 4], dtype=out_ptr.dtype.element_ty)
    for k in tl.static_range(Q):
        j = tl.load(index_ptr + r * Q + k, mask=ok, other=-1)
        t = tl.load(theta_ptr + b * d + j, mask=ok & (j >= 0), other=0.0)
        w = tl.load(weight_ptr + (r * Q + k)[:, None] * Q + m[None, :], mask=mask, other=0.0)
        acc += t[:, None] * w
    tl.store(out_ptr + (b * R + r)[:, None] * Q + m[None, :], acc, mask=mask)


@triton.jit(do_not_specialize=["R", "d", "degree"])
def _to_a_adjoint_kernel(
    grad_ptr, rowptr_ptr, entries_ptr, weight_ptr, out_ptr, R, d, degree, Q: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """``out[b, j] = sum over the incidences e = r Q + k of coordinate j of sum_m grad[b, r, m] weight[r, k, m]``."""
    b = tl.program_id(1).to(tl.int64)
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = j < d
    start = tl.load(rowptr_ptr + j, mask=ok, other=0)
    count = tl.load(rowptr_ptr + j + 1, mask=ok, other=0) - start
    m = tl.arange(0, 4)  # the columns, padded to a power of two
    acc = tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty)
    for i in range(degree):
        live = ok & (i < count)
        mask = live[:, None] & (m < Q)[None, :]
        e = tl.load(entries_ptr + start + i, mask=live, other=0).to(tl.int64)
        r = e // Q
        g = tl.load(grad_ptr + (b * R + r)[:, None] * Q + m[None, :], mask=mask, other=0.0)
        w = tl.load(weight_ptr + e[:, None] * Q + m[None, :], mask=mask, other=0.0)
        acc += tl.sum(g * w, axis=1)
    tl.store(out_ptr + b * d + j, acc, mask=ok)


def _block(size: int) -> int:
    return min(_BLOCK, triton.next_power_of_2(max(size, 1)))


class CellVelocities(torch.autograd.Function):
    """``A (B, C, n, n + 1) = B theta`` for ``theta (B, d)`` and ``BasisTables``; the backward is ``B^T dL/dA``."""

    @staticmethod
    def forward(ctx: Any, theta: Tensor, tables: BasisTables) -> Tensor:
        n, Q = tables.ndim, tables.ndim + 1
        theta = theta.contiguous()
        R = tables.cells * n
        out = theta.new_empty((theta.shape[0], tables.cells, n, Q))
        grid = (triton.cdiv(R, _block(R)), theta.shape[0])
        _to_a_kernel[grid](theta, tables.index, tables.weight, out, R, tables.d, Q=Q, BLOCK=_block(R))
        ctx.tables = tables
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None]:
        tables = ctx.tables
        Q = tables.ndim + 1
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0], tables.d))
        if tables.d == 0:
            return out, None
        grid = (triton.cdiv(tables.d, _block(tables.d)), grad.shape[0])
        _to_a_adjoint_kernel[grid](
            grad, tables.rowptr, tables.entries, tables.weight, out, tables.cells * tables.ndim, tables.d,
            tables.degree, Q=Q, BLOCK=_block(tables.d),
        )  # fmt: skip
        return out, None


def cell_velocities(basis: Any, theta: Tensor) -> Tensor:
    """``basis.to_A(theta)`` in one kernel (and its backward in one): per-cell affine maps ``(C, n, n + 1)`` for
    ``theta (d,)``, ``(B, C, n, n + 1)`` for ``theta (B, d)``; differentiable with respect to ``theta``."""
    if theta.dim() not in (1, 2) or theta.shape[-1] != basis.d:
        raise ValueError(f"theta must have shape ({basis.d},) or (B, {basis.d}), got {tuple(theta.shape)}")
    tables = basis_tables(basis, theta.dtype, theta.device)
    A = CellVelocities.apply(theta.reshape(theta.shape[0] if theta.dim() == 2 else 1, basis.d), tables)
    return A[0] if theta.dim() == 1 else A

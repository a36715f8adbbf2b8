"""The per-cell step matrices of the expm-step scheme and their adjoint, one matrix per GPU thread.

``step_matrices(A, h)`` is ``E = `` the top ``n`` rows of ``expm(h [A; 0])`` for ``A (..., n, n + 1)``, ``n`` in
(2, 3): the same matrices as ``regkit.cpab.integrate.step_matrices`` (``torch.linalg.matrix_exp``) up to rounding.
``step_matrices_vjp(A, h, G)`` is ``dL/dA`` for ``G = dL/dE``: with ``X = h [A; 0]``, the adjoint of the matrix
exponential is the top-right block of ``expm([[X^T, G'], [0, X^T]])`` (``G'`` = ``G`` with a zero row), times ``h``.
Both replace PyTorch's general ``matrix_exp`` (several launches, host synchronisations and, for the adjoint, doubled
matrices through autograd) by one launch each: scaling by a power of two until the infinity norm is at most 1, a
Taylor polynomial (Horner), then squaring, all in float64 whatever the input's dtype. The truncation bound follows
the output dtype: that of degree 18 at norm 1 for float64 (below 1e-17), of degree 12 for float32 (below 1e-9, far
under float32's rounding), so float32 results are correctly rounded up to a few ulps, more accurate than
``matrix_exp`` in float32; each program takes the lowest degree that meets the bound for its matrices (``_degree``).

Each thread holds its matrices as tuples of ``[BLOCK]`` scalars (row-major ``Q x Q``, ``Q = n + 1``) and multiplies
them with unrolled scalar arithmetic: no cross-thread reductions. The step matrices keep ``[A; 0]``'s structure (the
last row of every power is ``(0, .., 0, 1)``, so only the top ``n`` rows are computed); the adjoint works on the blocks
of its block-triangular matrix.
"""

from typing import Any  # noqa: F401  (the type comments of the tuples built in the kernels)

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 128  # matrices per program: one per thread with 4 warps
_DEGREE = {torch.float32: 12, torch.float64: 18}


@triton.jit
def float64_sum(h0, h1, h2):
    """``h0 + h1 + h2`` in float64 (Triton passes Python floats as float32: :func:`split_float` cuts ``h`` in three)."""
    return (tl.cast(h0, tl.float64) + tl.cast(h1, tl.float64)) + tl.cast(h2, tl.float64)


@triton.jit
def _mm(a, b, Q: tl.constexpr):
    """``a @ b`` for row-major ``Q x Q`` matrices held as tuples of ``Q * Q`` tensors."""
    out = ()  # type: tuple[Any, ...]
    for i in tl.static_range(Q):
        for j in tl.static_range(Q):
            s = a[i * Q] * b[j]
            for k in tl.static_range(1, Q):
                s = s + a[i * Q + k] * b[k * Q + j]
            out = out + (s,)  # noqa: RUF005
    return out


@triton.jit
def _mm_top(a, b, NDIM: tl.constexpr):
    """Top ``NDIM`` rows of ``a @ b`` for ``(NDIM + 1)``-square matrices whose last row is ``(0, .., 0, 1)``, held as
    their top rows (tuples of ``NDIM (NDIM + 1)`` tensors, row-major)."""
    Q: tl.constexpr = NDIM + 1
    out = ()  # type: tuple[Any, ...]
    for i in tl.static_range(NDIM):
        for j in tl.static_range(Q):
            s = a[i * Q] * b[j]
            for k in tl.static_range(1, NDIM):
                s = s + a[i * Q + k] * b[k * Q + j]
            if j == NDIM:
                s = s + a[i * Q + NDIM]
            out = out + (s,)  # noqa: RUF005
    return out


@triton.jit
def _scale(a, f, SIZE: tl.constexpr):
    out = ()  # type: tuple[Any, ...]
    for i in tl.static_range(SIZE):
        out = out + (a[i] * f,)  # noqa: RUF005
    return out


@triton.jit
def _add(a, b, SIZE: tl.constexpr):
    out = ()  # type: tuple[Any, ...]
    for i in tl.static_range(SIZE):
        out = out + (a[i] + b[i],)  # noqa: RUF005
    return out


@triton.jit
def _plus_identity(a, ROWS: tl.constexpr, Q: tl.constexpr):
    """``a + I`` for the top ``ROWS`` rows of a ``Q``-square matrix."""
    out = ()  # type: tuple[Any, ...]
    for i in tl.static_range(ROWS):
        for j in tl.static_range(Q):
            if i == j:
                out = out + (a[i * Q + j] + 1.0,)  # noqa: RUF005
            else:
                out = out + (a[i * Q + j],)  # noqa: RUF005
    return out


@triton.jit
def _select(cond, a, b, SIZE: tl.constexpr):
    out = ()  # type: tuple[Any, ...]
    for i in tl.static_range(SIZE):
        out = out + (tl.where(cond, a[i], b[i]),)  # noqa: RUF005
    return out


@triton.jit
def _row_sums(a, ROWS: tl.constexpr, Q: tl.constexpr):
    """Largest row sum of ``|a|`` (the infinity norm of the top ``ROWS`` rows)."""
    norm = tl.abs(a[0]) * 0.0
    for i in tl.static_range(ROWS):
        s = tl.abs(a[i * Q])
        for j in tl.static_range(1, Q):
            s = s + tl.abs(a[i * Q + j])
        norm = tl.maximum(norm, s)
    return norm


@triton.jit
def _scaling(norm):
    """Squarings ``s`` (float) that bring ``norm`` to at most 1; NaN and inf give 0 (they stay NaN/inf), at most 64."""
    s = tl.ceil(tl.log2(tl.maximum(norm, 1e-300)))
    return tl.where(s == s, tl.minimum(tl.maximum(s, 0.0), 64.0), 0.0)


@triton.jit
def _degree(norm, DEG: tl.constexpr):
    """The Taylor degree a program needs for matrices of infinity norm ``norm <= 1`` (after scaling): the largest over
    its matrices of the smallest ``d`` with ``norm^(d + 1) / (d + 1)! <= 1 / (DEG + 1)!``, the truncation bound of
    degree ``DEG`` at norm 1 (the terms ``norm^j / j!`` fall with ``j``). Small velocities (the usual case: ``h`` is a
    fraction of the time) need a few terms instead of ``DEG``. NaN or inf norms take ``DEG + 1``."""
    bound = tl.full([], 1.0, tl.float64)
    for j in tl.static_range(2, DEG + 2):
        bound = bound / j
    term = norm * 0.0 + 1.0
    need = tl.zeros(norm.shape, tl.int32)
    for j in tl.static_range(1, DEG + 2):
        term = term * norm / j
        need = tl.where(term > bound, j, need)
    need = tl.where(norm < 2.0, need, DEG + 1)  # NaN or inf
    return tl.max(need, axis=0)


@triton.jit(do_not_specialize=["R"])
def step_matrices_kernel(
    a_ptr, e_ptr, h0, h1, h2, R, NDIM: tl.constexpr, DEG: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """``e[r] = (expm(h [a[r]; 0]))[:NDIM]`` for ``R`` row-major ``NDIM x (NDIM + 1)`` matrices, written as padded
    ``NDIM x 4`` rows (a zero last column in 2D). Computed in float64 on the top rows (module docstring)."""
    Q: tl.constexpr = NDIM + 1
    h = float64_sum(h0, h1, h2)
    row = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    ok = row < R
    m = ()  # type: tuple[Any, ...]
    for i in tl.static_range(NDIM * Q):
        m = m + (tl.load(a_ptr + row * (NDIM * Q) + i, mask=ok, other=0.0).to(tl.float64) * h,)  # noqa: RUF005
    norm = _row_sums(m, NDIM, Q)
    s = _scaling(norm)
    m = _scale(m, tl.exp2(-s), NDIM * Q)
    t = _plus_identity(_scale(m, 0.0, NDIM * Q), NDIM, Q)
    for k in range(tl.minimum(_degree(norm * tl.exp2(-s), DEG), DEG), 0, -1):
        t = _plus_identity(_scale(_mm_top(m, t, NDIM), 1.0 / tl.cast(k, tl.float64), NDIM * Q), NDIM, Q)
    for i in range(tl.max(s, axis=0).to(tl.int32)):
        t = _select(i < s, _mm_top(t, t, NDIM), t, NDIM * Q)
    for i in tl.static_range(NDIM):
        for j in tl.static_range(4):
            if j < Q:
                value = t[i * Q + j]
            else:
                value = t[0] * 0.0
            tl.store(e_ptr + row * (NDIM * 4) + i * 4 + j, value.to(e_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["R"])
def step_matrices_vjp_kernel(
    a_ptr, g_ptr, out_ptr, h0, h1, h2, R, NDIM: tl.constexpr, DEG: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """``out[r] = h L[:NDIM, :NDIM + 1]``, ``L`` the top-right block of ``expm([[X^T, G'], [0, X^T]])`` with
    ``X = h [a[r]; 0]`` and ``G' = [g[r]; 0]`` (``g`` in padded ``NDIM x 4`` rows; its last column is not read in
    2D). ``L`` is linear in ``G'``: the squarings and the degree follow ``X`` alone (the top-right block's truncation
    error after degree ``d`` is about ``|G'| |X|^d / d!``: one degree more than the exponential's, and one more for
    the constant), and ``G'`` is scaled to a largest entry of 1. The block matrix stays block upper triangular
    through Horner's steps and the squarings, ``[[A, B], [0, A]] [[C, D], [0, C]] = [[AC, AD + BC], [0, AC]]``.
    Computed in float64."""
    Q: tl.constexpr = NDIM + 1
    h = float64_sum(h0, h1, h2)
    row = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    ok = row < R
    zero = tl.zeros([BLOCK], dtype=tl.float64)
    y = ()  # type: tuple[Any, ...]  # X^T
    g = ()  # type: tuple[Any, ...]
    for i in tl.static_range(Q):
        for j in tl.static_range(Q):
            if j < NDIM:
                y = y + (tl.load(a_ptr + row * (NDIM * Q) + j * Q + i, mask=ok, other=0.0).to(tl.float64) * h,)  # noqa: RUF005
            else:
                y = y + (zero,)  # noqa: RUF005
            if i < NDIM:
                g = g + (tl.load(g_ptr + row * (NDIM * 4) + i * 4 + j, mask=ok, other=0.0).to(tl.float64),)  # noqa: RUF005
            else:
                g = g + (zero,)  # noqa: RUF005
    size = tl.abs(g[0])
    for i in tl.static_range(1, Q * Q):
        size = tl.maximum(size, tl.abs(g[i]))
    size = tl.where(size > 0, size, 1.0)
    norm = _row_sums(y, Q, Q)
    s = _scaling(norm)
    scale = tl.exp2(-s)
    y = _scale(y, scale, Q * Q)
    g = _scale(g, scale / size, Q * Q)
    t = _plus_identity(_scale(y, 0.0, Q * Q), Q, Q)
    u = _scale(y, 0.0, Q * Q)
    for k in range(_degree(norm * scale, DEG) + 2, 0, -1):
        inverse = 1.0 / tl.cast(k, tl.float64)
        u = _scale(_add(_mm(y, u, Q), _mm(g, t, Q), Q * Q), inverse, Q * Q)
        t = _plus_identity(_scale(_mm(y, t, Q), inverse, Q * Q), Q, Q)
    for i in range(tl.max(s, axis=0).to(tl.int32)):
        square = i < s
        u = _select(square, _add(_mm(t, u, Q), _mm(u, t, Q), Q * Q), u, Q * Q)
        t = _select(square, _mm(t, t, Q), t, Q * Q)
    for i in tl.static_range(NDIM):
        for j in tl.static_range(Q):
            value = u[i * Q + j] * (size * h)
            tl.store(out_ptr + row * (NDIM * Q) + i * Q + j, value.to(out_ptr.dtype.element_ty), mask=ok)


def split_float(h: float) -> tuple[float, float, float]:
    """``h`` as three float32 values whose sum in float64 is ``h`` (24 bits each cover float64's 53)."""
    h0 = float(np.float32(h))
    h1 = float(np.float32(h - h0))
    return h0, h1, float(np.float32(h - h0 - h1))


def _launch(kernel, R: int, *args, h: float, dtype: torch.dtype, ndim: int) -> None:
    if dtype not in _DEGREE or ndim not in (2, 3):
        raise ValueError(f"step matrices take float32/float64 (..., n, n + 1) with n in (2, 3), got {dtype}, n={ndim}")
    grid = (triton.cdiv(R, _BLOCK),)
    kernel[grid](*args, *split_float(h), R, NDIM=ndim, DEG=_DEGREE[dtype], BLOCK=_BLOCK, num_warps=4)


def padded_rows(M: Tensor) -> Tensor:
    """``(..., n, n + 1)`` matrices as contiguous rows of 4 (the kernels' table layout: one 16-byte vector per row in
    float32); ``(..., n, 4)`` ones as they are."""
    if M.shape[-1] == 4:
        return M.contiguous()  # no copy when it already is (the fused path's own step matrices and moments)
    return torch.nn.functional.pad(M, (0, 4 - M.shape[-1])).contiguous()


def step_matrices(A: Tensor, h: float) -> Tensor:
    """``E (..., n, 4)``: the top ``n`` rows of ``expm(h [A; 0])`` for ``A (..., n, n + 1)`` (module docstring), in
    padded rows (:func:`padded_rows`)."""
    A = A.contiguous()
    E = A.new_empty((*A.shape[:-1], 4))
    n = A.shape[-2]
    _launch(step_matrices_kernel, A.numel() // (n * (n + 1)), A, E, h=h, dtype=A.dtype, ndim=n)
    return E


def step_matrices_vjp(A: Tensor, h: float, grad_E: Tensor) -> Tensor:
    """``dL/dA (..., n, n + 1)`` for ``grad_E = dL/dE`` (``(..., n, n + 1)`` or padded rows) through
    :func:`step_matrices` (module docstring)."""
    A, grad_E = A.contiguous(), padded_rows(grad_E)
    out = torch.empty_like(A)
    n = A.shape[-2]
    _launch(step_matrices_vjp_kernel, A.numel() // (n * (n + 1)), A, grad_E, out, h=h, dtype=A.dtype, ndim=n)
    return out

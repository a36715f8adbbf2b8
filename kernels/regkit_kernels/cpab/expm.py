"""The per-cell step matrices of the expm-step scheme and their adjoint, one Triton program per block of cells.

``step_matrices(A, h)`` is ``E = `` the top ``n`` rows of ``expm(h [A; 0])`` for ``A (..., n, n + 1)``, ``n`` in
(2, 3): the same matrices as ``regkit.cpab.integrate.step_matrices`` (``torch.linalg.matrix_exp``) up to rounding.
``step_matrices_vjp(A, h, G)`` is ``dL/dA`` for ``G = dL/dE``: with ``X = h [A; 0]``, the adjoint of the matrix
exponential is the top-right block of ``expm([[X^T, G'], [0, X^T]])`` (``G'`` = ``G`` with a zero row), times ``h``.
Both replace PyTorch's general ``matrix_exp`` (several launches, host synchronisations and, for the adjoint, doubled
matrices through autograd) by one launch each: scaling by a power of two until the infinity norm is at most 1, a
Taylor polynomial (Horner, degree 18: truncation below 1e-17), then squaring, all in float64 whatever the input's
dtype (the matrices are few and tiny; float32 results are then correctly rounded up to a few ulps, more accurate than
``matrix_exp`` in float32). Matrices are held padded to ``4 x 4`` in registers (padding with zero rows and columns
leaves the exponential's leading block unchanged); the adjoint works on the blocks of its block-triangular matrix.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 16  # matrices per program


@triton.jit
def _matmul(a, b):
    """Batched product of ``[R, Q, Q]`` matrices, one block of registers (the matrices are tiny)."""
    return tl.sum(a[:, :, :, None] * b[:, None, :, :], axis=2)


@triton.jit
def _scaling(norm):
    """Squarings ``s`` (float) that bring ``norm`` to at most 1; NaN and inf give 0 (they stay NaN/inf), at most 64."""
    s = tl.ceil(tl.log2(tl.maximum(norm, 1e-300)))
    return tl.where(s == s, tl.minimum(tl.maximum(s, 0.0), 64.0), 0.0)


@triton.jit
def _expm(m, eye, DEG: tl.constexpr):
    """``expm`` of each ``[4, 4]`` matrix of ``m [R, 4, 4]`` (float64) by scaling and squaring a degree-``DEG`` Taylor
    polynomial (Horner). ``eye`` is the ``[1, 4, 4]`` identity."""
    s = _scaling(tl.max(tl.sum(tl.abs(m), axis=2), axis=1))
    m = m * tl.exp2(-s)[:, None, None]
    t = eye + m * 0.0
    for k in tl.static_range(DEG, 0, -1):
        t = eye + _matmul(m, t) * (1.0 / k)
    for i in range(tl.max(s, axis=0).to(tl.int32)):
        t = tl.where((i < s)[:, None, None], _matmul(t, t), t)
    return t


@triton.jit
def _expm_frechet(y, g, eye, DEG: tl.constexpr):
    """The top-right block ``L`` of ``expm([[y, g], [0, y]])`` for ``[R, 4, 4]`` blocks (float64), worked on the blocks:
    the block matrix stays block upper triangular through Horner's steps and the squarings,
    ``[[A, B], [0, A]] [[C, D], [0, C]] = [[AC, AD + BC], [0, AC]]``."""
    s = _scaling(tl.max(tl.sum(tl.abs(y), axis=2) + tl.sum(tl.abs(g), axis=2), axis=1))
    scale = tl.exp2(-s)[:, None, None]
    y, g = y * scale, g * scale
    t, u = eye + y * 0.0, y * 0.0
    for k in tl.static_range(DEG, 0, -1):
        t, u = eye + _matmul(y, t) * (1.0 / k), (_matmul(y, u) + _matmul(g, t)) * (1.0 / k)
    for i in range(tl.max(s, axis=0).to(tl.int32)):
        square = (i < s)[:, None, None]
        t, u = tl.where(square, _matmul(t, t), t), tl.where(square, _matmul(t, u) + _matmul(u, t), u)
    return u


@triton.jit
def _step_matrices_kernel(a_ptr, e_ptr, h, R, NDIM: tl.constexpr, DEG: tl.constexpr, BLOCK: tl.constexpr):
    """``e[r] = (expm(h [a[r]; 0]))[:NDIM]`` for ``R`` row-major ``NDIM x (NDIM + 1)`` matrices, written as padded
    ``NDIM x 4`` rows (a zero last column in 2D). Computed in float64."""
    M: tl.constexpr = NDIM * (NDIM + 1)
    row = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK))[:, None, None].to(tl.int64)
    r = tl.arange(0, 4)[None, :, None]
    c = tl.arange(0, 4)[None, None, :]
    m = tl.load(a_ptr + row * M + r * (NDIM + 1) + c, mask=(row < R) & (r < NDIM) & (c < NDIM + 1), other=0.0)
    t = _expm(m.to(tl.float64) * h, (r == c).to(tl.float64), DEG)
    tl.store(e_ptr + row * (NDIM * 4) + r * 4 + c, t.to(e_ptr.dtype.element_ty), mask=(row < R) & (r < NDIM))


@triton.jit
def _step_matrices_vjp_kernel(
    a_ptr, g_ptr, out_ptr, h, R, NDIM: tl.constexpr, DEG: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """``out[r] = h L[:NDIM, :NDIM + 1]``, ``L`` the top-right block of ``expm([[X^T, G'], [0, X^T]])`` with
    ``X = h [a[r]; 0]`` and ``G' = [g[r]; 0]`` padded to ``4 x 4`` (``g`` in padded ``NDIM x 4`` rows; its last column
    is not read in 2D). ``G'`` is scaled to a largest entry of 1 (``L`` is linear in it), so that its size does not set
    the number of squarings. Computed in float64."""
    M: tl.constexpr = NDIM * (NDIM + 1)
    row = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK))[:, None, None].to(tl.int64)
    r = tl.arange(0, 4)[None, :, None]
    c = tl.arange(0, 4)[None, None, :]
    ok = row < R
    y = tl.load(a_ptr + row * M + c * (NDIM + 1) + r, mask=ok & (c < NDIM) & (r < NDIM + 1), other=0.0)  # X^T / h
    inside = ok & (r < NDIM) & (c < NDIM + 1)
    g = tl.load(g_ptr + row * (NDIM * 4) + r * 4 + c, mask=inside, other=0.0).to(tl.float64)
    scale = tl.max(tl.max(tl.abs(g), axis=2), axis=1)
    scale = tl.where(scale > 0, scale, 1.0)[:, None, None]
    u = _expm_frechet(y.to(tl.float64) * h, g / scale, (r == c).to(tl.float64), DEG)
    tl.store(out_ptr + row * M + r * (NDIM + 1) + c, (u * scale * h).to(out_ptr.dtype.element_ty), mask=inside)


def _launch(kernel, R: int, *args, dtype: torch.dtype, ndim: int) -> None:
    if dtype not in (torch.float32, torch.float64) or ndim not in (2, 3):
        raise ValueError(f"step matrices take float32/float64 (..., n, n + 1) with n in (2, 3), got {dtype}, n={ndim}")
    kernel[(triton.cdiv(R, _BLOCK),)](*args, R, NDIM=ndim, DEG=18, BLOCK=_BLOCK, num_warps=4)


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
    _launch(_step_matrices_kernel, A.numel() // (n * (n + 1)), A, E, float(h), dtype=A.dtype, ndim=n)
    return E


def step_matrices_vjp(A: Tensor, h: float, grad_E: Tensor) -> Tensor:
    """``dL/dA (..., n, n + 1)`` for ``grad_E = dL/dE`` (``(..., n, n + 1)`` or padded rows) through
    :func:`step_matrices` (module docstring)."""
    A, grad_E = A.contiguous(), padded_rows(grad_E)
    out = torch.empty_like(A)
    n = A.shape[-2]
    _launch(_step_matrices_vjp_kernel, A.numel() // (n * (n + 1)), A, grad_E, out, float(h), dtype=A.dtype, ndim=n)
    return out

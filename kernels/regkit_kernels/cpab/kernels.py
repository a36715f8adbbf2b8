"""Triton kernels of the CPAB expm-step scheme: forward with checkpoints, and the fused factorized adjoint.

The scheme and its per-point arithmetic are those of ``regkit.cpab.integrate`` (the spec): ``T`` steps
``x <- E_c [x; 1]`` with ``c`` found by the closed-form lookup of ``regkit.cpab.tessellation.Tessellation.locate``,
component ``i`` evaluated as ``((E_i0 x_0 + E_i1 x_1) [+ E_i2 x_2]) + e_i``. The launchers compile these kernels with
floating-point contraction off, so every product and sum is rounded as in PyTorch and the visited cells are the same.

Every program owns ``BLOCK`` points of one batch element (``program_id(1)``) and keeps them in registers through all
steps. ``geom_ptr`` holds, in the working dtype, the box's ``lower`` (NDIM values), a per-axis scale (NDIM: the extent
``upper - lower``, or its inverse when every extent is a power of two and ``DIVIDE`` is off), the per-axis box counts
(NDIM) and the counts minus one (NDIM), rounded exactly as ``locate`` rounds them. ``e_ptr`` is the step-matrix table
``E (B, C, NDIM, 4)``, contiguous, each row padded to 4 values (zero last column in 2D), so that a row is one aligned
vector load; the moment table has the same layout. Few, wide memory operations also keep Triton's compile time down (its
coalescing pass grows much faster than linearly with the number of loads and atomics in the unrolled backward).
Checkpoint ``s = 1 .. S - 1`` is the position after ``s K`` steps, ``S = ceil(T / K)`` (the points themselves are
checkpoint 0); the checkpoint table holds ``(S - 1, B, N, NDIM)``.
"""

import triton
import triton.language as tl


@triton.jit
def _geometry(geom_ptr, NDIM: tl.constexpr):
    """The box's ``lower``, per-axis scale (``extent``, or ``1 / extent`` when not ``DIVIDE``), box counts and box
    counts minus one, loaded once per program (values, not loads or arithmetic, inside the step loops)."""
    lo0 = tl.load(geom_ptr)
    lo1 = tl.load(geom_ptr + 1)
    sc0 = tl.load(geom_ptr + NDIM)
    sc1 = tl.load(geom_ptr + NDIM + 1)
    n0 = tl.load(geom_ptr + 2 * NDIM)
    n1 = tl.load(geom_ptr + 2 * NDIM + 1)
    t0 = tl.load(geom_ptr + 3 * NDIM)
    t1 = tl.load(geom_ptr + 3 * NDIM + 1)
    if NDIM == 3:
        lo2 = tl.load(geom_ptr + 2)
        sc2 = tl.load(geom_ptr + NDIM + 2)
        n2 = tl.load(geom_ptr + 2 * NDIM + 2)
        t2 = tl.load(geom_ptr + 3 * NDIM + 2)
    else:
        lo2, sc2, n2, t2 = lo0, sc0, n0, t0
    return (lo0, lo1, lo2), (sc0, sc1, sc2), (n0, n1, n2), (t0, t1, t2)


@triton.jit
def _axis(x, lower, scale, count, top, DIVIDE: tl.constexpr):
    """Box index (int32) and in-box coordinate along one axis, exactly as ``Tessellation.locate``:
    ``u = clamp((x - lower) / extent, 0, 1) * count`` (NaN -> 0: ``tl.maximum`` of a NaN and a number is the number,
    ``maxnum``, as ``locate``'s NaN -> lower), ``top = count - 1``. Without ``DIVIDE`` the extent is a power of two
    and ``scale = 1 / extent``, so that the product is the quotient, bit for bit. ``u - box`` is exact and in [0, 1]
    (the fraction of a float, or 1 on the upper face), so ``locate``'s clamp of it changes nothing and is left out."""
    if DIVIDE:
        if x.dtype == tl.float32:
            u = tl.math.div_rn(x - lower, scale)
        else:
            u = (x - lower) / scale
    else:
        u = (x - lower) * scale
    u = tl.minimum(tl.maximum(u, 0.0), 1.0) * count
    box = tl.minimum(tl.floor(u), top)  # x == upper belongs to the last box
    return box.to(tl.int32), u - box


@triton.jit
def _locate(x0, x1, x2, geo, NX, NY, NDIM: tl.constexpr, DIVIDE: tl.constexpr):
    """Cell ids (int32) of the points; ``x2`` is ignored in 2D. Numbering as ``Tessellation.locate``."""
    lower, scale, count, top = geo
    bx, lx = _axis(x0, lower[0], scale[0], count[0], top[0], DIVIDE)
    by, ly = _axis(x1, lower[1], scale[1], count[1], top[1], DIVIDE)
    if NDIM == 2:
        above_main = ly > lx
        above_anti = ly > 1.0 - lx
        cell = 2 * above_main.to(tl.int32) + (above_main != above_anti).to(tl.int32)
        return 4 * (bx + NX * by) + cell
    else:
        bz, lz = _axis(x2, lower[2], scale[2], count[2], top[2], DIVIDE)
        odd = ((bx + by + bz) % 2) == 1
        lx = tl.where(odd, 1.0 - lx, lx)
        cell = (
            (lx - ly - lz > 0).to(tl.int32)
            + 2 * (ly - lx - lz > 0).to(tl.int32)
            + 3 * (lz - lx - ly > 0).to(tl.int32)
            + 4 * (lx + ly + lz > 2).to(tl.int32)
        )
        return 5 * (bx + NX * (by + NY * bz)) + cell


@triton.jit
def _unpack(v):
    """The 4 columns of a ``[BLOCK, 4]`` tensor as ``[BLOCK]`` tensors (register moves, no arithmetic)."""
    even, odd = tl.split(tl.reshape(v, [v.shape[0], 2, 2]))
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


@triton.jit
def _pack(c0, c1, c2, c3):
    """``[BLOCK, 4]`` from 4 ``[BLOCK]`` columns (the inverse of ``_unpack``)."""
    return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [c0.shape[0], 4])


@triton.jit
def _load_row(row_ptr):
    """Row ``row_ptr -> (4,)`` of a padded table for each point in one vector load, as its 4 columns. Unmasked: every
    point, also a padding lane's (zero coordinates), has a valid cell."""
    return _unpack(tl.load(row_ptr[:, None] + tl.arange(0, 4)[None, :]))


@triton.jit
def _affine_row(e0, e1, e2, e3, x0, x1, x2, NDIM: tl.constexpr):
    """``E_i [x; 1]`` for row ``E_i = (e0, e1, e2[, e3])``, in the spec's order."""
    y = e0 * x0 + e1 * x1
    if NDIM == 2:
        return y + e2
    else:
        return (y + e2 * x2) + e3


@triton.jit
def _step(e_batch, x0, x1, x2, geo, NX, NY, NDIM: tl.constexpr, DIVIDE: tl.constexpr):
    """One scheme step: the new points and the cells the step used."""
    cell = _locate(x0, x1, x2, geo, NX, NY, NDIM, DIVIDE)
    e = e_batch + cell * (4 * NDIM)
    p0, p1, p2, p3 = _load_row(e)
    q0, q1, q2, q3 = _load_row(e + 4)
    y0 = _affine_row(p0, p1, p2, p3, x0, x1, x2, NDIM)
    y1 = _affine_row(q0, q1, q2, q3, x0, x1, x2, NDIM)
    if NDIM == 3:
        r0, r1, r2, r3 = _load_row(e + 8)
        x2 = _affine_row(r0, r1, r2, r3, x0, x1, x2, NDIM)
    return y0, y1, x2, cell


@triton.jit
def _load_points(ptr, idx, ok, NDIM: tl.constexpr):
    x0 = tl.load(ptr + idx * NDIM, mask=ok, other=0.0)
    x1 = tl.load(ptr + idx * NDIM + 1, mask=ok, other=0.0)
    if NDIM == 3:
        x2 = tl.load(ptr + idx * NDIM + 2, mask=ok, other=0.0)
    else:
        x2 = x0
    return x0, x1, x2


@triton.jit
def _store_points(ptr, idx, x0, x1, x2, ok, NDIM: tl.constexpr):
    tl.store(ptr + idx * NDIM, x0, mask=ok)
    tl.store(ptr + idx * NDIM + 1, x1, mask=ok)
    if NDIM == 3:
        tl.store(ptr + idx * NDIM + 2, x2, mask=ok)


# Sizes are not specialised on (divisibility by 16, equality to 1): one compiled kernel serves every problem size, so a
# warm-up call on a few points compiles what the real call uses.
_SIZES = ["x_batch_stride", "B", "N", "C", "NX", "NY", "T", "K"]


@triton.jit
def _points_of(perm_ptr, idx, ok, PERMUTED: tl.constexpr):
    """The points (their rows in the caller's tensors) that the lanes ``idx`` work on: ``perm[idx]`` or ``idx``."""
    if PERMUTED:
        p = tl.load(perm_ptr + idx, mask=ok, other=0)
    else:
        p = idx
    return p


@triton.jit(do_not_specialize=["N", "NX", "NY"])
def cell_kernel(x_ptr, geom_ptr, out_ptr, N, NX, NY, NDIM: tl.constexpr, DIVIDE: tl.constexpr, BLOCK: tl.constexpr):
    """``out (N,)`` int32: the cell of each of the points ``x (N, NDIM)`` (the sort key of ``ops.point_order``)."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < N
    x0, x1, x2 = _load_points(x_ptr, idx, ok, NDIM)
    tl.store(out_ptr + idx, _locate(x0, x1, x2, _geometry(geom_ptr, NDIM), NX, NY, NDIM, DIVIDE), mask=ok)


@triton.jit(do_not_specialize=_SIZES)
def cpab_fwd_kernel(
    x_ptr, x_batch_stride, perm_ptr, e_ptr, geom_ptr, out_ptr, ckpt_ptr, B, N, C, NX, NY, T, K, NDIM: tl.constexpr,
    DIVIDE: tl.constexpr, PERMUTED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``out (B, N, NDIM)`` = the points after ``T`` steps; ``ckpt (S - 1, B, N, NDIM)`` = the positions after K, 2K,
    ... steps. ``x_ptr`` rows are contiguous, ``x_batch_stride`` apart (0 for points shared by the batch). With
    ``PERMUTED``, lane ``i`` works on point ``perm[i]`` (points and ``out`` are read and written at that row, the
    checkpoints are kept in lane order)."""
    b = tl.program_id(1).to(tl.int64)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < N
    p = _points_of(perm_ptr, idx, ok, PERMUTED)
    geo = _geometry(geom_ptr, NDIM)
    x0, x1, x2 = _load_points(x_ptr + b * x_batch_stride, p, ok, NDIM)
    e_batch = e_ptr + b * C * (4 * NDIM)
    S = tl.cdiv(T, K)
    for seg in range(S):
        if seg > 0:
            _store_points(ckpt_ptr + ((seg - 1) * B + b) * N * NDIM, idx, x0, x1, x2, ok, NDIM)
        for _ in range(tl.minimum(K, T - seg * K)):
            x0, x1, x2, _cell = _step(e_batch, x0, x1, x2, geo, NX, NY, NDIM, DIVIDE)
    _store_points(out_ptr + b * N * NDIM, p, x0, x1, x2, ok, NDIM)


@triton.jit
def _flush(mom_ptr, cell, changed, ok, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, NDIM: tl.constexpr):
    """Add the accumulated moment rows of ``cell`` (padded ``NDIM x 4``) to the table where ``changed``: one vector
    atomic per row (``red.global.add.v4.f32`` on sm_90; in 2D the padding column adds zeros, which keeps the vector)."""
    p = (mom_ptr + cell * (4 * NDIM))[:, None] + tl.arange(0, 4)[None, :]
    m = (ok & changed & (cell >= 0))[:, None]
    if NDIM == 2:
        zero = tl.zeros_like(a0)
        tl.atomic_add(p, _pack(a0, a1, a2, zero), mask=m, sem="relaxed")
        tl.atomic_add(p + 4, _pack(a3, a4, a5, zero), mask=m, sem="relaxed")
    else:
        tl.atomic_add(p, _pack(a0, a1, a2, a3), mask=m, sem="relaxed")
        tl.atomic_add(p + 4, _pack(a4, a5, a6, a7), mask=m, sem="relaxed")
        tl.atomic_add(p + 8, _pack(a8, a9, a10, a11), mask=m, sem="relaxed")


@triton.jit
def _select(j, slots, SLOTS: tl.constexpr):
    """``slots[j]`` for a run-time ``j`` (a chain of selects over the register tuple)."""
    x = slots[0]
    for q in tl.static_range(1, SLOTS):
        x = tl.where(j == q, slots[q], x)
    return x


@triton.jit
def _flushed(mom_ptr, cell, changed, ok, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, NDIM: tl.constexpr):
    """:func:`_flush`, then the flushed points' moment registers zeroed (they start on their new cell)."""
    _flush(mom_ptr, cell, changed, ok, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, NDIM)
    a0, a1, a2 = tl.where(changed, 0.0, a0), tl.where(changed, 0.0, a1), tl.where(changed, 0.0, a2)
    a3, a4, a5 = tl.where(changed, 0.0, a3), tl.where(changed, 0.0, a4), tl.where(changed, 0.0, a5)
    a6, a7, a8 = tl.where(changed, 0.0, a6), tl.where(changed, 0.0, a7), tl.where(changed, 0.0, a8)
    a9, a10, a11 = tl.where(changed, 0.0, a9), tl.where(changed, 0.0, a10), tl.where(changed, 0.0, a11)
    return a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11


@triton.jit
def _moments(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, l0, l1, l2, x0, x1, x2, NDIM: tl.constexpr):
    """``a += lambda [x; 1]^T`` (row-major ``NDIM x (NDIM + 1)`` in the first 6 / 12 registers), fused multiply-adds."""
    if NDIM == 2:
        a0, a1, a2 = tl.fma(l0, x0, a0), tl.fma(l0, x1, a1), a2 + l0
        a3, a4, a5 = tl.fma(l1, x0, a3), tl.fma(l1, x1, a4), a5 + l1
    else:
        a0, a1, a2, a3 = tl.fma(l0, x0, a0), tl.fma(l0, x1, a1), tl.fma(l0, x2, a2), a3 + l0
        a4, a5, a6, a7 = tl.fma(l1, x0, a4), tl.fma(l1, x1, a5), tl.fma(l1, x2, a6), a7 + l1
        a8, a9, a10, a11 = tl.fma(l2, x0, a8), tl.fma(l2, x1, a9), tl.fma(l2, x2, a10), a11 + l2
    return a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11


@triton.jit(do_not_specialize=_SIZES)
def cpab_bwd_kernel(
    x_ptr, x_batch_stride, perm_ptr, ckpt_ptr, g_ptr, e_ptr, geom_ptr, gx_ptr, mom_ptr, B, N, C, NX, NY, T, K,
    NDIM: tl.constexpr, SEG: tl.constexpr, SLOTS: tl.constexpr, UNIFORM: tl.constexpr, MOMENTS: tl.constexpr,
    POINTS: tl.constexpr, DIVIDE: tl.constexpr, PERMUTED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The adjoint sweep: ``lambda_T = g``, then for ``s = T - 1 .. 0``: ``dL/dE_{c_s} += lambda_{s+1} [x_s; 1]^T``
    and ``lambda_s = E_lin(c_s)^T lambda_{s+1}``. Writes, when ``POINTS``, ``gx = lambda_0 (B, N, NDIM)`` and, when
    ``MOMENTS``, adds into ``mom (B, C, NDIM, 4)`` (zeroed by the caller).

    Stored segments (``K`` steps from a checkpoint) are taken last first. Within one, the positions every ``SEG`` steps
    are recomputed into registers (``SLOTS = ceil(K / SEG)`` of them; none to compute when ``SLOTS == 1``), and its
    sub-segments are taken last first: the ``SEG`` positions and cells of a sub-segment are recomputed (bit-identical
    to the forward, so the same cells ``c_s``) into registers (tuples, unrolled: ``SEG`` is a compile-time constant),
    then swept backward.

    A point's moment is accumulated in registers while it stays in one cell and added to the table (one vector of
    atomics per row) when its cell changes, and once at the end; with ``UNIFORM`` the flush and the reset are skipped
    by the whole program at the steps where none of its points changes cell. The moments and the adjoint take explicit
    fused multiply-adds (the launchers turn contraction off for the positions, which must round as PyTorch's; the
    adjoint need not, and rounds once instead of twice). ``PERMUTED`` as in the forward kernel (``g`` and ``gx`` at the
    lanes' points, the checkpoints in lane order)."""
    b = tl.program_id(1).to(tl.int64)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < N
    p = _points_of(perm_ptr, idx, ok, PERMUTED)
    geo = _geometry(geom_ptr, NDIM)
    l0, l1, l2 = _load_points(g_ptr + b * N * NDIM, p, ok, NDIM)
    e_batch = e_ptr + b * C * (4 * NDIM)
    mom_batch = mom_ptr + b * C * (4 * NDIM)
    zero = tl.zeros([BLOCK], dtype=l0.dtype)
    a0, a1, a2, a3, a4, a5 = zero, zero, zero, zero, zero, zero
    a6, a7, a8, a9, a10, a11 = zero, zero, zero, zero, zero, zero
    # The cell whose moment the registers hold (none yet: -1). Not cell 0 with zero moments, whose first flush would
    # send every point's zeros to one address: on the H200 that serialised the 6.9M-point grid's backward (28 ms).
    current = tl.full([BLOCK], -1, tl.int32)
    S = tl.cdiv(T, K)
    for i in range(S):
        seg = S - 1 - i
        length = tl.minimum(K, T - seg * K)
        if seg == 0:
            x0, x1, x2 = _load_points(x_ptr + b * x_batch_stride, p, ok, NDIM)
        else:
            x0, x1, x2 = _load_points(ckpt_ptr + ((seg - 1) * B + b) * N * NDIM, idx, ok, NDIM)
        # Tuples grown by concatenation (Triton's code generator takes no starred elements). Steps past the end of a
        # short last segment are computed and not used.
        c0, c1, c2 = (x0,), (x1,), (x2,)
        for _slot in tl.static_range(1, SLOTS):
            for _step_in_slot in range(SEG):
                x0, x1, x2, _cell = _step(e_batch, x0, x1, x2, geo, NX, NY, NDIM, DIVIDE)
            c0, c1, c2 = c0 + (x0,), c1 + (x1,), c2 + (x2,)  # type: ignore[assignment]  # noqa: RUF005
        subsegments = tl.cdiv(length, SEG)
        for jj in range(subsegments):
            j = subsegments - 1 - jj
            sublength = tl.minimum(SEG, length - j * SEG)
            x0, x1, x2 = _select(j, c0, SLOTS), _select(j, c1, SLOTS), _select(j, c2, SLOTS)
            xs0, xs1, xs2, cells = (), (), (), ()
            for _step_in_sub in tl.static_range(SEG):
                xs0, xs1, xs2 = xs0 + (x0,), xs1 + (x1,), xs2 + (x2,)  # type: ignore[assignment]  # noqa: RUF005
                x0, x1, x2, cell = _step(e_batch, x0, x1, x2, geo, NX, NY, NDIM, DIVIDE)
                cells = cells + (cell,)  # type: ignore[assignment]  # noqa: RUF005
            for k in tl.static_range(SEG - 1, -1, -1):
                if k < sublength:
                    x0, x1, x2, cell = xs0[k], xs1[k], xs2[k], cells[k]
                    e = e_batch + cell * (4 * NDIM)
                    if MOMENTS:
                        changed = cell != current
                        if UNIFORM:
                            if tl.max(changed.to(tl.int32), axis=0) > 0:
                                a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11 = _flushed(
                                    mom_batch, current, changed, ok, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11,
                                    NDIM,
                                )  # fmt: skip
                        else:
                            a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11 = _flushed(
                                mom_batch, current, changed, ok, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, NDIM
                            )
                        current = cell
                        a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11 = _moments(
                            a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, l0, l1, l2, x0, x1, x2, NDIM
                        )
                    p0, p1, p2, _p3 = _load_row(e)
                    q0, q1, q2, _q3 = _load_row(e + 4)
                    if NDIM == 2:
                        l0, l1 = tl.fma(q0, l1, p0 * l0), tl.fma(q1, l1, p1 * l0)
                    else:
                        r0, r1, r2, _r3 = _load_row(e + 8)
                        n0 = tl.fma(r0, l2, tl.fma(q0, l1, p0 * l0))
                        n1 = tl.fma(r1, l2, tl.fma(q1, l1, p1 * l0))
                        l2 = tl.fma(r2, l2, tl.fma(q2, l1, p2 * l0))
                        l0, l1 = n0, n1
    if MOMENTS:
        _flush(mom_batch, current, current >= 0, ok, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, NDIM)
    if POINTS:
        _store_points(gx_ptr + b * N * NDIM, p, l0, l1, l2, ok, NDIM)

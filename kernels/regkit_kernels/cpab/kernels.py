"""Triton kernels of the CPAB facet-resolved expm-step scheme: forward with checkpoints, and the fused adjoint.

The scheme and its per-point arithmetic are those of ``regkit.cpab.scheme`` (the spec; read its docstring), in domain
coordinates, (x, y[, z]) order. A step from ``x`` in cell ``c`` (the closed-form lookup of
``regkit.cpab.tessellation.Tessellation.locate``) first tries the regular step ``y = E_c [x; 1]``, component ``i``
evaluated as ``((E_i0 x_0 + E_i1 x_1) [+ E_i2 x_2]) + e_i``. The launchers compile these kernels with floating-point
contraction off, so every product and sum of a regular step is rounded as in PyTorch. When ``x`` is in the box and
``y`` has a negative barycentric coordinate of an interior facet of ``c``, the step is instead taken in *pieces*
(:func:`_walk`): the cell's exact flow, a Taylor polynomial in time (``regkit.cpab.crossing``) summed here term by
term to each lane's own degree, up to the first facet hit (secant start and safeguarded Newton, as ``hit_times``),
then on in the neighbour across it for the time left, until a piece ends in its cell; after ``MAX_CROSSINGS``
crossings the time left is taken in the last cell. Each lane's pieces depend on that lane alone (its own degrees;
block-wide loop bounds only skip work that every lane masks), so replaying them gives them bit for bit. Pieces agree
with the spec's to rounding, not bit for bit (it sums Horner's rule to the largest degree of all pieces of a round).

Every program owns ``BLOCK`` points of one batch element (``program_id(1)``) and keeps them in registers through all
steps; the crossing branch runs only where some lane of the program crosses. ``geom_ptr`` holds, in the working
dtype, the box's ``lower`` (NDIM values), a per-axis scale (NDIM: the extent ``upper - lower``, or its inverse when
every extent is a power of two and ``DIVIDE`` is off), the per-axis box counts (NDIM), the counts minus one (NDIM),
rounded exactly as ``locate`` rounds them, and ``upper`` (NDIM). ``e_ptr`` is the step-matrix table
``E (B, C, NDIM, 4)`` and ``a_ptr`` the velocity table ``A (B, C, NDIM, 4)``, contiguous, each row padded to 4 values
(zero last column in 2D), so that a row is one aligned vector load; the moment table and the pieces' ``dL/dA`` table
have the same layout. ``planes_ptr`` is ``(C, NDIM + 1, 4)``: row ``f`` of cell ``c`` is ``(planes[c, f, :NDIM],
planes[c, f, NDIM])`` of ``Tessellation.facet_planes`` (padded in 2D), the barycentric coordinate of vertex ``f``, and
``(0, .., 0, 1)`` for facets on the box boundary, whose coordinate is then 1 everywhere (they never stop a piece);
``nb_ptr`` is ``(C, 4)`` int32, the neighbour across facet ``f``. The step ``h`` comes as three float32 values
(``expm.split_float``). Few, wide memory operations also keep Triton's compile time down (its coalescing pass grows much
faster than linearly with the number of loads and atomics in the unrolled backward). Checkpoint ``s = 1 .. S - 1`` is
the position after ``s K`` steps, ``S = ceil(T / K)`` (the points themselves are checkpoint 0); the checkpoint table
holds ``(S - 1, B, N, NDIM)``.
"""

from typing import Any  # noqa: F401  (the type comments of the tuples built in the kernels)

import triton
import triton.language as tl

from regkit_kernels.cpab.expm import float64_sum

MAX_CROSSINGS = tl.constexpr(8)
"""Facet crossings followed within one step (``regkit.cpab.scheme.MAX_CROSSINGS``)."""
NEWTON_ITERATIONS = tl.constexpr(8)
"""Safeguarded Newton iterations per hit time (``regkit.cpab.crossing.NEWTON_ITERATIONS``)."""
MAX_DEGREE = tl.constexpr(60)
"""Degree cap of the pieces' Taylor polynomials (``regkit.cpab.crossing.MAX_DEGREE``)."""
TOLERANCE_F32 = tl.constexpr(1e-10)
"""Bound on a float32 piece's first dropped Taylor term (``regkit.cpab.crossing.TAYLOR_TOLERANCE``)."""
TOLERANCE_F64 = tl.constexpr(1e-17)
"""The same for float64."""


@triton.jit
def _geometry(geom_ptr, NDIM: tl.constexpr):
    """The box's ``lower``, per-axis scale (``extent``, or ``1 / extent`` when not ``DIVIDE``), box counts, box
    counts minus one and ``upper``, loaded once per program (values, not loads or arithmetic, inside the step loops)."""
    lo0 = tl.load(geom_ptr)
    lo1 = tl.load(geom_ptr + 1)
    sc0 = tl.load(geom_ptr + NDIM)
    sc1 = tl.load(geom_ptr + NDIM + 1)
    n0 = tl.load(geom_ptr + 2 * NDIM)
    n1 = tl.load(geom_ptr + 2 * NDIM + 1)
    t0 = tl.load(geom_ptr + 3 * NDIM)
    t1 = tl.load(geom_ptr + 3 * NDIM + 1)
    up0 = tl.load(geom_ptr + 4 * NDIM)
    up1 = tl.load(geom_ptr + 4 * NDIM + 1)
    if NDIM == 3:
        lo2 = tl.load(geom_ptr + 2)
        sc2 = tl.load(geom_ptr + NDIM + 2)
        n2 = tl.load(geom_ptr + 2 * NDIM + 2)
        t2 = tl.load(geom_ptr + 3 * NDIM + 2)
        up2 = tl.load(geom_ptr + 4 * NDIM + 2)
    else:
        lo2, sc2, n2, t2, up2 = lo0, sc0, n0, t0, up0
    return (lo0, lo1, lo2), (sc0, sc1, sc2), (n0, n1, n2), (t0, t1, t2), (up0, up1, up2)


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
    lower, scale, count, top, _upper = geo
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
def _vec(x0, x1, x2, NDIM: tl.constexpr):
    """The point ``(x0, x1[, x2])`` as a tuple of ``NDIM`` ``[BLOCK]`` tensors (the crossing code's vectors)."""
    if NDIM == 2:
        return (x0, x1)
    else:
        return (x0, x1, x2)


@triton.jit
def _where(cond, a, b, SIZE: tl.constexpr):
    """``tl.where`` over tuples of ``SIZE`` tensors."""
    out = ()  # type: tuple[Any, ...]
    for i in tl.static_range(SIZE):
        out = out + (tl.where(cond, a[i], b[i]),)  # noqa: RUF005
    return out


@triton.jit
def _filled(x, SIZE: tl.constexpr):
    """A shift register of ``SIZE`` entries, all ``x``."""
    out = ()  # type: tuple[Any, ...]
    for _ in tl.static_range(SIZE):
        out = out + (x,)  # noqa: RUF005
    return out


@triton.jit
def _shifted(slots, x, SIZE: tl.constexpr):
    """``slots[1:] + (x,)``: ``x`` pushed in at the end, the first entry dropped (register moves)."""
    out = ()  # type: tuple[Any, ...]
    for i in tl.static_range(1, SIZE):
        out = out + (slots[i],)  # noqa: RUF005
    return out + (x,)  # noqa: RUF005


@triton.jit
def _unshifted(slots, SIZE: tl.constexpr):
    """``slots[:1] + slots[:-1]``: the last entry dropped, the first repeated (the inverse shift)."""
    out = (slots[0],)  # type: tuple[Any, ...]
    for i in tl.static_range(SIZE - 1):
        out = out + (slots[i],)  # noqa: RUF005
    return out


@triton.jit
def _select(j, slots, SLOTS: tl.constexpr):
    """``slots[j]`` for a run-time ``j`` (a chain of selects over the register tuple)."""
    x = slots[0]
    for q in tl.static_range(1, SLOTS):
        x = tl.where(j == q, slots[q], x)
    return x


@triton.jit
def _dot(row, v, NDIM: tl.constexpr):
    """``row[:NDIM] . v``, summed in order, for a table row (a tuple of 4 columns) and a vector (a tuple)."""
    s = row[0] * v[0]
    for j in tl.static_range(1, NDIM):
        s = s + row[j] * v[j]
    return s


@triton.jit
def _affine(row, v, NDIM: tl.constexpr):
    """``row [v; 1]``: ``((row_0 v_0 + row_1 v_1) [+ row_2 v_2]) + row_NDIM``, as :func:`_affine_row`."""
    return _dot(row, v, NDIM) + row[NDIM]


@triton.jit
def _rows(ptr, cell, ROWS: tl.constexpr):
    """The ``ROWS`` padded rows of each lane's cell in a table of ``ROWS`` rows of 4 per cell (a tuple of rows)."""
    base = ptr + cell * (4 * ROWS)
    out = ()  # type: tuple[Any, ...]
    for r in tl.static_range(ROWS):
        out = out + (_load_row(base + 4 * r),)  # noqa: RUF005
    return out


@triton.jit
def _lin(M, v, NDIM: tl.constexpr):
    """``M_lin v`` for a cell's rows ``M`` (``NDIM`` rows of ``[M_lin | m]``) and a vector ``v``."""
    out = ()  # type: tuple[Any, ...]
    for r in tl.static_range(NDIM):
        out = out + (_dot(M[r], v, NDIM),)  # noqa: RUF005
    return out


@triton.jit
def _lin_t(M, v, NDIM: tl.constexpr):
    """``M_lin^T v`` for a cell's rows ``M`` and a vector ``v``."""
    out = ()  # type: tuple[Any, ...]
    for c in tl.static_range(NDIM):
        s = M[0][c] * v[0]
        for r in tl.static_range(1, NDIM):
            s = s + M[r][c] * v[r]
        out = out + (s,)  # noqa: RUF005
    return out


@triton.jit
def _outside(P, y, NDIM: tl.constexpr):
    """Per facet ``f`` of the lanes' cells (barycentric rows ``P``), whether ``y`` is past it: a negative barycentric
    coordinate (never for facets on the box boundary, whose rows give 1)."""
    out = ()  # type: tuple[Any, ...]
    for f in tl.static_range(NDIM + 1):
        out = out + (_affine(P[f], y, NDIM) < 0,)  # noqa: RUF005
    return out


@triton.jit
def _any(flags, SIZE: tl.constexpr):
    out = flags[0]
    for i in tl.static_range(1, SIZE):
        out = out | flags[i]
    return out


@triton.jit
def _linear_norm(A, NDIM: tl.constexpr):
    """``||A_lin||_1``, the largest column sum of ``|A_lin|`` (``regkit.cpab.crossing.linear_norm``)."""
    norm = tl.abs(A[0][0])
    for i in tl.static_range(1, NDIM):
        norm = norm + tl.abs(A[i][0])
    for j in tl.static_range(1, NDIM):
        s = tl.abs(A[0][j])
        for i in tl.static_range(1, NDIM):
            s = s + tl.abs(A[i][j])
        norm = tl.maximum(norm, s)
    return norm


@triton.jit
def _degree(rho):
    """Each lane's Taylor degree (int32) for ``rho = tau ||A_lin||_1`` (``regkit.cpab.crossing.taylor_degree``): the
    smallest ``K >= 1`` with ``rho^(K + 1) / (K + 1)! <= tol`` of the working dtype, capped at ``MAX_DEGREE``; the
    terms are multiplied up in float64, as the spec does in Python."""
    if rho.dtype == tl.float32:
        tol = TOLERANCE_F32
    else:
        tol = TOLERANCE_F64
    r = rho.to(tl.float64)
    term = r * (r / 2.0)  # rho^2 / 2!
    degree = tl.full(rho.shape, 1, tl.int32)
    pending = term > tol
    for d in range(2, MAX_DEGREE):
        if tl.max(pending.to(tl.int32), axis=0) > 0:
            term = term * (r / (d + 1))
            degree = tl.where(pending, d, degree)
            pending = pending & (term > tol)
    return tl.where(pending, MAX_DEGREE, degree)


@triton.jit
def _plus(a, b, SIZE: tl.constexpr):
    out = ()  # type: tuple[Any, ...]
    for i in tl.static_range(SIZE):
        out = out + (a[i] + b[i],)  # noqa: RUF005
    return out


@triton.jit
def _flow(A, x, tau, K, NDIM: tl.constexpr, SLOPE: tl.constexpr):
    """The in-cell flow of velocities ``A`` (a cell's rows ``[A_lin | a]``) from ``x`` for times ``tau``: its Taylor
    polynomial ``phi(tau) = sum_k t_k`` to each lane's degree ``K``, with ``t_0 = x``, ``t_1 = tau v(x)``,
    ``t_k = (tau / k) A_lin t_(k-1)``, and, with ``SLOPE``, its derivative
    ``phi'(tau) = v(x) + sum_(k = 2..K) A_lin t_(k-1)`` (else ``v(x)``). Terms past a lane's degree are zeros, so the
    loop's bound (the program's largest degree) changes no lane's sums."""
    v = ()  # type: tuple[Any, ...]
    t = ()  # type: tuple[Any, ...]
    y = ()  # type: tuple[Any, ...]
    for i in tl.static_range(NDIM):
        vi = _affine(A[i], x, NDIM)
        v, t, y = v + (vi,), t + (vi * tau,), y + (x[i] + vi * tau,)  # noqa: RUF005
    d = v
    for k in range(2, tl.max(K, axis=0) + 1):
        on = k <= K
        scale = tl.where(on, tau / k, 0.0)
        u = _lin(A, t, NDIM)
        nt = ()  # type: tuple[Any, ...]
        ny = ()  # type: tuple[Any, ...]
        for i in tl.static_range(NDIM):
            ti = u[i] * scale
            nt, ny = nt + (ti,), ny + (y[i] + ti,)  # noqa: RUF005
        if SLOPE:
            d = _where(on, _plus(d, u, NDIM), d, NDIM)
        t, y = nt, ny
    return y, d


@triton.jit
def _hit_time(A, x, K, left, whole, P, leaving, NDIM: tl.constexpr):
    """When and through which facet the pieces from ``x`` (velocities ``A``, degrees ``K``, cell rows ``P``; ``whole``
    is their flow for the time ``left``) first reach a facet in ``leaving`` (a flag per facet), as
    ``regkit.cpab.crossing.hit_times``: per such facet the secant estimate over ``[0, left]``, then up to
    ``NEWTON_ITERATIONS`` safeguarded Newton steps on its barycentric coordinate (bisecting when a step leaves the
    bracket), 0 when ``x`` is on or past it; the earliest wins (the first facet on ties), ``inf`` (facet 0) where none
    leaves.

    Each lane takes its own leaving facets in increasing order, one per pass (passes: the most facets a lane of the
    program leaves through). Newton stops once every lane is at a fixed point (an accepted step that does not move
    ``tau``, which every further step repeats): the result of all ``NEWTON_ITERATIONS``, bit for bit."""
    best = tl.full(left.shape, float("inf"), left.dtype)
    facet = tl.zeros(left.shape, tl.int32)
    remaining = leaving
    for _pass in range(NDIM + 1):
        todo = _any(remaining, NDIM + 1)
        if tl.max(todo.to(tl.int32), axis=0) > 0:
            f = tl.zeros(left.shape, tl.int32)  # the lane's first remaining facet and its row
            row = P[NDIM]
            for g in tl.static_range(NDIM, -1, -1):
                f = tl.where(remaining[g], g, f)
                row = _where(remaining[g], P[g], row, 4)
            cleared = ()  # type: tuple[Any, ...]
            for g in tl.static_range(NDIM + 1):
                cleared = cleared + (remaining[g] & (f != g),)  # noqa: RUF005
            remaining = cleared
            start = _affine(row, x, NDIM)
            secant = left * start / (start - _affine(row, whole, NDIM))
            tau = tl.minimum(tl.maximum(tl.where(secant == secant, secant, 0.0), 0.0), left)
            lo = tl.zeros_like(left)
            hi = left
            moving = todo & (start > 0)
            for _ in range(NEWTON_ITERATIONS):
                if tl.max(moving.to(tl.int32), axis=0) > 0:
                    y, slope = _flow(A, x, tau, K, NDIM, True)
                    value = _affine(row, y, NDIM)
                    inside = value > 0
                    lo, hi = tl.where(inside, tau, lo), tl.where(inside, hi, tau)
                    newton = tau - value / _dot(row, slope, NDIM)
                    accept = (newton >= lo) & (newton <= hi)
                    moving = moving & ~(accept & (newton == tau))
                    tau = tl.where(accept, newton, 0.5 * (lo + hi))
            tau = tl.where(todo, tl.where(start > 0, tau, 0.0), float("inf"))
            better = tau < best
            best, facet = tl.where(better, tau, best), tl.where(better, f, facet)
    return best, facet


@triton.jit
def _walk(a_batch, planes_ptr, nb_ptr, x, y, cell, leaving, active, h, NDIM: tl.constexpr):
    """The pieces of the steps that the lanes ``active`` take from ``x`` in ``cell`` for the time ``h`` (their regular
    steps end at ``y``, past the facets ``leaving`` of ``cell``), as ``regkit.cpab.scheme.take_step``: each piece the
    flow of its cell to the first facet hit, the last (the first that ends in its cell, or piece ``MAX_CROSSINGS``)
    for the time left. Returns the end points, the number of pieces (0 where not ``active``) and, as shift registers of
    ``MAX_CROSSINGS + 1`` entries (entry ``r``: piece ``r``), each piece's hit time (its duration, but for the last
    piece) and the facet it left through: what :func:`_replay` needs. The first piece's hit times start from the
    regular step's end (the cell's exact flow for ``h``, as the Taylor polynomial's, to rounding)."""
    start = x
    left = tl.zeros_like(x[0]) + h
    out = x
    count = tl.zeros_like(cell)
    taus = _filled(tl.zeros_like(left), MAX_CROSSINGS + 1)
    facets = _filled(count, MAX_CROSSINGS + 1)
    for r in range(MAX_CROSSINGS + 1):
        tau = tl.zeros_like(left)
        facet = tl.zeros_like(cell)
        if tl.max(active.to(tl.int32), axis=0) > 0:
            A = _rows(a_batch, cell, NDIM)
            P = _rows(planes_ptr, cell, NDIM + 1)
            K = _degree(tl.where(active, left * _linear_norm(A, NDIM), 0.0))
            if r == 0:  # the first piece leaves through the facets its regular step left through
                whole = y
            else:
                whole, _v = _flow(A, start, left, K, NDIM, False)
                leaving = _outside(P, whole, NDIM)
            done = (r == MAX_CROSSINGS) | ~_any(leaving, NDIM + 1)
            go = active & ~done
            gone = ()  # type: tuple[Any, ...]
            for f in tl.static_range(NDIM + 1):
                gone = gone + (leaving[f] & go,)  # noqa: RUF005
            tau, facet = _hit_time(A, start, K, left, whole, P, gone, NDIM)
            end, _v = _flow(A, start, tl.where(done, left, tau), K, NDIM, False)
            out = _where(active, end, out, NDIM)
            count = tl.where(active, r + 1, count)
            active = go
            cell = tl.where(active, tl.load(nb_ptr + cell * 4 + facet, mask=active, other=0), cell)
            left = tl.where(active, left - tau, left)
            start = _where(active, end, start, NDIM)
        taus, facets = _shifted(taus, tau, MAX_CROSSINGS + 1), _shifted(facets, facet, MAX_CROSSINGS + 1)
    return out, count, taus, facets


@triton.jit
def _replay(a_batch, nb_ptr, x, cell, h, taus, facets, p, take, NDIM: tl.constexpr):
    """The start, cell, time left and Taylor degree of piece ``p`` of the walks from ``x`` in ``cell`` (lanes
    ``take``), from the hit times and facets that :func:`_walk` recorded: the same arithmetic as the walk's, so the
    same bits, at one flow evaluation per piece before ``p`` instead of a search for its hit time."""
    start = x
    left = tl.zeros_like(x[0]) + h
    for r in range(p):
        A = _rows(a_batch, cell, NDIM)
        K = _degree(tl.where(take, left * _linear_norm(A, NDIM), 0.0))
        tau = _select(r, taus, MAX_CROSSINGS + 1)
        end, _v = _flow(A, start, tau, K, NDIM, False)
        facet = _select(r, facets, MAX_CROSSINGS + 1)
        cell = tl.where(take, tl.load(nb_ptr + cell * 4 + facet, mask=take, other=0), cell)
        left = tl.where(take, left - tau, left)
        start = _where(take, end, start, NDIM)
    A = _rows(a_batch, cell, NDIM)
    return start, cell, left, _degree(tl.where(take, left * _linear_norm(A, NDIM), 0.0))


@triton.jit
def _regular(e_batch, planes_ptr, x0, x1, x2, cell, NDIM: tl.constexpr):
    """The regular step ``y = E_c [x; 1]`` (``x2``, ``y2`` ignored in 2D) and, per facet of ``c``, whether ``y`` is
    past it."""
    e = e_batch + cell * (4 * NDIM)
    p0, p1, p2, p3 = _load_row(e)
    q0, q1, q2, q3 = _load_row(e + 4)
    y0 = _affine_row(p0, p1, p2, p3, x0, x1, x2, NDIM)
    y1 = _affine_row(q0, q1, q2, q3, x0, x1, x2, NDIM)
    if NDIM == 3:
        r0, r1, r2, r3 = _load_row(e + 8)
        y2 = _affine_row(r0, r1, r2, r3, x0, x1, x2, NDIM)
    else:
        y2 = x2
    return y0, y1, y2, _outside(_rows(planes_ptr, cell, NDIM + 1), _vec(y0, y1, y2, NDIM), NDIM)


@triton.jit
def _step(
    e_batch, a_batch, planes_ptr, nb_ptr, x0, x1, x2, ok, geo, h, NX, NY, NDIM: tl.constexpr, DIVIDE: tl.constexpr
):  # fmt: skip
    """One scheme step: the new points, the cells the step started in and the pieces it took (0 for a regular step).
    A step takes pieces where ``x`` is in the box and its regular step leaves its cell through an interior facet."""
    cell = _locate(x0, x1, x2, geo, NX, NY, NDIM, DIVIDE)
    y0, y1, y2, leaving = _regular(e_batch, planes_ptr, x0, x1, x2, cell, NDIM)
    lower, upper = geo[0], geo[4]
    inside = ok & (x0 >= lower[0]) & (x0 <= upper[0]) & (x1 >= lower[1]) & (x1 <= upper[1])
    if NDIM == 3:
        inside = inside & (x2 >= lower[2]) & (x2 <= upper[2])
    crossing = inside & _any(leaving, NDIM + 1)
    count = tl.zeros_like(cell)
    if tl.max(crossing.to(tl.int32), axis=0) > 0:
        x = _vec(x0, x1, x2, NDIM)
        y = _vec(y0, y1, y2, NDIM)
        end, count, _taus, _facets = _walk(a_batch, planes_ptr, nb_ptr, x, y, cell, leaving, crossing, h, NDIM)
        y0, y1 = tl.where(crossing, end[0], y0), tl.where(crossing, end[1], y1)
        if NDIM == 3:
            y2 = tl.where(crossing, end[2], y2)
    return y0, y1, y2, cell, count


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


@triton.jit(do_not_specialize=["B", "N", "C", "NX", "NY", "T"])
def crossing_step_kernel(
    x_ptr, perm_ptr, e_ptr, planes_ptr, geom_ptr, bucket_ptr, count_ptr, B, N, C, NX, NY, T, NDIM: tl.constexpr,
    DIVIDE: tl.constexpr, BUCKETS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """A prediction of the step at which each point first crosses a facet, to group the points that take pieces at
    the same steps (``ops.point_order``). Lane ``i`` takes the shared point ``x[perm[i]]`` (``x (N, NDIM)``) and
    applies its starting cell's regular step ``E_c [y; 1]`` ``T`` times (the exact in-cell flow, which is the point's
    flow until it leaves ``c``); the first step whose end is past an interior facet, the smallest over the batch's
    ``E (B, C, NDIM, 4)``, or ``T`` for none, goes in ``bucket (N,)`` as ``first (BUCKETS - 1) // T`` (``BUCKETS - 1``
    for none); ``count (BUCKETS, programs)`` gets each program's number of lanes per bucket."""
    pid = tl.program_id(0)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    ok = idx < N
    p = tl.load(perm_ptr + idx, mask=ok, other=0)
    geo = _geometry(geom_ptr, NDIM)
    x0, x1, x2 = _load_points(x_ptr, p, ok, NDIM)
    cell = _locate(x0, x1, x2, geo, NX, NY, NDIM, DIVIDE)
    P = _rows(planes_ptr, cell, NDIM + 1)
    first = tl.full([BLOCK], T, tl.int32)
    for b in range(B):
        e = e_ptr + b * C * (4 * NDIM) + cell * (4 * NDIM)
        E0 = _load_row(e)
        E1 = _load_row(e + 4)
        if NDIM == 3:
            E2 = _load_row(e + 8)
        else:
            E2 = E1
        y0, y1, y2 = x0, x1, x2
        for s in range(T):
            if tl.max((first > s).to(tl.int32), axis=0) > 0:
                z0 = _affine_row(E0[0], E0[1], E0[2], E0[3], y0, y1, y2, NDIM)
                z1 = _affine_row(E1[0], E1[1], E1[2], E1[3], y0, y1, y2, NDIM)
                if NDIM == 3:
                    y2 = _affine_row(E2[0], E2[1], E2[2], E2[3], y0, y1, y2, NDIM)
                y0, y1 = z0, z1
                left = _any(_outside(P, _vec(y0, y1, y2, NDIM), NDIM), NDIM + 1)
                first = tl.where(left & (first > s), s, first)
    bucket = tl.where(first < T, first * (BUCKETS - 1) // T, BUCKETS - 1)
    tl.store(bucket_ptr + idx, bucket, mask=ok)
    programs = tl.num_programs(0)
    for j in tl.static_range(BUCKETS):
        tl.store(count_ptr + j * programs + pid, tl.sum(((bucket == j) & ok).to(tl.int32), axis=0))


@triton.jit(do_not_specialize=["N"])
def partition_kernel(
    perm_ptr, bucket_ptr, offset_ptr, out_ptr, N, BUCKETS: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """``out (N,)``: ``perm`` stably partitioned by ``bucket`` (the layout of :func:`crossing_step_kernel`);
    ``offset (BUCKETS, programs)`` holds the exclusive prefix sums of its counts, bucket-major."""
    pid = tl.program_id(0)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    ok = idx < N
    p = tl.load(perm_ptr + idx, mask=ok, other=0)
    bucket = tl.load(bucket_ptr + idx, mask=ok, other=-1)
    programs = tl.num_programs(0)
    for j in tl.static_range(BUCKETS):
        mine = (bucket == j).to(tl.int32)
        rank = tl.load(offset_ptr + j * programs + pid) + tl.cumsum(mine, axis=0) - 1
        tl.store(out_ptr + rank, p, mask=mine > 0)


@triton.jit(do_not_specialize=_SIZES)
def cpab_fwd_kernel(
    x_ptr, x_batch_stride, perm_ptr, e_ptr, a_ptr, planes_ptr, nb_ptr, geom_ptr, out_ptr, ckpt_ptr, h0, h1, h2, B, N, C,
    NX, NY, T, K, NDIM: tl.constexpr, DIVIDE: tl.constexpr, PERMUTED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``out (B, N, NDIM)`` = the points after ``T`` steps of ``h = h0 + h1 + h2``; ``ckpt (S - 1, B, N, NDIM)`` =
    the positions after K, 2K, ... steps. ``x_ptr`` rows are contiguous, ``x_batch_stride`` apart (0 for points shared
    by the batch). With ``PERMUTED``, lane ``i`` works on point ``perm[i]`` (points and ``out`` are read and written at
    that row, the checkpoints are kept in lane order)."""
    b = tl.program_id(1).to(tl.int64)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < N
    p = _points_of(perm_ptr, idx, ok, PERMUTED)
    geo = _geometry(geom_ptr, NDIM)
    x0, x1, x2 = _load_points(x_ptr + b * x_batch_stride, p, ok, NDIM)
    h = float64_sum(h0, h1, h2).to(x0.dtype)
    e_batch = e_ptr + b * C * (4 * NDIM)
    a_batch = a_ptr + b * C * (4 * NDIM)
    S = tl.cdiv(T, K)
    for seg in range(S):
        if seg > 0:
            _store_points(ckpt_ptr + ((seg - 1) * B + b) * N * NDIM, idx, x0, x1, x2, ok, NDIM)
        for _ in range(tl.minimum(K, T - seg * K)):
            x0, x1, x2, _cell, _count = _step(
                e_batch, a_batch, planes_ptr, nb_ptr, x0, x1, x2, ok, geo, h, NX, NY, NDIM, DIVIDE
            )
    _store_points(out_ptr + b * N * NDIM, p, x0, x1, x2, ok, NDIM)


@triton.jit
def _piece_vjp(A, x, tau, lam, K, NDIM: tl.constexpr):
    """The adjoint of a piece ``phi(tau)`` from ``x`` (velocities ``A``, degrees ``K``, ``tau`` fixed) for
    ``lam = dL/dphi``: ``dL/dx = sum_(k = 0..K) w_k alpha_k`` and ``dL/dA = sum_(m = 1..K) w_m S_m`` (row-major
    ``NDIM x (NDIM + 1)``), with ``w_k = tau^k / k!``, ``alpha_k = (A_lin^T)^k lam`` and
    ``S_m = sum_(j + i = m - 1) alpha_j b_i^T``, ``b_i = Ã^i [x; 1]`` (``Ã = [A; 0]``): the closed form of
    ``regkit.cpab.crossing.piece_vjp``. Summed by recurrences linear in ``K`` on scaled terms, which stay bounded as
    the series' terms do (``alpha_k`` and ``w_k`` alone overflow and underflow float32 at high degrees):
    ``w_m alpha_m = (tau / m) A_lin^T (w_(m-1) alpha_(m-1))`` and, for ``T_m = w_(m-1) S_m``, ``T_1 = lam [x; 1]^T``,
    ``T_(m+1) = (tau / m) T_m Ã^T + w_m alpha_m [x; 1]^T``, ``w_m S_m = (tau / m) T_m``."""
    Q: tl.constexpr = NDIM + 1
    T = ()  # type: tuple[Any, ...]
    grad_A = ()  # type: tuple[Any, ...]
    for r in tl.static_range(NDIM):
        for c in tl.static_range(Q):
            if c < NDIM:
                T = T + (lam[r] * x[c],)  # noqa: RUF005
            else:
                T = T + (lam[r],)  # noqa: RUF005
            grad_A = grad_A + (tl.zeros_like(tau),)  # noqa: RUF005
    walpha, grad_x = lam, lam
    for m in range(1, tl.max(K, axis=0) + 1):
        ratio = tl.where(m <= K, tau / m, 0.0)  # w_m / w_(m-1); 0 past the lane's degree
        nA = ()  # type: tuple[Any, ...]
        for i in tl.static_range(NDIM * Q):
            nA = nA + (grad_A[i] + ratio * T[i],)  # noqa: RUF005
        grad_A = nA
        turned = _lin_t(A, walpha, NDIM)
        nw = ()  # type: tuple[Any, ...]
        nx = ()  # type: tuple[Any, ...]
        for i in tl.static_range(NDIM):
            wi = ratio * turned[i]
            nw, nx = nw + (wi,), nx + (grad_x[i] + wi,)  # noqa: RUF005
        walpha, grad_x = nw, nx
        nT = ()  # type: tuple[Any, ...]
        for r in tl.static_range(NDIM):
            for c in tl.static_range(Q):
                if c < NDIM:
                    s = T[r * Q] * A[c][0]
                    for k in tl.static_range(1, Q):
                        s = s + T[r * Q + k] * A[c][k]
                    nT = nT + (ratio * s + walpha[r] * x[c],)  # noqa: RUF005
                else:
                    nT = nT + (walpha[r],)  # noqa: RUF005
        T = nT
    return grad_x, grad_A


@triton.jit
def _add_rows(ptr, cell, mask, M, NDIM: tl.constexpr):
    """Add row-major ``NDIM x (NDIM + 1)`` matrices ``M`` (a tuple) to the lanes' cells of a padded table, masked."""
    Q: tl.constexpr = NDIM + 1
    p = (ptr + cell * (4 * NDIM))[:, None] + tl.arange(0, 4)[None, :]
    m = mask[:, None]
    for r in tl.static_range(NDIM):
        if NDIM == 2:
            row = _pack(M[r * Q], M[r * Q + 1], M[r * Q + 2], tl.zeros_like(M[0]))
        else:
            row = _pack(M[r * Q], M[r * Q + 1], M[r * Q + 2], M[r * Q + 3])
        tl.atomic_add(p + 4 * r, row, mask=m, sem="relaxed")


@triton.jit
def _pieces_vjp(
    e_batch, a_batch, planes_ptr, nb_ptr, direct_batch, x0, x1, x2, cell, count, l0, l1, l2, h, ok,
    NDIM: tl.constexpr, MOMENTS: tl.constexpr,
):  # fmt: skip
    """``lambda`` pulled back through the pieces of the steps taken in ``count > 0`` pieces from ``x`` in ``cell``
    (``regkit.cpab.scheme.step_vjp``), last piece first; with ``MOMENTS`` each piece's ``dL/dA`` is added to its cell
    in ``direct`` (atomics). The step is walked again (bit for bit: :func:`_walk` is per lane) and piece ``p`` replayed
    from the step's start (:func:`_replay`). Returns ``lambda`` at the step's start (``l2`` ignored in 2D); lanes
    with ``count == 0`` keep theirs."""
    y0, y1, y2, leaving = _regular(e_batch, planes_ptr, x0, x1, x2, cell, NDIM)
    x = _vec(x0, x1, x2, NDIM)
    lam = _vec(l0, l1, l2, NDIM)
    y = _vec(y0, y1, y2, NDIM)
    _end, _count, taus, facets = _walk(a_batch, planes_ptr, nb_ptr, x, y, cell, leaving, count > 0, h, NDIM)
    pieces = tl.max(count, axis=0)
    for i in range(pieces):
        p = pieces - 1 - i
        take = count > p
        start, piece_cell, left, degree = _replay(a_batch, nb_ptr, x, cell, h, taus, facets, p, take, NDIM)
        duration = tl.where(count - 1 == p, left, _select(p, taus, MAX_CROSSINGS + 1))
        A = _rows(a_batch, piece_cell, NDIM)
        grad_x, grad_A = _piece_vjp(A, start, duration, lam, degree, NDIM)
        lam = _where(take, grad_x, lam, NDIM)
        if MOMENTS:
            _add_rows(direct_batch, piece_cell, take & ok, grad_A, NDIM)
    if NDIM == 2:
        return lam[0], lam[1], l2
    else:
        return lam[0], lam[1], lam[2]


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
    x_ptr, x_batch_stride, perm_ptr, ckpt_ptr, g_ptr, e_ptr, a_ptr, planes_ptr, nb_ptr, geom_ptr, gx_ptr, mom_ptr,
    direct_ptr, h0, h1, h2, B, N, C, NX, NY, T, K, NDIM: tl.constexpr, SEG: tl.constexpr, SLOTS: tl.constexpr,
    UNIFORM: tl.constexpr, MOMENTS: tl.constexpr, POINTS: tl.constexpr, DIVIDE: tl.constexpr,
    PERMUTED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The adjoint sweep: ``lambda_T = g``, then for ``s = T - 1 .. 0``: a regular step adds
    ``lambda_{s+1} [x_s; 1]^T`` to ``dL/dE_{c_s}`` and sets ``lambda_s = E_lin(c_s)^T lambda_{s+1}``; a step in
    pieces adds each piece's ``dL/dA`` to its cell and pulls ``lambda`` back through its pieces
    (:func:`_pieces_vjp`). Writes, when ``POINTS``, ``gx = lambda_0 (B, N, NDIM)`` and, when ``MOMENTS``, adds into
    ``mom (B, C, NDIM, 4)`` and ``direct (B, C, NDIM, 4)`` (both zeroed by the caller).

    Stored segments (``K`` steps from a checkpoint) are taken last first. Within one, the positions every ``SEG`` steps
    are recomputed into registers (``SLOTS = ceil(K / SEG)`` of them; none to compute when ``SLOTS == 1``), and its
    sub-segments are taken last first: the ``SEG`` positions, cells and piece counts of a sub-segment are recomputed
    (the same code as the forward's) into registers (tuples, unrolled: ``SEG`` is a compile-time constant), then swept
    backward.

    A point's moment is accumulated in registers while its regular steps stay in one cell and added to the table (one
    vector of atomics per row) when the cell of a regular step changes, and once at the end; with ``UNIFORM`` the flush
    and the reset are skipped by the whole program at the steps where none of its points changes cell. Steps in pieces
    add no moment (their lanes' registers wait for their next regular step). The moments and the regular adjoint take
    explicit fused multiply-adds (the launchers turn contraction off for the positions, which must round as PyTorch's;
    the adjoint need not, and rounds once instead of twice). ``PERMUTED`` as in the forward kernel (``g`` and ``gx`` at
    the lanes' points, the checkpoints in lane order)."""
    b = tl.program_id(1).to(tl.int64)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < N
    p = _points_of(perm_ptr, idx, ok, PERMUTED)
    geo = _geometry(geom_ptr, NDIM)
    l0, l1, l2 = _load_points(g_ptr + b * N * NDIM, p, ok, NDIM)
    h = float64_sum(h0, h1, h2).to(l0.dtype)
    e_batch = e_ptr + b * C * (4 * NDIM)
    a_batch = a_ptr + b * C * (4 * NDIM)
    mom_batch = mom_ptr + b * C * (4 * NDIM)
    direct_batch = direct_ptr + b * C * (4 * NDIM)
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
        # Register checkpoints every SEG steps, in a loop over shift registers (tuples: Triton's code generator takes no
        # starred elements): a loop, not unrolled, so that the crossing code is compiled once per loop. Steps past the
        # end of a short last segment are computed and not used.
        c0, c1, c2 = _filled(x0, SLOTS), _filled(x1, SLOTS), _filled(x2, SLOTS)
        for _slot in range(1, SLOTS):
            for _step_in_slot in range(SEG):
                x0, x1, x2, _cell, _count = _step(
                    e_batch, a_batch, planes_ptr, nb_ptr, x0, x1, x2, ok, geo, h, NX, NY, NDIM, DIVIDE
                )
            c0, c1, c2 = _shifted(c0, x0, SLOTS), _shifted(c1, x1, SLOTS), _shifted(c2, x2, SLOTS)
        subsegments = tl.cdiv(length, SEG)
        for jj in range(subsegments):
            j = subsegments - 1 - jj
            sublength = tl.minimum(SEG, length - j * SEG)
            x0, x1, x2 = _select(j, c0, SLOTS), _select(j, c1, SLOTS), _select(j, c2, SLOTS)
            # The sub-segment's positions, cells and piece counts, oldest first after SEG shifts.
            xs0, xs1, xs2 = _filled(x0, SEG), _filled(x1, SEG), _filled(x2, SEG)
            cells, counts = _filled(current, SEG), _filled(current, SEG)
            for _step_in_sub in range(SEG):
                xs0, xs1, xs2 = _shifted(xs0, x0, SEG), _shifted(xs1, x1, SEG), _shifted(xs2, x2, SEG)
                x0, x1, x2, cell, count = _step(
                    e_batch, a_batch, planes_ptr, nb_ptr, x0, x1, x2, ok, geo, h, NX, NY, NDIM, DIVIDE
                )
                cells, counts = _shifted(cells, cell, SEG), _shifted(counts, count, SEG)
            # Swept newest first: step k = SEG - 1 - kk is the last entry, then shifted out.
            for kk in range(SEG):
                x0, x1, x2, cell, count = xs0[SEG - 1], xs1[SEG - 1], xs2[SEG - 1], cells[SEG - 1], counts[SEG - 1]
                xs0, xs1, xs2 = _unshifted(xs0, SEG), _unshifted(xs1, SEG), _unshifted(xs2, SEG)
                cells, counts = _unshifted(cells, SEG), _unshifted(counts, SEG)
                if SEG - 1 - kk < sublength:
                    regular = count == 0
                    e = e_batch + cell * (4 * NDIM)
                    if MOMENTS:
                        changed = (cell != current) & regular
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
                        current = tl.where(regular, cell, current)
                        w0, w1, w2 = tl.where(regular, l0, 0.0), tl.where(regular, l1, 0.0), tl.where(regular, l2, 0.0)
                        a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11 = _moments(
                            a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, w0, w1, w2, x0, x1, x2, NDIM
                        )
                    p0, p1, p2, _p3 = _load_row(e)
                    q0, q1, q2, _q3 = _load_row(e + 4)
                    if NDIM == 2:
                        n0, n1, n2 = tl.fma(q0, l1, p0 * l0), tl.fma(q1, l1, p1 * l0), l2
                    else:
                        r0, r1, r2, _r3 = _load_row(e + 8)
                        n0 = tl.fma(r0, l2, tl.fma(q0, l1, p0 * l0))
                        n1 = tl.fma(r1, l2, tl.fma(q1, l1, p1 * l0))
                        n2 = tl.fma(r2, l2, tl.fma(q2, l1, p2 * l0))
                    if tl.max(count, axis=0) > 0:
                        m0, m1, m2 = _pieces_vjp(
                            e_batch, a_batch, planes_ptr, nb_ptr, direct_batch, x0, x1, x2, cell, count, l0, l1, l2,
                            h, ok, NDIM, MOMENTS,
                        )  # fmt: skip
                        n0, n1, n2 = tl.where(regular, n0, m0), tl.where(regular, n1, m1), tl.where(regular, n2, m2)
                    l0, l1, l2 = n0, n1, n2
    if MOMENTS:
        _flush(mom_batch, current, current >= 0, ok, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, NDIM)
    if POINTS:
        _store_points(gx_ptr + b * N * NDIM, p, l0, l1, l2, ok, NDIM)

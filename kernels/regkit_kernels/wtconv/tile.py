"""Building blocks shared by the 2D and 3D WTConv kernels: masked loads, the Haar butterflies and the block-phase
(polyphase) depthwise convolution on one plane.

Every kernel works on tiles of one channel (so all of a tile's weights are scalars) whose elements are positions q of
a coarse grid (a Haar level's grid) in some batch item. Planes are addressed through tensors of pointers to their first
element, ``ok`` masks the valid elements, and coordinates are integer tensors; all of these only need to broadcast
against each other (the weight-gradient kernels add a tap axis).

The Haar butterflies here are unnormalised (sums and differences); the sub-band convolutions multiply their results
by the orthonormal factor 2**(-ndim/2) and the per-band scales (the layer's parameters are read as they are, in any
float dtype). The 2D butterfly maps the block (a b / c d) to (LL, LH, HL, HH), LH being the high-pass
along y; its matrix is symmetric, so the same butterfly maps the four sub-band values of a block back to its pixels
(a, b, c, d) (times 4).
"""

import triton
import triton.language as tl


@triton.jit
def block_at(ptrs, row, ok_y0, ok_y1, ok_x0, ok_x1):
    """The pixels (a b / c d) at ``ptrs``, ``ptrs + 1``, ``ptrs + row`` and ``ptrs + row + 1`` as float32, each loaded
    where its row (``ok_y0``, ``ok_y1``) and column (``ok_x0``, ``ok_x1``) flags are set, else zero. Callers compute a
    position's pointer once and add constant tap offsets, so that a load costs little index arithmetic of its own."""
    a = tl.load(ptrs, mask=ok_y0 & ok_x0, other=0.0).to(tl.float32)
    b = tl.load(ptrs + 1, mask=ok_y0 & ok_x1, other=0.0).to(tl.float32)
    c = tl.load(ptrs + row, mask=ok_y1 & ok_x0, other=0.0).to(tl.float32)
    d = tl.load(ptrs + (row + 1), mask=ok_y1 & ok_x1, other=0.0).to(tl.float32)
    return a, b, c, d


@triton.jit
def within(v, n):
    """0 <= v < n, as one unsigned comparison (``tl.cast`` also takes sizes that Triton specialised to constants)."""
    return tl.cast(v, tl.uint32) < tl.cast(n, tl.uint32)


@triton.jit
def fast_divmod(n, d, inv_d):
    """``(n // d, n % d)`` for 0 <= n < 2**31 and a quotient below 2**22, given ``inv_d = 1 / d`` in float32: the float
    estimate is off by at most one, which one correction removes (cheaper than an integer division by a run-time d)."""
    quot = (n.to(tl.float32) * inv_d).to(tl.int32)
    rem = n - quot * d
    quot = tl.where(rem < 0, quot - 1, tl.where(rem >= d, quot + 1, quot))
    return quot, n - quot * d


@triton.jit
def butterfly2d(a, b, c, d):
    """The unnormalised 2D Haar sub-bands (LL, LH, HL, HH) of the block (a b / c d) (module docstring); symmetric, so
    it also maps a block's sub-band values to its pixels, times 4."""
    s = a + b
    t = c + d
    u = a - b
    v = c - d
    return s + t, s - t, u + v, u - v


@triton.jit
def polyphase_conv2d(ptrs, w_ptr, qy, qx, ok, H, W, K: tl.constexpr, DIR: tl.constexpr):
    """Depthwise K x K correlation of a plane (DIR = 1) or its adjoint (DIR = -1), at the four pixels 2q + s of each
    block: ``acc_s(q) = sum_t w[t] * plane(2q + s + DIR * (t - K // 2))``, s = (sy, sx) in the order 00, 01, 10, 11.

    Each plane pixel at offset o = s + DIR * u from 2q (o in [-K//2, K//2 + 1]) is loaded once and feeds every s it
    reaches: (K + 1)**2 loads for 4 K**2 multiply-adds. The pointer of 2q is computed once; a row adds ``oy * W`` and a
    column a constant, and the bounds are unsigned comparisons.
    """
    P: tl.constexpr = K // 2
    centre = ptrs + (2 * qy * W + 2 * qx)
    acc00 = tl.zeros(ok.shape, tl.float32)
    acc01 = tl.zeros(ok.shape, tl.float32)
    acc10 = tl.zeros(ok.shape, tl.float32)
    acc11 = tl.zeros(ok.shape, tl.float32)
    for iy in range(K + 1):
        oy = iy - P
        ty0 = DIR * oy + P  # tap row used by sub-row sy = 0 (run-time, so invalid rows load a zero weight)
        ty1 = DIR * (oy - 1) + P  # ... by sy = 1
        in0 = (ty0 >= 0) & (ty0 < K)
        in1 = (ty1 >= 0) & (ty1 < K)
        row_ok = ok & within(2 * qy + oy, H)
        row = centre + oy * W
        for ix in tl.static_range(K + 1):
            ox = ix - P
            tx0 = DIR * ox + P
            tx1 = DIR * (ox - 1) + P
            v = tl.load(row + ox, mask=row_ok & within(2 * qx + ox, W), other=0.0).to(tl.float32)
            if tx0 >= 0 and tx0 < K:
                acc00 += tl.load(w_ptr + ty0 * K + tx0, mask=in0, other=0.0).to(tl.float32) * v
                acc10 += tl.load(w_ptr + ty1 * K + tx0, mask=in1, other=0.0).to(tl.float32) * v
            if tx1 >= 0 and tx1 < K:
                acc01 += tl.load(w_ptr + ty0 * K + tx1, mask=in0, other=0.0).to(tl.float32) * v
                acc11 += tl.load(w_ptr + ty1 * K + tx1, mask=in1, other=0.0).to(tl.float32) * v
    return acc00, acc01, acc10, acc11


@triton.jit
def _store2d(ptrs, v, y, x, ok, H, W):
    inside = (y < H) & (x < W)
    tl.store(ptrs + (y * W + x), v.to(ptrs.dtype.element_ty), mask=ok & inside)


@triton.jit
def store_blocks2d(ptrs, v00, v01, v10, v11, qy, qx, ok, H, W):
    """Store the four pixels 2q + s of each block (cropping the far side of odd sizes)."""
    _store2d(ptrs, v00, 2 * qy, 2 * qx, ok, H, W)
    _store2d(ptrs, v01, 2 * qy, 2 * qx + 1, ok, H, W)
    _store2d(ptrs, v10, 2 * qy + 1, 2 * qx, ok, H, W)
    _store2d(ptrs, v11, 2 * qy + 1, 2 * qx + 1, ok, H, W)


@triton.jit
def tile_coords(pid, B, C, Q, BLOCK: tl.constexpr):
    """Program ``pid``'s channel ``c`` and its tile: ``BLOCK`` consecutive (batch item, grid position) pairs of that
    channel, flattened as ``n = b * Q + q`` (so small grids pack many batch items into one tile). Returns c, the plane
    index ``b * C + c`` (int64), q and the validity mask, all [BLOCK]. Programs run chunk fastest, then channel, so
    that neighbouring chunks (which share halos) run together."""
    num_chunks = tl.cdiv(B * Q, BLOCK)
    c = pid // num_chunks
    n = (pid % num_chunks) * BLOCK + tl.arange(0, BLOCK)
    return c, (n // Q * C + c).to(tl.int64), n % Q, n < B * Q


@triton.jit
def level_tile(pid, B, C, D, H, W, LEVELS: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``pid`` of a launch over the Haar levels 2..LEVELS, level after level, each cut into tiles as by
    :func:`tile_coords` on its own grid (every axis of (D, H, W) halved j times, rounding up; 2D: D = 1).

    Returns the level j, the tile (c, plane, q, ok) on level j's grid, level j's input size (level j - 1's grid) and
    the element offsets of that input in the low-pass buffer (levels 1..L-1 one after the other, B x C planes each)
    and of level j's sub-bands in the coarse buffer (levels 2..L one after the other, B x C x NB planes each)."""
    start = 0
    level = 0
    local = 0
    low_off = tl.cast(0, tl.int64)
    z_off = tl.cast(0, tl.int64)
    d_in = D
    h_in = H
    w_in = W
    low_at = tl.cast(0, tl.int64)
    z_at = tl.cast(0, tl.int64)
    planes = tl.cast(B * C, tl.int64)
    for j in tl.static_range(2, LEVELS + 1):
        d_prev = (D + (1 << (j - 1)) - 1) >> (j - 1)
        h_prev = (H + (1 << (j - 1)) - 1) >> (j - 1)
        w_prev = (W + (1 << (j - 1)) - 1) >> (j - 1)
        q_j = ((d_prev + 1) // 2) * ((h_prev + 1) // 2) * ((w_prev + 1) // 2)
        n = tl.cdiv(B * q_j, BLOCK) * C
        hit = (pid >= start) & (pid < start + n)
        level = tl.where(hit, j, level)
        local = tl.where(hit, pid - start, local)
        low_off = tl.where(hit, low_at, low_off)
        z_off = tl.where(hit, z_at, z_off)
        d_in = tl.where(hit, d_prev, d_in)
        h_in = tl.where(hit, h_prev, h_in)
        w_in = tl.where(hit, w_prev, w_in)
        start += n
        low_at += planes * d_prev * h_prev * w_prev
        z_at += planes * NB * q_j
    q_level = ((d_in + 1) // 2) * ((h_in + 1) // 2) * ((w_in + 1) // 2)
    c, plane, q, ok = tile_coords(local, B, C, q_level, BLOCK)
    return level, c, plane, q, ok, d_in, h_in, w_in, low_off, z_off


@triton.jit
def haar_conv2d(ptrs, w_ptr, s_ptr, qy, qx, ok, H, W, K: tl.constexpr, DIR: tl.constexpr):
    """Depthwise K x K correlation of the four Haar sub-bands of a plane (DIR = 1), or its adjoint (DIR = -1), on the
    sub-band grid, times the per-band scale and the orthonormal factor 1/2:
    ``acc_b(q) = s[b] / 2 * sum_t w[b, t] * U_b(q + DIR * (t - K // 2))`` where ``U_b(p)`` is the unnormalised
    sub-band b of the plane's 2 x 2 block at 2p, recomputed for every tap from four loads (the sub-bands never go to
    memory). ``w_ptr`` and ``s_ptr`` point to this channel's ``[4, K * K]`` weights and ``[4]`` scales. The pointer of
    block q is computed once; a tap adds a row offset and a constant column offset."""
    P: tl.constexpr = K // 2
    KK: tl.constexpr = K * K
    Hq = (H + 1) // 2
    Wq = (W + 1) // 2
    H2 = H // 2  # blocks whose lower row (right column) lies inside the plane
    W2 = W // 2
    centre = ptrs + (2 * qy * W + 2 * qx)
    acc0 = tl.zeros(ok.shape, tl.float32)
    acc1 = tl.zeros(ok.shape, tl.float32)
    acc2 = tl.zeros(ok.shape, tl.float32)
    acc3 = tl.zeros(ok.shape, tl.float32)
    for ty in range(K):
        uy = DIR * (ty - P)
        ok_y0 = ok & within(qy + uy, Hq)
        ok_y1 = ok & within(qy + uy, H2)
        row = centre + 2 * uy * W
        for tx in tl.static_range(K):
            ux = DIR * (tx - P)
            a, b, c, d = block_at(row + 2 * ux, W, ok_y0, ok_y1, within(qx + ux, Wq), within(qx + ux, W2))
            ll, lh, hl, hh = butterfly2d(a, b, c, d)
            t = ty * K + tx
            acc0 += tl.load(w_ptr + t).to(tl.float32) * ll
            acc1 += tl.load(w_ptr + KK + t).to(tl.float32) * lh
            acc2 += tl.load(w_ptr + 2 * KK + t).to(tl.float32) * hl
            acc3 += tl.load(w_ptr + 3 * KK + t).to(tl.float32) * hh
    return (
        acc0 * (0.5 * tl.load(s_ptr).to(tl.float32)),
        acc1 * (0.5 * tl.load(s_ptr + 1).to(tl.float32)),
        acc2 * (0.5 * tl.load(s_ptr + 2).to(tl.float32)),
        acc3 * (0.5 * tl.load(s_ptr + 3).to(tl.float32)),
    )


@triton.jit
def coarse_synthesis2d(buf_ptr, plane, qy, qx, ok, BC, H, W, LEVELS: tl.constexpr):
    """Closed-form synthesis onto the level-1 grid of the processed sub-bands of levels 2..LEVELS:

    ``R(q) = sum_j 2**-(j-1) * sum_b sign_b(q) * Z_j[b](q >> (j-1))``, the signs given by bit j-2 of q's coordinates
    (LH takes the y bit, HL the x bit, HH both). ``R`` enters level 1 as an addition to its low-pass. ``buf_ptr``
    holds Z_2, Z_3, ... one after the other, each ``[B, C, 4, ceil(H / 2**j), ceil(W / 2**j)]``; ``BC`` = B * C.
    """
    r = tl.zeros(ok.shape, tl.float32)
    offset = tl.cast(0, tl.int64)
    scale = 1.0
    for j in tl.static_range(2, LEVELS + 1):
        scale = scale * 0.5
        hj = (H + (1 << j) - 1) >> j
        wj = (W + (1 << j) - 1) >> j
        size = hj * wj
        sy = (1 - 2 * ((qy >> (j - 2)) & 1)).to(tl.float32)
        sx = (1 - 2 * ((qx >> (j - 2)) & 1)).to(tl.float32)
        ptrs = buf_ptr + offset + plane * 4 * size + (qy >> (j - 1)) * wj + (qx >> (j - 1))
        ll = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
        lh = tl.load(ptrs + size, mask=ok, other=0.0).to(tl.float32)
        hl = tl.load(ptrs + 2 * size, mask=ok, other=0.0).to(tl.float32)
        hh = tl.load(ptrs + 3 * size, mask=ok, other=0.0).to(tl.float32)
        r += scale * (ll + sy * lh + sx * (hl + sy * hh))
        offset += tl.cast(BC, tl.int64) * 4 * size
    return r


# 3D: a volume is handled as z-slices of 2D planes; sub-band b = hz + 2 hy + 4 hx, pixel phases s = 4 sz + 2 sy + sx.


@triton.jit
def _slice3d(ptrs, z, ok, D, HW):
    """Pointers to z-slice ``z`` (per grid position) of a volume and the tile mask restricted to 0 <= z < D."""
    return ptrs + z * HW, ok & (z >= 0) & (z < D)


@triton.jit
def butterfly3d(v0, v1, v2, v3, v4, v5, v6, v7):
    """The unnormalised 3D Haar sub-bands (in the order hz + 2 hy + 4 hx) of a 2 x 2 x 2 block given in pixel-phase
    order; like the 2D butterfly it is symmetric, so it also maps sub-band values (in sub-band order) to the block's
    pixels (in phase order), times 8."""
    a0, a1, a2, a3 = butterfly2d(v0, v1, v2, v3)
    b0, b1, b2, b3 = butterfly2d(v4, v5, v6, v7)
    return a0 + b0, a0 - b0, a1 + b1, a1 - b1, a2 + b2, a2 - b2, a3 + b3, a3 - b3


@triton.jit
def haar_conv3d(ptrs, w_ptr, s_ptr, qz, qy, qx, ok, D, H, W, K: tl.constexpr, DIR: tl.constexpr):
    """3D analogue of :func:`haar_conv2d` (eight sub-bands, ``w_ptr`` -> ``[8, K**3]``, ``s_ptr`` -> ``[8]``, the
    orthonormal factor 2**(-3/2)); the z taps are a loop. Pointers and bounds as in :func:`haar_conv2d`."""
    P: tl.constexpr = K // 2
    KKK: tl.constexpr = K * K * K
    Dq = (D + 1) // 2
    Hq = (H + 1) // 2
    Wq = (W + 1) // 2
    D2 = D // 2  # blocks whose far slice (row, column) lies inside the volume
    H2 = H // 2
    W2 = W // 2
    HW = H * W
    centre = ptrs + ((2 * qz * H + 2 * qy) * W + 2 * qx)
    acc0 = tl.zeros(ok.shape, tl.float32)
    acc1 = tl.zeros(ok.shape, tl.float32)
    acc2 = tl.zeros(ok.shape, tl.float32)
    acc3 = tl.zeros(ok.shape, tl.float32)
    acc4 = tl.zeros(ok.shape, tl.float32)
    acc5 = tl.zeros(ok.shape, tl.float32)
    acc6 = tl.zeros(ok.shape, tl.float32)
    acc7 = tl.zeros(ok.shape, tl.float32)
    for tz in range(K):
        uz = DIR * (tz - P)
        ok_z0 = ok & within(qz + uz, Dq)
        ok_z1 = ok & within(qz + uz, D2)
        for ty in range(K):
            uy = DIR * (ty - P)
            y0 = within(qy + uy, Hq)
            y1 = within(qy + uy, H2)
            row = centre + (2 * uz * H + 2 * uy) * W
            for tx in tl.static_range(K):
                ux = DIR * (tx - P)
                x0 = within(qx + ux, Wq)
                x1 = within(qx + ux, W2)
                a0, a1, a2, a3 = block_at(row + 2 * ux, W, ok_z0 & y0, ok_z0 & y1, x0, x1)
                b0, b1, b2, b3 = block_at(row + (2 * ux + HW), W, ok_z1 & y0, ok_z1 & y1, x0, x1)
                u0, u1, u2, u3, u4, u5, u6, u7 = butterfly3d(a0, a1, a2, a3, b0, b1, b2, b3)
                wt = w_ptr + (tz * K + ty) * K + tx
                acc0 += tl.load(wt).to(tl.float32) * u0
                acc1 += tl.load(wt + KKK).to(tl.float32) * u1
                acc2 += tl.load(wt + 2 * KKK).to(tl.float32) * u2
                acc3 += tl.load(wt + 3 * KKK).to(tl.float32) * u3
                acc4 += tl.load(wt + 4 * KKK).to(tl.float32) * u4
                acc5 += tl.load(wt + 5 * KKK).to(tl.float32) * u5
                acc6 += tl.load(wt + 6 * KKK).to(tl.float32) * u6
                acc7 += tl.load(wt + 7 * KKK).to(tl.float32) * u7
    r = 0.35355339059327373  # 2**(-3/2)
    return (
        acc0 * (r * tl.load(s_ptr).to(tl.float32)),
        acc1 * (r * tl.load(s_ptr + 1).to(tl.float32)),
        acc2 * (r * tl.load(s_ptr + 2).to(tl.float32)),
        acc3 * (r * tl.load(s_ptr + 3).to(tl.float32)),
        acc4 * (r * tl.load(s_ptr + 4).to(tl.float32)),
        acc5 * (r * tl.load(s_ptr + 5).to(tl.float32)),
        acc6 * (r * tl.load(s_ptr + 6).to(tl.float32)),
        acc7 * (r * tl.load(s_ptr + 7).to(tl.float32)),
    )


@triton.jit
def polyphase_conv3d(ptrs, w_ptr, qz, qy, qx, ok, D, H, W, K: tl.constexpr, DIR: tl.constexpr):
    """3D analogue of :func:`polyphase_conv2d` (eight pixels per block, phase order): for every z tap and z phase,
    the 2D block-phase conv of the z-slice it reads."""
    P: tl.constexpr = K // 2
    acc0 = tl.zeros(ok.shape, tl.float32)
    acc1 = tl.zeros(ok.shape, tl.float32)
    acc2 = tl.zeros(ok.shape, tl.float32)
    acc3 = tl.zeros(ok.shape, tl.float32)
    acc4 = tl.zeros(ok.shape, tl.float32)
    acc5 = tl.zeros(ok.shape, tl.float32)
    acc6 = tl.zeros(ok.shape, tl.float32)
    acc7 = tl.zeros(ok.shape, tl.float32)
    for tz in range(K):
        w_slice = w_ptr + tz * K * K
        p0, ok0 = _slice3d(ptrs, 2 * qz + DIR * (tz - P), ok, D, H * W)
        a0, a1, a2, a3 = polyphase_conv2d(p0, w_slice, qy, qx, ok0, H, W, K, DIR)
        p1, ok1 = _slice3d(ptrs, 2 * qz + 1 + DIR * (tz - P), ok, D, H * W)
        a4, a5, a6, a7 = polyphase_conv2d(p1, w_slice, qy, qx, ok1, H, W, K, DIR)
        acc0 += a0
        acc1 += a1
        acc2 += a2
        acc3 += a3
        acc4 += a4
        acc5 += a5
        acc6 += a6
        acc7 += a7
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def coarse_synthesis3d(buf_ptr, plane, qz, qy, qx, ok, BC, D, H, W, LEVELS: tl.constexpr):
    """3D analogue of :func:`coarse_synthesis2d`: factor 2**(-3(j-1)/2) per level, eight sub-bands."""
    r = tl.zeros(ok.shape, tl.float32)
    offset = tl.cast(0, tl.int64)
    scale = 1.0
    for j in tl.static_range(2, LEVELS + 1):
        scale = scale * 0.35355339059327373  # 2**(-3/2)
        dj = (D + (1 << j) - 1) >> j
        hj = (H + (1 << j) - 1) >> j
        wj = (W + (1 << j) - 1) >> j
        size = dj * hj * wj
        sz = (1 - 2 * ((qz >> (j - 2)) & 1)).to(tl.float32)
        sy = (1 - 2 * ((qy >> (j - 2)) & 1)).to(tl.float32)
        sx = (1 - 2 * ((qx >> (j - 2)) & 1)).to(tl.float32)
        pos = ((qz >> (j - 1)) * hj + (qy >> (j - 1))) * wj + (qx >> (j - 1))
        ptrs = buf_ptr + offset + plane * 8 * size + pos
        t0 = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32) + sz * tl.load(ptrs + size, mask=ok, other=0.0)
        t1 = tl.load(ptrs + 2 * size, mask=ok, other=0.0).to(tl.float32) + sz * tl.load(
            ptrs + 3 * size, mask=ok, other=0.0
        )
        t2 = tl.load(ptrs + 4 * size, mask=ok, other=0.0).to(tl.float32) + sz * tl.load(
            ptrs + 5 * size, mask=ok, other=0.0
        )
        t3 = tl.load(ptrs + 6 * size, mask=ok, other=0.0).to(tl.float32) + sz * tl.load(
            ptrs + 7 * size, mask=ok, other=0.0
        )
        r += scale * (t0 + sy * t1 + sx * (t2 + sy * t3))
        offset += tl.cast(BC, tl.int64) * 8 * size
    return r


@triton.jit
def store_blocks3d(ptrs, v0, v1, v2, v3, v4, v5, v6, v7, qz, qy, qx, ok, D, H, W):
    """Store the eight pixels 2q + s of each block (phase order), cropping the far side of odd sizes."""
    p0, ok0 = _slice3d(ptrs, 2 * qz, ok, D, H * W)
    store_blocks2d(p0, v0, v1, v2, v3, qy, qx, ok0, H, W)
    p1, ok1 = _slice3d(ptrs, 2 * qz + 1, ok, D, H * W)
    store_blocks2d(p1, v4, v5, v6, v7, qy, qx, ok1, H, W)


# Weight gradients: one launch for all levels. Level j's (batch item, element) indices of a channel, an element being
# XP neighbouring positions along x (2D: 2, 3D: 1), are cut into shares of SPAN consecutive indices; every (level,
# share, channel, tap row) is one program, which writes one row of partial sums; programs appended to the input
# gradient's launch add the rows up (wgrad_finalize). 2D grids are 3D grids of depth 1.


@triton.jit
def _level_shares(j, B, D, H, W, SPAN, XP: tl.constexpr):
    """Partial-sum rows (shares of SPAN elements) of level j: its grid is every axis halved j times, rounding up; an
    element is XP neighbouring positions along x (the last of a row may have fewer)."""
    q = ((D + (1 << j) - 1) >> j) * ((H + (1 << j) - 1) >> j) * tl.cdiv((W + (1 << j) - 1) >> j, XP)
    return tl.cdiv(B * q, SPAN)


@triton.jit
def wgrad_plan(pid, B, C, PROGRAMS_PER_SHARE, D, H, W, SPAN, LEVELS: tl.constexpr, XP: tl.constexpr):
    """This weight-gradient program's level j (1-based), its index among that level's programs, its partial-sum row
    before the share is added, the offset of the level's input in the low-pass buffers (level j >= 2 reads the
    low-pass of level j - 1; levels 1..L-1 lie one after the other, B x C planes each), the level's input size
    (D, H, W) and the number of partial-sum rows of all levels."""
    start = 0
    rows = 0
    offset = tl.cast(0, tl.int64)
    level = 0
    local = 0
    row0 = 0
    low_offset = tl.cast(0, tl.int64)
    d_in = D
    h_in = H
    w_in = W
    d_prev = D
    h_prev = H
    w_prev = W
    for j in tl.static_range(1, LEVELS + 1):
        shares = _level_shares(j, B, D, H, W, SPAN, XP)
        n = PROGRAMS_PER_SHARE * shares
        hit = (pid >= start) & (pid < start + n)
        level = tl.where(hit, j, level)
        local = tl.where(hit, pid - start, local)
        row0 = tl.where(hit, rows, row0)
        low_offset = tl.where(hit, offset, low_offset)
        d_in = tl.where(hit, d_prev, d_in)
        h_in = tl.where(hit, h_prev, h_in)
        w_in = tl.where(hit, w_prev, w_in)
        start += n
        rows += shares
        if j >= 2:
            offset += tl.cast(B * C, tl.int64) * d_prev * h_prev * w_prev
        d_prev = (D + (1 << j) - 1) >> j
        h_prev = (H + (1 << j) - 1) >> j
        w_prev = (W + (1 << j) - 1) >> j
    return level, local, row0, low_offset, d_in, h_in, w_in, rows


@triton.jit
def wgrad_finalize(
    part_ptr, params_ptr, wb_ptr, sb_ptr, bias_ptr, out_ptr, pid, B, C, D, H, W, SPAN,
    LEVELS: tl.constexpr, NB: tl.constexpr, KT: tl.constexpr, TAPS: tl.constexpr, HAS_BIAS: tl.constexpr,
    SLOTS: tl.constexpr, XP: tl.constexpr,
):  # fmt: skip
    """Parameter gradients from the partial sums (``part_ptr``: [rows, C, NB, KT] of every level, then the base's [S_1,
    C, SLOTS, KT] (SLOTS partial sums per share, added up) and the bias's [S_1, C]; shares of XP-position elements,
    see ``_level_shares``) for channel ``pid % C`` and level
    ``pid // C + 1`` (the base conv when ``pid // C`` is LEVELS), ``C * (LEVELS + 1)`` programs in all. ``params_ptr``
    holds the level weights [L, C, NB, KT] then the level scales [L, C, NB]; base weights [C, KT], scale [C], bias [C]
    (2D: D = 1). Output, float32: dW [L, C, NB, KT], dS [L, C, NB], dWb [C, KT], dSb [C], dbias [C], one after the
    other. The partial sums G are products of unnormalised sub-bands, so a level's effective weight r * s * w
    (r = 2**(-ndim/2), r**2 = 1 / NB) has the gradient G / NB: ``dw = s * G / NB``, ``ds = sum_t w * G / NB``; the
    base: ``dwb = sb * Gb``, ``dsb = sum_t wb * Gb + bias * Gbias``, ``dbias = sb * Gbias``."""
    c = pid % C
    j = pid // C
    w_ptr = params_ptr
    s_ptr = params_ptr + LEVELS * C * NB * KT
    t = tl.arange(0, TAPS)
    t_ok = t < KT
    rows = 0
    row0 = 0
    count = 0
    for i in tl.static_range(1, LEVELS + 1):
        shares = _level_shares(i, B, D, H, W, SPAN, XP)
        rows += shares
        row0 += tl.where(i <= j, shares, 0)
        count = tl.where(i == j + 1, shares, count)
    if j < LEVELS:
        b = tl.arange(0, NB)[:, None]
        acc = tl.zeros([NB, TAPS], tl.float32)
        for row in range(row0, row0 + count):
            acc += tl.load(part_ptr + ((row * C + c) * NB + b) * KT + t[None, :], mask=t_ok[None, :], other=0.0)
        wc = (j * C + c) * NB
        w = tl.load(w_ptr + (wc + b) * KT + t[None, :], mask=t_ok[None, :], other=0.0).to(tl.float32)
        s = tl.load(s_ptr + wc + b).to(tl.float32)
        g = acc * (1.0 / NB)
        tl.store(out_ptr + (wc + b) * KT + t[None, :], s * g, mask=t_ok[None, :])
        tl.store(out_ptr + LEVELS * C * NB * KT + wc + tl.arange(0, NB), tl.sum(w * g, axis=1))
    else:
        shares1 = _level_shares(1, B, D, H, W, SPAN, XP)
        base = part_ptr + rows * C * NB * KT
        acc_b = tl.zeros([TAPS], tl.float32)
        acc_bias = tl.zeros([1], tl.float32)
        for row in range(0, shares1):
            for slot in tl.static_range(SLOTS):
                acc_b += tl.load(base + ((row * C + c) * SLOTS + slot) * KT + t, mask=t_ok, other=0.0)
            acc_bias += tl.load(base + shares1 * C * SLOTS * KT + row * C + c + tl.zeros([1], tl.int32))
        sb = tl.load(sb_ptr + c).to(tl.float32)
        wb = tl.load(wb_ptr + c * KT + t, mask=t_ok, other=0.0).to(tl.float32)
        ds = tl.sum(wb * acc_b, axis=0) + tl.zeros([1], tl.float32)
        if HAS_BIAS:
            ds += tl.load(bias_ptr + c).to(tl.float32) * acc_bias
        out = out_ptr + LEVELS * C * NB * (KT + 1)
        one = tl.arange(0, 1)
        tl.store(out + c * KT + t, sb * acc_b, mask=t_ok)
        tl.store(out + C * KT + c + one, ds)
        tl.store(out + C * KT + C + c + one, sb * acc_bias)

"""Fused WTConv kernels, 3D: the 2D kernels (``kernels2d.py``) with eight sub-bands and 2 x 2 x 2 blocks.

The parameters are read as they are (each convolution's result times its scales; the Haar levels' also times
2**(-3/2)). Sizes are run-time arguments; the z taps are a loop rather than unrolled, which keeps compile time low for
k = 7. ``_wgrad3d_level`` is ``noinline`` for compile time, as in 2D (``kernels2d.py``): 8.2 -> 4.1 s for sm_90.
"""

import triton
import triton.language as tl

from regkit_kernels.wtconv.tile import (
    block_at,
    butterfly3d,
    coarse_synthesis3d,
    fast_divmod,
    haar_conv3d,
    level_tile,
    polyphase_conv3d,
    store_blocks3d,
    tile_coords,
    wgrad_finalize,
    wgrad_plan,
    within,
)

_R3: tl.constexpr = tl.constexpr(0.35355339059327373)  # 2**(-3/2), the orthonormal 3D Haar factor
# The weight-gradient kernel's layout (see kernels2d.py): one position per element, one base partial sum per share.
WGRAD_PAIR: tl.constexpr = tl.constexpr(1)
BASE_SLOTS: tl.constexpr = tl.constexpr(1)


@triton.jit
def _grid_coords3d(q, Hq, Wq):
    return q // (Hq * Wq), (q // Wq) % Hq, q % Wq


@triton.jit
def _store_bands3d(ptrs, size, e0, e1, e2, e3, e4, e5, e6, e7, ok):
    """Store eight sub-band tiles ``size`` elements apart."""
    tl.store(ptrs, e0, mask=ok)
    tl.store(ptrs + size, e1, mask=ok)
    tl.store(ptrs + 2 * size, e2, mask=ok)
    tl.store(ptrs + 3 * size, e3, mask=ok)
    tl.store(ptrs + 4 * size, e4, mask=ok)
    tl.store(ptrs + 5 * size, e5, mask=ok)
    tl.store(ptrs + 6 * size, e6, mask=ok)
    tl.store(ptrs + 7 * size, e7, mask=ok)


@triton.jit
def haar_lowpasses3d_kernel(
    # pointers: a volume stack [P, D, H, W] and its raw Haar low-passes of levels 1..DEPTH, one after the other
    src_ptr,
    low_ptr,
    # sizes
    P,
    D,
    H,
    W,
    DEPTH: tl.constexpr,
    NP: tl.constexpr,
    TZ: tl.constexpr,
    TY: tl.constexpr,
    TX: tl.constexpr,
):
    """The orthonormal Haar low-passes (LLL) of levels 1..DEPTH of a volume stack in one pass, zero-padded on the far
    side of odd sizes; a program halves a tile of NP volumes x TZ x TY x TX voxels (multiples of 2**DEPTH) in
    registers, as in the 2D kernel (rows of the tile are (volume, z, y), flattened)."""
    pid = tl.program_id(0)
    tiles_x = tl.cdiv(W, TX)
    tiles_y = tl.cdiv(H, TY)
    tiles = tl.cdiv(D, TZ) * tiles_y * tiles_x
    p0 = pid // tiles * NP
    z0 = pid % tiles // (tiles_y * tiles_x) * TZ
    y0 = pid % (tiles_y * tiles_x) // tiles_x * TY
    x0 = pid % tiles_x * TX
    r = tl.arange(0, NP * TZ * TY)[:, None]
    p = p0 + r // (TZ * TY)
    z = z0 + r // TY % TZ
    y = y0 + r % TY
    x = x0 + tl.arange(0, TX)[None, :]
    ok = (p < P) & within(z, D) & within(y, H) & within(x, W)
    v = tl.load(src_ptr + ((p.to(tl.int64) * D + z) * H + y) * W + x, mask=ok, other=0.0).to(tl.float32)
    offset = tl.cast(0, tl.int64)
    d = D
    h = H
    w = W
    for j in tl.static_range(1, DEPTH + 1):  # level j's tile: NP x (TZ >> j) x (TY >> j) x (TX >> j)
        v = tl.sum(tl.reshape(v, [NP * (TZ >> j), 2, (TY >> (j - 1)) * (TX >> (j - 1))]), axis=1)  # z pairs
        v = tl.sum(tl.reshape(v, [NP * (TZ >> j) * (TY >> j), 2, TX >> (j - 1)]), axis=1)  # row pairs
        v = _R3 * tl.sum(tl.reshape(v, [NP * (TZ >> j) * (TY >> j), TX >> j, 2]), axis=2)  # column pairs
        d = (d + 1) // 2
        h = (h + 1) // 2
        w = (w + 1) // 2
        r = tl.arange(0, NP * (TZ >> j) * (TY >> j))[:, None]
        p = p0 + r // ((TZ >> j) * (TY >> j))
        z = (z0 >> j) + r // (TY >> j) % (TZ >> j)
        y = (y0 >> j) + r % (TY >> j)
        x = (x0 >> j) + tl.arange(0, TX >> j)[None, :]
        ok = (p < P) & within(z, d) & within(y, h) & within(x, w)
        tl.store(low_ptr + offset + ((p.to(tl.int64) * d + z) * h + y) * w + x, v, mask=ok)
        offset += tl.cast(P, tl.int64) * d * h * w


@triton.jit
def _level3d(low_ptr, params_ptr, z_ptr, pid, B, C, D, H, W, LEVELS: tl.constexpr, K: tl.constexpr,
             DIR: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Program ``pid`` of the Haar levels 2..LEVELS; see ``_level2d`` (``params_ptr``: weights [L, C, 8, K**3] then
    scales [L, C, 8])."""
    level, c, plane, q, ok, d, h, w, low_off, z_off = level_tile(pid, B, C, D, H, W, LEVELS, 8, BLOCK)
    hq = (h + 1) // 2
    wq = (w + 1) // 2
    size = (d + 1) // 2 * hq * wq
    qz, qy, qx = _grid_coords3d(q, hq, wq)
    wc = (level - 1) * C + c
    KKK: tl.constexpr = K * K * K
    z0, z1, z2, z3, z4, z5, z6, z7 = haar_conv3d(
        low_ptr + low_off + plane * d * h * w, params_ptr + wc * 8 * KKK, params_ptr + LEVELS * C * 8 * KKK + wc * 8,
        qz, qy, qx, ok, d, h, w, K, DIR,
    )  # fmt: skip
    _store_bands3d(z_ptr + z_off + plane * 8 * size + q, size, z0, z1, z2, z3, z4, z5, z6, z7, ok)


@triton.jit
def wtconv3d_levels_kernel(
    # pointers: the raw low-passes of levels 1..LEVELS-1 (of x or of the output gradient) one after the other; the
    # level weights and scales (see ``_level3d``); output: the sub-bands of levels 2..LEVELS (processed, or their
    # gradients) one after the other
    low_ptr,
    params_ptr,
    z_ptr,
    # sizes
    B,
    C,
    D,
    H,
    W,
    LEVELS: tl.constexpr,
    K: tl.constexpr,
    DIR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Haar levels 2..LEVELS in one launch, forward (DIR = 1: the processed sub-bands from x's low-passes) or backward
    (DIR = -1: the sub-band gradients from the output gradient's low-passes); see ``_level3d``."""
    _level3d(low_ptr, params_ptr, z_ptr, tl.program_id(0), B, C, D, H, W, LEVELS, K, DIR, BLOCK)


@triton.jit
def wtconv3d_fwd_kernel(
    # pointers: x and out [B, C, D, H, W]; base weights [C, K**3], bias [C] and scale [C]; the level weights and
    # scales (see ``_level3d``); the processed sub-bands of levels 2..LEVELS, one after the other
    x_ptr,
    wb_ptr,
    bias_ptr,
    sb_ptr,
    params_ptr,
    coarse_ptr,
    out_ptr,
    # sizes; (D1, H1, W1) is the level-1 grid
    B,
    C,
    D,
    H,
    W,
    D1,
    H1,
    W1,
    LEVELS: tl.constexpr,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The output, one 2 x 2 x 2 block per level-1 position (see the 2D kernel)."""
    KKK: tl.constexpr = K * K * K
    c, plane, q, ok = tile_coords(tl.program_id(0), B, C, D1 * H1 * W1, BLOCK)
    qz, qy, qx = _grid_coords3d(q, H1, W1)
    xs = x_ptr + plane * D * H * W
    z0, z1, z2, z3, z4, z5, z6, z7 = haar_conv3d(
        xs, params_ptr + c * 8 * KKK, params_ptr + LEVELS * C * 8 * KKK + c * 8, qz, qy, qx, ok, D, H, W, K, 1
    )
    z0 += coarse_synthesis3d(coarse_ptr, plane, qz, qy, qx, ok, B * C, D, H, W, LEVELS)
    r0, r1, r2, r3, r4, r5, r6, r7 = butterfly3d(z0, z1, z2, z3, z4, z5, z6, z7)
    a0, a1, a2, a3, a4, a5, a6, a7 = polyphase_conv3d(xs, wb_ptr + c * KKK, qz, qy, qx, ok, D, H, W, K, 1)
    sb = tl.load(sb_ptr + c).to(tl.float32)
    bias = tl.load(bias_ptr + c).to(tl.float32) if HAS_BIAS else 0.0
    store_blocks3d(
        out_ptr + plane * D * H * W,
        sb * (a0 + bias) + r0 * _R3,
        sb * (a1 + bias) + r1 * _R3,
        sb * (a2 + bias) + r2 * _R3,
        sb * (a3 + bias) + r3 * _R3,
        sb * (a4 + bias) + r4 * _R3,
        sb * (a5 + bias) + r5 * _R3,
        sb * (a6 + bias) + r6 * _R3,
        sb * (a7 + bias) + r7 * _R3,
        qz,
        qy,
        qx,
        ok,
        D,
        H,
        W,
    )


@triton.jit
def wtconv3d_bwd_kernel(
    # pointers: output gradient and input gradient [B, C, D, H, W]; base weights [C, K**3], scale [C] and bias [C];
    # the level weights and scales (see ``_level3d``); the sub-band gradients of levels 2..LEVELS one after the
    # other; the weight-gradient partial sums and the parameter gradients (see ``wgrad_finalize``)
    dy_ptr,
    wb_ptr,
    sb_ptr,
    bias_ptr,
    params_ptr,
    coarse_ptr,
    dx_ptr,
    part_ptr,
    grads_ptr,
    # sizes
    B,
    C,
    D,
    H,
    W,
    D1,
    H1,
    W1,
    SPAN,
    DX_PROGRAMS,
    LEVELS: tl.constexpr,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    TAPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The input gradient, one 2 x 2 x 2 block per level-1 position, then the parameter gradients; see the 2D
    kernel."""
    KKK: tl.constexpr = K * K * K
    pid = tl.program_id(0)
    if pid < DX_PROGRAMS:
        c, plane, q, ok = tile_coords(pid, B, C, D1 * H1 * W1, BLOCK)
        qz, qy, qx = _grid_coords3d(q, H1, W1)
        dys = dy_ptr + plane * D * H * W
        e0, e1, e2, e3, e4, e5, e6, e7 = haar_conv3d(
            dys, params_ptr + c * 8 * KKK, params_ptr + LEVELS * C * 8 * KKK + c * 8, qz, qy, qx, ok, D, H, W, K, -1
        )
        e0 += coarse_synthesis3d(coarse_ptr, plane, qz, qy, qx, ok, B * C, D, H, W, LEVELS)
        r0, r1, r2, r3, r4, r5, r6, r7 = butterfly3d(e0, e1, e2, e3, e4, e5, e6, e7)
        a0, a1, a2, a3, a4, a5, a6, a7 = polyphase_conv3d(dys, wb_ptr + c * KKK, qz, qy, qx, ok, D, H, W, K, -1)
        sb = tl.load(sb_ptr + c).to(tl.float32)
        store_blocks3d(
            dx_ptr + plane * D * H * W,
            sb * a0 + r0 * _R3,
            sb * a1 + r1 * _R3,
            sb * a2 + r2 * _R3,
            sb * a3 + r3 * _R3,
            sb * a4 + r4 * _R3,
            sb * a5 + r5 * _R3,
            sb * a6 + r6 * _R3,
            sb * a7 + r7 * _R3,
            qz,
            qy,
            qx,
            ok,
            D,
            H,
            W,
        )
    else:
        wgrad_finalize(
            part_ptr, params_ptr, wb_ptr, sb_ptr, bias_ptr, grads_ptr, pid - DX_PROGRAMS, B, C, D, H, W, SPAN, LEVELS,
            8, KKK, TAPS, HAS_BIAS, BASE_SLOTS, WGRAD_PAIR,
        )  # fmt: skip


@triton.jit(noinline=True)
def _wgrad3d_level(
    g_ptr, src_ptr, part_ptr, c, tz, ty, share, row, C, B, D, H, W, Dq, Hq, Wq, base_off, SPAN,
    K: tl.constexpr, BASE: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One level's weight-gradient sums for the taps of row (tz, ty) over one share of channel c; see
    ``_wgrad2d_level`` (a block is two z-slices of 2 x 2 pixels; each of the K blocks of the tap row is loaded once per
    position and feeds every tap column through the in-thread tap axis).

    With BASE, the base conv's sums of the same tap row: the pixels at offsets (uz + sz, uy + sy, ox) from a block's
    corner, ox in [-K // 2, K // 2 + 1], meet the block's pixel of phase (sz, sy, sx) at tap column ox - sx + K // 2
    (4 (K + 1) loads per position, apart from the sub-bands' blocks, which lie in other rows). ``sum_y g(y)`` (the
    bias) is summed by the programs of tap row (0, 0)."""
    P: tl.constexpr = K // 2
    tx = tl.arange(0, KP)[:, None]  # tap column, within a thread
    uz = tz - P
    uy = ty - P
    HW = H * W
    D2 = D // 2  # blocks whose far slice, row or column lies inside the volume
    H2 = H // 2
    W2 = W // 2
    acc0 = tl.zeros([KP, BLOCK], tl.float32)
    acc1 = tl.zeros([KP, BLOCK], tl.float32)
    acc2 = tl.zeros([KP, BLOCK], tl.float32)
    acc3 = tl.zeros([KP, BLOCK], tl.float32)
    acc4 = tl.zeros([KP, BLOCK], tl.float32)
    acc5 = tl.zeros([KP, BLOCK], tl.float32)
    acc6 = tl.zeros([KP, BLOCK], tl.float32)
    acc7 = tl.zeros([KP, BLOCK], tl.float32)
    acc_base = tl.zeros([KP, BLOCK], tl.float32)
    bias = tl.zeros([BLOCK], tl.float32)
    HWq = Hq * Wq
    Q = Dq * HWq
    inv_q = 1.0 / tl.cast(Q, tl.float32)
    inv_hw = 1.0 / tl.cast(HWq, tl.float32)
    inv_w = 1.0 / tl.cast(Wq, tl.float32)
    end = tl.minimum(share * SPAN + SPAN, B * Q)
    for start in range(share * SPAN, end, BLOCK):
        n = start + tl.arange(0, BLOCK)
        ok = n < end
        b, q = fast_divmod(n, Q, inv_q)
        qz, r = fast_divmod(q, HWq, inv_hw)
        qy, qx = fast_divmod(r, Wq, inv_w)
        pos = (b * C + c).to(tl.int64) * D * HW + ((2 * qz * H + 2 * qy) * W + 2 * qx)
        gs = g_ptr + pos
        y1 = qy < H2
        x1 = qx < W2
        g0, g1, g2, g3 = block_at(gs, W, ok, ok & y1, True, x1)
        g4, g5, g6, g7 = block_at(gs + HW, W, ok & (qz < D2), ok & (qz < D2) & y1, True, x1)
        if BASE:
            z = 2 * qz + uz
            y = 2 * qy + uy
            ok_b0 = ok & within(z, D)
            ok_b1 = ok & within(z + 1, D)
            by0 = within(y, H)
            by1 = within(y + 1, H)
            for ix in tl.static_range(K + 1):
                ox = ix - P
                col_ok = within(2 * qx + ox, W)
                p = src_ptr + pos + (uz * H + uy) * W + ox
                a0 = tl.load(p, mask=ok_b0 & by0 & col_ok, other=0.0).to(tl.float32)
                a1 = tl.load(p + W, mask=ok_b0 & by1 & col_ok, other=0.0).to(tl.float32)
                a2 = tl.load(p + HW, mask=ok_b1 & by0 & col_ok, other=0.0).to(tl.float32)
                a3 = tl.load(p + (HW + W), mask=ok_b1 & by1 & col_ok, other=0.0).to(tl.float32)
                if ix < K:  # sx = 0: tap column ix; the block's pixels of phases (sz, sy, 0): g0, g2, g4, g6
                    hit = tx == ix
                    acc_base = tl.where(hit, acc_base + (g0 * a0 + g2 * a1 + g4 * a2 + g6 * a3)[None, :], acc_base)
                if ix >= 1:  # sx = 1: tap column ix - 1
                    hit = tx == ix - 1
                    acc_base = tl.where(hit, acc_base + (g1 * a0 + g3 * a1 + g5 * a2 + g7 * a3)[None, :], acc_base)
            bias += g0 + g1 + g2 + g3 + g4 + g5 + g6 + g7
        d0, d1, d2, d3, d4, d5, d6, d7 = butterfly3d(g0, g1, g2, g3, g4, g5, g6, g7)
        vz = qz + uz
        vy = qy + uy
        ok_z0 = ok & within(vz, Dq)
        ok_z1 = ok & within(vz, D2)
        ry0 = within(vy, Hq)
        ry1 = within(vy, H2)
        src = src_ptr + pos + (2 * uz * H + 2 * uy) * W
        for v in tl.static_range(K):
            ux = v - P
            x0 = within(qx + ux, Wq)
            x1 = within(qx + ux, W2)
            s0, s1, s2, s3 = block_at(src + 2 * ux, W, ok_z0 & ry0, ok_z0 & ry1, x0, x1)
            s4, s5, s6, s7 = block_at(src + (2 * ux + HW), W, ok_z1 & ry0, ok_z1 & ry1, x0, x1)
            u0, u1, u2, u3, u4, u5, u6, u7 = butterfly3d(s0, s1, s2, s3, s4, s5, s6, s7)
            hit = tx == v
            acc0 = tl.where(hit, acc0 + (d0 * u0)[None, :], acc0)
            acc1 = tl.where(hit, acc1 + (d1 * u1)[None, :], acc1)
            acc2 = tl.where(hit, acc2 + (d2 * u2)[None, :], acc2)
            acc3 = tl.where(hit, acc3 + (d3 * u3)[None, :], acc3)
            acc4 = tl.where(hit, acc4 + (d4 * u4)[None, :], acc4)
            acc5 = tl.where(hit, acc5 + (d5 * u5)[None, :], acc5)
            acc6 = tl.where(hit, acc6 + (d6 * u6)[None, :], acc6)
            acc7 = tl.where(hit, acc7 + (d7 * u7)[None, :], acc7)
    KKK: tl.constexpr = K * K * K
    t = tl.arange(0, KP)
    t_ok = t < K
    dw = part_ptr + (row * C + c) * 8 * KKK + (tz * K + ty) * K + t
    tl.store(dw, tl.sum(acc0, axis=1), mask=t_ok)
    tl.store(dw + KKK, tl.sum(acc1, axis=1), mask=t_ok)
    tl.store(dw + 2 * KKK, tl.sum(acc2, axis=1), mask=t_ok)
    tl.store(dw + 3 * KKK, tl.sum(acc3, axis=1), mask=t_ok)
    tl.store(dw + 4 * KKK, tl.sum(acc4, axis=1), mask=t_ok)
    tl.store(dw + 5 * KKK, tl.sum(acc5, axis=1), mask=t_ok)
    tl.store(dw + 6 * KKK, tl.sum(acc6, axis=1), mask=t_ok)
    tl.store(dw + 7 * KKK, tl.sum(acc7, axis=1), mask=t_ok)
    if BASE:
        shares1 = tl.cdiv(B * Q, SPAN)
        tl.store(part_ptr + base_off + (share * C + c) * KKK + (tz * K + ty) * K + t, tl.sum(acc_base, axis=1),
                 mask=t_ok)  # fmt: skip
        one = tl.arange(0, 1)
        bias_at = part_ptr + base_off + shares1 * C * KKK + share * C + c
        tl.store(bias_at + one, tl.sum(bias) + 0.0 * one, mask=(one + tz + ty) == 0)


@triton.jit
def wtconv3d_wgrad_kernel(
    # pointers: the output gradient dy and x [B, C, D, H, W]; the low-passes of levels 1..L-1 of dy and of x, one
    # after the other; output: partial sums (see ``wgrad_finalize``)
    dy_ptr,
    x_ptr,
    glow_ptr,
    low_ptr,
    part_ptr,
    # sizes
    B,
    C,
    D,
    H,
    W,
    SPAN,
    LEVELS: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Weight gradients of every level (and of the base conv and bias) in one launch: program = (level, share,
    channel, z tap, y tap), the taps fastest (the K * K programs of a share read the same blocks), see ``wgrad_plan``;
    level 1 reads dy and x, deeper levels the low-pass buffers. (Unlike 2D, the levels' backward is a launch of its
    own: its registers would halve this kernel's occupancy.)"""
    level, local, row0, off, d_in, h_in, w_in, rows = wgrad_plan(
        tl.program_id(0), B, C, C * K * K, D, H, W, SPAN, LEVELS, WGRAD_PAIR
    )
    ty = local % K
    tz = local // K % K
    c = local // (K * K) % C
    share = local // (K * K * C)
    base_off = rows * C * 8 * K * K * K
    if level == 1:
        _wgrad3d_level(
            dy_ptr, x_ptr, part_ptr, c, tz, ty, share, row0 + share, C, B, D, H, W, (D + 1) // 2, (H + 1) // 2,
            (W + 1) // 2, base_off, SPAN, K, True, KP, BLOCK,
        )  # fmt: skip
    else:
        _wgrad3d_level(
            glow_ptr + off, low_ptr + off, part_ptr, c, tz, ty, share, row0 + share, C, B, d_in, h_in, w_in,
            (d_in + 1) // 2, (h_in + 1) // 2, (w_in + 1) // 2, base_off, SPAN, K, False, KP, BLOCK,
        )  # fmt: skip

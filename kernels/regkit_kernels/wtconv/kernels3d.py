"""Fused WTConv kernels, 3D: the 2D kernels (``kernels2d.py``) with eight sub-bands and 2 x 2 x 2 blocks.

The parameters are read as they are (each convolution's result times its scales; the Haar levels' also times
2**(-3/2)). Sizes are run-time arguments; the z taps are a loop rather than unrolled, which keeps compile time low for
k = 7.
"""

import triton
import triton.language as tl

from regkit_kernels.wtconv._tile import (
    _block_at,
    _butterfly3d,
    _coarse_synthesis3d,
    _divmod,
    _haar_block3d,
    _haar_conv3d,
    _polyphase_conv3d,
    _store_blocks3d,
    _tile_coords,
    _wgrad_plan,
    _within,
)

_R3: tl.constexpr = tl.constexpr(0.35355339059327373)  # 2**(-3/2), the orthonormal 3D Haar factor


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
def _haar_lowpass3d_kernel(
    # pointers: a volume stack [B, C, D, H, W] and its raw Haar low-pass [B, C, Dq, Hq, Wq]
    src_ptr,
    low_ptr,
    # sizes
    B,
    C,
    D,
    H,
    W,
    Dq,
    Hq,
    Wq,
    BLOCK: tl.constexpr,
):
    """The orthonormal Haar low-pass (LLL) of every 2 x 2 x 2 block, zero-padded on the far side of odd sizes."""
    _, plane, q, ok = _tile_coords(B, C, Dq * Hq * Wq, BLOCK)
    qz, qy, qx = _grid_coords3d(q, Hq, Wq)
    ll, _, _, _, _, _, _, _ = _haar_block3d(src_ptr + plane * D * H * W, 2 * qz, 2 * qy, 2 * qx, ok, D, H, W)
    tl.store(low_ptr + plane * Dq * Hq * Wq + q, ll * _R3, mask=ok)


@triton.jit
def _wtconv3d_level_fwd_kernel(
    # pointers: the previous level's raw low-pass [B, C, D, H, W]; weights [C, 8, K**3] and scales [C, 8]; outputs:
    # the processed sub-bands Z [B, C, 8, Dq, Hq, Wq] and this level's raw low-pass [B, C, Dq, Hq, Wq]
    # (q < low_size: all or none)
    src_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    low_ptr,
    # sizes
    B,
    C,
    D,
    H,
    W,
    Dq,
    Hq,
    Wq,
    low_size,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One Haar level (2 and deeper): analysis recomputed on chip, fused with the depthwise conv."""
    size = Dq * Hq * Wq
    c, plane, q, ok = _tile_coords(B, C, size, BLOCK)
    qz, qy, qx = _grid_coords3d(q, Hq, Wq)
    src = src_ptr + plane * D * H * W
    ll, _, _, _, _, _, _, _ = _haar_block3d(src, 2 * qz, 2 * qy, 2 * qx, ok, D, H, W)
    tl.store(low_ptr + plane * size + q, ll * _R3, mask=ok & (q < low_size))
    z0, z1, z2, z3, z4, z5, z6, z7 = _haar_conv3d(
        src, w_ptr + c * 8 * K * K * K, s_ptr + c * 8, qz, qy, qx, ok, D, H, W, K, 1
    )
    _store_bands3d(z_ptr + plane * 8 * size + q, size, z0, z1, z2, z3, z4, z5, z6, z7, ok)


@triton.jit
def _wtconv3d_fwd_kernel(
    # pointers: x and out [B, C, D, H, W]; base weights [C, K**3], bias [C] and scale [C]; level-1 weights
    # [C, 8, K**3] and scales [C, 8]; the processed sub-bands of levels 2..LEVELS, one after the other
    x_ptr,
    wb_ptr,
    bias_ptr,
    sb_ptr,
    w1_ptr,
    s1_ptr,
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
    c, plane, q, ok = _tile_coords(B, C, D1 * H1 * W1, BLOCK)
    qz, qy, qx = _grid_coords3d(q, H1, W1)
    xs = x_ptr + plane * D * H * W
    z0, z1, z2, z3, z4, z5, z6, z7 = _haar_conv3d(
        xs, w1_ptr + c * 8 * K * K * K, s1_ptr + c * 8, qz, qy, qx, ok, D, H, W, K, 1
    )
    z0 += _coarse_synthesis3d(coarse_ptr, plane, qz, qy, qx, ok, B * C, D, H, W, LEVELS)
    r0, r1, r2, r3, r4, r5, r6, r7 = _butterfly3d(z0, z1, z2, z3, z4, z5, z6, z7)
    a0, a1, a2, a3, a4, a5, a6, a7 = _polyphase_conv3d(xs, wb_ptr + c * K * K * K, qz, qy, qx, ok, D, H, W, K, 1)
    sb = tl.load(sb_ptr + c).to(tl.float32)
    bias = tl.load(bias_ptr + c).to(tl.float32) if HAS_BIAS else 0.0
    _store_blocks3d(
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
def _wtconv3d_level_bwd_kernel(
    # pointers: the output gradient's low-pass at the level's input [B, C, D, H, W]; weights [C, 8, K**3] and
    # scales [C, 8]; outputs: the level's sub-band gradient [B, C, 8, Dq, Hq, Wq] and the output gradient's next
    # low-pass [B, C, Dq, Hq, Wq] (q < low_size: all or none)
    dsrc_ptr,
    w_ptr,
    s_ptr,
    dz_ptr,
    dlow_ptr,
    # sizes
    B,
    C,
    D,
    H,
    W,
    Dq,
    Hq,
    Wq,
    low_size,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Backward of one Haar level (2 and deeper): the gradient of its sub-bands; see the 2D kernel."""
    size = Dq * Hq * Wq
    c, plane, q, ok = _tile_coords(B, C, size, BLOCK)
    qz, qy, qx = _grid_coords3d(q, Hq, Wq)
    dsrc = dsrc_ptr + plane * D * H * W
    ll, _, _, _, _, _, _, _ = _haar_block3d(dsrc, 2 * qz, 2 * qy, 2 * qx, ok, D, H, W)
    tl.store(dlow_ptr + plane * size + q, ll * _R3, mask=ok & (q < low_size))
    e0, e1, e2, e3, e4, e5, e6, e7 = _haar_conv3d(
        dsrc, w_ptr + c * 8 * K * K * K, s_ptr + c * 8, qz, qy, qx, ok, D, H, W, K, -1
    )
    _store_bands3d(dz_ptr + plane * 8 * size + q, size, e0, e1, e2, e3, e4, e5, e6, e7, ok)


@triton.jit
def _wtconv3d_bwd_kernel(
    # pointers: output gradient and input gradient [B, C, D, H, W]; base weights [C, K**3] and scale [C]; level-1
    # weights [C, 8, K**3] and scales [C, 8]; the sub-band gradients of levels 2..LEVELS one after the other
    dy_ptr,
    wb_ptr,
    sb_ptr,
    w1_ptr,
    s1_ptr,
    coarse_ptr,
    dx_ptr,
    # sizes
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
    BLOCK: tl.constexpr,
):
    """The input gradient, one 2 x 2 x 2 block per level-1 position; see the 2D kernel."""
    c, plane, q, ok = _tile_coords(B, C, D1 * H1 * W1, BLOCK)
    qz, qy, qx = _grid_coords3d(q, H1, W1)
    dys = dy_ptr + plane * D * H * W
    e0, e1, e2, e3, e4, e5, e6, e7 = _haar_conv3d(
        dys, w1_ptr + c * 8 * K * K * K, s1_ptr + c * 8, qz, qy, qx, ok, D, H, W, K, -1
    )
    e0 += _coarse_synthesis3d(coarse_ptr, plane, qz, qy, qx, ok, B * C, D, H, W, LEVELS)
    r0, r1, r2, r3, r4, r5, r6, r7 = _butterfly3d(e0, e1, e2, e3, e4, e5, e6, e7)
    a0, a1, a2, a3, a4, a5, a6, a7 = _polyphase_conv3d(dys, wb_ptr + c * K * K * K, qz, qy, qx, ok, D, H, W, K, -1)
    sb = tl.load(sb_ptr + c).to(tl.float32)
    _store_blocks3d(
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


@triton.jit
def _wgrad3d_level(
    g_ptr, src_ptr, part_ptr, c, tz, share, row, C, B, D, H, W, Dq, Hq, Wq, base_off, SPAN,
    K: tl.constexpr, BASE: tl.constexpr, TAPS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One level's weight-gradient sums for one z tap and one share of channel c; see ``_wgrad2d_level`` (the tile's
    tap axis holds the K x K in-plane taps of z tap ``tz``; a block is two z-slices of 2 x 2 pixels)."""
    P: tl.constexpr = K // 2
    KK: tl.constexpr = K * K
    KKK: tl.constexpr = K * K * K
    t = tl.arange(0, TAPS)
    uz = tz - P
    uy = (t // K - P)[:, None]
    ux = (t % K - P)[:, None]
    tap_ok = (t < KK)[:, None]
    HW = H * W
    band_off = (2 * uz * H + 2 * uy) * W + 2 * ux
    base_shift = (uz * H + uy) * W + ux
    D2 = D // 2  # blocks whose far slice, row or column lies inside the volume
    H2 = H // 2
    W2 = W // 2
    acc0 = tl.zeros([TAPS, BLOCK], tl.float32)
    acc1 = tl.zeros([TAPS, BLOCK], tl.float32)
    acc2 = tl.zeros([TAPS, BLOCK], tl.float32)
    acc3 = tl.zeros([TAPS, BLOCK], tl.float32)
    acc4 = tl.zeros([TAPS, BLOCK], tl.float32)
    acc5 = tl.zeros([TAPS, BLOCK], tl.float32)
    acc6 = tl.zeros([TAPS, BLOCK], tl.float32)
    acc7 = tl.zeros([TAPS, BLOCK], tl.float32)
    acc_base = tl.zeros([TAPS, BLOCK], tl.float32)
    acc_bias = tl.zeros([1, BLOCK], tl.float32)
    HWq = Hq * Wq
    Q = Dq * HWq
    inv_q = 1.0 / tl.cast(Q, tl.float32)
    inv_hw = 1.0 / tl.cast(HWq, tl.float32)
    inv_w = 1.0 / tl.cast(Wq, tl.float32)
    end = tl.minimum(share * SPAN + SPAN, B * Q)
    for start in range(share * SPAN, end, BLOCK):
        n = start + tl.arange(0, BLOCK)[None, :]
        ok = n < end
        b, q = _divmod(n, Q, inv_q)
        qz, r = _divmod(q, HWq, inv_hw)
        qy, qx = _divmod(r, Wq, inv_w)
        pos = (b * C + c).to(tl.int64) * D * HW + ((2 * qz * H + 2 * qy) * W + 2 * qx)
        gs = g_ptr + pos
        y1 = qy < H2
        x1 = qx < W2
        g0, g1, g2, g3 = _block_at(gs, W, ok, ok & y1, True, x1)
        g4, g5, g6, g7 = _block_at(gs + HW, W, ok & (qz < D2), ok & (qz < D2) & y1, True, x1)
        d0, d1, d2, d3, d4, d5, d6, d7 = _butterfly3d(g0, g1, g2, g3, g4, g5, g6, g7)
        src = src_ptr + pos
        vz = qz + uz
        vy = qy + uy
        vx = qx + ux
        ok_t = ok & tap_ok
        ry0 = _within(vy, Hq)
        ry1 = _within(vy, H2)
        rx0 = _within(vx, Wq)
        rx1 = _within(vx, W2)
        hs = src + band_off
        ok_z0 = ok_t & _within(vz, Dq)
        ok_z1 = ok_t & _within(vz, D2)
        s0, s1, s2, s3 = _block_at(hs, W, ok_z0 & ry0, ok_z0 & ry1, rx0, rx1)
        s4, s5, s6, s7 = _block_at(hs + HW, W, ok_z1 & ry0, ok_z1 & ry1, rx0, rx1)
        u0, u1, u2, u3, u4, u5, u6, u7 = _butterfly3d(s0, s1, s2, s3, s4, s5, s6, s7)
        acc0 += d0 * u0
        acc1 += d1 * u1
        acc2 += d2 * u2
        acc3 += d3 * u3
        acc4 += d4 * u4
        acc5 += d5 * u5
        acc6 += d6 * u6
        acc7 += d7 * u7
        if BASE:
            z = 2 * qz + uz
            y = 2 * qy + uy
            x = 2 * qx + ux
            by0 = _within(y, H)
            by1 = _within(y + 1, H)
            bx0 = _within(x, W)
            bx1 = _within(x + 1, W)
            bs = src + base_shift
            ok_b0 = ok_t & _within(z, D)
            ok_b1 = ok_t & _within(z + 1, D)
            a0, a1, a2, a3 = _block_at(bs, W, ok_b0 & by0, ok_b0 & by1, bx0, bx1)
            a4, a5, a6, a7 = _block_at(bs + HW, W, ok_b1 & by0, ok_b1 & by1, bx0, bx1)
            acc_base += g0 * a0 + g1 * a1 + g2 * a2 + g3 * a3 + g4 * a4 + g5 * a5 + g6 * a6 + g7 * a7
            acc_bias += g0 + g1 + g2 + g3 + g4 + g5 + g6 + g7
    t_ok = t < KK
    dw = part_ptr + (row * C + c) * 8 * KKK + tz * KK + t
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
        tl.store(part_ptr + base_off + (share * C + c) * KKK + tz * KK + t, tl.sum(acc_base, axis=1), mask=t_ok)
        bias_sum = tl.sum(acc_bias, axis=1)  # [1]
        one = tl.arange(0, 1)
        tl.store(part_ptr + base_off + shares1 * C * KKK + share * C + c + one, bias_sum, mask=(one + tz) == 0)


@triton.jit
def _wtconv3d_wgrad_kernel(
    # pointers: the output gradient dy and x [B, C, D, H, W]; the low-passes of levels 1..L-1 of dy and of x, one
    # after the other; output: partial sums (see ``_wgrad_finalize_kernel``)
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
    TAPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Weight gradients of every level (and of the base conv and bias) in one launch: program = (level, share, z tap,
    channel), see ``_wgrad_plan``; level 1 reads dy and x, deeper levels the low-pass buffers."""
    level, local, row0, off, d_in, h_in, w_in, rows = _wgrad_plan(tl.program_id(0), B, C, C * K, D, H, W, SPAN, LEVELS)
    c = local % C
    tz = local // C % K
    share = local // (C * K)
    base_off = rows * C * 8 * K * K * K
    if level == 1:
        _wgrad3d_level(
            dy_ptr, x_ptr, part_ptr, c, tz, share, row0 + share, C, B, D, H, W, (D + 1) // 2, (H + 1) // 2,
            (W + 1) // 2, base_off, SPAN, K, True, TAPS, BLOCK,
        )  # fmt: skip
    else:
        _wgrad3d_level(
            glow_ptr + off, low_ptr + off, part_ptr, c, tz, share, row0 + share, C, B, d_in, h_in, w_in,
            (d_in + 1) // 2, (h_in + 1) // 2, (w_in + 1) // 2, base_off, SPAN, K, False, TAPS, BLOCK,
        )  # fmt: skip

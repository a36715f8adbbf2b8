"""Fused WTConv kernels, 3D: the 2D kernels (``kernels2d.py``) with eight sub-bands and 2 x 2 x 2 blocks.

The parameters are read as they are (each convolution's result times its scales; the Haar levels' also times
2**(-3/2)). Sizes are run-time arguments; the z taps are a loop rather than unrolled, which keeps compile time low for
k = 7.
"""

import triton
import triton.language as tl

from regkit_kernels.wtconv._tile import (
    _butterfly3d,
    _coarse_synthesis3d,
    _haar_block3d,
    _haar_conv3d,
    _load2d,
    _polyphase_conv3d,
    _slice3d,
    _store_blocks3d,
    _store_diagonals,
    _tile_coords,
    _wgrad_plan,
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
def _select4(i, v0, v1, v2, v3):
    """``(v0, v1, v2, v3)[i]`` for a run-time index i."""
    return tl.where(i < 2, tl.where(i == 0, v0, v1), tl.where(i == 2, v2, v3))


@triton.jit
def _wgrad3d_bands(
    g_ptr, src_ptr, out_ptr, c, tz, ty, pair, share, C, B, D, H, W, Dq, Hq, Wq, SPAN,
    K: tl.constexpr, ROWS: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """Weight-gradient sums of sub-bands 2 * pair and 2 * pair + 1 of one level, taps (tz, ty, .), over one share
    (SPAN consecutive (batch item, z, y) rows of the level's grid) of channel c, stored at
    ``out_ptr + b * K**3 + (tz * K + ty) * K + tx``; see ``_wgrad2d_bands``."""
    P: tl.constexpr = K // 2
    COLS: tl.constexpr = 32 - 2 * P
    uz = tz - P
    uy = ty - P
    m = tl.arange(0, 32)
    kr = tl.arange(0, ROWS)
    acc_a = tl.zeros([32, 32], tl.float32)
    acc_b = tl.zeros([32, 32], tl.float32)
    end = tl.minimum(share * SPAN + SPAN, B * Dq * Hq)
    for r0 in range(share * SPAN, end, ROWS):
        r = r0 + kr
        r_ok = r < end
        qy = r % Hq
        qz = r // Hq % Dq
        plane = (r // (Hq * Dq) * C + c).to(tl.int64) * D * H * W
        for q0 in range(0, Wq, COLS):
            a_ok = r_ok[None, :] & (m < COLS)[:, None]
            d0, d1, d2, d3, d4, d5, d6, d7 = _haar_block3d(
                g_ptr + plane[None, :], 2 * qz[None, :], 2 * qy[None, :], 2 * (q0 + m)[:, None], a_ok, D, H, W
            )
            u0, u1, u2, u3, u4, u5, u6, u7 = _haar_block3d(
                src_ptr + plane[:, None], 2 * (qz + uz)[:, None], 2 * (qy + uy)[:, None], 2 * (q0 - P + m)[None, :],
                r_ok[:, None], D, H, W,
            )  # fmt: skip
            acc_a += tl.dot(_select4(pair, d0, d2, d4, d6), _select4(pair, u0, u2, u4, u6), input_precision=DOT)
            acc_b += tl.dot(_select4(pair, d1, d3, d5, d7), _select4(pair, u1, u3, u5, u7), input_precision=DOT)
    out = out_ptr + 2 * pair * K * K * K + (tz * K + ty) * K
    _store_diagonals(out, acc_a, K)
    _store_diagonals(out + K * K * K, acc_b, K)


@triton.jit
def _wgrad3d_base(
    g_ptr, src_ptr, out_ptr, bias_ptr, c, tz, ty, share, C, B, D, H, W, Dq, Hq, SPAN,
    K: tl.constexpr, ROWS: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """The base conv's weight-gradient sums ``Gb[tz, ty, tx] = sum_y g(y) src(y + u)`` over the voxel rows of one
    share of level-1 rows (half a step of level rows at a time: 2 * ROWS voxel rows), stored at
    ``out_ptr + (tz * K + ty) * K + tx``; for tz = ty = 0 also ``sum_y g(y)`` at ``bias_ptr``."""
    P: tl.constexpr = K // 2
    PIX: tl.constexpr = 32 - 2 * P
    uz = tz - P
    uy = ty - P
    kp = tl.arange(0, 2 * ROWS)  # voxel rows: level row kp // 4, sub-rows (kp // 2 % 2, kp % 2) in z and y
    m = tl.arange(0, 32)
    acc = tl.zeros([32, 32], tl.float32)
    acc_bias = tl.zeros([32, 2 * ROWS], tl.float32)
    end = tl.minimum(share * SPAN + SPAN, B * Dq * Hq)
    for r0 in range(share * SPAN, end, ROWS // 2):
        rp = r0 + kp // 4
        rp_ok = rp < end
        zp = 2 * (rp // Hq % Dq) + kp // 2 % 2
        yp = 2 * (rp % Hq) + kp % 2
        plane = (rp // (Hq * Dq) * C + c).to(tl.int64) * D * H * W
        for x0 in range(0, W, PIX):
            a_ok = rp_ok[None, :] & (m < PIX)[:, None]
            pa, oka = _slice3d(g_ptr + plane[None, :], zp[None, :], a_ok, D, H * W)
            ga = _load2d(pa, yp[None, :], (x0 + m)[:, None], oka, H, W)
            pb, okb = _slice3d(src_ptr + plane[:, None], (zp + uz)[:, None], rp_ok[:, None], D, H * W)
            xb = _load2d(pb, (yp + uy)[:, None], (x0 - P + m)[None, :], okb, H, W)
            acc += tl.dot(ga, xb, input_precision=DOT)
            acc_bias += ga
    _store_diagonals(out_ptr + (tz * K + ty) * K, acc, K)
    if (tz == 0) & (ty == 0):
        tl.store(bias_ptr, tl.sum(tl.sum(acc_bias, axis=1), axis=0))


@triton.jit
def _wtconv3d_wgrad_kernel(
    # pointers: the output gradient dy and x [B, C, D, H, W]; the low-passes of levels 1..L-1 of dy and of x, one
    # after the other; output: partial sums (see ``_wgrad_finalize_kernel``)
    dy_ptr,
    x_ptr,
    glow_ptr,
    low_ptr,
    part_ptr,
    # sizes; SPAN: grid rows per share
    B,
    C,
    D,
    H,
    W,
    SPAN,
    LEVELS: tl.constexpr,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    DOT: tl.constexpr,
):
    """Weight gradients of every level (and of the base conv and bias) in one launch: program = (level, share, part,
    z tap, y tap, channel), see ``_wgrad_plan``; parts 0..3 are two sub-bands each, part 4 the base conv (level 1).
    Level 1 reads dy and x, deeper levels the low-pass buffers."""
    level, local, row0, off, d_in, h_in, w_in, rows = _wgrad_plan(
        tl.program_id(0), B, C, 5 * C * K * K, D, H, W, SPAN, LEVELS
    )
    c = local % C
    ty = local // C % K
    tz = local // (C * K) % K
    part = local // (C * K * K) % 5
    share = local // (5 * C * K * K)
    out = part_ptr + ((row0 + share) * C + c) * 8 * K * K * K
    if level == 1:
        Dq = (D + 1) // 2
        Hq = (H + 1) // 2
        if part < 4:
            _wgrad3d_bands(
                dy_ptr, x_ptr, out, c, tz, ty, part, share, C, B, D, H, W, Dq, Hq, (W + 1) // 2, SPAN, K, ROWS, DOT
            )
        else:
            base = part_ptr + rows * C * 8 * K * K * K
            shares = tl.cdiv(B * Dq * Hq, SPAN)
            _wgrad3d_base(
                dy_ptr, x_ptr, base + (share * C + c) * K * K * K, base + shares * C * K * K * K + share * C + c, c, tz,
                ty, share, C, B, D, H, W, Dq, Hq, SPAN, K, ROWS, DOT,
            )  # fmt: skip
    elif part < 4:
        _wgrad3d_bands(
            glow_ptr + off, low_ptr + off, out, c, tz, ty, part, share, C, B, d_in, h_in, w_in, (d_in + 1) // 2,
            (h_in + 1) // 2, (w_in + 1) // 2, SPAN, K, ROWS, DOT,
        )  # fmt: skip

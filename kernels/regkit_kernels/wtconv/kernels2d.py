"""Fused WTConv kernels, 2D. See ``ops.py`` for the algorithm; the building blocks are in ``_tile.py``.

The kernels read the layer's parameters as they are: each convolution's result is multiplied by its per-channel
scale (and, for the Haar levels, by the orthonormal factor 1/2, so that the butterflies stay unnormalised). Sizes are
run-time arguments, so one compilation serves every image size; only the kernel size, the number of levels and the
block sizes are compile-time constants.
"""

import triton
import triton.language as tl

from regkit_kernels.wtconv._tile import (
    _butterfly2d,
    _coarse_synthesis2d,
    _haar_block2d,
    _haar_conv2d,
    _load2d,
    _polyphase_conv2d,
    _store_blocks2d,
    _store_diagonals,
    _tile_coords,
    _wgrad_plan,
)


@triton.jit
def _store_bands2d(ptrs, size, e0, e1, e2, e3, ok):
    """Store four sub-band tiles ``size`` elements apart."""
    tl.store(ptrs, e0, mask=ok)
    tl.store(ptrs + size, e1, mask=ok)
    tl.store(ptrs + 2 * size, e2, mask=ok)
    tl.store(ptrs + 3 * size, e3, mask=ok)


@triton.jit
def _haar_lowpass2d_kernel(
    # pointers: a plane stack [B, C, H, W] and its raw Haar low-pass [B, C, Hq, Wq]
    src_ptr,
    low_ptr,
    # sizes
    B,
    C,
    H,
    W,
    Hq,
    Wq,
    BLOCK: tl.constexpr,
):
    """The orthonormal Haar low-pass (LL) of every 2 x 2 block, zero-padded on the far side of odd sizes."""
    _, plane, q, ok = _tile_coords(B, C, Hq * Wq, BLOCK)
    ll, _, _, _ = _haar_block2d(src_ptr + plane * H * W, 2 * (q // Wq), 2 * (q % Wq), ok, H, W)
    tl.store(low_ptr + plane * Hq * Wq + q, 0.5 * ll, mask=ok)


@triton.jit
def _wtconv2d_level_fwd_kernel(
    # pointers: the previous level's raw low-pass [B, C, H, W]; weights [C, 4, K*K] and scales [C, 4]; outputs: the
    # processed sub-bands Z [B, C, 4, Hq, Wq] and this level's raw low-pass [B, C, Hq, Wq] (the positions
    # q < low_size: all, or none at the deepest level)
    src_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    low_ptr,
    # sizes
    B,
    C,
    H,
    W,
    Hq,
    Wq,
    low_size,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One Haar level (2 and deeper): analysis of the low-pass recomputed on chip, fused with the depthwise conv."""
    c, plane, q, ok = _tile_coords(B, C, Hq * Wq, BLOCK)
    qy = q // Wq
    qx = q % Wq
    src = src_ptr + plane * H * W
    ll, _, _, _ = _haar_block2d(src, 2 * qy, 2 * qx, ok, H, W)
    tl.store(low_ptr + plane * Hq * Wq + q, 0.5 * ll, mask=ok & (q < low_size))
    z0, z1, z2, z3 = _haar_conv2d(src, w_ptr + c * 4 * K * K, s_ptr + c * 4, qy, qx, ok, H, W, K, 1)
    _store_bands2d(z_ptr + plane * 4 * Hq * Wq + q, Hq * Wq, z0, z1, z2, z3, ok)


@triton.jit
def _wtconv2d_fwd_kernel(
    # pointers: x and out [B, C, H, W]; base weights [C, K*K], bias [C] and scale [C]; level-1 weights [C, 4, K*K]
    # and scales [C, 4]; the processed sub-bands of levels 2..LEVELS, one after the other
    x_ptr,
    wb_ptr,
    bias_ptr,
    sb_ptr,
    w1_ptr,
    s1_ptr,
    coarse_ptr,
    out_ptr,
    # sizes; (H1, W1) is the level-1 grid, ceil(H / 2) x ceil(W / 2)
    B,
    C,
    H,
    W,
    H1,
    W1,
    LEVELS: tl.constexpr,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The output, one 2 x 2 block per level-1 position q: base conv + bias + synthesis of level 1 (computed here from
    x) and of the deeper levels (closed form), written once."""
    c, plane, q, ok = _tile_coords(B, C, H1 * W1, BLOCK)
    qy = q // W1
    qx = q % W1
    xs = x_ptr + plane * H * W
    z0, z1, z2, z3 = _haar_conv2d(xs, w1_ptr + c * 4 * K * K, s1_ptr + c * 4, qy, qx, ok, H, W, K, 1)
    z0 += _coarse_synthesis2d(coarse_ptr, plane, qy, qx, ok, B * C, H, W, LEVELS)
    r00, r01, r10, r11 = _butterfly2d(z0, z1, z2, z3)
    a00, a01, a10, a11 = _polyphase_conv2d(xs, wb_ptr + c * K * K, qy, qx, ok, H, W, K, 1)
    sb = tl.load(sb_ptr + c).to(tl.float32)
    bias = tl.load(bias_ptr + c).to(tl.float32) if HAS_BIAS else 0.0
    out = out_ptr + plane * H * W
    r00 = sb * (a00 + bias) + 0.5 * r00
    r01 = sb * (a01 + bias) + 0.5 * r01
    r10 = sb * (a10 + bias) + 0.5 * r10
    r11 = sb * (a11 + bias) + 0.5 * r11
    _store_blocks2d(out, r00, r01, r10, r11, qy, qx, ok, H, W)


@triton.jit
def _wtconv2d_level_bwd_kernel(
    # pointers: the output gradient's low-pass at the level's input [B, C, H, W]; weights [C, 4, K*K] and scales
    # [C, 4]; outputs: the gradient of the level's sub-bands [B, C, 4, Hq, Wq] and the output gradient's next
    # low-pass [B, C, Hq, Wq] (q < low_size, as in the forward)
    dsrc_ptr,
    w_ptr,
    s_ptr,
    dz_ptr,
    dlow_ptr,
    # sizes
    B,
    C,
    H,
    W,
    Hq,
    Wq,
    low_size,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Backward of one Haar level (2 and deeper): the gradient of its sub-bands, the adjoint conv of the level's output
    gradient, which is the Haar analysis of the output gradient's low-pass (the adjoint of the closed-form synthesis),
    recomputed on chip like the forward's sub-bands."""
    c, plane, q, ok = _tile_coords(B, C, Hq * Wq, BLOCK)
    qy = q // Wq
    qx = q % Wq
    dsrc = dsrc_ptr + plane * H * W
    ll, _, _, _ = _haar_block2d(dsrc, 2 * qy, 2 * qx, ok, H, W)
    tl.store(dlow_ptr + plane * Hq * Wq + q, 0.5 * ll, mask=ok & (q < low_size))
    e0, e1, e2, e3 = _haar_conv2d(dsrc, w_ptr + c * 4 * K * K, s_ptr + c * 4, qy, qx, ok, H, W, K, -1)
    _store_bands2d(dz_ptr + plane * 4 * Hq * Wq + q, Hq * Wq, e0, e1, e2, e3, ok)


@triton.jit
def _wtconv2d_bwd_kernel(
    # pointers: output gradient and input gradient [B, C, H, W]; base weights [C, K*K] and scale [C]; level-1
    # weights [C, 4, K*K] and scales [C, 4]; the sub-band gradients of levels 2..LEVELS one after the other
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
    H,
    W,
    H1,
    W1,
    LEVELS: tl.constexpr,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The input gradient, one 2 x 2 block per level-1 position: the adjoint base conv of the output gradient plus the
    synthesis of all levels' sub-band gradients (level 1's computed here), written once."""
    c, plane, q, ok = _tile_coords(B, C, H1 * W1, BLOCK)
    qy = q // W1
    qx = q % W1
    dys = dy_ptr + plane * H * W
    e0, e1, e2, e3 = _haar_conv2d(dys, w1_ptr + c * 4 * K * K, s1_ptr + c * 4, qy, qx, ok, H, W, K, -1)
    e0 += _coarse_synthesis2d(coarse_ptr, plane, qy, qx, ok, B * C, H, W, LEVELS)
    r00, r01, r10, r11 = _butterfly2d(e0, e1, e2, e3)
    a00, a01, a10, a11 = _polyphase_conv2d(dys, wb_ptr + c * K * K, qy, qx, ok, H, W, K, -1)
    sb = tl.load(sb_ptr + c).to(tl.float32)
    dx = dx_ptr + plane * H * W
    _store_blocks2d(
        dx, sb * a00 + 0.5 * r00, sb * a01 + 0.5 * r01, sb * a10 + 0.5 * r10, sb * a11 + 0.5 * r11, qy, qx, ok, H, W
    )


@triton.jit
def _wgrad2d_bands(
    g_ptr, src_ptr, out_ptr, c, ty, pair, share, C, B, H, W, Hq, Wq, SPAN,
    K: tl.constexpr, ROWS: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """Weight-gradient sums of sub-bands 2 * pair and 2 * pair + 1 of one level, tap row ``ty``, over one share (SPAN
    consecutive (batch item, y) rows of the level's grid) of channel c, as correlations by matrix products (see
    ``_tile.py``): ``G[b, ty, tx] = sum_q dZ_b(q) Y_b(q + u)`` with dZ and Y the unnormalised sub-bands of g and src,
    stored at ``out_ptr + b * K * K + ty * K + tx``. Two bands per program keep the registers below 255."""
    P: tl.constexpr = K // 2
    COLS: tl.constexpr = 32 - 2 * P  # level columns per block: the products' 32 columns cover them and the halo
    uy = ty - P
    m = tl.arange(0, 32)
    kr = tl.arange(0, ROWS)
    acc_a = tl.zeros([32, 32], tl.float32)
    acc_b = tl.zeros([32, 32], tl.float32)
    end = tl.minimum(share * SPAN + SPAN, B * Hq)
    for r0 in range(share * SPAN, end, ROWS):
        r = r0 + kr
        r_ok = r < end
        qy = r % Hq
        plane = (r // Hq * C + c).to(tl.int64) * H * W
        for q0 in range(0, Wq, COLS):
            # A = the gradient's sub-bands at columns q0 + m (m < COLS), B = the source's at q0 - P + n, rows + uy
            a_ok = r_ok[None, :] & (m < COLS)[:, None]
            d0, d1, d2, d3 = _haar_block2d(g_ptr + plane[None, :], 2 * qy[None, :], 2 * (q0 + m)[:, None], a_ok, H, W)
            y = 2 * (qy + uy)[:, None]
            u0, u1, u2, u3 = _haar_block2d(src_ptr + plane[:, None], y, 2 * (q0 - P + m)[None, :], r_ok[:, None], H, W)
            first = pair == 0
            acc_a += tl.dot(tl.where(first, d0, d2), tl.where(first, u0, u2), input_precision=DOT)
            acc_b += tl.dot(tl.where(first, d1, d3), tl.where(first, u1, u3), input_precision=DOT)
    out = out_ptr + 2 * pair * K * K + ty * K
    _store_diagonals(out, acc_a, K)
    _store_diagonals(out + K * K, acc_b, K)


@triton.jit
def _wgrad2d_base(
    g_ptr, src_ptr, out_ptr, bias_ptr, c, ty, share, C, B, H, W, Hq, SPAN,
    K: tl.constexpr, ROWS: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """The base conv's weight-gradient sums ``Gb[ty, tx] = sum_y g(y) src(y + u)`` (g = dy, src = x) over the pixel
    rows of one share of level-1 rows, stored at ``out_ptr + ty * K + tx``; for ty = 0 also ``sum_y g(y)`` at
    ``bias_ptr``."""
    P: tl.constexpr = K // 2
    PIX: tl.constexpr = 32 - 2 * P  # pixel columns per block
    uy = ty - P
    kp = tl.arange(0, 2 * ROWS)  # pixel rows: level row kp // 2, sub-row kp % 2
    m = tl.arange(0, 32)
    acc = tl.zeros([32, 32], tl.float32)
    acc_bias = tl.zeros([32, 2 * ROWS], tl.float32)
    end = tl.minimum(share * SPAN + SPAN, B * Hq)
    for r0 in range(share * SPAN, end, ROWS):
        rp = r0 + kp // 2
        rp_ok = rp < end
        yp = 2 * (rp % Hq) + kp % 2
        plane = (rp // Hq * C + c).to(tl.int64) * H * W
        for x0 in range(0, W, PIX):
            a_ok = rp_ok[None, :] & (m < PIX)[:, None]
            ga = _load2d(g_ptr + plane[None, :], yp[None, :], (x0 + m)[:, None], a_ok, H, W)
            xb = _load2d(src_ptr + plane[:, None], (yp + uy)[:, None], (x0 - P + m)[None, :], rp_ok[:, None], H, W)
            acc += tl.dot(ga, xb, input_precision=DOT)
            acc_bias += ga
    _store_diagonals(out_ptr + ty * K, acc, K)
    if ty == 0:
        tl.store(bias_ptr, tl.sum(tl.sum(acc_bias, axis=1), axis=0))


@triton.jit
def _wtconv2d_wgrad_kernel(
    # pointers: the output gradient dy and x [B, C, H, W]; the low-passes of levels 1..L-1 of dy and of x, one after
    # the other; output: partial sums (see ``_wgrad_finalize_kernel``)
    dy_ptr,
    x_ptr,
    glow_ptr,
    low_ptr,
    part_ptr,
    # sizes; SPAN: grid rows per share
    B,
    C,
    H,
    W,
    SPAN,
    LEVELS: tl.constexpr,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    DOT: tl.constexpr,
):
    """Weight gradients of every level (and of the base conv and bias) in one launch: program = (level, share, part,
    tap row, channel), see ``_wgrad_plan``; parts 0 and 1 are two sub-bands each, part 2 the base conv (level 1;
    deeper levels have nothing to do there). Level 1 reads dy and x, deeper levels the low-pass buffers."""
    level, local, row0, off, _, h_in, w_in, rows = _wgrad_plan(tl.program_id(0), B, C, 3 * C * K, 1, H, W, SPAN, LEVELS)
    c = local % C
    ty = local // C % K
    part = local // (C * K) % 3
    share = local // (3 * C * K)
    out = part_ptr + ((row0 + share) * C + c) * 4 * K * K
    if level == 1:
        Hq = (H + 1) // 2
        if part < 2:
            _wgrad2d_bands(dy_ptr, x_ptr, out, c, ty, part, share, C, B, H, W, Hq, (W + 1) // 2, SPAN, K, ROWS, DOT)
        else:
            base = part_ptr + rows * C * 4 * K * K
            shares = tl.cdiv(B * Hq, SPAN)
            _wgrad2d_base(
                dy_ptr, x_ptr, base + (share * C + c) * K * K, base + shares * C * K * K + share * C + c, c, ty,
                share, C, B, H, W, Hq, SPAN, K, ROWS, DOT,
            )  # fmt: skip
    elif part < 2:
        _wgrad2d_bands(
            glow_ptr + off, low_ptr + off, out, c, ty, part, share, C, B, h_in, w_in, (h_in + 1) // 2,
            (w_in + 1) // 2, SPAN, K, ROWS, DOT,
        )  # fmt: skip

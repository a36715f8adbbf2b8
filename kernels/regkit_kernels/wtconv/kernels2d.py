"""Fused WTConv kernels, 2D. See ``ops.py`` for the algorithm; the building blocks are in ``_tile.py``.

The kernels read the layer's parameters as they are: each convolution's result is multiplied by its per-channel
scale (and, for the Haar levels, by the orthonormal factor 1/2, so that the butterflies stay unnormalised). Sizes are
run-time arguments, so one compilation serves every image size; only the kernel size, the number of levels and the
block sizes are compile-time constants.
"""

import triton
import triton.language as tl

from regkit_kernels.wtconv._tile import (
    _block_at,
    _butterfly2d,
    _coarse_synthesis2d,
    _divmod,
    _haar_block2d,
    _haar_conv2d,
    _polyphase_conv2d,
    _store_blocks2d,
    _tile_coords,
    _wgrad_plan,
    _within,
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
def _wgrad2d_level(
    g_ptr, src_ptr, part_ptr, c, share, row, C, B, H, W, Hq, Wq, base_off, SPAN,
    K: tl.constexpr, BASE: tl.constexpr, TAPS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One level's weight-gradient sums over one share (SPAN consecutive (batch item, position) pairs) of channel c:
    tile [TAPS, BLOCK] = every tap x BLOCK positions, products accumulated in registers and summed once.

    ``G[b, t] = sum_q dZ_b(q) Y_b(q + u_t)`` with dZ and Y the unnormalised sub-bands of g and src, into partial row
    ``row``; with BASE (level 1, src = x, g = dy) also ``Gb[t] = sum_y g(y) src(y + u_t)`` and ``sum_y g(y)`` into the
    base rows (at ``base_off``). A position's pointer is computed once per step and every tap adds a constant offset
    (``2 u`` blocks for the sub-bands, ``u`` pixels for the base); the bounds are unsigned comparisons of the shifted
    coordinates."""
    P: tl.constexpr = K // 2
    KK: tl.constexpr = K * K
    t = tl.arange(0, TAPS)
    uy = (t // K - P)[:, None]
    ux = (t % K - P)[:, None]
    tap_ok = (t < KK)[:, None]
    band_off = 2 * uy * W + 2 * ux
    base_shift = uy * W + ux
    H2 = H // 2  # blocks whose lower row lies inside the plane (the upper row of a block at q < Hq always does)
    W2 = W // 2
    acc0 = tl.zeros([TAPS, BLOCK], tl.float32)
    acc1 = tl.zeros([TAPS, BLOCK], tl.float32)
    acc2 = tl.zeros([TAPS, BLOCK], tl.float32)
    acc3 = tl.zeros([TAPS, BLOCK], tl.float32)
    acc_base = tl.zeros([TAPS, BLOCK], tl.float32)
    acc_bias = tl.zeros([1, BLOCK], tl.float32)
    Q = Hq * Wq
    inv_q = 1.0 / tl.cast(Q, tl.float32)
    inv_w = 1.0 / tl.cast(Wq, tl.float32)
    end = tl.minimum(share * SPAN + SPAN, B * Q)
    for start in range(share * SPAN, end, BLOCK):
        n = start + tl.arange(0, BLOCK)[None, :]
        ok = n < end
        b, q = _divmod(n, Q, inv_q)
        qy, qx = _divmod(q, Wq, inv_w)
        pos = (b * C + c).to(tl.int64) * H * W + (2 * qy * W + 2 * qx)
        g00, g01, g10, g11 = _block_at(g_ptr + pos, W, ok, ok & (qy < H2), True, qx < W2)
        d0, d1, d2, d3 = _butterfly2d(g00, g01, g10, g11)
        src = src_ptr + pos
        vy = qy + uy
        vx = qx + ux
        ok_t = ok & tap_ok
        s00, s01, s10, s11 = _block_at(
            src + band_off, W, ok_t & _within(vy, Hq), ok_t & _within(vy, H2), _within(vx, Wq), _within(vx, W2)
        )
        ll, lh, hl, hh = _butterfly2d(s00, s01, s10, s11)
        acc0 += d0 * ll
        acc1 += d1 * lh
        acc2 += d2 * hl
        acc3 += d3 * hh
        if BASE:
            y = 2 * qy + uy
            x = 2 * qx + ux
            a, bb, cc, d = _block_at(
                src + base_shift, W, ok_t & _within(y, H), ok_t & _within(y + 1, H), _within(x, W), _within(x + 1, W)
            )
            acc_base += g00 * a + g01 * bb + g10 * cc + g11 * d
            acc_bias += g00 + g01 + g10 + g11
    t_ok = t < KK
    out = part_ptr + (row * C + c) * 4 * KK + t
    tl.store(out, tl.sum(acc0, axis=1), mask=t_ok)
    tl.store(out + KK, tl.sum(acc1, axis=1), mask=t_ok)
    tl.store(out + 2 * KK, tl.sum(acc2, axis=1), mask=t_ok)
    tl.store(out + 3 * KK, tl.sum(acc3, axis=1), mask=t_ok)
    if BASE:
        shares1 = tl.cdiv(B * Q, SPAN)
        tl.store(part_ptr + base_off + (share * C + c) * KK + t, tl.sum(acc_base, axis=1), mask=t_ok)
        bias_sum = tl.sum(acc_bias, axis=1)  # [1]
        tl.store(part_ptr + base_off + shares1 * C * KK + share * C + c + tl.arange(0, 1), bias_sum)


@triton.jit
def _wtconv2d_wgrad_kernel(
    # pointers: the output gradient dy and x [B, C, H, W]; the low-passes of levels 1..L-1 of dy and of x, one after
    # the other; output: partial sums (see ``_wgrad_finalize_kernel``)
    dy_ptr,
    x_ptr,
    glow_ptr,
    low_ptr,
    part_ptr,
    # sizes
    B,
    C,
    H,
    W,
    SPAN,
    LEVELS: tl.constexpr,
    K: tl.constexpr,
    TAPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Weight gradients of every level (and of the base conv and bias) in one launch: program = (level, share,
    channel), see ``_wgrad_plan``. Level 1 reads dy and x, deeper levels the low-pass buffers."""
    level, local, row0, off, _, h_in, w_in, rows = _wgrad_plan(tl.program_id(0), B, C, C, 1, H, W, SPAN, LEVELS)
    c = local % C
    share = local // C
    base_off = rows * C * 4 * K * K
    if level == 1:
        _wgrad2d_level(
            dy_ptr, x_ptr, part_ptr, c, share, row0 + share, C, B, H, W, (H + 1) // 2, (W + 1) // 2, base_off, SPAN,
            K, True, TAPS, BLOCK,
        )  # fmt: skip
    else:
        _wgrad2d_level(
            glow_ptr + off, low_ptr + off, part_ptr, c, share, row0 + share, C, B, h_in, w_in, (h_in + 1) // 2,
            (w_in + 1) // 2, base_off, SPAN, K, False, TAPS, BLOCK,
        )  # fmt: skip

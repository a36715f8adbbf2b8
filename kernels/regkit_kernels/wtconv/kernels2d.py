"""Fused WTConv kernels, 2D. See ``ops.py`` for the algorithm; the building blocks are in ``_tile.py``.

Weights arrive folded: the per-channel scales multiplied in, and the Haar levels' kernels also by 1/2 (the orthonormal
Haar factor, so that the kernels use unnormalised butterflies). Sizes are run-time arguments, so one compilation
serves every image size; only the kernel size, the number of levels and the block size are compile-time constants.
"""

import triton
import triton.language as tl

from regkit_kernels.wtconv._tile import (
    _block2d,
    _butterfly2d,
    _coarse_synthesis2d,
    _haar_block2d,
    _haar_conv2d,
    _polyphase_conv2d,
    _store_blocks2d,
    _tile_coords,
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
    # pointers: the previous level's raw low-pass [B, C, H, W]; weights [C, 4, K*K]; outputs: the processed sub-bands
    # Z [B, C, 4, Hq, Wq] and this level's raw low-pass [B, C, Hq, Wq] (the positions q < low_size: all, or none at
    # the deepest level)
    src_ptr,
    w_ptr,
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
    z0, z1, z2, z3 = _haar_conv2d(src, w_ptr + c * 4 * K * K, qy, qx, ok, H, W, K, 1)
    _store_bands2d(z_ptr + plane * 4 * Hq * Wq + q, Hq * Wq, z0, z1, z2, z3, ok)


@triton.jit
def _wtconv2d_fwd_kernel(
    # pointers: x and out [B, C, H, W]; base weights [C, K*K] and bias [C]; level-1 weights [C, 4, K*K];
    # the processed sub-bands of levels 2..LEVELS, one after the other
    x_ptr,
    wb_ptr,
    bias_ptr,
    w1_ptr,
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
    BLOCK: tl.constexpr,
):
    """The output, one 2 x 2 block per level-1 position q: base conv + bias + synthesis of level 1 (computed here from
    x) and of the deeper levels (closed form), written once."""
    c, plane, q, ok = _tile_coords(B, C, H1 * W1, BLOCK)
    qy = q // W1
    qx = q % W1
    xs = x_ptr + plane * H * W
    z0, z1, z2, z3 = _haar_conv2d(xs, w1_ptr + c * 4 * K * K, qy, qx, ok, H, W, K, 1)
    z0 += _coarse_synthesis2d(coarse_ptr, plane, qy, qx, ok, B * C, H, W, LEVELS)
    r00, r01, r10, r11 = _butterfly2d(z0, z1, z2, z3)
    a00, a01, a10, a11 = _polyphase_conv2d(xs, wb_ptr + c * K * K, qy, qx, ok, H, W, K, 1)
    bias = tl.load(bias_ptr + c)
    out = out_ptr + plane * H * W
    r00 = a00 + bias + 0.5 * r00
    r01 = a01 + bias + 0.5 * r01
    r10 = a10 + bias + 0.5 * r10
    r11 = a11 + bias + 0.5 * r11
    _store_blocks2d(out, r00, r01, r10, r11, qy, qx, ok, H, W)


@triton.jit
def _wtconv2d_level_bwd_kernel(
    # pointers: the output gradient's low-pass at the level's input [B, C, H, W]; weights [C, 4, K*K]; outputs: the
    # gradient of the level's sub-bands [B, C, 4, Hq, Wq] and the output gradient's next low-pass [B, C, Hq, Wq]
    # (q < low_size, as in the forward)
    dsrc_ptr,
    w_ptr,
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
    e0, e1, e2, e3 = _haar_conv2d(dsrc, w_ptr + c * 4 * K * K, qy, qx, ok, H, W, K, -1)
    _store_bands2d(dz_ptr + plane * 4 * Hq * Wq + q, Hq * Wq, e0, e1, e2, e3, ok)


@triton.jit
def _wtconv2d_bwd_kernel(
    # pointers: output gradient, x and input gradient [B, C, H, W]; base weights [C, K*K]; level-1 weights
    # [C, 4, K*K]; the sub-band gradients of levels 2..LEVELS one after the other
    dy_ptr,
    wb_ptr,
    w1_ptr,
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
    e0, e1, e2, e3 = _haar_conv2d(dys, w1_ptr + c * 4 * K * K, qy, qx, ok, H, W, K, -1)
    e0 += _coarse_synthesis2d(coarse_ptr, plane, qy, qx, ok, B * C, H, W, LEVELS)
    r00, r01, r10, r11 = _butterfly2d(e0, e1, e2, e3)
    a00, a01, a10, a11 = _polyphase_conv2d(dys, wb_ptr + c * K * K, qy, qx, ok, H, W, K, -1)
    dx = dx_ptr + plane * H * W
    _store_blocks2d(dx, a00 + 0.5 * r00, a01 + 0.5 * r01, a10 + 0.5 * r10, a11 + 0.5 * r11, qy, qx, ok, H, W)


@triton.jit
def _wtconv2d_wgrad_kernel(
    # pointers: at one level's input, the output gradient's low-pass (dy itself for level 1) and the raw low-pass
    # (x for level 1) [B, C, H, W]; outputs, partial sums over this program's share of the positions: the level's
    # weight gradient [SPLIT, C, 4, K*K] and, with BASE, the base weights' [SPLIT, C, K*K] and the bias's [SPLIT, C]
    g_ptr,
    src_ptr,
    dw_ptr,
    dwb_ptr,
    dbias_ptr,
    # sizes
    B,
    C,
    H,
    W,
    Hq,
    Wq,
    K: tl.constexpr,
    BASE: tl.constexpr,
    TAPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Weight gradients of one level (and, with BASE, of the base conv and bias) for one channel and one share of its
    (batch item, position) pairs: tile [TAPS, BLOCK] = every tap x BLOCK positions, products accumulated in registers
    over the whole share and summed once, so there are neither atomics nor per-tile reductions.

    ``dw[b, t] = sum_q dZ_b(q) Y_b(q + u_t)`` with dZ and Y the unnormalised sub-bands of g and src (the caller applies
    the two orthonormal factors); ``dwb[t] = sum_y g(y) src(y + u_t)``; ``dbias = sum_y g(y)``."""
    P: tl.constexpr = K // 2
    KK: tl.constexpr = K * K
    c = tl.program_id(0) % C
    share = tl.program_id(0) // C
    shares = tl.num_programs(0) // C
    t = tl.arange(0, TAPS)
    uy = (t // K - P)[:, None]
    ux = (t % K - P)[:, None]
    tap_ok = (t < KK)[:, None]
    acc0 = tl.zeros([TAPS, BLOCK], tl.float32)
    acc1 = tl.zeros([TAPS, BLOCK], tl.float32)
    acc2 = tl.zeros([TAPS, BLOCK], tl.float32)
    acc3 = tl.zeros([TAPS, BLOCK], tl.float32)
    acc_base = tl.zeros([TAPS, BLOCK], tl.float32)
    acc_bias = tl.zeros([1, BLOCK], tl.float32)
    Q = Hq * Wq
    for start in range(share * BLOCK, B * Q, shares * BLOCK):
        n = start + tl.arange(0, BLOCK)[None, :]
        ok = n < B * Q
        q = n % Q
        qy = q // Wq
        qx = q % Wq
        plane = (n // Q * C + c).to(tl.int64) * H * W
        g00, g01, g10, g11 = _block2d(g_ptr + plane, 2 * qy, 2 * qx, ok, H, W)
        d0, d1, d2, d3 = _butterfly2d(g00, g01, g10, g11)
        src = src_ptr + plane
        ll, lh, hl, hh = _haar_block2d(src, 2 * (qy + uy), 2 * (qx + ux), ok & tap_ok, H, W)
        acc0 += d0 * ll
        acc1 += d1 * lh
        acc2 += d2 * hl
        acc3 += d3 * hh
        if BASE:
            a, b, cc, d = _block2d(src, 2 * qy + uy, 2 * qx + ux, ok & tap_ok, H, W)
            acc_base += g00 * a + g01 * b + g10 * cc + g11 * d
            acc_bias += g00 + g01 + g10 + g11
    out = share * C + c
    t_ok = t < KK
    tl.store(dw_ptr + out * 4 * KK + t, tl.sum(acc0, axis=1), mask=t_ok)
    tl.store(dw_ptr + out * 4 * KK + KK + t, tl.sum(acc1, axis=1), mask=t_ok)
    tl.store(dw_ptr + out * 4 * KK + 2 * KK + t, tl.sum(acc2, axis=1), mask=t_ok)
    tl.store(dw_ptr + out * 4 * KK + 3 * KK + t, tl.sum(acc3, axis=1), mask=t_ok)
    if BASE:
        tl.store(dwb_ptr + out * KK + t, tl.sum(acc_base, axis=1), mask=t_ok)
        tl.store(dbias_ptr + out, tl.sum(tl.sum(acc_bias, axis=1), axis=0))

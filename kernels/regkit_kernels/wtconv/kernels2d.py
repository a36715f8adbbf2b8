"""Fused WTConv kernels, 2D. See ``ops.py`` for the algorithm; the building blocks are in ``_tile.py``.

Weights arrive folded: the per-channel scales multiplied in, and the Haar levels' kernels also by 1/2 (the orthonormal
Haar factor, so that the kernels use unnormalised butterflies). Sizes are run-time arguments, so one compilation
serves every image size; only the kernel size, the number of levels and the block sizes are compile-time constants.
"""

import triton
import triton.language as tl

from regkit_kernels.wtconv._tile import (
    _butterfly2d,
    _coarse_synthesis2d,
    _haar_block2d,
    _haar_conv2d,
    _haar_corr2d,
    _load2d,
    _polyphase_conv2d,
    _polyphase_corr2d,
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
    BLOCK_B: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """The orthonormal Haar low-pass (LL) of every 2 x 2 block, zero-padded on the far side of odd sizes."""
    b, c, q = _tile_coords(B, C, tl.cdiv(Hq * Wq, BLOCK_Q), BLOCK_B, BLOCK_Q)
    ok = (b < B)[:, None] & (q < Hq * Wq)[None, :]
    plane = (b * C + c).to(tl.int64)
    ll, _, _, _ = _haar_block2d(src_ptr + (plane * H * W)[:, None], 2 * (q // Wq), 2 * (q % Wq), ok, H, W)
    out = low_ptr + (plane * Hq * Wq)[:, None] + q[None, :]
    tl.store(out, 0.5 * ll, mask=ok)


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
    BLOCK_B: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """One Haar level (2 and deeper): analysis of the low-pass recomputed on chip, fused with the depthwise conv."""
    b, c, q = _tile_coords(B, C, tl.cdiv(Hq * Wq, BLOCK_Q), BLOCK_B, BLOCK_Q)
    ok = (b < B)[:, None] & (q < Hq * Wq)[None, :]
    qy = q // Wq
    qx = q % Wq
    plane = (b * C + c).to(tl.int64)
    src = src_ptr + (plane * H * W)[:, None]
    ll, _, _, _ = _haar_block2d(src, 2 * qy, 2 * qx, ok, H, W)
    tl.store(low_ptr + (plane * Hq * Wq)[:, None] + q[None, :], 0.5 * ll, mask=ok & (q < low_size)[None, :])
    z0, z1, z2, z3 = _haar_conv2d(src, w_ptr + c * 4 * K * K, qy, qx, ok, H, W, K, 1)
    _store_bands2d(z_ptr + (plane * 4 * Hq * Wq)[:, None] + q[None, :], Hq * Wq, z0, z1, z2, z3, ok)


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
    BLOCK_B: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """The output, one 2 x 2 block per level-1 position q: base conv + bias + synthesis of level 1 (computed here from
    x) and of the deeper levels (closed form), written once."""
    b, c, q = _tile_coords(B, C, tl.cdiv(H1 * W1, BLOCK_Q), BLOCK_B, BLOCK_Q)
    ok = (b < B)[:, None] & (q < H1 * W1)[None, :]
    qy = q // W1
    qx = q % W1
    plane = (b * C + c).to(tl.int64)
    xs = x_ptr + (plane * H * W)[:, None]
    z0, z1, z2, z3 = _haar_conv2d(xs, w1_ptr + c * 4 * K * K, qy, qx, ok, H, W, K, 1)
    z0 += _coarse_synthesis2d(coarse_ptr, plane, qy, qx, ok, B * C, H, W, LEVELS)
    r00, r01, r10, r11 = _butterfly2d(z0, z1, z2, z3)
    a00, a01, a10, a11 = _polyphase_conv2d(xs, wb_ptr + c * K * K, qy, qx, ok, H, W, K, 1)
    bias = tl.load(bias_ptr + c)
    _store_blocks2d(
        out_ptr + (plane * H * W)[:, None],
        a00 + bias + 0.5 * r00,
        a01 + bias + 0.5 * r01,
        a10 + bias + 0.5 * r10,
        a11 + bias + 0.5 * r11,
        qy,
        qx,
        ok,
        H,
        W,
    )


@triton.jit
def _wtconv2d_level_bwd_kernel(
    # pointers: the output gradient's low-pass and the raw low-pass at the level's input [B, C, H, W]; weights
    # [C, 4, K*K]; outputs: the gradient of the level's sub-bands [B, C, 4, Hq, Wq], the output gradient's next
    # low-pass [B, C, Hq, Wq] (q < low_size, as in the forward) and the weight gradient [C, 4, K*K] (added)
    dsrc_ptr,
    src_ptr,
    w_ptr,
    dz_ptr,
    dlow_ptr,
    dw_ptr,
    # sizes
    B,
    C,
    H,
    W,
    Hq,
    Wq,
    low_size,
    K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """Backward of one Haar level (2 and deeper): the level's output gradient is the Haar analysis of the output
    gradient's low-pass (the adjoint of the closed-form synthesis), recomputed on chip like the forward's sub-bands."""
    b, c, q = _tile_coords(B, C, tl.cdiv(Hq * Wq, BLOCK_Q), BLOCK_B, BLOCK_Q)
    ok = (b < B)[:, None] & (q < Hq * Wq)[None, :]
    qy = q // Wq
    qx = q % Wq
    plane = (b * C + c).to(tl.int64)
    dsrc = dsrc_ptr + (plane * H * W)[:, None]
    g0, g1, g2, g3 = _haar_block2d(dsrc, 2 * qy, 2 * qx, ok, H, W)
    tl.store(dlow_ptr + (plane * Hq * Wq)[:, None] + q[None, :], 0.5 * g0, mask=ok & (q < low_size)[None, :])
    _haar_corr2d(src_ptr + (plane * H * W)[:, None], g0, g1, g2, g3, dw_ptr + c * 4 * K * K, qy, qx, ok, H, W, K)
    e0, e1, e2, e3 = _haar_conv2d(dsrc, w_ptr + c * 4 * K * K, qy, qx, ok, H, W, K, -1)
    _store_bands2d(dz_ptr + (plane * 4 * Hq * Wq)[:, None] + q[None, :], Hq * Wq, e0, e1, e2, e3, ok)


@triton.jit
def _wtconv2d_bwd_kernel(
    # pointers: output gradient, x and input gradient [B, C, H, W]; base weights [C, K*K]; level-1 weights
    # [C, 4, K*K]; the sub-band gradients of levels 2..LEVELS one after the other; weight and bias gradients
    dy_ptr,
    x_ptr,
    wb_ptr,
    w1_ptr,
    coarse_ptr,
    dx_ptr,
    dwb_ptr,
    dbias_ptr,
    dw1_ptr,
    # sizes
    B,
    C,
    H,
    W,
    H1,
    W1,
    LEVELS: tl.constexpr,
    K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """Backward of the base conv and level 1, and the input gradient, one 2 x 2 block per level-1 position: the weight
    gradients from products of the output gradient with x (the Haar sub-bands of both recomputed on chip), then the
    input gradient as the adjoint conv of the output gradient plus the synthesis of all levels' sub-band gradients."""
    b, c, q = _tile_coords(B, C, tl.cdiv(H1 * W1, BLOCK_Q), BLOCK_B, BLOCK_Q)
    ok = (b < B)[:, None] & (q < H1 * W1)[None, :]
    qy = q // W1
    qx = q % W1
    plane = (b * C + c).to(tl.int64)
    dys = dy_ptr + (plane * H * W)[:, None]
    xs = x_ptr + (plane * H * W)[:, None]
    g00 = _load2d(dys, 2 * qy, 2 * qx, ok, H, W)
    g01 = _load2d(dys, 2 * qy, 2 * qx + 1, ok, H, W)
    g10 = _load2d(dys, 2 * qy + 1, 2 * qx, ok, H, W)
    g11 = _load2d(dys, 2 * qy + 1, 2 * qx + 1, ok, H, W)
    tl.atomic_add(dbias_ptr + c, tl.sum(tl.sum(g00 + g01 + g10 + g11, axis=1), axis=0), sem="relaxed")
    _polyphase_corr2d(xs, g00, g01, g10, g11, dwb_ptr + c * K * K, qy, qx, ok, H, W, K)
    g0, g1, g2, g3 = _butterfly2d(g00, g01, g10, g11)
    _haar_corr2d(xs, g0, g1, g2, g3, dw1_ptr + c * 4 * K * K, qy, qx, ok, H, W, K)

    e0, e1, e2, e3 = _haar_conv2d(dys, w1_ptr + c * 4 * K * K, qy, qx, ok, H, W, K, -1)
    e0 += _coarse_synthesis2d(coarse_ptr, plane, qy, qx, ok, B * C, H, W, LEVELS)
    r00, r01, r10, r11 = _butterfly2d(e0, e1, e2, e3)
    a00, a01, a10, a11 = _polyphase_conv2d(dys, wb_ptr + c * K * K, qy, qx, ok, H, W, K, -1)
    _store_blocks2d(
        dx_ptr + (plane * H * W)[:, None],
        a00 + 0.5 * r00,
        a01 + 0.5 * r01,
        a10 + 0.5 * r10,
        a11 + 0.5 * r11,
        qy,
        qx,
        ok,
        H,
        W,
    )

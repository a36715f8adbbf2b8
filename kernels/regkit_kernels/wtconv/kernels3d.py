"""Fused WTConv kernels, 3D: the 2D kernels (``kernels2d.py``) with eight sub-bands and 2 x 2 x 2 blocks.

Weights arrive folded (scales multiplied in; the Haar levels' kernels also by 2**(-3/2)). Sizes are run-time
arguments; the z taps are a loop rather than unrolled, which keeps compile time low for k = 7.
"""

import triton
import triton.language as tl

from regkit_kernels.wtconv._tile import (
    _butterfly3d,
    _coarse_synthesis3d,
    _haar_block3d,
    _haar_conv3d,
    _haar_corr3d,
    _load2d,
    _polyphase_conv3d,
    _polyphase_corr3d,
    _slice3d,
    _store_blocks3d,
    _tile_coords,
    _tile_sum,
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
    BLOCK_B: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """The orthonormal Haar low-pass (LLL) of every 2 x 2 x 2 block, zero-padded on the far side of odd sizes."""
    size = Dq * Hq * Wq
    b, c, q = _tile_coords(B, C, tl.cdiv(size, BLOCK_Q), BLOCK_B, BLOCK_Q)
    ok = (b < B)[:, None] & (q < size)[None, :]
    qz, qy, qx = _grid_coords3d(q, Hq, Wq)
    plane = (b * C + c).to(tl.int64)
    ll, _, _, _, _, _, _, _ = _haar_block3d(src_ptr + (plane * D * H * W)[:, None], 2 * qz, 2 * qy, 2 * qx, ok, D, H, W)
    out = low_ptr + (plane * size)[:, None] + q[None, :]
    tl.store(out, ll * _R3, mask=ok)


@triton.jit
def _wtconv3d_level_fwd_kernel(
    # pointers: the previous level's raw low-pass [B, C, D, H, W]; weights [C, 8, K**3]; outputs: the processed
    # sub-bands Z [B, C, 8, Dq, Hq, Wq] and this level's raw low-pass [B, C, Dq, Hq, Wq] (q < low_size: all or none)
    src_ptr,
    w_ptr,
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
    BLOCK_B: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """One Haar level (2 and deeper): analysis recomputed on chip, fused with the depthwise conv."""
    size = Dq * Hq * Wq
    b, c, q = _tile_coords(B, C, tl.cdiv(size, BLOCK_Q), BLOCK_B, BLOCK_Q)
    ok = (b < B)[:, None] & (q < size)[None, :]
    qz, qy, qx = _grid_coords3d(q, Hq, Wq)
    plane = (b * C + c).to(tl.int64)
    src = src_ptr + (plane * D * H * W)[:, None]
    ll, _, _, _, _, _, _, _ = _haar_block3d(src, 2 * qz, 2 * qy, 2 * qx, ok, D, H, W)
    tl.store(low_ptr + (plane * size)[:, None] + q[None, :], ll * _R3, mask=ok & (q < low_size)[None, :])
    z0, z1, z2, z3, z4, z5, z6, z7 = _haar_conv3d(src, w_ptr + c * 8 * K * K * K, qz, qy, qx, ok, D, H, W, K, 1)
    _store_bands3d(z_ptr + (plane * 8 * size)[:, None] + q[None, :], size, z0, z1, z2, z3, z4, z5, z6, z7, ok)


@triton.jit
def _wtconv3d_fwd_kernel(
    # pointers: x and out [B, C, D, H, W]; base weights [C, K**3] and bias [C]; level-1 weights [C, 8, K**3];
    # the processed sub-bands of levels 2..LEVELS, one after the other
    x_ptr,
    wb_ptr,
    bias_ptr,
    w1_ptr,
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
    BLOCK_B: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """The output, one 2 x 2 x 2 block per level-1 position (see the 2D kernel)."""
    size = D1 * H1 * W1
    b, c, q = _tile_coords(B, C, tl.cdiv(size, BLOCK_Q), BLOCK_B, BLOCK_Q)
    ok = (b < B)[:, None] & (q < size)[None, :]
    qz, qy, qx = _grid_coords3d(q, H1, W1)
    plane = (b * C + c).to(tl.int64)
    xs = x_ptr + (plane * D * H * W)[:, None]
    z0, z1, z2, z3, z4, z5, z6, z7 = _haar_conv3d(xs, w1_ptr + c * 8 * K * K * K, qz, qy, qx, ok, D, H, W, K, 1)
    z0 += _coarse_synthesis3d(coarse_ptr, plane, qz, qy, qx, ok, B * C, D, H, W, LEVELS)
    r0, r1, r2, r3, r4, r5, r6, r7 = _butterfly3d(z0, z1, z2, z3, z4, z5, z6, z7)
    a0, a1, a2, a3, a4, a5, a6, a7 = _polyphase_conv3d(xs, wb_ptr + c * K * K * K, qz, qy, qx, ok, D, H, W, K, 1)
    bias = tl.load(bias_ptr + c)
    _store_blocks3d(
        out_ptr + (plane * D * H * W)[:, None],
        a0 + bias + r0 * _R3,
        a1 + bias + r1 * _R3,
        a2 + bias + r2 * _R3,
        a3 + bias + r3 * _R3,
        a4 + bias + r4 * _R3,
        a5 + bias + r5 * _R3,
        a6 + bias + r6 * _R3,
        a7 + bias + r7 * _R3,
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
    # pointers: the output gradient's low-pass and the raw low-pass at the level's input [B, C, D, H, W]; weights
    # [C, 8, K**3]; outputs: the level's sub-band gradient [B, C, 8, Dq, Hq, Wq], the output gradient's next low-pass
    # [B, C, Dq, Hq, Wq] (q < low_size: all or none) and the weight gradient [C, 8, K**3] (added)
    dsrc_ptr,
    src_ptr,
    w_ptr,
    dz_ptr,
    dlow_ptr,
    dw_ptr,
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
    BLOCK_B: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """Backward of one Haar level (2 and deeper); see the 2D kernel."""
    size = Dq * Hq * Wq
    b, c, q = _tile_coords(B, C, tl.cdiv(size, BLOCK_Q), BLOCK_B, BLOCK_Q)
    ok = (b < B)[:, None] & (q < size)[None, :]
    qz, qy, qx = _grid_coords3d(q, Hq, Wq)
    plane = (b * C + c).to(tl.int64)
    dsrc = dsrc_ptr + (plane * D * H * W)[:, None]
    g0, g1, g2, g3, g4, g5, g6, g7 = _haar_block3d(dsrc, 2 * qz, 2 * qy, 2 * qx, ok, D, H, W)
    tl.store(dlow_ptr + (plane * size)[:, None] + q[None, :], g0 * _R3, mask=ok & (q < low_size)[None, :])
    _haar_corr3d(
        src_ptr + (plane * D * H * W)[:, None], g0, g1, g2, g3, g4, g5, g6, g7, dw_ptr + c * 8 * K * K * K,
        qz, qy, qx, ok, D, H, W, K,
    )  # fmt: skip
    e0, e1, e2, e3, e4, e5, e6, e7 = _haar_conv3d(dsrc, w_ptr + c * 8 * K * K * K, qz, qy, qx, ok, D, H, W, K, -1)
    _store_bands3d(dz_ptr + (plane * 8 * size)[:, None] + q[None, :], size, e0, e1, e2, e3, e4, e5, e6, e7, ok)


@triton.jit
def _wtconv3d_bwd_kernel(
    # pointers: output gradient, x and input gradient [B, C, D, H, W]; base weights [C, K**3]; level-1 weights
    # [C, 8, K**3]; the sub-band gradients of levels 2..LEVELS one after the other; weight and bias gradients
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
    D,
    H,
    W,
    D1,
    H1,
    W1,
    LEVELS: tl.constexpr,
    K: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """Backward of the base conv and level 1, and the input gradient; see the 2D kernel."""
    size = D1 * H1 * W1
    b, c, q = _tile_coords(B, C, tl.cdiv(size, BLOCK_Q), BLOCK_B, BLOCK_Q)
    ok = (b < B)[:, None] & (q < size)[None, :]
    qz, qy, qx = _grid_coords3d(q, H1, W1)
    plane = (b * C + c).to(tl.int64)
    dys = dy_ptr + (plane * D * H * W)[:, None]
    xs = x_ptr + (plane * D * H * W)[:, None]
    p0, ok0 = _slice3d(dys, 2 * qz, ok, D, H * W)
    p1, ok1 = _slice3d(dys, 2 * qz + 1, ok, D, H * W)
    g0 = _load2d(p0, 2 * qy, 2 * qx, ok0, H, W)
    g1 = _load2d(p0, 2 * qy, 2 * qx + 1, ok0, H, W)
    g2 = _load2d(p0, 2 * qy + 1, 2 * qx, ok0, H, W)
    g3 = _load2d(p0, 2 * qy + 1, 2 * qx + 1, ok0, H, W)
    g4 = _load2d(p1, 2 * qy, 2 * qx, ok1, H, W)
    g5 = _load2d(p1, 2 * qy, 2 * qx + 1, ok1, H, W)
    g6 = _load2d(p1, 2 * qy + 1, 2 * qx, ok1, H, W)
    g7 = _load2d(p1, 2 * qy + 1, 2 * qx + 1, ok1, H, W)
    tl.atomic_add(dbias_ptr + c, _tile_sum(g0 + g1 + g2 + g3 + g4 + g5 + g6 + g7), sem="relaxed")
    _polyphase_corr3d(xs, g0, g1, g2, g3, g4, g5, g6, g7, dwb_ptr + c * K * K * K, qz, qy, qx, ok, D, H, W, K)
    h0, h1, h2, h3, h4, h5, h6, h7 = _butterfly3d(g0, g1, g2, g3, g4, g5, g6, g7)
    _haar_corr3d(xs, h0, h1, h2, h3, h4, h5, h6, h7, dw1_ptr + c * 8 * K * K * K, qz, qy, qx, ok, D, H, W, K)

    e0, e1, e2, e3, e4, e5, e6, e7 = _haar_conv3d(dys, w1_ptr + c * 8 * K * K * K, qz, qy, qx, ok, D, H, W, K, -1)
    e0 += _coarse_synthesis3d(coarse_ptr, plane, qz, qy, qx, ok, B * C, D, H, W, LEVELS)
    r0, r1, r2, r3, r4, r5, r6, r7 = _butterfly3d(e0, e1, e2, e3, e4, e5, e6, e7)
    a0, a1, a2, a3, a4, a5, a6, a7 = _polyphase_conv3d(dys, wb_ptr + c * K * K * K, qz, qy, qx, ok, D, H, W, K, -1)
    _store_blocks3d(
        dx_ptr + (plane * D * H * W)[:, None],
        a0 + r0 * _R3,
        a1 + r1 * _R3,
        a2 + r2 * _R3,
        a3 + r3 * _R3,
        a4 + r4 * _R3,
        a5 + r5 * _R3,
        a6 + r6 * _R3,
        a7 + r7 * _R3,
        qz,
        qy,
        qx,
        ok,
        D,
        H,
        W,
    )

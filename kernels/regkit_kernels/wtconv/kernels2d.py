"""Fused WTConv kernels, 2D. See ``ops.py`` for the algorithm; the building blocks are in ``tile.py``.

The kernels read the layer's parameters as they are: each convolution's result is multiplied by its per-channel
scale (and, for the Haar levels, by the orthonormal factor 1/2, so that the butterflies stay unnormalised). Sizes are
run-time arguments, so one compilation serves every image size; only the kernel size, the number of levels and the
block sizes are compile-time constants.

Compile time: the helpers that a program calls once and that only store (``_level2d``, ``_wgrad2d_level``) are
``noinline``, functions of their own in the compiled module. Triton's coalescing pass takes, for every load and
store, the whole slice of operations connected to it, so its cost grows with the square of a function's size or more;
inlined, the weight-gradient kernel's three copies of its level loop were one function, and the pass took 9 of its 12
seconds of compile for sm_90 on the CPU. As functions of their own (the two calls with the same constants share one):
3.3 s, with the same loop bodies in SASS and the same registers (``benchmarks/scripts/wtconv_compile.py``).
"""

import triton
import triton.language as tl

from regkit_kernels.wtconv.tile import (
    block_at,
    butterfly2d,
    coarse_synthesis2d,
    fast_divmod,
    haar_conv2d,
    level_tile,
    polyphase_conv2d,
    store_blocks2d,
    tile_coords,
    wgrad_finalize,
    wgrad_plan,
    within,
)

# The weight-gradient kernel's layout, read by ops.py's plan too: an element of a step is WGRAD_PAIR neighbouring
# positions along x, and a share writes BASE_SLOTS partial sums of the base weights (one per phase row).
WGRAD_PAIR: tl.constexpr = tl.constexpr(2)
BASE_SLOTS: tl.constexpr = tl.constexpr(2)


@triton.jit
def _store_bands2d(ptrs, size, e0, e1, e2, e3, ok):
    """Store four sub-band tiles ``size`` elements apart."""
    tl.store(ptrs, e0, mask=ok)
    tl.store(ptrs + size, e1, mask=ok)
    tl.store(ptrs + 2 * size, e2, mask=ok)
    tl.store(ptrs + 3 * size, e3, mask=ok)


@triton.jit
def haar_lowpasses2d_kernel(
    # pointers: a plane stack [P, H, W] and its raw Haar low-passes of levels 1..DEPTH, one after the other
    # ([P, ceil(H / 2**j), ceil(W / 2**j)] each)
    src_ptr,
    low_ptr,
    # sizes
    P,
    H,
    W,
    DEPTH: tl.constexpr,
    NP: tl.constexpr,
    TY: tl.constexpr,
    TX: tl.constexpr,
):
    """The orthonormal Haar low-passes (LL) of levels 1..DEPTH of a plane stack in one pass, zero-padded on the far
    side of odd sizes: a program loads a tile of NP planes x TY x TX pixels (TY and TX multiples of 2**DEPTH) and
    halves it DEPTH times in registers, storing each level's part."""
    pid = tl.program_id(0)
    tiles_x = tl.cdiv(W, TX)
    tiles = tl.cdiv(H, TY) * tiles_x
    p0 = pid // tiles * NP
    y0 = pid % tiles // tiles_x * TY
    x0 = pid % tiles_x * TX
    r = tl.arange(0, NP * TY)[:, None]
    p = p0 + r // TY
    y = y0 + r % TY
    x = x0 + tl.arange(0, TX)[None, :]
    ok = (p < P) & within(y, H) & within(x, W)
    v = tl.load(src_ptr + (p.to(tl.int64) * H + y) * W + x, mask=ok, other=0.0).to(tl.float32)
    offset = tl.cast(0, tl.int64)
    h = H
    w = W
    for j in tl.static_range(1, DEPTH + 1):  # level j's tile: NP x (TY >> j) x (TX >> j)
        v = tl.sum(tl.reshape(v, [NP * (TY >> j), 2, TX >> (j - 1)]), axis=1)  # row pairs (they stay in a plane)
        v = 0.5 * tl.sum(tl.reshape(v, [NP * (TY >> j), TX >> j, 2]), axis=2)  # column pairs
        h = (h + 1) // 2
        w = (w + 1) // 2
        r = tl.arange(0, NP * (TY >> j))[:, None]
        p = p0 + r // (TY >> j)
        y = (y0 >> j) + r % (TY >> j)
        x = (x0 >> j) + tl.arange(0, TX >> j)[None, :]
        ok = (p < P) & within(y, h) & within(x, w)
        tl.store(low_ptr + offset + (p.to(tl.int64) * h + y) * w + x, v, mask=ok)
        offset += tl.cast(P, tl.int64) * h * w


@triton.jit(noinline=True)
def _level2d(low_ptr, params_ptr, z_ptr, pid, B, C, H, W, LEVELS: tl.constexpr, K: tl.constexpr,
             DIR: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Program ``pid`` of the Haar levels 2..LEVELS (see ``level_tile``): the depthwise conv (DIR = 1) or its adjoint
    (DIR = -1) of the sub-bands of the previous level's low-pass, recomputed on chip, into the level's part of the
    coarse buffer. ``params_ptr`` holds the level weights [L, C, 4, K*K] then the scales [L, C, 4]."""
    level, c, plane, q, ok, _, h, w, low_off, z_off = level_tile(pid, B, C, 1, H, W, LEVELS, 4, BLOCK)
    wq = (w + 1) // 2
    size = (h + 1) // 2 * wq
    wc = (level - 1) * C + c
    z0, z1, z2, z3 = haar_conv2d(
        low_ptr + low_off + plane * h * w, params_ptr + wc * 4 * K * K, params_ptr + LEVELS * C * 4 * K * K + wc * 4,
        q // wq, q % wq, ok, h, w, K, DIR,
    )  # fmt: skip
    _store_bands2d(z_ptr + z_off + plane * 4 * size + q, size, z0, z1, z2, z3, ok)


@triton.jit
def wtconv2d_levels_kernel(
    # pointers: the raw low-passes of levels 1..LEVELS-1 [B, C, ...] one after the other; the level weights and scales
    # (see ``_level2d``); output: the sub-bands Z of levels 2..LEVELS [B, C, 4, ...] one after the other
    low_ptr,
    params_ptr,
    z_ptr,
    # sizes
    B,
    C,
    H,
    W,
    LEVELS: tl.constexpr,
    K: tl.constexpr,
    DIR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Haar levels 2..LEVELS in one launch: analysis of the previous level's low-pass recomputed on chip, fused with
    the level's depthwise conv (DIR = 1) or its adjoint (DIR = -1; in 2D the backward pass runs the levels inside the
    weight-gradient launch instead)."""
    _level2d(low_ptr, params_ptr, z_ptr, tl.program_id(0), B, C, H, W, LEVELS, K, DIR, BLOCK)


@triton.jit
def wtconv2d_fwd_kernel(
    # pointers: x and out [B, C, H, W]; base weights [C, K*K], bias [C] and scale [C]; the level weights and scales
    # (see ``_level2d``); the processed sub-bands of levels 2..LEVELS, one after the other
    x_ptr,
    wb_ptr,
    bias_ptr,
    sb_ptr,
    params_ptr,
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
    c, plane, q, ok = tile_coords(tl.program_id(0), B, C, H1 * W1, BLOCK)
    qy = q // W1
    qx = q % W1
    xs = x_ptr + plane * H * W
    z0, z1, z2, z3 = haar_conv2d(
        xs, params_ptr + c * 4 * K * K, params_ptr + LEVELS * C * 4 * K * K + c * 4, qy, qx, ok, H, W, K, 1
    )
    z0 += coarse_synthesis2d(coarse_ptr, plane, qy, qx, ok, B * C, H, W, LEVELS)
    r00, r01, r10, r11 = butterfly2d(z0, z1, z2, z3)
    a00, a01, a10, a11 = polyphase_conv2d(xs, wb_ptr + c * K * K, qy, qx, ok, H, W, K, 1)
    sb = tl.load(sb_ptr + c).to(tl.float32)
    bias = tl.load(bias_ptr + c).to(tl.float32) if HAS_BIAS else 0.0
    out = out_ptr + plane * H * W
    r00 = sb * (a00 + bias) + 0.5 * r00
    r01 = sb * (a01 + bias) + 0.5 * r01
    r10 = sb * (a10 + bias) + 0.5 * r10
    r11 = sb * (a11 + bias) + 0.5 * r11
    store_blocks2d(out, r00, r01, r10, r11, qy, qx, ok, H, W)


@triton.jit
def wtconv2d_bwd_kernel(
    # pointers: output gradient and input gradient [B, C, H, W]; base weights [C, K*K], scale [C] and bias [C]; the
    # level weights and scales (see ``_level2d``); the sub-band gradients of levels 2..LEVELS one after the other;
    # the weight-gradient partial sums and the parameter gradients (see ``wgrad_finalize``)
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
    H,
    W,
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
    """The input gradient, one 2 x 2 block per level-1 position (programs below DX_PROGRAMS): the adjoint base conv of
    the output gradient plus the synthesis of all levels' sub-band gradients (level 1's computed here), written once.
    The programs after them sum the weight-gradient partial sums up (``wgrad_finalize``), in the same launch."""
    pid = tl.program_id(0)
    if pid < DX_PROGRAMS:
        c, plane, q, ok = tile_coords(pid, B, C, H1 * W1, BLOCK)
        qy = q // W1
        qx = q % W1
        dys = dy_ptr + plane * H * W
        e0, e1, e2, e3 = haar_conv2d(
            dys, params_ptr + c * 4 * K * K, params_ptr + LEVELS * C * 4 * K * K + c * 4, qy, qx, ok, H, W, K, -1
        )
        e0 += coarse_synthesis2d(coarse_ptr, plane, qy, qx, ok, B * C, H, W, LEVELS)
        r00, r01, r10, r11 = butterfly2d(e0, e1, e2, e3)
        a00, a01, a10, a11 = polyphase_conv2d(dys, wb_ptr + c * K * K, qy, qx, ok, H, W, K, -1)
        sb = tl.load(sb_ptr + c).to(tl.float32)
        dx = dx_ptr + plane * H * W
        store_blocks2d(
            dx, sb * a00 + 0.5 * r00, sb * a01 + 0.5 * r01, sb * a10 + 0.5 * r10, sb * a11 + 0.5 * r11, qy, qx, ok, H,
            W,
        )  # fmt: skip
    else:
        wgrad_finalize(
            part_ptr, params_ptr, wb_ptr, sb_ptr, bias_ptr, grads_ptr, pid - DX_PROGRAMS, B, C, 1, H, W, SPAN, LEVELS,
            4, K * K, TAPS, HAS_BIAS, BASE_SLOTS, WGRAD_PAIR,
        )  # fmt: skip


@triton.jit
def _base_column(b00, b01, b10, b11, tx, col: tl.constexpr, K: tl.constexpr, p0, p1, g0, g1):
    """Base-conv sums (see ``_wgrad2d_level``) of one pixel column (``p0`` in pixel row r = 0, ``p1`` in r = 1) against
    one phase column of a block's output gradient (``g0``: phase row sy = 0, ``g1``: sy = 1), at tap column ``col``
    (nothing where it lies outside 0..K-1). ``bRS`` accumulates pixel row R against phase row S."""
    if (col >= 0) and (col < K):
        hit = tx == col
        b00 = tl.where(hit, b00 + (g0 * p0)[None, :], b00)
        b01 = tl.where(hit, b01 + (g1 * p0)[None, :], b01)
        b10 = tl.where(hit, b10 + (g0 * p1)[None, :], b10)
        b11 = tl.where(hit, b11 + (g1 * p1)[None, :], b11)
    return b00, b01, b10, b11


@triton.jit
def _base_pixels(
    b00, b01, b10, b11, tx, col: tl.constexpr, K: tl.constexpr, p0, p1, ga00, ga01, ga10, ga11, gb00, gb01, gb10, gb11
):  # fmt: skip
    """``_base_column`` for a pixel column against both blocks of a pair (``ga``, ``gb``: their output gradients),
    ``col`` being its tap column for the first block's phase column 0 (phase column 1 is one tap left, the second
    block two more)."""
    b00, b01, b10, b11 = _base_column(b00, b01, b10, b11, tx, col, K, p0, p1, ga00, ga10)
    b00, b01, b10, b11 = _base_column(b00, b01, b10, b11, tx, col - 1, K, p0, p1, ga01, ga11)
    b00, b01, b10, b11 = _base_column(b00, b01, b10, b11, tx, col - 2, K, p0, p1, gb00, gb10)
    return _base_column(b00, b01, b10, b11, tx, col - 3, K, p0, p1, gb01, gb11)


@triton.jit(noinline=True)
def _wgrad2d_level(
    g_ptr, src_ptr, part_ptr, c, ty, share, row, C, B, H, W, Hq, Wq, base_off, SPAN,
    K: tl.constexpr, BASE: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One level's weight-gradient sums over one share (SPAN consecutive (batch item, pair) indices) of channel c, for
    the taps of row ``ty``: ``G[b, ty, tx] = sum_q dZ_b(q) Y_b(q + u)``, u = (ty, tx) - K // 2, with dZ and Y the
    unnormalised sub-bands of g and src, into partial row ``row``.

    A thread takes two neighbouring positions of a row (q and q + (0, 1): a pair; the second is void past the row's
    end) per step, BLOCK pairs a step. The sub-band gradients of both are computed once, and each of the K + 1 blocks
    of the tap row that they meet (four loads, a butterfly) once: block q + (uy, ux) is tap ux of the first and tap
    ux - 1 of the second. Products go to the tap column's accumulator: the accumulators are [KP, BLOCK] tiles whose tap
    axis lies within a thread, so that selecting the column (``tl.where`` with a compile-time column) costs nothing once
    unrolled.

    With BASE (level 1, src = x, g = dy), the same pixels feed the base conv's sums ``Gb[t] = sum_y g(y) src(y + t -
    K // 2)``: the pixel at offset (2 uy + r, o) from a block's corner 2q meets the block's pixel of phase (sy, sx) at
    tap (2 uy + r - sy, o - sx) + K // 2; the tap row is known at run time only, so the sums go to one accumulator per
    (r, sy) and are stored, by phase row sy, where the tap row is valid (every (tap row, sy) comes from exactly one
    program; the kernel runs tap rows that feed none without BASE). ``sum_y g(y)`` (the bias) is summed by the programs
    of the middle tap row."""
    P: tl.constexpr = K // 2
    tx = tl.arange(0, KP)[:, None]  # tap column, within a thread
    uy = ty - P
    H2 = H // 2  # blocks whose lower row (right column) lies inside the plane
    W2 = W // 2
    acc0 = tl.zeros([KP, BLOCK], tl.float32)
    acc1 = tl.zeros([KP, BLOCK], tl.float32)
    acc2 = tl.zeros([KP, BLOCK], tl.float32)
    acc3 = tl.zeros([KP, BLOCK], tl.float32)
    base00 = tl.zeros([KP, BLOCK], tl.float32)  # base sums by (pixel row r, phase row sy)
    base01 = tl.zeros([KP, BLOCK], tl.float32)
    base10 = tl.zeros([KP, BLOCK], tl.float32)
    base11 = tl.zeros([KP, BLOCK], tl.float32)
    bias = tl.zeros([BLOCK], tl.float32)
    Wp = (Wq + 1) // 2  # pairs per row
    Q = Hq * Wp
    inv_q = 1.0 / tl.cast(Q, tl.float32)
    inv_w = 1.0 / tl.cast(Wp, tl.float32)
    end = tl.minimum(share * SPAN + SPAN, B * Q)
    for start in range(share * SPAN, end, BLOCK):
        n = start + tl.arange(0, BLOCK)
        ok = n < end
        b, q = fast_divmod(n, Q, inv_q)
        qy, px = fast_divmod(q, Wp, inv_w)
        qx = 2 * px  # the pair's first position; the second, qx + 1, exists where qx + 1 < Wq
        pos = (b * C + c).to(tl.int64) * H * W + (2 * qy * W + 2 * qx)
        gs = g_ptr + pos
        ok_g1 = ok & (qy < H2)
        ga00, ga01, ga10, ga11 = block_at(gs, W, ok, ok_g1, True, qx < W2)
        gb00, gb01, gb10, gb11 = block_at(gs + 2, W, ok, ok_g1, qx + 1 < Wq, qx + 1 < W2)
        da0, da1, da2, da3 = butterfly2d(ga00, ga01, ga10, ga11)
        db0, db1, db2, db3 = butterfly2d(gb00, gb01, gb10, gb11)
        vy = qy + uy
        ok_y0 = ok & within(vy, Hq)
        ok_y1 = ok & within(vy, H2)
        src = src_ptr + pos + 2 * uy * W
        for v in tl.static_range(K + 1):
            ux = v - P
            s00, s01, s10, s11 = block_at(src + 2 * ux, W, ok_y0, ok_y1, within(qx + ux, Wq), within(qx + ux, W2))
            ll, lh, hl, hh = butterfly2d(s00, s01, s10, s11)
            if v < K:  # tap column v of the first position
                hit = tx == v
                acc0 = tl.where(hit, acc0 + (da0 * ll)[None, :], acc0)
                acc1 = tl.where(hit, acc1 + (da1 * lh)[None, :], acc1)
                acc2 = tl.where(hit, acc2 + (da2 * hl)[None, :], acc2)
                acc3 = tl.where(hit, acc3 + (da3 * hh)[None, :], acc3)
            if v >= 1:  # tap column v - 1 of the second
                hit = tx == v - 1
                acc0 = tl.where(hit, acc0 + (db0 * ll)[None, :], acc0)
                acc1 = tl.where(hit, acc1 + (db1 * lh)[None, :], acc1)
                acc2 = tl.where(hit, acc2 + (db2 * hl)[None, :], acc2)
                acc3 = tl.where(hit, acc3 + (db3 * hh)[None, :], acc3)
            if BASE:  # pixel columns 2 ux (s00, s10) and 2 ux + 1 (s01, s11) from the first block's corner
                base00, base01, base10, base11 = _base_pixels(
                    base00, base01, base10, base11, tx, 2 * ux + P, K, s00, s10, ga00, ga01, ga10, ga11, gb00, gb01,
                    gb10, gb11,
                )  # fmt: skip
                base00, base01, base10, base11 = _base_pixels(
                    base00, base01, base10, base11, tx, 2 * ux + 1 + P, K, s01, s11, ga00, ga01, ga10, ga11, gb00,
                    gb01, gb10, gb11,
                )  # fmt: skip
        if BASE:
            bias += ga00 + ga01 + ga10 + ga11 + gb00 + gb01 + gb10 + gb11
    t = tl.arange(0, KP)
    t_ok = t < K
    out = part_ptr + (row * C + c) * 4 * K * K + ty * K + t
    tl.store(out, tl.sum(acc0, axis=1), mask=t_ok)
    tl.store(out + K * K, tl.sum(acc1, axis=1), mask=t_ok)
    tl.store(out + 2 * K * K, tl.sum(acc2, axis=1), mask=t_ok)
    tl.store(out + 3 * K * K, tl.sum(acc3, axis=1), mask=t_ok)
    if BASE:  # tap row 2 uy + r - sy + P of phase row sy, where valid
        shares1 = tl.cdiv(B * Q, SPAN)
        base = part_ptr + base_off + (share * C + c) * 2 * K * K + t
        t0 = 2 * uy + P + 0 * t  # tap row of (r, sy) = (0, 0) and (1, 1), as a vector (the interpreter takes no
        # mask made of a vector and a scalar)
        tl.store(base + t0 * K, tl.sum(base00, axis=1), mask=t_ok & within(t0, K))
        tl.store(base + (K + t0 - 1) * K, tl.sum(base01, axis=1), mask=t_ok & within(t0 - 1, K))
        tl.store(base + (t0 + 1) * K, tl.sum(base10, axis=1), mask=t_ok & within(t0 + 1, K))
        tl.store(base + (K + t0) * K, tl.sum(base11, axis=1), mask=t_ok & within(t0, K))
        one = tl.arange(0, 1)
        bias_at = part_ptr + base_off + shares1 * C * 2 * K * K + share * C + c
        tl.store(bias_at + one, tl.sum(bias) + 0.0 * one, mask=(one + uy) == 0)


@triton.jit
def wtconv2d_wgrad_kernel(
    # pointers: the output gradient dy and x [B, C, H, W]; the low-passes of levels 1..L-1 of dy and of x, one after
    # the other; the level weights and scales (see ``_level2d``); outputs: the sub-band gradients of levels 2..L one
    # after the other and the weight-gradient partial sums (see ``wgrad_finalize``)
    dy_ptr,
    x_ptr,
    glow_ptr,
    low_ptr,
    params_ptr,
    dz_ptr,
    part_ptr,
    # sizes
    B,
    C,
    H,
    W,
    SPAN,
    LEVEL_PROGRAMS,
    LEVELS: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK: tl.constexpr,
    LEVEL_BLOCK: tl.constexpr,
):
    """The backward pass of Haar levels 2..LEVELS (programs below LEVEL_PROGRAMS, see ``_level2d``: the sub-band
    gradient is the adjoint conv of the Haar analysis of the output gradient's low-pass, the adjoint of the closed-form
    synthesis) and, after them in the same launch, the weight gradients of every level, the base conv and the bias:
    program = (level, share, channel, tap row), tap row fastest (the K programs of a share read the same blocks), see
    ``wgrad_plan``; level 1 reads dy and x, deeper levels the low-passes."""
    pid = tl.program_id(0)
    if pid < LEVEL_PROGRAMS:
        _level2d(glow_ptr, params_ptr, dz_ptr, pid, B, C, H, W, LEVELS, K, -1, LEVEL_BLOCK)
    else:
        level, local, row0, off, _, h_in, w_in, rows = wgrad_plan(
            pid - LEVEL_PROGRAMS, B, C, C * K, 1, H, W, SPAN, LEVELS, WGRAD_PAIR
        )
        ty = local % K
        c = local // K % C
        share = local // (K * C)
        base_off = rows * C * 4 * K * K
        uy = ty - K // 2
        if level == 1:
            if (2 * uy + 1 >= -(K // 2)) & (2 * uy <= K // 2 + 1):  # pixel rows 2 uy, 2 uy + 1 reach base taps
                _wgrad2d_level(
                    dy_ptr, x_ptr, part_ptr, c, ty, share, row0 + share, C, B, H, W, (H + 1) // 2, (W + 1) // 2,
                    base_off, SPAN, K, True, KP, BLOCK,
                )  # fmt: skip
            else:
                _wgrad2d_level(
                    dy_ptr, x_ptr, part_ptr, c, ty, share, row0 + share, C, B, H, W, (H + 1) // 2, (W + 1) // 2,
                    base_off, SPAN, K, False, KP, BLOCK,
                )  # fmt: skip
        else:
            _wgrad2d_level(
                glow_ptr + off, low_ptr + off, part_ptr, c, ty, share, row0 + share, C, B, h_in, w_in, (h_in + 1) // 2,
                (w_in + 1) // 2, base_off, SPAN, K, False, KP, BLOCK,
            )  # fmt: skip

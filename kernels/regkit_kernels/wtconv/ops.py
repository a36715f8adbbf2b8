"""Fused WTConv, 2D and 3D: launchers, the autograd Function and the functional entry point.

The layer (see ``regkit.features.wtconv``) is computed with three reformulations that cut memory traffic:

1. Haar analysis on chip: a level's sub-bands are recomputed from the previous level's raw low-pass inside the tap
   loop of the level's depthwise convolution and never written. Level 1 reads x itself; the raw low-passes of levels
   1..L-1 (a quarter, a sixteenth, ... of x in 2D; the first by a small kernel, the others by the level kernels) are
   kept for the backward pass.
2. Closed-form synthesis: the cascade of inverse transforms collapses to one pass. Pixel y receives, from level j,
   ``2**(-j*ndim/2) * sum_b sign_b(y) * Z_j[b](y >> j)``, the signs given by bit j-1 of y's coordinates. The output
   kernel works on 2 x 2 (x 2) blocks, one per level-1 position: it computes level 1's convolution and the base
   convolution from the same x tile, adds the deeper levels in closed form and stores the block once.
3. Folded scales: the per-channel scales are multiplied into the kernels' weights by the caller (``wtconv_fused``),
   so autograd recovers their gradients from the folded weights' gradients; no scaling pass exists.

The backward pass mirrors the forward: the adjoint of the closed-form synthesis is the Haar analysis cascade of the
output gradient (its low-passes made like the forward's, its sub-bands on chip); each level's sub-band gradient is the
adjoint convolution of that, and the input gradient is the adjoint base convolution plus the closed-form synthesis of
the sub-band gradients, written once. Weight gradients are tile sums of products recomputed on chip, added atomically in
float32 (their summation order, and so their last bits, vary from run to run).

Memory besides x, out and their gradients: the low-passes (1/3 of x's elements in 2D, 1/7 in 3D), the processed
sub-bands of levels 2..L during the forward pass and their gradients during the backward pass (as many again each).
These coarse tensors are float32 whatever x's dtype: in bfloat16 only x, out and their gradients are rounded.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
from torch import Tensor
from torch.autograd.function import once_differentiable

from regkit_kernels.wtconv.kernels2d import (
    _haar_lowpass2d_kernel,
    _wtconv2d_bwd_kernel,
    _wtconv2d_fwd_kernel,
    _wtconv2d_level_bwd_kernel,
    _wtconv2d_level_fwd_kernel,
)
from regkit_kernels.wtconv.kernels3d import (
    _haar_lowpass3d_kernel,
    _wtconv3d_bwd_kernel,
    _wtconv3d_fwd_kernel,
    _wtconv3d_level_bwd_kernel,
    _wtconv3d_level_fwd_kernel,
)


@dataclass(frozen=True)
class _Kernels:
    lowpass: triton.JITFunction
    level_fwd: triton.JITFunction
    fwd: triton.JITFunction
    level_bwd: triton.JITFunction
    bwd: triton.JITFunction
    tile: int  # elements per program on a GPU (batch rows x grid positions)


# One table picks the 2D or 3D kernels. Tiles of 512 / 256 elements with 4 warps: see docs/wtconv_notes.md.
_KERNELS = {
    2: _Kernels(
        _haar_lowpass2d_kernel,
        _wtconv2d_level_fwd_kernel,
        _wtconv2d_fwd_kernel,
        _wtconv2d_level_bwd_kernel,
        _wtconv2d_bwd_kernel,
        512,
    ),
    3: _Kernels(
        _haar_lowpass3d_kernel,
        _wtconv3d_level_fwd_kernel,
        _wtconv3d_fwd_kernel,
        _wtconv3d_level_bwd_kernel,
        _wtconv3d_bwd_kernel,
        256,
    ),
}
_NUM_WARPS = 4
# Under TRITON_INTERPRET=1 each program costs Python overhead, so CPU runs use one large tile per plane.
_INTERPRETER_TILE = 1 << 16
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _level_sizes(size: Sequence[int], levels: int) -> list[tuple[int, ...]]:
    """Grid sizes of levels 0..levels: each level halves every axis, rounding up."""
    return [tuple(-(-s // 2**j) for s in size) for j in range(levels + 1)]


def _launch_config(x: Tensor, positions: int, tile: int) -> tuple[int, int]:
    """(BLOCK_B, BLOCK_Q) for a grid of ``positions`` per plane: one of three shapes of ``tile`` elements (long rows of
    one batch item for large grids, 8 x tile/8, tile/8 x 8), so that a layer compiles few kernel variants; batch rows
    are capped by the batch."""
    if x.device.type == "cpu":
        tile = _INTERPRETER_TILE
    if positions >= tile:
        block_b, block_q = 1, tile
    elif positions >= tile // 8 or x.device.type == "cpu":
        block_b, block_q = 8, max(tile // 8, triton.next_power_of_2(positions) if x.device.type == "cpu" else 0)
    else:
        block_b, block_q = tile // 8, 8
    return min(block_b, triton.next_power_of_2(x.shape[0])), block_q


def _grid(batch: int, channels: int, positions: int, block_b: int, block_q: int) -> tuple[int]:
    return (triton.cdiv(positions, block_q) * channels * triton.cdiv(batch, block_b),)


def _coarse_buffers(x: Tensor, sizes: list[tuple[int, ...]]) -> tuple[Tensor, list[Tensor]]:
    """One buffer for the sub-bands of levels 2..L, ``[B, C, 2**ndim, *S_j]`` each, one after the other (the output
    kernels find each level's part from the sizes); returns it and the per-level views."""
    b, c = x.shape[:2]
    nb = 2 ** (x.dim() - 2)
    shapes = [(b, c, nb, *s) for s in sizes[2:]]
    buffer = x.new_empty(sum(math.prod(s) for s in shapes), dtype=torch.float32)
    views, start = [], 0
    for shape in shapes:
        views.append(buffer[start : start + math.prod(shape)].view(shape))
        start += math.prod(shape)
    return buffer, views


def _lowpass(t: Tensor, low: Tensor, kern: _Kernels) -> None:
    """Write into ``low`` the raw Haar low-pass of ``t``: ``2**(-ndim/2)`` times the sums over 2 x 2 (x 2) blocks, the
    far side of odd axes padded with zeros (the deeper low-passes come out of the level kernels)."""
    positions = math.prod(low.shape[2:])
    bb, bq = _launch_config(t, positions, kern.tile)
    kern.lowpass[_grid(t.shape[0], t.shape[1], positions, bb, bq)](
        t, low, *t.shape[:2], *t.shape[2:], *low.shape[2:], BLOCK_B=bb, BLOCK_Q=bq, num_warps=_NUM_WARPS
    )


def _check(x: Tensor) -> None:
    if x.dim() - 2 not in _KERNELS:
        raise ValueError(f"expected x (B, C, *spatial) with 2 or 3 spatial axes, got {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"the fused WTConv takes float32, bfloat16 or float16, got {x.dtype}")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the fused WTConv needs CUDA tensors (or TRITON_INTERPRET=1 with CPU tensors)")


def wtconv_fwd(x: Tensor, base_weight: Tensor, base_bias: Tensor, level_weights: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Forward pass on folded float32 parameters.

    Args:
        x: ``(B, C, *S)``, contiguous.
        base_weight: ``(C, k**ndim)``, base kernel times base scale; ``base_bias``: ``(C,)``, bias times base scale.
        level_weights: ``(L, C, 2**ndim, k**ndim)``, each level's kernels times its scales.

    Returns the output and the raw low-passes of levels 1..L-1 (kept for :func:`wtconv_bwd`).
    """
    _check(x)
    ndim, (batch, channels), levels = x.dim() - 2, x.shape[:2], level_weights.shape[0]
    kern, k = _KERNELS[ndim], round(base_weight.shape[1] ** (1 / ndim))
    haar_weights = level_weights * 2 ** (-ndim / 2)
    sizes = _level_sizes(x.shape[2:], levels)
    lows = [x] + [x.new_empty(batch, channels, *s, dtype=torch.float32) for s in sizes[1:levels]]
    if levels > 1:
        _lowpass(x, lows[1], kern)
    coarse, views = _coarse_buffers(x, sizes)
    for j in range(2, levels + 1):  # level j also writes the low-pass that level j + 1 reads
        positions = math.prod(sizes[j])
        bb, bq = _launch_config(x, positions, kern.tile)
        kern.level_fwd[_grid(batch, channels, positions, bb, bq)](
            lows[j - 1], haar_weights[j - 1], views[j - 2], lows[j] if j < levels else coarse, batch, channels,
            *sizes[j - 1], *sizes[j], positions * (j < levels), K=k, BLOCK_B=bb, BLOCK_Q=bq, num_warps=_NUM_WARPS,
        )  # fmt: skip
    out = torch.empty_like(x)
    positions = math.prod(sizes[1])
    bb, bq = _launch_config(x, positions, kern.tile)
    kern.fwd[_grid(batch, channels, positions, bb, bq)](
        x, base_weight, base_bias, haar_weights[0], coarse, out, batch, channels, *sizes[0], *sizes[1],
        LEVELS=levels, K=k, BLOCK_B=bb, BLOCK_Q=bq, num_warps=_NUM_WARPS,
    )  # fmt: skip
    return out, lows[1:]


def wtconv_bwd(
    grad_out: Tensor, x: Tensor, base_weight: Tensor, level_weights: Tensor, lows: Sequence[Tensor]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward pass of :func:`wtconv_fwd`: gradients of x, base_weight, base_bias and level_weights (float32)."""
    ndim, (batch, channels), levels = x.dim() - 2, x.shape[:2], level_weights.shape[0]
    kern, k = _KERNELS[ndim], round(base_weight.shape[1] ** (1 / ndim))
    haar_weights = level_weights * 2 ** (-ndim / 2)
    sizes = _level_sizes(x.shape[2:], levels)
    grads = [grad_out] + [x.new_empty(batch, channels, *s, dtype=torch.float32) for s in sizes[1:levels]]
    if levels > 1:
        _lowpass(grad_out, grads[1], kern)
    srcs = [x, *lows]
    coarse, views = _coarse_buffers(x, sizes)
    grad_base = torch.zeros_like(base_weight, dtype=torch.float32)
    grad_bias = torch.zeros(channels, device=x.device, dtype=torch.float32)
    grad_levels = torch.zeros_like(level_weights, dtype=torch.float32)
    for j in range(2, levels + 1):  # level j also writes the gradient low-pass that level j + 1 reads
        positions = math.prod(sizes[j])
        bb, bq = _launch_config(x, positions, kern.tile)
        kern.level_bwd[_grid(batch, channels, positions, bb, bq)](
            grads[j - 1], srcs[j - 1], haar_weights[j - 1], views[j - 2], grads[j] if j < levels else coarse,
            grad_levels[j - 1], batch, channels, *sizes[j - 1], *sizes[j], positions * (j < levels),
            K=k, BLOCK_B=bb, BLOCK_Q=bq, num_warps=_NUM_WARPS,
        )  # fmt: skip
    grad_x = torch.empty_like(x)
    positions = math.prod(sizes[1])
    bb, bq = _launch_config(x, positions, kern.tile)
    kern.bwd[_grid(batch, channels, positions, bb, bq)](
        grad_out, x, base_weight, haar_weights[0], coarse, grad_x, grad_base, grad_bias, grad_levels[0], batch,
        channels, *sizes[0], *sizes[1], LEVELS=levels, K=k, BLOCK_B=bb, BLOCK_Q=bq, num_warps=_NUM_WARPS,
    )  # fmt: skip
    # The kernels sum products of unnormalised sub-bands of the gradient and of x: two orthonormal factors to apply.
    return grad_x, grad_base, grad_bias, grad_levels.mul_(2.0**-ndim)


class WTConvFunction(torch.autograd.Function):
    """Autograd face of :func:`wtconv_fwd` / :func:`wtconv_bwd` (folded float32 parameters)."""

    @staticmethod
    def forward(ctx, x: Tensor, base_weight: Tensor, base_bias: Tensor, level_weights: Tensor) -> Tensor:  # type: ignore[override]
        out, lows = wtconv_fwd(x, base_weight, base_bias, level_weights)
        ctx.save_for_backward(x, base_weight, level_weights, *lows)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # type: ignore[override]
        x, base_weight, level_weights, *lows = ctx.saved_tensors
        return wtconv_bwd(grad_out.contiguous(), x, base_weight, level_weights, lows)


def wtconv_fused(
    x: Tensor,
    base_weight: Tensor,
    base_bias: Tensor | None,
    base_scale: Tensor,
    wavelet_weights: Sequence[Tensor],
    wavelet_scales: Sequence[Tensor],
) -> Tensor:
    """The WTConv layer with the fused kernels; same arguments and result as ``regkit.features.wtconv_reference``.

    The scales are folded into the kernels here, with autograd, so their gradients follow from the folded weights'.
    """
    channels, nb, levels = x.shape[1], 2 ** (x.dim() - 2), len(wavelet_weights)
    scale = base_scale.reshape(channels, 1).float()
    folded_base = scale * base_weight.reshape(channels, -1).float()
    folded_bias = (
        scale[:, 0] * base_bias.float()
        if base_bias is not None
        else torch.zeros(channels, device=x.device, dtype=torch.float32)
    )
    folded_levels = torch.stack(
        [
            s.reshape(-1, 1).float() * w.reshape(channels * nb, -1).float()
            for w, s in zip(wavelet_weights, wavelet_scales, strict=True)
        ]
    ).reshape(levels, channels, nb, -1)
    return WTConvFunction.apply(x.contiguous(), folded_base.contiguous(), folded_bias.contiguous(), folded_levels)

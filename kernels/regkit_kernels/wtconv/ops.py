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
3. Folded scales: the kernels see each kernel multiplied by its per-channel scale (and the levels' also by the
   orthonormal Haar factor); the backward pass turns the folded weights' gradients into those of the weights and
   scales. No scaling pass exists.

The backward pass mirrors the forward: the adjoint of the closed-form synthesis is the Haar analysis cascade of the
output gradient (its low-passes made like the forward's, its sub-bands on chip); each level's sub-band gradient is the
adjoint convolution of that, and the input gradient is the adjoint base convolution plus the closed-form synthesis of
the sub-band gradients, written once. The weight gradients come from their own kernel per level, whose tiles span
every tap of a channel: products of the recomputed sub-bands of the gradient and of the input are accumulated in
registers over a share of the positions and summed once (partial sums per share, added up here; deterministic).

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
    _wtconv2d_wgrad_kernel,
)
from regkit_kernels.wtconv.kernels3d import (
    _haar_lowpass3d_kernel,
    _wtconv3d_bwd_kernel,
    _wtconv3d_fwd_kernel,
    _wtconv3d_level_bwd_kernel,
    _wtconv3d_level_fwd_kernel,
    _wtconv3d_wgrad_kernel,
)


@dataclass(frozen=True)
class _Kernels:
    lowpass: triton.JITFunction
    level_fwd: triton.JITFunction
    fwd: triton.JITFunction
    level_bwd: triton.JITFunction
    bwd: triton.JITFunction
    wgrad: triton.JITFunction
    block: int  # positions per program of the convolution kernels
    wgrad_block: int  # positions per step of the weight-gradient kernels (times the in-plane taps)


# One table picks the 2D or 3D kernels. Block sizes: the best of a small sweep on an H200 (docs/wtconv_notes.md); the
# weight-gradient kernels are latency-bound, and their smaller tiles (fewer registers, more warps) won by 15% (2D) and
# 10% (3D) on the largest shapes.
_KERNELS = {
    2: _Kernels(
        _haar_lowpass2d_kernel,
        _wtconv2d_level_fwd_kernel,
        _wtconv2d_fwd_kernel,
        _wtconv2d_level_bwd_kernel,
        _wtconv2d_bwd_kernel,
        _wtconv2d_wgrad_kernel,
        256,
        16,
    ),
    3: _Kernels(
        _haar_lowpass3d_kernel,
        _wtconv3d_level_fwd_kernel,
        _wtconv3d_fwd_kernel,
        _wtconv3d_level_bwd_kernel,
        _wtconv3d_bwd_kernel,
        _wtconv3d_wgrad_kernel,
        256,
        8,
    ),
}
_NUM_WARPS = 4
# Weight-gradient programs per multiprocessor (their shares of the positions are summed afterwards).
_WGRAD_PROGRAMS_PER_SM = 4
# Under TRITON_INTERPRET=1 each program costs Python overhead, so CPU runs use one large tile per channel.
_INTERPRETER_BLOCK = 1 << 14
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _level_sizes(size: Sequence[int], levels: int) -> list[tuple[int, ...]]:
    """Grid sizes of levels 0..levels: each level halves every axis, rounding up."""
    return [tuple(-(-s // 2**j) for s in size) for j in range(levels + 1)]


def _launch(kernel: triton.JITFunction, x: Tensor, block: int, grid_size: Sequence[int], *args, **consts) -> None:
    """Launch a convolution kernel over every (batch item, position of ``grid_size``) of every channel of ``x``."""
    if x.device.type == "cpu":
        block = min(_INTERPRETER_BLOCK, _pow2(x.shape[0] * math.prod(grid_size)))
    chunks = -(-x.shape[0] * math.prod(grid_size) // block)
    kernel[(chunks * x.shape[1],)](*args, BLOCK=block, num_warps=_NUM_WARPS, **consts)


def _coarse_buffers(x: Tensor, sizes: list[tuple[int, ...]]) -> tuple[Tensor, list[Tensor]]:
    """One float32 buffer for the sub-bands of levels 2..L, ``[B, C, 2**ndim, *S_j]`` each, one after the other (the
    output kernels find each level's part from the sizes); returns it and the per-level views."""
    b, c = x.shape[:2]
    nb = 2 ** (x.dim() - 2)
    shapes = [(b, c, nb, *s) for s in sizes[2:]]
    buffer = x.new_empty(sum(math.prod(s) for s in shapes), dtype=torch.float32)
    views, start = [], 0
    for shape in shapes:
        views.append(buffer[start : start + math.prod(shape)].view(shape))
        start += math.prod(shape)
    return buffer, views


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
        level_weights: ``(L, C, 2**ndim, k**ndim)``, each level's kernels times its scales and ``2**(-ndim/2)``.

    Returns the output and the raw low-passes of levels 1..L-1 (kept for :func:`wtconv_bwd`).
    """
    _check(x)
    ndim, (batch, channels), levels = x.dim() - 2, x.shape[:2], level_weights.shape[0]
    kern, k = _KERNELS[ndim], round(base_weight.shape[1] ** (1 / ndim))
    sizes = _level_sizes(x.shape[2:], levels)
    lows = [x] + [x.new_empty(batch, channels, *s, dtype=torch.float32) for s in sizes[1:levels]]
    if levels > 1:
        _launch(kern.lowpass, x, kern.block, sizes[1], x, lows[1], batch, channels, *sizes[0], *sizes[1])
    coarse, views = _coarse_buffers(x, sizes)
    for j in range(2, levels + 1):  # level j also writes the low-pass that level j + 1 reads
        low = lows[j] if j < levels else coarse
        _launch(
            kern.level_fwd, x, kern.block, sizes[j], lows[j - 1], level_weights[j - 1], views[j - 2], low,
            batch, channels, *sizes[j - 1], *sizes[j], math.prod(sizes[j]) * (j < levels), K=k,
        )  # fmt: skip
    out = torch.empty_like(x)
    _launch(
        kern.fwd, x, kern.block, sizes[1], x, base_weight, base_bias, level_weights[0], coarse, out, batch, channels,
        *sizes[0], *sizes[1], LEVELS=levels, K=k,
    )  # fmt: skip
    return out, lows[1:]


def _wgrad_shares(x: Tensor, programs_per_share: int, positions: int, block: int) -> int:
    """How many shares the positions of a channel are split into for the weight-gradient kernels."""
    if x.device.type == "cpu":
        return 1
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    wanted = -(-_WGRAD_PROGRAMS_PER_SM * sms // programs_per_share)
    return max(1, min(wanted, -(-positions // (4 * block))))


def wtconv_bwd(
    grad_out: Tensor, x: Tensor, base_weight: Tensor, level_weights: Tensor, lows: Sequence[Tensor]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward pass of :func:`wtconv_fwd`: gradients of x, base_weight, base_bias and level_weights (float32)."""
    ndim, (batch, channels), levels = x.dim() - 2, x.shape[:2], level_weights.shape[0]
    kern, k = _KERNELS[ndim], round(base_weight.shape[1] ** (1 / ndim))
    sizes = _level_sizes(x.shape[2:], levels)
    grads = [grad_out] + [x.new_empty(batch, channels, *s, dtype=torch.float32) for s in sizes[1:levels]]
    if levels > 1:
        _launch(kern.lowpass, x, kern.block, sizes[1], grad_out, grads[1], batch, channels, *sizes[0], *sizes[1])
    coarse, views = _coarse_buffers(x, sizes)
    for j in range(2, levels + 1):  # level j also writes the gradient low-pass that level j + 1 reads
        low = grads[j] if j < levels else coarse
        _launch(
            kern.level_bwd, x, kern.block, sizes[j], grads[j - 1], level_weights[j - 1], views[j - 2], low,
            batch, channels, *sizes[j - 1], *sizes[j], math.prod(sizes[j]) * (j < levels), K=k,
        )  # fmt: skip
    grad_x = torch.empty_like(x)
    _launch(
        kern.bwd, x, kern.block, sizes[1], grad_out, base_weight, level_weights[0], coarse, grad_x, batch, channels,
        *sizes[0], *sizes[1], LEVELS=levels, K=k,
    )  # fmt: skip

    # Weight gradients: one launch per level, partial sums per share of the positions, added up below.
    srcs = [x, *lows]
    plane_taps = k * k
    programs_per_share = channels * (k if ndim == 3 else 1)
    block = kern.wgrad_block if x.device.type == "cuda" else _pow2(batch * math.prod(sizes[1]))
    shares = [_wgrad_shares(x, programs_per_share, batch * math.prod(s), block) for s in sizes[1:]]
    nb, taps = 2**ndim, k**ndim
    grad_levels = [x.new_empty(n, channels, nb, taps, dtype=torch.float32) for n in shares]
    grad_base = x.new_empty(shares[0], channels, taps, dtype=torch.float32)
    grad_bias = x.new_empty(shares[0], channels, dtype=torch.float32)
    for j in range(1, levels + 1):
        kern.wgrad[(programs_per_share * shares[j - 1],)](
            grads[j - 1], srcs[j - 1], grad_levels[j - 1], grad_base, grad_bias, batch, channels, *sizes[j - 1],
            *sizes[j], K=k, BASE=j == 1, TAPS=_pow2(plane_taps), BLOCK=block, num_warps=_NUM_WARPS,
        )  # fmt: skip
    # The kernels sum products of unnormalised sub-bands of the gradient and of the input: the two orthonormal
    # factors, and the one folded into the level weights, are applied here.
    scale = 2 ** (-ndim / 2)
    grad_levels_sum = torch.stack([g.sum(0) for g in grad_levels]).mul_(scale)
    return grad_x, grad_base.sum(0), grad_bias.sum(0), grad_levels_sum


def _fold(base_weight, base_bias, base_scale, level_weights, level_scales, ndim):
    """Folded float32 kernels: base kernel and bias times the base scale; level kernels times their scales and the
    orthonormal Haar factor ``2**(-ndim/2)``."""
    channels = base_weight.shape[0]
    scale = base_scale.reshape(channels, 1).float()
    base = (scale * base_weight.reshape(channels, -1).float()).contiguous()
    bias = scale[:, 0] * base_bias.float() if base_bias is not None else scale.new_zeros(channels)
    weights = torch.stack([w.reshape(w.shape[0], -1) for w in level_weights]).float()
    scales = torch.stack([s.reshape(-1, 1) for s in level_scales]).float()
    levels = (weights * (scales * 2 ** (-ndim / 2))).reshape(len(level_weights), channels, 2**ndim, -1)
    return base, bias.contiguous(), levels.contiguous(), weights, scales


class WTConvFunction(torch.autograd.Function):
    """Autograd face of :func:`wtconv_fwd` / :func:`wtconv_bwd` on the layer's own parameters: the scales are folded
    into the kernels inside, and the gradients of weights and scales recovered from the folded weights' gradients."""

    @staticmethod
    def forward(ctx, x: Tensor, base_weight: Tensor, base_bias: Tensor | None, base_scale: Tensor, *levels: Tensor):
        ndim, num = x.dim() - 2, len(levels) // 2
        base, bias, folded, weights, scales = _fold(
            base_weight, base_bias, base_scale, levels[:num], levels[num:], ndim
        )
        out, lows = wtconv_fwd(x, base, bias, folded)
        ctx.save_for_backward(x, base_weight, base_bias, base_scale, base, folded, weights, scales, *lows)
        ctx.level_params = [(p.shape, p.dtype) for p in levels]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        x, base_weight, base_bias, base_scale, base, folded, weights, scales, *lows = ctx.saved_tensors
        ndim, channels, num = x.dim() - 2, x.shape[1], len(ctx.level_params) // 2
        grad_x, g_base, g_bias, g_levels = wtconv_bwd(grad_out.contiguous(), x, base, folded, lows)
        # folded = r * s * w with r = 2**(-ndim/2): dw = r * s * g and ds = r * sum over the taps of w * g.
        g_levels = g_levels.reshape(num, -1, weights.shape[-1]) * 2 ** (-ndim / 2)
        grad_w = (scales * g_levels).unbind(0)
        grad_s = (weights * g_levels).sum(-1).unbind(0)
        s = base_scale.reshape(channels, 1).float()
        grad_base_w = s * g_base
        grad_base_s = (base_weight.reshape(channels, -1).float() * g_base).sum(-1)
        grad_bias = None
        if base_bias is not None:
            grad_bias = (s[:, 0] * g_bias).to(base_bias.dtype)
            grad_base_s = grad_base_s + base_bias.float() * g_bias
        params = ctx.level_params
        return (
            grad_x,
            grad_base_w.reshape(base_weight.shape).to(base_weight.dtype),
            grad_bias,
            grad_base_s.reshape(base_scale.shape).to(base_scale.dtype),
            *(g.reshape(shape).to(dtype) for g, (shape, dtype) in zip(grad_w + grad_s, params, strict=True)),
        )


def wtconv_fused(
    x: Tensor,
    base_weight: Tensor,
    base_bias: Tensor | None,
    base_scale: Tensor,
    wavelet_weights: Sequence[Tensor],
    wavelet_scales: Sequence[Tensor],
) -> Tensor:
    """The WTConv layer with the fused kernels; same arguments and result as ``regkit.features.wtconv_reference``."""
    return WTConvFunction.apply(x.contiguous(), base_weight, base_bias, base_scale, *wavelet_weights, *wavelet_scales)

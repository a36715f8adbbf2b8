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
3. Folded scales: the kernels multiply each convolution's result by its per-channel scale (and the levels' also by the
   orthonormal Haar factor), reading the parameters as they are; the gradients of weights and scales come from the
   sums of products that the gradient of the folded kernel (scale x weight) needs. No scaling pass exists.

The backward pass mirrors the forward: the adjoint of the closed-form synthesis is the Haar analysis cascade of the
output gradient (its low-passes made like the forward's, its sub-bands on chip); each level's sub-band gradient is the
adjoint convolution of that, and the input gradient is the adjoint base convolution plus the closed-form synthesis of
the sub-band gradients, written once. The weight gradients of all levels come from one launch whose tiles span every
tap of a channel: products of the recomputed sub-bands of the gradient and of the input are accumulated in registers
over a share of the positions and summed once into a row of partial sums; one more launch adds the rows up and
writes the gradients of every weight, scale and the bias (deterministic, no atomics).

Python overhead matters at the small WTConvNeXt stages (their GPU work is a fraction of a millisecond): a forward is
L + 1 launches and three allocations, a backward L + 4 launches, a handful of allocations and views.

Memory besides x, out and their gradients: the low-passes (1/3 of x's elements in 2D, 1/7 in 3D), the processed
sub-bands of levels 2..L during the forward pass and their gradients during the backward pass (as many again each),
and during the backward pass the output gradient's low-passes until the input gradient is allocated.
These coarse tensors are float32 whatever x's dtype: in bfloat16 only x, out and their gradients are rounded.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
from torch import Tensor
from torch.autograd.function import once_differentiable

from regkit_kernels.wtconv._tile import _wgrad_finalize_kernel
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
    wgrad_block: int  # positions per step of the weight-gradient kernel (times the in-plane taps)
    wgrad_programs: int  # level-1 weight-gradient programs wanted per multiprocessor (sets the span of a program)
    wgrad_warps: int


# One table picks the 2D or 3D kernels. Block sizes: the best of small sweeps on an H200 (docs/wtconv_notes.md). The
# weight-gradient kernel is latency-bound: small tiles (fewer registers, more warps), and enough programs for several
# waves, so that the last wave's idle multiprocessors cost little.
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
        32,
        4,
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
        32,
        4,
    ),
}
_NUM_WARPS = 4
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


def _offsets(x: Tensor, sizes: Sequence[Sequence[int]], per_position: int) -> list[int]:
    """Element offsets of consecutive ``[B, C, per_position, *size]`` tensors in one buffer, then the total."""
    planes, offsets = x.shape[0] * x.shape[1] * per_position, [0]
    for size in sizes:
        offsets.append(offsets[-1] + planes * math.prod(size))
    return offsets


def _check(x: Tensor) -> None:
    if x.dim() - 2 not in _KERNELS:
        raise ValueError(f"expected x (B, C, *spatial) with 2 or 3 spatial axes, got {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"the fused WTConv takes float32, bfloat16 or float16, got {x.dtype}")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the fused WTConv needs CUDA tensors (or TRITON_INTERPRET=1 with CPU tensors)")


def _pyramid(
    kern: _Kernels, level_kernel: triton.JITFunction, src: Tensor, weights: Sequence[Tensor],
    scales: Sequence[Tensor], sizes: list[tuple[int, ...]], k: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Levels 2..L of the forward (``level_kernel`` = level_fwd, ``src`` = x) or of the backward (level_bwd, dy):
    returns the float32 low-passes of levels 1..L-1 of ``src``, one buffer, and the sub-bands of levels 2..L (processed,
    or their gradients), another."""
    levels = len(sizes) - 1
    batch, channels = src.shape[:2]
    lows = _offsets(src, sizes[1:levels], 1)
    coarse = _offsets(src, sizes[2:], 2 ** (src.dim() - 2))
    low = src.new_empty(lows[-1], dtype=torch.float32)
    bands = src.new_empty(coarse[-1], dtype=torch.float32)
    if levels > 1:
        _launch(kern.lowpass, src, kern.block, sizes[1], src, low, batch, channels, *sizes[0], *sizes[1])
    for j in range(2, levels + 1):  # level j also writes the low-pass that level j + 1 reads
        _launch(
            level_kernel, src, kern.block, sizes[j], low[lows[j - 2] :], weights[j - 1], scales[j - 1],
            bands[coarse[j - 2] :], low[lows[j - 1] :] if j < levels else low, batch, channels, *sizes[j - 1],
            *sizes[j], math.prod(sizes[j]) * (j < levels), K=k,
        )  # fmt: skip
    return low, bands


def wtconv_fwd(
    x: Tensor, base_weight: Tensor, base_bias: Tensor | None, base_scale: Tensor, weights: Sequence[Tensor],
    scales: Sequence[Tensor],
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Forward pass on the layer's parameters (contiguous, any float dtype).

    Args:
        x: ``(B, C, *S)``, contiguous.
        base_weight: ``(C, 1, *[k] * ndim)``; ``base_bias``: ``(C,)`` or None; ``base_scale``: C elements.
        weights, scales: per level, ``(C * 2**ndim, 1, *[k] * ndim)`` kernels and ``C * 2**ndim`` scales.

    Returns the output and the float32 raw low-passes of levels 1..L-1, one buffer (kept for :func:`wtconv_bwd`).
    """
    _check(x)
    ndim, (batch, channels), levels = x.dim() - 2, x.shape[:2], len(weights)
    kern, k = _KERNELS[ndim], base_weight.shape[-1]
    sizes = _level_sizes(x.shape[2:], levels)
    low, coarse = _pyramid(kern, kern.level_fwd, x, weights, scales, sizes, k)
    out = torch.empty_like(x)
    bias = base_scale if base_bias is None else base_bias
    _launch(
        kern.fwd, x, kern.block, sizes[1], x, base_weight, bias, base_scale, weights[0], scales[0], coarse, out,
        batch, channels, *sizes[0], *sizes[1], LEVELS=levels, K=k, HAS_BIAS=base_bias is not None,
    )  # fmt: skip
    return out, low


@functools.cache
def _multiprocessors(device: int | None) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _wgrad_tiling(x: Tensor, kern: _Kernels, positions: int, programs_per_share: int) -> tuple[int, int]:
    """Block (positions per step) and span ((batch item, position) pairs per program, a power-of-2 multiple of the
    block) of the weight-gradient kernel: the span gives level 1 at least ``kern.wgrad_programs`` programs per
    multiprocessor. On the CPU, one block and one program per level and channel."""
    if x.device.type != "cuda":
        return _pow2(positions), _pow2(positions)
    wanted = kern.wgrad_programs * _multiprocessors(x.device.index)
    span = positions * programs_per_share // wanted
    return kern.wgrad_block, max(kern.wgrad_block, 1 << max(span, 1).bit_length() - 1)


def wtconv_bwd(
    grad_out: Tensor, x: Tensor, low: Tensor, base_weight: Tensor, base_bias: Tensor | None, base_scale: Tensor,
    weights: Sequence[Tensor], scales: Sequence[Tensor],
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Backward pass of :func:`wtconv_fwd` (``low`` is its second result). Returns the gradient of x and, in one
    float32 buffer, those of the parameters: level weights ``[L, C * 2**ndim, k**ndim]``, level scales
    ``[L, C * 2**ndim]``, base weights ``[C, k**ndim]``, base scale ``[C]`` and bias ``[C]``, one after the other."""
    ndim, (batch, channels), levels = x.dim() - 2, x.shape[:2], len(weights)
    kern, k = _KERNELS[ndim], base_weight.shape[-1]
    sizes = _level_sizes(x.shape[2:], levels)
    glow, coarse = _pyramid(kern, kern.level_bwd, grad_out, weights, scales, sizes, k)

    # Weight gradients (before the input gradient, so that the gradient's low-passes are freed first).
    nb, taps = 2**ndim, k**ndim
    positions = [batch * math.prod(s) for s in sizes[1:]]  # (batch item, position) pairs per channel and level
    programs_per_share = channels * (k if ndim == 3 else 1)
    block, span = _wgrad_tiling(x, kern, positions[0], programs_per_share)
    rows = [-(-n // span) for n in positions]
    part = x.new_empty((sum(rows) * nb + rows[0]) * channels * taps + rows[0] * channels, dtype=torch.float32)
    programs = sum(rows) * programs_per_share
    kern.wgrad[(programs,)](
        grad_out, x, glow, low, part, batch, channels, *x.shape[2:], span, LEVELS=levels, K=k,
        TAPS=_pow2(k * k), BLOCK=block, num_warps=kern.wgrad_warps,
    )  # fmt: skip
    del glow
    grads = torch.empty(levels * channels * nb * (taps + 1) + channels * (taps + 2), device=x.device)
    bias = base_scale if base_bias is None else base_bias
    _wgrad_finalize_kernel[(channels, levels + 1)](
        part, torch.stack(list(weights)), torch.stack(list(scales)), base_weight, base_scale, bias, grads, batch,
        channels,
        *((1,) * (3 - ndim)), *x.shape[2:], span, LEVELS=levels, NB=nb, KT=taps, TAPS=_pow2(taps),
        HAS_BIAS=base_bias is not None, num_warps=_NUM_WARPS,
    )  # fmt: skip

    grad_x = torch.empty_like(x)
    _launch(
        kern.bwd, x, kern.block, sizes[1], grad_out, base_weight, base_scale, weights[0], scales[0], coarse, grad_x,
        batch, channels, *sizes[0], *sizes[1], LEVELS=levels, K=k,
    )  # fmt: skip
    return grad_x, grads


class WTConvFunction(torch.autograd.Function):
    """Autograd face of :func:`wtconv_fwd` / :func:`wtconv_bwd` on the layer's own parameters."""

    @staticmethod
    def forward(ctx, x: Tensor, base_weight: Tensor, base_bias: Tensor | None, base_scale: Tensor, *levels: Tensor):
        num = len(levels) // 2
        out, low = wtconv_fwd(x, base_weight, base_bias, base_scale, levels[:num], levels[num:])
        ctx.save_for_backward(x, low, base_weight, base_bias, base_scale, *levels)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        x, low, base_weight, base_bias, base_scale, *levels = ctx.saved_tensors
        num = len(levels) // 2
        weights, scales = levels[:num], levels[num:]
        grad_x, grads = wtconv_bwd(grad_out.contiguous(), x, low, base_weight, base_bias, base_scale, weights, scales)
        # Views of the one gradient buffer, in the parameters' shapes (and dtypes).
        n_w, n_s, channels = weights[0].numel(), scales[0].numel(), base_weight.shape[0]
        n_b = base_weight.numel()
        ends = [num * n_w, num * (n_w + n_s), num * (n_w + n_s) + n_b, num * (n_w + n_s) + n_b + channels]
        grad_w = grads[: ends[0]].view(num, *weights[0].shape).unbind(0)
        grad_s = grads[ends[0] : ends[1]].view(num, *scales[0].shape).unbind(0)
        grad_base = grads[ends[1] : ends[2]].view(base_weight.shape)
        grad_base_s = grads[ends[2] : ends[3]].view(base_scale.shape)
        grad_bias = None if base_bias is None else grads[ends[3] :]
        params = (base_weight, base_bias, base_scale, *levels)
        results = (grad_base, grad_bias, grad_base_s, *grad_w, *grad_s)
        return grad_x, *(
            g if g is None or g.dtype == p.dtype else g.to(p.dtype) for g, p in zip(results, params, strict=True)
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
    return WTConvFunction.apply(
        x.contiguous(),
        base_weight.contiguous(),
        base_bias,
        base_scale,
        *(w.contiguous() for w in wavelet_weights),
        *wavelet_scales,
    )

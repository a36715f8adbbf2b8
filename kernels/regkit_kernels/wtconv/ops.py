"""Fused WTConv, 2D and 3D: launchers, the autograd Function and the functional entry point.

The layer (see ``regkit.features.wtconv``) is computed with three reformulations that cut memory traffic:

1. Haar analysis on chip: a level's sub-bands are recomputed from the previous level's raw low-pass inside the tap
   loop of the level's depthwise convolution and never written. Level 1 reads x itself; the raw low-passes of levels
   1..L-1 (a quarter, a sixteenth, ... of x in 2D; by a kernel that halves tiles in registers, a few levels per
   launch) are kept for the backward pass.
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
the sub-band gradients, written once. The weight gradients of all levels come from one launch, a program per channel,
share of the positions and tap row: products of the recomputed sub-bands of the gradient and of the input are
accumulated in registers and summed once into a row of partial sums (each block of the tap row is loaded once per
position, in 2D once per pair of neighbouring positions, and feeds every tap column; in 2D level 1's pixels also feed
the base conv's sums); programs appended to the input gradient's launch add the rows up and write the gradients of
every weight, scale and the bias (deterministic, no atomics).

Launches: the low-passes take ceil((L - 1) / LOWPASS_DEPTH) launches each way; besides them a forward pass is two (all
levels 2..L, the output) and a backward pass two in 2D (the levels' sub-band gradients together with the weight-gradient
partial sums; the input gradient together with the final sums of the parameter gradients; in 3D the levels' backward is
a third), whatever the number of levels. The level weights and scales are concatenated once per forward (one small copy)
so that every kernel finds all levels' parameters behind one pointer. Host work matters at the small WTConvNeXt stages
(their GPU work is a fraction of a millisecond): sizes, grids and tilings are computed once per shape (``launch_plan``).

Memory besides x, out and their gradients: the low-passes (1/3 of x's elements in 2D, 1/7 in 3D), the processed
sub-bands of levels 2..L during the forward pass and their gradients during the backward pass (as many again each),
and during the backward pass the output gradient's low-passes until the input gradient is allocated.
These coarse tensors are float32 whatever x's dtype: in bfloat16 only x, out and their gradients are rounded.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
from torch import Tensor
from torch.autograd.function import once_differentiable

from regkit_kernels.launch import interpreter_on, pow2
from regkit_kernels.wtconv import kernels2d, kernels3d


@dataclass(frozen=True, kw_only=True)
class Kernels:
    """The kernels of one dimensionality (2D or 3D) and their launch settings: an entry of :data:`KERNELS`."""

    lowpasses: triton.JITFunction
    levels: triton.JITFunction
    fwd: triton.JITFunction
    wgrad: triton.JITFunction  # the weight-gradient partial sums (and the levels' backward, see wgrad_levels)
    bwd: triton.JITFunction  # the input gradient and the parameter gradients' final sums
    wgrad_levels: bool  # the levels' backward runs in the weight-gradient launch (2D; in 3D it would halve the
    # occupancy of that kernel, whose tiles need far fewer registers than the 3D level convolutions)
    block: int  # positions per program of the convolution kernels
    num_warps: int  # warps per program of every kernel but the weight-gradient one
    wgrad_block: int  # elements (see wgrad_pair) per step of the weight-gradient kernel; at least 32 * wgrad_warps,
    # so that the tap axis of its tiles lies within a thread
    wgrad_programs: int  # level-1 weight-gradient programs wanted per multiprocessor (sets the span of a program)
    wgrad_warps: int
    wgrad_maxnreg: int | None  # a register cap for the weight-gradient kernel (None: the compiler's choice)
    base_slots: int  # partial sums of the base weights per share (the kernels' BASE_SLOTS)
    wgrad_pair: int  # positions along x per element of a weight-gradient step (the kernels' WGRAD_PAIR)


# Block sizes: the best of small sweeps on an H200 (benchmarks/results/wtconv-h200.md). The weight-gradient kernels are
# latency-bound: enough programs for several waves, so that the last wave's idle multiprocessors cost little; one
# element per thread.
KERNELS = {
    2: Kernels(
        lowpasses=kernels2d.haar_lowpasses2d_kernel,
        levels=kernels2d.wtconv2d_levels_kernel,
        fwd=kernels2d.wtconv2d_fwd_kernel,
        wgrad=kernels2d.wtconv2d_wgrad_kernel,
        bwd=kernels2d.wtconv2d_bwd_kernel,
        wgrad_levels=True,
        block=256,
        num_warps=4,
        wgrad_block=128,
        wgrad_programs=32,
        wgrad_warps=4,
        wgrad_maxnreg=None,
        base_slots=kernels2d.BASE_SLOTS.value,
        wgrad_pair=kernels2d.WGRAD_PAIR.value,
    ),
    3: Kernels(
        lowpasses=kernels3d.haar_lowpasses3d_kernel,
        levels=kernels3d.wtconv3d_levels_kernel,
        fwd=kernels3d.wtconv3d_fwd_kernel,
        wgrad=kernels3d.wtconv3d_wgrad_kernel,
        bwd=kernels3d.wtconv3d_bwd_kernel,
        wgrad_levels=False,
        block=256,
        num_warps=4,
        wgrad_block=128,
        wgrad_programs=32,
        wgrad_warps=4,
        wgrad_maxnreg=None,
        base_slots=kernels3d.BASE_SLOTS.value,
        wgrad_pair=kernels3d.WGRAD_PAIR.value,
    ),
}
"""The one table that picks the 2D or 3D kernels, by the number of spatial axes."""
INTERPRETER_BLOCK = 1 << 14
"""Positions per program under Triton's interpreter, where every program costs Python overhead: CPU runs take one
large tile per channel. Read by :func:`launch_plan` (a test lowers it, with ``launch_plan.cache_clear()``, to reach
the GPU's tilings)."""
LOWPASS_DEPTH = 2
"""Low-pass levels per launch (the first launch reads x, the next the deepest low-pass it wrote, ...): a tile halved
in registers more often needs more barriers and layout shuffles per program. H200, graphed step at WTConvNeXt stages
1 and 2: 1 level per launch 1.955 / 1.021 ms, 2 levels 1.928 / 1.006, all (4 and 3) 2.097 / 1.218."""
_LOWPASS_TILE = 1024  # elements of a low-pass program's tile on the GPU
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _side(n: int, unit: int, cap: int) -> int:
    """The power-of-2 multiple of ``unit``, at most ``cap`` (or ``unit``), that covers ``n`` with the least padding
    (the larger on ties)."""
    best = side = unit
    while side * 2 <= cap:
        side *= 2
        if _cdiv(n, side) * side <= _cdiv(n, best) * best:
            best = side
    return best


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything about a launch sequence that depends only on x's shape, the number of levels and the device."""

    sizes: list[tuple[int, ...]]  # grid sizes of levels 0..L (each halves every axis, rounding up)
    low_numel: int  # elements of the low-passes of levels 1..L-1, one after the other
    coarse_numel: int  # elements of the sub-bands of levels 2..L, one after the other
    lowpass_steps: list[LowpassStep]
    level_block: int
    level_programs: int  # programs of levels 2..L
    block: int
    dx_programs: int  # programs of the output and input-gradient kernels
    wgrad_block: int
    span: int  # (batch item, element) indices per weight-gradient program
    wgrad_programs: int
    part_numel: int  # weight-gradient partial sums
    grads_numel: int  # parameter gradients


@dataclass(frozen=True, kw_only=True)
class LowpassStep:
    """One launch of the low-pass kernel: levels ``first + 1 .. first + depth`` from level ``first``'s low-pass (x's
    when ``first`` is 0), read at ``src_offset`` of the low-pass buffer and written from ``dst_offset`` on."""

    first: int
    depth: int
    src_offset: int
    dst_offset: int
    grid: int
    tile: dict[str, int]  # NP, (TZ,) TY, TX


@functools.cache
def _multiprocessors(device: int | None) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def wgrad_tiling(kern: Kernels, elements: int, per_share: int, device: torch.device) -> tuple[int, int]:
    """Block (elements per step) and span ((batch item, element) indices per program, a power-of-2 multiple of the
    block) of the weight-gradient kernel, given level 1's indices per channel and the programs per share: the span gives
    level 1 at least ``kern.wgrad_programs`` programs per multiprocessor. On the CPU, one block and one program per
    level and channel."""
    if device.type != "cuda":
        return pow2(elements), pow2(elements)
    wanted = kern.wgrad_programs * _multiprocessors(device.index)
    return kern.wgrad_block, max(kern.wgrad_block, 1 << max(elements * per_share // wanted, 1).bit_length() - 1)


@functools.lru_cache(maxsize=256)
def launch_plan(shape: tuple[int, ...], levels: int, k: int, device: torch.device) -> Plan:
    """The launch plan of the fused layer on x of ``shape`` (see :class:`Plan`); on the CPU (the interpreter), few
    large tiles."""
    ndim, (batch, channels), kern = len(shape) - 2, shape[:2], KERNELS[len(shape) - 2]
    cuda, nb, taps = device.type == "cuda", 2**ndim, k**ndim
    sizes = [tuple(-(-s // 2**j) for s in shape[2:]) for j in range(levels + 1)]
    planes = batch * channels
    counts = [math.prod(s) for s in sizes]  # positions per plane, by level

    budget, steps, offsets = _LOWPASS_TILE if cuda else INTERPRETER_BLOCK, [], [0]
    for j in range(1, levels):  # element offsets of the low-passes of levels 1..L-1 in their buffer
        offsets.append(offsets[-1] + planes * counts[j])
    for first in range(0, levels - 1, LOWPASS_DEPTH):
        depth = min(LOWPASS_DEPTH, levels - 1 - first)
        unit, sides = 2**depth, list[int]()
        for n in reversed(sizes[first]):  # x, y(, z): each side takes what the tile budget leaves
            sides.insert(0, _side(n, unit, max(unit, min(64 if cuda else budget, budget // math.prod(sides)))))
        np_ = min(max(1, budget // math.prod(sides)), pow2(planes))
        grid = _cdiv(planes, np_) * math.prod(_cdiv(n, t) for n, t in zip(sizes[first], sides, strict=True))
        tile = {"NP": np_, **dict(zip(("TZ", "TY", "TX")[3 - ndim :], sides, strict=True))}
        source = offsets[first - 1] if first else 0
        steps.append(
            LowpassStep(first=first, depth=depth, src_offset=source, dst_offset=offsets[first], grid=grid, tile=tile)
        )

    def block_for(positions: int) -> int:
        return kern.block if cuda else min(INTERPRETER_BLOCK, pow2(positions))

    level_block = block_for(batch * counts[2]) if levels > 1 else 1
    level_programs = sum(channels * _cdiv(batch * counts[j], level_block) for j in range(2, levels + 1))
    block = block_for(batch * counts[1])

    # (batch item, element) indices per channel and level, an element being kern.wgrad_pair positions along x
    elements = [batch * math.prod(s[:-1]) * _cdiv(s[-1], kern.wgrad_pair) for s in sizes[1:]]
    per_share = channels * k ** (ndim - 1)  # programs per share: one per tap row
    wgrad_block, span = wgrad_tiling(kern, elements[0], per_share, device)
    rows = [_cdiv(n, span) for n in elements]
    return Plan(
        sizes=sizes,
        low_numel=offsets[-1],
        coarse_numel=planes * nb * sum(counts[2:]),
        lowpass_steps=steps,
        level_block=level_block,
        level_programs=level_programs,
        block=block,
        dx_programs=channels * _cdiv(batch * counts[1], block),
        wgrad_block=wgrad_block,
        span=span,
        wgrad_programs=sum(rows) * per_share,
        part_numel=(sum(rows) * nb + rows[0] * kern.base_slots) * channels * taps + rows[0] * channels,
        grads_numel=levels * channels * nb * (taps + 1) + channels * (taps + 2),
    )


def _check(x: Tensor) -> None:
    if x.dim() - 2 not in KERNELS:
        raise ValueError(f"expected x (B, C, *spatial) with 2 or 3 spatial axes, got {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"the fused WTConv takes float32, bfloat16 or float16, got {x.dtype}")
    if x.device.type != "cuda" and not interpreter_on():
        raise ValueError("the fused WTConv needs CUDA tensors (or TRITON_INTERPRET=1 with CPU tensors)")


def level_params(weights: Sequence[Tensor], scales: Sequence[Tensor]) -> Tensor:
    """The level weights ``[L, C * 2**ndim, k**ndim]`` then the level scales ``[L, C * 2**ndim]``, one flat tensor:
    the layout in which the kernels read every level's parameters (a copy, one small launch)."""
    return torch.cat([*(w.reshape(-1) for w in weights), *(s.reshape(-1) for s in scales)])


def _lowpasses(kern: Kernels, plan: Plan, src: Tensor) -> Tensor:
    """The float32 raw low-passes of levels 1..L-1 of ``src`` (x or the output gradient), one buffer."""
    low = src.new_empty(plan.low_numel, dtype=torch.float32)
    for step in plan.lowpass_steps:
        kern.lowpasses[(step.grid,)](
            low[step.src_offset :] if step.first else src, low[step.dst_offset :] if step.first else low,
            src.shape[0] * src.shape[1], *plan.sizes[step.first], DEPTH=step.depth, num_warps=kern.num_warps,
            **step.tile,
        )  # fmt: skip
    return low


def wtconv_fwd(
    x: Tensor, base_weight: Tensor, base_bias: Tensor | None, base_scale: Tensor, params: Tensor, levels: int
) -> tuple[Tensor, Tensor]:
    """Forward pass on the layer's parameters (contiguous, any float dtype).

    Args:
        x: ``(B, C, *S)``, contiguous.
        base_weight: ``(C, 1, *[k] * ndim)``; ``base_bias``: ``(C,)`` or None; ``base_scale``: C elements.
        params: every level's weights and scales, from :func:`level_params`; ``levels``: their number L.

    Returns the output and the float32 raw low-passes of levels 1..L-1, one buffer (kept for :func:`wtconv_bwd`).
    """
    _check(x)
    (batch, channels), k = x.shape[:2], base_weight.shape[-1]
    kern, plan = KERNELS[x.dim() - 2], launch_plan(x.shape, levels, k, x.device)
    low = _lowpasses(kern, plan, x)
    coarse = x.new_empty(plan.coarse_numel, dtype=torch.float32)
    if levels > 1:
        kern.levels[(plan.level_programs,)](
            low, params, coarse, batch, channels, *x.shape[2:], LEVELS=levels, K=k, DIR=1, BLOCK=plan.level_block,
            num_warps=kern.num_warps,
        )  # fmt: skip
    out = torch.empty_like(x)
    kern.fwd[(plan.dx_programs,)](
        x, base_weight, base_scale if base_bias is None else base_bias, base_scale, params, coarse, out, batch,
        channels, *plan.sizes[0], *plan.sizes[1], LEVELS=levels, K=k, HAS_BIAS=base_bias is not None,
        BLOCK=plan.block, num_warps=kern.num_warps,
    )  # fmt: skip
    return out, low


def wtconv_bwd(
    grad_out: Tensor, x: Tensor, low: Tensor, base_weight: Tensor, base_bias: Tensor | None, base_scale: Tensor,
    params: Tensor, levels: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Backward pass of :func:`wtconv_fwd` (``low`` is its second result). Returns the gradient of x and, in one
    float32 buffer, those of the parameters: level weights ``[L, C * 2**ndim, k**ndim]``, level scales
    ``[L, C * 2**ndim]``, base weights ``[C, k**ndim]``, base scale ``[C]`` and bias ``[C]``, one after the other."""
    ndim, (batch, channels), k = x.dim() - 2, x.shape[:2], base_weight.shape[-1]
    kern, plan = KERNELS[ndim], launch_plan(x.shape, levels, k, x.device)
    glow = _lowpasses(kern, plan, grad_out)
    coarse = x.new_empty(plan.coarse_numel, dtype=torch.float32)
    part = x.new_empty(plan.part_numel, dtype=torch.float32)
    consts = {
        "LEVELS": levels, "K": k, "KP": pow2(k), "BLOCK": plan.wgrad_block, "num_warps": kern.wgrad_warps,
        "maxnreg": kern.wgrad_maxnreg,
    }  # fmt: skip
    if kern.wgrad_levels:
        kern.wgrad[(plan.level_programs + plan.wgrad_programs,)](
            grad_out, x, glow, low, params, coarse, part, batch, channels, *x.shape[2:], plan.span,
            plan.level_programs, LEVEL_BLOCK=plan.level_block, **consts,
        )  # fmt: skip
    else:
        if levels > 1:
            kern.levels[(plan.level_programs,)](
                glow, params, coarse, batch, channels, *x.shape[2:], LEVELS=levels, K=k, DIR=-1,
                BLOCK=plan.level_block, num_warps=kern.num_warps,
            )  # fmt: skip
        kern.wgrad[(plan.wgrad_programs,)](
            grad_out, x, glow, low, part, batch, channels, *x.shape[2:], plan.span, **consts
        )  # fmt: skip
    del glow  # freed before the input gradient is allocated
    grads = x.new_empty(plan.grads_numel, dtype=torch.float32)
    grad_x = torch.empty_like(x)
    kern.bwd[(plan.dx_programs + channels * (levels + 1),)](
        grad_out, base_weight, base_scale, base_scale if base_bias is None else base_bias, params, coarse, grad_x,
        part, grads, batch, channels, *plan.sizes[0], *plan.sizes[1], plan.span, plan.dx_programs, LEVELS=levels,
        K=k, HAS_BIAS=base_bias is not None, TAPS=pow2(k**ndim), BLOCK=plan.block, num_warps=kern.num_warps,
    )  # fmt: skip
    return grad_x, grads


class WTConvFunction(torch.autograd.Function):
    """Autograd face of :func:`wtconv_fwd` / :func:`wtconv_bwd` on the layer's own parameters."""

    @staticmethod
    def forward(ctx, x: Tensor, base_weight: Tensor, base_bias: Tensor | None, base_scale: Tensor, *levels: Tensor):
        num = len(levels) // 2
        params = level_params(levels[:num], levels[num:])
        out, low = wtconv_fwd(x, base_weight, base_bias, base_scale, params, num)
        ctx.save_for_backward(x, low, params, base_weight, base_bias, base_scale)
        ctx.level_shapes = levels[0].shape, levels[num].shape
        ctx.dtypes = tuple(None if p is None else p.dtype for p in (base_weight, base_bias, base_scale, *levels))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        x, low, params, base_weight, base_bias, base_scale = ctx.saved_tensors
        (w_shape, s_shape), num, channels = ctx.level_shapes, len(ctx.dtypes) // 2 - 1, base_weight.shape[0]
        grad_x, grads = wtconv_bwd(grad_out.contiguous(), x, low, base_weight, base_bias, base_scale, params, num)
        # Views of the one gradient buffer, in the parameters' shapes (and dtypes).
        flat = grads.split(
            [w_shape.numel()] * num + [s_shape.numel()] * num + [base_weight.numel(), channels, channels]
        )
        results = (
            flat[-3].view(base_weight.shape),
            None if base_bias is None else flat[-1],
            flat[-2].view(base_scale.shape),
            *(g.view(w_shape) for g in flat[:num]),
            *(g.view(s_shape) for g in flat[num : 2 * num]),
        )
        return grad_x, *(
            g if g is None or g.dtype == dtype else g.to(dtype) for g, dtype in zip(results, ctx.dtypes, strict=True)
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
        x.contiguous(), base_weight.contiguous(), base_bias, base_scale, *wavelet_weights, *wavelet_scales
    )

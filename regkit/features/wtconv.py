"""Wavelet convolution (WTConv) layers in 2D and 3D: the semantics of Finder et al., "Wavelet Convolutions for Large
Receptive Fields" (ECCV 2024), as a readable PyTorch reference and, through ``backend``, fused Triton kernels.

Tensors are ``(B, C, *spatial)`` with spatial layout ``[y, x]`` or ``[z, y, x]``. One layer computes

    out = base_scale * (depthwise_conv_k(x) + bias) + reconstruction,

where the reconstruction comes from a Haar (db1) wavelet cascade of ``levels`` levels: level i pads the previous
level's raw low-pass with one zero on the far side of every odd axis, splits it into 2**ndim orthonormal sub-bands,
convolves each sub-band with its own depthwise k x k (x k) kernel (no bias) and multiplies it by a per-channel scale
(initialised to 0.1); the next level takes the raw low-pass (before the convolution). The synthesis runs from the
deepest level up, adding each level's reconstruction to the processed low-pass of the level above, and crops back to
the size before padding. The parameter names and shapes are those of the authors' ``WTConv2d``, so their checkpoints
load (the fixed Haar filters they store, ``wt_filter`` and ``iwt_filter``, are dropped on load).

Sub-band order: bit ``a`` of the sub-band index is set for the high-pass along spatial axis ``a`` (axis 0 first). In
2D that is LL, LH (high along y), HL (high along x), HH, the order of ``pywt.dwt2`` and of the authors' layer; sub-band
``b`` of channel ``c`` is channel ``c * 2**ndim + b`` of the level's depthwise convolution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import EllipsisType
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from regkit._backend import load_kernels, resolve_backend

# One table picks the 2D or 3D operators (as MONAI's ``Conv[Conv.CONV, dim]``).
_CONV_FN = {2: F.conv2d, 3: F.conv3d}
_CONV_MODULE: dict[int, type[nn.Conv2d] | type[nn.Conv3d]] = {2: nn.Conv2d, 3: nn.Conv3d}

_BASE_SCALE_INIT = 1.0
_WAVELET_SCALE_INIT = 0.1
# Dtypes the fused kernels take (fp32 accumulation); anything else (float64 for gradcheck) runs the reference.
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def haar_analysis(x: Tensor) -> Tensor:
    """One level of the orthonormal Haar (db1) analysis over the spatial axes of ``x`` ``(B, C, *S)``, S all even.

    Returns ``(B, C, 2**ndim, *S/2)``: sub-band ``b`` is the high-pass along spatial axis ``a`` where bit ``a`` of ``b``
    is set, else the low-pass; each 1D step maps a pair (u, v) to ((u + v), (u - v)) / sqrt(2).
    """
    bands = x.unsqueeze(2)
    for axis in range(x.dim() - 2):
        dim = 3 + axis
        even, odd = bands[_every_other(dim, 0)], bands[_every_other(dim, 1)]
        bands = torch.cat(((even + odd) * math.sqrt(0.5), (even - odd) * math.sqrt(0.5)), dim=2)
    return bands


def haar_synthesis(bands: Tensor) -> Tensor:
    """Inverse (= adjoint) of :func:`haar_analysis`: ``(B, C, 2**ndim, *S)`` to ``(B, C, *2S)``."""
    ndim = bands.dim() - 3
    for axis in reversed(range(ndim)):
        dim = 3 + axis
        low, high = bands.chunk(2, dim=2)
        even, odd = (low + high) * math.sqrt(0.5), (low - high) * math.sqrt(0.5)
        bands = torch.stack((even, odd), dim=dim + 1).flatten(dim, dim + 1)
    return bands.squeeze(2)


def _every_other(dim: int, start: int) -> tuple[slice, ...]:
    return (slice(None),) * dim + (slice(start, None, 2),)


def wtconv_reference(
    x: Tensor,
    base_weight: Tensor,
    base_bias: Tensor | None,
    base_scale: Tensor,
    wavelet_weights: Sequence[Tensor],
    wavelet_scales: Sequence[Tensor],
) -> Tensor:
    """The WTConv layer in plain PyTorch (the specification; see the module docstring for the semantics).

    Args:
        x: ``(B, C, *S)`` with 2 or 3 spatial axes.
        base_weight: ``(C, 1, *[k] * ndim)`` depthwise kernel, k odd; ``base_bias``: ``(C,)`` or None.
        base_scale: ``(1, C, *[1] * ndim)``.
        wavelet_weights: one ``(C * 2**ndim, 1, *[k] * ndim)`` kernel per level (finest first).
        wavelet_scales: one ``(1, C * 2**ndim, *[1] * ndim)`` scale per level.
    """
    ndim = x.dim() - 2
    conv = _CONV_FN[ndim]
    channels = x.shape[1]
    pad = base_weight.shape[-1] // 2
    processed: list[tuple[Tensor, tuple[int, ...]]] = []
    low = x
    for weight, scale in zip(wavelet_weights, wavelet_scales, strict=True):
        size = tuple(low.shape[2:])
        low = F.pad(low, [p for s in reversed(size) for p in (0, s % 2)])
        bands = haar_analysis(low)
        low = bands[:, :, 0]
        z = conv(bands.flatten(1, 2), weight, padding=pad, groups=weight.shape[0]) * scale
        processed.append((z.unflatten(1, (channels, 2**ndim)), size))
    reconstruction: Tensor | None = None
    for z, size in reversed(processed):
        if reconstruction is not None:
            z = torch.cat((z[:, :, :1] + reconstruction.unsqueeze(2), z[:, :, 1:]), dim=2)
        crop: tuple[EllipsisType | slice, ...] = (..., *(slice(0, s) for s in size))
        reconstruction = haar_synthesis(z)[crop]
    assert reconstruction is not None  # levels >= 1
    return base_scale * conv(x, base_weight, base_bias, padding=pad, groups=channels) + reconstruction


def wtconv(
    x: Tensor,
    base_weight: Tensor,
    base_bias: Tensor | None,
    base_scale: Tensor,
    wavelet_weights: Sequence[Tensor],
    wavelet_scales: Sequence[Tensor],
    backend: str = "auto",
) -> Tensor:
    """The WTConv layer with a chosen backend: ``"reference"`` (:func:`wtconv_reference`), ``"triton"`` (the fused
    kernels of ``regkit_kernels.wtconv``) or ``"auto"`` (Triton for CUDA tensors in float32/bfloat16/float16 when the
    kernels import, else the reference). Arguments as in :func:`wtconv_reference`; the result is the same up to
    rounding."""
    ndim = x.dim() - 2
    if ndim not in _CONV_FN or base_weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"expected x (B, {base_weight.shape[0]}, *spatial) with 2 or 3 spatial axes, got {tuple(x.shape)}"
        )
    if backend == "auto" and x.dtype not in _FUSED_DTYPES:
        backend = "reference"
    if resolve_backend(backend, x.device, "wtconv", faces=("reference", "triton")) == "triton":
        fused = load_kernels("wtconv").wtconv_fused
        return fused(x, base_weight, base_bias, base_scale, wavelet_weights, wavelet_scales)
    return wtconv_reference(x, base_weight, base_bias, base_scale, wavelet_weights, wavelet_scales)


class _Scale(nn.Module):
    """A learned per-channel factor ``weight`` of shape ``(1, C, 1, ...)`` (the authors' ``_ScaleModule``)."""

    def __init__(self, channels: int, ndim: int, init: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((1, channels) + (1,) * ndim, init))


class _WTConvNd(nn.Module):
    """Shared body of :class:`WTConv2d` and :class:`WTConv3d`."""

    ndim: ClassVar[int]
    base_conv: nn.Conv2d | nn.Conv3d
    base_scale: _Scale

    def __init__(
        self, channels: int, kernel_size: int = 5, levels: int = 1, bias: bool = True, backend: str = "auto"
    ) -> None:
        super().__init__()
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd integer, got {kernel_size}")
        if levels < 1:
            raise ValueError(f"levels must be at least 1, got {levels}")
        conv, sub = _CONV_MODULE[self.ndim], channels * 2**self.ndim
        self.channels, self.kernel_size, self.levels, self.backend = channels, kernel_size, levels, backend
        self.base_conv = conv(channels, channels, kernel_size, padding=kernel_size // 2, groups=channels, bias=bias)
        self.base_scale = _Scale(channels, self.ndim, _BASE_SCALE_INIT)
        self.wavelet_convs = nn.ModuleList(
            conv(sub, sub, kernel_size, padding=kernel_size // 2, groups=sub, bias=False) for _ in range(levels)
        )
        self.wavelet_scale = nn.ModuleList(_Scale(sub, self.ndim, _WAVELET_SCALE_INIT) for _ in range(levels))
        self._register_load_state_dict_pre_hook(_drop_fixed_filters)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the layer to ``x`` ``(B, C, *spatial)``; the output has the same shape."""
        return wtconv(
            x,
            self.base_conv.weight,
            self.base_conv.bias,
            self.base_scale.weight,
            [cast(Tensor, c.weight) for c in self.wavelet_convs],  # ModuleList items are typed as plain Modules
            [cast(Tensor, s.weight) for s in self.wavelet_scale],
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        return f"{self.channels}, kernel_size={self.kernel_size}, levels={self.levels}, backend={self.backend!r}"


def _drop_fixed_filters(state_dict: dict, prefix: str, *args: object) -> None:
    """Load-time hook: discard the fixed Haar filters that the authors' layer keeps as frozen parameters."""
    for name in ("wt_filter", "iwt_filter"):
        state_dict.pop(prefix + name, None)


class WTConv2d(_WTConvNd):
    """2D wavelet convolution on ``(B, C, H, W)``: depthwise k x k base convolution plus ``levels`` Haar levels.

    Args:
        channels: C (input and output channels).
        kernel_size: odd k of every depthwise kernel (5 in WTConvNeXt).
        levels: number of wavelet levels (WTConvNeXt uses 5, 4, 3, 2 by stage).
        bias: whether the base convolution has a bias.
        backend: ``"auto"``, ``"reference"`` or ``"triton"`` (see :func:`wtconv`); not part of the state_dict.
    """

    ndim = 2


class WTConv3d(_WTConvNd):
    """3D wavelet convolution on ``(B, C, D, H, W)`` with 8 Haar sub-bands per level; arguments as :class:`WTConv2d`."""

    ndim = 3


#: The layer class for 2 or 3 spatial axes.
WTConv: dict[int, type[_WTConvNd]] = {2: WTConv2d, 3: WTConv3d}

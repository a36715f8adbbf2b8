"""Similarity measures between a fixed image and a warped moving image, as losses to minimise.

Every measure is an ``nn.Module`` called as ``loss = sim(fixed, warped, mask=None)``:

* ``fixed``, ``warped``: tensors ``(B, C, *spatial)`` of equal shape, 2D (``[y, x]``) or 3D (``[z, y, x]``), on the
  fixed grid, float32 or float64, CPU or CUDA;
* ``mask``: optional weights ``(B or 1, 1, *spatial)`` in [0, 1] (the fixed mask times the warped moving mask) that
  restrict every statistic to the masked region; an all-zero mask (for any batch element) raises ``ImageValueError``;
* the result is a scalar tensor, the mean over batch and channels, differentiable with respect to both images and the
  mask. Constant images give finite values and gradients.

The names are the ones the YAML configuration uses. The loss conventions (all minimised, best value first):

========  =====================================================================================  ==========
name      loss                                                                                   range
========  =====================================================================================  ==========
``mse``   masked mean of ``(fixed - warped)^2``                                                  0 .. inf
``ncc``   ``1 - NCC``: global normalised cross-correlation (signed; contrast must not be inverted) 0 .. 2
``lncc``  ``1 - mean(LNCC^2)``: squared local NCC in a box window (ANTs / VoxelMorph convention)  0 .. 1
``mi``    ``-MI``: mutual information (nats) of a cubic B-spline Parzen joint histogram          -log(bins) .. 0
========  =====================================================================================  ==========

New measures (e.g. the learned ``features`` similarity) join the registry with ``@register_similarity("name")``;
``build_similarity(name, **params)`` builds one from the configuration.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar, TypeVar

import torch
from torch import nn

from regkit.errors import ConfigError, ImageValueError
from regkit.spatial.filters import box_sum, per_axis

# Standardisation floors: the variance gets `_EPS_REL * mean square` added, so that a constant image standardises to
# (nearly) zero instead of amplified rounding noise; `_TINY` keeps square roots and divisions finite for all-zero input.
_EPS_REL = 1e-9
_TINY = 1e-12
# The MI intensity percentiles are estimated from at most this many voxels per image (a regular subsample).
_QUANTILE_SAMPLES = 1 << 16


class Similarity(nn.Module):
    """Base class of the similarity losses; subclasses implement ``_loss(fixed, warped, weights)``."""

    name: ClassVar[str] = ""

    def forward(self, fixed: torch.Tensor, warped: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Loss between ``fixed`` and ``warped`` ``(B, C, *spatial)``, restricted to ``mask`` ``(B|1, 1, *spatial)``."""
        return self._loss(fixed, warped, _weights(fixed, warped, mask))

    def _loss(self, fixed: torch.Tensor, warped: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


SIMILARITIES: dict[str, type[Similarity]] = {}

_S = TypeVar("_S", bound=type[Similarity])


def register_similarity(name: str) -> Callable[[_S], _S]:
    """Class decorator adding a ``Similarity`` subclass to ``SIMILARITIES`` under the configuration name ``name``."""

    def decorate(cls: _S) -> _S:
        if name in SIMILARITIES:
            raise ValueError(f"similarity '{name}' is already registered by {SIMILARITIES[name].__qualname__}")
        cls.name = name
        SIMILARITIES[name] = cls
        return cls

    return decorate


def build_similarity(name: str, **params: object) -> Similarity:
    """Build the similarity registered as ``name`` with keyword ``params``; ConfigError for unknown names/parameters."""
    if name not in SIMILARITIES:
        raise ConfigError(
            f"unknown similarity '{name}'{_suggest(name, SIMILARITIES)}; known: {', '.join(sorted(SIMILARITIES))}"
        )
    cls = SIMILARITIES[name]
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    for key in params:
        if key not in accepted:
            raise ConfigError(
                f"similarity '{name}' has no parameter '{key}'{_suggest(key, accepted)}; "
                f"parameters: {', '.join(accepted) or 'none'}"
            )
    return cls(**params)


def _suggest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _weights(fixed: torch.Tensor, warped: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Check the inputs and return voxel weights ``(B|1, 1, *spatial)`` in the images' dtype (ones without a mask)."""
    if fixed.dim() not in (4, 5) or fixed.shape != warped.shape:
        raise ValueError(
            f"similarity needs fixed and warped of one shape (B, C, *spatial) with 2 or 3 spatial axes, "
            f"got {tuple(fixed.shape)} and {tuple(warped.shape)}"
        )
    if not fixed.is_floating_point() or fixed.dtype != warped.dtype:
        raise ValueError(f"similarity needs floating images of one dtype, got {fixed.dtype} and {warped.dtype}")
    spatial = fixed.shape[2:]
    if mask is None:
        return torch.ones((1, 1, *spatial), dtype=fixed.dtype, device=fixed.device)
    if (
        mask.dim() != fixed.dim()
        or mask.shape[1] != 1
        or mask.shape[2:] != spatial
        or mask.shape[0] not in (1, fixed.shape[0])
    ):
        raise ValueError(f"mask must have shape (B or 1, 1, *{tuple(spatial)}), got {tuple(mask.shape)}")
    weights = mask.to(fixed.dtype)
    if bool((weights.flatten(1).sum(1) <= 0).any()):
        raise ImageValueError("the similarity mask is empty: the fixed and (warped) moving masks share no voxel")
    return weights


def _masked_mean(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted mean over the spatial axes of ``x`` ``(B, C, *spatial)``, shaped ``(B, C, 1, ...)``."""
    dims = tuple(range(2, x.dim()))
    return (x * weights).sum(dims, keepdim=True) / weights.sum(dims, keepdim=True)


def _standardise(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-9 * mean square)`` with masked statistics per batch element and channel.

    NCC and LNCC are invariant to this map (up to the floor), which makes their epsilons dimensionless and keeps the
    box-filter sums well conditioned whatever the intensity units.
    """
    mean = _masked_mean(x, weights)
    centred = x - mean
    var = _masked_mean(centred * centred, weights)
    return centred / torch.sqrt(var + _EPS_REL * (var + mean * mean) + _TINY)


@register_similarity("mse")
class MeanSquaredError(Similarity):
    """Masked mean squared intensity difference (intensities in the images' own units)."""

    def _loss(self, fixed: torch.Tensor, warped: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        diff = fixed - warped
        return _masked_mean(diff * diff, weights).mean()


@register_similarity("ncc")
class NormalizedCrossCorrelation(Similarity):
    """``1 - NCC`` with NCC the masked global normalised cross-correlation, in [-1, 1].

    Invariant to positive affine intensity changes of either image; 0 for identical images.
    """

    def _loss(self, fixed: torch.Tensor, warped: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ncc = _masked_mean(_standardise(fixed, weights) * _standardise(warped, weights), weights)
        return 1.0 - ncc.mean()


@register_similarity("lncc")
class LocalNormalizedCrossCorrelation(Similarity):
    """``1 - mean(cc^2)`` with ``cc`` the normalised cross-correlation in a box window centred on each voxel.

    Args:
        window: odd window size in voxels, one number or one per axis in index order (x, y[, z]).
        eps: added to each local variance (images are first standardised globally, so it is relative to the global
            variance); damps flat regions, where ``cc^2`` goes to 0.

    Window statistics are weighted by the mask and ignore voxels outside the image; the mean of ``cc^2`` is weighted by
    the mask. Box sums come from cumulative sums, so the cost does not grow with the window.
    """

    def __init__(self, window: int | Sequence[int] = 9, eps: float = 1e-5) -> None:
        super().__init__()
        sizes = (window,) if isinstance(window, int) else tuple(window)
        if not sizes or any(not isinstance(k, int) or k < 1 or k % 2 == 0 for k in sizes):
            raise ConfigError(f"lncc window must be odd positive integers (voxels), got {window}")
        if eps <= 0:
            raise ConfigError(f"lncc eps must be positive, got {eps}")
        self.window = window
        self.eps = eps

    def _loss(self, fixed: torch.Tensor, warped: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        window = [int(k) for k in per_axis(self.window, fixed.dim() - 2, "lncc window")]
        f = _standardise(fixed, weights)
        g = _standardise(warped, weights)
        channels = fixed.shape[1]
        sums = box_sum(torch.cat([f, g, f * f, g * g, f * g], dim=1) * weights, window)
        count = box_sum(weights, window).clamp_min(_TINY)
        mf, mg, sff, sgg, sfg = (s / count for s in sums.split(channels, dim=1))
        var_f = (sff - mf * mf).clamp_min(0.0)
        var_g = (sgg - mg * mg).clamp_min(0.0)
        cov = sfg - mf * mg
        cc2 = cov * cov / ((var_f + self.eps) * (var_g + self.eps))
        return 1.0 - _masked_mean(cc2, weights).mean()


@register_similarity("mi")
class MutualInformation(Similarity):
    """``-MI``: negative mutual information (nats) of the masked joint intensity histogram, for multi-modal pairs.

    Args:
        bins: histogram bins per image (>= 5).
        percentiles: each image's intensities are mapped linearly from these (masked) percentiles to [0, 1] and
            clipped, which makes the histogram robust to outliers.

    Each voxel spreads its (mask-weighted) unit mass over 4 x 4 neighbouring bins with cubic B-spline Parzen windows
    (as ITK's Mattes MI does), so the histogram, and the loss, are differentiable in both images. The joint histogram
    is one matrix product of the two images' ``(voxels, bins)`` membership matrices (memory ``2 x voxels x bins``).
    """

    def __init__(self, bins: int = 32, percentiles: Sequence[float] = (0.5, 99.5)) -> None:
        super().__init__()
        if not isinstance(bins, int) or bins < 5:
            raise ConfigError(f"mi bins must be an integer >= 5, got {bins}")
        lo, hi = (float(p) for p in percentiles)
        if not 0.0 <= lo < hi <= 100.0:
            raise ConfigError(f"mi percentiles must satisfy 0 <= low < high <= 100, got {tuple(percentiles)}")
        self.bins = bins
        self.percentiles = (lo, hi)

    def _loss(self, fixed: torch.Tensor, warped: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        b, c = fixed.shape[:2]
        w = weights.expand(b, c, *fixed.shape[2:]).reshape(b * c, -1)
        parzen_f = self._parzen(fixed.reshape(b * c, -1), w)
        parzen_g = self._parzen(warped.reshape(b * c, -1), w)
        joint = (parzen_f * w.unsqueeze(-1)).transpose(1, 2) @ parzen_g
        joint = joint / joint.sum((1, 2), keepdim=True)
        mi = _neg_entropy(joint, (1, 2)) - _neg_entropy(joint.sum(2), (1,)) - _neg_entropy(joint.sum(1), (1,))
        return -mi.mean()

    def _parzen(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Cubic B-spline bin memberships ``(images, voxels, bins)`` of ``x`` ``(images, voxels)``; 4 non-zero each."""
        q = torch.tensor(self.percentiles, dtype=x.dtype, device=x.device) / 100.0
        rows = []
        for k in range(x.shape[0]):
            values = x[k][weights[k] > 0]
            lo, hi = torch.quantile(values[:: max(1, values.numel() // _QUANTILE_SAMPLES)], q)
            rows.append((x[k] - lo) / (hi - lo + _EPS_REL * (hi.abs() + lo.abs()) + _TINY))
        # Bin coordinate u in [1, bins - 2]: the 4 bins u's B-spline touches stay inside [0, bins - 1].
        u = 1.0 + torch.stack(rows).clamp(0.0, 1.0) * (self.bins - 3)
        start = u.detach().floor().clamp(max=self.bins - 3)
        s = u - start
        r = 1.0 - s
        spline = torch.stack(
            [r**3 / 6.0, 2.0 / 3.0 - s * s + s**3 / 2.0, 2.0 / 3.0 - r * r + r**3 / 2.0, s**3 / 6.0], -1
        )
        first = start.long().unsqueeze(-1) - 1 + torch.arange(4, device=x.device)
        return x.new_zeros(*x.shape, self.bins).scatter(-1, first, spline)


def _neg_entropy(p: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``sum p log p`` over ``dims`` (0 log 0 = 0, with finite gradients at empty bins)."""
    return (p * torch.log(p.clamp_min(_TINY))).sum(dims)

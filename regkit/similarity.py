"""Similarity measures between a fixed image and a warped moving image, as losses to minimise.

Every measure is an ``nn.Module`` called as ``loss = sim(fixed, warped, mask=None)``:

* ``fixed``, ``warped``: tensors ``(B, C, *spatial)`` of equal shape, 2D (``[y, x]``) or 3D (``[z, y, x]``), on the
  fixed grid, float32 or float64, CPU or CUDA;
* ``mask``: optional weights ``(B or 1, 1, *spatial)`` in [0, 1] (the fixed mask times the warped moving mask) that
  restrict every statistic to the masked region; an all-zero mask (for any batch element) raises ``ImageValueError``;
* the result is a scalar tensor, the mean over batch and channels, differentiable with respect to both images and the
  mask. Constant images give finite values and gradients.

The names are the ones the YAML configuration uses; every loss is minimised (best value first):

* ``mse``: masked mean of ``(fixed - warped)^2``, in [0, inf).
* ``ncc``: ``1 - NCC`` with NCC the global normalised cross-correlation, in [0, 2]; signed, so the contrast must not
  be inverted.
* ``lncc``: ``1 - mean(cc^2)`` with ``cc`` the local NCC in a box window (the ANTs / VoxelMorph convention), in [0, 1].
* ``mi``: ``-MI``, the mutual information (nats) of a cubic B-spline Parzen joint histogram, in [-log(bins), 0].
* ``features``: ``1 - mean cos`` between the learned WTConv features (``regkit.features.network``) of the two images,
  in [0, 2]; for pairs of any contrasts.

New measures join the registry with ``@register_similarity("name")``; ``build_similarity(name, **params)`` builds one
from the configuration. A measure is evaluated on an already warped image (``forward``), or through
:meth:`Similarity.loss_at_points` from the moving image and the world points where the transformation samples it,
which a measure may override to avoid resampling the moving image itself (``features`` in its ``warp_features`` mode).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch import nn

from regkit import _backend
from regkit.errors import ConfigError, ImageValueError
from regkit.spatial.filters import box_sum, per_axis
from regkit.spatial.grid import Grid
from regkit.spatial.sampling import sample_image

if TYPE_CHECKING:
    from regkit.features.network import FeatureNetwork

# Standardisation floors: the variance gets `_EPS_REL * mean square` added, so that a constant image standardises to
# (nearly) zero instead of amplified rounding noise; `_TINY` keeps square roots and divisions finite for all-zero input.
_EPS_REL = 1e-9
_LNCC_FACES = ("torch", "numba")  # the squared local NCC map: PyTorch, or fused numba kernels on the CPU
_MI_FACES = ("torch", "numba")  # the Parzen joint histogram: PyTorch, or numba kernels on the CPU
_TINY = 1e-12
# The MI intensity percentiles are estimated from at most this many voxels per image (a regular subsample).
_QUANTILE_SAMPLES = 1 << 16
# MI builds its joint histogram over chunks of this many voxels: (images x chunk x bins) dense memberships at a time.
_HIST_CHUNK = 1 << 18


class Similarity(nn.Module):
    """Base class of the similarity losses; subclasses implement ``_loss(fixed, warped, weights)``."""

    name: ClassVar[str] = ""

    def forward(self, fixed: torch.Tensor, warped: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Loss between ``fixed`` and ``warped`` ``(B, C, *spatial)``, restricted to ``mask`` ``(B|1, 1, *spatial)``."""
        return self._loss(fixed, warped, _weights(fixed, warped, mask))

    def _loss(self, fixed: torch.Tensor, warped: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def loss_at_points(
        self,
        fixed: torch.Tensor,
        moving: torch.Tensor,
        moving_grid: Grid,
        points: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Loss between ``fixed`` ``(1, C, *S)`` and ``moving`` ``(C, *moving_grid.shape)`` sampled (linear, zero
        outside) at LPS world points ``points`` ``(*S, n)``, one per fixed voxel; ``mask`` as in :meth:`forward`.
        Differentiable with respect to ``points``. This default warps the moving image and calls :meth:`forward`."""
        return self(fixed, sample_image(moving, moving_grid, points)[None], mask)


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
    # Not checked while a CUDA graph is captured (the check waits for the GPU): an empty mask then gives a NaN loss,
    # which the engine reports.
    if not _backend.capturing(weights) and bool((weights.flatten(1).sum(1) <= 0).any()):
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
    the mask. Box sums come from cumulative sums, so the cost does not grow with the window. The gradient with respect
    to the images is computed in closed form from box sums (recomputing the window statistics), so only the two
    standardised images are kept for the backward pass; a mask that requires a gradient takes the autograd path.
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
        window = tuple(int(k) for k in per_axis(self.window, fixed.dim() - 2, "lncc window"))
        f = _standardise(fixed, weights)
        g = _standardise(warped, weights)
        if weights.requires_grad:
            cc2 = _local_cc2(f, g, weights, window, self.eps)
        else:
            cc2 = _LocalCC2.apply(f, g, weights, window, self.eps)
        return 1.0 - _masked_mean(cc2, weights).mean()


def _window_stats(
    f: torch.Tensor, g: torch.Tensor, weights: torch.Tensor, window: tuple[int, ...]
) -> tuple[torch.Tensor, ...]:
    """Mask-weighted window statistics of ``f`` and ``g``: voxel weight sum, means, variances, covariance.

    One box sum at a time, so that no more than a few image-sized temporaries exist at once.
    """
    count = box_sum(weights, window).clamp_min(_TINY)
    mf = box_sum(weights * f, window) / count
    mg = box_sum(weights * g, window) / count
    var_f = box_sum(weights * f * f, window) / count - mf * mf
    var_g = box_sum(weights * g * g, window) / count - mg * mg
    cov = box_sum(weights * f * g, window) / count - mf * mg
    return count, mf, mg, var_f, var_g, cov


def _local_cc2(
    f: torch.Tensor, g: torch.Tensor, weights: torch.Tensor, window: tuple[int, ...], eps: float
) -> torch.Tensor:
    """Squared local NCC map ``cov^2 / ((var_f + eps) (var_g + eps))`` (autograd reference)."""
    _, _, _, var_f, var_g, cov = _window_stats(f, g, weights, window)
    return cov * cov / ((var_f.clamp_min(0.0) + eps) * (var_g.clamp_min(0.0) + eps))


class _LocalCC2(torch.autograd.Function):
    """``_local_cc2`` with a closed-form backward for the images (the weights are constants here).

    With ``a = 2 cov / (Vf Vg W) * grad`` and ``b_g = 2 cov^2 / (Vf Vg^2 W) * grad`` per window centre
    (``V = var + eps``, ``W`` the window's weight sum), the adjoint of the window sums gives
    ``d/dg = w (f box(a) - box(a mf) - g box(b_g) + box(b_g mg))``, and symmetrically for ``f``. On the CPU the same
    formulas run fused in numba (``regkit_kernels.lncc_numba``; the window statistics are kept for the backward pass).
    """

    @staticmethod
    def forward(
        ctx: Any,
        f: torch.Tensor,
        g: torch.Tensor,
        weights: torch.Tensor,
        window: tuple[int, ...],
        eps: float,
    ) -> torch.Tensor:
        ctx.save_for_backward(f, g, weights)
        ctx.window, ctx.eps = window, eps
        ctx.numba = _backend.resolve_backend("auto", f.device, "lncc", faces=_LNCC_FACES) == "numba"
        if ctx.numba:
            cc2, ctx.stats = _backend.load_kernels("lncc_numba").local_cc2(f, g, weights, window, eps)
            return cc2
        return _local_cc2(f, g, weights, window, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        f, g, weights = ctx.saved_tensors
        window, eps = ctx.window, ctx.eps
        if ctx.numba:
            grad_f, grad_g = _backend.load_kernels("lncc_numba").local_cc2_backward(
                f, g, weights, ctx.stats, grad, window, eps, ctx.needs_input_grad[0]
            )
            return grad_f, (grad_g if ctx.needs_input_grad[1] else None), None, None, None
        count, mf, mg, var_f, var_g, cov = _window_stats(f, g, weights, window)
        vf, vg = var_f.clamp_min(0.0) + eps, var_g.clamp_min(0.0) + eps
        a = 2.0 * cov * grad / (vf * vg * count)
        grad_f = grad_g = None
        if ctx.needs_input_grad[0]:
            b_f = a * cov / vf * (var_f >= 0)
            grad_f = g * box_sum(a, window) - box_sum(a * mg, window)
            grad_f = weights * (grad_f - f * box_sum(b_f, window) + box_sum(b_f * mf, window))
        if ctx.needs_input_grad[1]:
            b_g = a * cov / vg * (var_g >= 0)
            grad_g = f * box_sum(a, window) - box_sum(a * mf, window)
            grad_g = weights * (grad_g - g * box_sum(b_g, window) + box_sum(b_g * mg, window))
        return grad_f, grad_g, None, None, None


@register_similarity("mi")
class MutualInformation(Similarity):
    """``-MI``: negative mutual information (nats) of the masked joint intensity histogram, for multi-modal pairs.

    Args:
        bins: histogram bins per image (>= 5).
        percentiles: each image's intensities are mapped linearly from these (masked) percentiles to [0, 1] and
            clipped, which makes the histogram robust to outliers.

    Each voxel spreads its (mask-weighted) unit mass over 4 x 4 neighbouring bins with cubic B-spline Parzen windows
    (as ITK's Mattes MI does), so the histogram, and the loss, are differentiable in both images and the mask. The
    joint histogram and its adjoint are computed over chunks of voxels, so the memory does not grow with the image
    beyond a few copies of it.
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
        t_f = self._normalise(fixed.reshape(b * c, -1), w)
        t_g = self._normalise(warped.reshape(b * c, -1), w)
        joint = _JointHistogram.apply(t_f, t_g, w, self.bins)
        joint = joint / joint.sum((1, 2), keepdim=True)
        mi = _neg_entropy(joint, (1, 2)) - _neg_entropy(joint.sum(2), (1,)) - _neg_entropy(joint.sum(1), (1,))
        return -mi.mean()

    def _normalise(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Intensities ``(images, voxels)`` mapped from their masked percentiles to [0, 1], clipped."""
        q = _backend.device_constant(tuple(p / 100.0 for p in self.percentiles), x.dtype, x.device)
        step = max(1, x.shape[1] // _QUANTILE_SAMPLES)
        rows = []
        for k in range(x.shape[0]):
            # Masked voxels as NaN rather than selected: the same shapes whatever the mask (no wait for the GPU)
            values = torch.where(weights[k] > 0, x[k], torch.nan)[::step]
            lo, hi = torch.nanquantile(values, q)
            rows.append((x[k] - lo) / (hi - lo + _EPS_REL * (hi.abs() + lo.abs()) + _TINY))
        return torch.stack(rows).clamp(0.0, 1.0)


def _parzen(t: torch.Tensor, bins: int, derivative: bool) -> torch.Tensor:
    """Dense cubic B-spline bin memberships ``(images, voxels, bins)`` of ``t`` in [0, 1] (4 non-zero per voxel).

    With ``derivative``, their derivatives with respect to ``t`` instead. The bin coordinate is
    ``u = 1 + t (bins - 3)`` in [1, bins - 2], so the 4 bins a voxel touches stay inside [0, bins - 1].
    """
    u = 1.0 + t * (bins - 3)
    start = u.floor().clamp(max=bins - 3)
    s = u - start
    r = 1.0 - s
    if derivative:
        values = [-0.5 * r * r, s * (1.5 * s - 2.0), r * (2.0 - 1.5 * r), 0.5 * s * s]
        spline = torch.stack(values, -1) * (bins - 3)
    else:
        spline = torch.stack(
            [r**3 / 6.0, 2.0 / 3.0 - s * s + s**3 / 2.0, 2.0 / 3.0 - r * r + r**3 / 2.0, s**3 / 6.0], -1
        )
    first = start.long().unsqueeze(-1) - 1 + torch.arange(4, device=t.device)
    return t.new_zeros(*t.shape, bins).scatter(-1, first, spline)


class _JointHistogram(torch.autograd.Function):
    """Joint histograms ``H[k] = sum_v w[k, v] P(t_f[k, v]) P(t_g[k, v])^T`` (``P``: B-spline memberships).

    Forward and backward run over chunks of ``_HIST_CHUNK`` voxels, so the dense ``(voxels, bins)`` memberships never
    exist for the whole image. On the CPU the same sums run in numba, 16 products per voxel
    (``regkit_kernels.mi_numba``).
    """

    @staticmethod
    def forward(ctx: Any, t_f: torch.Tensor, t_g: torch.Tensor, w: torch.Tensor, bins: int) -> torch.Tensor:
        ctx.save_for_backward(t_f, t_g, w)
        ctx.bins = bins
        ctx.numba = _backend.resolve_backend("auto", t_f.device, "mi", faces=_MI_FACES) == "numba"
        if ctx.numba:
            return _backend.load_kernels("mi_numba").joint_histogram(t_f, t_g, w, bins)
        joint = t_f.new_zeros(t_f.shape[0], bins, bins)
        for sl in _chunks(t_f.shape[1]):
            p_f = _parzen(t_f[:, sl], bins, False) * w[:, sl, None]
            joint += p_f.transpose(1, 2) @ _parzen(t_g[:, sl], bins, False)
        return joint

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        t_f, t_g, w = ctx.saved_tensors
        bins = ctx.bins
        need_f, need_g, need_w = ctx.needs_input_grad[:3]
        if ctx.numba:
            kernels = _backend.load_kernels("mi_numba")
            return (*kernels.joint_histogram_backward(t_f, t_g, w, grad, bins, (need_f, need_g, need_w)), None)
        grads: list[list[torch.Tensor]] = [[], [], []]
        for sl in _chunks(t_f.shape[1]):
            p_f = _parzen(t_f[:, sl], bins, False)
            p_g = _parzen(t_g[:, sl], bins, False)
            g_pg = p_g @ grad.transpose(1, 2)  # (images, voxels, bins of f): sum_b grad[a, b] p_g[v, b]
            if need_f:
                grads[0].append(w[:, sl] * (_parzen(t_f[:, sl], bins, True) * g_pg).sum(-1))
            if need_g:
                grads[1].append(w[:, sl] * (_parzen(t_g[:, sl], bins, True) * (p_f @ grad)).sum(-1))
            if need_w:
                grads[2].append((p_f * g_pg).sum(-1))
        out = [torch.cat(parts, dim=1) if parts else None for parts in grads]
        return out[0], out[1], out[2], None


def _chunks(n: int) -> list[slice]:
    return [slice(i, min(i + _HIST_CHUNK, n)) for i in range(0, n, _HIST_CHUNK)]


def _neg_entropy(p: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``sum p log p`` over ``dims`` (0 log 0 = 0, with finite gradients at empty bins)."""
    return (p * torch.log(p.clamp_min(_TINY))).sum(dims)


FEATURE_MODES = ("warp_image", "warp_features")  # what the features similarity warps (see below)
FEATURE_DISTANCES = ("cosine", "lncc")  # its distances between feature maps


@register_similarity("features")
class FeatureSimilarity(Similarity):
    """A distance between the L2-normalised features ``F`` of the feature network (``regkit.features.network``, full
    resolution) of the fixed and the warped moving image, for any pair of contrasts: ``distance="cosine"``,
    ``1 - mean cos(F(fixed), F(warped))`` in [0, 2]; ``distance="lncc"``, the ``lncc`` loss (window ``lncc_window``)
    of the feature maps, every feature channel an image of its own, in [0, 1]: the features' local correlation, blind
    to slow changes of their mean and scale, weighs where they change, which localises better (2D ITK T1 -> PD
    endpoint error 1.23 mm against 1.40 with the cosine, docs/benchmarks/features-cpu.md).

    Args:
        mode: ``"warp_image"``: the features of the warped moving image, recomputed at every evaluation (exact);
            ``"warp_features"``: the features of the moving image, computed once per pyramid level and warped by
            :meth:`loss_at_points` (linear interpolation, re-normalised; zero outside the moving image), which is
            much cheaper per iteration. :meth:`forward`, which receives an already warped image, is the same in both.
        weights: a weights file (``regkit train-features``); None: the weights shipped for the images' dimension.
        distance: ``"cosine"`` or ``"lncc"`` (above).
        lncc_weight: adds ``lncc_weight`` times the ``lncc`` loss of the images themselves (window ``lncc_window``)
            to the feature distance; 0: features alone. The features carry the anatomy across contrasts, the local
            NCC the voxel-scale detail wherever the two contrasts are locally affine (its ``cc^2`` ignores the sign).

    Each channel of the images is an image of its own. The features of the fixed image are computed once per pyramid
    level: they are kept for the fixed tensor last seen (a registration passes the same tensor at every iteration of a
    level) unless it requires a gradient; likewise the moving features in ``warp_features`` mode. The network is frozen
    and not part of this module's parameters; it runs in the images' dtype and device (WTConv backend ``auto``: fused
    kernels for CUDA float32, reference layers otherwise).
    """

    def __init__(
        self,
        mode: str = "warp_image",
        weights: str | Path | None = None,
        lncc_weight: float = 0.0,
        lncc_window: int = 9,
        distance: str = "cosine",
    ) -> None:
        super().__init__()
        if mode not in FEATURE_MODES:
            raise ConfigError(f"features mode must be {' or '.join(map(repr, FEATURE_MODES))}, got {mode!r}")
        if distance not in FEATURE_DISTANCES:
            choices = " or ".join(map(repr, FEATURE_DISTANCES))
            raise ConfigError(f"features distance must be {choices}, got {distance!r}")
        if lncc_weight < 0:
            raise ConfigError(f"features lncc_weight must be at least 0, got {lncc_weight}")
        self.mode = mode
        self.distance = distance
        self.weights = None if weights is None else Path(weights)
        self.lncc_weight = lncc_weight
        self.lncc = LocalNormalizedCrossCorrelation(lncc_window)
        self._networks: dict[tuple[int, torch.device, torch.dtype], FeatureNetwork] = {}
        self._cache: dict[str, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def _network(self, image: torch.Tensor) -> FeatureNetwork:
        """The network for ``image``'s dimension, device and dtype (loaded on first use)."""
        from regkit.features.network import load_feature_network

        ndim = image.dim() - 2
        key = (ndim, image.device, image.dtype)
        if key not in self._networks:
            network = load_feature_network(self.weights, ndim=ndim)
            self._networks[key] = network.to(device=image.device, dtype=image.dtype)
        return self._networks[key]

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Unit features of every channel of ``images`` ``(B, C, *S)``: ``(B, C, features, *S)``."""
        b, c = images.shape[:2]
        maps = self._network(images)(images.reshape(b * c, 1, *images.shape[2:])).full.to(images.dtype)
        return maps.reshape(b, c, *maps.shape[1:])

    def _cached(self, role: str, key: torch.Tensor, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``compute()`` (features of the tensor ``key``), reused while the same ``key`` (unchanged) comes back for
        ``role``; recomputed with gradients if ``key`` requires them."""
        if key.requires_grad:
            return compute()
        held = self._cache.get(role)
        if held is None or held[0] is not key or held[1] != key._version:
            with torch.no_grad():
                held = (key, key._version, compute())
            self._cache[role] = held
        return held[2]

    def _compare(self, fixed: torch.Tensor, features: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The feature distance between the fixed image and the features ``(B, C, F, *S)`` of the warped one."""
        fixed_features = self._cached("fixed", fixed, lambda: self.features(fixed))
        if self.distance == "lncc":
            return self.lncc._loss(fixed_features.flatten(1, 2), features.flatten(1, 2), weights)
        return 1.0 - _masked_mean((fixed_features * features).sum(2), weights).mean()

    def _loss(self, fixed: torch.Tensor, warped: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        loss = self._compare(fixed, self.features(warped), weights)
        return loss + self.lncc_weight * self.lncc._loss(fixed, warped, weights) if self.lncc_weight else loss

    def loss_at_points(
        self,
        fixed: torch.Tensor,
        moving: torch.Tensor,
        moving_grid: Grid,
        points: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As :meth:`Similarity.loss_at_points`; in ``warp_features`` mode the moving image's features (computed once)
        are warped instead of the image."""
        if self.mode == "warp_image":
            return super().loss_at_points(fixed, moving, moving_grid, points, mask)
        channels = moving.shape[0]
        maps = self._cached("moving", moving, lambda: self.features(moving[None])[0])  # (C, F, *moving shape)
        warped = sample_image(maps.flatten(0, 1), moving_grid, points).unflatten(0, (channels, -1))
        warped = torch.nn.functional.normalize(warped, dim=1, eps=1e-6)[None]
        loss = self._compare(fixed, warped, _weights(fixed, fixed, mask))
        if self.lncc_weight:
            loss = loss + self.lncc_weight * self.lncc.loss_at_points(fixed, moving, moving_grid, points, mask)
        return loss

"""The ``mi`` similarity: ``-MI``, the mutual information (nats) of a cubic B-spline Parzen joint histogram, in
[-log(bins), 0] (options: :class:`MiSimilarity`). On the CPU the joint histogram and its adjoint run in numba kernels
(``regkit_kernels.numba.mi``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from regkit import _backend
from regkit.errors import ConfigError
from regkit.similarity.base import EPS_REL, TINY, Similarity

__all__ = ["HIST_CHUNK", "MI_FACES", "QUANTILE_SAMPLES", "MutualInformation"]

MI_FACES = ("torch", "numba")
"""The implementations of the Parzen joint histogram: PyTorch, or numba kernels on the CPU."""
QUANTILE_SAMPLES = 1 << 16
"""The intensity percentiles are estimated from at most this many voxels per image (a regular subsample)."""
HIST_CHUNK = 1 << 18
"""The joint histogram is built over chunks of this many voxels: (images x chunk x bins) dense memberships at a time."""


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

    def weighted_loss(self, fixed: torch.Tensor, warped: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
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
        step = max(1, x.shape[1] // QUANTILE_SAMPLES)
        rows = []
        for k in range(x.shape[0]):
            # Masked voxels as NaN rather than selected: the same shapes whatever the mask (no wait for the GPU)
            values = torch.where(weights[k] > 0, x[k], torch.nan)[::step]
            lo, hi = torch.nanquantile(values, q)
            rows.append((x[k] - lo) / (hi - lo + EPS_REL * (hi.abs() + lo.abs()) + TINY))
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

    Forward and backward run over chunks of ``HIST_CHUNK`` voxels, so the dense ``(voxels, bins)`` memberships never
    exist for the whole image. On the CPU the same sums run in numba, 16 products per voxel
    (``regkit_kernels.numba.mi``).
    """

    @staticmethod
    def forward(ctx: Any, t_f: torch.Tensor, t_g: torch.Tensor, w: torch.Tensor, bins: int) -> torch.Tensor:
        ctx.save_for_backward(t_f, t_g, w)
        ctx.bins = bins
        ctx.numba = _backend.resolve_backend("auto", t_f.device, "mi", faces=MI_FACES) == "numba"
        if ctx.numba:
            return _backend.load_kernels("numba.mi").joint_histogram(t_f, t_g, w, bins)
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
            kernels = _backend.load_kernels("numba.mi")
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
    return [slice(i, min(i + HIST_CHUNK, n)) for i in range(0, n, HIST_CHUNK)]


def _neg_entropy(p: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``sum p log p`` over ``dims`` (0 log 0 = 0, with finite gradients at empty bins)."""
    return (p * torch.log(p.clamp_min(TINY))).sum(dims)

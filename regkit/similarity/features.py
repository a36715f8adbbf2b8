"""The ``features`` similarity: a distance between the learned WTConv features (``regkit.features.network``) of the two
images, for pairs of any contrasts (options: :class:`FeaturesSimilarity`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from regkit.errors import ConfigError
from regkit.similarity.base import Similarity, mask_weights, masked_mean
from regkit.similarity.lncc import LocalNormalizedCrossCorrelation
from regkit.similarity.options import FEATURE_DISTANCES, FEATURE_MODES
from regkit.spatial.grid import Grid
from regkit.spatial.sampling import sample_image

if TYPE_CHECKING:
    from regkit.features.network import FeatureNetwork

__all__ = ["FeatureSimilarity"]


class FeatureSimilarity(Similarity):
    """A distance between the L2-normalised features ``F`` of the feature network (``regkit.features.network``, full
    resolution) of the fixed and the warped moving image, for any pair of contrasts: ``distance="cosine"``,
    ``1 - mean cos(F(fixed), F(warped))`` in [0, 2]; ``distance="lncc"``, the ``lncc`` loss (window ``lncc_window``)
    of the feature maps, every feature channel an image of its own, in [0, 1]: the features' local correlation, blind
    to slow changes of their mean and scale, weighs where they change, which localises better (2D ITK T1 -> PD
    endpoint error 1.23 mm against 1.40 with the cosine, benchmarks/results/features-cpu.md).

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
            return self.lncc.weighted_loss(fixed_features.flatten(1, 2), features.flatten(1, 2), weights)
        return 1.0 - masked_mean((fixed_features * features).sum(2), weights).mean()

    def weighted_loss(self, fixed: torch.Tensor, warped: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        loss = self._compare(fixed, self.features(warped), weights)
        return loss + self.lncc_weight * self.lncc.weighted_loss(fixed, warped, weights) if self.lncc_weight else loss

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
        loss = self._compare(fixed, warped, mask_weights(fixed, fixed, mask))
        if self.lncc_weight:
            loss = loss + self.lncc_weight * self.lncc.loss_at_points(fixed, moving, moving_grid, points, mask)
        return loss

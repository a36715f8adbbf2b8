"""The ``mse`` similarity: masked mean of ``(fixed - warped)^2``, in [0, inf) (options: :class:`MseSimilarity`)."""

from __future__ import annotations

import torch

from regkit.similarity.base import Similarity, masked_mean

__all__ = ["MeanSquaredError"]


class MeanSquaredError(Similarity):
    """Masked mean squared intensity difference (intensities in the images' own units)."""

    def weighted_loss(self, fixed: torch.Tensor, warped: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        diff = fixed - warped
        return masked_mean(diff * diff, weights).mean()

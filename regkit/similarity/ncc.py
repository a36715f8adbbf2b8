"""The ``ncc`` similarity: ``1 - NCC`` with NCC the global normalised cross-correlation, in [0, 2]; signed, so the
contrast must not be inverted (options: :class:`NccSimilarity`)."""

from __future__ import annotations

import torch

from regkit.similarity.base import Similarity, masked_mean, standardise

__all__ = ["NormalizedCrossCorrelation"]


class NormalizedCrossCorrelation(Similarity):
    """``1 - NCC`` with NCC the masked global normalised cross-correlation, in [-1, 1].

    Invariant to positive affine intensity changes of either image; 0 for identical images.
    """

    def weighted_loss(self, fixed: torch.Tensor, warped: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ncc = masked_mean(standardise(fixed, weights) * standardise(warped, weights), weights)
        return 1.0 - ncc.mean()

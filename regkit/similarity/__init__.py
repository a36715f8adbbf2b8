"""Similarity measures between a fixed image and a warped moving image, as losses to minimise.

The names are the ones the YAML configuration uses; every loss is minimised (best value first):

* ``mse``: masked mean of ``(fixed - warped)^2``, in [0, inf) (:mod:`regkit.similarity.mse`).
* ``ncc``: ``1 - NCC`` with NCC the global normalised cross-correlation, in [0, 2]; signed, so the contrast must not
  be inverted (:mod:`regkit.similarity.ncc`).
* ``lncc``: ``1 - mean(cc^2)`` with ``cc`` the local NCC in a box window (the ANTs / VoxelMorph convention), in [0, 1]
  (:mod:`regkit.similarity.lncc`).
* ``mi``: ``-MI``, the mutual information (nats) of a cubic B-spline Parzen joint histogram, in [-log(bins), 0]
  (:mod:`regkit.similarity.mi`).
* ``features``: ``1 - mean cos`` between the learned WTConv features (``regkit.features.network``) of the two images,
  in [0, 2]; for pairs of any contrasts (:mod:`regkit.similarity.features`).

:data:`SIMILARITIES` (:mod:`regkit.similarity.registry`) maps each name to its options model
(:mod:`regkit.similarity.options`, the configuration's schema) and its measure class; ``build_similarity(name,
**params)`` builds one. The call convention of the measures (shapes, masks, dtypes) is that of their base class
:class:`regkit.similarity.base.Similarity`. This package imports torch only when a measure is built (the
configuration schema imports it).
"""

from __future__ import annotations

# --- the options models (the configuration's similarity schema, without torch) --------------------------------------
from regkit.similarity.options import (
    FEATURE_DISTANCES,
    FEATURE_MODES,
    FeaturesSimilarity,
    LnccSimilarity,
    MiSimilarity,
    MseSimilarity,
    NccSimilarity,
    SimilarityOptions,
)

# --- the registry: name -> options model and measure class; build_similarity ----------------------------------------
from regkit.similarity.registry import SIMILARITIES, Measure, build_similarity, register_similarity

__all__ = [
    "FEATURE_DISTANCES",
    "FEATURE_MODES",
    "SIMILARITIES",
    "FeaturesSimilarity",
    "LnccSimilarity",
    "Measure",
    "MiSimilarity",
    "MseSimilarity",
    "NccSimilarity",
    "SimilarityOptions",
    "build_similarity",
    "register_similarity",
]

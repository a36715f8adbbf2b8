"""The options models of the similarity measures: the ``similarity:`` mapping of an optimized stage.

One model per measure, each discriminated by its ``name`` (its name in :data:`~regkit.similarity.SIMILARITIES`). They
live apart from the measures' ``nn.Module`` classes so that the configuration schema imports them without torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import AfterValidator, Field, field_validator

from regkit.options import Model, Seq, invalid

__all__ = [
    "FEATURE_DISTANCES",
    "FEATURE_MODES",
    "FeatureDistance",
    "FeatureMode",
    "FeaturesSimilarity",
    "LnccSimilarity",
    "MiSimilarity",
    "MseSimilarity",
    "NccSimilarity",
    "SimilarityOptions",
]


def _odd(window: int) -> int:
    if window % 2 == 0:
        raise invalid(f"must be odd (got {window})")
    return window


_OddWindow = Annotated[int, AfterValidator(_odd)]  # a window side in voxels: odd


class SimilarityOptions(Model):
    """Base of the measures' options models: ``name`` chooses the measure, each subclass narrows it to its own."""

    name: str = Field(description="Similarity measure (narrowed by each measure).")


class MseSimilarity(SimilarityOptions):
    """Mean squared intensity difference; for images of one modality with matching intensity scales."""

    name: Literal["mse"] = Field(default="mse", description="Similarity measure: mean squared error.")


class NccSimilarity(SimilarityOptions):
    """Global normalized cross-correlation; for one modality with intensities related linearly."""

    name: Literal["ncc"] = Field(default="ncc", description="Similarity measure: normalized cross-correlation.")


class LnccSimilarity(SimilarityOptions):
    """Local normalized cross-correlation over a sliding cubic (square in 2D) window; robust to intensity bias."""

    name: Literal["lncc"] = Field(default="lncc", description="Similarity measure: local normalized cross-correlation.")
    window: _OddWindow = Field(
        default=9, ge=3, le=63, description="Side of the window in voxels of the current pyramid level; odd."
    )


class MiSimilarity(SimilarityOptions):
    """Mutual information from a cubic B-spline Parzen-window joint histogram; for images of different modalities."""

    name: Literal["mi"] = Field(default="mi", description="Similarity measure: mutual information.")
    bins: int = Field(default=32, ge=8, le=256, description="Number of histogram bins per image.")
    percentiles: Seq[float] = Field(
        default=(0.5, 99.5),
        description="Each image's intensities are mapped linearly from these two percentiles (low, high) to the "
        "histogram range and clipped, for robustness to outliers.",
    )

    @field_validator("percentiles")
    @classmethod
    def _percentiles(cls, percentiles: tuple[float, ...]) -> tuple[float, ...]:
        if len(percentiles) != 2 or not 0 <= percentiles[0] < percentiles[1] <= 100:
            raise invalid(f"must be two percentiles with 0 <= low < high <= 100 (got {list(percentiles)})")
        return percentiles


FeatureMode = Literal["warp_image", "warp_features"]
"""What the features similarity warps: the moving image, or its features."""
FEATURE_MODES: tuple[str, ...] = get_args(FeatureMode)

FeatureDistance = Literal["cosine", "lncc"]
"""The distances of the features similarity between feature maps."""
FEATURE_DISTANCES: tuple[str, ...] = get_args(FeatureDistance)


class FeaturesSimilarity(SimilarityOptions):
    """Distance between deep features (the WTConv feature network) of the fixed and the warped moving image."""

    name: Literal["features"] = Field(default="features", description="Similarity measure: feature distance.")
    mode: FeatureMode = Field(
        default="warp_image",
        description="warp_image: warp the moving image, then compute its features (exact, slower); "
        "warp_features: compute the moving image's features once and warp them (faster).",
    )
    weights: Path | None = Field(
        default=None,
        strict=False,
        description="Weights file of the feature network; null: the weights shipped with regkit. "
        "A relative path is resolved against the folder of the YAML file that sets it.",
    )
    lncc_weight: float = Field(
        default=0.0,
        ge=0.0,
        le=1e3,
        description="Weight of a local NCC term of the images themselves, added to the feature distance: the "
        "features carry the anatomy across contrasts, the intensities its voxel-scale detail where the contrasts "
        "are related (0: features alone).",
    )
    lncc_window: _OddWindow = Field(
        default=9,
        ge=3,
        le=63,
        description="Window of the local NCC (of the images, and of the features with distance lncc).",
    )
    distance: FeatureDistance = Field(
        default="cosine",
        description="cosine: one minus the features' mean cosine similarity; lncc: the local NCC loss of the feature "
        "maps (each feature an image), which localises better.",
    )

    @field_validator("weights")
    @classmethod
    def _exists(cls, weights: Path | None) -> Path | None:
        if weights is not None and not weights.is_file():
            raise invalid(f"no such file: {weights}")
        return weights

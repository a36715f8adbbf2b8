"""The recipe of ``regkit train-features``: a typed, strictly validated schema read from YAML.

The models follow :mod:`regkit.config` (frozen, unknown keys rejected, no numbers parsed from strings, every error one
line ``FILE:LINE: key.path: message``). Shipped recipes, in this package's folder: ``features-2d.yaml`` and
``features-3d.yaml`` (the ones that made the shipped weights); :func:`load_training_config` takes their names
(``features-2d``, :func:`training_presets`) or any YAML file, read by :func:`regkit.config.layers.read_yaml`. Lengths
are in voxels of the synthesised crops unless a field says mm.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from regkit.config.layers import read_yaml
from regkit.config.messages import validate
from regkit.config.schema import Device
from regkit.options import Model, Seq, invalid

__all__ = [
    "FeatureTrainingConfig",
    "LossConfig",
    "NetworkConfig",
    "SynthesisConfig",
    "load_training_config",
    "training_presets",
]


class NetworkConfig(Model):
    """The feature network's hyper-parameters (``regkit.features.network.NetworkSpec``)."""

    channels: Seq[int] = Field(
        default=(16, 32), description="Channels of stage 0 (full) and stage 1 (half resolution)."
    )
    depths: Seq[int] = Field(default=(2, 2), description="WTConv blocks in stage 0 and stage 1.")
    levels: Seq[int] = Field(default=(4, 3), description="Wavelet levels of the WTConv layers of stage 0 and stage 1.")
    kernel_size: int = Field(default=5, ge=1, description="Odd size of the WTConv depthwise kernels.")
    features: int = Field(default=16, ge=1, description="Channels of the L2-normalised output features.")
    mlp_ratio: int = Field(default=2, ge=1, description="Hidden channels of each block's MLP, per channel.")
    self_similarity: int = Field(
        default=0,
        ge=0,
        description="0: the network reads the image; d > 0: its self-similarity descriptors at offset d voxels "
        "(contrast-independent edges, MIND-like).",
    )

    @field_validator("channels", "depths", "levels")
    @classmethod
    def _two_positive(cls, values: tuple[int, ...]) -> tuple[int, ...]:
        if len(values) != 2 or any(v < 1 for v in values):
            raise invalid(f"needs 2 integers >= 1, one per stage (got {list(values)})")
        return values

    @field_validator("kernel_size")
    @classmethod
    def _odd(cls, k: int) -> int:
        if k % 2 == 0:
            raise invalid(f"must be odd (got {k})")
        return k


class SynthesisConfig(Model):
    """How the two views of a training sample are synthesised from the label maps
    (:mod:`regkit.features.training.synth`)."""

    source_spacing: float = Field(default=1.0, gt=0, description="Isotropic spacing (mm) of the label volume.")
    crop: int = Field(default=96, ge=8, description="Size of each view, voxels per axis.")
    voxel_size: Seq[float] = Field(
        default=(1.0, 4.0),
        description="Range (mm) of a view's voxel size, drawn log-uniformly per sample: the scales registration "
        "pyramids see.",
    )
    rotation: float = Field(default=15.0, ge=0, description="Largest rotation (degrees) of a crop about each axis.")
    cells: int = Field(default=4, ge=1, description="CPAB cells per axis of the random deformation between views.")
    deformation: float = Field(
        default=0.6, ge=0, description="Scale of the CPAB prior's standard deviation for the deformation."
    )
    affine_rotation: float = Field(default=15.0, ge=0, description="Largest rotation (degrees) between the views.")
    affine_scaling: float = Field(default=0.15, ge=0, lt=1, description="Largest relative scale change between views.")
    affine_translation: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="Largest translation between the views along each axis, as a fraction of the crop. Large enough "
        "that a voxel's position in its crop says nothing about where its match lies in the other view (the mean "
        "offset then exceeds the mean distance between anchors): otherwise the network learns to encode the position "
        "(the crop borders reveal it) instead of the anatomy.",
    )
    same_contrast: float = Field(
        default=0.3, ge=0, le=1, description="Probability that both views share their label intensities."
    )
    merge_parcels: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="Probability that all grey-matter parcels of a view get one intensity (as in real images) "
        "instead of one each.",
    )
    texture: float = Field(default=0.05, ge=0, description="Largest within-label noise std (intensities in [0, 1]).")
    blur: float = Field(default=1.0, ge=0, description="Largest Gaussian blur sigma (voxels).")
    resolution: float = Field(
        default=3.0, ge=1, description="Largest factor of a resolution loss (down- then up-sampling)."
    )
    resolution_probability: float = Field(
        default=0.5, ge=0, le=1, description="Probability of a resolution loss (along one axis, or all)."
    )
    bias: float = Field(default=0.4, ge=0, description="Largest amplitude of the smooth log bias field.")
    gamma: float = Field(default=0.3, ge=0, description="Std of the log of the gamma exponent.")
    noise: float = Field(default=0.05, ge=0, description="Largest additive noise std (intensities in [0, 1]).")

    @field_validator("voxel_size")
    @classmethod
    def _range(cls, values: tuple[float, ...]) -> tuple[float, ...]:
        if len(values) != 2 or not 0 < values[0] <= values[1]:
            raise invalid(f"needs (low, high) with 0 < low <= high (got {list(values)})")
        return values


class LossConfig(Model):
    """The InfoNCE loss over corresponding voxels of the two views."""

    negatives: Literal["local", "global"] = Field(
        default="global",
        description="local: the match's neighbours at the distances 'radii' (anchors on edges); global: the other "
        "anchors' matches and positions over the batch (regkit.features.training.train).",
    )
    points: int = Field(default=512, ge=2, description="Corresponding voxel pairs sampled per sample.")
    temperature: float = Field(default=0.07, gt=0, description="Softmax temperature of the cosine similarities.")
    exclusion: float = Field(
        default=2.0,
        ge=0,
        description="global: points closer than this (voxels) to a positive are not used as its negatives.",
    )
    half_weight: float = Field(default=0.5, ge=0, description="Weight of the half-resolution features' loss.")
    radii: Seq[float] = Field(
        default=(2.0, 3.0, 5.0, 8.0),
        description="local: distances (voxels) of the negatives from the match, each in every axis and diagonal "
        "direction.",
    )
    edge: float = Field(
        default=0.1,
        ge=0,
        description="local: anchors where view B's standard deviation over 5 voxels per axis exceeds this "
        "(intensities in [0, 1]).",
    )

    @field_validator("radii")
    @classmethod
    def _positive_radii(cls, values: tuple[float, ...]) -> tuple[float, ...]:
        if not values or any(v < 1 for v in values):
            raise invalid(f"needs distances >= 1 voxel (got {list(values)})")
        return values


class FeatureTrainingConfig(Model):
    """A self-supervised training run of the feature network (``regkit train-features``)."""

    dim: Literal[2, 3] = Field(description="Spatial dimensions of the network and of the synthesised views.")
    seed: int = Field(default=0, ge=0, description="Seed: the same seed and configuration give the same run.")
    device: Device = Field(default="auto", description="auto (CUDA if available), cpu, cuda or cuda:N.")
    steps: int = Field(ge=1, description="Optimizer steps.")
    batch_size: int = Field(default=8, ge=1, description="Samples (pairs of views) per step.")
    learning_rate: float = Field(default=2e-3, gt=0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(default=0.01, ge=0, description="AdamW weight decay.")
    warmup: int = Field(
        default=50, ge=0, description="Steps of linear warm-up, then cosine decay to a tenth of the peak."
    )
    checkpoint_every: int = Field(default=100, ge=1, description="Steps between checkpoints (and at the end).")
    mixed_precision: bool = Field(default=True, description="bfloat16 autocast on CUDA (ignored on the CPU).")
    network: NetworkConfig = Field(default=NetworkConfig(), description="The network.")
    synthesis: SynthesisConfig = Field(default=SynthesisConfig(), description="The synthesis of the training views.")
    loss: LossConfig = Field(default=LossConfig(), description="The loss.")

    @model_validator(mode="after")
    def _crop_fits_levels(self) -> FeatureTrainingConfig:
        smallest = self.synthesis.crop // 2 ** max(self.network.levels[0], self.network.levels[1] + 1)
        if smallest < 1:
            raise invalid(
                f"crop {self.synthesis.crop} is too small for {list(self.network.levels)} wavelet levels",
                ("synthesis", "crop"),
            )
        return self


def _recipes_folder() -> Path:
    """The folder of the shipped recipes: this package's (``regkit/features/training/``)."""
    return Path(str(resources.files("regkit.features.training")))


def training_presets() -> list[str]:
    """Names of the training recipes shipped with regkit (``regkit/features/training/NAME.yaml``), sorted."""
    return sorted(p.stem for p in _recipes_folder().glob("*.yaml"))


def load_training_config(source: str | Path) -> FeatureTrainingConfig:
    """Load and validate a training recipe: a YAML file, or the name of a shipped one (``features-2d``).

    Raises :class:`~regkit.errors.ConfigError` with one line ``FILE:LINE: key.path: message`` on any problem.
    """
    if isinstance(source, str) and source in training_presets():
        path, label = _recipes_folder() / f"{source}.yaml", f"regkit/features/training/{source}.yaml"
    else:
        path = Path(source).expanduser()
        label = str(path)
    shipped = ", ".join(training_presets())
    layer = read_yaml(path, label, hint=f" (shipped training recipes: {shipped})")
    return validate(FeatureTrainingConfig, layer)

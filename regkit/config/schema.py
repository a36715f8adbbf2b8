"""The registration configuration's schema: :class:`RegistrationConfig` and the models it is built from.

A configuration is a :class:`RegistrationConfig`: global settings (dimension, device, backend, seed, dtype), an ordered
list of stages (``moments``, ``rigid``, ``affine``, ``cpab``) and the optional outputs to write. Every model is a
:class:`regkit.options.Model`: frozen, unknown keys rejected, numbers not parsed from strings (an int is accepted where
a float is expected).

The stage types are a discriminated union (:data:`Stage` on ``type``, :data:`STAGES` maps each type to its model); the
similarity measures are one too (:data:`AnySimilarity` on ``name``), generated from the similarity registry
(:data:`regkit.similarity.SIMILARITIES`, which maps each name to its options model).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args

from pydantic import AfterValidator, BaseModel, Discriminator, Field, Tag, field_validator, model_validator

from regkit.errors import ConfigError
from regkit.options import Model, Seq, invalid
from regkit.similarity.options import SimilarityOptions
from regkit.similarity.registry import SIMILARITIES

__all__ = [
    "PATH_KEYS",
    "STAGES",
    "UNIONS",
    "AffineStage",
    "AnySimilarity",
    "CpabPrior",
    "CpabStage",
    "Device",
    "IntOrInts",
    "MaskConfig",
    "MomentsStage",
    "OptimizerConfig",
    "OutputsConfig",
    "PyramidLevel",
    "RegistrationConfig",
    "RigidStage",
    "Stage",
]

# ---------------------------------------------------------------------------------------------------------------------
# Field types and the similarity union
# ---------------------------------------------------------------------------------------------------------------------


def _int_or_list(value: Any) -> str:
    return "list" if isinstance(value, list | tuple) else "int"


_Count = Annotated[int, Field(ge=1, le=100_000)]  # iterations per level, cells per axis
IntOrInts = Annotated[
    Annotated[_Count, Tag("int")] | Annotated[Seq[_Count], Tag("list")],
    Discriminator(_int_or_list),
]
"""An int >= 1, or a list of ints >= 1."""

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _check_device(device: str) -> str:
    if not _DEVICE.fullmatch(device):
        raise invalid(f"must be 'auto', 'cpu', 'cuda' or 'cuda:N' (got {device!r})")
    return device


Device = Annotated[str, AfterValidator(_check_device)]
"""A device string: ``auto`` (CUDA if available), ``cpu``, ``cuda`` or ``cuda:N`` (the registration configuration's
and the feature training recipe's ``device``)."""


if TYPE_CHECKING:
    AnySimilarity = SimilarityOptions
else:
    AnySimilarity = Annotated[
        Union[tuple(measure.options for measure in SIMILARITIES.values())],  # noqa: UP007 (a union built at run time)
        Field(discriminator="name"),
    ]
"""Any similarity measure's options, chosen by its ``name``: the union of the registry's options models, in its order
(type checkers see their base class)."""

# ---------------------------------------------------------------------------------------------------------------------
# Stages (discriminated on `type`)
# ---------------------------------------------------------------------------------------------------------------------


class PyramidLevel(Model):
    """One level of the multi-resolution pyramid: the images are smoothed, then shrunk by an integer factor."""

    shrink: int = Field(
        ge=1, le=64, description="Integer factor by which each image axis is shrunk (1: full resolution)."
    )
    smoothing: float = Field(
        ge=0,
        le=64,
        description="Standard deviation of the Gaussian applied before shrinking, in voxels of the full-resolution "
        "image (0: none).",
    )


_DEFAULT_PYRAMID = (
    PyramidLevel(shrink=4, smoothing=2.0),
    PyramidLevel(shrink=2, smoothing=1.0),
    PyramidLevel(shrink=1, smoothing=0.0),
)


class OptimizerConfig(Model):
    """The gradient-based optimizer run at each pyramid level, with early stopping on a stalled loss."""

    name: Literal["adam", "lbfgs"] = Field(default="adam", description="Optimizer: adam or lbfgs.")
    learning_rate: float = Field(
        default=0.05,
        gt=0,
        le=100,
        description="Step size (adam) or initial step length (lbfgs), in the stage's parameter units: millimetres for "
        "rigid and affine stages (about 0.5 suits brain images), prior standard deviations for CPAB stages (whitened "
        "coordinates; about 0.05).",
    )
    iterations: IntOrInts = Field(
        default=100,
        description="Maximum iterations per pyramid level: one int for every level, or a list with one per level.",
    )
    tolerance: float = Field(
        default=1e-5,
        ge=0,
        le=1,
        description="A level stops early once the relative change of the loss, |L_k - L_(k-1)| / |L_(k-1)|, stays "
        "below this for `patience` consecutive iterations (0: never stop early).",
    )
    patience: int = Field(
        default=10, ge=1, le=100_000, description="Consecutive iterations below `tolerance` that stop a level."
    )


class MaskConfig(Model):
    """Which masks, when given to the registration, restrict the similarity to the voxels inside them."""

    fixed: bool = Field(default=True, description="Use the fixed image's mask.")
    moving: bool = Field(default=True, description="Use the moving image's mask (warped along with the moving image).")


class MomentsStage(Model):
    """Initialisation from image moments: matches centres of mass, and optionally the principal axes."""

    type: Literal["moments"] = Field(default="moments", description="Stage type: moment-based initialisation.")
    mode: Literal["com", "principal_axes"] = Field(
        default="com",
        description="com: translation between the centres of mass; principal_axes: also rotate to align the "
        "principal axes of inertia (can flip by 180 degrees on near-symmetric images).",
    )


class _OptimizedStage(Model):
    """Fields shared by the stages that optimize a similarity over a pyramid."""

    type: Literal["rigid", "affine", "cpab"] = Field(description="Stage type (narrowed by each stage).")
    similarity: AnySimilarity = Field(description="The similarity measure that the stage maximizes.")
    pyramid: Seq[PyramidLevel] = Field(
        default=_DEFAULT_PYRAMID,
        description="Pyramid levels, coarse to fine; the shrink factors must not increase.",
    )
    optimizer: OptimizerConfig = Field(default=OptimizerConfig(), description="The optimizer and its stopping rule.")
    mask: MaskConfig = Field(default=MaskConfig(), description="Which masks restrict the similarity.")

    @field_validator("pyramid")
    @classmethod
    def _coarse_to_fine(cls, pyramid: tuple[PyramidLevel, ...]) -> tuple[PyramidLevel, ...]:
        if not pyramid:
            raise invalid("needs at least one level")
        for i in range(1, len(pyramid)):
            if pyramid[i].shrink > pyramid[i - 1].shrink:
                raise invalid(
                    f"shrink factors must not increase from coarse to fine (got {pyramid[i].shrink} after "
                    f"{pyramid[i - 1].shrink})",
                    (i, "shrink"),
                )
        return pyramid

    @model_validator(mode="after")
    def _iterations_per_level(self) -> _OptimizedStage:
        iterations = self.optimizer.iterations
        if isinstance(iterations, tuple) and len(iterations) != len(self.pyramid):
            raise invalid(
                f"{len(iterations)} entries for {len(self.pyramid)} pyramid levels (give one per level, or one int)",
                ("optimizer", "iterations"),
            )
        return self

    def level_iterations(self) -> tuple[int, ...]:
        """Maximum optimizer iterations at each pyramid level, coarse to fine."""
        iterations = self.optimizer.iterations
        return iterations if isinstance(iterations, tuple) else (iterations,) * len(self.pyramid)


class RigidStage(_OptimizedStage):
    """Rigid registration: rotation and translation."""

    type: Literal["rigid"] = Field(default="rigid", description="Stage type: rigid.")


class AffineStage(_OptimizedStage):
    """Affine registration: a general linear map and a translation."""

    type: Literal["affine"] = Field(default="affine", description="Stage type: affine.")


class CpabPrior(Model):
    """Gaussian prior on the CPAB parameters: squared-exponential covariance between the cells' affine maps."""

    length_scale: float = Field(
        default=0.1,
        gt=0,
        le=10,
        description="Correlation length between cell centres, in units of the [0, 1] tessellation domain.",
    )
    variance: float = Field(default=1.0, gt=0, le=1e6, description="Prior variance of the velocity-field parameters.")
    weight: float = Field(
        default=0.01,
        ge=0,
        le=1e6,
        description="Multiplier of the prior energy 1/2 theta^T Sigma^-1 theta added to the loss (0: none).",
    )


class CpabStage(_OptimizedStage):
    """Diffeomorphic registration with a CPAB transformation, refined coarse to fine with the pyramid."""

    type: Literal["cpab"] = Field(default="cpab", description="Stage type: CPAB diffeomorphism.")
    tessellation: Seq[IntOrInts] = Field(
        default=(4, 8, 12),
        description="Cells per axis at each pyramid level, coarse to fine: an int (same on every axis) or a list in "
        "(x, y[, z]) order; one entry per pyramid level, never decreasing. The engine uses at most one cell per 4 "
        "voxels of the fixed image along each axis.",
    )
    boundary: Literal["zero", "normal", "free"] = Field(
        default="zero",
        description="Velocity at the domain boundary: zero (vanishes), normal (no flow across it) or free.",
    )
    volume_preserving: bool = Field(
        default=False, description="Constrain the velocity to be divergence-free in every cell."
    )
    steps: int = Field(default=50, ge=1, le=1000, description="Integration steps T of the flow over unit time.")
    prior: CpabPrior = Field(default=CpabPrior(), description="Prior on the velocity-field parameters.")
    chain: int = Field(
        default=1,
        ge=1,
        le=16,
        description="Number of CPAB transformations composed, each with its own parameters (large motions).",
    )
    multimodal: AnySimilarity | None = Field(
        default=None,
        description="The similarity used instead of `similarity` when the pair is found multi-modal: when, after "
        "the earlier stages, the fixed intensities explain the moving ones' less linearly than `modality_threshold` "
        "(r^2 / eta^2, the squared correlation over the correlation ratio). None: always `similarity`.",
    )
    modality_threshold: float = Field(
        default=0.7,
        gt=0,
        lt=1,
        description="With `multimodal`: the r^2 / eta^2 of the pair's intensities below which it counts as multi-modal "
        "(1: a linear relation, one contrast up to gain and offset).",
    )

    @model_validator(mode="after")
    def _schedule(self) -> CpabStage:
        if len(self.tessellation) != len(self.pyramid):
            raise invalid(f"{len(self.tessellation)} levels but the pyramid has {len(self.pyramid)}", ("tessellation",))
        axes = {len(cells) for cells in self.tessellation if isinstance(cells, tuple)}
        if axes - {2, 3} or len(axes) > 1:
            raise invalid(
                f"per-axis cell counts need 2 or 3 entries, the same at every level (got {sorted(axes)})",
                ("tessellation",),
            )
        dim = axes.pop() if axes else 1
        for i in range(1, len(self.tessellation)):
            before, after = self._cells(i - 1, dim), self._cells(i, dim)
            if any(a < b for a, b in zip(after, before, strict=True)):
                raise invalid(
                    f"cell counts must not decrease from coarse to fine (got {list(after)} after {list(before)})",
                    ("tessellation", i),
                )
        return self

    def _cells(self, level: int, dim: int) -> tuple[int, ...]:
        cells = self.tessellation[level]
        return cells if isinstance(cells, tuple) else (cells,) * dim

    def level_cells(self, dim: int) -> tuple[tuple[int, ...], ...]:
        """Cells per axis, in (x, y[, z]) order, of the tessellation at each pyramid level (coarse to fine).

        Raises :class:`~regkit.errors.ConfigError` if per-axis counts were given for another dimension than ``dim``.
        """
        cells = tuple(self._cells(level, dim) for level in range(len(self.tessellation)))
        if any(len(c) != dim for c in cells):
            raise ConfigError(f"tessellation: per-axis cell counts {list(self.tessellation)} do not fit {dim}D images")
        return cells


Stage = Annotated[MomentsStage | RigidStage | AffineStage | CpabStage, Field(discriminator="type")]
"""Any stage, chosen by its ``type``. To add one: write its model above and add it to this union."""

STAGES: dict[str, type[Model]] = {cls.model_fields["type"].default: cls for cls in get_args(get_args(Stage)[0])}
"""Stage type -> model."""

# ---------------------------------------------------------------------------------------------------------------------
# The whole configuration
# ---------------------------------------------------------------------------------------------------------------------


class OutputsConfig(Model):
    """Which optional outputs a registration writes (their file names are fixed, not configurable)."""

    warped: bool = Field(default=True, description="The moving image warped onto the fixed grid.")
    displacement: bool = Field(default=True, description="The dense displacement field on the fixed grid (world mm).")
    inverse_displacement: bool = Field(
        default=True, description="The dense inverse displacement field on the moving grid."
    )
    jacobian: bool = Field(default=True, description="The Jacobian determinant map of the transformation.")
    transform_h5: bool = Field(default=True, description="The transformation as an ITK HDF5 transform file.")
    qc_png: bool = Field(default=True, description="A quality-control image of overlaid slices.")


class RegistrationConfig(Model):
    """A complete registration: global settings, the stages run in order, and the outputs to write."""

    dim: Literal[2, 3] | None = Field(default=None, description="Image dimension, 2 or 3; null: taken from the images.")
    device: Device = Field(
        default="auto", description="Where to compute: auto (CUDA if available), cpu, cuda or cuda:N."
    )
    backend: Literal["auto", "reference", "torch", "numba", "triton"] = Field(
        default="auto",
        description="Implementation of the CPAB integration: reference (pure PyTorch specification), torch "
        "(factorized PyTorch), numba (compiled kernels, CPU only), triton (fused kernels, CUDA only) or auto (the "
        "fastest available: triton on CUDA, numba on the CPU).",
    )
    cuda_graphs: bool = Field(
        default=True,
        description="On CUDA, replay each pyramid level's Adam iterations from a CUDA graph after 3 eager ones "
        "(one launch per iteration instead of hundreds; the same result).",
    )
    seed: int = Field(default=0, ge=0, le=2**32 - 1, description="Seed of every random number generator used.")
    dtype: Literal["float32", "float64"] = Field(
        default="float32", description="Floating-point type of the computation."
    )
    stages: Seq[Stage] = Field(description="The stages, run in this order; each starts where the last ended.")
    outputs: OutputsConfig = Field(default=OutputsConfig(), description="Which optional outputs to write.")

    @field_validator("stages")
    @classmethod
    def _not_empty(cls, stages: tuple[Stage, ...]) -> tuple[Stage, ...]:
        if not stages:
            raise invalid("needs at least one stage")
        return stages

    @model_validator(mode="after")
    def _consistent(self) -> RegistrationConfig:
        for i, stage in enumerate(self.stages):
            if isinstance(stage, MomentsStage) and i > 0:
                raise invalid("a moments stage initialises, so it can only be the first stage", ("stages", i, "type"))
            if isinstance(stage, CpabStage) and self.dim is not None:
                for level, cells in enumerate(stage.tessellation):
                    if isinstance(cells, tuple) and len(cells) != self.dim:
                        raise invalid(
                            f"{len(cells)} per-axis cell counts but dim is {self.dim}",
                            ("stages", i, "tessellation", level),
                        )
        return self


def _types_in(annotation: Any) -> Iterator[Any]:
    yield annotation
    for arg in get_args(annotation):
        yield from _types_in(arg)


def _path_keys(model: type[BaseModel]) -> frozenset[str]:
    """Names of the fields, anywhere in ``model``'s schema, that hold file paths."""
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        for kind in _types_in(field.annotation):
            if kind is Path:
                keys.add(name)
            elif isinstance(kind, type) and not get_args(kind) and issubclass(kind, BaseModel):
                keys |= _path_keys(kind)
    return frozenset(keys)


PATH_KEYS = _path_keys(RegistrationConfig)
"""The keys, anywhere in a registration configuration, whose values are file paths (resolved by the layers)."""

UNIONS: dict[str, Collection[str]] = {"type": STAGES, "name": SIMILARITIES}
"""The discriminated unions of the schema: discriminator key -> its tags, in order (for error messages)."""

"""Registration configuration: a typed, strictly validated schema, loaded from YAML files or named presets.

A configuration is a :class:`RegistrationConfig`: global settings (dimension, device, backend, seed, dtype), an ordered
list of stages (``moments``, ``rigid``, ``affine``, ``cpab``) and the optional outputs to write. Every model is frozen
and rejects unknown keys; numbers are not parsed from strings (an int is accepted where a float is expected).

YAML is read with safe semantics only. :func:`load_config` takes a file or the name of a preset shipped in
``regkit/configs/`` (see :func:`list_presets`); a file may start from another one with ``base: NAME_OR_PATH`` and
override keys (mappings merge deeply, lists and scalars replace). Relative paths are resolved against the folder of the
YAML file that sets them (overrides given in Python: against the current directory). Every problem raises a
:class:`~regkit.errors.ConfigError` with one line ``FILE:LINE: key.path: message``.

The similarity measures and stage types are discriminated unions (:data:`Similarity` on ``name``, :data:`Stage` on
``type``); :data:`SIMILARITIES` and :data:`STAGES` map each name to its model class.
"""

from __future__ import annotations

import difflib
import hashlib
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from regkit.errors import ConfigError

__all__ = [
    "SIMILARITIES",
    "STAGES",
    "AffineStage",
    "CpabPrior",
    "CpabStage",
    "FeaturesSimilarity",
    "LnccSimilarity",
    "MaskConfig",
    "MiSimilarity",
    "MomentsStage",
    "MseSimilarity",
    "NccSimilarity",
    "OptimizerConfig",
    "OutputsConfig",
    "PyramidLevel",
    "RegistrationConfig",
    "RigidStage",
    "Similarity",
    "Stage",
    "config_hash",
    "dump_config",
    "list_presets",
    "load_config",
]

# ---------------------------------------------------------------------------------------------------------------------
# Schema building blocks
# ---------------------------------------------------------------------------------------------------------------------

KeyPath = tuple[str | int, ...]
T = TypeVar("T")


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


Seq = Annotated[tuple[T, ...], BeforeValidator(_as_tuple)]
"""A tuple that also accepts a list (YAML sequences), its items validated strictly."""


def _int_or_list(value: Any) -> str:
    return "list" if isinstance(value, list | tuple) else "int"


_Count = Annotated[int, Field(ge=1)]
IntOrInts = Annotated[
    Annotated[_Count, Tag("int")] | Annotated[Seq[_Count], Tag("list")],
    Discriminator(_int_or_list),
]
"""An int >= 1, or a list of ints >= 1."""


def invalid(message: str, key: KeyPath = ()) -> PydanticCustomError:
    """A validation error whose location is the validated object's location followed by ``key``."""
    return PydanticCustomError("regkit_config", "{message}", {"message": message, "key": key})


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


class Model(BaseModel):
    """Base of every configuration model: frozen, strict, unknown keys rejected with a suggestion."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if key not in cls.model_fields:
                    raise invalid(f"unknown key {key!r}{_did_you_mean(str(key), cls.model_fields)}", (key,))
        return data


# ---------------------------------------------------------------------------------------------------------------------
# Similarity measures (discriminated on `name`)
# ---------------------------------------------------------------------------------------------------------------------


def _odd(window: int) -> int:
    if window % 2 == 0:
        raise invalid(f"must be odd (got {window})")
    return window


_OddWindow = Annotated[int, AfterValidator(_odd)]  # a window side in voxels: odd


class MseSimilarity(Model):
    """Mean squared intensity difference; for images of one modality with matching intensity scales."""

    name: Literal["mse"] = Field(default="mse", description="Similarity measure: mean squared error.")


class NccSimilarity(Model):
    """Global normalized cross-correlation; for one modality with intensities related linearly."""

    name: Literal["ncc"] = Field(default="ncc", description="Similarity measure: normalized cross-correlation.")


class LnccSimilarity(Model):
    """Local normalized cross-correlation over a sliding cubic (square in 2D) window; robust to intensity bias."""

    name: Literal["lncc"] = Field(default="lncc", description="Similarity measure: local normalized cross-correlation.")
    window: _OddWindow = Field(
        default=9, ge=3, description="Side of the window in voxels of the current pyramid level; odd."
    )


class MiSimilarity(Model):
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


class FeaturesSimilarity(Model):
    """Distance between deep features (the WTConv feature network) of the fixed and the warped moving image."""

    name: Literal["features"] = Field(default="features", description="Similarity measure: feature distance.")
    mode: Literal["warp_image", "warp_features"] = Field(
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
        description="Weight of a local NCC term of the images themselves, added to the feature distance: the "
        "features carry the anatomy across contrasts, the intensities its voxel-scale detail where the contrasts "
        "are related (0: features alone).",
    )
    lncc_window: _OddWindow = Field(
        default=9, ge=3, description="Window of the local NCC (of the images, and of the features with distance lncc)."
    )
    distance: Literal["cosine", "lncc"] = Field(
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


Similarity = Annotated[
    MseSimilarity | NccSimilarity | LnccSimilarity | MiSimilarity | FeaturesSimilarity,
    Field(discriminator="name"),
]
"""Any similarity measure, chosen by its ``name``. To add one: write its model above and add it to this union."""

SIMILARITIES: dict[str, type[Model]] = {
    cls.model_fields["name"].default: cls for cls in get_args(get_args(Similarity)[0])
}
"""Similarity measure name -> options model."""

# ---------------------------------------------------------------------------------------------------------------------
# Stages (discriminated on `type`)
# ---------------------------------------------------------------------------------------------------------------------


class PyramidLevel(Model):
    """One level of the multi-resolution pyramid: the images are smoothed, then shrunk by an integer factor."""

    shrink: int = Field(ge=1, description="Integer factor by which each image axis is shrunk (1: full resolution).")
    smoothing: float = Field(
        ge=0,
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
        description="A level stops early once the relative change of the loss, |L_k - L_(k-1)| / |L_(k-1)|, stays "
        "below this for `patience` consecutive iterations (0: never stop early).",
    )
    patience: int = Field(default=10, ge=1, description="Consecutive iterations below `tolerance` that stop a level.")


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
    similarity: Similarity = Field(description="The similarity measure that the stage maximizes.")
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
        description="Correlation length between cell centres, in units of the [0, 1] tessellation domain.",
    )
    variance: float = Field(default=1.0, gt=0, description="Prior variance of the velocity-field parameters.")
    weight: float = Field(
        default=0.01,
        ge=0,
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
        description="Number of CPAB transformations composed, each with its own parameters (large motions).",
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


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


class RegistrationConfig(Model):
    """A complete registration: global settings, the stages run in order, and the outputs to write."""

    dim: Literal[2, 3] | None = Field(default=None, description="Image dimension, 2 or 3; null: taken from the images.")
    device: str = Field(default="auto", description="Where to compute: auto (CUDA if available), cpu, cuda or cuda:N.")
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
    seed: int = Field(default=0, ge=0, description="Seed of every random number generator used.")
    dtype: Literal["float32", "float64"] = Field(
        default="float32", description="Floating-point type of the computation."
    )
    stages: Seq[Stage] = Field(description="The stages, run in this order; each starts where the last ended.")
    outputs: OutputsConfig = Field(default=OutputsConfig(), description="Which optional outputs to write.")

    @field_validator("device")
    @classmethod
    def _device(cls, device: str) -> str:
        if not _DEVICE.fullmatch(device):
            raise invalid(f"must be 'auto', 'cpu', 'cuda' or 'cuda:N' (got {device!r})")
        return device

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


_PATH_KEYS = _path_keys(RegistrationConfig)

# ---------------------------------------------------------------------------------------------------------------------
# YAML with line numbers
# ---------------------------------------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """The safe loader, also reading YAML 1.2 floats without a dot (``1e-5``) as floats rather than strings."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)

Origin = tuple[str, int | None]
"""Where a key was set: a file label and a 1-based line (None for overrides given in Python)."""


@dataclass(frozen=True)
class Layer:
    """Raw configuration data and, for every key path in it, where it was set."""

    data: dict[str, Any]
    origins: dict[KeyPath, Origin]


def parse(text: str, label: str) -> Layer:
    """Parse one YAML document into a mapping, recording the line of every key and list item."""
    try:
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            if node is None or node.tag == "tag:yaml.org,2002:null":
                raise ConfigError(f"{label}:1: the configuration is empty")
            if not isinstance(node, yaml.MappingNode):
                kind = "list" if isinstance(node, yaml.SequenceNode) else "single value"
                raise ConfigError(f"{label}:{node.start_mark.line + 1}: expected a mapping of keys, got a {kind}")
            origins: dict[KeyPath, Origin] = {(): (label, node.start_mark.line + 1)}
            return Layer(_construct(loader, node, (), label, origins), origins)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = mark.line + 1 if mark is not None else 1
        hint = " (indent with spaces, not tabs)" if "\\t" in str(err.problem) else ""
        raise ConfigError(f"{label}:{line}: invalid YAML: {err.problem or err.context}{hint}") from None
    except yaml.reader.ReaderError as err:
        raise ConfigError(f"{label}:{text.count(chr(10), 0, err.position) + 1}: invalid YAML: {err.reason}") from None


def _construct(loader: _Loader, node: yaml.Node, path: KeyPath, label: str, origins: dict[KeyPath, Origin]) -> Any:
    """Build the Python value of ``node`` (safe semantics), rejecting duplicate and non-string keys."""
    if isinstance(node, yaml.MappingNode) and node.tag == "tag:yaml.org,2002:map":
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = loader.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if not isinstance(key, str):
                raise ConfigError(
                    f"{label}:{line}: {format_path(path) or 'top level'}: keys must be strings (got {key!r})"
                )
            if key in seen:
                where = f"{format_path((*path, key))}: duplicate key"
                raise ConfigError(f"{label}:{line}: {where} (first set on line {seen[key]})")
            seen[key] = line
        loader.flatten_mapping(node)
        mapping: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node)
            origins[(*path, key)] = (label, key_node.start_mark.line + 1)
            mapping[key] = _construct(loader, value_node, (*path, key), label, origins)
        return mapping
    if isinstance(node, yaml.SequenceNode) and node.tag == "tag:yaml.org,2002:seq":
        items = []
        for i, item in enumerate(node.value):
            origins[(*path, i)] = (label, item.start_mark.line + 1)
            items.append(_construct(loader, item, (*path, i), label, origins))
        return items
    return loader.construct_object(node, deep=True)  # scalars, and collections with explicit tags (!!set, ...)


def _from_python(data: Mapping[str, Any], label: str) -> Layer:
    """A layer from a Python mapping (overrides), every key attributed to ``label`` without a line."""
    origins: dict[KeyPath, Origin] = {}

    def walk(value: Any, path: KeyPath) -> None:
        origins[path] = (label, None)
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, (*path, key))
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                walk(item, (*path, i))

    walk(data, ())
    return Layer(dict(data), origins)


def merge(base: Layer, over: Layer) -> Layer:
    """``over`` on top of ``base``: mappings merge key by key, anything else in ``over`` replaces."""
    origins: dict[KeyPath, Origin] = {}

    def subtree(layer: Layer, path: KeyPath) -> None:
        origins.update({p: o for p, o in layer.origins.items() if p[: len(path)] == path})

    def combine(a: Any, b: Any, path: KeyPath) -> Any:
        if not (isinstance(a, Mapping) and isinstance(b, Mapping)):
            subtree(over, path)
            return b
        origins[path] = over.origins[path]
        merged = dict(a)
        for key, value in b.items():
            merged[key] = combine(a[key], value, (*path, key)) if key in a else value
            if key not in a:
                subtree(over, (*path, key))
        for key in a.keys() - b.keys():
            subtree(base, (*path, key))
        return merged

    return Layer(combine(base.data, over.data, ()), origins)


def resolve_paths(value: Any, folder: Path) -> Any:
    """A copy of ``value`` with relative file paths (under the keys in ``_PATH_KEYS``) joined to ``folder``."""
    if isinstance(value, Mapping):
        return {
            key: str(folder / Path(item).expanduser())
            if key in _PATH_KEYS and isinstance(item, str)
            else resolve_paths(item, folder)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [resolve_paths(item, folder) for item in value]
    return value


# ---------------------------------------------------------------------------------------------------------------------
# Presets and sources
# ---------------------------------------------------------------------------------------------------------------------


DEFAULT_PRESETS = {2: "histology-2d", 3: "brain-mri-3d"}
"""The preset front ends use when the user names none, by image dimension (CLI ``register``, the napari widget)."""


def _presets_dir() -> Path:
    return Path(str(resources.files("regkit") / "configs"))


def list_presets() -> list[str]:
    """Names of the registration presets shipped with regkit (``regkit/configs/NAME.yaml``), sorted; the feature
    network's training configurations there (``features-*.yaml``, see ``regkit.features.train_config``) are not
    registration presets."""
    return sorted(p.stem for p in _presets_dir().glob("*.yaml") if not p.stem.startswith("features-"))


@dataclass(frozen=True)
class _Source:
    """A configuration file: its label in messages, its resolved path, its text, and the folder of relative paths."""

    label: str
    path: Path
    text: str
    folder: Path


def open_config(ref: str | Path, folder: Path, where: str) -> _Source:
    """Find and read a configuration: a preset name, or a YAML path relative to ``folder``.

    ``where`` prefixes error messages (the ``FILE:LINE: base:`` that named ``ref``, or nothing).
    """
    presets = list_presets()
    is_path = isinstance(ref, Path) or ref.endswith((".yaml", ".yml")) or "/" in ref or "\\" in ref
    if not is_path and ref in presets:
        path = _presets_dir() / f"{ref}.yaml"
        label = f"regkit/configs/{ref}.yaml"
    else:
        path = folder / Path(ref).expanduser()
        label = str(ref) if Path(ref).is_absolute() or folder == Path() else str(path)
        if not is_path and not path.is_file():
            raise ConfigError(
                f"{where}{ref!r} is neither a YAML file nor a preset{_did_you_mean(str(ref), presets)} "
                f"(presets: {', '.join(presets)})"
            )
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where}{label}: no such file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}{label}: not a UTF-8 text file") from None
    except OSError as err:
        raise ConfigError(f"{where}{label}: cannot read ({err.strerror})") from None
    return _Source(label, path.resolve(), text, path.parent.absolute())


def read_layers(source: _Source, chain: tuple[Path, ...]) -> Layer:
    """The layer of ``source`` merged on top of the layers of its ``base`` chain (``chain``: the files below it)."""
    layer = parse(source.text, source.label)
    data = resolve_paths(layer.data, source.folder)
    if "base" not in data:
        return Layer(data, layer.origins)
    ref = data.pop("base")
    label, line = layer.origins[("base",)]
    where = f"{label}:{line}: base: "
    if not isinstance(ref, str):
        raise ConfigError(f"{where}expected a preset name or a file path, got {_show(ref)}")
    base = open_config(ref, source.folder, where)
    chain = (*chain, source.path)
    if base.path in chain:
        raise ConfigError(f"{where}circular base {ref!r}")
    origins = {path: origin for path, origin in layer.origins.items() if path[:1] != ("base",)}
    return merge(read_layers(base, chain), Layer(data, origins))


# ---------------------------------------------------------------------------------------------------------------------
# Loading, dumping, hashing
# ---------------------------------------------------------------------------------------------------------------------


def load_config(source: str | Path, overrides: Mapping[str, Any] | None = None) -> RegistrationConfig:
    """Load and validate a registration configuration.

    ``source`` is a YAML file or the name of a preset (see :func:`list_presets`); a string ending in ``.yaml``/``.yml``
    or containing a path separator is always a file. ``overrides`` is a nested mapping merged on top (mappings merge
    deeply, lists and scalars replace), with relative paths resolved against the current directory. Raises
    :class:`~regkit.errors.ConfigError` with one line ``FILE:LINE: key.path: message`` on any problem.
    """
    layer = read_layers(open_config(source, Path(), ""), ())
    if overrides:
        layer = merge(layer, _from_python(resolve_paths(overrides, Path.cwd()), "overrides"))
    try:
        return RegistrationConfig.model_validate(layer.data)
    except ValidationError as err:
        raise ConfigError(first_error(err, layer)) from None


class _Dumper(yaml.SafeDumper):
    """The safe dumper, writing lists of scalars on one line (``[4, 8, 12]``) and everything else as blocks."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flow = all(not isinstance(item, list | dict) for item in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def dump_config(cfg: RegistrationConfig) -> str:
    """The configuration as YAML with every default filled in, in schema order; :func:`load_config` reads it back."""
    return yaml.dump(cfg.model_dump(mode="json"), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def config_hash(cfg: RegistrationConfig) -> str:
    """A stable hexadecimal SHA-256 of the configuration (of its canonical :func:`dump_config` text)."""
    return hashlib.sha256(dump_config(cfg).encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------------------------------------------------
# Validation errors as one line
# ---------------------------------------------------------------------------------------------------------------------

_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "tuple_type": "a list",
    "list_type": "a list",
    "model_type": "a mapping",
    "dict_type": "a mapping",
    "model_attributes_type": "a mapping",
}
_BOUNDS = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}


_UNIONS = {"type": STAGES, "name": SIMILARITIES}
"""The discriminated unions of the schema, by their discriminator key."""


def _show(value: Any) -> str:
    """A short description of a raw YAML value for messages: its kind, and the value when it is a scalar."""
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        type(value), type(value).__name__
    )
    return f"{kind} {value!r}"


def format_path(path: KeyPath) -> str:
    """``('stages', 2, 'optimizer')`` -> ``stages[2].optimizer``."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text.lstrip(".")


def _data_path(loc: tuple[Any, ...], data: Any, missing: bool) -> KeyPath:
    """The key path in the raw data of a pydantic error location, without the union tags pydantic adds to it."""
    path: list[str | int] = []
    for i, part in enumerate(loc):
        if isinstance(data, Mapping) and part in data:
            data = data[part]
        elif isinstance(data, list | tuple) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        elif not (missing and i == len(loc) - 1):
            continue
        path.append(part)
    return tuple(path)


def _quoted(text: str) -> list[str]:
    return re.findall(r"'([^']*)'", text)


def _message(err: Any) -> tuple[KeyPath, str]:
    """A pydantic error as (key path to append to its location, message)."""
    kind, ctx, value = err["type"], err.get("ctx", {}), err["input"]
    if kind == "regkit_config":
        return ctx["key"], ctx["message"]
    if kind == "missing":
        return (), "required key missing"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        key = ctx["discriminator"].strip("'")
        tags = ", ".join(_UNIONS[key])
        if kind == "union_tag_not_found":
            return (key,), f"required key missing (one of {tags})"
        return (key,), f"unknown {key} {ctx['tag']!r}{_did_you_mean(ctx['tag'], _UNIONS[key])} (one of {tags})"
    if kind == "literal_error":
        hint = _did_you_mean(value, _quoted(ctx["expected"])) if isinstance(value, str) else ""
        return (), f"must be {ctx['expected']} (got {_show(value)}){hint}"
    if kind in _BOUNDS:
        name, op = _BOUNDS[kind]
        return (), f"must be {op} {ctx[name]:g} (got {value!r})"
    if kind in _EXPECTED:
        return (), f"expected {_EXPECTED[kind]}, got {_show(value)}"
    if kind == "finite_number":
        return (), f"must be a finite number (got {value!r})"
    return (), err["msg"]


def first_error(err: ValidationError, layer: Layer) -> str:
    """The first validation error, by file position, as ``FILE:LINE: key.path: message (and N more)``."""
    located = []
    for e in err.errors(include_url=False):
        key, message = _message(e)
        path = _data_path(e["loc"], layer.data, e["type"] == "missing") + tuple(key)
        label, line = layer.origins[next(path[:n] for n in range(len(path), -1, -1) if path[:n] in layer.origins)]
        located.append((line is None, line or 0, f"{label}:{line}" if line is not None else label, path, message))
    located.sort(key=lambda item: item[:2])
    _, _, where, path, message = located[0]
    more = f" (and {len(located) - 1} more)" if len(located) > 1 else ""
    return f"{where}: {format_path(path) or 'top level'}: {message}{more}"

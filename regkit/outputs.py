"""The files a registration writes, under one stable naming scheme, and the exports built on a saved transformation.

:func:`write_outputs` writes a :class:`~regkit.engine.RegistrationResult` into a folder. The names never change with
options; the optional files (their ``config.outputs`` flag in brackets, :class:`~regkit.config.OutputsConfig`) are
written when their flag is true:

* ``warped.nii.gz``: the moving image resampled onto the fixed grid (linear, float) [``warped``];
* ``warped_labels.nii.gz``: the moving label map resampled onto the fixed grid (nearest, integer type kept) [when
  moving labels are given];
* ``displacement.nii.gz``: the pull-back displacement of the whole transformation on the fixed grid, ITK convention
  (below) [``displacement``];
* ``inverse_displacement.nii.gz``: the displacement of the inverse transformation on the MOVING grid
  [``inverse_displacement``];
* ``affine.mat``: the ITK affine transform of the linear stages (moments, rigid, affine);
* ``transform.h5``: one ITK composite transform, the affine and the CPAB displacement field, equivalent to
  ``displacement.nii.gz`` [``transform_h5``];
* ``transform.json``: the exact transformation (:meth:`~regkit.transform.Transformation.save`);
* ``jacobian.nii.gz``: the analytic Jacobian determinant on the fixed grid, float32 [``jacobian``];
* ``metrics.json``: similarity before/after, Dice/HD95, folds, SDlogJ, runtime, memory, ... (below);
* ``config.yaml``: the resolved configuration (:func:`~regkit.config.dump_config`);
* ``qc.png``: the quality-control picture of :func:`qc_picture` [``qc_png``].

Displacement fields (``displacement.nii.gz``, ``inverse_displacement.nii.gz``, ``regkit invert``) follow ITK and
ANTs: a vector image on the grid it is evaluated on, components in LPS millimetres in (x, y[, z]) order, pull-back
``x_moving = x_fixed + u(x_fixed)``; NIfTI files get intent code 1007 (vector) and the shape ``X x Y x Z x 1 x 3``
(``X x Y x 1 x 1 x 2`` in 2D). Voxels are float32: SimpleITK's ``DisplacementFieldTransform`` wants float64, so cast
first (``sitk.DisplacementFieldTransform(sitk.Cast(field, sitk.sitkVectorFloat64))``); ANTs reads the file as is.

``transform.h5`` holds ``CompositeTransform([affine, field])``; ITK applies the last transform of a composite first,
so it maps ``x -> M(phi(x))``, the order of :class:`~regkit.transform.Transformation`.

``metrics.json`` (every value a plain number; NaN written as null):

* ``similarity``: for ``ncc``, ``mse`` and the similarity of the last optimized stage, ``{"before", "after"}``: the loss
  as regkit minimizes it (``ncc``: 1 - NCC, ``lncc``: 1 - mean local cc^2, ``mi``: -MI in nats, ``mse``), lower is
  better, on the full-resolution fixed image against the moving image resampled onto the fixed grid with the identity
  (``before``) and with the transformation (``after``), both rescaled to [0, 1] between their 0.5th and 99.5th
  percentiles, no masks;
* ``labels`` (both label maps given): per label and mean Dice before and after, and HD95 (mm) after, over the labels
  present in both maps (Learn2Reg's rule; 0 is background);
* ``jacobian``: Learn2Reg's ``fraction_nonpositive`` and ``sdlogj`` from central differences of
  ``displacement.nii.gz`` (:mod:`regkit.spatial.metrics`), and the analytic determinant's ``analytic_min`` and
  ``analytic_max``;
* ``field_of_view_overlap``: the fraction of the fixed grid that lies inside the moving image's box (identity map);
* ``runtime``: seconds per stage (with the levels' iterations and similarities) and in total; ``peak_memory``: bytes
  and how they were measured (CUDA ``max_memory_allocated``, else the process's peak resident set size);
* ``device``, ``seed``, ``versions``; ``images``: the fixed and moving grids (``regkit invert`` and ``regkit export``
  read the moving grid from here).

Atomicity: everything is written into a temporary folder beside the output folder, which is renamed into place only
when complete; an existing folder is replaced (with ``overwrite``) only after the new one is complete, and only if it is
empty or a regkit output folder (holds ``transform.json``). On any error, or Ctrl-C, the temporary folder is removed, so
no half-written output ever exists.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from regkit import __version__, _atomic
from regkit.config import dump_config
from regkit.engine import rescale_intensities
from regkit.errors import ImageDimensionError, ImageValueError, ImageWriteError, RegkitError
from regkit.io import Image, write_image
from regkit.png import write_png
from regkit.similarity import build_similarity
from regkit.spatial.affine import grid_centre, to_sitk_affine, write_itk_affine
from regkit.spatial.grid import Grid
from regkit.spatial.metrics import dice_per_label, fraction_nonpositive, hd95_per_label, jacobian_determinant, sdlogj
from regkit.spatial.sampling import sample_image
from regkit.transform import Transformation

if TYPE_CHECKING:
    import SimpleITK as sitk

    from regkit.engine import RegistrationResult

__all__ = [
    "OUTPUT_FILES",
    "OutputExistsError",
    "RegistrationInputs",
    "apply_itk_transform",
    "as_label_map",
    "check_output_dir",
    "field_of_view_overlap",
    "learn2reg_displacement",
    "qc_picture",
    "read_moving_grid",
    "read_registration_inputs",
    "resample",
    "write_displacement",
    "write_learn2reg",
    "write_outputs",
]

OUTPUT_FILES: dict[str, str] = {
    "warped": "warped.nii.gz",
    "warped_labels": "warped_labels.nii.gz",
    "displacement": "displacement.nii.gz",
    "inverse_displacement": "inverse_displacement.nii.gz",
    "affine": "affine.mat",
    "transform_h5": "transform.h5",
    "transform": "transform.json",
    "jacobian": "jacobian.nii.gz",
    "metrics": "metrics.json",
    "config": "config.yaml",
    "qc": "qc.png",
}
"""Output key -> file name inside the output folder (fixed; never depends on options)."""

_PERCENTILES = (0.5, 99.5)  # display window of the QC picture
_QC_SIDE = 256  # longest side of a QC panel, pixels
_QC_GAP = 4  # black pixels between QC panels
_WRITERS = 4  # threads writing image files while the next outputs are computed


class OutputExistsError(RegkitError):
    """The output folder exists and overwriting was not asked for."""


# ----------------------------------------------------------------------------------------------------------------------
# Input checks


def check_output_dir(out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """The output folder as an absolute, normalised Path, after checking that it may be written.

    Raises :class:`OutputExistsError` if it exists and ``overwrite`` is False, or if ``overwrite`` would replace a
    non-empty folder that is not a regkit output (no ``transform.json``), and :class:`RegkitError` if it is a file.
    """
    out = Path(os.path.abspath(out_dir))
    if out.exists() and not out.is_dir():
        raise RegkitError(f"output {out_dir} exists and is not a folder; choose another -o")
    if out.exists() and not overwrite:
        raise OutputExistsError(f"output folder {out_dir} exists; use --overwrite to replace it, or choose another -o")
    if out.exists() and any(out.iterdir()) and not (out / OUTPUT_FILES["transform"]).is_file():
        raise OutputExistsError(
            f"output folder {out_dir} is not empty and holds no {OUTPUT_FILES['transform']}: not a regkit output "
            "folder, so --overwrite does not replace it; choose another -o"
        )
    return out


def as_label_map(image: Image, name: str) -> Image:
    """``image`` as an integer label map: integer types unchanged, floats holding only integer values converted to
    int64 (label maps are often stored as float NIfTI); other floats raise :class:`ImageValueError` naming ``name``."""
    data = image.data
    if not data.is_floating_point():
        return image
    bad = ~torch.isfinite(data) | (data != data.round())
    if bool(bad.any()):
        example = float(data[bad][0])
        raise ImageValueError(
            f"{name} holds non-integer values (e.g. {example:g} at {int(bad.sum())} voxels); a label map must hold "
            "integer labels"
        )
    return Image(data.to(torch.int64), image.grid)


@dataclasses.dataclass(frozen=True)
class RegistrationInputs:
    """The images of one registration, read and checked by :func:`read_registration_inputs`."""

    fixed: Image
    moving: Image
    fixed_labels: Image | None = None
    moving_labels: Image | None = None
    fixed_mask: Image | None = None
    moving_mask: Image | None = None


def read_registration_inputs(
    fixed: str | os.PathLike,
    moving: str | os.PathLike,
    *,
    fixed_labels: str | os.PathLike | None = None,
    moving_labels: str | os.PathLike | None = None,
    fixed_mask: str | os.PathLike | None = None,
    moving_mask: str | os.PathLike | None = None,
) -> RegistrationInputs:
    """Read the images of one registration (the CLI's ``register`` and every batch job): all must have the fixed
    image's dimension (:class:`ImageDimensionError` naming the files), and label maps must hold integer labels
    (:func:`as_label_map`)."""
    from regkit.io import read_image

    fixed_image, moving_image = read_image(fixed), read_image(moving)
    if fixed_image.ndim != moving_image.ndim:
        raise ImageDimensionError(f"{fixed} is {fixed_image.ndim}D but {moving} is {moving_image.ndim}D")
    optional: dict[str, Image | None] = {}
    for key, path in (
        ("fixed_labels", fixed_labels),
        ("moving_labels", moving_labels),
        ("fixed_mask", fixed_mask),
        ("moving_mask", moving_mask),
    ):
        image = None if path is None else read_image(path)
        if image is not None and image.ndim != fixed_image.ndim:
            raise ImageDimensionError(f"{path} is {image.ndim}D but the images are {fixed_image.ndim}D")
        optional[key] = as_label_map(image, str(path)) if image is not None and key.endswith("_labels") else image
    return RegistrationInputs(fixed_image, moving_image, **optional)


def field_of_view_overlap(fixed: Grid, moving: Grid, samples: int = 24) -> float:
    """Fraction of the fixed grid's voxel-centre box that lies inside the moving grid's box (half a voxel beyond its
    outer voxel centres) under the identity map of world space; estimated on a ``samples``-per-axis lattice."""
    index = torch.stack(
        torch.meshgrid(
            *[torch.linspace(0, s - 1, min(s, samples), dtype=torch.float64) for s in fixed.size], indexing="ij"
        ),
        dim=-1,
    ).reshape(-1, fixed.ndim)
    inside_index = moving.world_to_index(fixed.index_to_world(index))
    size = torch.tensor(moving.size, dtype=torch.float64)
    inside = ((inside_index >= -0.5) & (inside_index <= size - 0.5)).all(dim=-1)
    return float(inside.double().mean())


# ----------------------------------------------------------------------------------------------------------------------
# Resampling and field files


def resample(
    transform: Transformation,
    image: Image,
    reference: Grid | None = None,
    mode: str = "linear",
    device: torch.device | str | None = None,
) -> Image:
    """``image`` (in the moving world space, any grid) resampled onto ``reference`` (default: the transformation's
    fixed grid) through ``transform``: ``out(x) = image(T(x))``, 0 outside. ``"linear"`` gives a float image
    (float64 stays float64), ``"nearest"`` keeps the voxel type (label sets are preserved)."""
    grid = reference or transform.fixed_grid
    if image.ndim != grid.ndim:
        raise ImageDimensionError(f"the image is {image.ndim}D but the reference grid is {grid.ndim}D")
    on_grid = dataclasses.replace(transform, fixed_grid=grid)
    data = image.data if device is None else image.data.to(device)
    if mode == "linear" and data.dtype != torch.float64:
        data = data.float()
    return Image(on_grid.warp(data, image.grid, mode=mode).cpu(), grid)


def _sample(image: Image, world: torch.Tensor, mode: str = "linear") -> torch.Tensor:
    """``image`` at world points ``(..., n)`` (on their device), returned on the CPU: float for linear, the voxel
    type for nearest; 0 outside."""
    data = image.data.to(world.device)
    if mode == "linear" and not data.is_floating_point():
        data = data.float()
    return sample_image(data, image.grid, world, mode=mode).cpu()


def _sitk_image(array: np.ndarray, grid: Grid, vector: bool) -> sitk.Image:
    """A SimpleITK image of ``array`` (``grid.shape``, plus a trailing component axis if ``vector``) on ``grid``."""
    import SimpleITK as sitk

    itk_image = sitk.GetImageFromArray(np.ascontiguousarray(array), isVector=vector)
    itk_image.SetSpacing(grid.spacing)
    itk_image.SetOrigin(grid.origin)
    itk_image.SetDirection(np.ravel(grid.direction).tolist())
    return itk_image


def write_displacement(field: torch.Tensor, grid: Grid, path: str | os.PathLike) -> Path:
    """Write a displacement ``(*grid.shape, n)`` (LPS mm) as an ITK vector image (float32), atomically; the format
    follows the suffix (``.nii.gz``: intent 1007, shape ``X x Y x Z x 1 x 3``; ``.mha``, ``.nrrd`` also work)."""
    import SimpleITK as sitk

    path = Path(path)
    if tuple(field.shape) != (*grid.shape, grid.ndim):
        raise ValueError(f"displacement of shape {tuple(field.shape)} does not fit grid shape {grid.shape}")
    if not path.parent.is_dir():
        raise ImageWriteError(f"cannot write {path}: folder {path.parent} does not exist")
    try:
        with _atomic.replacing(path) as tmp:
            sitk.WriteImage(_sitk_image(field.detach().cpu().float().numpy(), grid, vector=True), str(tmp))
    except RuntimeError as err:
        raise ImageWriteError(f"cannot write {path}: {' '.join(str(err).split())[-200:]}") from err
    return path


def _write_transform_h5(transform: Transformation, cpab_field: torch.Tensor, path: Path) -> None:
    """``transform`` as one ITK composite transform file, ``CompositeTransform([affine, field])`` with ``cpab_field``
    the displacement of its CPAB part on the fixed grid; ITK evaluates it as ``affine(field(x))`` (the last transform
    added acts first)."""
    import SimpleITK as sitk

    grid = transform.fixed_grid
    field_transform = sitk.DisplacementFieldTransform(_sitk_image(cpab_field.double().numpy(), grid, vector=True))
    affine = to_sitk_affine(transform.matrix, grid_centre(grid))
    sitk.WriteTransform(sitk.CompositeTransform([affine, field_transform]), str(path))


def apply_itk_transform(path: str | os.PathLike, image: Image, reference: Grid, mode: str = "linear") -> Image:
    """Resample ``image`` onto ``reference`` with an ITK transform file (e.g. ``transform.h5``) through
    ``SimpleITK.Resample``: ``out(x) = image(T(x))``, 0 outside; linear gives float32, nearest keeps the voxel type."""
    import SimpleITK as sitk

    path = Path(path)
    if not path.is_file():
        raise RegkitError(f"{path}: no such file")
    try:
        itk_transform = sitk.ReadTransform(str(path))
    except RuntimeError as err:
        raise RegkitError(f"{path}: not a readable ITK transform file") from err
    if itk_transform.GetDimension() != reference.ndim or image.ndim != reference.ndim:
        raise ImageDimensionError(
            f"{path} is a {itk_transform.GetDimension()}D transform but the image is {image.ndim}D and the reference "
            f"{reference.ndim}D"
        )
    data = image.data.cpu()
    if mode == "linear":
        data = data.float()
    elif data.dtype == torch.bool:
        data = data.to(torch.uint8)
    source = _sitk_image(data.numpy(), image.grid, vector=False)
    interpolator = sitk.sitkLinear if mode == "linear" else sitk.sitkNearestNeighbor
    out = sitk.Resample(
        source,
        reference.size,
        itk_transform,
        interpolator,
        reference.origin,
        reference.spacing,
        np.ravel(reference.direction).tolist(),
        0.0,
        source.GetPixelID(),
    )
    return Image(torch.from_numpy(sitk.GetArrayFromImage(out)), reference)


def learn2reg_displacement(
    transform: Transformation, moving_grid: Grid, device: torch.device | str | None = None
) -> np.ndarray:
    """The transformation as a Learn2Reg displacement: ``(X, Y, Z, 3)`` (``(X, Y, 2)`` in 2D) float32 in nibabel's
    ``[i, j, k]`` array order, in voxel units, such that fixed voxel ``(i, j, k)`` corresponds to the moving voxel
    ``(i, j, k) + disp[i, j, k]`` (``scipy.ndimage.map_coordinates(moving, identity + disp)``, as Learn2Reg's
    evaluation warps label maps). When fixed and moving share one grid, as in Learn2Reg's data, these are voxel units
    of the fixed image; otherwise the moving continuous index minus the fixed index."""
    fixed = transform.fixed_grid
    world = fixed.world_points(torch.float64, device)
    moving_index = moving_grid.world_to_index(transform.transform_world(world))
    disp = (moving_index - fixed.index_points(torch.float64, device)).float().cpu()
    n = fixed.ndim
    return disp.permute(*reversed(range(n)), n).contiguous().numpy()


def _nifti_affine(grid: Grid) -> np.ndarray:
    """4x4 voxel-to-RAS matrix of ``grid`` (2D grids embedded in 3D), for nibabel."""
    n = grid.ndim
    affine = np.eye(4)
    affine[:n, :n] = grid.affine()[:n, :n]
    affine[:n, 3] = grid.affine()[:n, n]
    return np.diag([-1.0, -1.0, 1.0, 1.0]) @ affine


def write_learn2reg(
    transform: Transformation, moving_grid: Grid, path: str | os.PathLike, device: torch.device | str | None = None
) -> Path:
    """Write :func:`learn2reg_displacement` as a NIfTI file (4D ``X x Y x Z x 3`` float32, the fixed grid's affine),
    atomically. Learn2Reg names these ``disp_FIXED_MOVING.nii.gz`` with 4-digit case ids (``disp_0001_0002.nii.gz``)."""
    import nibabel as nib

    path = Path(path)
    if not path.name.endswith((".nii.gz", ".nii")):
        raise ImageWriteError(f"cannot write {path}: a Learn2Reg displacement is a .nii.gz file")
    if not path.parent.is_dir():
        raise ImageWriteError(f"cannot write {path}: folder {path.parent} does not exist")
    disp = learn2reg_displacement(transform, moving_grid, device)
    image = nib.Nifti1Image(disp, _nifti_affine(transform.fixed_grid))
    image.header.set_xyzt_units("mm")
    with _atomic.replacing(path) as tmp:
        nib.save(image, str(tmp))
    return path


def _grid_dict(grid: Grid) -> dict[str, list]:
    return {
        "size": list(grid.size),
        "spacing": list(grid.spacing),
        "origin": list(grid.origin),
        "direction": [list(row) for row in grid.direction],
    }


def read_moving_grid(result_dir: str | os.PathLike) -> Grid:
    """The moving image's grid recorded in ``RESULT_DIR/metrics.json`` by :func:`write_outputs`."""
    path = Path(result_dir) / OUTPUT_FILES["metrics"]
    try:
        g = json.loads(path.read_text())["images"]["moving"]
        return Grid.create(g["size"], g["spacing"], g["origin"], g["direction"])
    except FileNotFoundError:
        raise RegkitError(f"{path}: no such file (give the moving image's grid with --reference)") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RegkitError(f"{path}: no moving grid recorded ({type(err).__name__}: {err})") from err


# ----------------------------------------------------------------------------------------------------------------------
# Metrics


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _similarities(result: RegistrationResult, world: torch.Tensor, mapped: torch.Tensor) -> dict[str, dict]:
    """``{name: {"before", "after"}}`` for ncc, mse and the last optimized stage's similarity (module docstring);
    ``world``: the fixed voxel centres, ``mapped``: their images under the transformation (moving world space)."""
    measures: dict[str, dict[str, Any]] = {"ncc": {}, "mse": {}}
    optimized = [stage for stage in result.config.stages if hasattr(stage, "similarity")]
    if optimized and optimized[-1].similarity.name in ("lncc", "mi"):
        last = optimized[-1].similarity
        measures[last.name] = last.model_dump(exclude={"name"})
    fixed = rescale_intensities(result.fixed.data)[None, None]
    moving = Image(rescale_intensities(result.moving.data), result.moving.grid)
    images = {"before": _sample(moving, world)[None, None], "after": _sample(moving, mapped)[None, None]}
    out = {}
    with torch.no_grad():
        for name, params in measures.items():
            sim = build_similarity(name, **params)
            out[name] = {key: _finite(float(sim(fixed, image))) for key, image in images.items()}
    return out


def _label_metrics(
    fixed_labels: Image, moving_labels: Image, before: torch.Tensor, after: torch.Tensor, spacing
) -> dict[str, Any]:
    """Dice before/after and HD95 after, over the labels present in both maps (Learn2Reg's rule)."""
    present = set(torch.unique(fixed_labels.data).tolist()) & set(torch.unique(moving_labels.data).tolist())
    labels = sorted(int(v) for v in present if v != 0)
    dice_before = dice_per_label(fixed_labels.data, before, labels)
    dice_after = dice_per_label(fixed_labels.data, after, labels)
    hd95 = hd95_per_label(fixed_labels.data, after, spacing, labels)

    def mean(values: dict[int, float]) -> float | None:
        finite = [v for v in values.values() if math.isfinite(v)]
        return float(np.mean(finite)) if finite else None

    return {
        "labels": labels,
        "dice_before": {str(k): _finite(v) for k, v in dice_before.items()},
        "dice_after": {str(k): _finite(v) for k, v in dice_after.items()},
        "hd95_after_mm": {str(k): _finite(v) for k, v in hd95.items()},
        "mean_dice_before": mean(dice_before),
        "mean_dice_after": mean(dice_after),
        "mean_hd95_after_mm": mean(hd95),
    }


def _peak_memory(result: RegistrationResult) -> dict[str, Any]:
    if result.peak_memory_bytes is not None:
        return {"bytes": int(result.peak_memory_bytes), "measure": "cuda_max_memory_allocated"}
    try:
        import resource
    except ImportError:  # Windows
        return {"bytes": None, "measure": "unavailable"}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"bytes": int(peak if sys.platform == "darwin" else peak * 1024), "measure": "process_peak_rss"}


def _jacobian_metrics(det_fd: torch.Tensor, det_analytic: torch.Tensor) -> dict[str, Any]:
    interior = min(det_fd.shape) > 4  # Learn2Reg drops 2 voxels on each side
    return {
        "fraction_nonpositive": fraction_nonpositive(det_fd) if interior else None,
        "sdlogj": _finite(sdlogj(det_fd)) if interior else None,
        "analytic_min": _finite(float(det_analytic.min())),
        "analytic_max": _finite(float(det_analytic.max())),
    }


# ----------------------------------------------------------------------------------------------------------------------
# QC picture


def _window(values: np.ndarray) -> np.ndarray:
    """Values mapped to [0, 1] between their 0.5th and 99.5th percentiles (clipped)."""
    lo, hi = np.percentile(values, _PERCENTILES)
    return np.zeros_like(values) if hi <= lo else np.clip((values - lo) / (hi - lo), 0.0, 1.0)


def _jacobian_colours(det: np.ndarray, folded: np.ndarray) -> np.ndarray:
    """RGB in [0, 1]: from blue (det <= 1/sqrt 2, shrinking) through white (det = 1) to red (det >= sqrt 2, growing),
    linear in log2(det); ``folded`` pixels green."""
    t = np.clip(2.0 * np.log2(np.maximum(det, 1e-6)), -1.0, 1.0)[..., None]
    white = np.ones(3)
    rgb = np.where(
        t < 0, white + (-t) * (np.array([0.1, 0.25, 0.9]) - white), white + t * (np.array([0.9, 0.1, 0.1]) - white)
    )
    rgb[folded] = (0.0, 1.0, 0.0)
    return rgb


def _slices(shape: tuple[int, ...]) -> list[tuple[tuple, tuple[int, int], bool]]:
    """(tensor index, (row index axis, column index axis), flip rows) of the QC slices: the whole 2D image, or the
    3D mid-slices: axial (k fixed), coronal (j fixed) and sagittal (i fixed), k pointing up."""
    if len(shape) == 2:
        return [((slice(None), slice(None)), (1, 0), False)]
    z, y, x = (s // 2 for s in shape)
    return [
        ((z, slice(None), slice(None)), (1, 0), False),
        ((slice(None), y, slice(None)), (2, 0), True),
        ((slice(None), slice(None), x), (2, 1), True),
    ]


def qc_picture(
    fixed: torch.Tensor,
    warped: torch.Tensor,
    displacement: torch.Tensor,
    det: torch.Tensor,
    folded: torch.Tensor,
    grid: Grid,
) -> np.ndarray:
    """The QC picture as an RGB uint8 array ``(H, W, 3)``: one row per slice (the 2D image, or the three orthogonal
    3D mid-slices), each with a fixed/warped checkerboard, the warped image under the deformed grid (lines of
    constant fixed index of ``x + u(x)``, in yellow) and the Jacobian determinant map (:func:`_jacobian_colours`;
    ``folded`` voxels green). Arrays are on ``grid`` (``grid.shape``, ``displacement`` ``(*grid.shape, n)``); panels
    keep the physical aspect ratio, the longest side :data:`_QC_SIDE` pixels."""
    fixed_w = torch.from_numpy(_window(fixed.float().numpy()))
    warped_w = torch.from_numpy(_window(warped.float().numpy()))
    n = grid.ndim
    to_index = torch.as_tensor(np.linalg.inv(grid.affine()[:n, :n]).T, dtype=torch.float32)
    rows = []
    for index, (row_axis, col_axis), flip in _slices(grid.shape):
        shift = displacement[index].float() @ to_index  # the displacement in index units of the fixed grid
        n_rows, n_cols = shift.shape[:2]
        c_row = torch.arange(n_rows, dtype=torch.float32)[:, None] + shift[..., row_axis]
        c_col = torch.arange(n_cols, dtype=torch.float32)[None, :] + shift[..., col_axis]
        planes = torch.stack([fixed_w[index], warped_w[index], c_row, c_col, det[index].float()])
        mask = folded[index].float()
        if flip:
            planes, mask = planes.flip(-2), mask.flip(-2)
        height_mm, width_mm = n_rows * grid.spacing[row_axis], n_cols * grid.spacing[col_axis]
        scale = _QC_SIDE / max(height_mm, width_mm)
        size = (max(1, round(height_mm * scale)), max(1, round(width_mm * scale)))
        f, w, c_row, c_col, d = F.interpolate(planes[None], size=size, mode="bilinear", align_corners=False)[0].numpy()
        folds = F.interpolate(mask[None, None], size=size, mode="nearest")[0, 0].numpy() > 0
        tile = max(size) // 8
        yy, xx = np.mgrid[: size[0], : size[1]]
        checker = np.where(((yy // tile + xx // tile) % 2 == 0), f, w)
        period = max(2, round(max(n_rows, n_cols) / 16))
        line = np.zeros(size, dtype=bool)
        for coord in (c_row, c_col):
            shifted = coord + period / 2  # lines half a period inside the borders
            slope = np.hypot(*np.gradient(shifted))  # voxels per display pixel; 0 where the edge voxels are stretched
            distance = np.abs(shifted - period * np.round(shifted / period)) / np.maximum(slope, 1e-6)  # pixels
            line |= distance < 0.75
        overlay = np.repeat(w[..., None], 3, axis=-1)
        overlay[line] = (1.0, 0.85, 0.0)
        rows.append([np.repeat(checker[..., None], 3, axis=-1), overlay, _jacobian_colours(d, folds)])
    width = max(panel.shape[1] for row in rows for panel in row) + _QC_GAP  # one column width: panels line up
    lines = [
        np.concatenate([np.pad(p, ((0, _QC_GAP), (0, width - p.shape[1]), (0, 0))) for p in row], 1) for row in rows
    ]
    picture = np.concatenate(lines, axis=0)[:-_QC_GAP, :-_QC_GAP]
    return (picture * 255).round().astype(np.uint8)


# ----------------------------------------------------------------------------------------------------------------------
# Writing a result


def write_outputs(
    result: RegistrationResult,
    out_dir: str | os.PathLike,
    *,
    moving_labels: Image | None = None,
    fixed_labels: Image | None = None,
    overwrite: bool = False,
) -> dict[str, Path]:
    """Write a registration's outputs into ``out_dir`` (module docstring: names, conventions, atomicity).

    Args:
        result: the outcome of :func:`regkit.engine.register`.
        out_dir: the output folder; its parent folders are created. It must not exist unless ``overwrite``.
        moving_labels: optional label map in the moving image's world space (any grid); warped with nearest
            interpolation into ``warped_labels.nii.gz``.
        fixed_labels: optional label map of the fixed image (resampled onto the fixed grid, nearest, if its grid
            differs); with ``moving_labels``, Dice and HD95 go into ``metrics.json``.
        overwrite: replace an existing ``out_dir`` (only once the new outputs are complete).

    Returns:
        Output key (:data:`OUTPUT_FILES`) -> path of every file written.

    Raises:
        OutputExistsError: ``out_dir`` exists and ``overwrite`` is False.
        ImageValueError: a label map holds non-integer values.
        ImageDimensionError: a label map's dimension differs from the images'.
    """
    start = time.perf_counter()
    peak_memory = _peak_memory(result)  # before writing: the registration's peak, not the writer's
    out = check_output_dir(out_dir, overwrite)
    ndim = result.fixed.ndim
    labels = {}
    for name, image in (("moving labels", moving_labels), ("fixed labels", fixed_labels)):
        if image is not None:
            if image.ndim != ndim:
                raise ImageDimensionError(f"the {name} are {image.ndim}D but the images are {ndim}D")
            labels[name] = as_label_map(image, f"the {name}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        # image files are written by threads while the next outputs are computed (compressing a 1 mm brain's fields
        # takes seconds each; SimpleITK releases the GIL while it writes); the pool waits for them before closing
        with ThreadPoolExecutor(max_workers=_WRITERS) as pool:
            moving, fixed = labels.get("moving labels"), labels.get("fixed labels")
            written = _write_all(pool, result, tmp, moving, fixed, start, peak_memory)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {key: out / path.name for key, path in written.items()}


def _write_all(
    pool: ThreadPoolExecutor,
    result: RegistrationResult,
    folder: Path,
    moving_labels: Image | None,
    fixed_labels: Image | None,
    start: float,
    peak_memory: dict[str, Any],
) -> dict[str, Path]:
    """Compute every output and write it into ``folder`` (image files through ``pool``); returns key -> path once
    every write has finished (a failed write raises)."""
    transform, fixed_grid = result.transform, result.fixed.grid
    flags = result.config.outputs
    device = result.device
    paths = {key: folder / name for key, name in OUTPUT_FILES.items()}
    written: dict[str, Path] = {}
    pending: dict[str, Future] = {}

    def done(key: str) -> None:
        written[key] = paths[key]

    def in_background(key: str, write: Callable[..., object], *args: object) -> None:
        pending[key] = pool.submit(write, *args, paths[key])

    # One evaluation of the transformation serves the warped images, the displacement and the CPAB-only field.
    world = fixed_grid.world_points(torch.float64, device)
    mapped = transform.transform_world(world)
    warped = Image(_sample(result.moving, mapped), fixed_grid)
    if flags.warped:
        in_background("warped", write_image, warped)
    label_metrics = None
    if moving_labels is not None:
        warped_labels = Image(_sample(moving_labels, mapped, "nearest"), fixed_grid)
        in_background("warped_labels", write_image, warped_labels)
        if fixed_labels is not None:
            if fixed_labels.grid != fixed_grid:
                fixed_labels = Image(_sample(fixed_labels, world, "nearest"), fixed_grid)
            unmoved_labels = _sample(moving_labels, world, "nearest")
            label_metrics = _label_metrics(
                fixed_labels, moving_labels, unmoved_labels, warped_labels.data, fixed_grid.spacing
            )

    displacement = (mapped - world).float().cpu()
    if flags.displacement:
        in_background("displacement", write_displacement, displacement, fixed_grid)
    if flags.inverse_displacement:
        inverse = transform.inverse_displacement(result.moving.grid, device=device).cpu()
        in_background("inverse_displacement", write_displacement, inverse, result.moving.grid)
    write_itk_affine(paths["affine"], transform.matrix, grid_centre(fixed_grid))
    done("affine")
    if flags.transform_h5:
        n = fixed_grid.ndim
        inverse_matrix = torch.as_tensor(np.linalg.inv(transform.matrix), device=mapped.device)
        cpab_points = mapped @ inverse_matrix[:n, :n].T + inverse_matrix[:n, n]  # phi(x) = M^-1 y
        in_background("transform_h5", _write_transform_h5, transform, (cpab_points - world).cpu())
    transform.save(paths["transform"])
    done("transform")
    det = transform.jacobian_determinant(device=device).cpu()
    if flags.jacobian:
        in_background("jacobian", write_image, Image(det, fixed_grid))
    det_fd = jacobian_determinant(displacement, fixed_grid)
    if flags.qc_png:
        picture = qc_picture(result.fixed.data, warped.data, displacement, det, (det_fd <= 0) | (det <= 0), fixed_grid)
        write_png(picture, paths["qc"])
        done("qc")
    paths["config"].write_text(dump_config(result.config))
    done("config")

    runtime: dict[str, Any] = {
        "total_seconds": result.seconds,
        "stages": [dataclasses.asdict(stage) for stage in result.stages],
    }
    metrics = {
        "similarity": _similarities(result, world, mapped),
        **({"labels": label_metrics} if label_metrics is not None else {}),
        "jacobian": _jacobian_metrics(det_fd, det),
        "field_of_view_overlap": field_of_view_overlap(fixed_grid, result.moving.grid),
        "runtime": runtime,
        "peak_memory": peak_memory,
        "device": result.device,
        "seed": result.config.seed,
        "versions": {
            "regkit": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "images": {"fixed": _grid_dict(fixed_grid), "moving": _grid_dict(result.moving.grid)},
    }
    for key, future in pending.items():
        future.result()  # re-raises a failed write
        done(key)
    runtime["write_seconds"] = round(time.perf_counter() - start, 3)
    paths["metrics"].write_text(json.dumps(metrics, indent=1, allow_nan=False))
    done("metrics")
    return written


def _replace(tmp: Path, out: Path) -> None:
    """Move the complete folder ``tmp`` to ``out``; an existing ``out`` is removed only after the move succeeded."""
    old = None
    if out.exists():
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

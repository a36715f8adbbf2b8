"""Transformations in other tools' conventions: ITK/ANTs displacement fields and transform files, Learn2Reg.

Displacement fields (``displacement.nii.gz``, ``inverse_displacement.nii.gz``, ``regkit invert``) follow ITK and
ANTs: a vector image on the grid it is evaluated on, components in LPS millimetres in (x, y[, z]) order, pull-back
``x_moving = x_fixed + u(x_fixed)``; NIfTI files get intent code 1007 (vector) and the shape ``X x Y x Z x 1 x 3``
(``X x Y x 1 x 1 x 2`` in 2D). Voxels are float32: SimpleITK's ``DisplacementFieldTransform`` wants float64, so cast
first (``sitk.DisplacementFieldTransform(sitk.Cast(field, sitk.sitkVectorFloat64))``); ANTs reads the file as is.

``transform.h5`` holds ``CompositeTransform([affine, field])``; ITK applies the last transform of a composite first,
so it maps ``x -> M(phi(x))``, the order of :class:`~regkit.transform.Transformation`.

Learn2Reg's displacements (:func:`learn2reg_displacement`) are in voxel units and nibabel's ``[i, j, k]`` array order
instead (their evaluation's convention).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from regkit import _atomic
from regkit.errors import ImageDimensionError, ImageWriteError, RegkitError
from regkit.io.image import Image
from regkit.io.preflight import input_kind, native_name
from regkit.spatial.affine import grid_centre, to_sitk_affine
from regkit.spatial.grid import Grid

if TYPE_CHECKING:
    import SimpleITK as sitk

    from regkit.transform import Transformation

__all__ = [
    "apply_itk_transform",
    "learn2reg_displacement",
    "write_displacement",
    "write_learn2reg",
    "write_transform_h5",
]


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
    native_name(path, ImageWriteError)
    if not path.parent.is_dir():
        raise ImageWriteError(f"cannot write {path}: folder {path.parent} does not exist")
    try:
        with _atomic.replacing(path) as tmp:
            sitk.WriteImage(_sitk_image(field.detach().cpu().float().numpy(), grid, vector=True), str(tmp))
    except RuntimeError as err:
        raise ImageWriteError(f"cannot write {path}: {' '.join(str(err).split())[-200:]}") from err
    return path


def write_transform_h5(transform: Transformation, cpab_field: torch.Tensor, path: Path) -> None:
    """``transform`` as one ITK composite transform file, ``CompositeTransform([affine, field])`` with ``cpab_field``
    the displacement of its CPAB part on the fixed grid; ITK evaluates it as ``affine(field(x))`` (the last transform
    added acts first)."""
    import SimpleITK as sitk

    name = native_name(path, ImageWriteError)
    grid = transform.fixed_grid
    field_transform = sitk.DisplacementFieldTransform(_sitk_image(cpab_field.double().numpy(), grid, vector=True))
    affine = to_sitk_affine(transform.matrix, grid_centre(grid))
    sitk.WriteTransform(sitk.CompositeTransform([affine, field_transform]), name)


def apply_itk_transform(path: str | os.PathLike, image: Image, reference: Grid, mode: str = "linear") -> Image:
    """Resample ``image`` onto ``reference`` with an ITK transform file (e.g. ``transform.h5``) through
    ``SimpleITK.Resample``: ``out(x) = image(T(x))``, 0 outside; linear gives float32, nearest keeps the voxel type.
    A path that is not a regular file SimpleITK can open (:func:`~regkit.io.preflight.input_kind`) or not a
    transform file raises :class:`RegkitError`."""
    import SimpleITK as sitk

    path = Path(path)
    if input_kind(path, RegkitError) == "folder":
        raise RegkitError(f"{path} is a folder, not an ITK transform file")
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

"""Headers and geometry: the grid of an image header, NIfTI's sform/qform chosen by ITK's rules, orientation codes.

Conventions (those of ITK, see :mod:`regkit.spatial.grid`): LPS world millimetres, ``world = origin + direction @
(spacing * index)`` with index (i, j[, k]); tensors in ``[z, y, x]`` layout. :func:`grid_from_header` checks a
header's geometry (positive spacing, orthonormal direction) and its dimensions; :func:`itk_nifti_affine` is the
voxel-to-RAS matrix ITK 5.4 takes from a NIfTI header; :func:`orientation_code` names where index axes point
(nibabel's letters) and :func:`reorient` permutes and flips an image's axes, voxels moving with the header.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from regkit.errors import GeometryError, ImageDimensionError
from regkit.io.image import Image
from regkit.spatial.grid import Grid

if TYPE_CHECKING:
    from nibabel.nifti1 import Nifti1Header

__all__ = ["NO_NIFTI_ORIENTATION", "grid_from_header", "itk_nifti_affine", "orientation_code", "reorient"]

# Anatomical letter of the + and - direction of each LPS world axis.
_AXIS_LETTERS = (("L", "R"), ("P", "A"), ("S", "I"))

NO_NIFTI_ORIENTATION = (
    "{path}: the sform has shear or non-uniform scaling and there is no qform; ITK (and regkit) need a rotation and "
    "spacing (set a qform, e.g. with nibabel's img.set_qform(affine, code=1))"
)
"""Message (``format`` it with ``path``) for a NIfTI file without an orientation ITK accepts."""


# ----------------------------------------------------------------------------------------------------------------------
# Header geometry


def grid_from_header(
    path: Path,
    size: tuple[int, ...],
    spacing: tuple[float, ...] | np.ndarray,
    origin: tuple[float, ...] | np.ndarray,
    direction: tuple[float, ...] | np.ndarray,
    components: int,
    ndim: int | None,
) -> Grid:
    """The 2D/3D grid of an image header with ``len(size)`` axes, dropping trailing axes of size 1 as allowed.

    Raises ImageDimensionError if the image does not reduce to ``ndim`` (2 or 3 when None) axes or is a vector image,
    and GeometryError (naming ``path``) for invalid geometry.
    """
    size = tuple(int(s) for s in size)
    n = len(size)
    dims = "x".join(map(str, size))
    if components != 1:
        raise ImageDimensionError(
            f"{path} has {components} components per voxel (a vector, complex or RGB image of size {dims}); regkit "
            f"needs a scalar image: extract one component, e.g. "
            f"`SimpleITK.VectorIndexSelectionCast(SimpleITK.ReadImage('{path.name}'), 0)`, or convert RGB to gray"
        )
    target = ndim or min(max(n, 2), 3)
    keep = n
    while keep > target and size[keep - 1] == 1:
        keep -= 1
    if keep > target:
        what = "volume" if target == 3 else "image"
        index = ", ".join([":"] * target + ["0"] * (n - target))
        hint = f"`SimpleITK.ReadImage('{path.name}')[{index}]`"
        if n == 4 and target == 3 and path.name.lower().endswith((".nii", ".nii.gz")):
            hint = f"`fslroi {path.name} vol0.nii.gz 0 1` (FSL) or {hint}"
        raise ImageDimensionError(
            f"{path} has {n} dimensions ({dims}); regkit needs a {target}D {what} here: pick one index along axis "
            f"{target + 1} (of {size[target]}), e.g. {hint}"
        )
    if keep < target:
        raise ImageDimensionError(f"{path} is a {keep}D image ({dims}); a {target}D volume is expected here")
    d = np.asarray(direction, dtype=np.float64).reshape(n, n)
    if keep < n and max(np.abs(d[:keep, keep:]).max(), np.abs(d[keep:, :keep]).max()) > 1e-6:
        raise ImageDimensionError(
            f"{path} ({dims}) cannot be read as {keep}D: its axes of size 1 are oblique to the world axes that would "
            f"be dropped; read it with ndim={n}"
        )
    try:
        return Grid.create(size[:keep], tuple(spacing)[:keep], tuple(origin)[:keep], d[:keep, :keep])
    except GeometryError as err:
        raise GeometryError(f"{path}: {err}") from err


def itk_nifti_affine(header: Nifti1Header, path: Path) -> np.ndarray:
    """4x4 voxel-to-RAS matrix that ITK 5.4 uses for a NIfTI header (rule in
    :func:`~regkit.io.files.read_image_nibabel`)."""
    scode, qcode = int(header["sform_code"]), int(header["qform_code"])
    zooms = np.abs(np.asarray(header["pixdim"][1:4], dtype=np.float64))
    zooms[zooms == 0] = 1.0
    if scode == 0 and qcode == 0:
        return np.diag([-zooms[0], -zooms[1], zooms[2], 1.0])
    # As nifti1_io fills them: an unset sform is all zeros, an unset qform is diag(pixdim); float32 as ITK holds them.
    sform = header.get_sform(coded=False).astype(np.float32) if scode else np.zeros((4, 4), np.float32)
    qform = header.get_qform(coded=False).astype(np.float32) if qcode else np.diag([*zooms, 1.0]).astype(np.float32)
    use_sform = bool(
        np.abs(sform[:3, :3] - qform[:3, :3]).max() <= 1e-5
        and np.abs(sform[:, 3] - qform[:, 3]).sum() <= 1e-7
        and np.abs(sform[3] - qform[3]).sum() <= 1e-7
    )
    if scode:
        linear = sform[:3, :3].astype(np.float64)
        norms = np.linalg.norm(linear, axis=0)
        rotation = linear / np.where(norms > 0, norms, 1.0)
        no_shear = (
            np.array_equal(sform[3], [0, 0, 0, 1])
            and abs(np.linalg.det(linear)) > 0
            and np.abs(rotation @ rotation.T - np.eye(3)).max() <= 1e-4
        )
        if no_shear:
            if qcode == 0 or scode == 1:
                use_sform = True
            else:
                use_sform = bool(np.abs(sform - qform).max() <= 1e-4)
    if use_sform:
        return sform.astype(np.float64)
    if qcode:
        return header.get_qform(coded=False)
    raise GeometryError(NO_NIFTI_ORIENTATION.format(path=path))


# ----------------------------------------------------------------------------------------------------------------------
# Orientation codes


def _axis_map(direction: np.ndarray) -> list[tuple[int, int]]:
    """For each index axis, the closest world axis and the sign (+1/-1) of the direction along it.

    Axes are assigned from the most to the least clearly aligned column, each world axis once (nibabel's
    ``io_orientation`` rule), so oblique directions get a valid permutation.
    """
    remaining = np.array(direction, dtype=np.float64)
    order = np.argsort(-np.max(remaining**2, axis=0), kind="stable")
    result: list[tuple[int, int]] = [(0, 0)] * remaining.shape[1]
    for col in order:
        row = int(np.argmax(np.abs(remaining[:, col])))
        result[col] = (row, 1 if remaining[row, col] > 0 else -1)
        remaining[row, :] = 0.0
    return result


def orientation_code(grid: Grid) -> str:
    """nibabel-style axis code: the anatomical direction toward which index axes i, j[, k] point (e.g. "RAS").

    Letters: L/R, P/A, S/I for the world x, y, z axes; e.g. "LAS" means i runs toward the patient's Left, j toward
    Anterior and k toward Superior. The LPS identity direction is "LPS". For oblique directions each axis gets its
    closest world axis (nibabel's ``aff2axcodes``). 2D grids get two letters from L/R and P/A.

    This is the convention of nibabel, FreeSurfer and ITK >= 5.4's ``AnatomicalOrientation`` "positive" codes. ITK's
    older ``SpatialOrientation`` names (``ITK_COORDINATE_ORIENTATION_RAI`` ...) and ``orientation`` in
    ``DICOMOrient`` use the opposite letters: they name where each axis comes *from*, so our "LPS" is ITK's "RAI".
    """
    return "".join(_AXIS_LETTERS[axis][0 if sign > 0 else 1] for axis, sign in _axis_map(np.asarray(grid.direction)))


def reorient(image: Image, code: str) -> Image:
    """The same image with its index axes permuted and flipped so that :func:`orientation_code` gives ``code``.

    Voxels move together with the header: the LPS world position of every voxel centre, and its value, are
    unchanged (only the tensor layout, spacing order, origin corner and direction columns change). For oblique
    images the result's axes point toward the requested directions as closely as the image's own axes allow.
    """
    n = image.ndim
    code = code.upper()
    letters = {
        letter: (axis, sign)
        for axis, pair in enumerate(_AXIS_LETTERS[:n])
        for letter, sign in zip(pair, (1, -1), strict=True)
    }
    if len(code) != n or any(c not in letters for c in code) or len({letters[c][0] for c in code}) != n:
        valid = ", ".join("/".join(pair) for pair in _AXIS_LETTERS[:n])
        raise GeometryError(
            f"invalid orientation code {code!r} for a {n}D image: give one letter per axis, one from each of {valid}"
        )
    current = _axis_map(image.direction)
    source = [[axis for axis, _ in current].index(letters[c][0]) for c in code]
    flips = [current[a][1] != letters[c][1] for a, c in zip(source, code, strict=True)]
    grid = image.grid
    # Tensor dim of index axis a is n - 1 - a.
    data = image.data.permute([n - 1 - source[t] for t in reversed(range(n))])
    flip_dims = [n - 1 - t for t in range(n) if flips[t]]
    if flip_dims:
        data = data.flip(flip_dims)
    corner = torch.zeros(n, dtype=torch.float64)
    for t, a in enumerate(source):
        if flips[t]:
            corner[a] = grid.size[a] - 1
    direction = np.asarray(grid.direction)[:, source] * np.where(flips, -1.0, 1.0)
    new_grid = Grid.create(
        [grid.size[a] for a in source],
        [grid.spacing[a] for a in source],
        grid.index_to_world(corner).tolist(),
        direction,
    )
    return Image(data.contiguous(), new_grid)

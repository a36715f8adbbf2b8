"""Image files: reading and writing NIfTI, MetaImage, NRRD, PNG and DICOM series, with their geometry.

Conventions (those of ITK, see :mod:`regkit.spatial.grid`):

* An :class:`~regkit.io.image.Image` is a tensor in ``[z, y, x]`` (3D) or ``[y, x]`` (2D) layout plus a
  :class:`~regkit.spatial.Grid`: ``world = origin + direction @ (spacing * index)`` with index (i, j[, k]) and world
  points in LPS millimetres.
* Orientation lives in the header only. Arrays are never flipped or transposed to "fix" orientation; the one layout
  change made is the transpose of nibabel's ``[i, j, k]`` arrays (NIfTI voxels) to ``[k, j, i]``.
* Voxel types are kept where torch has them (uint8, int8, int16, int32, int64, float32, float64); uint16 becomes int32,
  uint32 and uint64 become int64 (all values exactly). NIfTI intensity scaling (``scl_slope``/``scl_inter``) is applied
  on read, which gives float32 (float64 for float64 files), as ITK does.

What each format keeps on a round trip through :func:`write_image` and :func:`read_image` (values always bit for bit):

========== ================================================================================================
NIfTI      geometry as float32 (sform and qform, both with code 1 = scanner): about 1e-7 relative; exact for
           values that float32 represents (e.g. spacing 0.5, origin -90.25, axis-aligned directions)
MetaImage  geometry exactly (17 significant digits); .mhd keeps the voxels in a companion .zraw file
NRRD       spacing and origin exactly, direction to ~1e-16 (stored as spacing times direction); .nhdr keeps the
           voxels in a companion .raw.gz file
PNG        2D, uint8 or uint16 voxels (integers in [0, 65535] are written as uint16) and spacing; origin and
           direction are lost (a warning says so)
========== ================================================================================================
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import re
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import SimpleITK as sitk
import torch

from regkit import _atomic
from regkit.errors import (
    GeometryError,
    ImageReadError,
    ImageValueError,
    ImageWriteError,
    RegkitError,
)
from regkit.io.image import Image
from regkit.io.orientation import NO_NIFTI_ORIENTATION, grid_from_header, itk_nifti_affine
from regkit.spatial.grid import Grid

if TYPE_CHECKING:
    from nibabel.arrayproxy import ArrayProxy
    from nibabel.nifti1 import Nifti1Header

__all__ = [
    "DATA_FILES_ANYWHERE",
    "SUPPORTED_EXTENSIONS",
    "format_of",
    "read_image",
    "read_image_nibabel",
    "write_image",
]


# Extension -> format name; the longest matching suffix wins (".nii.gz" before ".gz").
_FORMATS = {
    ".nii": "NIfTI",
    ".nii.gz": "NIfTI",
    ".mha": "MetaImage",
    ".mhd": "MetaImage",
    ".nrrd": "NRRD",
    ".nhdr": "NRRD",
    ".png": "PNG",
}
SUPPORTED_EXTENSIONS: tuple[str, ...] = tuple(_FORMATS)

# The header line naming a MetaImage's or detached NRRD header's voxel file(s): LOCAL (MetaImage: the voxels follow),
# LIST (names on the following lines), a printf pattern with its range ("slice%03d.raw 1 10 1"), or one file name.
_DATA_FILE_LINE = {
    "MetaImage": re.compile(rb"^[ \t]*ElementDataFile[ \t]*=[ \t]*(\S[^\r\n]*?)[ \t]*\r?$", re.M),
    "NRRD": re.compile(rb"^[ \t]*data ?file[ \t]*:[ \t]*(\S[^\r\n]*?)[ \t]*\r?$", re.M | re.I),
}
_HEADER_BYTES = 1 << 16  # headers are read this far for their data-file line
DATA_FILES_ANYWHERE = "REGKIT_DATA_FILES_ANYWHERE"
"""Set to 1 to let MetaImage and NRRD headers name voxel files outside their own folder (refused by default: a header
could otherwise make regkit read any file the user can, e.g. ``ElementDataFile = /etc/passwd``)."""

# numpy voxel types kept as they are, and those widened to a signed type that holds all their values.
_KEPT_DTYPES = {np.dtype(t) for t in (np.uint8, np.int8, np.int16, np.int32, np.int64, np.float32, np.float64)}
_WIDENED_DTYPES = {np.dtype(np.uint16): np.int32, np.dtype(np.uint32): np.int64, np.dtype(np.uint64): np.int64}


# ----------------------------------------------------------------------------------------------------------------------
# Reading


def read_image(path: str | os.PathLike, *, ndim: int | None = None, check_finite: bool = True) -> Image:
    """Read a 2D or 3D scalar image file, or the first DICOM series in a folder, with its LPS geometry.

    Geometry always comes from SimpleITK (for NIfTI, ITK's choice between sform and qform; see
    :func:`read_image_nibabel`). Voxels come from SimpleITK too, except for NIfTI, whose voxels nibabel reads (scaled
    as ITK scales them) because ITK's NIfTI library silently turns NaN/Inf voxels into 0 and fills the missing part of
    a truncated file with 0; here the whole file (the whole gzip stream, CRC included) is read and checked.

    Trailing axes of size 1 beyond the third (e.g. a 3D volume stored with one time point) are dropped. A 3D image
    with one slice (size ``x, y, 1``) stays 3D unless ``ndim=2``, which drops that axis and its world coordinate (the
    slice must then lie in a world x-y plane).

    Args:
        path: a ``.nii``, ``.nii.gz``, ``.mha``, ``.mhd``, ``.nrrd``, ``.nhdr`` or ``.png`` file, or a DICOM folder.
        ndim: 2 or 3 to require that many dimensions; None accepts both.
        check_finite: raise :class:`ImageValueError` if a floating-point image holds NaN or Inf voxels.

    Raises:
        ImageReadError: missing file, unknown extension, corrupt or truncated file, folder without DICOM series.
        ImageDimensionError: more (or fewer) dimensions than wanted, or a vector (multi-component) image.
        GeometryError: non-positive spacing, singular or non-orthonormal direction matrix.
        ImageValueError: NaN/Inf voxels (with ``check_finite``), or uint64 values beyond the int64 range.
    """
    if ndim not in (None, 2, 3):
        raise ValueError(f"ndim must be None, 2 or 3, got {ndim}")
    path = Path(path)
    if path.is_dir():
        itk_image = _read_dicom_series(path)
        grid = grid_from_header(
            path,
            itk_image.GetSize(),
            itk_image.GetSpacing(),
            itk_image.GetOrigin(),
            itk_image.GetDirection(),
            itk_image.GetNumberOfComponentsPerPixel(),
            ndim,
        )
        array = sitk.GetArrayFromImage(itk_image)
    else:
        fmt = format_of(path, ImageReadError)
        if not path.exists():
            raise ImageReadError(f"{path}: no such file")
        _check_data_files(path, fmt)
        reader = sitk.ImageFileReader()
        reader.SetFileName(str(path))
        try:
            reader.ReadImageInformation()
        except RuntimeError as err:
            if fmt == "NIfTI" and "orthonormal" in str(err):
                raise GeometryError(NO_NIFTI_ORIENTATION.format(path=path)) from err
            raise ImageReadError(f"cannot read {path}: not a valid {fmt} file (corrupt or truncated header)") from err
        components = reader.GetNumberOfComponents()
        gray = _gray_png(reader, path) if fmt == "PNG" and components > 1 else None
        # The geometry is checked from the header before the voxels are read: ITK refuses some of it (zero spacing,
        # singular directions) only while reading, with a multi-line message.
        grid = grid_from_header(
            path,
            reader.GetSize(),
            reader.GetSpacing(),
            reader.GetOrigin(),
            reader.GetDirection(),
            1 if gray is not None else components,
            ndim,
        )
        if gray is not None:
            array = gray
        elif fmt == "NIfTI":
            array = _read_nifti(path)[1]
        else:
            try:
                array = sitk.GetArrayFromImage(reader.Execute())
            except RuntimeError as err:
                raise ImageReadError(f"cannot read {path}: the voxel data are corrupt or truncated") from err
    data = _to_tensor(array.reshape(grid.shape), path)
    if check_finite:
        _check_finite(data, path)
    return Image(data, grid)


def read_image_nibabel(path: str | os.PathLike) -> Image:
    """Read a NIfTI file with nibabel, independently of SimpleITK, into the same LPS geometry :func:`read_image` gives.

    nibabel's arrays are ``[i, j, k]``; the tensor is their transpose ``[k, j, i]`` (a change of memory layout, not of
    orientation). The voxel-to-world matrix follows ITK's rule (ITK 5.4, ``NiftiImageIO``), which is *not* nibabel's
    ``img.affine`` (the sform whenever ``sform_code > 0``):

    * both codes 0: origin 0 and identity LPS direction (nibabel would centre the image instead);
    * the sform is used when it equals the qform, or when it has no shear (orthonormal after normalising its columns)
      and either ``qform_code == 0`` or ``sform_code == 1`` (scanner), or, for other sform codes (aligned,
      Talairach, MNI), when it is within 1e-4 of the qform (ITK compares the two matrices' SVDs; we compare the
      matrices, which agrees except where ITK's SVD comparison is ill-conditioned);
    * otherwise the qform if ``qform_code > 0``; else there is no usable orientation and GeometryError is raised.

    RAS is converted to LPS by negating x and y; the direction is the chosen matrix's normalised columns, the
    spacing is ``pixdim`` (as in ITK, even where the sform's column norms differ) and the origin its translation.
    Scaled intensities (``scl_slope``/``scl_inter``) are returned as float32 (float64 for float64 files), as in ITK.
    NaN/Inf voxels are kept (no check).
    """
    path = Path(path)
    if format_of(path, ImageReadError) != "NIfTI":
        raise ImageReadError(f"{path}: read_image_nibabel reads NIfTI files (.nii, .nii.gz) only")
    if not path.is_file():
        raise ImageReadError(f"{path}: no such file")
    header, array = _read_nifti(path)
    n = array.ndim
    spatial = min(n, 3)
    lps = np.diag([-1.0, -1.0, 1.0, 1.0]) @ itk_nifti_affine(header, path)
    columns = lps[:spatial, :spatial]
    direction = np.eye(max(n, 2))
    direction[:spatial, :spatial] = columns / np.linalg.norm(columns, axis=0)
    origin = np.zeros(max(n, 2))
    origin[:spatial] = lps[:spatial, 3]
    size = array.shape[::-1]
    grid = grid_from_header(path, size, header["pixdim"][1 : n + 1], origin, direction.ravel(), 1, None)
    return Image(_to_tensor(array.reshape(grid.shape), path), grid)


def _read_nifti(path: Path) -> tuple[Nifti1Header, np.ndarray]:
    """Header (as nibabel checks it) and voxels of a NIfTI-1/2 file, voxels in ``[..., k, j, i]`` layout.

    The whole file is read into memory first (a ``.gz`` file's whole stream, so that truncation and CRC errors
    surface), then parsed by nibabel. Voxels keep the file's byte order and are scaled as ITK scales them: when
    ``scl_slope``/``scl_inter`` apply, ``raw * slope + inter`` as float32 (float64 for float64 files).

    Raises ImageReadError for truncated/corrupt files and GeometryError for non-positive ``pixdim``, which ITK and
    nibabel would silently replace by 1 or by its absolute value (SPM once read a negative ``pixdim`` as a flip).
    """
    import nibabel as nib

    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as stream:
            raw = stream.read()
    except (EOFError, OSError, zlib.error) as err:
        raise ImageReadError(f"cannot read {path}: the file is truncated or corrupt ({_one_line(err)})") from err
    sizeof_hdr = {int.from_bytes(raw[:4], "little"), int.from_bytes(raw[:4], "big")}
    kind = nib.Nifti1Image if 348 in sizeof_hdr else nib.Nifti2Image if 540 in sizeof_hdr else None
    if kind is None:
        raise ImageReadError(f"cannot read {path}: not a NIfTI-1 or NIfTI-2 file")
    try:
        unchecked = kind.header_class.from_fileobj(io.BytesIO(raw), check=False)
        shape = unchecked.get_data_shape()
        pixdim = tuple(float(p) for p in unchecked["pixdim"][1 : min(len(shape), 3) + 1])
        if not all(p > 0 for p in pixdim):
            raise GeometryError(
                f"{path}: pixdim (spacing) {pixdim} must be positive; fix the header, e.g. with nibabel's "
                f"header.set_zooms()"
            )
        img = kind.from_bytes(raw)
        proxy = cast("ArrayProxy", img.dataobj)
        voxels = np.asarray(proxy.get_unscaled())
    except (OSError, ValueError, EOFError, nib.filebasedimages.ImageFileError) as err:
        raise ImageReadError(f"cannot read {path}: the file is truncated or corrupt ({_one_line(err)})") from err
    slope, inter = float(proxy.slope), float(proxy.inter)
    if slope != 1.0 or inter != 0.0:
        float_type = np.float64 if voxels.dtype == np.float64 else np.float32
        voxels = (voxels.astype(np.float64) * slope + inter).astype(float_type)
    return img.header, np.ascontiguousarray(voxels.T)


def _gray_png(reader: sitk.ImageFileReader, path: Path) -> np.ndarray | None:
    """The gray channel of a gray+alpha, RGB or RGBA PNG, if its colour channels are equal and its alpha opaque.

    Many gray images (ITK's examples among them) are stored as RGB; a PNG with real colours or transparency gives None.
    """
    try:
        pixels = sitk.GetArrayFromImage(reader.Execute())
    except RuntimeError as err:
        raise ImageReadError(f"cannot read {path}: the voxel data are corrupt or truncated") from err
    colours = pixels[..., :3] if pixels.shape[-1] >= 3 else pixels[..., :1]
    alpha = pixels[..., 3] if pixels.shape[-1] == 4 else pixels[..., 1] if pixels.shape[-1] == 2 else None
    if (colours != colours[..., :1]).any() or (alpha is not None and (alpha != np.iinfo(alpha.dtype).max).any()):
        return None
    return np.ascontiguousarray(colours[..., 0])


def _one_line(err: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(err).split()) or type(err).__name__


def _check_data_files(path: Path, fmt: str) -> None:
    """Raise :class:`ImageReadError` if the MetaImage or NRRD header ``path`` names a voxel file that is missing or,
    unless :data:`DATA_FILES_ANYWHERE` is set, outside the header's folder (symlinks resolved)."""
    line = _DATA_FILE_LINE.get(fmt)
    if line is None:
        return
    with open(path, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if fmt == "NRRD":
        head = re.split(rb"\r?\n\r?\n", head, maxsplit=1)[0]  # the header ends at the first empty line
    found = line.search(head)
    if found is None or found.group(1).upper() == b"LOCAL":
        return
    value = found.group(1).decode("utf-8", "replace")
    if value.upper().startswith("LIST"):
        names = head[found.end() :].decode("utf-8", "replace").split()
    else:
        names = [value.split()[0]]
    folder = path.parent.resolve()
    anywhere = os.environ.get(DATA_FILES_ANYWHERE) == "1"
    for name in names:
        target = (path.parent / name).resolve()
        if not anywhere and not target.is_relative_to(folder):
            raise ImageReadError(
                f"{path}: its header names the voxel file {name}, outside the header's folder; refused (set "
                f"{DATA_FILES_ANYWHERE}=1 to allow)"
            )
        if "%" not in name and not target.is_file():
            raise ImageReadError(f"{path}: its voxel file {target} does not exist")


def format_of(path: Path, error: type[RegkitError]) -> str:
    """Format name of ``path`` from its extension (case-insensitive); raises ``error`` for unknown extensions."""
    name = path.name.lower()
    for ext in sorted(_FORMATS, key=len, reverse=True):
        if name.endswith(ext):
            return _FORMATS[ext]
    suffix = "".join(path.suffixes[-2:]) or "(none)"
    raise error(
        f"{path}: unknown image extension {suffix}; supported: {', '.join(SUPPORTED_EXTENSIONS)}"
        + (", or a DICOM folder" if error is ImageReadError else "")
    )


@contextlib.contextmanager
def _itk_warnings_off() -> Iterator[None]:
    """Silence ITK's warnings on stderr (e.g. GDCM's "No Series were found") for the duration of the block."""
    previous = sitk.ProcessObject.GetGlobalWarningDisplay()
    sitk.ProcessObject.SetGlobalWarningDisplay(False)
    try:
        yield
    finally:
        sitk.ProcessObject.SetGlobalWarningDisplay(previous)


def _read_dicom_series(folder: Path) -> sitk.Image:
    """Read the first DICOM series found in ``folder`` (not its sub-folders); warns if there are several."""
    with _itk_warnings_off():
        series = sitk.ImageSeriesReader.GetGDCMSeriesIDs(str(folder))
    if not series:
        raise ImageReadError(f"{folder}: folder holds no DICOM series (pass an image file or a folder of DICOM slices)")
    files = sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(folder), series[0])
    if len(series) > 1:
        warnings.warn(
            f"{folder} holds {len(series)} DICOM series; reading the first ({series[0]}, {len(files)} files)",
            stacklevel=3,
        )
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(files)
    try:
        return reader.Execute()
    except RuntimeError as err:
        raise ImageReadError(f"cannot read the DICOM series {series[0]} in {folder}: corrupt or incomplete") from err


def _to_tensor(array: np.ndarray, path: Path) -> torch.Tensor:
    """A CPU tensor of ``array`` in native byte order; uint16 -> int32, uint32/uint64 -> int64 (values kept)."""
    array = array.astype(array.dtype.newbyteorder("="), copy=False)
    if array.dtype in _WIDENED_DTYPES:
        if array.dtype == np.uint64 and array.size and array.max() > np.iinfo(np.int64).max:
            raise ImageValueError(f"{path}: uint64 voxel values above {np.iinfo(np.int64).max} are not supported")
        array = array.astype(_WIDENED_DTYPES[array.dtype])
    elif array.dtype not in _KEPT_DTYPES:
        raise ImageValueError(f"{path}: voxel type {array.dtype} is not supported")
    return torch.from_numpy(np.ascontiguousarray(array))


def _check_finite(data: torch.Tensor, path: Path) -> None:
    """Raise ImageValueError, with the counts, if a floating-point tensor holds NaN or Inf."""
    if not data.is_floating_point():
        return
    bad = int((~torch.isfinite(data)).sum())
    if bad:
        nan = int(torch.isnan(data).sum())
        raise ImageValueError(
            f"{path} has {bad} non-finite voxels ({nan} NaN, {bad - nan} Inf) of {data.numel()}; replace them "
            f"(e.g. numpy.nan_to_num) or read with check_finite=False"
        )


# ----------------------------------------------------------------------------------------------------------------------
# Writing


def write_image(image: Image, path: str | os.PathLike) -> Path:
    """Write ``image`` with its geometry; the format follows the extension (see the module docstring's table).

    The write is atomic: SimpleITK writes into a temporary folder next to ``path``, then the files are moved into
    place (companion data files of .mhd/.nhdr first, the named file last), so a failed write leaves nothing behind
    and a reader never sees a half-written file. bool tensors are written as uint8, float16/bfloat16 as float32.
    MetaImage and NRRD voxels are zlib-compressed. Returns ``path``.

    Raises:
        ImageWriteError: unknown extension, missing folder, voxel type or dimension the format cannot store, or a
            failure inside SimpleITK.
    """
    path = Path(path)
    fmt = format_of(path, ImageWriteError)
    itk_image = _to_itk(image, path, fmt)
    folder = path.parent
    if not folder.is_dir():
        raise ImageWriteError(f"cannot write {path}: folder {folder} does not exist")
    try:
        with _atomic.staging(folder, ".regkit-tmp-") as staging:
            sitk.WriteImage(itk_image, str(staging / path.name), useCompression=fmt in ("MetaImage", "NRRD"))
            for written in sorted(staging.iterdir(), key=lambda p: p.name == path.name):
                os.replace(written, folder / written.name)
    except (RuntimeError, OSError) as err:
        raise ImageWriteError(f"cannot write {path}: {_one_line(err)[-200:]}") from err
    return path


def _to_itk(image: Image, path: Path, fmt: str) -> sitk.Image:
    """A SimpleITK image with the voxels and geometry of ``image``, in a voxel type that ``fmt`` stores."""
    data = image.data.detach().cpu()
    if data.dtype == torch.bool:
        data = data.to(torch.uint8)
    elif data.dtype in (torch.float16, torch.bfloat16):
        data = data.to(torch.float32)
    array = data.numpy()
    if array.dtype not in _KEPT_DTYPES:
        raise ImageWriteError(f"cannot write {path}: voxel type {data.dtype} is not supported")
    if fmt == "PNG":
        array = _png_voxels(array, image.grid, path)
    itk_image = sitk.GetImageFromArray(array, isVector=False)
    itk_image.SetSpacing(image.grid.spacing)
    itk_image.SetOrigin(image.grid.origin)
    itk_image.SetDirection(np.ravel(image.grid.direction).tolist())
    return itk_image


def _png_voxels(array: np.ndarray, grid: Grid, path: Path) -> np.ndarray:
    """The voxels as uint8 or uint16 for PNG (2D only); warns that origin and direction are not stored."""
    if array.ndim != 2:
        raise ImageWriteError(f"cannot write {path}: PNG holds 2D images only, got shape {array.shape}")
    if array.dtype != np.uint8:
        low, high = (array.min(), array.max()) if array.size else (0, 0)
        if not np.issubdtype(array.dtype, np.integer) or low < 0 or high > 65535:
            raise ImageWriteError(
                f"cannot write {path}: PNG stores 8/16-bit unsigned integers, got {array.dtype} values in "
                f"[{low}, {high}]; write .nii.gz or .mha instead, or rescale"
            )
        array = array.astype(np.uint16)
    if any(grid.origin) or not np.array_equal(grid.direction, np.eye(2)):
        warnings.warn(
            f"{path}: PNG stores no origin or direction; origin {grid.origin} and direction "
            f"{np.asarray(grid.direction).tolist()} are lost",
            stacklevel=4,
        )
    return array

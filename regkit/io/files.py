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
import math
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
from regkit.io.preflight import DATA_FILES_ANYWHERE, check_declared_size, check_text_header, input_kind, native_name
from regkit.spatial.grid import Grid

if TYPE_CHECKING:
    from nibabel.arrayproxy import ArrayProxy
    from nibabel.nifti1 import Nifti1Header, Nifti1Image

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

# Where a single-file NIfTI's voxels may start at the earliest: after the header and its 4 extension bytes.
_NIFTI_FIRST_VOXEL = {348: 352, 540: 544}

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
    a truncated file with 0; here the file is read exactly as far as its header declares, and checked.

    Before any native reader opens the file (:mod:`regkit.io.preflight`): its name must be one SimpleITK can take,
    it must be a regular file (or a DICOM folder), the voxel files a MetaImage/NRRD header names must be regular
    files in its folder, and the voxels its header declares must fit into the memory available and into the file.

    Trailing axes of size 1 beyond the third (e.g. a 3D volume stored with one time point) are dropped. A 3D image
    with one slice (size ``x, y, 1``) stays 3D unless ``ndim=2``, which drops that axis and its world coordinate (the
    slice must then lie in a world x-y plane).

    Args:
        path: a ``.nii``, ``.nii.gz``, ``.mha``, ``.mhd``, ``.nrrd``, ``.nhdr`` or ``.png`` file, or a DICOM folder.
        ndim: 2 or 3 to require that many dimensions; None accepts both.
        check_finite: raise :class:`ImageValueError` if a floating-point image holds NaN or Inf voxels.

    Raises:
        ImageReadError: missing file, unknown extension, corrupt, truncated or overlong file, folder without DICOM
            series, a name that is not UTF-8, a named pipe, device or socket, a declared size beyond the memory
            available or beyond what the file can hold, an invalid NIfTI ``vox_offset``.
        ImageDimensionError: more (or fewer) dimensions than wanted, or a vector (multi-component) image.
        GeometryError: non-finite or non-positive spacing, singular or non-orthonormal direction matrix.
        ImageValueError: NaN/Inf voxels (with ``check_finite``), or uint64 values beyond the int64 range.
    """
    if ndim not in (None, 2, 3):
        raise ValueError(f"ndim must be None, 2 or 3, got {ndim}")
    path = Path(path)
    if input_kind(path, ImageReadError) == "folder":
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
        stored_bytes = os.stat(path).st_size + check_text_header(path, fmt)
        reader = sitk.ImageFileReader()
        reader.SetFileName(str(path))
        try:
            reader.ReadImageInformation()
        except RuntimeError as err:
            if fmt == "NIfTI" and "orthonormal" in str(err):
                raise GeometryError(NO_NIFTI_ORIENTATION.format(path=path)) from err
            raise ImageReadError(f"cannot read {path}: not a valid {fmt} file (corrupt or truncated header)") from err
        check_declared_size(path, reader.GetSize(), _voxel_bytes(reader), stored_bytes)
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
    if input_kind(path, ImageReadError) == "folder" or format_of(path, ImageReadError) != "NIfTI":
        raise ImageReadError(f"{path}: read_image_nibabel reads NIfTI files (.nii, .nii.gz) only")
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
    """Header (as nibabel checks it) and voxels of a single-file NIfTI-1/2, voxels in ``[..., k, j, i]`` layout.

    The header is checked first (:func:`_nifti_data_end`); then exactly the bytes it declares are read (a ``.gz``
    file's stream no further, so that a small file cannot expand beyond them) and parsed by nibabel, and a file with
    fewer or more bytes is refused (at the end of a whole ``.gz`` stream, its CRC is checked). Voxels keep the file's
    byte order and are scaled as ITK scales them: when ``scl_slope``/``scl_inter`` apply, ``raw * slope + inter`` as
    float32 (float64 for float64 files).

    Raises ImageReadError for invalid headers (see :func:`_nifti_data_end`), truncated, corrupt or overlong files.
    """
    import nibabel as nib

    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as stream:
            kind, end = _nifti_data_end(path, stream)
            stream.seek(0)
            raw = stream.read(end)
            overlong = len(raw) == end and stream.read(1) != b""
        if overlong:
            raise ImageReadError(
                f"cannot read {path}: it holds more data than its header declares ({end} bytes); the header's "
                "dimensions or voxel type are wrong, or the file is corrupt"
            )
        if len(raw) < end:
            raise EOFError(f"{len(raw)} of the {end} bytes its header declares")
        img = kind.from_bytes(raw)
        proxy = cast("ArrayProxy", img.dataobj)
        voxels = np.asarray(proxy.get_unscaled())
    except (
        EOFError,
        OSError,
        ValueError,
        zlib.error,
        nib.filebasedimages.ImageFileError,
        nib.spatialimages.HeaderDataError,
    ) as err:
        raise ImageReadError(f"cannot read {path}: the file is truncated or corrupt ({_one_line(err)})") from err
    slope, inter = float(proxy.slope), float(proxy.inter)
    if slope != 1.0 or inter != 0.0:
        float_type = np.float64 if voxels.dtype == np.float64 else np.float32
        voxels = (voxels.astype(np.float64) * slope + inter).astype(float_type)
    return img.header, np.ascontiguousarray(voxels.T)


def _nifti_data_end(path: Path, stream: io.BufferedIOBase) -> tuple[type[Nifti1Image], int]:
    """nibabel's image class (NIfTI-1 or 2) and the byte where the voxels end, from the header at the start of
    ``stream``, checked before any voxel is read; one rule for both readers, which ITK and nibabel would each bend
    their own way.

    Raises ImageReadError unless the header is a single-file NIfTI's (magic ``n+1``/``n+2``) with positive
    dimensions, a known voxel type, voxels starting after the header (``vox_offset`` >= 352 for NIfTI-1, 544 for
    NIfTI-2; nibabel would read a smaller offset's voxels from the header's own bytes) and a size that fits into
    memory (:func:`~regkit.io.preflight.check_declared_size`); GeometryError for a non-finite or non-positive
    ``pixdim``, which ITK and nibabel would silently replace by 1 or by its absolute value (SPM once read a negative
    ``pixdim`` as a flip).
    """
    import nibabel as nib

    first = stream.read(4)
    sizeof_hdr = {int.from_bytes(first, "little"), int.from_bytes(first, "big")} & set(_NIFTI_FIRST_VOXEL)
    if not sizeof_hdr:
        raise ImageReadError(f"cannot read {path}: not a NIfTI-1 or NIfTI-2 file")
    size = sizeof_hdr.pop()
    kind = nib.Nifti1Image if size == 348 else nib.Nifti2Image
    head = first + stream.read(size - 4)
    if len(head) < size:
        raise EOFError(f"{len(head)} of the {size} header bytes")
    header = kind.header_class.from_fileobj(io.BytesIO(head), check=False)
    magic = header["magic"].item()
    if magic != header.single_magic:
        raise ImageReadError(f"cannot read {path}: magic {magic!r} is not that of a single-file NIfTI (n+1, n+2)")
    shape = header.get_data_shape()
    if not shape or min(shape) < 1:
        raise ImageReadError(f"cannot read {path}: its header's dimensions {shape} must be positive")
    pixdim = tuple(float(p) for p in header["pixdim"][1 : min(len(shape), 3) + 1])
    if not all(math.isfinite(p) and p > 0 for p in pixdim):
        raise GeometryError(
            f"{path}: pixdim (spacing) {pixdim} must be finite and positive; fix the header, e.g. with nibabel's "
            "header.set_zooms()"
        )
    offset, first_voxel = float(header["vox_offset"]), _NIFTI_FIRST_VOXEL[size]
    if not (math.isfinite(offset) and offset >= first_voxel):
        raise ImageReadError(
            f"cannot read {path}: vox_offset {offset:g} is invalid; a single-file NIfTI-{1 if size == 348 else 2}'s "
            f"voxels start at byte {first_voxel} or later"
        )
    try:
        voxel_bytes = header.get_data_dtype().itemsize
    except (KeyError, nib.spatialimages.HeaderDataError):
        raise ImageReadError(
            f"cannot read {path}: its header's datatype {int(header['datatype'])} is not a NIfTI voxel type"
        ) from None
    check_declared_size(path, shape, voxel_bytes, offset=int(offset))
    return kind, int(offset) + math.prod(shape) * voxel_bytes


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
    """Read the first DICOM series found in ``folder`` (not its sub-folders); warns if there are several.

    Before the series is read, the names of its files must pass :func:`~regkit.io.preflight.native_name`, and its
    size (its first file's slice size times the number of files) must fit into memory.
    """
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
    for name in files:
        native_name(Path(name), ImageReadError)
    first = sitk.ImageFileReader()
    first.SetFileName(files[0])
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(files)
    try:
        first.ReadImageInformation()
        check_declared_size(folder, (*first.GetSize()[:2], len(files)), _voxel_bytes(first))
        return reader.Execute()
    except RuntimeError as err:
        raise ImageReadError(f"cannot read the DICOM series {series[0]} in {folder}: corrupt or incomplete") from err


def _voxel_bytes(reader: sitk.ImageFileReader) -> int:
    """Bytes per voxel (all components) of the image whose information ``reader`` has read, from SimpleITK's name of
    its pixel type (e.g. "vector of 8-bit unsigned integer"; complex types count as 2 components); 8 bytes per
    component for a type SimpleITK does not know (which it will not read either)."""
    bits = re.search(r"(\d+)-bit", sitk.GetPixelIDValueAsString(reader.GetPixelID()))
    return (int(bits.group(1)) // 8 if bits else 8) * reader.GetNumberOfComponents()


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
    native_name(path, ImageWriteError)
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

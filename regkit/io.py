"""Images with geometry: reading and writing NIfTI, MetaImage, NRRD, PNG and DICOM series.

Conventions (those of ITK, see :mod:`regkit.spatial.grid`):

* An :class:`Image` is a tensor in ``[z, y, x]`` (3D) or ``[y, x]`` (2D) layout plus a :class:`~regkit.spatial.Grid`:
  ``world = origin + direction @ (spacing * index)`` with index (i, j[, k]) and world points in LPS millimetres.
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
import shutil
import tempfile
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import SimpleITK as sitk
import torch

from regkit.errors import (
    GeometryError,
    ImageDimensionError,
    ImageReadError,
    ImageValueError,
    ImageWriteError,
    RegkitError,
)
from regkit.spatial.grid import Grid

if TYPE_CHECKING:
    from nibabel.arrayproxy import ArrayProxy
    from nibabel.nifti1 import Nifti1Header

__all__ = [
    "SUPPORTED_EXTENSIONS",
    "Image",
    "ImageWriteError",
    "describe_image",
    "orientation_code",
    "read_image",
    "read_image_nibabel",
    "reorient",
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

# numpy voxel types kept as they are, and those widened to a signed type that holds all their values.
_KEPT_DTYPES = {np.dtype(t) for t in (np.uint8, np.int8, np.int16, np.int32, np.int64, np.float32, np.float64)}
_WIDENED_DTYPES = {np.dtype(np.uint16): np.int32, np.dtype(np.uint32): np.int64, np.dtype(np.uint64): np.int64}

# Anatomical letter of the + and - direction of each LPS world axis.
_AXIS_LETTERS = (("L", "R"), ("P", "A"), ("S", "I"))
_ANATOMY = {"L": "Left", "R": "Right", "P": "Posterior", "A": "Anterior", "S": "Superior", "I": "Inferior"}


@dataclass(frozen=True, eq=False)
class Image:
    """A scalar image with its geometry.

    ``data`` is a ``[z, y, x]`` (3D) or ``[y, x]`` (2D) tensor, ``grid`` the geometry (size in (x, y[, z]) order,
    spacing, origin, direction; LPS millimetres, ITK conventions). ``data.shape`` must equal ``grid.shape``. Images
    are not compared with ``==``: compare ``data`` (``torch.equal``) and ``grid``.
    """

    data: torch.Tensor
    grid: Grid

    def __post_init__(self) -> None:
        if tuple(self.data.shape) != self.grid.shape:
            raise GeometryError(
                f"image data of shape {tuple(self.data.shape)} does not match its grid: size {self.grid.size} "
                f"needs a tensor of shape {self.grid.shape} ([z, y, x] = size reversed)"
            )

    @property
    def ndim(self) -> int:
        """Number of spatial dimensions (2 or 3)."""
        return self.grid.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        """Tensor shape, ``[z, y, x]`` or ``[y, x]``."""
        return self.grid.shape

    @property
    def spacing(self) -> np.ndarray:
        """Voxel spacing in millimetres, (x, y[, z]) order."""
        return np.asarray(self.grid.spacing)

    @property
    def origin(self) -> np.ndarray:
        """LPS world position of the centre of voxel index 0, in millimetres."""
        return np.asarray(self.grid.origin)

    @property
    def direction(self) -> np.ndarray:
        """``ndim x ndim`` matrix whose columns are the LPS directions of the index axes i, j[, k]."""
        return np.asarray(self.grid.direction)

    def index_to_world(self, index: torch.Tensor) -> torch.Tensor:
        """Map continuous indices ``(..., ndim)`` in (i, j[, k]) order to LPS world points (see :class:`Grid`)."""
        return self.grid.index_to_world(index)

    def world_to_index(self, world: torch.Tensor) -> torch.Tensor:
        """Map LPS world points ``(..., ndim)`` to continuous indices in (i, j[, k]) order (see :class:`Grid`)."""
        return self.grid.world_to_index(world)


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
        grid = _grid_from_header(
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
        reader = sitk.ImageFileReader()
        reader.SetFileName(str(path))
        try:
            reader.ReadImageInformation()
        except RuntimeError as err:
            if fmt == "NIfTI" and "orthonormal" in str(err):
                raise GeometryError(_NO_NIFTI_ORIENTATION.format(path=path)) from err
            raise ImageReadError(f"cannot read {path}: not a valid {fmt} file (corrupt or truncated header)") from err
        components = reader.GetNumberOfComponents()
        gray = _gray_png(reader, path) if fmt == "PNG" and components > 1 else None
        # The geometry is checked from the header before the voxels are read: ITK refuses some of it (zero spacing,
        # singular directions) only while reading, with a multi-line message.
        grid = _grid_from_header(
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
    lps = np.diag([-1.0, -1.0, 1.0, 1.0]) @ _itk_nifti_affine(header, path)
    columns = lps[:spatial, :spatial]
    direction = np.eye(max(n, 2))
    direction[:spatial, :spatial] = columns / np.linalg.norm(columns, axis=0)
    origin = np.zeros(max(n, 2))
    origin[:spatial] = lps[:spatial, 3]
    size = array.shape[::-1]
    grid = _grid_from_header(path, size, header["pixdim"][1 : n + 1], origin, direction.ravel(), 1, None)
    return Image(_to_tensor(array.reshape(grid.shape), path), grid)


_NO_NIFTI_ORIENTATION = (
    "{path}: the sform has shear or non-uniform scaling and there is no qform; ITK (and regkit) need a rotation and "
    "spacing (set a qform, e.g. with nibabel's img.set_qform(affine, code=1))"
)


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


def _grid_from_header(
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


def _itk_nifti_affine(header: Nifti1Header, path: Path) -> np.ndarray:
    """4x4 voxel-to-RAS matrix that ITK 5.4 uses for a NIfTI header (rule in :func:`read_image_nibabel`)."""
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
    raise GeometryError(_NO_NIFTI_ORIENTATION.format(path=path))


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
        staging = Path(tempfile.mkdtemp(prefix=".regkit-tmp-", dir=folder))
    except OSError as err:
        raise ImageWriteError(f"cannot write {path}: {err.strerror}") from err
    try:
        sitk.WriteImage(itk_image, str(staging / path.name), useCompression=fmt in ("MetaImage", "NRRD"))
        for written in sorted(staging.iterdir(), key=lambda p: p.name == path.name):
            os.replace(written, folder / written.name)
    except (RuntimeError, OSError) as err:
        raise ImageWriteError(f"cannot write {path}: {_one_line(err)[-200:]}") from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)
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


# ----------------------------------------------------------------------------------------------------------------------
# Orientation


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


# ----------------------------------------------------------------------------------------------------------------------
# Description


def _num(value: float) -> str:
    """Compact number: 6 significant digits, no "-0"."""
    text = f"{float(value):.6g}"
    return "0" if text == "-0" else text


def describe_image(img: Image) -> dict[str, str]:
    """One-line strings describing ``img`` (size, spacing, origin, direction, orientation, dtype, range).

    ``direction`` lists the LPS unit vector of each index axis and, for oblique images, the largest angle between an
    index axis and its closest world axis. ``range`` is over finite values, with the NaN/Inf counts when there are any.
    """
    grid = img.grid
    code = orientation_code(grid)
    axes = "xyz"[: img.ndim]
    direction = np.asarray(grid.direction)
    columns = ", ".join(f"{'ijk'[c]} ({', '.join(_num(v) for v in direction[:, c])})" for c in range(img.ndim))
    tilt = math.degrees(math.acos(min(1.0, float(np.abs(direction).max(axis=0).min()))))
    if tilt > 1e-3:
        columns += f"; oblique by up to {tilt:.2f} deg"
    pointing = ", ".join(f"{axis} to {_ANATOMY[c]}" for axis, c in zip("ijk"[: img.ndim], code, strict=True))
    return {
        "size": f"{' x '.join(map(str, grid.size))} ({', '.join(axes)}); tensor [{', '.join(reversed(axes))}]",
        "spacing": f"{' x '.join(_num(s) for s in grid.spacing)} mm",
        "origin": f"({', '.join(_num(o) for o in grid.origin)}) mm LPS",
        "direction": columns,
        "orientation": f"{code} ({pointing})",
        "dtype": str(img.data.dtype).removeprefix("torch."),
        "range": _value_range(img.data),
    }


def _value_range(data: torch.Tensor) -> str:
    """``"min .. max"`` over finite values, plus the NaN/Inf counts if any."""
    if not data.is_floating_point():
        return f"{int(data.min())} .. {int(data.max())}"
    finite = torch.isfinite(data)
    nan = int(torch.isnan(data).sum())
    inf = data.numel() - int(finite.sum()) - nan
    values = data[finite]
    text = f"{_num(values.min().item())} .. {_num(values.max().item())}" if values.numel() else "no finite values"
    return text + (f" ({nan} NaN, {inf} Inf)" if nan or inf else "")

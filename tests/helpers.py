"""Helpers shared by the tests (a test module imports what it uses from here; fixtures live in the conftest files).

* Offline test data: files of installed packages (:func:`nibabel_data`) and of Debian's insighttoolkit5-examples
  (:func:`itk_example`), and DICOM series written here (:func:`write_dicom_series`).
* The ``regkit`` command line, run in-process as the console script runs it (:func:`run_cli`), and the check of its
  one-line errors (:func:`assert_one_error_line`).
* Small synthetic images: Gaussian blobs on a grid (:func:`gaussian_blobs`, :func:`blob_values`) and the rotations of
  oblique grids (:func:`rotation`).
* The small registrations of ``tests/regkit/conftest.py`` (:func:`scene`, :func:`label_map`,
  :func:`registration_config`) and what their tests compare them with (:func:`same_grid`, :func:`sitk_read`,
  :func:`inside_moving`).
* The tolerances of the compiled kernels against their references (the last section).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from regkit.config import RegistrationConfig, load_config
from regkit.io import Image
from regkit.spatial.grid import Grid

if TYPE_CHECKING:
    import SimpleITK as sitk

    from regkit.registration import RegistrationResult

# ---------------------------------------------------------------------------------------------------------------------
# Offline test data

ITK_DATA = Path("/usr/share/doc/insighttoolkit5-examples/examples/Data")

# A 3D configuration of a few iterations at shrink 4: the whole pipeline (pair, registration, outputs) in seconds,
# not the demo's accuracy.
TINY_3D_CONFIG = """\
dim: 3
stages:
  - {type: moments}
  - type: affine
    similarity: {name: ncc}
    pyramid: [{shrink: 4, smoothing: 2.0}]
    optimizer: {learning_rate: 0.5, iterations: 10}
  - type: cpab
    similarity: {name: lncc, window: 5}
    pyramid: [{shrink: 4, smoothing: 2.0}]
    optimizer: {learning_rate: 0.05, iterations: 5}
    tessellation: [4]
    steps: 5
"""


def itk_example(name: str) -> Path:
    """Path of a file from Debian's insighttoolkit5-examples; skips the test if the package is not installed."""
    path = ITK_DATA / name
    if not path.exists():
        pytest.skip(f"{path} missing: apt-get install insighttoolkit5-examples")
    return path


def nibabel_data(name: str) -> Path:
    """Path of a file shipped in nibabel's tests/data folder (e.g. 'anatomical.nii')."""
    import nibabel.tests

    return Path(nibabel.tests.__file__).parent / "data" / name


def write_dicom_series(folder: Path, image: sitk.Image, series_uid: str) -> None:
    """Write a 3D int16 image as one DICOM file per slice, with the position/orientation tags a series needs."""
    import SimpleITK as sitk

    folder.mkdir(exist_ok=True)
    direction = np.array(image.GetDirection()).reshape(3, 3)
    orientation = "\\".join(f"{v:.12g}" for v in (*direction[:, 0], *direction[:, 1]))
    writer = sitk.ImageFileWriter()
    writer.KeepOriginalImageUIDOn()
    for k in range(image.GetDepth()):
        slice_k = image[:, :, k]
        position = "\\".join(f"{v:.12g}" for v in image.TransformIndexToPhysicalPoint((0, 0, k)))
        tags = {
            "0008|0060": "MR",
            "0020|000d": "1.2.826.0.1.3680043.2.1125.7",
            "0020|000e": series_uid,
            "0008|0018": f"{series_uid}.{k + 1}",
            "0020|0013": str(k + 1),
            "0020|0032": position,
            "0020|0037": orientation,
            "0018|0050": f"{image.GetSpacing()[2]:.12g}",
        }
        for tag, value in tags.items():
            slice_k.SetMetaData(tag, value)
        writer.SetFileName(str(folder / f"{series_uid[-3:]}_{k:03d}.dcm"))
        writer.Execute(slice_k)


# ---------------------------------------------------------------------------------------------------------------------
# The command line


def run_cli(argv: Sequence[object]) -> int:
    """Run ``regkit ARGV`` in this process through :func:`regkit_cli.main.main`, as the console script does, and return
    its exit code (arguments are stringified: paths may be passed as they are). The one way the tests run the command
    line in-process; ``capsys`` or ``capfd`` capture what it prints."""
    from regkit_cli.main import main  # here, so that the engine's and the kernels' tests need no CLI

    try:
        main([str(a) for a in argv])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


def assert_one_error_line(capsys: pytest.CaptureFixture[str], contains: str) -> None:
    """What the command printed on stderr is one ``error: ...`` line that contains ``contains``."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and contains in lines[0], err


# ---------------------------------------------------------------------------------------------------------------------
# Small synthetic images


def blob_values(
    points: torch.Tensor,
    centres: Sequence[Sequence[float]],
    spreads: float | Sequence[float],
    weights: Sequence[float] | None = None,
) -> torch.Tensor:
    """``sum_k weights[k] exp(-|p - centres[k]|^2 / spreads[k])`` at world points ``p`` (``(..., ndim)``, mm, in
    (x, y[, z]) order), in their dtype: Gaussian blobs with ``spreads[k] = 2 sigma_k^2`` (mm^2; 32 is sigma 4 mm), one
    spread per blob or one for all; the weights default to 1."""
    spread = [float(spreads)] * len(centres) if isinstance(spreads, (int, float)) else list(spreads)
    weight = [1.0] * len(centres) if weights is None else list(weights)
    terms = zip(centres, spread, weight, strict=True)
    total = sum(w * torch.exp(-((points - torch.tensor(c, dtype=points.dtype)) ** 2).sum(-1) / s) for c, s, w in terms)
    assert isinstance(total, torch.Tensor), "no blobs"
    return total


def gaussian_blobs(
    grid: Grid,
    centres: Sequence[Sequence[float]],
    spreads: float | Sequence[float],
    weights: Sequence[float] | None = None,
    *,
    dtype: torch.dtype = torch.float64,
) -> Image:
    """A float32 image on ``grid`` of Gaussian blobs at world points ``centres`` (:func:`blob_values` of the voxel
    centres, computed in ``dtype``): a smooth image with structure to register."""
    return Image(blob_values(grid.world_points(dtype), centres, spreads, weights).float(), grid)


def rotation(angle: float, ndim: int, tilt: float = 0.0) -> np.ndarray:
    """An ``ndim x ndim`` rotation: by ``angle`` (radians) in the x-y plane, then, in 3D, by ``tilt`` about x (with a
    tilt no axis stays aligned)."""
    c, s = np.cos(angle), np.sin(angle)
    rot = np.eye(ndim)
    rot[:2, :2] = [[c, -s], [s, c]]
    if ndim == 3 and tilt:
        about_x = np.eye(3)
        about_x[1:, 1:] = [[np.cos(tilt), -np.sin(tilt)], [np.sin(tilt), np.cos(tilt)]]
        rot = about_x @ rot
    return rot


# ---------------------------------------------------------------------------------------------------------------------
# Small registrations (the registration_case fixture of tests/regkit/conftest.py) and their checks


def scene(grid: Grid, warp: float) -> Image:
    """Three Gaussian blobs evaluated in world space (mm), optionally at smoothly displaced points."""
    p = grid.world_points(torch.float64)
    n = grid.ndim
    q = p + warp * torch.stack([torch.sin(p[..., (a + 1) % n] / 6.0) for a in range(n)], dim=-1)
    centres = [[10.0, 12.0, 14.0][:n], [18.0, 10.0, 12.0][:n], [12.0, 20.0, 18.0][:n]]
    return Image(blob_values(q, centres, 32.0, (1.0, 0.7, 0.5)).float(), grid)


def label_map(image: Image) -> Image:
    """Labels 0, 1, 2 of ``image`` (int16): above 0.3, and above 0.7."""
    return Image((image.data > 0.3).to(torch.int16) + (image.data > 0.7).to(torch.int16), image.grid)


def registration_config(ndim: int, **outputs_flags: bool) -> RegistrationConfig:
    """A quick moments, affine and CPAB registration (a few iterations at full resolution), with ``outputs`` flags."""
    single = [{"shrink": 1, "smoothing": 0.0}]
    stages = [
        {"type": "moments"},
        {
            "type": "affine",
            "similarity": {"name": "ncc"},
            "pyramid": single,
            "optimizer": {"iterations": 8, "learning_rate": 0.5},
        },
        {
            "type": "cpab",
            "similarity": {"name": "lncc", "window": 5},
            "pyramid": single,
            "optimizer": {"iterations": 8, "learning_rate": 0.2},
            "tessellation": [3],
            "steps": 10,
        },
    ]
    return load_config("quick-2d", overrides={"dim": ndim, "stages": stages, "outputs": outputs_flags})


def same_grid(a: Grid, b: Grid) -> bool:
    """Equal up to NIfTI's float32 geometry."""
    return a.size == b.size and all(
        np.allclose(getattr(a, key), getattr(b, key), atol=1e-5) for key in ("spacing", "origin", "direction")
    )


def sitk_read(path: str | Path) -> sitk.Image:
    """The file read by SimpleITK."""
    import SimpleITK as sitk

    return sitk.ReadImage(str(path))


def inside_moving(result: RegistrationResult, margin: float = 1.0) -> np.ndarray:
    """Fixed voxels whose moving sample point lies at least ``margin`` voxels inside the moving grid."""
    y = result.transform.transform_world(result.fixed.grid.world_points(torch.float64))
    index = result.moving.grid.world_to_index(y)
    size = torch.tensor(result.moving.grid.size, dtype=torch.float64)
    return ((index >= margin) & (index <= size - 1 - margin)).all(dim=-1).numpy()


# =====================================================================================================================
# Tolerances of the compiled kernels (regkit_kernels) against their references, shared by their tests
# =====================================================================================================================

RELATIVE_TOLERANCE: dict[torch.dtype, float] = {torch.float64: 1e-12, torch.float32: 1e-4, torch.bfloat16: 3e-2}
"""Largest ``|fast - reference|`` of an output or gradient, relative to the largest ``|reference|``, where a compiled
face computes in ``dtype`` what the reference computes in another order (sums over cells, points or positions in
another order, float32 atomics; bfloat16 also rounds the inputs and outputs). A test whose faces differ by less uses
:func:`relative_tolerance` with a stated factor; none uses a looser one."""


def relative_tolerance(dtype: torch.dtype, tighter: float = 1.0) -> float:
    """``RELATIVE_TOLERANCE[dtype]``, divided by ``tighter`` (at least 1)."""
    if tighter < 1:
        raise ValueError(f"a test may tighten the shared tolerance, not loosen it; got the factor {tighter}")
    return RELATIVE_TOLERANCE[dtype] / tighter


def assert_relative_close(got: torch.Tensor, want: torch.Tensor, tol: float, name: str = "") -> None:
    """``max |got - want| <= tol * max |want|`` (``got`` taken to ``want``'s dtype first); on failure the message names
    the worst element, its reference value and the scale."""
    diff = (got.to(want.dtype) - want).abs()
    scale = want.abs().max().item()
    worst = diff.argmax().item()
    assert diff.max().item() <= tol * scale, (
        f"{name}: max |got - reference| = {diff.max().item():.3g} at flat index {worst} "
        f"(reference {want.flatten()[worst].item():.6g}, largest |reference| {scale:.3g}, tolerance {tol:.3g})"
    )

"""regkit.outputs: the files of a registration, checked against SimpleITK, nibabel and scipy, and written atomically.

One small 2D and one small 3D registration (oblique, anisotropic, different fixed and moving grids) are run once per
module; the tests read their output folders.
"""

from __future__ import annotations

import json
import math
import os

import nibabel as nib
import numpy as np
import pytest
import SimpleITK as sitk
import torch
from scipy import ndimage

import regkit.outputs as outputs
from regkit.config import load_config
from regkit.engine import register
from regkit.errors import ImageDimensionError, ImageValueError
from regkit.io import Image, read_image, write_image
from regkit.outputs import (
    OUTPUT_FILES,
    OutputExistsError,
    apply_itk_transform,
    as_label_map,
    field_of_view_overlap,
    learn2reg_displacement,
    qc_picture,
    read_moving_grid,
    resample,
    write_outputs,
)
from regkit.spatial.grid import Grid
from regkit.spatial.sampling import sample_image
from regkit.transform import Transformation

ALL_FILES = set(OUTPUT_FILES.values())


def _rotation(angle: float, ndim: int) -> np.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    r = np.eye(ndim)
    r[:2, :2] = [[c, -s], [s, c]]
    return r


def _scene(grid: Grid, warp: float) -> Image:
    """Three Gaussian blobs evaluated in world space (mm), optionally at smoothly displaced points."""
    p = grid.world_points(torch.float64)
    n = grid.ndim
    q = p + warp * torch.stack([torch.sin(p[..., (a + 1) % n] / 6.0) for a in range(n)], dim=-1)
    centres = torch.tensor([[10.0, 12.0, 14.0], [18.0, 10.0, 12.0], [12.0, 20.0, 18.0]])[:, :n]
    image = sum(w * torch.exp(-((q - c) ** 2).sum(-1) / 32.0) for c, w in zip(centres, (1.0, 0.7, 0.5), strict=True))
    return Image(image.float(), grid)


def _labels(image: Image) -> Image:
    return Image((image.data > 0.3).to(torch.int16) + (image.data > 0.7).to(torch.int16), image.grid)


def _config(ndim: int, **outputs_flags: bool):
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


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These problems are tiny: intra-op threads only cost time (4x on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=[2, 3], ids=["2d", "3d"])
def case(request, tmp_path_factory):
    """A registration between different oblique grids, written with both label maps: (result, labels, folder)."""
    ndim = request.param
    size = (20, 24, 28)[:ndim]
    fixed_grid = Grid.create(size, (1.5, 1.2, 1.0)[:ndim], (0.0, 0.0, 0.0)[:ndim], _rotation(0.2, ndim))
    moving_grid = Grid.create((22, 22, 26)[:ndim], (1.4, 1.3, 1.1)[:ndim], (1.0, -1.0, 0.5)[:ndim])
    fixed, moving = _scene(fixed_grid, 0.0), _scene(moving_grid, 1.5)
    result = register(fixed, moving, _config(ndim))
    labels = {"moving": _labels(moving), "fixed": _labels(fixed)}
    parent = tmp_path_factory.mktemp(f"out{ndim}d")
    write_outputs(result, parent / "out", moving_labels=labels["moving"], fixed_labels=labels["fixed"])
    return result, labels, parent / "out"


def _same_grid(a: Grid, b: Grid) -> bool:
    """Equal up to NIfTI's float32 geometry."""
    return a.size == b.size and all(
        np.allclose(getattr(a, key), getattr(b, key), atol=1e-5) for key in ("spacing", "origin", "direction")
    )


def _sitk_read(path) -> sitk.Image:
    return sitk.ReadImage(str(path))


def _inside(result, margin: float = 1.0) -> np.ndarray:
    """Fixed voxels whose moving sample point lies at least ``margin`` voxels inside the moving grid."""
    y = result.transform.transform_world(result.fixed.grid.world_points(torch.float64))
    index = result.moving.grid.world_to_index(y)
    size = torch.tensor(result.moving.grid.size, dtype=torch.float64)
    return ((index >= margin) & (index <= size - 1 - margin)).all(dim=-1).numpy()


def _resample_with(result, itk_transform, tmp_path) -> np.ndarray:
    """The moving image (read back from a file by SimpleITK) resampled onto the fixed grid by SimpleITK."""
    write_image(result.moving, tmp_path / "moving.nii.gz")
    moving = _sitk_read(tmp_path / "moving.nii.gz")
    write_image(result.fixed, tmp_path / "fixed.nii.gz")
    reference = _sitk_read(tmp_path / "fixed.nii.gz")
    out = sitk.Resample(moving, reference, itk_transform, sitk.sitkLinear, 0.0, sitk.sitkFloat32)
    return sitk.GetArrayFromImage(out)


# ----------------------------------------------------------------------------------------------------------------------
# The folder


def test_exactly_the_named_files(case):
    _, _, out = case
    assert set(os.listdir(out)) == ALL_FILES
    assert os.listdir(out.parent) == ["out"]  # no temporary folder left beside it


def test_optional_outputs_follow_the_flags(case, tmp_path):
    result, _, _ = case
    flags = {k: False for k in ("warped", "displacement", "inverse_displacement", "jacobian", "transform_h5", "qc_png")}
    result = type(result)(**{**result.__dict__, "config": _config(result.fixed.ndim, **flags)})
    written = write_outputs(result, tmp_path / "out")
    mandatory = {"affine", "transform", "metrics", "config"}
    assert set(written) == mandatory
    assert set(os.listdir(tmp_path / "out")) == {OUTPUT_FILES[k] for k in mandatory}


# ----------------------------------------------------------------------------------------------------------------------
# Conventions, against SimpleITK, nibabel and scipy


def test_displacement_header_is_itk_vector_nifti(case):
    result, _, out = case
    header = nib.load(out / "displacement.nii.gz").header
    size = result.fixed.grid.size
    n = len(size)
    expected = (*size, 1, n) if n == 3 else (*size, 1, 1, n)
    assert header.get_data_shape() == expected
    assert int(header["intent_code"]) == 1007
    assert header.get_data_dtype() == np.float32


def test_sitk_resampling_with_displacement_reproduces_warped(case, tmp_path):
    result, _, out = case
    field = sitk.Cast(_sitk_read(out / "displacement.nii.gz"), sitk.sitkVectorFloat64)
    ours = sitk.GetArrayFromImage(_sitk_read(out / "warped.nii.gz"))
    theirs = _resample_with(result, sitk.DisplacementFieldTransform(field), tmp_path)
    inside = _inside(result)
    assert inside.mean() > 0.5
    np.testing.assert_allclose(theirs[inside], ours[inside], atol=2e-4)


def test_sitk_resampling_with_transform_h5_reproduces_warped(case, tmp_path):
    result, _, out = case
    composite = sitk.ReadTransform(str(out / "transform.h5"))
    ours = sitk.GetArrayFromImage(_sitk_read(out / "warped.nii.gz"))
    theirs = _resample_with(result, composite, tmp_path)
    inside = _inside(result)
    np.testing.assert_allclose(theirs[inside], ours[inside], atol=2e-4)


def test_affine_mat_is_the_linear_part(case):
    result, _, out = case
    affine = sitk.ReadTransform(str(out / "affine.mat"))
    point = np.asarray(result.fixed.grid.origin) + 3.0
    m = result.transform.matrix
    n = result.fixed.ndim
    np.testing.assert_allclose(affine.TransformPoint(point.tolist()), m[:n, :n] @ point + m[:n, n], atol=1e-6)


def test_inverse_composes_with_forward_to_identity(case):
    result, _, out = case
    fixed_grid, moving_grid = result.fixed.grid, result.moving.grid
    u = torch.from_numpy(sitk.GetArrayFromImage(_sitk_read(out / "displacement.nii.gz"))).double()
    v = torch.from_numpy(sitk.GetArrayFromImage(_sitk_read(out / "inverse_displacement.nii.gz"))).double()
    assert tuple(v.shape) == (*moving_grid.shape, moving_grid.ndim)
    x = fixed_grid.world_points(torch.float64)
    y = x + u
    back = y + sample_image(v.movedim(-1, 0), moving_grid, y).movedim(0, -1)
    error = (back - x).norm(dim=-1).numpy()[_inside(result)]
    displacement = u.norm(dim=-1).numpy()[_inside(result)]
    # linear interpolation of v between moving voxels on a strong deformation (det 0.5 to 2): up to ~0.2 mm
    assert np.median(error) < 0.03 * min(fixed_grid.spacing)
    assert error.max() < 0.25 * min(fixed_grid.spacing)
    assert np.median(displacement) > 10 * np.median(error)  # a wrong inverse errs by about the displacement


def test_jacobian_positive_and_consistent_with_metrics(case):
    result, _, out = case
    det = read_image(out / "jacobian.nii.gz")
    assert _same_grid(det.grid, result.fixed.grid) and det.data.dtype == torch.float32
    assert float(det.data.min()) > 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["jacobian"]["fraction_nonpositive"] == 0.0
    assert metrics["jacobian"]["analytic_min"] == pytest.approx(float(det.data.min()), rel=1e-6)


def test_transform_json_reevaluates_the_displacement(case):
    result, _, out = case
    loaded = Transformation.load(out / "transform.json")
    torch.testing.assert_close(loaded.displacement(), result.transform.displacement())


def test_learn2reg_displacement_warps_like_scipy_map_coordinates(case):
    """Learn2Reg's evaluation: map_coordinates(moving[i, j, k], identity + disp) on the fixed voxels."""
    result, _, out = case
    disp = learn2reg_displacement(result.transform, result.moving.grid)
    n = result.fixed.ndim
    assert disp.shape == (*result.fixed.grid.size, n)
    moving = result.moving.data.permute(*reversed(range(n))).numpy()  # nibabel's [i, j, k] layout
    identity = np.stack(np.meshgrid(*[np.arange(s) for s in result.fixed.grid.size], indexing="ij"))
    theirs = ndimage.map_coordinates(moving, identity + np.moveaxis(disp, -1, 0), order=1)
    ours = read_image(out / "warped.nii.gz").data.permute(*reversed(range(n))).numpy()
    inside = np.transpose(_inside(result), tuple(reversed(range(n))))
    np.testing.assert_allclose(theirs[inside], ours[inside], atol=1e-4)


# ----------------------------------------------------------------------------------------------------------------------
# Contents


def test_labels_keep_their_label_set_and_type(case):
    _, labels, out = case
    warped = read_image(out / "warped_labels.nii.gz")
    assert warped.data.dtype == torch.int16
    assert set(torch.unique(warped.data).tolist()) <= set(torch.unique(labels["moving"].data).tolist()) | {0}


def test_warped_is_float_on_the_fixed_grid(case):
    result, _, out = case
    warped = read_image(out / "warped.nii.gz")
    assert _same_grid(warped.grid, result.fixed.grid) and warped.data.dtype == torch.float32


def test_metrics_content(case):
    result, _, out = case
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) == {
        "similarity",
        "labels",
        "jacobian",
        "field_of_view_overlap",
        "runtime",
        "peak_memory",
        "device",
        "seed",
        "versions",
        "images",
    }
    assert set(metrics["similarity"]) == {"ncc", "mse", "lncc"}
    for values in metrics["similarity"].values():
        assert values["after"] < values["before"]
    labels = metrics["labels"]
    assert labels["labels"] == [1, 2]
    assert labels["mean_dice_after"] > labels["mean_dice_before"]
    assert set(labels["hd95_after_mm"]) == {"1", "2"}
    assert metrics["jacobian"]["sdlogj"] > 0
    assert [s["kind"] for s in metrics["runtime"]["stages"]] == ["moments", "affine", "cpab"]
    assert metrics["runtime"]["total_seconds"] == result.seconds
    assert metrics["peak_memory"]["bytes"] > 0 and metrics["peak_memory"]["measure"] == "process_peak_rss"
    assert metrics["device"] == "cpu" and metrics["seed"] == 0
    assert set(metrics["versions"]) == {"regkit", "torch", "python"}
    assert read_moving_grid(out) == result.moving.grid
    assert load_config(str(out / "config.yaml")) == result.config


def test_qc_png_has_one_row_of_three_panels_per_slice(case):
    result, _, out = case
    png = sitk.GetArrayFromImage(_sitk_read(out / "qc.png"))
    assert png.dtype == np.uint8 and png.shape[-1] == 3
    rows = 1 if result.fixed.ndim == 2 else 3
    assert png.shape[0] >= rows * 100 and png.shape[1] >= 3 * outputs._QC_SIDE * 0.5
    assert png.std() > 10  # not blank


def test_qc_picture_marks_folds_green():
    grid = Grid.create((16, 12))
    det = torch.ones(grid.shape)
    folded = torch.zeros(grid.shape, dtype=torch.bool)
    folded[4:8, 4:8] = True
    picture = qc_picture(torch.rand(grid.shape), torch.rand(grid.shape), torch.zeros(*grid.shape, 2), det, folded, grid)
    jacobian_panel = picture[:, -picture.shape[1] // 3 :]
    assert ((jacobian_panel == (0, 255, 0)).all(-1)).sum() > 0


# ----------------------------------------------------------------------------------------------------------------------
# Atomicity


def test_existing_folder_is_refused_then_replaced_with_overwrite(case, tmp_path):
    result, _, _ = case
    out = tmp_path / "out"
    out.mkdir()
    (out / "transform.json").write_text("old")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        write_outputs(result, out)
    assert os.listdir(out) == ["transform.json"]
    write_outputs(result, out, overwrite=True)
    assert (out / "transform.json").read_text() != "old"
    assert sorted(os.listdir(out)) == sorted(ALL_FILES - {"warped_labels.nii.gz"})
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_overwrite_never_replaces_a_folder_of_other_files(case, tmp_path):
    result, _, _ = case
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(OutputExistsError, match="not a regkit output folder"):
        write_outputs(result, tmp_path, overwrite=True)
    assert os.listdir(tmp_path) == ["notes.txt"]


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_failure_midway_leaves_nothing(case, tmp_path, monkeypatch, error):
    result, labels, _ = case

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(outputs, "_write_transform_h5", fail)
    with pytest.raises(type(error)):
        write_outputs(result, tmp_path / "out", moving_labels=labels["moving"])
    assert os.listdir(tmp_path) == []


def test_failure_with_overwrite_keeps_the_old_folder(case, tmp_path, monkeypatch):
    result, _, _ = case
    out = tmp_path / "out"
    out.mkdir()
    (out / "transform.json").write_text("old")

    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(outputs, "write_png", fail)
    with pytest.raises(RuntimeError):
        write_outputs(result, out, overwrite=True)
    assert os.listdir(tmp_path) == ["out"] and os.listdir(out) == ["transform.json"]


# ----------------------------------------------------------------------------------------------------------------------
# Helpers


def test_as_label_map():
    grid = Grid.create((3, 2))
    assert as_label_map(Image(torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 1.0]]), grid), "l").data.dtype == torch.int64
    ints = Image(torch.zeros(2, 3, dtype=torch.uint8), grid)
    assert as_label_map(ints, "l") is ints
    with pytest.raises(ImageValueError, match=r"labels\.nii\.gz holds non-integer values \(e\.g\. 0\.5"):
        as_label_map(Image(torch.tensor([[0.0, 0.5, 2.0], [3.0, 0.0, 1.0]]), grid), "labels.nii.gz")


def test_label_map_of_another_dimension_is_refused(case, tmp_path):
    result, _, _ = case
    other = Image(
        torch.zeros((4,) * (5 - result.fixed.ndim), dtype=torch.int16), Grid.create((4,) * (5 - result.fixed.ndim))
    )
    with pytest.raises(ImageDimensionError, match="moving labels"):
        write_outputs(result, tmp_path / "out", moving_labels=other)
    assert os.listdir(tmp_path) == []


def test_field_of_view_overlap():
    grid = Grid.create((10, 10), (1.0, 1.0))
    assert field_of_view_overlap(grid, grid) == 1.0
    assert field_of_view_overlap(grid, Grid.create((10, 10), origin=(100.0, 0.0))) == 0.0
    assert 0.4 < field_of_view_overlap(grid, Grid.create((10, 10), origin=(5.0, 0.0))) < 0.6


def test_resample_and_itk_transform_agree(case, tmp_path):
    result, labels, out = case
    reference = Grid.create(
        result.fixed.grid.size, [s * 1.1 for s in result.fixed.grid.spacing], result.fixed.grid.origin
    )
    ours = resample(Transformation.load(out / "transform.json"), labels["moving"], reference, mode="nearest")
    theirs = apply_itk_transform(out / "transform.h5", labels["moving"], reference, mode="nearest")
    assert ours.data.dtype == theirs.data.dtype == torch.int16
    assert (ours.data != theirs.data).double().mean() < 0.01  # nearest ties and the field's border may differ

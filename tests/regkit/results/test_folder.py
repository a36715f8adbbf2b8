"""regkit.results.folder: the files of a registration, checked against SimpleITK, nibabel and scipy, and written
atomically.

The tests read the output folders of the package's registrations (the ``case`` fixture of conftest.py).
"""

from __future__ import annotations

import os

import nibabel as nib
import numpy as np
import pytest
import SimpleITK as sitk
import torch
from scipy import ndimage

import regkit.results.folder as folder
from regkit.errors import ImageDimensionError
from regkit.io import Image, learn2reg_displacement, read_image, write_image
from regkit.results import OUTPUT_FILES, OutputExistsError, write_outputs
from regkit.spatial.grid import Grid
from regkit.spatial.sampling import sample_image
from regkit.transform import Transformation
from tests.regkit.results.registration_cases import inside_moving, registration_config, same_grid, sitk_read

ALL_FILES = set(OUTPUT_FILES.values())


def _resample_with(result, itk_transform, tmp_path) -> np.ndarray:
    """The moving image (read back from a file by SimpleITK) resampled onto the fixed grid by SimpleITK."""
    write_image(result.moving, tmp_path / "moving.nii.gz")
    moving = sitk_read(tmp_path / "moving.nii.gz")
    write_image(result.fixed, tmp_path / "fixed.nii.gz")
    reference = sitk_read(tmp_path / "fixed.nii.gz")
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
    result = type(result)(**{**result.__dict__, "config": registration_config(result.fixed.ndim, **flags)})
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
    field = sitk.Cast(sitk_read(out / "displacement.nii.gz"), sitk.sitkVectorFloat64)
    ours = sitk.GetArrayFromImage(sitk_read(out / "warped.nii.gz"))
    theirs = _resample_with(result, sitk.DisplacementFieldTransform(field), tmp_path)
    inside = inside_moving(result)
    assert inside.mean() > 0.5
    np.testing.assert_allclose(theirs[inside], ours[inside], atol=2e-4)


def test_sitk_resampling_with_transform_h5_reproduces_warped(case, tmp_path):
    result, _, out = case
    composite = sitk.ReadTransform(str(out / "transform.h5"))
    ours = sitk.GetArrayFromImage(sitk_read(out / "warped.nii.gz"))
    theirs = _resample_with(result, composite, tmp_path)
    inside = inside_moving(result)
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
    u = torch.from_numpy(sitk.GetArrayFromImage(sitk_read(out / "displacement.nii.gz"))).double()
    v = torch.from_numpy(sitk.GetArrayFromImage(sitk_read(out / "inverse_displacement.nii.gz"))).double()
    assert tuple(v.shape) == (*moving_grid.shape, moving_grid.ndim)
    x = fixed_grid.world_points(torch.float64)
    y = x + u
    back = y + sample_image(v.movedim(-1, 0), moving_grid, y).movedim(0, -1)
    error = (back - x).norm(dim=-1).numpy()[inside_moving(result)]
    displacement = u.norm(dim=-1).numpy()[inside_moving(result)]
    # linear interpolation of v between moving voxels on a strong deformation (det 0.5 to 2): up to ~0.2 mm
    assert np.median(error) < 0.03 * min(fixed_grid.spacing)
    assert error.max() < 0.25 * min(fixed_grid.spacing)
    assert np.median(displacement) > 10 * np.median(error)  # a wrong inverse errs by about the displacement


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
    inside = np.transpose(inside_moving(result), tuple(reversed(range(n))))
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
    assert same_grid(warped.grid, result.fixed.grid) and warped.data.dtype == torch.float32


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

    monkeypatch.setattr(folder, "write_transform_h5", fail)
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

    monkeypatch.setattr(folder, "write_png", fail)
    with pytest.raises(RuntimeError):
        write_outputs(result, out, overwrite=True)
    assert os.listdir(tmp_path) == ["out"] and os.listdir(out) == ["transform.json"]


# ----------------------------------------------------------------------------------------------------------------------
# Label maps


def test_label_map_of_another_dimension_is_refused(case, tmp_path):
    result, _, _ = case
    other = Image(
        torch.zeros((4,) * (5 - result.fixed.ndim), dtype=torch.int16), Grid.create((4,) * (5 - result.fixed.ndim))
    )
    with pytest.raises(ImageDimensionError, match="moving labels"):
        write_outputs(result, tmp_path / "out", moving_labels=other)
    assert os.listdir(tmp_path) == []

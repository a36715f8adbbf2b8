"""regkit.io.transforms: transformations in other tools' conventions, checked with those tools on the files of a
registration: the displacement field (ITK's vector NIfTI, SimpleITK's DisplacementFieldTransform), transform.h5
(SimpleITK's composite transform) and Learn2Reg's displacement (scipy's map_coordinates).

The tests read the registrations of the ``registration_case`` fixture (tests/regkit/conftest.py).
"""

from __future__ import annotations

import os

import nibabel as nib
import numpy as np
import pytest
import SimpleITK as sitk
import torch
from scipy import ndimage

from regkit.errors import RegkitError
from regkit.io import Image, apply_itk_transform, learn2reg_displacement, read_image, write_image
from regkit.spatial import Grid
from tests.helpers import inside_moving, sitk_read


def _resample_with(result, itk_transform, tmp_path) -> np.ndarray:
    """The moving image (read back from a file by SimpleITK) resampled onto the fixed grid by SimpleITK."""
    write_image(result.moving, tmp_path / "moving.nii.gz")
    moving = sitk_read(tmp_path / "moving.nii.gz")
    write_image(result.fixed, tmp_path / "fixed.nii.gz")
    reference = sitk_read(tmp_path / "fixed.nii.gz")
    out = sitk.Resample(moving, reference, itk_transform, sitk.sitkLinear, 0.0, sitk.sitkFloat32)
    return sitk.GetArrayFromImage(out)


def test_displacement_header_is_itk_vector_nifti(registration_case):
    result, _, out = registration_case
    header = nib.load(out / "displacement.nii.gz").header
    size = result.fixed.grid.size
    n = len(size)
    expected = (*size, 1, n) if n == 3 else (*size, 1, 1, n)
    assert header.get_data_shape() == expected
    assert int(header["intent_code"]) == 1007
    assert header.get_data_dtype() == np.float32


def test_sitk_resampling_with_displacement_reproduces_warped(registration_case, tmp_path):
    result, _, out = registration_case
    field = sitk.Cast(sitk_read(out / "displacement.nii.gz"), sitk.sitkVectorFloat64)
    ours = sitk.GetArrayFromImage(sitk_read(out / "warped.nii.gz"))
    theirs = _resample_with(result, sitk.DisplacementFieldTransform(field), tmp_path)
    inside = inside_moving(result)
    assert inside.mean() > 0.5
    np.testing.assert_allclose(theirs[inside], ours[inside], atol=2e-4)


def test_sitk_resampling_with_transform_h5_reproduces_warped(registration_case, tmp_path):
    result, _, out = registration_case
    composite = sitk.ReadTransform(str(out / "transform.h5"))
    ours = sitk.GetArrayFromImage(sitk_read(out / "warped.nii.gz"))
    theirs = _resample_with(result, composite, tmp_path)
    inside = inside_moving(result)
    np.testing.assert_allclose(theirs[inside], ours[inside], atol=2e-4)


def test_learn2reg_displacement_warps_like_scipy_map_coordinates(registration_case):
    """Learn2Reg's evaluation: map_coordinates(moving[i, j, k], identity + disp) on the fixed voxels."""
    result, _, out = registration_case
    disp = learn2reg_displacement(result.transform, result.moving.grid)
    n = result.fixed.ndim
    assert disp.shape == (*result.fixed.grid.size, n)
    moving = result.moving.data.permute(*reversed(range(n))).numpy()  # nibabel's [i, j, k] layout
    identity = np.stack(np.meshgrid(*[np.arange(s) for s in result.fixed.grid.size], indexing="ij"))
    theirs = ndimage.map_coordinates(moving, identity + np.moveaxis(disp, -1, 0), order=1)
    ours = read_image(out / "warped.nii.gz").data.permute(*reversed(range(n))).numpy()
    inside = np.transpose(inside_moving(result), tuple(reversed(range(n))))
    np.testing.assert_allclose(theirs[inside], ours[inside], atol=1e-4)


def test_transform_files_are_refused_unless_regular_files_simpleitk_can_open(tmp_path):
    """apply_itk_transform checks the path before ITK opens it: a named pipe would block it, a name that is not
    UTF-8 would abort the process inside SimpleITK."""
    image = Image(torch.zeros(2, 3), Grid.create((3, 2)))
    os.mkfifo(tmp_path / "transform.h5")
    cases = {
        tmp_path / "transform.h5": "named pipe",
        tmp_path: "is a folder",
        tmp_path / os.fsdecode(b"\xff.h5"): "not valid UTF-8",
        tmp_path / "missing.h5": "no such file",
    }
    for path, match in cases.items():
        with pytest.raises(RegkitError, match=match) as err:
            apply_itk_transform(path, image, image.grid)
        assert "\n" not in str(err.value)

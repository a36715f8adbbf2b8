"""``regkit invert``: the inverse displacement of a registration (conftest.py), from its folder or a lone transform."""

from __future__ import annotations

import shutil

import nibabel as nib
import numpy as np

from tests.helpers import assert_one_error_line, run_cli


def test_invert_result_dir_matches_inverse_displacement(result_dir, tmp_path):
    out = tmp_path / "inverse.nii.gz"
    assert run_cli(["invert", result_dir, "-o", out]) == 0
    ours = nib.load(out).get_fdata()
    written = nib.load(result_dir / "inverse_displacement.nii.gz").get_fdata()
    np.testing.assert_allclose(ours, written, atol=1e-6)


def test_invert_lone_transform_needs_a_reference(files, result_dir, tmp_path, capsys):
    lone = tmp_path / "transform.json"
    shutil.copy(result_dir / "transform.json", lone)
    assert run_cli(["invert", lone, "-o", tmp_path / "inverse.nii.gz"]) == 1
    assert_one_error_line(capsys, "--reference")
    assert run_cli(["invert", lone, "-o", tmp_path / "inverse.nii.gz", "-r", files["moving"]]) == 0
    assert nib.load(tmp_path / "inverse.nii.gz").shape == (34, 34, 1, 1, 2)

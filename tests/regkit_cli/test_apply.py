"""``regkit apply``: the transformation of a registration (conftest.py) applied to its labels and moving image."""

from __future__ import annotations

import pytest
import torch

from regkit.io import read_image
from tests.helpers import assert_one_error_line, run_cli


@pytest.mark.parametrize("transform", ["transform.json", "transform.h5"])
def test_apply_nearest_keeps_the_label_set(files, result_dir, tmp_path, transform):
    out = tmp_path / "labels.nii.gz"
    argv = ["apply", result_dir / transform, files["ml"], "-r", files["fixed"], "-o", out, "--interp", "nearest"]
    assert run_cli(argv) == 0
    labels = read_image(out)
    assert labels.data.dtype == torch.int16
    assert set(torch.unique(labels.data).tolist()) == {0, 1, 2}
    warped_labels = read_image(result_dir / "warped_labels.nii.gz")
    assert (labels.data != warped_labels.data).double().mean() < 0.01


@pytest.mark.parametrize("transform", ["transform.json", "transform.h5"])
def test_apply_linear_reproduces_warped(files, result_dir, tmp_path, transform):
    out = tmp_path / "warped.mha"
    assert run_cli(["apply", result_dir / transform, files["moving"], "-r", files["fixed"], "-o", out]) == 0
    ours, warped = read_image(out), read_image(result_dir / "warped.nii.gz")
    assert ours.data.dtype == torch.float32
    interior = (slice(4, -4), slice(4, -4))
    torch.testing.assert_close(ours.data[interior], warped.data[interior], atol=2e-4, rtol=0)


def test_apply_missing_transform_is_one_line(files, tmp_path, capsys):
    argv = ["apply", tmp_path / "none.h5", files["ml"], "-r", files["fixed"], "-o", tmp_path / "x.nii.gz"]
    assert run_cli(argv) == 1
    assert_one_error_line(capsys, "no such file")

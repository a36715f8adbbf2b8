"""regkit.results.folder: the files of a registration (which ones, affine.mat against SimpleITK, their contents), and
written atomically.

The tests read the output folders of the ``registration_case`` fixture (tests/regkit/conftest.py). The conventions of
the displacement, transform.h5 and Learn2Reg files are tested with their writers (tests/regkit/io/test_transforms.py),
transform.json and the inverse with :class:`~regkit.transform.Transformation` (tests/regkit/test_transform.py).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import SimpleITK as sitk
import torch

import regkit.results.folder as folder
from regkit.errors import ImageDimensionError
from regkit.io import Image, read_image
from regkit.results import OUTPUT_FILES, OutputExistsError, write_outputs
from regkit.spatial.grid import Grid
from tests.helpers import registration_config, same_grid

ALL_FILES = set(OUTPUT_FILES.values())


# ----------------------------------------------------------------------------------------------------------------------
# The folder


def test_exactly_the_named_files(registration_case):
    _, _, out = registration_case
    assert set(os.listdir(out)) == ALL_FILES
    assert os.listdir(out.parent) == ["out"]  # no temporary folder left beside it


def test_optional_outputs_follow_the_flags(registration_case, tmp_path):
    result, _, _ = registration_case
    flags = {k: False for k in ("warped", "displacement", "inverse_displacement", "jacobian", "transform_h5", "qc_png")}
    result = type(result)(**{**result.__dict__, "config": registration_config(result.fixed.ndim, **flags)})
    written = write_outputs(result, tmp_path / "out")
    mandatory = {"affine", "transform", "metrics", "config"}
    assert set(written) == mandatory
    assert set(os.listdir(tmp_path / "out")) == {OUTPUT_FILES[k] for k in mandatory}


# ----------------------------------------------------------------------------------------------------------------------
# affine.mat, against SimpleITK


def test_affine_mat_is_the_linear_part(registration_case):
    result, _, out = registration_case
    affine = sitk.ReadTransform(str(out / "affine.mat"))
    point = np.asarray(result.fixed.grid.origin) + 3.0
    m = result.transform.matrix
    n = result.fixed.ndim
    np.testing.assert_allclose(affine.TransformPoint(point.tolist()), m[:n, :n] @ point + m[:n, n], atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# Contents


def test_labels_keep_their_label_set_and_type(registration_case):
    _, labels, out = registration_case
    warped = read_image(out / "warped_labels.nii.gz")
    assert warped.data.dtype == torch.int16
    assert set(torch.unique(warped.data).tolist()) <= set(torch.unique(labels["moving"].data).tolist()) | {0}


def test_warped_is_float_on_the_fixed_grid(registration_case):
    result, _, out = registration_case
    warped = read_image(out / "warped.nii.gz")
    assert same_grid(warped.grid, result.fixed.grid) and warped.data.dtype == torch.float32


# ----------------------------------------------------------------------------------------------------------------------
# Atomicity


def test_existing_folder_is_refused_then_replaced_with_overwrite(registration_case, tmp_path):
    result, _, _ = registration_case
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


def test_overwrite_never_replaces_a_folder_of_other_files(registration_case, tmp_path):
    result, _, _ = registration_case
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(OutputExistsError, match="not a regkit output folder"):
        write_outputs(result, tmp_path, overwrite=True)
    assert os.listdir(tmp_path) == ["notes.txt"]


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_failure_midway_leaves_nothing(registration_case, tmp_path, monkeypatch, error):
    result, labels, _ = registration_case

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(folder, "write_transform_h5", fail)
    with pytest.raises(type(error)):
        write_outputs(result, tmp_path / "out", moving_labels=labels["moving"])
    assert os.listdir(tmp_path) == []


def test_failure_with_overwrite_keeps_the_old_folder(registration_case, tmp_path, monkeypatch):
    result, _, _ = registration_case
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


def test_label_map_of_another_dimension_is_refused(registration_case, tmp_path):
    result, _, _ = registration_case
    other = Image(
        torch.zeros((4,) * (5 - result.fixed.ndim), dtype=torch.int16), Grid.create((4,) * (5 - result.fixed.ndim))
    )
    with pytest.raises(ImageDimensionError, match="moving labels"):
        write_outputs(result, tmp_path / "out", moving_labels=other)
    assert os.listdir(tmp_path) == []

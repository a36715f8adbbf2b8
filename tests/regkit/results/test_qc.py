"""regkit.results.qc: the QC picture, as written into the folders of tests/regkit/conftest.py, and alone."""

from __future__ import annotations

import numpy as np
import SimpleITK as sitk
import torch

from regkit.results.qc import QC_SIDE, qc_picture
from regkit.spatial.grid import Grid
from tests.helpers import sitk_read


def test_qc_png_has_one_row_of_three_panels_per_slice(registration_case):
    result, _, out = registration_case
    png = sitk.GetArrayFromImage(sitk_read(out / "qc.png"))
    assert png.dtype == np.uint8 and png.shape[-1] == 3
    rows = 1 if result.fixed.ndim == 2 else 3
    assert png.shape[0] >= rows * 100 and png.shape[1] >= 3 * QC_SIDE * 0.5
    assert png.std() > 10  # not blank


def test_qc_picture_marks_folds_green():
    grid = Grid.create((16, 12))
    det = torch.ones(grid.shape)
    folded = torch.zeros(grid.shape, dtype=torch.bool)
    folded[4:8, 4:8] = True
    picture = qc_picture(torch.rand(grid.shape), torch.rand(grid.shape), torch.zeros(*grid.shape, 2), det, folded, grid)
    jacobian_panel = picture[:, -picture.shape[1] // 3 :]
    assert ((jacobian_panel == (0, 255, 0)).all(-1)).sum() > 0

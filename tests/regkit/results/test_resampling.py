"""regkit.results.resampling: resample through a saved transformation, against SimpleITK's transform.h5."""

from __future__ import annotations

import torch

from regkit.io import apply_itk_transform
from regkit.results import resample
from regkit.spatial.grid import Grid
from regkit.transform import Transformation


def test_resample_and_itk_transform_agree(registration_case, tmp_path):
    result, labels, out = registration_case
    reference = Grid.create(
        result.fixed.grid.size, [s * 1.1 for s in result.fixed.grid.spacing], result.fixed.grid.origin
    )
    ours = resample(Transformation.load(out / "transform.json"), labels["moving"], reference, mode="nearest")
    theirs = apply_itk_transform(out / "transform.h5", labels["moving"], reference, mode="nearest")
    assert ours.data.dtype == theirs.data.dtype == torch.int16
    assert (ours.data != theirs.data).double().mean() < 0.01  # nearest ties and the field's border may differ

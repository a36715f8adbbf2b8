"""regkit.io.inputs: label maps as integer images."""

from __future__ import annotations

import pytest
import torch

from regkit.errors import ImageValueError
from regkit.io import Image, as_label_map
from regkit.spatial.grid import Grid


def test_as_label_map():
    grid = Grid.create((3, 2))
    assert as_label_map(Image(torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 1.0]]), grid), "l").data.dtype == torch.int64
    ints = Image(torch.zeros(2, 3, dtype=torch.uint8), grid)
    assert as_label_map(ints, "l") is ints
    with pytest.raises(ImageValueError, match=r"labels\.nii\.gz holds non-integer values \(e\.g\. 0\.5"):
        as_label_map(Image(torch.tensor([[0.0, 0.5, 2.0], [3.0, 0.0, 1.0]]), grid), "labels.nii.gz")

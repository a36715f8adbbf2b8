"""regkit.io.image: the Image type, a tensor with its grid."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from regkit.errors import GeometryError
from regkit.io import Image
from regkit.spatial import Grid

# ----------------------------------------------------------------------------------------------------------------------
# Image


def test_image_checks_shape_and_exposes_geometry() -> None:
    grid = Grid.create((4, 3, 2), spacing=(0.5, 1.0, 2.0), origin=(1.0, 2.0, 3.0))
    with pytest.raises(GeometryError, match=r"\(4, 3, 2\).*\(2, 3, 4\)"):
        Image(torch.zeros(4, 3, 2), grid)
    image = Image(torch.zeros(2, 3, 4), grid)
    assert image.ndim == 3 and image.shape == (2, 3, 4)
    np.testing.assert_array_equal(image.spacing, [0.5, 1.0, 2.0])
    np.testing.assert_array_equal(image.origin, [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(image.direction, np.eye(3))
    index = torch.tensor([[3.0, 2.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(image.index_to_world(index), torch.tensor([[2.5, 4.0, 5.0]], dtype=torch.float64))
    torch.testing.assert_close(image.world_to_index(image.index_to_world(index)), index)

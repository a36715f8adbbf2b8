"""regkit.transform: the transformation a registration finds, saved and loaded (transform.json), and its inverse.

The tests read the registrations of the ``registration_case`` fixture (tests/regkit/conftest.py): their output folders
hold transform.json and the forward and inverse displacement fields.
"""

from __future__ import annotations

import numpy as np
import SimpleITK as sitk
import torch

from regkit.spatial.sampling import sample_image
from regkit.transform import Transformation
from tests.helpers import inside_moving, sitk_read


def test_transform_json_reevaluates_the_displacement(registration_case):
    result, _, out = registration_case
    loaded = Transformation.load(out / "transform.json")
    torch.testing.assert_close(loaded.displacement(), result.transform.displacement())


def test_inverse_composes_with_forward_to_identity(registration_case):
    result, _, out = registration_case
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

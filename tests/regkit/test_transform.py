"""regkit.transform: the transformation a registration finds, saved and loaded (transform.json), and its inverse.

The tests read the registrations of the ``registration_case`` fixture (tests/regkit/conftest.py): their output folders
hold transform.json and the forward and inverse displacement fields.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import SimpleITK as sitk
import torch

from regkit.spatial.grid import Grid
from regkit.spatial.sampling import sample_image
from regkit.transform import Transformation, TransformFileError
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


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["cpab"][0].update(theta=[float("nan")] * len(d["cpab"][0]["theta"])), "theta must be finite"),
        (lambda d: d["cpab"][0].update(theta=[1e30] * len(d["cpab"][0]["theta"])), "theta must be finite"),
        (lambda d: d["cpab"][0].update(steps=10**9), "steps must be an integer in [1, 1000]"),
        (lambda d: d["cpab"][0].update(steps=2.5), "steps must be an integer"),
        (lambda d: d["cpab"][0].update(dtype="float16"), "dtype must be float32 or float64"),
        (lambda d: d["matrix"][0].__setitem__(0, float("nan")), "matrix holds non-finite values"),
        (lambda d: d.update(matrix=np.diag([1.0] * (len(d["matrix"]) - 2) + [0.0, 1.0]).tolist()), "singular"),
        (lambda d: d["fixed_grid"]["spacing"].__setitem__(0, 0.0), "fixed_grid: spacing must be finite and positive"),
        (lambda d: d.update(cpab={}), "cpab must be a list"),
        (lambda d: d["cpab"][0]["origin"].__setitem__(0, float("inf")), "cpab[0]: origin must be finite"),
        (lambda d: d["cpab"][0].update(cells=[10**6] * len(d["cpab"][0]["cells"])), "boxes"),
        (lambda d: d["cpab"][0].update(cells=[2]), "cpab[0]: cells must be"),
        (lambda d: d["cpab"][0].update(volume_preserving="no"), "cpab[0]: volume_preserving must be true or false"),
        (lambda d: d["cpab"][0].update(length_scale=-1.0), "cpab[0]: length_scale and variance must be positive"),
        (lambda d: d["cpab"][0].update(theta=[d["cpab"][0]["theta"]]), "cpab[0]: theta has shape"),
    ],
)
def test_a_transform_file_is_validated_on_load(registration_case, tmp_path, edit, message):
    """Non-finite or huge parameters, bad steps or dtype, a non-finite or singular matrix, an invalid grid or flow
    frame, a tessellation too fine to rebuild, wrong types and shapes: one line naming the file."""
    _, _, out = registration_case
    data = json.loads((out / "transform.json").read_text())
    edit(data)
    path = tmp_path / "transform.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TransformFileError) as err:
        Transformation.load(path)
    assert message in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda text: text.replace(b'"version": 1', b'"version": ' + b"1" * 5000), "Exceeds the limit"),
        (lambda text: text.replace(b'"matrix": ', b'"matrix": ' + b"[" * 100_000), "nested too deeply"),
        (lambda text: text.replace(b"regkit-transform", b"regkit-transform\xff"), "can't decode byte 0xff"),
        (lambda text: text[: len(text) // 2], "not a readable JSON transform file"),
    ],
)
def test_a_transform_file_that_is_not_json_is_one_line(tmp_path, edit, message):
    """Integers too long to convert, nesting too deep for the parser, invalid UTF-8, a cut file."""
    path = Transformation(Grid.create((8, 6)), np.eye(3)).save(tmp_path / "transform.json")
    path.write_bytes(edit(path.read_bytes()))
    with pytest.raises(TransformFileError) as err:
        Transformation.load(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value) and "\n" not in str(err.value)

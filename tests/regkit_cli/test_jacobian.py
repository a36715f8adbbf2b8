"""``regkit jacobian``: the Jacobian determinant of a registration's saved transformation (conftest.py)."""

from __future__ import annotations

import torch

from regkit.io import read_image
from tests.helpers import run_cli


def test_jacobian_matches_the_result(result_dir, tmp_path):
    out = tmp_path / "det.nii.gz"
    assert run_cli(["jacobian", result_dir / "transform.json", "-o", out]) == 0
    torch.testing.assert_close(read_image(out).data, read_image(result_dir / "jacobian.nii.gz").data)

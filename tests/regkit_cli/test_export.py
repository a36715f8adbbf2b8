"""``regkit export``: a registration (conftest.py) in Learn2Reg's submission layout."""

from __future__ import annotations

import nibabel as nib
import numpy as np

from tests.helpers import assert_one_error_line, run_cli


def test_export_learn2reg_names_and_layout(result_dir, tmp_path, capsys):
    folder = tmp_path / "submission"
    assert (
        run_cli(["export", result_dir, "--format", "learn2reg", "-o", folder, "--fixed-id", "1", "--moving-id", "12"])
        == 0
    )
    path = folder / "disp_0001_0012.nii.gz"
    assert capsys.readouterr().out.strip() == str(path)
    disp = nib.load(path)
    assert disp.shape == (36, 32, 2) and disp.get_data_dtype() == np.float32
    assert run_cli(["export", result_dir / "transform.json", "-o", folder]) == 1
    assert_one_error_line(capsys, "--fixed-id")

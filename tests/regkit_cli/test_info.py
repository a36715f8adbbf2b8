"""``regkit info``: geometry, orientation code, dtype and range of real images; bad files give one ``error:`` line.

Output is captured at the file-descriptor level (``capfd``) so that anything ITK prints from C++ is seen too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from tests.helpers import itk_example, nibabel_data, run_cli


def _fields(out: str) -> dict[str, str]:
    """``key value`` lines of ``regkit info`` as a dict."""
    return dict(line.split(None, 1) for line in out.splitlines())


def test_info_on_las_nifti(capfd) -> None:
    assert run_cli(["info", str(nibabel_data("anatomical.nii"))]) == 0
    captured = capfd.readouterr()
    assert captured.err == ""
    fields = _fields(captured.out)
    assert list(fields) == ["size", "spacing", "origin", "direction", "orientation", "dtype", "range"]
    assert fields["size"].startswith("33 x 41 x 25")
    assert fields["spacing"] == "2 x 2 x 2 mm"
    assert fields["origin"] == "(-32, 40, -16) mm LPS"
    assert fields["orientation"].startswith("LAS ")
    assert fields["dtype"] == "int16"
    assert fields["range"] == "-610 .. 30393"


def test_info_on_oblique_2d_metaimage_and_on_nan_voxels(capfd) -> None:
    assert run_cli(["info", str(itk_example("BrainProtonDensitySliceBorder20DirectionPlus30.mhd"))]) == 0
    fields = _fields(capfd.readouterr().out)
    assert fields["size"].startswith("221 x 257")
    assert fields["direction"].endswith("oblique by up to 30.00 deg")
    assert fields["orientation"].startswith("LP ")
    # `info` does not refuse NaN voxels; it counts them.
    assert run_cli(["info", str(nibabel_data("resampled_anat_moved.nii"))]) == 0
    assert _fields(capfd.readouterr().out)["range"].endswith("(153 NaN, 0 Inf)")


def _truncated_nifti(folder: Path) -> Path:
    path = folder / "cut.nii.gz"
    nib.save(nib.Nifti1Image(np.random.default_rng(0).random((16, 16, 16), dtype=np.float32), np.eye(4)), path)
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])
    return path


def _four_d_nifti(folder: Path) -> Path:
    path = folder / "bold.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((6, 7, 8, 3), np.float32), np.eye(4)), path)
    return path


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: d / "missing.nii.gz", "no such file"),
        (_truncated_nifti, "truncated or corrupt"),
        (_four_d_nifti, "4 dimensions (6x7x8x3)"),
        (lambda d: d, "no DICOM series"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_code_1(capfd, tmp_path: Path, make, expected: str) -> None:
    path = make(tmp_path)
    assert run_cli(["info", str(path)]) == 1
    captured = capfd.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert expected in captured.err and path.name in captured.err
    assert "Traceback" not in captured.err


def test_python_dash_m_regkit_info_runs_the_real_entry_point(tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "regkit_cli", "info", str(nibabel_data("anatomical.nii"))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert _fields(ok.stdout)["orientation"].startswith("LAS ")
    assert ok.stderr == ""

"""``regkit register / apply / invert / jacobian / export`` on a tiny 2D pair: outputs, exit codes, one-line errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest
import torch

import regkit.registration
from regkit.io import Image, read_image, write_image
from regkit.results import OUTPUT_FILES
from regkit.spatial.grid import Grid
from tests.regkit_cli.cli import run_cli

CONFIG = """\
base: quick-2d
stages:
  - {type: moments}
  - type: affine
    similarity: {name: ncc}
    pyramid: [{shrink: 1, smoothing: 0.0}]
    optimizer: {iterations: 8}
  - type: cpab
    similarity: {name: ncc}
    pyramid: [{shrink: 1, smoothing: 0.0}]
    optimizer: {iterations: 8, learning_rate: 0.2}
    tessellation: [3]
    steps: 10
"""


def _blobs(grid: Grid, shift: float) -> torch.Tensor:
    p = grid.world_points(torch.float64)
    a = torch.exp(-((p - torch.tensor([14.0 + shift, 16.0])) ** 2).sum(-1) / 40.0)
    b = torch.exp(-((p - torch.tensor([24.0, 10.0 - shift])) ** 2).sum(-1) / 20.0)
    return (a + 0.6 * b).float()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These problems are tiny: intra-op threads only cost time (4x on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A 2D pair with label maps, a few bad inputs and a small configuration, as files."""
    d = tmp_path_factory.mktemp("inputs")
    fixed_grid = Grid.create((36, 32), (1.0, 1.2), (0.0, 0.0))
    moving_grid = Grid.create((34, 34), (1.1, 1.1), (1.5, -1.0))
    fixed, moving = _blobs(fixed_grid, 0.0), _blobs(moving_grid, 2.0)
    paths = {name: d / f"{name}.nii.gz" for name in ("fixed", "moving", "fl", "ml", "float_labels", "volume", "far")}
    write_image(Image(fixed, fixed_grid), paths["fixed"])
    write_image(Image(moving, moving_grid), paths["moving"])
    write_image(Image((fixed > 0.4).to(torch.int16) + (fixed > 0.8).to(torch.int16), fixed_grid), paths["fl"])
    write_image(Image((moving > 0.4).to(torch.int16) + (moving > 0.8).to(torch.int16), moving_grid), paths["ml"])
    write_image(Image(moving * 2.5, moving_grid), paths["float_labels"])
    write_image(Image(torch.rand(6, 7, 8), Grid.create((8, 7, 6))), paths["volume"])
    write_image(Image(moving, Grid.create(moving_grid.size, moving_grid.spacing, (500.0, 0.0))), paths["far"])
    paths["config"] = d / "config.yaml"
    paths["config"].write_text(CONFIG)
    paths["bad_config"] = d / "bad.yaml"
    paths["bad_config"].write_text(CONFIG.replace("steps: 10", "stpes: 10"))
    return paths


@pytest.fixture(scope="module")
def result_dir(files, tmp_path_factory):
    """One registration through main(), with both label maps and progress on."""
    out = tmp_path_factory.mktemp("result") / "out"
    argv = ["register", files["fixed"], files["moving"], "-o", out, "-c", files["config"]]
    assert run_cli([*argv, "--moving-labels", files["ml"], "--fixed-labels", files["fl"], "--seed", "3"]) == 0
    return out


def _one_error_line(capsys, contains: str) -> None:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and contains in lines[0], err


# ----------------------------------------------------------------------------------------------------------------------
# register


def test_register_writes_every_output(result_dir):
    assert set(os.listdir(result_dir)) == set(OUTPUT_FILES.values())
    assert os.listdir(result_dir.parent) == ["out"]
    assert "seed: 3" in (result_dir / "config.yaml").read_text()


def test_register_prints_where_and_key_metrics(files, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["register", files["fixed"], files["moving"], "-o", out, "-c", files["config"]]
    assert run_cli([*argv, "--moving-labels", files["ml"], "--fixed-labels", files["fl"]]) == 0
    stdout = capsys.readouterr().out
    assert f"outputs: {out}" in stdout and "Dice (mean of 2 labels)" in stdout and "runtime:" in stdout


def test_register_quiet_prints_nothing(files, tmp_path, capsys):
    argv = ["register", files["fixed"], files["moving"], "-o", tmp_path / "out", "-c", files["config"], "--quiet"]
    assert run_cli(argv) == 0
    assert capsys.readouterr() == ("", "")


def test_register_through_python_m(files, tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "regkit_cli", "register", files["fixed"], files["moving"], "-o", out]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as _one_thread
    argv = [str(c) for c in command] + ["-c", str(files["config"]), "--quiet"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert set(os.listdir(out)) == set(OUTPUT_FILES.values()) - {"warped_labels.nii.gz"}


def test_non_overlapping_fields_of_view_warn(files, tmp_path, capsys):
    argv = ["register", files["fixed"], files["far"], "-o", tmp_path / "out", "-c", files["config"], "--quiet"]
    assert run_cli(argv) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and "do not overlap" in err and err.count("\n") == 1
    assert (tmp_path / "out" / "metrics.json").exists()


def test_overwrite_replaces(files, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "transform.json").write_text("old")
    argv = ["register", files["fixed"], files["moving"], "-o", out, "-c", files["config"], "--quiet", "--overwrite"]
    assert run_cli(argv) == 0
    assert set(os.listdir(out)) == set(OUTPUT_FILES.values()) - {"warped_labels.nii.gz"}


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("2d_3d", "is 2D but"),
        ("float_labels", "holds non-integer values"),
        ("existing_output", "exists; use --overwrite"),
        ("missing_file", "no such file"),
        ("invalid_config_key", "unknown key 'stpes'"),
        ("bad_device", "device: must be"),
    ],
)
def test_bad_input_is_one_error_line(files, tmp_path, capsys, case, message):
    out = tmp_path / "out"
    fixed, moving, config, extra = files["fixed"], files["moving"], files["config"], []
    if case == "2d_3d":
        moving = files["volume"]
    elif case == "float_labels":
        extra = ["--moving-labels", files["float_labels"]]
    elif case == "existing_output":
        out.mkdir()
    elif case == "missing_file":
        moving = tmp_path / "nothere.nii.gz"
    elif case == "invalid_config_key":
        config = files["bad_config"]
    elif case == "bad_device":
        extra = ["--device", "gpu"]
    assert run_cli(["register", fixed, moving, "-o", out, "-c", config, "--quiet", *extra]) == 1
    _one_error_line(capsys, message)
    assert os.listdir(tmp_path) == (["out"] if case == "existing_output" else [])


def test_ctrl_c_leaves_nothing_and_exits_130(files, tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(regkit.registration, "register", interrupted)
    assert run_cli(["register", files["fixed"], files["moving"], "-o", tmp_path / "out", "-c", files["config"]]) == 130
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.strip()] == [
        f"interrupted: nothing was written to {tmp_path / 'out'}"
    ]
    assert os.listdir(tmp_path) == []


def test_gpu_out_of_memory_is_one_line(files, tmp_path, capsys, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(regkit.registration, "register", out_of_memory)
    assert run_cli(["register", files["fixed"], files["moving"], "-o", tmp_path / "out", "-c", files["config"]]) == 1
    _one_error_line(capsys, "smaller tessellation")


# ----------------------------------------------------------------------------------------------------------------------
# apply, invert, jacobian, export


@pytest.mark.parametrize("transform", ["transform.json", "transform.h5"])
def test_apply_nearest_keeps_the_label_set(files, result_dir, tmp_path, transform):
    out = tmp_path / "labels.nii.gz"
    argv = ["apply", result_dir / transform, files["ml"], "-r", files["fixed"], "-o", out, "--interp", "nearest"]
    assert run_cli(argv) == 0
    labels = read_image(out)
    assert labels.data.dtype == torch.int16
    assert set(torch.unique(labels.data).tolist()) == {0, 1, 2}
    warped_labels = read_image(result_dir / "warped_labels.nii.gz")
    assert (labels.data != warped_labels.data).double().mean() < 0.01


@pytest.mark.parametrize("transform", ["transform.json", "transform.h5"])
def test_apply_linear_reproduces_warped(files, result_dir, tmp_path, transform):
    out = tmp_path / "warped.mha"
    assert run_cli(["apply", result_dir / transform, files["moving"], "-r", files["fixed"], "-o", out]) == 0
    ours, warped = read_image(out), read_image(result_dir / "warped.nii.gz")
    assert ours.data.dtype == torch.float32
    interior = (slice(4, -4), slice(4, -4))
    torch.testing.assert_close(ours.data[interior], warped.data[interior], atol=2e-4, rtol=0)


def test_apply_missing_transform_is_one_line(files, tmp_path, capsys):
    argv = ["apply", tmp_path / "none.h5", files["ml"], "-r", files["fixed"], "-o", tmp_path / "x.nii.gz"]
    assert run_cli(argv) == 1
    _one_error_line(capsys, "no such file")


def test_invert_result_dir_matches_inverse_displacement(result_dir, tmp_path):
    out = tmp_path / "inverse.nii.gz"
    assert run_cli(["invert", result_dir, "-o", out]) == 0
    ours = nib.load(out).get_fdata()
    written = nib.load(result_dir / "inverse_displacement.nii.gz").get_fdata()
    np.testing.assert_allclose(ours, written, atol=1e-6)


def test_invert_lone_transform_needs_a_reference(files, result_dir, tmp_path, capsys):
    lone = tmp_path / "transform.json"
    shutil.copy(result_dir / "transform.json", lone)
    assert run_cli(["invert", lone, "-o", tmp_path / "inverse.nii.gz"]) == 1
    _one_error_line(capsys, "--reference")
    assert run_cli(["invert", lone, "-o", tmp_path / "inverse.nii.gz", "-r", files["moving"]]) == 0
    assert nib.load(tmp_path / "inverse.nii.gz").shape == (34, 34, 1, 1, 2)


def test_jacobian_matches_the_result(result_dir, tmp_path):
    out = tmp_path / "det.nii.gz"
    assert run_cli(["jacobian", result_dir / "transform.json", "-o", out]) == 0
    torch.testing.assert_close(read_image(out).data, read_image(result_dir / "jacobian.nii.gz").data)


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
    _one_error_line(capsys, "--fixed-id")

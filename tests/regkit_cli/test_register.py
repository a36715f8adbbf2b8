"""``regkit register`` on a tiny 2D pair (the fixtures of conftest.py): outputs, what it prints, exit codes, one-line
errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import regkit.registration
from regkit.results import OUTPUT_FILES
from regkit_cli.main import INTERRUPTED
from tests.helpers import assert_one_error_line, run_cli


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
    assert f"configuration: {files['config']}\n" in stdout


def test_register_names_the_default_configuration(files, tmp_path, capsys, monkeypatch):
    from regkit.config import DEFAULT_PRESETS

    monkeypatch.setitem(DEFAULT_PRESETS, 2, str(files["config"]))  # the tiny configuration stands in for the default
    assert run_cli(["register", files["fixed"], files["moving"], "-o", tmp_path / "out"]) == 0
    stdout = capsys.readouterr().out
    assert f"configuration: {files['config']} (the default for 2D images; --config chooses another)" in stdout


def test_register_quiet_prints_nothing(files, tmp_path, capsys):
    argv = ["register", files["fixed"], files["moving"], "-o", tmp_path / "out", "-c", files["config"], "--quiet"]
    assert run_cli(argv) == 0
    assert capsys.readouterr() == ("", "")


def test_register_through_python_m(files, tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "regkit_cli", "register", files["fixed"], files["moving"], "-o", out]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one torch thread, as tests/conftest.py sets in this process
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
    assert_one_error_line(capsys, message)
    assert os.listdir(tmp_path) == (["out"] if case == "existing_output" else [])


def test_ctrl_c_leaves_nothing_and_exits_130(files, tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(regkit.registration, "register", interrupted)
    assert run_cli(["register", files["fixed"], files["moving"], "-o", tmp_path / "out", "-c", files["config"]]) == 130
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.strip()] == [INTERRUPTED]
    assert os.listdir(tmp_path) == []


def test_gpu_out_of_memory_is_one_line(files, tmp_path, capsys, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(regkit.registration, "register", out_of_memory)
    assert run_cli(["register", files["fixed"], files["moving"], "-o", tmp_path / "out", "-c", files["config"]]) == 1
    assert_one_error_line(capsys, "smaller tessellation")


def test_a_result_that_fails_its_checks_is_kept_and_exits_3(files, tmp_path, capsys, monkeypatch):
    import regkit.results.metrics

    def folds(*args, **kwargs):
        return ["the transformation folds: analytic Jacobian determinant down to -0.2"]

    monkeypatch.setattr(regkit.results.metrics, "failed_checks", folds)
    out = tmp_path / "out"
    assert run_cli(["register", files["fixed"], files["moving"], "-o", out, "-c", files["config"], "--quiet"]) == 3
    assert_one_error_line(capsys, "the result failed its checks (the transformation folds")
    assert json.loads((out / "metrics.json").read_text())["failed_checks"] == folds()

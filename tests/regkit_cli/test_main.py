"""What every ``regkit`` command shares: it starts without the benchmarks (they live in the checkout's ``benchmarks``
package, not in the CLI), images of the wrong dimension, Ctrl-C and unforeseen errors are one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from regkit_cli.main import INTERRUPTED, UNEXPECTED
from tests.helpers import assert_one_error_line, run_cli


def test_regkit_imports_no_benchmark_code() -> None:
    code = "import regkit_cli.main, sys; "
    code += "print(sorted(m for m in sys.modules if m.startswith('benchmarks') or '.bench' in m))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("command", "files_used"),
    [
        (["apply", "{result}/transform.json", "{volume}", "-r", "{fixed}", "-o", "{out}.nii.gz"], "the image"),
        (["apply", "{result}/transform.json", "{moving}", "-r", "{volume}", "-o", "{out}.nii.gz"], "the reference"),
        (["invert", "{result}", "-r", "{volume}", "-o", "{out}.nii.gz"], "the reference"),
        (["export", "{result}", "-r", "{volume}", "-o", "{out}.nii.gz"], "the reference"),
    ],
)
def test_an_image_of_another_dimension_than_the_transformation_is_one_line(
    files, result_dir, tmp_path, capsys, command, files_used
):
    names = {"result": result_dir, "out": tmp_path / "out", **files}
    assert run_cli([part.format(**names) for part in command]) == 1
    assert_one_error_line(capsys, f"{files['volume']}: the image is 3D but the transformation in {result_dir}")
    assert os.listdir(tmp_path) == []


def test_ctrl_c_in_any_command_is_one_line_and_exit_130(files, capsys, monkeypatch):
    import regkit.io

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(regkit.io, "describe_image", interrupted)
    assert run_cli(["info", files["fixed"]]) == 130
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [INTERRUPTED]


def test_an_unforeseen_error_is_one_line_with_its_type(files, capsys, monkeypatch):
    import regkit.io

    def broken(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(regkit.io, "describe_image", broken)
    assert run_cli(["info", files["fixed"]]) == 1
    assert_one_error_line(capsys, f"RecursionError: maximum recursion depth exceeded ({UNEXPECTED})")
    with pytest.raises(RecursionError):  # --debug: the traceback
        run_cli(["--debug", "info", files["fixed"]])

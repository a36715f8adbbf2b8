"""Never lose data: every command that writes ``-o`` refuses an existing output unless ``--overwrite``, never writes
over one of its inputs (even with ``--overwrite``), and ``register --overwrite`` replaces only a folder that regkit
wrote; an output that cannot be written is found before any work. On the registration of conftest.py."""

from __future__ import annotations

import os
import shutil

import pytest

import regkit.registration
from tests.helpers import assert_one_error_line, run_cli

COMMANDS = ["apply", "invert", "jacobian", "export"]


def _argv(command: str, files, result_dir, output) -> list[object]:
    """``regkit COMMAND`` writing ``output`` from the registration in ``result_dir``."""
    if command == "apply":
        return ["apply", result_dir / "transform.json", files["moving"], "-r", files["fixed"], "-o", output]
    return [command, result_dir, "-o", output]


@pytest.mark.parametrize("command", COMMANDS)
def test_an_existing_output_is_refused_unless_overwrite(command, files, result_dir, tmp_path, capsys):
    output = tmp_path / "out.nii.gz"
    output.write_text("precious")
    assert run_cli(_argv(command, files, result_dir, output)) == 1
    assert_one_error_line(capsys, f"output file {output} exists; use --overwrite")
    assert output.read_text() == "precious"
    assert run_cli([*_argv(command, files, result_dir, output), "--overwrite"]) == 0
    assert output.stat().st_size > len("precious")
    assert sorted(os.listdir(tmp_path)) == ["out.nii.gz"]  # no temporary left


def test_export_into_a_folder_refuses_an_existing_file(result_dir, tmp_path, capsys):
    argv = ["export", result_dir, "-o", tmp_path, "--fixed-id", "1", "--moving-id", "2"]
    (tmp_path / "disp_0001_0002.nii.gz").write_text("precious")
    assert run_cli(argv) == 1
    assert_one_error_line(capsys, "disp_0001_0002.nii.gz exists; use --overwrite")
    assert run_cli([*argv, "--overwrite"]) == 0


@pytest.mark.parametrize("how", ["same path", "relative path", "symlink"])
def test_apply_never_writes_over_its_input(how, files, result_dir, tmp_path, capsys, monkeypatch):
    moving = tmp_path / "moving.nii.gz"
    shutil.copy(files["moving"], moving)
    before = moving.read_bytes()
    output: object = moving
    if how == "relative path":
        (tmp_path / "sub").mkdir()
        monkeypatch.chdir(tmp_path / "sub")
        output = "../moving.nii.gz"
    elif how == "symlink":
        output = tmp_path / "link.nii.gz"
        (tmp_path / "link.nii.gz").symlink_to(moving)
    argv = ["apply", result_dir / "transform.json", moving, "-r", files["fixed"], "-o", output, "--overwrite"]
    assert run_cli(argv) == 1
    assert_one_error_line(capsys, f"output {output} is the input {moving}")
    assert moving.read_bytes() == before


@pytest.mark.parametrize("command", ["invert", "jacobian", "export"])
def test_commands_reading_a_result_folder_never_write_over_it(command, result_dir, tmp_path, capsys):
    source = tmp_path / "result"
    shutil.copytree(result_dir, source)
    before = (source / "metrics.json").read_bytes()
    output = source / "metrics.json" if command == "invert" else source / "transform.json"
    if command == "export":  # a Learn2Reg file is .nii.gz: write over the given reference instead
        output = source / "warped.nii.gz"
        argv = [command, source, "-o", output, "-r", output, "--overwrite"]
    else:
        argv = [command, source, "-o", output, "--overwrite"]
    assert run_cli(argv) == 1
    assert_one_error_line(capsys, "is the input")
    assert (source / "metrics.json").read_bytes() == before


@pytest.fixture
def no_registration(monkeypatch):
    """``regkit register`` fails the test if it gets as far as registering."""

    def register(*args, **kwargs):
        raise AssertionError("registered before checking the output")

    monkeypatch.setattr(regkit.registration, "register", register)


def test_register_overwrite_refuses_a_folder_with_foreign_files_and_keeps_them(
    files, result_dir, tmp_path, capsys, no_registration
):
    out = tmp_path / "out"
    shutil.copytree(result_dir, out)
    (out / "notes.txt").write_text("precious")
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    argv = ["register", files["fixed"], files["moving"], "-o", out, "-c", files["config"], "--overwrite"]
    assert run_cli(argv) == 1
    assert_one_error_line(capsys, "holds files that regkit did not write (notes.txt)")
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before


def test_register_overwrite_replaces_a_folder_that_regkit_wrote(files, result_dir, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(result_dir, out)
    argv = ["register", files["fixed"], files["moving"], "-o", out, "-c", files["config"], "--quiet", "--overwrite"]
    assert run_cli(argv) == 0
    assert "warped_labels.nii.gz" not in os.listdir(out)  # the earlier output, with labels, was replaced whole
    assert os.listdir(tmp_path) == ["out"]


def test_register_overwrite_never_replaces_a_folder_holding_its_input(
    files, result_dir, tmp_path, capsys, no_registration
):
    out = tmp_path / "out"
    shutil.copytree(result_dir, out)
    moving = out / "warped.nii.gz"  # an earlier result registered again, into its own folder
    argv = ["register", files["fixed"], moving, "-o", out, "-c", files["config"], "--overwrite"]
    assert run_cli(argv) == 1
    assert_one_error_line(capsys, "warped.nii.gz")
    assert moving.is_file()


def test_register_finds_an_output_it_cannot_write_before_registering(files, tmp_path, capsys, no_registration):
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = ["register", files["fixed"], files["moving"], "-o", blocker / "out", "-c", files["config"]]
    assert run_cli(argv) == 1
    assert_one_error_line(capsys, f"cannot write the output {blocker / 'out'}: {blocker} is not a folder")


def test_register_finds_an_unwritable_folder_before_registering(files, tmp_path, capsys, no_registration, monkeypatch):
    real_access = os.access
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: os.fspath(path) != str(locked) and real_access(path, mode))
    argv = ["register", files["fixed"], files["moving"], "-o", locked / "a" / "out", "-c", files["config"]]
    assert run_cli(argv) == 1
    assert_one_error_line(capsys, f"no permission to write in {locked}")


@pytest.mark.parametrize("writer", ["write_png", "write_image"])
def test_a_full_disk_while_writing_the_outputs_is_one_line_and_leaves_nothing(
    writer, files, tmp_path, capsys, monkeypatch
):
    """The disk fills while the result folder is written (qc.png, or an image written by a thread): one line naming
    the error, exit 1, and neither the folder nor its staging folder is left."""
    import errno

    import regkit.results.folder

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(args[-1]))

    monkeypatch.setattr(regkit.results.folder, writer, full)
    out = tmp_path / "out"
    assert run_cli(["register", files["fixed"], files["moving"], "-o", out, "-c", files["config"], "-q"]) == 1
    assert_one_error_line(capsys, "No space left on device")
    assert os.listdir(tmp_path) == []

"""regkit.results.folder: the files of a registration (which ones, affine.mat against SimpleITK, their contents), and
written atomically.

The tests read the output folders of the ``registration_case`` fixture (tests/regkit/conftest.py). The conventions of
the displacement, transform.h5 and Learn2Reg files are tested with their writers (tests/regkit/io/test_transforms.py),
transform.json and the inverse with :class:`~regkit.transform.Transformation` (tests/regkit/test_transform.py).
"""

from __future__ import annotations

import json
import os
import socket

import numpy as np
import pytest
import SimpleITK as sitk
import torch

import regkit.results.folder as folder
from regkit.errors import ImageDimensionError, RegkitError
from regkit.io import Image, read_image
from regkit.results import OUTPUT_FILES, OutputExistsError, check_output_dir, check_output_file, write_outputs
from regkit.spatial.grid import Grid
from tests.helpers import registration_config, same_grid
from tests.regkit.test_atomic import dead_pid

ALL_FILES = set(OUTPUT_FILES.values())


# ----------------------------------------------------------------------------------------------------------------------
# The folder


def test_exactly_the_named_files(registration_case):
    _, _, out = registration_case
    assert set(os.listdir(out)) == ALL_FILES
    assert os.listdir(out.parent) == ["out"]  # no temporary folder left beside it


def test_optional_outputs_follow_the_flags(registration_case, tmp_path):
    result, _, _ = registration_case
    flags = {k: False for k in ("warped", "displacement", "inverse_displacement", "jacobian", "transform_h5", "qc_png")}
    result = type(result)(**{**result.__dict__, "config": registration_config(result.fixed.ndim, **flags)})
    written = write_outputs(result, tmp_path / "out")
    mandatory = {"affine", "transform", "metrics", "config", "record"}
    assert set(written) == mandatory
    assert set(os.listdir(tmp_path / "out")) == {OUTPUT_FILES[k] for k in mandatory}


# ----------------------------------------------------------------------------------------------------------------------
# affine.mat, against SimpleITK


def test_affine_mat_is_the_linear_part(registration_case):
    result, _, out = registration_case
    affine = sitk.ReadTransform(str(out / "affine.mat"))
    point = np.asarray(result.fixed.grid.origin) + 3.0
    m = result.transform.matrix
    n = result.fixed.ndim
    np.testing.assert_allclose(affine.TransformPoint(point.tolist()), m[:n, :n] @ point + m[:n, n], atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# Contents


def test_labels_keep_their_label_set_and_type(registration_case):
    _, labels, out = registration_case
    warped = read_image(out / "warped_labels.nii.gz")
    assert warped.data.dtype == torch.int16
    assert set(torch.unique(warped.data).tolist()) <= set(torch.unique(labels["moving"].data).tolist()) | {0}


def test_warped_is_float_on_the_fixed_grid(registration_case):
    result, _, out = registration_case
    warped = read_image(out / "warped.nii.gz")
    assert same_grid(warped.grid, result.fixed.grid) and warped.data.dtype == torch.float32


# ----------------------------------------------------------------------------------------------------------------------
# Atomicity


def test_existing_folder_is_refused_then_replaced_with_overwrite(registration_case, tmp_path):
    result, _, _ = registration_case
    out = tmp_path / "out"
    out.mkdir()
    (out / "transform.json").write_text("old")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        write_outputs(result, out)
    assert os.listdir(out) == ["transform.json"]
    write_outputs(result, out, overwrite=True)
    assert (out / "transform.json").read_text() != "old"
    assert sorted(os.listdir(out)) == sorted(ALL_FILES - {"warped_labels.nii.gz"})
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_overwrite_never_replaces_a_folder_of_other_files(registration_case, tmp_path):
    result, _, _ = registration_case
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(OutputExistsError, match="not a regkit output folder"):
        write_outputs(result, tmp_path, overwrite=True)
    assert os.listdir(tmp_path) == ["notes.txt"]


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_failure_midway_leaves_nothing(registration_case, tmp_path, monkeypatch, error):
    result, labels, _ = registration_case

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(folder, "write_transform_h5", fail)
    with pytest.raises(type(error)):
        write_outputs(result, tmp_path / "out", moving_labels=labels["moving"])
    assert os.listdir(tmp_path) == []


def test_failure_with_overwrite_keeps_the_old_folder(registration_case, tmp_path, monkeypatch):
    result, _, _ = registration_case
    out = tmp_path / "out"
    out.mkdir()
    (out / "transform.json").write_text("old")

    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(folder, "write_png", fail)
    with pytest.raises(RuntimeError):
        write_outputs(result, out, overwrite=True)
    assert os.listdir(tmp_path) == ["out"] and os.listdir(out) == ["transform.json"]


# ----------------------------------------------------------------------------------------------------------------------
# Never lose data: --overwrite replaces only what regkit wrote, never an input; writability is checked first


def test_the_record_names_what_regkit_wrote(registration_case):
    _, _, out = registration_case
    record = json.loads((out / OUTPUT_FILES["record"]).read_text())
    assert set(record["files"]) == ALL_FILES - {OUTPUT_FILES["record"]}


def test_overwrite_replaces_a_folder_that_regkit_wrote(registration_case, tmp_path):
    result, labels, _ = registration_case
    out = tmp_path / "out"
    write_outputs(result, out, moving_labels=labels["moving"])
    assert "warped_labels.nii.gz" in os.listdir(out)
    write_outputs(result, out, overwrite=True)  # without labels now: the old warped_labels.nii.gz goes
    assert set(os.listdir(out)) == ALL_FILES - {"warped_labels.nii.gz"}
    assert os.listdir(tmp_path) == ["out"]  # no temporary or old folder left


def test_overwrite_refuses_a_regkit_folder_with_foreign_files_and_keeps_them(registration_case, tmp_path):
    result, _, _ = registration_case
    out = tmp_path / "out"
    write_outputs(result, out)
    for name in ("notes.txt", "a.txt", "b.txt", "c.txt"):
        (out / name).write_text("precious")
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    with pytest.raises(OutputExistsError, match=r"did not write \(a\.txt, b\.txt, c\.txt and 1 more\)"):
        write_outputs(result, out, overwrite=True)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before


def test_a_foreign_file_that_appears_while_writing_keeps_the_old_folder(registration_case, tmp_path, monkeypatch):
    result, _, _ = registration_case
    out = tmp_path / "out"
    write_outputs(result, out)
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    write_png = folder.write_png

    def drop_a_note(*args, **kwargs):
        (out / "notes.txt").write_text("precious")
        return write_png(*args, **kwargs)

    monkeypatch.setattr(folder, "write_png", drop_a_note)
    with pytest.raises(OutputExistsError, match=r"now holds files that regkit did not write \(notes\.txt\)"):
        write_outputs(result, out, overwrite=True)
    before["notes.txt"] = b"precious"
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert os.listdir(tmp_path) == ["out"]


def test_overwrite_never_replaces_a_folder_holding_an_input(registration_case, tmp_path):
    result, _, _ = registration_case
    out = tmp_path / "out"
    write_outputs(result, out)
    (tmp_path / "link").symlink_to(out)
    with pytest.raises(OutputExistsError, match="holds the input"):
        write_outputs(result, out, overwrite=True, inputs=[None, tmp_path / "link" / "warped.nii.gz"])
    assert (out / "warped.nii.gz").is_file()


def test_an_output_folder_that_is_a_symlink_is_replaced_not_followed(registration_case, tmp_path):
    result, _, _ = registration_case
    target = tmp_path / "target"
    write_outputs(result, target)
    before = {name: (target / name).read_bytes() for name in os.listdir(target)}
    (tmp_path / "out").symlink_to(target)
    write_outputs(result, tmp_path / "out", overwrite=True)
    assert not (tmp_path / "out").is_symlink() and set(os.listdir(tmp_path / "out")) == ALL_FILES - {
        "warped_labels.nii.gz"
    }
    assert {name: (target / name).read_bytes() for name in os.listdir(target)} == before


def test_an_output_folder_that_cannot_be_created_is_found_first(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(RegkitError, match="is not a folder"):
        check_output_dir(tmp_path / "file" / "out")
    with pytest.raises(RegkitError, match="exists and is not a folder"):
        check_output_dir(tmp_path / "file", overwrite=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unwritable_output_folder_is_found_first(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(RegkitError, match="no permission to write in"):
            check_output_dir(locked / "a" / "out")
        with pytest.raises(RegkitError, match="no permission to write in"):
            check_output_file(locked / "out.nii.gz")
    finally:
        locked.chmod(0o700)


def test_an_output_file_is_refused_if_it_exists_or_is_an_input(tmp_path, monkeypatch):
    image = tmp_path / "image.nii.gz"
    image.write_text("input")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link.nii.gz").symlink_to(image)
    os.link(image, tmp_path / "hard.nii.gz")
    for output in ("image.nii.gz", "./sub/../image.nii.gz", "link.nii.gz", "hard.nii.gz"):
        with pytest.raises(OutputExistsError, match="is the input"):
            check_output_file(output, overwrite=True, inputs=[None, image])
    (tmp_path / "sub").mkdir()
    with pytest.raises(OutputExistsError, match="exists; use --overwrite"):
        check_output_file("link.nii.gz")
    (tmp_path / "dangling.nii.gz").symlink_to(tmp_path / "nowhere")
    with pytest.raises(OutputExistsError, match="exists; use --overwrite"):
        check_output_file("dangling.nii.gz")
    assert check_output_file("link.nii.gz", overwrite=True) == tmp_path / "link.nii.gz"
    with pytest.raises(RegkitError, match="is a folder"):
        check_output_file("sub", overwrite=True)
    with pytest.raises(RegkitError, match="does not exist"):
        check_output_file("none/out.nii.gz")
    assert image.read_text() == "input"


# ----------------------------------------------------------------------------------------------------------------------
# Label maps


def test_label_map_of_another_dimension_is_refused(registration_case, tmp_path):
    result, _, _ = registration_case
    other = Image(
        torch.zeros((4,) * (5 - result.fixed.ndim), dtype=torch.int16), Grid.create((4,) * (5 - result.fixed.ndim))
    )
    with pytest.raises(ImageDimensionError, match="moving labels"):
        write_outputs(result, tmp_path / "out", moving_labels=other)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------------------------------------------------
# Concurrent writers, the job record, leftovers of killed writers


def test_of_two_writers_of_one_folder_the_later_fails_without_overwrite(registration_case, tmp_path, monkeypatch):
    result, _, _ = registration_case
    out = tmp_path / "out"
    dump_config = folder.dump_config

    def another_run_finishes_first(overwrite: bool) -> None:
        def write(*args, **kwargs):
            monkeypatch.setattr(folder, "dump_config", dump_config)
            write_outputs(result, out, overwrite=overwrite, job={"name": "first"})  # it passed check_output_dir too
            return dump_config(*args, **kwargs)

        monkeypatch.setattr(folder, "dump_config", write)

    another_run_finishes_first(False)
    with pytest.raises(OutputExistsError, match=r"output folder .*out appeared while regkit wrote it"):
        write_outputs(result, out, job={"name": "late"})
    assert folder.read_job_record(out) == {"name": "first"}  # the first one's output, untouched
    assert os.listdir(tmp_path) == ["out"]
    another_run_finishes_first(True)
    write_outputs(result, out, overwrite=True, job={"name": "late"})  # replaces the first one's, in turn
    assert folder.read_job_record(out) == {"name": "late"} and os.listdir(tmp_path) == ["out"]


def test_the_job_record_says_which_work_a_folder_completes(registration_case, tmp_path):
    result, _, out = registration_case
    assert folder.read_job_record(out) is None  # written without one
    job = {"name": "b_to_a", "config_hash": "abc", "inputs": "[]"}
    write_outputs(result, tmp_path / "out", job=job)
    assert folder.read_job_record(tmp_path / "out") == job
    assert json.loads((tmp_path / "out" / OUTPUT_FILES["record"]).read_text())["job"] == job
    (tmp_path / "out" / "transform.json").unlink()
    assert folder.read_job_record(tmp_path / "out") is None  # not complete
    assert folder.read_job_record(tmp_path / "missing") is None


def test_the_next_writer_cleans_up_what_killed_writers_left(registration_case, tmp_path):
    result, _, _ = registration_case
    host, dead = socket.gethostname(), dead_pid()
    out, aside = tmp_path / "out", tmp_path / f".out.old-{dead}@{host}-abcdefgh"
    write_outputs(result, out, job={"name": "old"})
    aside.mkdir()  # a writer killed between moving "out" aside and renaming its new folder into place
    os.rename(out, aside / "out")
    (tmp_path / f"out.tmp-{dead}@{host}-abcdefgh").mkdir()  # its temporary folder
    live = tmp_path / f"out.tmp-{os.getpid()}@{host}-abcdefgh"  # a writer still at work
    live.mkdir()
    folder.remove_leftovers([out])
    assert folder.read_job_record(out) == {"name": "old"}  # put back: the replacement never arrived
    assert sorted(os.listdir(tmp_path)) == sorted(["out", live.name])

    aside.mkdir()  # a writer killed after its new folder was in place, before it deleted the old one
    write_outputs(result, aside / "out")
    (aside / "out" / "notes.txt").write_text("precious")
    with pytest.warns(UserWarning, match=r"files that regkit did not write were kept in .*\.out\.old-"):
        write_outputs(result, out, overwrite=True)  # the next writer of "out" cleans up first
    assert os.listdir(aside / "out") == ["notes.txt"]  # regkit's files deleted, the user's kept
    assert sorted(os.listdir(tmp_path)) == sorted(["out", live.name, aside.name])

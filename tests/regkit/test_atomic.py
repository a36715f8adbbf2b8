"""One way to replace a file: the old file or the new one, never a part, no temporary file left behind, and never
through a planted symlink."""

import os
import stat
from pathlib import Path

import pytest

from regkit import _atomic


def test_the_temporary_file_sits_beside_the_target_with_its_suffixes(tmp_path: Path):
    target = tmp_path / "displacement.nii.gz"
    with _atomic.replacing(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".displacement.tmp-") and tmp.name.endswith(".nii.gz")
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["displacement.nii.gz"]


def test_an_error_leaves_the_old_file_and_no_temporary(tmp_path: Path):
    target = _atomic.write_text(tmp_path / "summary.csv", "old\n")
    with pytest.raises(RuntimeError), _atomic.replacing(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.csv"]


def test_two_writes_in_one_process_use_different_temporaries(tmp_path: Path):
    with _atomic.replacing(tmp_path / "a.json") as first, _atomic.replacing(tmp_path / "a.json") as second:
        assert first != second
        first.write_text("1")
        second.write_text("2")
    assert (tmp_path / "a.json").read_text() in ("1", "2")


def test_the_temporary_is_a_new_file_of_our_own_never_a_planted_symlink(tmp_path: Path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    target = tmp_path / "out.json"
    for n in range(50):  # every name the predictable scheme of earlier versions would have taken
        (tmp_path / f".out.tmp-{os.getpid()}-{n}.json").symlink_to(victim)
    with _atomic.replacing(target) as tmp:
        assert not tmp.is_symlink() and tmp.stat().st_size == 0 and tmp.stat().st_uid == os.getuid()
        tmp.write_text("new")
    assert victim.read_text() == "precious" and target.read_text() == "new"


def test_a_symlink_at_the_target_is_replaced_not_written_through(tmp_path: Path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "out.txt").symlink_to(victim)
    _atomic.write_text(tmp_path / "out.txt", "new")
    assert not (tmp_path / "out.txt").is_symlink() and (tmp_path / "out.txt").read_text() == "new"
    assert victim.read_text() == "precious"


def test_files_and_folders_get_the_permissions_of_the_umask(tmp_path: Path):
    umask = os.umask(0o027)
    os.umask(umask)
    target = _atomic.write_text(tmp_path / "a.txt", "x")
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    with _atomic.staging(tmp_path, ".stage-") as folder:
        assert folder.name.startswith(".stage-") and stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~umask
        (folder / "file").write_text("x")
    assert not folder.exists()

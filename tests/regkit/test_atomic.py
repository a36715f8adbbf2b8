"""One way to replace a file: the old file or the new one, never a part, and no temporary file left behind."""

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

"""One way to replace a file: the old file or the new one, never a part, no temporary file left behind, and never
through a planted symlink."""

import os
import socket
import stat
import subprocess
import sys
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


def dead_pid() -> int:
    """The id of a process of this host that has ended."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    return int(done.stdout)


def test_temporaries_name_their_process_and_the_next_writer_removes_those_of_gone_ones(tmp_path: Path):
    host = socket.gethostname()
    with _atomic.replacing(tmp_path / "a.json") as tmp:
        assert tmp.name.startswith(f".a.tmp-{os.getpid()}@{host}-") and tmp.name.endswith(".json")
    dead, live = dead_pid(), os.getpid()
    gone = tmp_path / f".a.tmp-{dead}@{host}-abcdefgh.json"  # left by a writer killed on this host
    kept = [tmp_path / f".a.tmp-{live}@{host}-abcdefgh.json", tmp_path / f".a.tmp-{dead}@other-host-abcdefgh.json"]
    for path in (gone, *kept):
        path.write_text("partial")
    stage_gone, stage_kept = tmp_path / f"s.tmp-{dead}@{host}-abcdefgh", tmp_path / f"s.tmp-{live}@{host}-abcdefgh"
    for folder in (stage_gone, stage_kept):
        folder.mkdir()
        (folder / "file").write_text("partial")
    assert _atomic.leftovers(tmp_path) == [(".a.tmp-", gone), ("s.tmp-", stage_gone)]
    _atomic.write_text(tmp_path / "a.json", "new")
    with _atomic.staging(tmp_path, "s.tmp-"):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a.json", stage_kept.name, *(p.name for p in kept)])


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="Linux reads the umask from /proc")
def test_the_umask_is_read_without_setting_it(tmp_path: Path, monkeypatch):
    umask = os.umask(0o027)
    os.umask(umask)

    def no_umask(mask: int) -> int:
        raise AssertionError("os.umask changes the umask of every thread")

    monkeypatch.setattr(os, "umask", no_umask)
    target = _atomic.write_text(tmp_path / "a.txt", "x")
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask


@pytest.mark.skipif(sys.platform == "win32", reason="flock is a POSIX call")
def test_a_folder_lock_is_held_on_the_folder_itself(tmp_path: Path):
    import fcntl

    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        with _atomic.folder_lock(tmp_path):
            with pytest.raises(BlockingIOError):  # another open file description: another writer waits
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released at the end of the block
    finally:
        os.close(fd)
    assert list(tmp_path.iterdir()) == []  # no lock file

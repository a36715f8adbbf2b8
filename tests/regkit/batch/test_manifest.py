"""``regkit.batch.manifest``: the manifest (rollback journal, another path, older WAL manifests, readers while a run
writes or after a killed write, a file that is not a manifest) and the lock (a second run refused, the fallback
without flock)."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from regkit.batch import MANIFEST, BatchLockedError, Manifest, ManifestError, load_spec, lock_output_root, run_batch
from regkit.errors import ConfigError
from tests.regkit.batch.batch_cases import LIST_SPEC, make_data, write_spec


def test_second_run_on_the_same_root_is_refused(tmp_path):
    make_data(tmp_path)
    plan = load_spec(write_spec(tmp_path, LIST_SPEC))
    with lock_output_root(plan.root) as lock:
        code = f"from regkit.batch import *; run_batch(load_spec({str(plan.spec_path)!r}))"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and "BatchLockedError" in done.stderr and str(lock) in done.stderr
        with pytest.raises(BatchLockedError, match=r"\.batch\.lock is held by pid"):
            with lock_output_root(plan.root):  # a second open file description in this process is refused too
                pass
    assert not Manifest.read_only(plan.manifest)


def journal_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("manifest.sqlite-"))


def is_wal(path: Path) -> bool:
    """The file format versions of the SQLite header (bytes 18, 19): 2 in WAL mode, 1 with a rollback journal."""
    return path.read_bytes()[18:20] == b"\x02\x02"


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_manifest_has_a_rollback_journal_and_may_live_elsewhere(tmp_path):
    make_data(tmp_path)
    plan = load_spec(write_spec(tmp_path, LIST_SPEC))
    run_batch(plan)
    assert plan.manifest == tmp_path / "out" / MANIFEST and not is_wal(plan.manifest)
    assert journal_files(tmp_path / "out") == []  # no -wal, -shm or -journal left

    spec = write_spec(tmp_path, LIST_SPEC.replace("output: out", "output: out2\nmanifest: local/study.sqlite"))
    plan = load_spec(spec)
    assert plan.manifest == tmp_path / "local" / "study.sqlite"
    assert [o.state for o in run_batch(plan).outcomes] == ["done", "done"]
    assert sorted(Manifest.read_only(plan.manifest)) == ["b_to_a", "c_to_a"]
    assert not (tmp_path / "out2" / MANIFEST).exists() and (tmp_path / "out2" / "summary.csv").is_file()
    assert load_spec(spec, manifest=tmp_path / "other.sqlite").manifest == tmp_path / "other.sqlite"
    (tmp_path / "local" / "folder.sqlite").mkdir()
    with pytest.raises(ConfigError, match=r"batch.yaml:3: manifest: the manifest .*folder.sqlite is a folder"):
        load_spec(write_spec(tmp_path, LIST_SPEC.replace("output: out", "output: out\nmanifest: local/folder.sqlite")))


_OLDER_RUN = """
import os, sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("PRAGMA journal_mode=WAL")  # as regkit wrote its manifests before
con.execute("PRAGMA wal_autocheckpoint=0")
con.execute("UPDATE jobs SET worker = 'older run' WHERE name = 'b_to_a'")
os._exit(0)  # killed: the update lives in the -wal file only
"""


def test_manifest_of_an_older_run_in_wal_mode_opens(tmp_path):
    make_data(tmp_path)
    plan = load_spec(write_spec(tmp_path, LIST_SPEC))
    run_batch(plan)
    subprocess.run([sys.executable, "-c", _OLDER_RUN, str(plan.manifest)], check=True, timeout=60)
    assert is_wal(plan.manifest) and journal_files(tmp_path / "out") == ["manifest.sqlite-shm", "manifest.sqlite-wal"]
    before = listing(tmp_path)
    assert Manifest.read_only(plan.manifest)["b_to_a"]["worker"] == "older run"  # read from a copy
    assert listing(tmp_path) == before  # nothing written
    assert [o.state for o in run_batch(plan).outcomes] == ["skipped", "skipped"]  # converted by the run's writes
    assert not is_wal(plan.manifest) and journal_files(tmp_path / "out") == []
    assert Manifest.read_only(plan.manifest)["b_to_a"]["worker"] == "older run"


_KILLED_WRITE = """
import os, sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("PRAGMA cache_size=1")  # the pages spill into the file before the commit
con.execute("BEGIN IMMEDIATE")
con.execute("UPDATE jobs SET state = 'failed'")
con.executemany("INSERT INTO jobs (name, state, inputs, config_hash) VALUES (?, 'x', ?, '')",
                [(f"x{i}", "y" * 500) for i in range(2000)])
os._exit(0)  # killed in the middle of the transaction: a hot journal is left
"""


def test_read_only_reads_past_a_journal_left_by_a_killed_write(tmp_path):
    make_data(tmp_path)
    plan = load_spec(write_spec(tmp_path, LIST_SPEC))
    run_batch(plan)
    subprocess.run([sys.executable, "-c", _KILLED_WRITE, str(plan.manifest)], check=True, timeout=60)
    assert journal_files(tmp_path / "out") == ["manifest.sqlite-journal"]
    before = listing(tmp_path)
    rows = Manifest.read_only(plan.manifest)
    assert sorted(rows) == ["b_to_a", "c_to_a"] and {row["state"] for row in rows.values()} == {"done"}
    assert listing(tmp_path) == before  # the journal is still there for the next writer to roll back
    assert {row["state"] for row in Manifest(plan.manifest).rows().values()} == {"done"}
    assert journal_files(tmp_path / "out") == []


def test_a_file_that_is_not_a_manifest_is_a_one_line_error(tmp_path):
    make_data(tmp_path)
    plan = load_spec(write_spec(tmp_path, LIST_SPEC))
    plan.manifest.parent.mkdir()
    plan.manifest.write_bytes(b"this is not a SQLite database, " * 10)
    for read in (Manifest.read_only, lambda path: run_batch(plan)):
        with pytest.raises(ManifestError) as err:
            read(plan.manifest)
        assert str(err.value) == f"{plan.manifest}: not a regkit manifest (file is not a database)"


@pytest.mark.skipif(sys.platform == "win32", reason="flock is a POSIX call")
def test_lock_falls_back_to_a_lock_file_where_the_file_system_has_no_flock(tmp_path, monkeypatch):
    import fcntl

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")  # e.g. Lustre mounted without flock

    monkeypatch.setattr(fcntl, "flock", no_flock)
    holder = f"pid {os.getpid()} on {socket.gethostname()}"
    with lock_output_root(tmp_path) as lock:
        assert lock.read_text().split()[:2] == [str(os.getpid()), socket.gethostname()]  # the lock file's holder
        with pytest.raises(BatchLockedError) as err:
            with lock_output_root(tmp_path):
                pass
        assert str(err.value).startswith(f"{lock} is held by {holder} since ") and "\n" not in str(err.value)
    assert not lock.exists() and not (tmp_path / ".batch.holder").exists()  # removed on release

    lock.write_text("4321\nnode-17\n")  # left by a run on another host that was killed
    (tmp_path / ".batch.holder").write_text("pid 4321 on node-17 since Mon Jan  5 10:00:00 2026\n")
    with pytest.raises(BatchLockedError, match=r"held by pid 4321 on node-17 .*if that process is gone, delete"):
        with lock_output_root(tmp_path):
            pass
    lock.unlink()
    with lock_output_root(tmp_path):
        pass


def test_batches_whose_output_roots_nest_are_refused(tmp_path):
    make_data(tmp_path)
    outer = load_spec(write_spec(tmp_path, LIST_SPEC))  # root out/, job folders out/b_to_a, out/c_to_a
    inner = load_spec(write_spec(tmp_path, LIST_SPEC.replace("output: out", "output: out/b_to_a")))
    (tmp_path / "link").symlink_to(tmp_path / "out")  # the same root by another path
    linked = load_spec(write_spec(tmp_path, LIST_SPEC.replace("output: out", "output: link/b_to_a/deeper")))
    with lock_output_root(inner.root):
        with pytest.raises(BatchLockedError) as err:
            run_batch(outer)  # its job folder out/b_to_a is the other run's root
        assert str(err.value).startswith(f"{inner.root / '.batch.lock'} is held by pid {os.getpid()}")
        assert "which overlaps this batch's" in str(err.value) and "\n" not in str(err.value)
    with lock_output_root(outer.root, [job.out_dir for job in outer.jobs]):
        for plan in (inner, linked):  # inside the other run's root, also through a symbolic link
            with pytest.raises(BatchLockedError, match=r"out/\.batch\.lock is held by pid .* the output root .*/out,"):
                run_batch(plan)
    assert not outer.manifest.exists() and not inner.manifest.exists()
    shutil.rmtree(inner.root)  # the other runs' roots (with their lock files) in a job folder of this one
    assert [o.state for o in run_batch(outer).outcomes] == ["done", "done"]  # alone, it runs

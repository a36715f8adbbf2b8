"""The manifest of a batch (:class:`Manifest`: one SQLite row per job, its state, inputs' fingerprint, configuration
hash, error and timings) and the lock of its output root (:func:`lock_output_root`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sqlite3
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock, Timeout

from regkit import _atomic
from regkit.batch.plan import Job
from regkit.errors import RegkitError

if TYPE_CHECKING:
    from regkit.batch.jobs import JobOutcome

MANIFEST = "manifest.sqlite"
"""The manifest's file name in the output root, unless the spec's ``manifest`` (or ``--manifest``) names another."""
_LOCK = ".batch.lock"
_HOLDER = ".batch.holder"  # who holds the lock, for the message of a refused run

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    inputs TEXT NOT NULL,
    config_hash TEXT NOT NULL,
    error TEXT,
    started REAL,
    finished REAL,
    seconds REAL,
    device TEXT,
    worker TEXT
)
"""


class ManifestError(RegkitError):
    """A manifest that SQLite cannot use: not a regkit manifest, or a file system on which it cannot lock it."""


def _manifest_error(path: Path, err: sqlite3.Error) -> ManifestError:
    """The one-line error of a manifest that SQLite refused: a lock it could not take (or an I/O error), or a file
    that is not a regkit manifest."""
    if isinstance(err, sqlite3.OperationalError):
        return ManifestError(
            f"{path}: {err} (where its file system has no file locks, give the manifest a path on a local disk: "
            "--manifest or the spec's `manifest`)"
        )
    return ManifestError(f"{path}: not a regkit manifest ({err})")


def _is_wal(path: Path) -> bool:
    """Whether the SQLite file at ``path`` is in WAL mode: bytes 18 and 19 of its header, the file format's write and
    read versions, are 2 (1: a rollback journal)."""
    with open(path, "rb") as handle:
        return handle.read(20)[18:20] == b"\x02\x02"


def _select_rows(uri: str) -> dict[str, dict[str, Any]]:
    """Every job's row of the SQLite database at ``uri`` (a ``file:`` URI), by name; empty where the table is not
    created yet (a run that is just starting)."""
    con = sqlite3.connect(uri, timeout=60.0, uri=True)
    try:
        con.row_factory = sqlite3.Row
        if con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'jobs'").fetchone() is None:
            return {}
        return {row["name"]: dict(row) for row in con.execute("SELECT * FROM jobs")}
    finally:
        con.close()


class Manifest:
    """The SQLite manifest of a batch: one row per job.

    Only the process running the batch writes it (it holds the output root's lock; dask workers return their outcomes
    to it). Each write is one short transaction on its own connection, in exclusive locking mode and with a rollback
    journal (``journal_mode=DELETE``): SQLite supports both on network file systems, where WAL mode, whose index lives
    in memory shared by the processes of one host, is not. A manifest in WAL mode, written by an older regkit, is
    converted by its first write (the rows a killed run left in its ``-wal`` file are kept). Where the file system
    has no locks at all, SQLite cannot open it: give the manifest a path on a local disk.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        was_wal = self.path.is_file() and _is_wal(self.path)
        try:
            con = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
        except sqlite3.Error as err:
            raise _manifest_error(self.path, err) from None
        try:
            con.execute("PRAGMA locking_mode=EXCLUSIVE")  # first: a WAL manifest is then read without shared memory
            con.execute("PRAGMA journal_mode=DELETE")
            con.execute(_SCHEMA)
            con.execute("BEGIN IMMEDIATE")
            yield con
            con.execute("COMMIT")
        except BaseException as err:
            if con.in_transaction:
                con.execute("ROLLBACK")
            if isinstance(err, sqlite3.Error):
                raise _manifest_error(self.path, err) from None
            raise
        finally:
            con.close()
        if was_wal:  # converted: the WAL index of a killed run is of no use any more
            self.path.with_name(self.path.name + "-shm").unlink(missing_ok=True)

    def rows(self) -> dict[str, dict[str, Any]]:
        """Every job's row, by name."""
        with self._connect() as con:
            con.row_factory = sqlite3.Row
            return {row["name"]: dict(row) for row in con.execute("SELECT * FROM jobs")}

    @staticmethod
    def read_only(path: Path) -> dict[str, dict[str, Any]]:
        """The rows of the manifest at ``path`` (empty if there is none), also while a run writes it, writing nothing
        beside it: read under a shared lock; or, where SQLite would first have to write (a journal left by a run killed
        while writing, which only a writer may roll back, or a WAL manifest of an older regkit, whose readers create
        ``-wal`` and ``-shm`` files), read from a copy in a temporary folder, where SQLite rolls back or replays it.

        Raises :class:`ManifestError` naming the file if it is not a regkit manifest.
        """
        if not path.is_file():
            return {}
        try:
            if not _is_wal(path):
                try:
                    return _select_rows(f"{path.as_uri()}?mode=ro")
                except sqlite3.OperationalError:  # a journal to roll back first
                    pass
            with tempfile.TemporaryDirectory() as folder:
                for suffix in ("", "-journal", "-wal"):
                    source = path.with_name(path.name + suffix)
                    if source.is_file():
                        shutil.copyfile(source, Path(folder) / source.name)
                return _select_rows((Path(folder) / path.name).as_uri())
        except sqlite3.Error as err:
            raise _manifest_error(path, err) from None

    def start(self, jobs: list[Job], worker: str) -> None:
        """Record ``jobs`` as running from now, handed to ``worker``, with their inputs' fingerprints and
        configuration hashes (what a rerun compares)."""
        now = time.time()
        with self._connect() as con:
            con.executemany(
                "INSERT OR REPLACE INTO jobs (name, state, inputs, config_hash, started, worker) "
                "VALUES (?, 'running', ?, ?, ?, ?)",
                [(job.name, job.fingerprint(), job.config_hash, now, worker) for job in jobs],
            )

    def finish(self, outcome: JobOutcome) -> None:
        """Record the end of a job: ``done`` or ``failed`` with its one-line error, its runtime and device, and
        where and when it started if the outcome knows."""
        with self._connect() as con:
            con.execute(
                "UPDATE jobs SET state = ?, error = ?, finished = ?, seconds = ?, device = ?, "
                "started = COALESCE(?, started), worker = COALESCE(?, worker) WHERE name = ?",
                (
                    outcome.state,
                    outcome.error,
                    time.time(),
                    outcome.seconds,
                    outcome.device,
                    outcome.started,
                    outcome.worker,
                    outcome.name,
                ),
            )

    def record_done(self, found: list[tuple[Job, JobOutcome]]) -> None:
        """Record, in one transaction, jobs found done by their output folders' records (:meth:`Job.recorded`: a run
        was killed after the rename of the folder, before its outcome reached the manifest), with their current
        fingerprints and configuration hashes and the outcomes that the records describe."""
        with self._connect() as con:
            con.executemany(
                "INSERT OR REPLACE INTO jobs (name, state, inputs, config_hash, started, finished, seconds, device, "
                "worker) VALUES (?, 'done', ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        job.name,
                        job.fingerprint(),
                        job.config_hash,
                        outcome.started,
                        None if outcome.started is None else outcome.started + outcome.seconds,
                        outcome.seconds,
                        outcome.device,
                        outcome.worker,
                    )
                    for job, outcome in found
                ],
            )

    def mark_pending(self, jobs: list[Job]) -> None:
        """Insert a pending row for each job the manifest does not hold yet."""
        with self._connect() as con:
            con.executemany(
                "INSERT OR IGNORE INTO jobs (name, state, inputs, config_hash) VALUES (?, 'pending', ?, ?)",
                [(job.name, job.fingerprint(), job.config_hash) for job in jobs],
            )


class BatchLockedError(RegkitError):
    """Another batch run holds the output root's lock."""


def _holder(lock_path: Path) -> str:
    """Who holds the lock ``lock_path``, as its ``.batch.holder`` beside it says."""
    try:
        return (lock_path.parent / _HOLDER).read_text(encoding="utf-8").strip() or "another process"
    except (FileNotFoundError, NotADirectoryError):
        return "another process"


def _locked(lock_path: Path, why: str) -> BatchLockedError:
    """The refusal of a run because another process holds ``lock_path``; ``why``: what that means for this run."""
    return BatchLockedError(
        f"{lock_path} is held by {_holder(lock_path)}: {why}; wait for it to end (if that process is gone, delete "
        f"{lock_path})"
    )


def _acquire(lock: FileLock) -> bool:
    """Take ``lock`` without waiting; whether it was free."""
    try:
        with warnings.catch_warnings():  # filelock warns of the fallback described in lock_output_root
            warnings.filterwarnings("ignore", "flock not supported", UserWarning)
            lock.acquire()
    except Timeout:
        return False
    return True


def _held(lock_path: Path) -> bool:
    """Whether another process holds the existing lock file ``lock_path`` (taken and released at once if free)."""
    lock = FileLock(str(lock_path), timeout=0)
    if _acquire(lock):
        lock.release()
        return False
    return True


def _check_nesting(root: Path, job_dirs: Iterable[Path]) -> None:
    """Refuse a batch when another process holds the ``.batch.lock`` of a folder above ``root`` or of a folder on the
    way from a job folder up to ``root`` (the job folder included), all by real paths (:func:`lock_output_root`)."""
    real_root = Path(os.path.realpath(root))
    folders = set(real_root.parents)
    for out_dir in job_dirs:
        folder = Path(os.path.realpath(out_dir))
        while folder != real_root and folder not in folders:
            folders.add(folder)  # up to the root, or (a job folder that a link leads out of it) the top
            folder = folder.parent
    for folder in sorted(folders):
        lock_path = folder / _LOCK
        if lock_path.is_file() and _held(lock_path):
            raise _locked(
                lock_path,
                f"another regkit batch run uses the output root {folder}, which overlaps this batch's {root} (one "
                "holds job folders of the other)",
            )


@contextlib.contextmanager
def lock_output_root(root: Path, job_dirs: Iterable[Path] = ()) -> Iterator[Path]:
    """Create ``root`` and hold ``root/.batch.lock`` while the block runs; ``root/.batch.holder`` names the holder
    (pid, host, start time).

    The lock is a :class:`filelock.FileLock`: ``flock`` on Linux and macOS, ``msvcrt.locking`` on Windows, released
    by the operating system when the process ends, even killed with ``kill -9``. Where the file system has no file
    locks (``flock`` fails with ENOSYS, e.g. Lustre mounted without ``flock``), filelock falls back to a lock file
    created exclusively (``O_EXCL``) with the holder's pid and host, which it removes on release; a later run on the
    same host takes over the file of a process that is gone, one left by a killed run on another host stays until it
    is deleted.

    Nested batches: once it holds its own lock, a run also refuses to start while another process holds the
    ``.batch.lock`` of a folder above ``root`` or of a folder between ``root`` and one of ``job_dirs`` (the job
    folders included), all by real paths: two runs whose output roots nest would otherwise write the same job
    folders. Each takes its own lock before it looks at the others', so of two that start together at least one
    sees the other.

    Raises :class:`BatchLockedError` naming the lock file and its holder if another process (or another block of this
    one) holds it or the lock of a nested batch.
    """
    root.mkdir(parents=True, exist_ok=True)
    lock_path, holder_path = root / _LOCK, root / _HOLDER
    lock = FileLock(str(lock_path), timeout=0)
    if not _acquire(lock):
        raise _locked(lock_path, "another regkit batch run uses this output root")
    try:
        _check_nesting(root, job_dirs)
        _atomic.write_text(holder_path, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%c')}\n")
        yield lock_path
    finally:
        holder_path.unlink(missing_ok=True)
        lock.release()

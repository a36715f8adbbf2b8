"""Files written atomically: a reader (or a run killed mid-write) sees the old file or the new one, never a part.

Every writer in regkit that replaces one file goes through :func:`replacing`: the content goes into a temporary file
beside the target (same folder, so the final rename is atomic on one file system), created exclusively by
:func:`tempfile.mkstemp` (``O_EXCL``: a name nobody can predict, and never a file or symlink planted there), hidden
(``.NAME.tmp-TAG`` followed by the target's suffixes, so that writers that choose the format by extension,
SimpleITK and nibabel, see the right one) and given the permissions of a file created in the usual way (umask). It is
renamed onto the target only when the writer returned; :func:`os.replace` replaces a symlink at the target, never the
file it points to. On an error it is removed and the target is left as it was. Folders that appear only when complete
(a result folder, a DICOM series, the companion files of an image) are staged in a folder made by :func:`staging`.

Leftovers: every temporary name is ``PREFIX PID@HOST-RANDOM`` (:func:`tagged`; the writer's process id and host,
then the random part), so that what a process killed while writing left behind is recognised and removed by the next
writer of the same target (:func:`leftovers`): only entries of this host whose process is gone, never one of a live
process (a reused process id counts as live) or of another host.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# PREFIX, ending in '-', then PID@HOST- and mkstemp's 8 random characters (a-z, 0-9, _), then any suffixes
_TAGGED = re.compile(r"(?P<prefix>.*-)(?P<pid>\d+)@(?P<host>[^@/]+?)-[a-z0-9_]{8}(\..*)?", re.DOTALL)
# flock errors meaning that the file system cannot lock the folder (NFS, some FUSE and cluster file systems)
_NO_FOLDER_LOCKS = {errno.ENOSYS, errno.ENOLCK, errno.EBADF, errno.EINVAL, errno.EOPNOTSUPP}


def _umask() -> int:
    """This process's umask: from ``/proc/self/status`` on Linux (reading it changes nothing), else by setting it
    and setting it back (the only portable way, briefly process-wide)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def tagged(prefix: str) -> str:
    """``prefix`` followed by ``PID@HOST-`` of this process: the start of the name of every temporary entry regkit
    creates (``prefix`` ends with ``-``), by which :func:`leftovers` recognises one whose process is gone."""
    return f"{prefix}{os.getpid()}@{socket.gethostname()}-"


def _gone(pid: int) -> bool:
    """Whether no process ``pid`` exists on this host (False where that cannot be told, on Windows)."""
    if os.name == "nt":  # os.kill(pid, 0) would send it CTRL_C_EVENT
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # e.g. PermissionError: it exists, another user's
        return False
    return False


def leftovers(parent: str | os.PathLike) -> list[tuple[str, Path]]:
    """The temporary entries in ``parent`` (files or folders named by :func:`tagged`, with any suffixes) left by
    processes of this host that are gone, each with its prefix, sorted by name; empty where ``parent`` cannot be
    listed."""
    host, found = socket.gethostname(), []
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return []
    for name in names:
        match = _TAGGED.fullmatch(name)
        if match is not None and match["host"] == host and _gone(int(match["pid"])):
            found.append((match["prefix"], Path(parent) / name))
    return found


def discard(path: Path) -> None:
    """Remove ``path``: a folder with everything in it (never following a symlink), a file or a link; nothing if it
    is gone already."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _discard_leftovers(parent: str | os.PathLike, prefix: str) -> None:
    """Remove the :func:`leftovers` of ``prefix`` in ``parent``."""
    for found, path in leftovers(parent):
        if found == prefix:
            discard(path)


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a new, empty temporary file beside ``path`` to write into; rename it onto ``path`` when the block ends
    without an error, remove it in every case. Temporaries of ``path`` left by killed processes are removed first."""
    path = Path(path)
    suffix = "".join(path.suffixes)
    base = path.name[: -len(suffix)] if suffix else path.name
    _discard_leftovers(path.parent, f".{base}.tmp-")
    fd, name = tempfile.mkstemp(prefix=tagged(f".{base}.tmp-"), suffix=suffix, dir=path.parent)
    tmp = Path(name)
    try:
        try:
            os.fchmod(fd, 0o666 & ~_umask())
        finally:
            os.close(fd)
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def make_folder(parent: str | os.PathLike, prefix: str) -> Path:
    """A new folder in ``parent``, created exclusively (:func:`tempfile.mkdtemp`, named ``PREFIX PID@HOST-RANDOM``)
    with the permissions of a folder created in the usual way (umask)."""
    folder = Path(tempfile.mkdtemp(prefix=tagged(prefix), dir=parent))
    os.chmod(folder, 0o777 & ~_umask())
    return folder


@contextmanager
def staging(parent: str | os.PathLike, prefix: str) -> Iterator[Path]:
    """Yield a new folder made by :func:`make_folder`, after removing the folders of ``prefix`` in ``parent`` left by
    killed processes; it is removed, with whatever is still in it, when the block ends (what was moved out of it
    stays)."""
    _discard_leftovers(parent, prefix)
    folder = make_folder(parent, prefix)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def folder_lock(folder: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` itself while the block runs (``flock`` on the folder: no lock file is
    left anywhere), so that processes that replace entries of one folder take turns. Where the folder cannot be locked
    (Windows; file systems without ``flock`` on folders, e.g. NFS) the block runs without the lock."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            if err.errno not in _NO_FOLDER_LOCKS:
                raise
        yield
    finally:
        os.close(fd)  # releases the lock


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8, newlines as given) to ``path`` atomically; returns ``path``."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8", newline="")
    return Path(path)

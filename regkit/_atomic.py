"""Files written atomically: a reader (or a run killed mid-write) sees the old file or the new one, never a part.

Every writer in regkit that replaces one file goes through :func:`replacing`: the content goes into a temporary file
beside the target (same folder, so the final rename is atomic on one file system), created exclusively by
:func:`tempfile.mkstemp` (``O_EXCL``: a name nobody can predict, and never a file or symlink planted there), hidden
(``.NAME.tmp-RANDOM`` followed by the target's suffixes, so that writers that choose the format by extension,
SimpleITK and nibabel, see the right one) and given the permissions of a file created in the usual way (umask). It is
renamed onto the target only when the writer returned; :func:`os.replace` replaces a symlink at the target, never the
file it points to. On an error it is removed and the target is left as it was. Folders that appear only when complete
(a result folder, a DICOM series, the companion files of an image) are staged in a folder made by :func:`staging`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once, at import: os.umask is the only portable way to read it, and it is process-wide


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a new, empty temporary file beside ``path`` to write into; rename it onto ``path`` when the block ends
    without an error, remove it in every case."""
    path = Path(path)
    suffix = "".join(path.suffixes)
    base = path.name[: -len(suffix)] if suffix else path.name
    fd, name = tempfile.mkstemp(prefix=f".{base}.tmp-", suffix=suffix, dir=path.parent)
    tmp = Path(name)
    try:
        try:
            os.fchmod(fd, 0o666 & ~_UMASK)
        finally:
            os.close(fd)
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def staging(parent: str | os.PathLike, prefix: str) -> Iterator[Path]:
    """Yield a new folder in ``parent``, created exclusively (:func:`tempfile.mkdtemp`, named ``PREFIX RANDOM``) with
    the permissions of a folder created in the usual way (umask); it is removed, with whatever is still in it, when
    the block ends (what was moved out of it stays)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        os.chmod(folder, 0o777 & ~_UMASK)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8, newlines as given) to ``path`` atomically; returns ``path``."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8", newline="")
    return Path(path)

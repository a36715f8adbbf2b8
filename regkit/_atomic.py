"""Files written atomically: a reader (or a run killed mid-write) sees the old file or the new one, never a part.

Every writer in regkit that replaces one file goes through :func:`replacing`: the content goes into a temporary file
beside the target (same folder, so the final rename is atomic on one file system), hidden and unique to the process
and call (``.NAME.tmp-PID-N`` followed by the target's suffixes, so that writers that choose the format by extension,
SimpleITK and nibabel, see the right one), which is renamed onto the target only when the writer returned; on an
error it is removed and the target is left as it was. Folders that appear only when complete (a result folder, a
DICOM series) are staged by their writers.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_calls = itertools.count()


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write into; rename it onto ``path`` when the block ends without an
    error, remove it in every case."""
    path = Path(path)
    base = path.name[: -len("".join(path.suffixes))] if path.suffixes else path.name
    tmp = path.with_name(f".{base}.tmp-{os.getpid()}-{next(_calls)}{''.join(path.suffixes)}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8, newlines as given) to ``path`` atomically; returns ``path``."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8", newline="")
    return Path(path)

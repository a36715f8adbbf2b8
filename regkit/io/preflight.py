"""Checks made before a native reader (SimpleITK, GDCM, ITK's transform reader) opens a file.

Each refuses, with one line naming the file, an input that would otherwise crash the process, block it, exhaust its
memory or make it read a file it should not:

* :func:`native_name`: a name SimpleITK can take (UTF-8, no NUL byte); others abort the process inside SimpleITK.
* :func:`input_kind`: an existing regular file or folder; a named pipe would block forever (ignoring Ctrl-C), a
  device read without end.
* :func:`check_text_header`: the voxel files a MetaImage or NRRD header names (regular files in the header's folder),
  a MetaImage's number of dimensions (others crash ITK) and the numbers of its geometry (ITK reads ``nan`` or
  ``abc`` there as 0, silently).
* :func:`check_declared_size`: the voxels a header declares fit into the memory available
  (:func:`available_memory`) and into the file (deflate expands data at most :data:`DEFLATE_MAX_RATIO` times).
"""

from __future__ import annotations

import math
import os
import re
import stat
from pathlib import Path

from regkit.errors import GeometryError, ImageReadError, RegkitError

__all__ = [
    "DATA_FILES_ANYWHERE",
    "DEFLATE_MAX_RATIO",
    "MAX_DATA_FILES",
    "MAX_METAIMAGE_DIMS",
    "available_memory",
    "check_declared_size",
    "check_text_header",
    "input_kind",
    "native_name",
]

DATA_FILES_ANYWHERE = "REGKIT_DATA_FILES_ANYWHERE"
"""Set to 1 to let MetaImage and NRRD headers name voxel files outside their own folder (refused by default: a header
could otherwise make regkit read any file the user can, e.g. ``ElementDataFile = /etc/passwd``)."""

MAX_DATA_FILES = 100_000
"""Most voxel files one header may name (a list or a printf pattern with its range), each checked before reading."""

MAX_METAIMAGE_DIMS = 10
"""Most dimensions of a MetaImage (the size of the arrays of ITK's MetaImage reader)."""

DEFLATE_MAX_RATIO = 1032
"""Most bytes that one byte of deflate (zlib, gzip, PNG) data expands to: voxels declared beyond this many times a
file's size cannot be in it."""

# The header line naming a MetaImage's or detached NRRD header's voxel file(s): LOCAL (MetaImage: the voxels follow),
# LIST (names on the following lines), a printf pattern with its range ("slice%03d.raw 1 10 1"), or one file name.
_DATA_FILE_LINE = {
    "MetaImage": re.compile(rb"^[ \t]*ElementDataFile[ \t]*=[ \t]*(\S[^\r\n]*?)[ \t]*\r?$", re.M),
    "NRRD": re.compile(rb"^[ \t]*data ?file[ \t]*:[ \t]*(\S[^\r\n]*?)[ \t]*\r?$", re.M | re.I),
}
# The MetaImage fields ITK takes the geometry from; their numbers are parsed with C++ streams, which stop at the
# first token that is not a finite number and leave it and the rest 0.
_METAIMAGE_GEOMETRY = re.compile(
    rb"^[ \t]*(ElementSpacing|ElementSize|Offset|Origin|Position|TransformMatrix|Rotation|Orientation)[ \t]*="
    rb"([^\r\n]*)",
    re.M,
)
# Fields of whole numbers whose values ITK cannot be given unchecked: pattern, name, largest value. MetaImage's NDims
# sizes the arrays of ITK's reader (more dimensions write beyond them); NRRD sizes beyond 32 bits are cut to their
# low 32 bits in ITK's header information (4294967297 is read as 1), while the reader allocates the full size.
_WHOLE_NUMBERS = {
    "MetaImage": (re.compile(rb"^[ \t]*NDims[ \t]*=([^\r\n]*)", re.M), "NDims", MAX_METAIMAGE_DIMS),
    "NRRD": (re.compile(rb"^sizes[ \t]*:([^\r\n]*)", re.M), "sizes", 2**32 - 1),
}
_HEADER_BYTES = 1 << 16  # text headers are read this far
_FILE_KINDS = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def native_name(path: Path, error: type[RegkitError]) -> str:
    """``str(path)``, checked to be a name SimpleITK can open: encodable as UTF-8 (a name that is not valid UTF-8
    reaches Python as lone surrogates, and SimpleITK aborts the process on them) and free of NUL bytes. Raises
    ``error`` with the name's ``repr``."""
    name = str(path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise error(f"{name!r}: the file name is not valid UTF-8; rename the file to read or write it") from None
    if "\0" in name:
        raise error(f"{name!r}: the file name holds a NUL byte")
    return name


def input_kind(path: Path, error: type[RegkitError]) -> str:
    """``"file"`` for a readable regular file, ``"folder"`` for a folder (symlinks followed), after
    :func:`native_name`. Raises ``error`` for a missing or unreadable path and for anything else (named pipe, device,
    socket), which is never opened."""
    native_name(path, error)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as err:
        raise error(f"cannot read {path}: {err.strerror}") from None
    if stat.S_ISDIR(mode):
        return "folder"
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
        raise error(f"{path} is {kind}, not a regular file; regkit reads image files (and DICOM folders)")
    if not os.access(path, os.R_OK):
        raise error(f"cannot read {path}: permission denied")
    return "file"


def check_text_header(path: Path, fmt: str) -> int:
    """Check the text header of the MetaImage or NRRD file ``path`` (``fmt`` "MetaImage" or "NRRD"; other formats
    pass) before ITK reads it, and return the total size in bytes of the voxel files it names (0 for none).

    * A MetaImage's ``NDims`` must be a whole number from 1 to :data:`MAX_METAIMAGE_DIMS` (ITK's MetaImage reader
      writes beyond its arrays, and crashes, for others), NRRD ``sizes`` whole numbers below 2**32 (ITK would
      report larger ones cut to 32 bits, and allocate their full size): :class:`ImageReadError` otherwise.
    * Every voxel file it names (one name, a LIST, or a printf pattern with its range, at most
      :data:`MAX_DATA_FILES`) must be an existing regular file inside the header's folder (symlinks resolved; set
      :data:`DATA_FILES_ANYWHERE` to 1 to allow other folders): :class:`ImageReadError` otherwise.
    * MetaImage geometry fields (``ElementSpacing``, ``Offset``, ``TransformMatrix`` and their synonyms) must hold
      finite numbers: :class:`GeometryError` otherwise (ITK would read ``nan`` or ``abc``, and all after it, as 0).
    """
    line = _DATA_FILE_LINE.get(fmt)
    if line is None:
        return 0
    with open(path, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if fmt == "NRRD":
        head = re.split(rb"\r?\n\r?\n", head, maxsplit=1)[0]  # the header ends at the first empty line
    found = line.search(head)
    header = head[: found.end()] if fmt == "MetaImage" and found else head  # a MetaImage header ends at that line
    _check_whole_numbers(path, fmt, header)
    if fmt == "MetaImage":
        _check_metaimage_geometry(path, header)
    if found is None or found.group(1).upper() == b"LOCAL":
        return 0
    value = found.group(1).decode("utf-8", "replace")
    if value.upper().startswith("LIST"):
        names = head[found.end() :].decode("utf-8", "replace").split()
    elif "%" in value:
        names = _pattern_names(path, value)
    else:
        names = [value.split()[0]]
    if len(names) > MAX_DATA_FILES:
        raise ImageReadError(f"{path}: its header names more than {MAX_DATA_FILES} voxel files")
    folder = path.parent.resolve()
    anywhere = os.environ.get(DATA_FILES_ANYWHERE) == "1"
    total = 0
    for name in names:
        target = (path.parent / name).resolve()
        if not anywhere and not target.is_relative_to(folder):
            raise ImageReadError(
                f"{path}: its header names the voxel file {name}, outside the header's folder; refused (set "
                f"{DATA_FILES_ANYWHERE}=1 to allow)"
            )
        try:
            status = os.stat(target)
        except OSError:
            raise ImageReadError(f"{path}: its voxel file {target} does not exist") from None
        if not stat.S_ISREG(status.st_mode):
            raise ImageReadError(f"{path}: its voxel file {target} is not a regular file")
        total += status.st_size
    return total


def _pattern_names(path: Path, value: str) -> list[str]:
    """The file names of a voxel-file pattern ``"name%03d.raw min max step [subdim]"`` (bounds inclusive), at most
    ``MAX_DATA_FILES + 1`` of them."""
    fields = value.split()
    try:
        low, high, step = (int(f) for f in fields[1:4])
        numbers = range(low, high + (1 if step > 0 else -1), step)
    except ValueError:
        raise ImageReadError(
            f"{path}: its voxel-file pattern {value!r} needs whole numbers min max step, step not 0"
        ) from None
    try:
        return [fields[0] % i for i in numbers[: MAX_DATA_FILES + 1]]
    except (TypeError, ValueError):
        raise ImageReadError(
            f"{path}: its voxel-file pattern {fields[0]!r} is not a printf pattern of an integer"
        ) from None


def _check_whole_numbers(path: Path, fmt: str, header: bytes) -> None:
    """Raise ImageReadError if a field of :data:`_WHOLE_NUMBERS` in the text ``header`` holds anything but whole
    numbers in its range (ITK crashes on others, or reads them truncated to 32 bits)."""
    pattern, field, high = _WHOLE_NUMBERS[fmt]
    for found in pattern.finditer(header):
        tokens = found.group(1).split()
        if not tokens or not all(t.isdigit() and 1 <= int(t) <= high for t in tokens):
            raise ImageReadError(
                f"{path}: header field {field} holds {found.group(1).strip().decode('utf-8', 'replace')!r}; ITK "
                f"takes whole numbers from 1 to {high} there"
            )


def _check_metaimage_geometry(path: Path, header: bytes) -> None:
    """Raise GeometryError if a geometry field of the MetaImage ``header`` holds anything but finite numbers."""
    for found in _METAIMAGE_GEOMETRY.finditer(header):
        for token in found.group(2).split():
            try:
                number = float(token)
            except ValueError:
                number = math.nan
            if not math.isfinite(number):
                field = found.group(1).decode()
                raise GeometryError(
                    f"{path}: header field {field} holds {token.decode('utf-8', 'replace')!r}, not a finite number"
                )


def available_memory() -> int | None:
    """Bytes of memory available to new allocations now: Linux's ``MemAvailable`` (``/proc/meminfo``), else the free
    physical pages (``os.sysconf``), else None (not known)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    names = getattr(os, "sysconf_names", {})
    if "SC_AVPHYS_PAGES" in names and "SC_PAGE_SIZE" in names:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def check_declared_size(
    path: Path, size: tuple[int, ...], voxel_bytes: int, stored_bytes: int | None = None, offset: int = 0
) -> None:
    """Raise :class:`ImageReadError` naming ``path`` if the voxels its header declares (``size`` voxels of
    ``voxel_bytes`` bytes, from byte ``offset`` of the file) need more than :func:`available_memory`, or more than
    :data:`DEFLATE_MAX_RATIO` times the ``stored_bytes`` of the file(s) holding them (when given: files stored raw or
    deflate-compressed); call it before any voxel is read. (Reading takes one or two copies more; this refuses
    headers that cannot be right, not every file that will not fit.)"""
    needed = offset + math.prod(size) * voxel_bytes
    declared = f"its header declares {' x '.join(map(str, size))} voxels of {voxel_bytes} bytes"
    declared += f" from byte {offset} ({needed / 1e9:.4g} GB)" if offset else f" ({needed / 1e9:.4g} GB)"
    available = available_memory()
    if available is not None and needed > available:
        raise ImageReadError(
            f"{path}: {declared}, more than the {available / 1e9:.4g} GB of memory available; the header is corrupt "
            "or the image too large"
        )
    if stored_bytes is not None and needed > DEFLATE_MAX_RATIO * stored_bytes:
        raise ImageReadError(
            f"{path}: {declared}, more than its {stored_bytes} bytes on disk can hold even compressed; the header is "
            "corrupt"
        )

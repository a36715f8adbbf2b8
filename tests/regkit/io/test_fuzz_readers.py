"""Fuzzing the image readers: small valid files of every format regkit reads, mutated by generators with fixed seeds.

The bases are tiny (8 x 8 x 4 or 8 x 8): NIfTI-1 ``.nii`` and ``.nii.gz`` in 2D and 3D, NIfTI-2 ``.nii``, MetaImage
``.mha`` (raw and compressed) and ``.mhd`` + ``.raw``, NRRD ``.nrrd`` (raw and gzip) and ``.nhdr`` + ``.raw``, PNG
(8 and 16 bit) and a DICOM series folder. The mutations cut files, flip bytes of headers (and of compressed streams),
set binary header fields (dimensions, spacing, voxel type, offsets, scaling, orientation) to extreme values, replace,
drop or repeat lines of text headers, point data-file lines at hostile targets (missing files, other folders, a
named pipe, huge printf ranges) and append data (a small ``.nii.gz`` that expands to 8 MiB).

Every variant must read into a valid :class:`~regkit.io.Image` or raise a :class:`~regkit.errors.RegkitError` whose
message is one line naming the file; any other exception, a crash of the process or a hang is a bug. NIfTI variants
are read by both readers (:func:`read_image` and :func:`read_image_nibabel`), which must read the same voxels.

The reads run in a worker process (:func:`serve`), so that a native crash or a hang is seen and blamed on its variant
(the worker is then restarted after it). A failure lists the first variants that broke a rule, by name; the files of a
variant are rebuilt by running the generators with the same seed.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import struct
import subprocess
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np
import SimpleITK as sitk

from tests.helpers import write_dicom_series

ROOT = Path(__file__).resolve().parents[3]
SEED = 26
HANG_SECONDS = 10.0  # a read this long is a hang: the tiny files read in milliseconds

# --- hostile values -----------------------------------------------------------------------------------------------

INT16 = [0, -1, 1, 2, 3, 4, 5, 7, 8, 255, 32767, -32768]
INT32 = [0, -1, 1, 347, 348, 349, 540, 2**31 - 1, -(2**31)]
INT64 = [0, -1, 1, 7, 8, 2**31, 2**62, -(2**63)]
FLOATS = [0.0, -0.0, -1.0, 1e-30, 1e-45, 1e30, 3.4e38, math.nan, math.inf, -math.inf]
DATATYPES = [0, 1, 2, 4, 8, 16, 32, 64, 128, 255, 256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2304, -1]
TEXT_VALUES = [
    "0",
    "-1",
    "1",
    "1 1",
    "1 1 1 1 1",
    "2147483647 2147483647 2147483647",
    "100000 100000 100000",
    "99999999999999999999",
    "1e999",
    "nan",
    "inf",
    "-inf",
    "1e-300",
    "0x10",
    "abc",
    "",
    "True",
    "False",
    "LOCAL",
    "MET_UCHAR",
    "MET_DOUBLE",
    "MET_OTHER",
    "MET_FLOAT_ARRAY",
    "uchar",
    "double",
    "block",
    "gzip",
    "raw",
    "hex",
    "ascii",
    "bzip2",
    "big",
    "none",
    "(nan,0,0) (0,1,0) (0,0,1)",
    "(1,0,0) (0,0,0) (0,0,1)",
    "(0,0,0)",
    "\xff\xfe",
]
# Targets of a data-file line; {stem} is the variant's name (its own files), FIFO a named pipe beside it.
DATA_FILE_VALUES = [
    "{stem}.missing",
    "../{stem}.raw",
    "/etc/passwd",
    "/dev/zero",
    "LOCAL",
    "LIST",
    "LIST\n{stem}.raw\n{stem}.raw",
    "{stem}%d.raw 1 1000000000000 1",
    "{stem}%d.raw 1 3 0",
    "{stem}%n.raw 1 3 1",
    "{stem}%d.raw a b c",
    "{stem}.fifo",
    ".",
    "{stem}.raw {stem}.raw",
]


# --- the bases ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Base:
    """A valid image file (with its companion voxel file, or a DICOM folder) and the mutations it gets."""

    name: str  # also the extension of the file: "3d.nii", "2d.nii.gz", "dicom" ...
    files: dict[str, bytes]  # suffix -> content; "" is the file that is read
    mutations: list[tuple[str, Callable[[np.random.Generator, dict[str, bytes]], dict[str, bytes]], int]]


def _volume(ndim: int, dtype: type) -> np.ndarray:
    """A [z, y, x] (or [y, x]) array of distinct values."""
    shape = (4, 8, 8)[3 - ndim :]
    return (np.arange(math.prod(shape)).reshape(shape) * 3 - 50).astype(dtype)


def _nifti(kind: type, ndim: int, dtype: type, gz: bool) -> bytes:
    """A NIfTI file of ``_volume`` with an oblique-free RAS affine of spacing (0.5, 1, 2); qform and sform code 1."""
    affine = np.diag([0.5, 1.0, 2.0, 1.0])
    affine[:3, 3] = (-10.0, 5.0, 3.0)
    img = kind(_volume(ndim, dtype).T, affine)
    img.header.set_qform(affine, code=1)
    img.header.set_sform(affine, code=1)
    raw = img.to_bytes()
    return gzip.compress(raw, mtime=0) if gz else raw


def _itk_file(ext: str, ndim: int, dtype: type, compress: bool, folder: Path) -> dict[str, bytes]:
    """The files SimpleITK writes for ``_volume`` (spacing 0.5..., origin, a rotation in 2D): suffix -> content."""
    image = sitk.GetImageFromArray(_volume(ndim, dtype))
    image.SetSpacing((0.5, 1.0, 2.0)[:ndim])
    image.SetOrigin((-10.0, 5.0, 3.0)[:ndim])
    if ndim == 2:
        c, s = math.cos(0.5), math.sin(0.5)
        image.SetDirection((c, -s, s, c))
    path = folder / f"base{ext}"
    sitk.WriteImage(image, str(path), useCompression=compress)
    files = {"": path.read_bytes()}
    for companion in folder.glob("base.*"):
        if companion != path:
            files[companion.name.removeprefix("base")] = companion.read_bytes()
        companion.unlink()
    return files


def _bases(folder: Path) -> list[Base]:
    nifti1 = _nifti_fields(NIFTI1_FIELDS)
    nifti2 = _nifti_fields(NIFTI2_FIELDS)
    byte_level = [("truncate", _truncate, 8), ("flip", _flip(352), 8)]
    text = [("value", _text_value, 14), ("drop", _text_drop, 4), ("repeat", _text_repeat, 3)]
    text += [("flip", _flip(200), 4), ("truncate", _truncate, 5)]
    detached = [("data-file", _data_file, 14), ("raw-truncate", _companion(_truncate), 3)]
    detached += [("raw-flip", _companion(_flip(1 << 20)), 2)]
    gz = [("inner", _inside_gzip(_pick(nifti1, _truncate, _flip(352))), 20), ("flip", _flip(1 << 20), 6)]
    gz += [("truncate", _truncate, 6), ("expand", _expand, 2)]
    png = [("truncate", _truncate, 6), ("flip", _flip(64), 8), ("ihdr", _png_ihdr, 14)]
    dicom = [("file-truncate", _in_dicom(_truncate), 6), ("file-flip", _in_dicom(_flip(2048)), 12)]
    dicom += [("drop-file", _dicom_drop, 2), ("garbage-file", _dicom_garbage, 2)]
    # The variants that exposed bugs (crashes, hangs, tracebacks) before the readers were hardened, kept fixed.
    found = {
        "2d.nii": [_set_nifti(112, "f", 1.0), _set_nifti(116, "f", math.nan), _set_nifti(40, "6h", 5, 8, 8, 1, 1, 2)],
        "nifti2.nii": [_set_nifti(168, "q", 2**62), _set_nifti(12, "h", -1), _set_nifti(108, "f", 0.0)],
        "3d.nii": [_set_nifti(108, "f", 0.0), _set_nifti(40, "4h", 3, 10000, 10000, 10000)],
        "3d.mha": [_set_line(b"NDims", b"-1"), _set_line(b"NDims", b"100"), _set_line(b"Offset", b"nan 0 0")],
        "2d-z.mha": [_set_line(b"DimSize", b"65536 65536"), _set_line(b"NDims", b"2147483647")],
        "3d.mhd": [_set_line(b"ElementDataFile", b"{stem}.fifo"), _set_line(b"NDims", b"99999999999999999999")],
        "3d.nrrd": [_set_line(b"sizes", b"4294967297 1 1")],
        "3d.nhdr": [_set_line(b"data file", b"{stem}.fifo"), _set_line(b"sizes", b"4294967297 1 1")],
    }
    with_tmp = folder / "bases"
    with_tmp.mkdir()
    bases = [
        Base("3d.nii", {"": _nifti(nib.Nifti1Image, 3, np.int16, False)}, [("field", nifti1, 44), *byte_level]),
        Base("2d.nii", {"": _nifti(nib.Nifti1Image, 2, np.float32, False)}, [("field", nifti1, 16), *byte_level]),
        Base("nifti2.nii", {"": _nifti(nib.Nifti2Image, 3, np.uint8, False)}, [("field", nifti2, 24), *byte_level]),
        Base("3d.nii.gz", {"": _nifti(nib.Nifti1Image, 3, np.int16, True)}, gz),
        Base("2d.nii.gz", {"": _nifti(nib.Nifti1Image, 2, np.float64, True)}, gz[:2]),
        Base("3d.mha", _itk_file(".mha", 3, np.int16, False, with_tmp), text),
        Base("2d-z.mha", _itk_file(".mha", 2, np.float32, True, with_tmp), text),
        Base("3d.mhd", _itk_file(".mhd", 3, np.uint16, False, with_tmp), text[:2] + detached),
        Base("3d.nrrd", _itk_file(".nrrd", 3, np.int16, False, with_tmp), text),
        Base("2d-gz.nrrd", _itk_file(".nrrd", 2, np.float32, True, with_tmp), text),
        Base("3d.nhdr", _itk_file(".nhdr", 3, np.float32, False, with_tmp), text[:2] + detached),
        Base("8bit.png", _itk_file(".png", 2, np.uint8, False, with_tmp), png),
        Base("16bit.png", _itk_file(".png", 2, np.uint16, False, with_tmp), png[2:]),
        Base("dicom", _dicom_files(with_tmp / "dicom"), dicom),
    ]
    return [
        Base(b.name, b.files, [*b.mutations, *(("found", mutation, 1) for mutation in found.get(b.name, []))])
        for b in bases
    ]


def _dicom_files(folder: Path) -> dict[str, bytes]:
    """A 4-slice DICOM series (one file per slice): file name -> content."""
    image = sitk.GetImageFromArray(_volume(3, np.int16))
    image.SetSpacing((0.5, 1.0, 2.0))
    write_dicom_series(folder, image, "1.2.826.0.1.3680043.2.1125.2626")
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


# --- the mutations ------------------------------------------------------------------------------------------------
# Each takes the generator and the base's files (suffix -> content) and returns the variant's files.

Files = dict[str, bytes]
Mutation = Callable[[np.random.Generator, Files], Files]

# NIfTI header fields: name, offset, struct code, count, values.
NIFTI1_FIELDS = [
    ("sizeof_hdr", 0, "i", 1, INT32),
    ("dim", 40, "h", 8, INT16),
    ("datatype", 70, "h", 1, DATATYPES),
    ("bitpix", 72, "h", 1, INT16),
    ("pixdim", 76, "f", 8, FLOATS),
    ("vox_offset", 108, "f", 1, [0.0, 1.0, 348.0, 351.0, 352.5, 400.0, 1e9, -352.0, math.nan, math.inf]),
    ("scl_slope", 112, "f", 1, FLOATS),
    ("scl_inter", 116, "f", 1, FLOATS),
    ("qform_code", 252, "h", 1, INT16),
    ("sform_code", 254, "h", 1, INT16),
    ("quatern", 256, "f", 6, FLOATS),
    ("srow", 280, "f", 12, FLOATS),
    ("magic", 344, "4s", 1, [b"ni1\0", b"n+2\0", b"\0\0\0\0", b"n+1x"]),
]
NIFTI2_FIELDS = [
    ("sizeof_hdr", 0, "i", 1, INT32),
    ("magic", 4, "8s", 1, [b"n+1\0\r\n\x1a\n", b"ni2\0\r\n\x1a\n", bytes(8)]),
    ("datatype", 12, "h", 1, DATATYPES),
    ("bitpix", 14, "h", 1, INT16),
    ("dim", 16, "q", 8, INT64),
    ("pixdim", 104, "d", 8, [*FLOATS, 1e300]),
    ("vox_offset", 168, "q", 1, [0, 540, 543, 545, 2**40, -1]),
    ("scl_slope", 176, "d", 1, FLOATS),
    ("sform_code", 348, "i", 1, INT32),
    ("srow", 400, "d", 12, FLOATS),
]


def _nifti_fields(fields: list) -> Mutation:
    def mutate(rng: np.random.Generator, files: Files) -> Files:
        raw = bytearray(files[""])
        for _ in range(int(rng.integers(1, 3))):
            _, offset, code, count, values = fields[int(rng.integers(len(fields)))]
            index = int(rng.integers(count))
            value = values[int(rng.integers(len(values)))]
            struct.pack_into(f"<{code}", raw, offset + index * struct.calcsize(code), value)
        return {"": bytes(raw)}

    return mutate


def _set_nifti(offset: int, code: str, *values: float) -> Mutation:
    """Header bytes from ``offset`` set to ``values`` (little-endian ``struct`` code ``code``)."""

    def mutate(rng: np.random.Generator, files: Files) -> Files:
        raw = bytearray(files[""])
        struct.pack_into(f"<{code}", raw, offset, *values)
        return {"": bytes(raw)}

    return mutate


def _set_line(key: bytes, value: bytes) -> Mutation:
    """The text header's line of ``key`` given ``value``."""

    def mutate(rng: np.random.Generator, files: Files) -> Files:
        lines, rest = _header_lines(files[""])
        lines = [_line_value(line, value) if line.startswith(key) else line for line in lines]
        return {**files, "": b"\n".join(lines) + rest}

    return mutate


def _truncate(rng: np.random.Generator, files: Files) -> Files:
    data = files[""]
    return {**files, "": data[: int(rng.integers(len(data)))]}


def _flip(within: int) -> Mutation:
    """Xor 1 to 8 random bytes among the first ``within`` bytes with random non-zero values."""

    def mutate(rng: np.random.Generator, files: Files) -> Files:
        data = bytearray(files[""])
        for _ in range(int(rng.integers(1, 9))):
            data[int(rng.integers(min(within, len(data))))] ^= int(rng.integers(1, 256))
        return {**files, "": bytes(data)}

    return mutate


def _pick(*mutations: Mutation) -> Mutation:
    """One of ``mutations``, chosen by the generator."""
    return lambda rng, files: mutations[int(rng.integers(len(mutations)))](rng, files)


def _inside_gzip(mutation: Mutation) -> Mutation:
    """``mutation`` applied to the uncompressed stream, compressed again."""

    def mutate(rng: np.random.Generator, files: Files) -> Files:
        inner = mutation(rng, {"": gzip.decompress(files[""])})
        return {"": gzip.compress(inner[""], mtime=0)}

    return mutate


def _expand(rng: np.random.Generator, files: Files) -> Files:
    """A gzip stream that holds 8 MiB (a few KiB compressed) beyond the voxels its header declares."""
    return {"": gzip.compress(gzip.decompress(files[""]) + bytes(8 << 20), mtime=0)}


def _companion(mutation: Mutation) -> Mutation:
    """``mutation`` applied to the detached header's voxel file."""

    def mutate(rng: np.random.Generator, files: Files) -> Files:
        return {**files, ".raw": mutation(rng, {"": files[".raw"]})[""]}

    return mutate


def _header_lines(data: bytes) -> tuple[list[bytes], bytes]:
    """The lines of a MetaImage or NRRD header and what follows them: ``data == b"\\n".join(lines) + rest``."""
    if data.startswith(b"NRRD"):
        head, blank, rest = data.partition(b"\n\n")
        return head.split(b"\n"), blank + rest
    end = data.find(b"\n", data.find(b"ElementDataFile"))
    return data[:end].split(b"\n"), data[end:]


def _line_value(line: bytes, value: bytes) -> bytes:
    """``line`` (``key = value`` or ``key: value``) with its value replaced."""
    for sep in (b" = ", b": "):
        if sep in line:
            return line.split(sep, 1)[0] + sep + value
    return value


def _text_value(rng: np.random.Generator, files: Files) -> Files:
    lines, rest = _header_lines(files[""])
    i = int(rng.integers(1, len(lines)))
    lines[i] = _line_value(lines[i], TEXT_VALUES[int(rng.integers(len(TEXT_VALUES)))].encode("latin-1"))
    return {**files, "": b"\n".join(lines) + rest}


def _text_drop(rng: np.random.Generator, files: Files) -> Files:
    lines, rest = _header_lines(files[""])
    del lines[int(rng.integers(len(lines)))]
    return {**files, "": b"\n".join(lines) + rest}


def _text_repeat(rng: np.random.Generator, files: Files) -> Files:
    lines, rest = _header_lines(files[""])
    i = int(rng.integers(1, len(lines)))
    lines.insert(i, _line_value(lines[i], TEXT_VALUES[int(rng.integers(len(TEXT_VALUES)))].encode("latin-1")))
    return {**files, "": b"\n".join(lines) + rest}


def _data_file(rng: np.random.Generator, files: Files) -> Files:
    """The data-file line pointed at a hostile target (``{stem}`` is replaced when the files are written)."""
    lines, rest = _header_lines(files[""])
    value = DATA_FILE_VALUES[int(rng.integers(len(DATA_FILE_VALUES)))].encode()
    i = next(i for i, line in enumerate(lines) if line.lower().startswith((b"elementdatafile", b"data file")))
    lines[i] = _line_value(lines[i], value)
    return {**files, "": b"\n".join(lines) + rest}


def _png_ihdr(rng: np.random.Generator, files: Files) -> Files:
    """One IHDR field (width, height, bit depth, colour type, interlace) set to an extreme value, CRC recomputed."""
    data = bytearray(files[""])
    field = int(rng.integers(5))
    if field < 2:
        struct.pack_into(">I", data, 16 + 4 * field, [0, 1, 65535, 2**31 - 1, 2**32 - 1][int(rng.integers(5))])
    else:
        data[24 + field - 2] = [0, 1, 2, 3, 4, 6, 7, 16, 255][int(rng.integers(9))]
    struct.pack_into(">I", data, 29, zlib.crc32(bytes(data[12:29])))
    return {"": bytes(data)}


def _in_dicom(mutation: Mutation) -> Mutation:
    """``mutation`` applied to one file of the series."""

    def mutate(rng: np.random.Generator, files: Files) -> Files:
        name = sorted(files)[int(rng.integers(len(files)))]
        return {**files, name: mutation(rng, {"": files[name]})[""]}

    return mutate


def _dicom_drop(rng: np.random.Generator, files: Files) -> Files:
    name = sorted(files)[int(rng.integers(len(files)))]
    return {k: v for k, v in files.items() if k != name}


def _dicom_garbage(rng: np.random.Generator, files: Files) -> Files:
    return {**files, "zz.dcm": b"DICM" + rng.bytes(int(rng.integers(1, 600)))}


# --- writing and reading the variants -----------------------------------------------------------------------------


def write_variants(folder: Path) -> list[tuple[str, Path]]:
    """Write every variant into ``folder``, and each base unchanged (mutation "none"): (base name, mutation and
    number, path to read) in a fixed order."""
    variants = []
    for b, base in enumerate(_bases(folder)):
        for m, (label, mutation, count) in enumerate(base.mutations):
            for k in range(count):
                rng = np.random.default_rng([SEED, b, m, k])
                files = mutation(rng, dict(base.files))
                stem = f"v{len(variants):03d}"
                variants.append((f"{base.name} {label} #{k}", _write(folder, stem, base.name, files)))
        variants.append((f"{base.name} none #0", _write(folder, f"v{len(variants):03d}", base.name, base.files)))
    return variants


def _write(folder: Path, stem: str, base: str, files: Files) -> Path:
    """Write one variant's files, named after ``stem``; returns the path to read (a DICOM variant is a folder)."""
    if base == "dicom":
        path = folder / f"{stem}-dicom"
        path.mkdir()
        for name, content in files.items():
            (path / name).write_bytes(content)
        return path
    path = folder / f"{stem}.{base.split('.', 1)[1]}"
    header = files[""]
    if b"{stem}.fifo" in header:
        os.mkfifo(folder / f"{stem}.fifo")
    path.write_bytes(header.replace(b"{stem}", stem.encode()).replace(b"base.raw", f"{stem}.raw".encode()))
    if ".raw" in files:
        (folder / f"{stem}.raw").write_bytes(files[".raw"])
    return path


def serve() -> None:
    """The worker: read each path of the file ``argv[1]`` (one a line) with every reader of its format and append one
    JSON line per path to the file ``argv[2]`` (flushed, so that a crash or hang is blamed on the next path)."""
    import torch

    from regkit.errors import RegkitError
    from regkit.io import read_image, read_image_nibabel

    paths = Path(sys.argv[1]).read_text(errors="surrogateescape").splitlines()
    with open(sys.argv[2], "a") as out:
        for path in paths:
            readers = [read_image, read_image_nibabel] if ".nii" in path else [read_image]
            results, images = [], []
            for reader in readers:
                start = time.perf_counter()
                try:
                    image = reader(path)
                    outcome = {"outcome": "read", "shape": list(image.shape), "dtype": str(image.data.dtype)}
                    images.append(image)
                except RegkitError as err:
                    outcome = {"outcome": "refused", "type": type(err).__name__, "message": str(err)}
                except Exception as err:
                    outcome = {"outcome": "exception", "type": type(err).__name__, "message": str(err)[:300]}
                outcome["seconds"] = time.perf_counter() - start
                results.append(outcome)
            if len(images) == 2:
                results[1]["same voxels"] = bool(torch.equal(images[0].data, images[1].data))
            out.write(json.dumps(results) + "\n")
            out.flush()


def _read_all(paths: list[Path], folder: Path) -> list[list[dict]]:
    """The worker's results for ``paths``. A variant that kills the worker, or after which no result comes for
    ``HANG_SECONDS``, gets one "crash" or "hang" result, and a new worker goes on after it."""
    results: list[list[dict]] = []
    todo, out, stderr = folder / "todo.txt", folder / "results.jsonl", folder / "stderr.txt"
    while len(results) < len(paths):
        todo.write_text("".join(f"{path}\n" for path in paths[len(results) :]), errors="surrogateescape")
        out.write_text("")
        command = [sys.executable, "-c", "from tests.regkit.io.test_fuzz_readers import serve; serve()", todo, out]
        with open(stderr, "wb") as errors:
            worker = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=errors)
        done, deadline = 0, time.monotonic() + 60 + HANG_SECONDS  # the first result waits for the imports too
        while worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            lines = out.read_text().count("\n")
            if lines > done:
                done, deadline = lines, time.monotonic() + HANG_SECONDS
        hang = worker.poll() is None
        if hang:
            worker.kill()
        worker.wait()
        results += [json.loads(line) for line in out.read_text().splitlines()]
        if len(results) < len(paths):
            failure = (
                "hang"
                if hang
                else f"crash (exit {worker.returncode}): {' '.join(stderr.read_text(errors='replace')[-300:].split())}"
            )
            results.append([{"outcome": failure, "seconds": math.inf}])
    return results


def test_every_variant_reads_or_is_refused_in_one_line(tmp_path: Path) -> None:
    variants = write_variants(tmp_path)
    assert len(variants) >= 300
    results = _read_all([path for _, path in variants], tmp_path)
    bad = []
    counts: dict[str, Counter] = {}  # base -> outcome of each reader ("read/refused") -> variants
    for (name, path), readers in zip(variants, results, strict=True):
        counts.setdefault(name.split()[0], Counter())["/".join(r["outcome"] for r in readers)] += 1
        for r in readers:
            message = r.get("message", "")
            if r["outcome"] not in ("read", "refused"):
                bad.append(f"{name} ({path.name}): {r['outcome']} {r.get('type', '')}: {message}")
            elif r["outcome"] == "refused" and ("\n" in message or path.name not in message):
                bad.append(f"{name} ({path.name}): message not one line naming the file: {message!r}")
            elif r["seconds"] > HANG_SECONDS:
                bad.append(f"{name} ({path.name}): took {r['seconds']:.1f} s")
        # SimpleITK (ITK 5.4) reads no NIfTI-2 header: only read_image_nibabel reads that base.
        readable = readers[1:] if name.startswith("nifti2.nii") else readers
        if " none " in name and any(r["outcome"] != "read" for r in readable):
            bad.append(f"{name} ({path.name}): the valid base was not read: {readers}")
        # One rule for both NIfTI readers: they read or refuse alike, except for voxels only read_image checks
        # (NaN/Inf, ImageValueError) and NIfTI-2 headers, which only read_image_nibabel reads.
        outcomes = [r["outcome"] for r in readers]
        if outcomes == ["refused", "read"] and readers[0]["type"] != "ImageValueError" and readable == readers:
            bad.append(f"{name} ({path.name}): read_image_nibabel read it, read_image refused: {readers[0]}")
        if outcomes == ["read", "refused"]:
            bad.append(f"{name} ({path.name}): read_image read it, read_image_nibabel refused: {readers[1]}")
        if readers[-1].get("same voxels") is False:
            bad.append(f"{name} ({path.name}): read_image and read_image_nibabel read different voxels")
    summary = "; ".join(f"{base}: {dict(c)}" for base, c in counts.items())
    print(f"{len(variants)} variants; {summary}")
    assert not bad, f"{len(bad)} failures, the first: " + "\n".join(bad[:20])

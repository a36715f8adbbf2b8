"""The output folder of a registration: one stable naming scheme (:data:`OUTPUT_FILES`), written atomically.

:func:`write_outputs` writes a :class:`~regkit.registration.RegistrationResult` into a folder. The names never change
with options; the optional files (their ``config.outputs`` flag in brackets, :class:`~regkit.config.OutputsConfig`) are
written when their flag is true:

* ``warped.nii.gz``: the moving image resampled onto the fixed grid (linear, float) [``warped``];
* ``warped_labels.nii.gz``: the moving label map resampled onto the fixed grid (nearest, integer type kept) [when
  moving labels are given];
* ``displacement.nii.gz``: the pull-back displacement of the whole transformation on the fixed grid, ITK convention
  (:mod:`regkit.io.transforms`) [``displacement``];
* ``inverse_displacement.nii.gz``: the displacement of the inverse transformation on the MOVING grid
  [``inverse_displacement``];
* ``affine.mat``: the ITK affine transform of the linear stages (moments, rigid, affine);
* ``transform.h5``: one ITK composite transform, the affine and the CPAB displacement field, equivalent to
  ``displacement.nii.gz`` [``transform_h5``];
* ``transform.json``: the exact transformation (:meth:`~regkit.transform.Transformation.save`);
* ``jacobian.nii.gz``: the analytic Jacobian determinant on the fixed grid, float32 [``jacobian``];
* ``metrics.json``: similarity before/after, Dice/HD95, folds, SDlogJ, runtime, memory, ...
  (:mod:`regkit.results.metrics`);
* ``config.yaml``: the resolved configuration (:func:`~regkit.config.dump_config`);
* ``qc.png``: the quality-control picture of :func:`~regkit.results.qc.qc_picture` [``qc_png``];
* ``.regkit-outputs.json``: the record of what regkit wrote into the folder (``{"files": [NAME, ...]}``, and
  ``"job"``, the mapping given as ``job``: a batch job's name, configuration hash and inputs' fingerprint), written
  last; it is how ``overwrite`` recognises a folder that regkit wrote, and a batch a job whose output is complete
  (:func:`read_job_record`).

Atomicity: everything is written into a temporary folder beside the output folder (``NAME.tmp-PID@HOST-RANDOM``,
created exclusively, with a name nobody can predict), which is renamed into place only when complete; an existing
folder is replaced (with ``overwrite``) only after the new one is complete, and only if it is empty or holds nothing
but what regkit wrote there (the names in its record; in a folder of an earlier regkit, which kept no record, the
names of :data:`OUTPUT_FILES`, with ``transform.json`` among them). Of the replaced folder only regkit's files are
deleted: a file put there in the meantime is kept (the old folder stays, renamed, and a warning says where). On any
error, or Ctrl-C, the temporary folder is removed, so no half-written output ever exists.

Concurrent writers: without ``overwrite``, of two runs writing one new folder at once the later raises
:class:`OutputExistsError` (the rename never replaces a folder that appeared meanwhile); with it, the replacements
take turns (a lock on the parent folder, where its file system can lock folders: not NFS). What a killed run left
(its temporary folder, or the folder it replaced, moved aside as ``.NAME.old-PID@HOST-RANDOM``) is cleaned up by the
next write of that folder (:func:`remove_leftovers`).

Never over an input: :func:`check_output_dir` refuses to replace a folder that holds one of the run's inputs, and
:func:`check_output_file` (the commands that write one file) an output that is one of them (same real path, so
symlinks and relative paths count, or the same file).

Over 500 lines because the writer, the checks it makes before writing and the rules by which a complete folder takes
the place of an older one (the record, concurrent writers, leftovers) make one guarantee, each part relying on the
others' names and record.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from regkit import _atomic
from regkit.config import dump_config
from regkit.errors import ImageDimensionError, RegkitError
from regkit.io.files import write_image
from regkit.io.image import Image
from regkit.io.inputs import as_label_map
from regkit.io.transforms import write_displacement, write_transform_h5
from regkit.png import write_png
from regkit.results.metrics import label_scores, measure_peak_memory, metrics_record
from regkit.results.qc import qc_picture
from regkit.results.resampling import sample_world
from regkit.spatial.affine import grid_centre, write_itk_affine
from regkit.spatial.grid import Grid
from regkit.spatial.metrics import jacobian_determinant

if TYPE_CHECKING:
    from regkit.registration import RegistrationResult

__all__ = [
    "OUTPUT_FILES",
    "OutputExistsError",
    "check_output_dir",
    "check_output_file",
    "read_job_record",
    "read_moving_grid",
    "remove_leftovers",
    "write_outputs",
]

OUTPUT_FILES: dict[str, str] = {
    "warped": "warped.nii.gz",
    "warped_labels": "warped_labels.nii.gz",
    "displacement": "displacement.nii.gz",
    "inverse_displacement": "inverse_displacement.nii.gz",
    "affine": "affine.mat",
    "transform_h5": "transform.h5",
    "transform": "transform.json",
    "jacobian": "jacobian.nii.gz",
    "metrics": "metrics.json",
    "config": "config.yaml",
    "qc": "qc.png",
    "record": ".regkit-outputs.json",
}
"""Output key -> file name inside the output folder (fixed; never depends on options)."""

_WRITERS = 4  # threads writing image files while the next outputs are computed
_NAMED = 3  # foreign files named in an error


class OutputExistsError(RegkitError):
    """The output exists and overwriting was not asked for, or would lose what regkit did not write."""


def check_output_dir(
    out_dir: str | os.PathLike, overwrite: bool = False, inputs: Iterable[str | os.PathLike | None] = ()
) -> Path:
    """The output folder as an absolute, normalised Path, after checking that it may be written (module docstring).

    Raises :class:`OutputExistsError` if it exists and ``overwrite`` is False, or if ``overwrite`` would replace a
    folder that holds files regkit did not write (the first few named) or one of ``inputs`` (paths; None is skipped),
    and :class:`RegkitError` if it is not a folder, or if it cannot be created or written (its nearest existing folder
    is a file or not writable), so that a run finds out before it works.
    """
    out = Path(os.path.abspath(out_dir))
    if os.path.lexists(out) and not out.is_dir():
        raise RegkitError(f"output {out_dir} exists and is not a folder; choose another -o")
    if out.exists():
        if not overwrite:
            raise OutputExistsError(
                f"output folder {out_dir} exists; use --overwrite to replace it, or choose another -o"
            )
        real = Path(os.path.realpath(out))
        for source in inputs:
            if source is not None and Path(os.path.realpath(source)).is_relative_to(real):
                raise OutputExistsError(
                    f"output folder {out_dir} holds the input {source}; regkit never writes over its inputs, so "
                    "--overwrite does not replace it; choose another -o"
                )
        foreign = _foreign_entries(out)
        if foreign:
            raise OutputExistsError(
                f"output folder {out_dir} is not a regkit output folder: it holds files that regkit did not write "
                f"({_first_few(foreign)}), so --overwrite does not replace it; move them or choose another -o"
            )
    _check_writable(out, out_dir)
    return out


def check_output_file(
    path: str | os.PathLike, overwrite: bool = False, inputs: Iterable[str | os.PathLike | None] = ()
) -> Path:
    """The output file of a command as an absolute, normalised Path, after checking that it may be written.

    Raises :class:`OutputExistsError` if it is one of ``inputs`` (paths; None is skipped; the same real path or the
    same file), even with ``overwrite``, or if it exists (a symlink counts, even a broken one) and ``overwrite`` is
    False, and :class:`RegkitError` if it is a folder or its folder does not exist or is not writable.
    """
    out = Path(os.path.abspath(path))
    for source in inputs:
        if source is not None and _same_file(out, Path(source)):
            raise OutputExistsError(
                f"output {path} is the input {source}; regkit never writes over its inputs, even with --overwrite; "
                "choose another -o"
            )
    if out.is_dir():
        raise RegkitError(f"output {path} is a folder; give a file name as -o")
    if os.path.lexists(out) and not overwrite:
        raise OutputExistsError(f"output file {path} exists; use --overwrite to replace it, or choose another -o")
    if not out.parent.is_dir():
        raise RegkitError(f"cannot write {path}: folder {out.parent} does not exist")
    _check_writable(out.parent, path)
    return out


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same real path, or (both existing) the same inode (hard links)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False


def _check_writable(out: Path, given: str | os.PathLike) -> None:
    """RegkitError unless the nearest existing folder at or above ``out`` (its parent if ``out`` exists: where the
    temporaries go) is a folder this process may create entries in."""
    where = out.parent if out.exists() else out
    while not os.path.lexists(where):
        where = where.parent
    if not where.is_dir():
        raise RegkitError(f"cannot write the output {given}: {where} is not a folder")
    if not os.access(where, os.W_OK | os.X_OK):
        raise RegkitError(f"cannot write the output {given}: no permission to write in {where}")


def _read_record(folder: Path) -> dict[str, Any]:
    """The record of ``folder`` (module docstring); empty if there is none, it cannot be read or is not an object."""
    try:
        record = json.loads((folder / OUTPUT_FILES["record"]).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _regkit_entries(folder: Path) -> set[str]:
    """The names in ``folder`` that regkit wrote: those of its record and the record; in a folder without a record
    (written by an earlier regkit, which kept none), the names of :data:`OUTPUT_FILES` if it holds
    ``transform.json``; none if the record cannot be read."""
    if not os.path.lexists(folder / OUTPUT_FILES["record"]):
        return set(OUTPUT_FILES.values()) if (folder / OUTPUT_FILES["transform"]).is_file() else set()
    names = _read_record(folder).get("files")
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        return set()
    return {*names, OUTPUT_FILES["record"]}


def read_job_record(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The ``job`` mapping that :func:`write_outputs` put into the record of the output folder ``out_dir``; None
    where the folder is missing, holds no ``transform.json`` or has no readable record with a ``job`` mapping."""
    folder = Path(out_dir)
    job = _read_record(folder).get("job") if (folder / OUTPUT_FILES["transform"]).is_file() else None
    return job if isinstance(job, dict) else None


def _first_few(names: list[str]) -> str:
    """The first :data:`_NAMED` of ``names`` and how many more, for an error message."""
    more = len(names) - _NAMED
    return ", ".join(names[:_NAMED]) + (f" and {more} more" if more > 0 else "")


def _foreign_entries(folder: Path) -> list[str]:
    """The names in ``folder`` that regkit did not write, sorted."""
    ours = _regkit_entries(folder)
    return sorted(name for name in os.listdir(folder) if name not in ours)


def read_moving_grid(result_dir: str | os.PathLike) -> Grid:
    """The moving image's grid recorded in ``RESULT_DIR/metrics.json`` by :func:`write_outputs`."""
    path = Path(result_dir) / OUTPUT_FILES["metrics"]
    try:
        g = json.loads(path.read_text())["images"]["moving"]
        return Grid.create(g["size"], g["spacing"], g["origin"], g["direction"])
    except FileNotFoundError:
        raise RegkitError(f"{path}: no such file (give the moving image's grid with --reference)") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RegkitError(f"{path}: no moving grid recorded ({type(err).__name__}: {err})") from err


def write_outputs(
    result: RegistrationResult,
    out_dir: str | os.PathLike,
    *,
    moving_labels: Image | None = None,
    fixed_labels: Image | None = None,
    overwrite: bool = False,
    extra: Mapping[str, Path] | None = None,
    inputs: Iterable[str | os.PathLike | None] = (),
    job: Mapping[str, Any] | None = None,
) -> dict[str, Path]:
    """Write a registration's outputs into ``out_dir`` (module docstring: names, conventions, atomicity).

    Args:
        result: the outcome of :func:`regkit.registration.register`.
        out_dir: the output folder; its parent folders are created. It must not exist unless ``overwrite``.
        moving_labels: optional label map in the moving image's world space (any grid); warped with nearest
            interpolation into ``warped_labels.nii.gz``.
        fixed_labels: optional label map of the fixed image (resampled onto the fixed grid, nearest, if its grid
            differs); with ``moving_labels``, Dice and HD95 go into ``metrics.json``.
        overwrite: replace an existing ``out_dir`` (only once the new outputs are complete, and only if it holds
            nothing but regkit's outputs).
        extra: name -> a file or folder on the output folder's file system, moved into it under that name with the
            outputs (so that it appears only with them) and recorded as regkit's (the demo's generated inputs).
        inputs: the paths the run read (None is skipped): an existing ``out_dir`` that holds one is not replaced.
        job: a JSON-serialisable mapping written into the folder's record under ``job`` before the folder is renamed
            into place, so that the folder itself says which work it completes (a batch job's name, configuration
            hash and inputs' fingerprint; :func:`read_job_record`).

    Returns:
        Output key (:data:`OUTPUT_FILES`) -> path of every file written.

    Raises:
        OutputExistsError: ``out_dir`` exists and ``overwrite`` is False (also when another run wrote it meanwhile),
            or it holds files that regkit did not write or one of ``inputs`` (:func:`check_output_dir`).
        ImageValueError: a label map holds non-integer values.
        ImageDimensionError: a label map's dimension differs from the images'.
    """
    start = time.perf_counter()
    peak_memory = measure_peak_memory(result)  # before writing: the registration's peak, not the writer's
    out = check_output_dir(out_dir, overwrite, inputs)
    ndim = result.fixed.ndim
    labels = {}
    for name, image in (("moving labels", moving_labels), ("fixed labels", fixed_labels)):
        if image is not None:
            if image.ndim != ndim:
                raise ImageDimensionError(f"the {name} are {image.ndim}D but the images are {ndim}D")
            labels[name] = as_label_map(image, f"the {name}")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers([out])
    with _atomic.staging(out.parent, f"{out.name}.tmp-") as tmp:
        # image files are written by threads while the next outputs are computed (compressing a 1 mm brain's fields
        # takes seconds each; SimpleITK releases the GIL while it writes); the pool waits for them before closing
        with ThreadPoolExecutor(max_workers=_WRITERS) as pool:
            moving, fixed = labels.get("moving labels"), labels.get("fixed labels")
            written = _write_all(pool, result, tmp, moving, fixed, start, peak_memory)
        for name, path in (extra or {}).items():
            os.replace(path, tmp / name)
        record: dict[str, Any] = {"files": sorted([*(path.name for path in written.values()), *(extra or {})])}
        if job is not None:
            record["job"] = dict(job)
        written["record"] = tmp / OUTPUT_FILES["record"]
        written["record"].write_text(json.dumps(record, indent=1))
        _replace(tmp, out, overwrite)
    return {key: out / path.name for key, path in written.items()}


def _write_all(
    pool: ThreadPoolExecutor,
    result: RegistrationResult,
    folder: Path,
    moving_labels: Image | None,
    fixed_labels: Image | None,
    start: float,
    peak_memory: dict[str, Any],
) -> dict[str, Path]:
    """Compute every output and write it into ``folder`` (image files through ``pool``); returns key -> path once
    every write has finished (a failed write raises)."""
    transform, fixed_grid = result.transform, result.fixed.grid
    flags = result.config.outputs
    device = result.device
    paths = {key: folder / name for key, name in OUTPUT_FILES.items()}
    written: dict[str, Path] = {}
    pending: dict[str, Future] = {}

    def done(key: str) -> None:
        written[key] = paths[key]

    def in_background(key: str, write: Callable[..., object], *args: object) -> None:
        pending[key] = pool.submit(write, *args, paths[key])

    # One evaluation of the transformation serves the warped images, the displacement and the CPAB-only field.
    world = fixed_grid.world_points(torch.float64, device)
    mapped = transform.transform_world(world)
    warped = Image(sample_world(result.moving, mapped), fixed_grid)
    if flags.warped:
        in_background("warped", write_image, warped)
    label_metrics = None
    if moving_labels is not None:
        warped_labels = Image(sample_world(moving_labels, mapped, "nearest"), fixed_grid)
        in_background("warped_labels", write_image, warped_labels)
        if fixed_labels is not None:
            if fixed_labels.grid != fixed_grid:
                fixed_labels = Image(sample_world(fixed_labels, world, "nearest"), fixed_grid)
            unmoved_labels = sample_world(moving_labels, world, "nearest")
            label_metrics = label_scores(
                fixed_labels, moving_labels, unmoved_labels, warped_labels.data, fixed_grid.spacing
            )

    displacement = (mapped - world).float().cpu()
    if flags.displacement:
        in_background("displacement", write_displacement, displacement, fixed_grid)
    if flags.inverse_displacement:
        inverse = transform.inverse_displacement(result.moving.grid, device=device).cpu()
        in_background("inverse_displacement", write_displacement, inverse, result.moving.grid)
    write_itk_affine(paths["affine"], transform.matrix, grid_centre(fixed_grid))
    done("affine")
    if flags.transform_h5:
        n = fixed_grid.ndim
        inverse_matrix = torch.as_tensor(np.linalg.inv(transform.matrix), device=mapped.device)
        cpab_points = mapped @ inverse_matrix[:n, :n].T + inverse_matrix[:n, n]  # phi(x) = M^-1 y
        in_background("transform_h5", write_transform_h5, transform, (cpab_points - world).cpu())
    transform.save(paths["transform"])
    done("transform")
    det = transform.jacobian_determinant(device=device).cpu()
    if flags.jacobian:
        in_background("jacobian", write_image, Image(det, fixed_grid))
    det_fd = jacobian_determinant(displacement, fixed_grid)
    if flags.qc_png:
        picture = qc_picture(result.fixed.data, warped.data, displacement, det, (det_fd <= 0) | (det <= 0), fixed_grid)
        write_png(picture, paths["qc"])
        done("qc")
    paths["config"].write_text(dump_config(result.config))
    done("config")

    metrics = metrics_record(result, world, mapped, label_metrics, det_fd, det, peak_memory)
    for key, future in pending.items():
        future.result()  # re-raises a failed write
        done(key)
    metrics["runtime"]["write_seconds"] = round(time.perf_counter() - start, 3)
    paths["metrics"].write_text(json.dumps(metrics, indent=1, allow_nan=False))
    done("metrics")
    return written


def _rename_into_place(tmp: Path, out: Path) -> None:
    """Rename the folder ``tmp`` to ``out``, never over an existing non-empty folder, a file or a link (rename(2)
    refuses them; Windows refuses any existing ``out``): OutputExistsError."""
    try:
        os.rename(tmp, out)
    except OSError:
        if not os.path.lexists(out):
            raise
        raise OutputExistsError(
            f"output folder {out} appeared while regkit wrote it (another run?); it was left as it was and nothing "
            "was written: use --overwrite to replace it, or choose another -o"
        ) from None


def _replace(tmp: Path, out: Path, overwrite: bool) -> None:
    """Move the complete folder ``tmp`` to ``out``, holding the lock of their parent folder
    (:func:`regkit._atomic.folder_lock`). An ``out`` that exists now (it appeared since :func:`check_output_dir`:
    another run's output) is replaced only with ``overwrite``, else OutputExistsError. It is first moved aside, into
    a new folder of its own (so that no planted name is in the way); if files that regkit did not write appeared in it
    since :func:`check_output_dir`, it is put back and OutputExistsError raised; regkit's files in it are deleted only
    after the move succeeded (:func:`_remove_outputs`)."""
    with _atomic.folder_lock(out.parent):
        if not overwrite or not os.path.lexists(out):
            _rename_into_place(tmp, out)
            return
        aside = _atomic.make_folder(out.parent, f".{out.name}.old-")
        old = aside / out.name
        os.rename(out, old)
        try:
            foreign = [] if old.is_symlink() else _foreign_entries(old)
            if foreign:
                raise OutputExistsError(
                    f"output folder {out} now holds files that regkit did not write ({_first_few(foreign)}); "
                    "it was left as it was"
                )
            _rename_into_place(tmp, out)
        except BaseException:
            os.rename(old, out)
            aside.rmdir()
            raise
    _remove_outputs(old)


def _remove_outputs(old: Path) -> None:
    """Delete the replaced output folder ``old`` and the folder it was moved into: the link, if it was a symlink (the
    folder it points to is left alone), else regkit's entries in it, the record last (so that a deletion cut short is
    taken up again by :func:`remove_leftovers`), and the folders once empty. Anything else (put there during the
    swap) is kept where it is, and a warning says where."""
    if old.is_symlink():
        old.unlink()
    else:
        ours = _regkit_entries(old)
        for entry in sorted(old.iterdir(), key=lambda entry: entry.name == OUTPUT_FILES["record"]):
            if entry.name in ours:
                _atomic.discard(entry)
        with contextlib.suppress(OSError):
            old.rmdir()
    if os.path.lexists(old):
        warnings.warn(f"files that regkit did not write were kept in {old}", stacklevel=4)
    else:
        old.parent.rmdir()


_LEFTOVER = re.compile(r"\.?(?P<name>.+)\.[a-z]+-")  # the prefix of a temporary beside NAME: NAME.KIND- or .NAME.KIND-


def remove_leftovers(out_dirs: Iterable[str | os.PathLike]) -> None:
    """Clean up what writers killed on this host left beside each output folder ``NAME`` of ``out_dirs``: their
    temporaries (``NAME.KIND-PID@HOST-RANDOM``, ``.NAME.KIND-...``: :func:`regkit._atomic.leftovers`) of processes
    that are gone, never those of a live process or of another host. They are removed, except a replaced folder moved
    aside (``.NAME.old-...``): put back where ``NAME`` is missing (its writer was killed before the new folder was in
    place), else emptied of regkit's files (:func:`_remove_outputs`). One listing of each parent folder, locked."""
    by_parent: dict[Path, set[str]] = defaultdict(set)
    for out_dir in out_dirs:
        out = Path(os.path.abspath(out_dir))
        by_parent[out.parent].add(out.name)
    for parent, names in by_parent.items():
        if not parent.is_dir():
            continue
        with _atomic.folder_lock(parent):
            for prefix, path in _atomic.leftovers(parent):
                match = _LEFTOVER.fullmatch(prefix)
                if match is None or match["name"] not in names:
                    continue
                if prefix == f".{match['name']}.old-":
                    _settle_aside(path, parent / match["name"])
                else:
                    _atomic.discard(path)


def _settle_aside(aside: Path, out: Path) -> None:
    """The folder ``aside`` into which a killed writer moved the output folder ``out`` that it was replacing: put
    back if ``out`` is missing, else its regkit files deleted (:func:`_remove_outputs`); removed once empty."""
    old = aside / out.name
    if os.path.lexists(old):
        if os.path.lexists(out):
            _remove_outputs(old)
            return
        os.rename(old, out)
    with contextlib.suppress(OSError):
        aside.rmdir()

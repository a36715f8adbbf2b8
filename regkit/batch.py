"""Batch registration: many pairs from one YAML spec, run locally or on a dask.distributed cluster, resumable.

A batch spec (YAML; every relative path is resolved against the spec file's folder)::

    defaults: quick-2d                 # a preset name, a YAML config file, or a config mapping (may have `base:`)
    output: results                    # the output root: lock, summary, report and the job folders
    manifest: /local/disk/study.sqlite # optional; default: manifest.sqlite in the output root
    layout: "{out}/{moving_stem}_to_{fixed_stem}"   # optional; fields: out, fixed_stem, moving_stem,
                                                    # fixed_parent, moving_parent (folder names), index (0-based)
    jobs:                              # explicit pairs; optional labels/masks and a per-job `config`
      - {fixed: a.nii.gz, moving: b.nii.gz, moving_labels: b_seg.nii.gz, config: {seed: 3}}
    csv: pairs.csv                     # columns fixed, moving [, fixed_labels, moving_labels, fixed_mask, moving_mask];
                                       # the paths in it are relative to the CSV file's folder
    glob:                              # one of three pairing rules
      pairing: atlas                   # every image in `images` (moving) to `atlas` (fixed)
      images: "data/*.nii.gz"
      atlas: atlas.nii.gz
      # pairing: within_folder         # every pair (a, b), a before b by name, of the `images` in one folder
      # pairing: pattern               # `fixed` and `moving` globs; pairs whose `*` parts are equal
      # fixed: "t1/*_t1.nii.gz"
      # moving: "t2/*_t2.nii.gz"

A per-job ``config`` that is a mapping is merged over ``defaults`` (mappings deeply); a string replaces it. Sources
may be combined. :func:`load_spec` validates everything before any work: the schema (unknown keys, types), each job's
registration configuration, each input (exists, header readable), globs that match nothing, and two jobs with one
output folder; each problem is a :class:`~regkit.errors.ConfigError` ``FILE:LINE: key.path: message``.

Running (:func:`run_batch`): the manifest (:class:`Manifest`, SQLite with a rollback journal, so that it may live on a
network file system; ``manifest.sqlite`` in the output root unless the spec's ``manifest`` or ``--manifest`` puts it
elsewhere, e.g. on a local disk) holds each job's state (pending, running, done, failed), its inputs' sizes and mtimes,
its configuration hash (:func:`regkit.config.config_hash`), its one-line error and its timings. Only the process
running the batch writes it, also with dask, whose workers return their outcomes to it. A job is skipped when it is
done with unchanged inputs and configuration and its output folder holds ``transform.json`` (folders are written
atomically by :func:`regkit.outputs.write_outputs`, so a folder that exists is complete, even after ``kill -9``);
failed jobs are skipped unless ``retry_failed`` (or their inputs changed); ``force`` reruns everything. A failing job
is recorded and the others go on. At the end of every run (a rerun too, and one stopped by an exception or Ctrl-C),
the output root gets, written atomically, ``summary.csv`` with one row per job of the plan (:data:`SUMMARY_COLUMNS`)
and ``report.html`` (:func:`write_report`: a self-contained page with a sortable table, QC thumbnails and metric
histograms). ``.batch.lock`` in the output root is held for the whole run (:func:`lock_output_root`): a second run on
the same root is refused.

Executors: ``local`` runs the jobs one after another in this process, each on its configuration's ``device``.
``dask`` runs each job as one task of :func:`execute_job` (as the local executor does) on a dask.distributed cluster:

* by default a local cluster of single-threaded worker processes (:func:`plan_local_workers`): one per GPU when the
  jobs may use a GPU (device ``auto`` or ``cuda``) and GPUs exist, each pinned to its GPU by ``CUDA_VISIBLE_DEVICES``
  (so ``cuda`` in a worker is its GPU) and declaring the dask resource ``GPU=1``; otherwise 2, or ``workers``, without
  resources; the CPU cores are shared evenly among them;
* or an existing scheduler at ``scheduler``, e.g. a SLURM or PBS cluster started with dask-jobqueue in a separate
  Python session that stays alive (docs/batch.md has the recipe), then
  ``regkit batch spec.yaml --executor dask --scheduler tcp://10.0.0.5:8786``. The workers must see the inputs and the
  output root at the same paths (a shared file system) and have the client's regkit version installed.

A job whose device is ``cuda`` asks for the resource ``GPU=1`` (:func:`job_resources`): dask runs it only on a worker
that declares it (``--resources GPU=1``); ``cpu`` and ``auto`` jobs ask for nothing (``auto``: the GPU of the worker
that runs it if it has one, else its CPU). The client registers regkit's dask WorkerPlugin (:func:`worker_plugin`) on
the cluster; its setup on every worker, present or joining later, checks that the worker's regkit version is the
client's, pins a worker that sees several GPUs to one of them, sets the torch threads (:func:`worker_threads`),
applies the process settings of :mod:`regkit.process` (the allocator, overriding dask's ``MALLOC_TRIM_THRESHOLD_``,
and the OpenMP wait policy) and points the numba and Triton caches at node-local disk (:func:`node_cache_dir`).

Pairs are registered one per call, also when several have the same shape: :func:`regkit.engine.register` optimizes
one transformation (its own tessellation schedule, stopping rule and optimizer state), and each iteration's work, the
CPAB integration at every voxel of the fixed grid's pyramid level (millions of points for a 1 mm brain), is already
one large launch on the GPU. To share one GPU among jobs, run more dask workers than GPUs (``workers`` > number of
GPUs): one job's reading, writing and CPU work then overlaps another's GPU work (``regkit bench batch`` measures it).
"""

from __future__ import annotations

import base64
import contextlib
import csv
import dataclasses
import functools
import glob as globlib
import html
import io
import json
import math
import os
import re
import shutil
import socket
import sqlite3
import string
import struct
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from filelock import FileLock, Timeout
from pydantic import Field, ValidationError, field_validator, model_validator

from regkit.config import (
    KeyPath,
    RegistrationConfig,
    Seq,
    _first_error,
    _format_path,
    _invalid,
    _Layer,
    _merge,
    _Model,
    _open,
    _parse,
    _read_layers,
    _resolve_paths,
    config_hash,
)
from regkit.errors import ConfigError, RegkitError

__all__ = [
    "INPUT_KEYS",
    "MANIFEST",
    "NODE_CACHE",
    "REPORT",
    "SUMMARY_COLUMNS",
    "WORKER_THREADS",
    "BatchLockedError",
    "BatchReport",
    "BatchSpec",
    "Job",
    "JobOutcome",
    "LocalWorker",
    "Manifest",
    "ManifestError",
    "Plan",
    "device_label",
    "execute_job",
    "job_resources",
    "load_spec",
    "local_workers_for",
    "lock_output_root",
    "node_cache_dir",
    "plan_actions",
    "plan_local_workers",
    "run_batch",
    "run_job",
    "summary_rows",
    "worker_plugin",
    "worker_threads",
    "write_report",
    "write_summary",
]

INPUT_KEYS = ("fixed", "moving", "fixed_labels", "moving_labels", "fixed_mask", "moving_mask")
"""The input files of a job, in the order they are listed and fingerprinted."""
MANIFEST = "manifest.sqlite"
"""The manifest's file name in the output root, unless the spec's ``manifest`` (or ``--manifest``) names another."""
NODE_CACHE = "REGKIT_NODE_CACHE"
"""Environment variable of a dask worker: the folder of its numba and Triton caches (:func:`node_cache_dir`)."""
WORKER_THREADS = "REGKIT_WORKER_THREADS"
"""Environment variable of a dask worker: the torch threads of its jobs (:func:`worker_threads`)."""
_LOCK = ".batch.lock"
_HOLDER = ".batch.holder"  # who holds the lock, for the message of a refused run
_PLUGIN = "regkit"  # the name of RegkitWorkerPlugin on a dask cluster
_LAYOUT_FIELDS = {"out", "fixed_stem", "moving_stem", "fixed_parent", "moving_parent", "index"}
_IMAGE_SUFFIXES = (".nii.gz", ".nii", ".mha", ".mhd", ".nrrd", ".nhdr", ".png")

# ---------------------------------------------------------------------------------------------------------------------
# Spec schema
# ---------------------------------------------------------------------------------------------------------------------


class JobEntry(_Model):
    """One explicit pair of the ``jobs`` list."""

    fixed: str = Field(description="Fixed image: the grid and world space of the outputs.")
    moving: str = Field(description="Moving image, registered to the fixed image.")
    fixed_labels: str | None = Field(default=None, description="Label map of the fixed image (Dice, HD95).")
    moving_labels: str | None = Field(default=None, description="Label map of the moving image, warped.")
    fixed_mask: str | None = Field(default=None, description="Mask on the fixed grid.")
    moving_mask: str | None = Field(default=None, description="Mask on the moving grid.")
    config: str | dict[str, Any] | None = Field(
        default=None, description="A preset/file replacing `defaults`, or a mapping merged over them."
    )


class GlobSpec(_Model):
    """Jobs from glob patterns and a pairing rule."""

    pairing: Literal["atlas", "within_folder", "pattern"] = Field(description="How images are paired.")
    images: str | None = Field(default=None, description="Glob of the images (atlas, within_folder).")
    atlas: str | None = Field(default=None, description="The fixed image of every pair (atlas).")
    fixed: str | None = Field(default=None, description="Glob of the fixed images, one `*` (pattern).")
    moving: str | None = Field(default=None, description="Glob of the moving images, one `*` (pattern).")

    @model_validator(mode="after")
    def _keys_of_rule(self) -> GlobSpec:
        needed = {"atlas": ("images", "atlas"), "within_folder": ("images",), "pattern": ("fixed", "moving")}
        for key in ("images", "atlas", "fixed", "moving"):
            given = getattr(self, key) is not None
            if given != (key in needed[self.pairing]):
                verb = "needs" if not given else "does not use"
                raise _invalid(f"pairing {self.pairing!r} {verb} {key!r}", (key,))
        if self.pairing == "pattern":
            for key in ("fixed", "moving"):
                if Path(getattr(self, key)).name.count("*") != 1:
                    raise _invalid("the file name must hold exactly one '*' (the part that pairs files)", (key,))
        return self


class BatchSpec(_Model):
    """A batch of registrations: default configuration, job sources and output layout."""

    defaults: str | dict[str, Any] = Field(description="A preset name, a config file, or a config mapping.")
    output: str = Field(description="The output root folder.")
    manifest: str | None = Field(
        default=None, description="The manifest file (default: manifest.sqlite in the output root), e.g. on local disk."
    )
    layout: str = Field(default="{out}/{moving_stem}_to_{fixed_stem}", description="Each job's output folder.")
    jobs: Seq[JobEntry] = Field(default=(), description="Explicit pairs.")
    csv: str | None = Field(default=None, description="A CSV of pairs (columns fixed, moving, ...).")
    glob: GlobSpec | None = Field(default=None, description="Pairs from glob patterns.")

    @field_validator("layout")
    @classmethod
    def _layout(cls, layout: str) -> str:
        fields = {name for _, name, _, _ in string.Formatter().parse(layout) if name is not None}
        unknown = fields - _LAYOUT_FIELDS
        if unknown:
            raise _invalid(f"unknown field {{{sorted(unknown)[0]}}} (fields: {', '.join(sorted(_LAYOUT_FIELDS))})")
        if not layout.startswith("{out}/"):
            raise _invalid("must start with {out}/ (job folders live in the output root)")
        return layout

    @model_validator(mode="after")
    def _sources(self) -> BatchSpec:
        if not self.jobs and self.csv is None and self.glob is None:
            raise _invalid("no jobs: give `jobs`, `csv` or `glob`")
        return self


# ---------------------------------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One registration of a plan: absolute input paths (None where not given), its configuration, its folder."""

    name: str  # the output folder relative to the output root: the job's key in the manifest
    inputs: dict[str, Path | None]  # INPUT_KEYS -> path
    config: RegistrationConfig
    out_dir: Path

    @property
    def config_hash(self) -> str:
        """:func:`regkit.config.config_hash` of the job's configuration."""
        return config_hash(self.config)

    def fingerprint(self) -> str:
        """The inputs' paths, sizes and modification times (ns), as JSON: what a rerun compares."""
        stats = []
        for key in INPUT_KEYS:
            path = self.inputs[key]
            if path is not None:
                try:
                    st = path.stat()
                    stats.append([key, str(path), st.st_size, st.st_mtime_ns])
                except FileNotFoundError:  # removed since the plan was made: the job fails when it reads it
                    stats.append([key, str(path), None, None])
        return json.dumps(stats)


@dataclass(frozen=True)
class Plan:
    """A validated batch: the spec file, the output root, the jobs in order and the manifest file (by default
    :data:`MANIFEST` in the output root)."""

    spec_path: Path
    root: Path
    jobs: list[Job]
    manifest: Path


def _stem(path: Path) -> str:
    name = path.name
    for suffix in _IMAGE_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


@dataclass
class _Draft:
    """A job before its configuration is validated: inputs, where each was set, and its config override."""

    inputs: dict[str, Path | None]
    where: dict[str, str]  # input key -> 'FILE:LINE: key.path' for messages
    config: str | dict[str, Any] | None = None
    config_path: KeyPath = ()


class _SpecReader:
    """Turns a parsed spec layer into jobs, with a located message for every problem."""

    def __init__(self, layer: _Layer, folder: Path) -> None:
        self.layer, self.folder = layer, folder

    def where(self, path: KeyPath) -> str:
        """``FILE:LINE: key.path`` of ``path`` (or of its nearest parent that was set in the file)."""
        found = next(path[:n] for n in range(len(path), -1, -1) if path[:n] in self.layer.origins)
        label, line = self.layer.origins[found]
        return f"{label}:{line}: {_format_path(path) or 'top level'}"

    def path(self, value: str, base: Path | None = None) -> Path:
        """``value`` as an absolute path, relative to ``base`` (default: the spec's folder)."""
        return Path(os.path.abspath((base or self.folder) / Path(value).expanduser()))

    def glob(self, pattern: str, key: KeyPath) -> list[Path]:
        matches = sorted(Path(p) for p in globlib.glob(str(self.path(pattern))))
        if not matches:
            raise ConfigError(f"{self.where(key)}: {pattern!r} matches no file")
        return matches

    def explicit(self, spec: BatchSpec) -> list[_Draft]:
        drafts = []
        for i, entry in enumerate(spec.jobs):
            inputs = {k: None if getattr(entry, k) is None else self.path(getattr(entry, k)) for k in INPUT_KEYS}
            where = {k: self.where(("jobs", i, k)) for k in INPUT_KEYS}
            drafts.append(_Draft(inputs, where, entry.config, ("jobs", i, "config")))
        return drafts

    def from_csv(self, value: str) -> list[_Draft]:
        csv_path = self.path(value)
        where = self.where(("csv",))
        try:
            text = csv_path.read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"{where}: cannot read {csv_path} ({err.strerror})") from None
        reader = csv.DictReader(text.splitlines())
        columns = reader.fieldnames or []
        unknown = [c for c in columns if c not in INPUT_KEYS]
        missing = [c for c in ("fixed", "moving") if c not in columns]
        if unknown or missing:
            problem = f"unknown column {unknown[0]!r}" if unknown else f"missing column {missing[0]!r}"
            raise ConfigError(f"{csv_path}:1: {problem} (columns: {', '.join(INPUT_KEYS)})")
        drafts = []
        for row in reader:
            line = reader.line_num
            if not row.get("fixed") or not row.get("moving"):
                raise ConfigError(f"{csv_path}:{line}: fixed and moving must both be given")
            inputs = {k: self.path(row[k], csv_path.parent) if row.get(k) else None for k in INPUT_KEYS}
            drafts.append(_Draft(inputs, {k: f"{csv_path}:{line}: {k}" for k in INPUT_KEYS}))
        if not drafts:
            raise ConfigError(f"{where}: {csv_path} lists no pairs")
        return drafts

    def from_glob(self, spec: GlobSpec) -> list[_Draft]:
        def draft(fixed: Path, moving: Path, fkey: str, mkey: str) -> _Draft:
            inputs: dict[str, Path | None] = dict.fromkeys(INPUT_KEYS)
            inputs.update(fixed=fixed, moving=moving)
            return _Draft(inputs, {"fixed": self.where(("glob", fkey)), "moving": self.where(("glob", mkey))})

        if spec.pairing == "atlas":
            assert spec.atlas is not None and spec.images is not None  # GlobSpec checked the keys of the rule
            atlas = self.path(spec.atlas)
            return [draft(atlas, image, "atlas", "images") for image in self.glob(spec.images, ("glob", "images"))]
        if spec.pairing == "within_folder":
            assert spec.images is not None
            folders: dict[Path, list[Path]] = {}
            for image in self.glob(spec.images, ("glob", "images")):
                folders.setdefault(image.parent, []).append(image)
            return [
                draft(a, b, "images", "images")
                for images in folders.values()
                for i, a in enumerate(images)
                for b in images[i + 1 :]
            ]
        keyed = {}
        for role in ("fixed", "moving"):
            pattern: str = getattr(spec, role)
            prefix, suffix = Path(pattern).name.split("*")
            files = self.glob(pattern, ("glob", role))
            keyed[role] = {f.name[len(prefix) : len(f.name) - len(suffix)]: f for f in files}
        common = sorted(keyed["fixed"].keys() & keyed["moving"].keys())
        if not common:
            raise ConfigError(f"{self.where(('glob', 'pairing'))}: no fixed and moving files share a '*' part")
        return [draft(keyed["fixed"][k], keyed["moving"][k], "fixed", "moving") for k in common]

    def config_layer(self, value: str | dict[str, Any], key: KeyPath) -> _Layer:
        """The configuration layer of a preset/file name or a mapping set at ``key`` in the spec."""
        where = f"{self.where(key)}: "
        if isinstance(value, str):
            return _read_layers(_open(value, self.folder, where), ())
        origins = {p[len(key) :]: o for p, o in self.layer.origins.items() if p[: len(key)] == key}
        data = _resolve_paths(value, self.folder)
        if "base" not in data:
            return _Layer(data, origins)
        ref = data.pop("base")
        if not isinstance(ref, str):
            raise ConfigError(f"{self.where((*key, 'base'))}: expected a preset name or a file path")
        base = _read_layers(_open(ref, self.folder, f"{self.where((*key, 'base'))}: "), ())
        return _merge(base, _Layer(data, {p: o for p, o in origins.items() if p[:1] != ("base",)}))


def _validate_config(layer: _Layer) -> RegistrationConfig:
    try:
        return RegistrationConfig.model_validate(layer.data)
    except ValidationError as err:
        raise ConfigError(_first_error(err, layer)) from None


def _check_input(path: Path, where: str) -> None:
    """Raise a located :class:`ConfigError` unless ``path`` is a DICOM folder or an image whose header reads."""
    import SimpleITK as sitk

    from regkit.errors import ImageReadError
    from regkit.io import _format_of

    if path.is_dir():
        return
    if not path.is_file():
        raise ConfigError(f"{where}: no such file: {path}")
    try:
        _format_of(path, ImageReadError)
    except ImageReadError as err:
        raise ConfigError(f"{where}: {err}") from None
    reader = sitk.ImageFileReader()
    reader.SetFileName(str(path))
    try:
        reader.ReadImageInformation()
    except RuntimeError:
        raise ConfigError(f"{where}: cannot read the image header of {path} (corrupt or not an image)") from None


def load_spec(spec_path: str | os.PathLike, manifest: str | os.PathLike | None = None) -> Plan:
    """Read and validate a batch spec (module docstring) into a :class:`Plan`, checking every input's header.
    ``manifest`` (``--manifest``), relative to the current folder, replaces the spec's ``manifest``.

    Raises :class:`~regkit.errors.ConfigError` ``FILE:LINE: key.path: message`` on the first problem.
    """
    spec_path = Path(spec_path)
    try:
        text = spec_path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{spec_path}: no such file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{spec_path}: not a UTF-8 text file") from None
    layer = _parse(text, str(spec_path))
    try:
        spec = BatchSpec.model_validate(layer.data)
    except ValidationError as err:
        raise ConfigError(_first_error(err, layer)) from None
    folder = spec_path.parent.absolute()
    reader = _SpecReader(layer, folder)
    drafts = reader.explicit(spec)
    if spec.csv is not None:
        drafts += reader.from_csv(spec.csv)
    if spec.glob is not None:
        drafts += reader.from_glob(spec.glob)

    root = reader.path(spec.output)
    if manifest is not None:
        manifest_path, where = Path(os.path.abspath(manifest)), "--manifest"
    elif spec.manifest is not None:
        manifest_path, where = reader.path(spec.manifest), reader.where(("manifest",))
    else:
        manifest_path, where = root / MANIFEST, reader.where(("output",))
    if manifest_path.is_dir():
        raise ConfigError(f"{where}: the manifest {manifest_path} is a folder; give a file path")
    defaults = reader.config_layer(spec.defaults, ("defaults",))
    default_config = _validate_config(defaults)
    checked: set[Path] = set()
    seen: dict[Path, str] = {}
    jobs = []
    for index, draft in enumerate(drafts):
        for key in INPUT_KEYS:
            path = draft.inputs[key]
            if path is not None and path not in checked:
                _check_input(path, draft.where[key])
                checked.add(path)
        config = default_config
        if draft.config is not None:
            over = reader.config_layer(draft.config, draft.config_path)
            config = _validate_config(over if isinstance(draft.config, str) else _merge(defaults, over))
        fixed, moving = draft.inputs["fixed"], draft.inputs["moving"]
        assert fixed is not None and moving is not None
        out_dir = Path(
            os.path.normpath(
                spec.layout.format(
                    out=root,
                    fixed_stem=_stem(fixed),
                    moving_stem=_stem(moving),
                    fixed_parent=fixed.parent.name,
                    moving_parent=moving.parent.name,
                    index=index,
                )
            )
        )
        if out_dir == root or root not in out_dir.parents:
            raise ConfigError(f"{reader.where(('layout',))}: {out_dir} is not a folder inside the output root {root}")
        if out_dir in seen:
            raise ConfigError(
                f"{draft.where['moving']}: job {index} ({fixed.name}, {moving.name}) has the same output folder "
                f"{out_dir} as {seen[out_dir]}; use a layout with more fields (e.g. {{index}} or {{fixed_parent}})"
            )
        seen[out_dir] = f"job {index} ({fixed.name}, {moving.name})"
        jobs.append(Job(out_dir.relative_to(root).as_posix(), draft.inputs, config, out_dir))
    return Plan(spec_path.absolute(), root, jobs, manifest_path)


# ---------------------------------------------------------------------------------------------------------------------
# Manifest and lock
# ---------------------------------------------------------------------------------------------------------------------

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

    def mark_pending(self, jobs: list[Job]) -> None:
        """Insert a pending row for each job the manifest does not hold yet."""
        with self._connect() as con:
            con.executemany(
                "INSERT OR IGNORE INTO jobs (name, state, inputs, config_hash) VALUES (?, 'pending', ?, ?)",
                [(job.name, job.fingerprint(), job.config_hash) for job in jobs],
            )


class BatchLockedError(RegkitError):
    """Another batch run holds the output root's lock."""


@contextlib.contextmanager
def lock_output_root(root: Path) -> Iterator[Path]:
    """Create ``root`` and hold ``root/.batch.lock`` while the block runs; ``root/.batch.holder`` names the holder
    (pid, host, start time).

    The lock is a :class:`filelock.FileLock`: ``flock`` on Linux and macOS, ``msvcrt.locking`` on Windows, released
    by the operating system when the process ends, even killed with ``kill -9``. Where the file system has no file
    locks (``flock`` fails with ENOSYS, e.g. Lustre mounted without ``flock``), filelock falls back to a lock file
    created exclusively (``O_EXCL``) with the holder's pid and host, which it removes on release; a later run on the
    same host takes over the file of a process that is gone, one left by a killed run on another host stays until it
    is deleted.

    Raises :class:`BatchLockedError` naming the lock file and its holder if another process (or another block of this
    one) holds it.
    """
    root.mkdir(parents=True, exist_ok=True)
    lock_path, holder_path = root / _LOCK, root / _HOLDER
    lock = FileLock(str(lock_path), timeout=0)
    try:
        with warnings.catch_warnings():  # filelock warns of the fallback described above
            warnings.filterwarnings("ignore", "flock not supported", UserWarning)
            lock.acquire()
    except Timeout:
        try:
            holder = holder_path.read_text(encoding="utf-8").strip() or "another process"
        except FileNotFoundError:
            holder = "another process"
        raise BatchLockedError(
            f"{lock_path} is held by {holder}: another regkit batch run uses this output root; wait for it to end "
            f"(if that process is gone, delete {lock_path})"
        ) from None
    try:
        _write_atomically(holder_path, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%c')}\n")
        yield lock_path
    finally:
        holder_path.unlink(missing_ok=True)
        lock.release()


# ---------------------------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------------------------


def plan_actions(plan: Plan, rows: dict[str, dict[str, Any]], retry_failed: bool, force: bool) -> list[str]:
    """What a run does with each job of ``plan`` given the manifest ``rows``: ``run``, ``skip (done)`` (done, inputs
    and configuration unchanged, output folder complete) or ``skip (failed)`` (failed, unchanged, no ``retry_failed``).
    """
    actions = []
    for job in plan.jobs:
        row = rows.get(job.name)
        if force or row is None or row["inputs"] != job.fingerprint() or row["config_hash"] != job.config_hash:
            actions.append("run")
        elif row["state"] == "done" and (job.out_dir / "transform.json").is_file():
            actions.append("skip (done)")
        elif row["state"] == "failed" and not retry_failed:
            actions.append("skip (failed)")
        else:
            actions.append("run")
    return actions


@dataclass(frozen=True)
class JobOutcome:
    """What happened to one job: ``done``, ``failed`` (with its one-line error) or ``skipped`` (with the earlier
    state)."""

    name: str
    state: Literal["done", "failed", "skipped"]
    error: str | None = None
    seconds: float = 0.0
    device: str | None = None
    previous: str | None = None  # for skipped jobs: the manifest's state (done or failed)
    worker: str | None = None  # host:pid of the process that ran it; in dask, 'NAME on host:pid' (the worker's name)
    started: float | None = None  # when it started (seconds since the epoch)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if isinstance(err, RegkitError) else f"{type(err).__name__}: {text}"


def _register_job(job: Job) -> str:
    """Read the job's inputs, register and write its output folder; returns the device used."""
    from regkit.engine import register
    from regkit.outputs import read_registration_inputs, write_outputs

    fixed, moving = job.inputs["fixed"], job.inputs["moving"]
    assert fixed is not None and moving is not None  # every job has both
    paths = {key: path for key, path in job.inputs.items() if key not in ("fixed", "moving")}
    inputs = read_registration_inputs(fixed, moving, **paths)
    result = register(
        inputs.fixed,
        inputs.moving,
        job.config,
        fixed_mask=inputs.fixed_mask,
        moving_mask=inputs.moving_mask,
    )
    write_outputs(
        result,
        job.out_dir,
        moving_labels=inputs.moving_labels,
        fixed_labels=inputs.fixed_labels,
        overwrite=True,
    )
    return result.device


def execute_job(job: Job) -> JobOutcome:
    """Register one job and write its output folder, in this process; its outcome: ``done``, or ``failed`` with the
    one-line error (any exception but KeyboardInterrupt, out-of-memory included), with the runtime, the device
    (:func:`device_label`) and this process (host:pid). Writes no manifest: the process running the batch records
    the outcome (:meth:`Manifest.finish`). The one job runner of every executor."""
    worker, started, start = f"{socket.gethostname()}:{os.getpid()}", time.time(), time.perf_counter()
    try:
        device = _register_job(job)
    except Exception as err:
        return JobOutcome(job.name, "failed", _one_line(err), time.perf_counter() - start, None, None, worker, started)
    return JobOutcome(job.name, "done", None, time.perf_counter() - start, device_label(device), None, worker, started)


def run_job(job: Job, manifest: Path) -> JobOutcome:
    """Run one job in this process (:func:`execute_job`) and record it in the manifest at ``manifest``: running, then
    its outcome."""
    book = Manifest(manifest)
    book.start([job], f"{socket.gethostname()}:{os.getpid()}")
    outcome = execute_job(job)
    book.finish(outcome)
    return outcome


def device_label(device: str) -> str:
    """How the manifest and the reports name the device a job ran on: ``device`` (``cpu``, ``cuda``, ``cuda:N``), and
    for a CUDA device of a process whose ``CUDA_VISIBLE_DEVICES`` is set (a pinned worker) also the GPUs it saw, e.g.
    ``cuda (CUDA_VISIBLE_DEVICES=3)``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device.startswith("cuda") and visible:
        return f"{device} (CUDA_VISIBLE_DEVICES={visible})"
    return device


@dataclass(frozen=True)
class LocalWorker:
    """One worker process of the dask executor's LocalCluster."""

    name: str
    threads: int  # CPU threads of torch in the worker (OMP_NUM_THREADS, REGKIT_WORKER_THREADS)
    gpu: int | None  # the one GPU the worker sees (CUDA_VISIBLE_DEVICES); None without GPUs

    @property
    def env(self) -> dict[str, str]:
        """The worker process's environment variables: ``OMP_NUM_THREADS`` and :data:`WORKER_THREADS` (its torch
        threads) and, if pinned, ``CUDA_VISIBLE_DEVICES``."""
        env = {"OMP_NUM_THREADS": str(self.threads), WORKER_THREADS: str(self.threads)}
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
        return env

    @property
    def resources(self) -> dict[str, float]:
        """The dask resources the worker declares: ``GPU=1`` if pinned to a GPU, none otherwise."""
        return {} if self.gpu is None else {"GPU": 1}


def plan_local_workers(workers: int | None, gpus: int, cpus: int) -> list[LocalWorker]:
    """The worker processes of the dask executor's LocalCluster.

    With ``gpus`` > 0: ``workers`` (default: one per GPU) processes, worker ``i`` pinned to GPU ``i mod gpus`` (so more
    workers than GPUs share them evenly, fewer use the first ones). Without GPUs: ``workers`` (default 2) processes.
    The ``cpus`` cores are shared evenly: ``max(1, cpus // n)`` torch threads per worker.
    """
    n = workers if workers is not None else gpus or 2
    if n < 1:
        raise ValueError(f"workers must be at least 1, got {n}")
    threads = max(1, cpus // n)
    return [LocalWorker(f"worker-{i}", threads, i % gpus if gpus else None) for i in range(n)]


def _cpu_count() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def job_resources(job: Job) -> dict[str, float]:
    """The dask resources the task of ``job`` asks for: ``GPU=1`` when its device is ``cuda`` or ``cuda:N``, so that
    it runs only on a worker that declares a GPU (the local cluster's pinned workers; remote workers started with
    ``--resources GPU=1``); none for ``cpu``, and none for ``auto``, which runs on whichever worker dask chooses: on
    its GPU if it sees one, else on its CPU."""
    return {"GPU": 1} if job.config.device.startswith("cuda") else {}


def _check_pinned_devices(jobs: list[Job]) -> None:
    """Pinned workers see one GPU each, as ``cuda:0``: a job configured for ``cuda:N`` (N > 0) could not run."""
    for job in jobs:
        if job.config.device.startswith("cuda:") and job.config.device != "cuda:0":
            raise RegkitError(
                f"job {job.name}: device {job.config.device!r} with --executor dask: each local worker is pinned to "
                "one GPU and sees it as 'cuda'; use device 'cuda' or 'auto'"
            )


def local_workers_for(jobs: list[Job], workers: int | None) -> list[LocalWorker]:
    """The worker processes the dask executor starts for ``jobs`` when no scheduler address is given:
    :func:`plan_local_workers` with this machine's CPU cores and its GPUs (``torch.cuda.device_count``), or no GPUs if
    every job runs on the CPU. Raises :class:`RegkitError` for a job that cannot run on them: with GPUs, one
    configured for ``cuda:N`` (N > 0: a pinned worker sees its one GPU as ``cuda``); without, one configured for
    ``cuda`` (no worker would ever take it)."""
    import torch

    gpus = 0 if all(job.config.device == "cpu" for job in jobs) else torch.cuda.device_count()
    if gpus:
        _check_pinned_devices(jobs)
    else:
        for job in jobs:
            if job_resources(job):
                raise RegkitError(
                    f"job {job.name}: device {job.config.device!r} with --executor dask, but this machine has no "
                    "CUDA GPU; use device 'auto' or 'cpu', or --scheduler with GPU workers"
                )
    return plan_local_workers(workers, gpus, _cpu_count())


@contextlib.contextmanager
def _local_cluster(workers: list[LocalWorker]) -> Iterator[Any]:
    """A ``dask.distributed`` cluster of one single-threaded worker process (Nanny) per :class:`LocalWorker`, each
    with its environment and resources, and a scheduler on 127.0.0.1 without dashboard; each worker may use ``1/n``
    of the memory (the nanny restarts a worker that exceeds it: its job fails)."""
    import logging

    from dask.distributed import Nanny, Scheduler, SpecCluster

    quiet = logging.WARNING
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard": False, "dashboard_address": None}}
    specs = {
        worker.name: {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                "env": worker.env,
                "resources": worker.resources,
                "host": "127.0.0.1",
                "memory_limit": 1 / len(workers),
                "silence_logs": quiet,
            },
        }
        for worker in workers
    }
    with SpecCluster(scheduler=scheduler, workers=specs, silence_logs=quiet) as cluster:
        yield cluster


# --- what RegkitWorkerPlugin does in each dask worker -----------------------------------------------------------------


def _version_problem(worker: Any, client_version: str) -> str | None:
    """The one-line error of a dask worker whose regkit version is not the client's, None where they are equal."""
    from regkit import __version__

    if __version__ == client_version:
        return None
    return (
        f"dask worker {worker.name} ({worker.address}) runs regkit {__version__}, this client regkit "
        f"{client_version}: install the client's version on every worker"
    )


def _pin_gpu(worker: Any) -> int:
    """Pin a dask worker that declares the GPU resource and sees several GPUs (``CUDA_VISIBLE_DEVICES`` lists more
    than one: a SLURM job with ``--gres=gpu:N`` running N worker processes) to one of them by ``CUDA_VISIBLE_DEVICES``:
    the i-th, i being its process number, the suffix ``-i`` that ``dask worker --nworkers N`` appends to the worker
    names. Returns the number of GPUs among which it chose (the workers that share its cores), 1 where it did not
    pin (one GPU or none, no GPU resource, or a name without a process number)."""
    visible = [gpu.strip() for gpu in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if gpu.strip()]
    number = re.fullmatch(r".*-(\d+)", str(worker.name))
    if not worker.state.total_resources.get("GPU") or len(visible) < 2 or number is None:
        return 1
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[int(number.group(1)) % len(visible)]
    return len(visible)


def worker_threads(worker: Any, sharing: int = 1) -> int:
    """The torch threads of a dask worker's jobs: :data:`WORKER_THREADS` where set (the local cluster sets each
    worker's share; a job script may too); else ``OMP_NUM_THREADS`` where more than 1 (e.g. exported by a job
    script); else, where it is 1 or unset (dask's nanny sets ``OMP_NUM_THREADS=1`` in its workers unless their
    environment sets it), the worker's share of the cores: the cores it may run on (its CPU affinity, on SLURM or PBS
    the job's cores) divided by its dask threads (the jobs it runs at a time) and by ``sharing``, the workers of one
    job that share them (one per GPU, :func:`_pin_gpu`).

    Raises :class:`RegkitError` naming the variable and the worker if :data:`WORKER_THREADS` is not a positive integer.
    """
    explicit = os.environ.get(WORKER_THREADS, "").strip()
    if explicit:
        if not explicit.isdigit() or int(explicit) < 1:
            raise RegkitError(f"{WORKER_THREADS}={explicit!r} on dask worker {worker.name}: give a positive integer")
        return int(explicit)
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 1:
        return int(omp)
    return max(1, _cpu_count() // max(1, worker.state.nthreads) // sharing)


def node_cache_dir(worker: Any) -> Path:
    """The folder of a dask worker's numba and Triton caches: :data:`NODE_CACHE` where set in the worker's
    environment; else ``regkit-cache`` in the node's dask scratch folder, beside the workers' own folders (the parent
    of the worker's ``local_directory``: ``<local directory>/dask-scratch-space``, the local directory being
    ``--local-directory``, dask-jobqueue's ``local_directory`` or the temporary folder, ``$TMPDIR`` or ``/tmp``),
    shared by the workers of the node and kept after they end."""
    configured = os.environ.get(NODE_CACHE, "").strip()
    if configured:
        return Path(configured).expanduser()
    return Path(worker.local_directory).parent / "regkit-cache"


def _configure_worker(worker: Any) -> dict[str, Any]:
    """Make regkit's settings in a dask worker (``RegkitWorkerPlugin.setup``): the GPU pinning, the torch threads
    (``OMP_NUM_THREADS``, which :func:`_execute_in_worker` applies), the process settings of :mod:`regkit.process`
    (the allocator, overriding dask's ``MALLOC_TRIM_THRESHOLD_``, and the OpenMP wait policy where torch is not
    imported yet) and the cache folders; returns what it set."""
    from regkit import process

    threads = worker_threads(worker, _pin_gpu(worker))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return {
        "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "threads": threads,
        "allocator": process.tune_allocator(override_env=("MALLOC_TRIM_THRESHOLD_",)),
        "wait_policy": process.set_wait_policy(),
        "caches": process.configure_caches(node_cache_dir(worker)),
    }


@functools.cache
def _worker_plugin_class() -> type:
    """The class of :func:`worker_plugin`, defined on first use: its base class is dask.distributed's, optional and
    slow to import."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class RegkitWorkerPlugin(WorkerPlugin):
        name = _PLUGIN

        def __init__(self, version: str) -> None:
            self.version = version
            self.settings: dict[str, Any] = {}

        def __reduce__(self) -> tuple[Callable[[str], Any], tuple[str]]:
            return worker_plugin, (self.version,)  # pickled as the call that makes it: the class has no global name

        def setup(self, worker: Any) -> None:
            problem = _version_problem(worker, self.version)
            if problem is not None:
                raise RegkitError(problem)
            self.settings = _configure_worker(worker)

    return RegkitWorkerPlugin


def worker_plugin(version: str) -> Any:
    """regkit's dask WorkerPlugin (``RegkitWorkerPlugin``, needs dask.distributed) for a client of regkit ``version``:
    the client of a batch registers it on the cluster, and its setup runs on every worker, present or joining later.
    It raises :class:`RegkitError` on a worker whose regkit version is not ``version``; else it makes regkit's
    settings there (:func:`_configure_worker`) and keeps what it set in its ``settings`` (a dict)."""
    return _worker_plugin_class()(version)


def _execute_in_worker(job: Job, client_version: str) -> JobOutcome:
    """:func:`execute_job` in a dask worker whose regkit version is the client's (else the job fails with that line:
    a worker that joins after the run started and fails ``RegkitWorkerPlugin``'s setup still gets jobs), with
    ``OMP_NUM_THREADS`` torch threads (set here, in the thread that runs the job, as torch may have been imported
    before the plugin set the variable); the outcome names the worker."""
    import torch
    from distributed import get_worker

    worker = get_worker()
    label = f"{worker.name} on {socket.gethostname()}:{os.getpid()}"
    problem = _version_problem(worker, client_version)
    if problem is not None:
        return JobOutcome(job.name, "failed", problem, worker=label, started=time.time())
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    return dataclasses.replace(execute_job(job), worker=label)


def _start_workers(client: Any, jobs: list[Job]) -> None:
    """Register ``RegkitWorkerPlugin`` with the client's regkit version on the cluster of ``client`` (its setup runs
    on every worker), and check that GPU jobs can be placed: if the cluster has workers and none declares the GPU
    resource, no job asking for it would ever start. Raises :class:`RegkitError` with one line on a problem."""
    from regkit import __version__

    try:
        client.register_plugin(worker_plugin(__version__), name=_PLUGIN)
    except RegkitError:
        raise
    except Exception as err:  # e.g. regkit missing on a worker, or a version without the plugin
        raise RegkitError(
            f"the dask workers of {client.scheduler.address} could not set up regkit ({_one_line(err)}); install "
            f"regkit {__version__} on every worker"
        ) from None
    gpu_job = next((job for job in jobs if job_resources(job)), None)
    workers = client.scheduler_info()["workers"]
    if gpu_job is not None and workers and not any(w.get("resources", {}).get("GPU") for w in workers.values()):
        raise RegkitError(
            f"job {gpu_job.name}: device {gpu_job.config.device!r} needs a dask worker with a GPU, but none of the "
            f"{len(workers)} workers at {client.scheduler.address} declares one: start GPU workers with --resources "
            "GPU=1 (dask-jobqueue: worker_extra_args=['--resources', 'GPU=1'])"
        )


def _run_dask(
    jobs: list[Job], manifest: Path, workers: int | None, scheduler: str | None, report: Callable[[JobOutcome], None]
) -> None:
    """Run ``jobs`` on a dask cluster (module docstring), recording each in ``manifest`` from this process and
    reporting each outcome as it arrives."""
    try:
        from dask.distributed import Client, as_completed
    except ImportError:
        raise RegkitError(
            "--executor dask needs dask.distributed: pip install 'regkit[dask]' (or 'dask[distributed]')"
        ) from None
    if not jobs:
        return
    from regkit import __version__

    with contextlib.ExitStack() as stack:
        if scheduler is None:
            cluster = stack.enter_context(_local_cluster(local_workers_for(jobs, workers)))
            client = stack.enter_context(Client(cluster))
        else:
            client = stack.enter_context(Client(scheduler))
        _start_workers(client, jobs)
        book = Manifest(manifest)  # written by this process only: the workers return their outcomes
        book.start(jobs, f"dask scheduler {client.scheduler.address}")
        futures = {
            client.submit(_execute_in_worker, job, __version__, pure=False, resources=job_resources(job) or None): job
            for job in jobs
        }
        for future in as_completed(futures):
            job = futures[future]
            try:
                outcome = future.result()
            except Exception as err:  # the worker died (e.g. killed for memory) before the job could end
                outcome = JobOutcome(job.name, "failed", _one_line(err))
            book.finish(outcome)
            report(outcome)


@dataclass
class BatchReport:
    """The outcome of every job of a run, in completion order."""

    outcomes: list[JobOutcome] = field(default_factory=list)

    @property
    def failed(self) -> list[JobOutcome]:
        """Jobs that failed in this run, or earlier and were not retried."""
        return [o for o in self.outcomes if o.state == "failed" or o.previous == "failed"]


def run_batch(
    plan: Plan,
    *,
    executor: Literal["local", "dask"] = "local",
    workers: int | None = None,
    scheduler: str | None = None,
    retry_failed: bool = False,
    force: bool = False,
    on_outcome: Callable[[JobOutcome], None] | None = None,
) -> BatchReport:
    """Run the jobs of ``plan`` that :func:`plan_actions` says to run, holding the output root's lock, and report
    each outcome (also to ``on_outcome`` as it arrives). A failing job is recorded and the others go on."""
    report = BatchReport()

    def record(outcome: JobOutcome) -> None:
        report.outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)

    with lock_output_root(plan.root):
        manifest = Manifest(plan.manifest)
        rows = manifest.rows()
        manifest.mark_pending(plan.jobs)
        todo = []
        for job, action in zip(plan.jobs, plan_actions(plan, rows, retry_failed, force), strict=True):
            if action == "run":
                todo.append(job)
            else:
                row = rows[job.name]
                record(
                    JobOutcome(job.name, "skipped", row["error"], row["seconds"] or 0.0, row["device"], row["state"])
                )
        for job in todo:  # partial outputs of runs killed while writing (write_outputs' temporary folders)
            for tmp in job.out_dir.parent.glob(f"{globlib.escape(job.out_dir.name)}.tmp-*"):
                shutil.rmtree(tmp, ignore_errors=True)
        try:
            if executor == "local":
                for job in todo:
                    record(run_job(job, plan.manifest))
            else:
                _run_dask(todo, plan.manifest, workers, scheduler, record)
        finally:
            rows = manifest.rows()
            write_summary(plan, rows)
            write_report(plan, rows)
    return report


SUMMARY_COLUMNS = (
    "name",
    "fixed",
    "moving",
    "state",
    "seconds",
    "device",
    "mean_dice_before",
    "mean_dice_after",
    "jacobian_fraction_nonpositive",
    "sdlogj",
    "error",
)
"""Columns of ``summary.csv``: the manifest's state, runtime (s) and device, and metrics from each ``metrics.json``."""


def summary_rows(plan: Plan, rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per job of ``plan``, in plan order, with the :data:`SUMMARY_COLUMNS`: state, runtime and device from
    the manifest ``rows`` (``pending`` for a job it lacks), metrics from the ``metrics.json`` of done jobs (None where
    absent, e.g. Dice without labels)."""
    table = []
    for job in plan.jobs:
        row = rows.get(job.name, {})
        metrics: dict[str, Any] = {}
        if row.get("state") == "done" and (job.out_dir / "metrics.json").is_file():
            metrics = json.loads((job.out_dir / "metrics.json").read_text())
        labels, jacobian = metrics.get("labels") or {}, metrics.get("jacobian") or {}
        table.append(
            {
                "name": job.name,
                "fixed": job.inputs["fixed"],
                "moving": job.inputs["moving"],
                "state": row.get("state", "pending"),
                "seconds": None if row.get("seconds") is None else round(row["seconds"], 3),
                "device": row.get("device"),
                "mean_dice_before": labels.get("mean_dice_before"),
                "mean_dice_after": labels.get("mean_dice_after"),
                "jacobian_fraction_nonpositive": jacobian.get("fraction_nonpositive"),
                "sdlogj": jacobian.get("sdlogj"),
                "error": row.get("error"),
            }
        )
    return table


def _write_atomically(path: Path, text: str) -> Path:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8", newline="")
    os.replace(tmp, path)
    return path


def write_summary(plan: Plan, rows: dict[str, dict[str, Any]]) -> Path:
    """Write ``summary.csv`` in the output root (atomically): the :func:`summary_rows` of ``plan``."""
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, SUMMARY_COLUMNS)
    writer.writeheader()
    writer.writerows(summary_rows(plan, rows))
    return _write_atomically(plan.root / "summary.csv", buffer.getvalue())


# ---------------------------------------------------------------------------------------------------------------------
# report.html
# ---------------------------------------------------------------------------------------------------------------------

REPORT = "report.html"
_THUMBNAIL_SIDE = 240  # pixels: the longest side of a QC thumbnail in the report

_REPORT_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; }
.meta { color: #555; margin-top: 0; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; margin: 1em 0; }
figure { margin: 0; border: 1px solid #ddd; padding: 0.5em; }
figcaption { font-weight: 600; font-size: 0.9em; }
svg text { font: 11px system-ui, sans-serif; fill: #444; }
table { border-collapse: collapse; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.5em; vertical-align: top; text-align: left; }
th { background: #f3f3f3; cursor: pointer; user-select: none; position: sticky; top: 0; }
th[data-dir="asc"]::after { content: " \\25B2"; }
th[data-dir="desc"]::after { content: " \\25BC"; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td small { color: #666; }
tr.failed td { background: #fdecec; }
tr.pending td, tr.running td { background: #fff8e0; }
td.error { max-width: 30em; font-size: 0.9em; }
img { display: block; image-rendering: auto; }
"""

# Click a header to sort by it (again: the other way); numbers numerically, text alphabetically, empty cells last.
_REPORT_JS = """
for (const th of document.querySelectorAll("#jobs thead th")) {
  th.addEventListener("click", () => {
    const table = th.closest("table"), body = table.tBodies[0], col = th.cellIndex;
    const numeric = th.dataset.type === "num", dir = th.dataset.dir === "asc" ? -1 : 1;
    for (const other of table.tHead.rows[0].cells) delete other.dataset.dir;
    th.dataset.dir = dir === 1 ? "asc" : "desc";
    const key = (row) => row.cells[col].dataset.value ?? row.cells[col].textContent.trim();
    const rows = Array.from(body.rows).sort((a, b) => {
      const x = key(a), y = key(b);
      if (x === "" || y === "") return (x === "") - (y === "");
      return dir * (numeric ? parseFloat(x) - parseFloat(y) : x.localeCompare(y));
    });
    for (const row of rows) body.appendChild(row);
  });
}
"""


def _png(rgb: Any) -> bytes:
    """An 8-bit RGB array ``(H, W, 3)`` as PNG file bytes (no filtering, zlib level 9)."""
    height, width, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def _thumbnail(path: Path) -> str | None:
    """The picture at ``path`` (a job's ``qc.png``) shrunk by block averaging to at most :data:`_THUMBNAIL_SIDE`
    pixels on its longest side, as a ``data:image/png;base64`` URI; None if it is missing or unreadable."""
    import numpy as np
    import SimpleITK as sitk

    if not path.is_file():
        return None
    try:
        rgb = sitk.GetArrayFromImage(sitk.ReadImage(str(path)))
    except RuntimeError:
        return None
    if rgb.ndim == 2:
        rgb = rgb[..., None]
    rgb = np.broadcast_to(rgb[..., :3], (*rgb.shape[:2], 3)).astype(np.float64)
    k = max(1, math.ceil(max(rgb.shape[:2]) / _THUMBNAIL_SIDE))
    h, w = max(k, rgb.shape[0] // k * k), max(k, rgb.shape[1] // k * k)
    rgb = np.pad(rgb, ((0, max(0, h - rgb.shape[0])), (0, max(0, w - rgb.shape[1])), (0, 0)))[:h, :w]
    small = rgb.reshape(h // k, k, w // k, k, 3).mean(axis=(1, 3)).round().clip(0, 255).astype(np.uint8)
    return "data:image/png;base64," + base64.b64encode(_png(np.ascontiguousarray(small))).decode("ascii")


def _histogram_svg(title: str, values: list[float], unit: str = "") -> str:
    """A histogram of ``values`` as an inline SVG figure with its title, count and median (or a note if empty)."""
    import numpy as np

    caption = f"<figcaption>{html.escape(title)}</figcaption>"
    if not values:
        return f'<figure>{caption}<p class="meta">no values</p></figure>'
    width, height, left, right, top, bottom = 320, 170, 34, 10, 10, 34
    lo, hi = min(values), max(values)
    if hi == lo:
        pad = abs(lo) * 0.05 or 0.5
        lo, hi = lo - pad, hi + pad
    counts, edges = np.histogram(values, bins=max(1, min(20, math.ceil(math.sqrt(len(values))))), range=(lo, hi))
    plot_w, plot_h = width - left - right, height - top - bottom
    bar_w, top_count = plot_w / len(counts), int(counts.max())
    parts = [f'<svg width="{width}" height="{height}" role="img">']
    for i, count in enumerate(counts):
        bar_h = plot_h * count / top_count
        x, y = left + i * bar_w, top + plot_h - bar_h
        parts.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(bar_w - 1, 1):.1f}" height="{bar_h:.1f}" fill="#4a7bb7">'
            f"<title>{edges[i]:.4g} to {edges[i + 1]:.4g}{unit}: {count}</title></rect>"
        )
    axis_y = top + plot_h
    parts += [
        f'<line x1="{left}" y1="{axis_y}" x2="{left + plot_w}" y2="{axis_y}" stroke="#888"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{axis_y}" stroke="#888"/>',
        f'<text x="{left - 4}" y="{top + 9}" text-anchor="end">{top_count}</text>',
        f'<text x="{left - 4}" y="{axis_y}" text-anchor="end">0</text>',
        f'<text x="{left}" y="{axis_y + 14}">{lo:.4g}</text>',
        f'<text x="{left + plot_w}" y="{axis_y + 14}" text-anchor="end">{hi:.4g}</text>',
        f'<text x="{left + plot_w / 2}" y="{axis_y + 28}" text-anchor="middle">'
        f"{html.escape(unit.strip() or 'value')}; n = {len(values)}, median {float(np.median(values)):.4g}</text>",
        "</svg>",
    ]
    return f"<figure>{caption}{''.join(parts)}</figure>"


def _cell(value: Any, digits: int | None = None, scale: float = 1.0, css: str = "") -> str:
    """A table cell: numbers (times ``scale``) right-aligned with ``digits`` significant digits and sorted by their
    full value, text escaped; None is an empty cell. ``css``: the cell's class."""
    if value is None or value == "":
        return '<td data-value=""></td>'
    if digits is not None:
        number = float(value) * scale
        return f'<td class="num" data-value="{number!r}">{number:.{digits}g}</td>'
    return f'<td class="{css}">{html.escape(str(value))}</td>' if css else f"<td>{html.escape(str(value))}</td>"


def write_report(plan: Plan, rows: dict[str, dict[str, Any]]) -> Path:
    """Write ``report.html`` in the output root (atomically): a self-contained page (inline CSS, JavaScript and
    images; no network) with histograms (inline SVG) of the done jobs' mean Dice before and after, folds and runtime,
    and a table of every job of ``plan`` (:func:`summary_rows`) sortable by any column, with each done job's QC
    thumbnail (from its ``qc.png``, linked to the full picture)."""
    table = summary_rows(plan, rows)
    done = [row for row in table if row["state"] == "done"]

    def values(key: str, scale: float = 1.0) -> list[float]:
        return [row[key] * scale for row in done if row[key] is not None]

    states = {state: sum(row["state"] == state for row in table) for state in ("done", "failed", "running", "pending")}
    counts = ", ".join(f"{n} {state}" for state, n in states.items() if n)
    plots = [
        _histogram_svg("Mean Dice before", values("mean_dice_before")),
        _histogram_svg("Mean Dice after", values("mean_dice_after")),
        _histogram_svg("Folds (non-positive Jacobian)", values("jacobian_fraction_nonpositive", 100.0), " %"),
        _histogram_svg("Runtime", values("seconds"), " s"),
    ]
    header = [
        ("#", "num"),
        ("job", "text"),
        ("QC", "text"),
        ("state", "text"),
        ("runtime s", "num"),
        ("device", "text"),
        ("Dice before", "num"),
        ("Dice after", "num"),
        ("folds %", "num"),
        ("SDlogJ", "num"),
        ("error", "text"),
    ]
    body = []
    for index, (job, row) in enumerate(zip(plan.jobs, table, strict=True)):
        thumbnail = _thumbnail(job.out_dir / "qc.png") if row["state"] == "done" else None
        qc = '<td data-value=""></td>'
        if thumbnail is not None:
            link = html.escape(f"{job.name}/qc.png", quote=True)
            qc = f'<td data-value="{index}"><a href="{link}"><img src="{thumbnail}" alt="QC of {link}"></a></td>'
        fixed, moving = job.inputs["fixed"], job.inputs["moving"]
        assert fixed is not None and moving is not None
        title = html.escape(f"fixed {fixed}\nmoving {moving}", quote=True)
        body.append(
            f'<tr class="{html.escape(row["state"])}"><td class="num" data-value="{index}">{index}</td>'
            f'<td data-value="{html.escape(job.name, quote=True)}" title="{title}">{html.escape(job.name)}<br>'
            f"<small>{html.escape(moving.name)} to {html.escape(fixed.name)}</small></td>"
            f"{qc}{_cell(row['state'])}{_cell(row['seconds'], 4)}{_cell(row['device'])}"
            f"{_cell(row['mean_dice_before'], 3)}{_cell(row['mean_dice_after'], 3)}"
            f"{_cell(row['jacobian_fraction_nonpositive'], 3, 100.0)}{_cell(row['sdlogj'], 3)}"
            f"{_cell(row['error'], css='error')}</tr>"
        )
    title = f"regkit batch: {plan.root}"
    page = "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en">',
            '<head><meta charset="utf-8">',
            f"<title>{html.escape(title)}</title>",
            f"<style>{_REPORT_CSS}</style></head>",
            "<body>",
            f"<h1>{html.escape(title)}</h1>",
            f'<p class="meta">spec {html.escape(str(plan.spec_path))}; {len(table)} jobs: {counts}; '
            f"written {time.strftime('%Y-%m-%d %H:%M:%S')}</p>",
            f'<section class="plots">{"".join(plots)}</section>',
            '<table id="jobs"><thead><tr>'
            + "".join(f'<th data-type="{kind}">{html.escape(name)}</th>' for name, kind in header)
            + "</tr></thead>",
            "<tbody>",
            *body,
            "</tbody></table>",
            f"<script>{_REPORT_JS}</script>",
            "</body></html>",
            "",
        ]
    )
    return _write_atomically(plan.root / REPORT, page)

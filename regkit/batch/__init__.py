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
its configuration hash (:func:`regkit.config.config_hash`), its one-line error and its timings. Only the process running
the batch writes it, also with dask, whose workers return their outcomes to it. A job is skipped when its inputs and
configuration are unchanged and its output folder is complete: folders are written atomically by
:func:`regkit.results.write_outputs`, and each job's folder carries its stamp (name, configuration hash, inputs'
fingerprint) in its record, written before the folder is renamed into place; a job whose folder carries its current
stamp is done, also when a run was killed between the rename and the manifest's update (it is then recorded done, not
run again), so every job runs exactly once; failed jobs are skipped unless ``retry_failed`` (or their inputs changed);
``force`` reruns everything. A failing job is recorded and the others go on. At the end of every run (a rerun too, and
one stopped by an exception or Ctrl-C), the output root gets, written atomically, ``summary.csv`` with one row per job
of the plan (:data:`SUMMARY_COLUMNS`) and ``report.html`` (:func:`write_report`: a self-contained page with a sortable
table, QC thumbnails and metric histograms). ``.batch.lock`` in the output root is held for the whole run
(:func:`lock_output_root`): a second run on the same root is refused.

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

Pairs are registered one per call, also when several have the same shape: :func:`regkit.registration.register` optimizes
one transformation (its own tessellation schedule, stopping rule and optimizer state), and each iteration's work, the
CPAB integration at every voxel of the fixed grid's pyramid level (millions of points for a 1 mm brain), is already
one large launch on the GPU. To share one GPU among jobs, run more dask workers than GPUs (``workers`` > number of
GPUs): one job's reading, writing and CPU work then overlaps another's GPU work (``python -m benchmarks batch``
measures it).

The modules: :mod:`~regkit.batch.spec` (the spec's schema and :func:`load_spec`), :mod:`~regkit.batch.plan` (jobs,
plan, what a run does with each job), :mod:`~regkit.batch.manifest` (the manifest and the lock),
:mod:`~regkit.batch.jobs` (one job), :mod:`~regkit.batch.dask` (the dask executor), :mod:`~regkit.batch.report`
(``summary.csv``, ``report.html``), :mod:`~regkit.batch.run` (:func:`run_batch`) and :mod:`~regkit.batch.atomic`
(atomic text files).
"""

from __future__ import annotations

# --- the dask executor: local workers, resources, the worker plugin --------------------------------------------------
from regkit.batch.dask import (
    NODE_CACHE,
    WORKER_THREADS,
    LocalWorker,
    job_resources,
    local_workers_for,
    node_cache_dir,
    plan_local_workers,
    worker_plugin,
    worker_threads,
)

# --- one job ---------------------------------------------------------------------------------------------------------
from regkit.batch.jobs import JobOutcome, device_label, execute_job, run_job

# --- the manifest and the lock of the output root --------------------------------------------------------------------
from regkit.batch.manifest import MANIFEST, BatchLockedError, Manifest, ManifestError, lock_output_root

# --- the plan: jobs, what a run does with each -----------------------------------------------------------------------
from regkit.batch.plan import INPUT_KEYS, Job, Plan, plan_actions

# --- summary.csv and report.html -------------------------------------------------------------------------------------
from regkit.batch.report import REPORT, SUMMARY_COLUMNS, summary_rows, write_report, write_summary

# --- a batch run -----------------------------------------------------------------------------------------------------
from regkit.batch.run import BatchReport, run_batch

# --- the spec: its schema, load_spec ---------------------------------------------------------------------------------
from regkit.batch.spec import BatchSpec, GlobSpec, JobEntry, load_spec

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
    "GlobSpec",
    "Job",
    "JobEntry",
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

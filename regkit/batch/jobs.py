"""One job: :func:`execute_job` registers it and writes its output folder (the one job runner of every executor),
:func:`run_job` also records it in the manifest (the local executor), :class:`JobOutcome` is what happened."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from regkit.batch.manifest import Manifest
from regkit.batch.plan import Job
from regkit.errors import RegkitError


@dataclass(frozen=True, kw_only=True)
class JobOutcome:
    """What happened to one job: ``done``, ``failed`` (with its one-line error) or ``skipped`` (with the earlier
    state). Built by keyword only."""

    name: str
    state: Literal["done", "failed", "skipped"]
    error: str | None = None
    seconds: float = 0.0
    device: str | None = None
    previous: str | None = None  # for skipped jobs: the manifest's state (done or failed)
    worker: str | None = None  # host:pid of the process that ran it; in dask, 'NAME on host:pid' (the worker's name)
    started: float | None = None  # when it started (seconds since the epoch)


def one_line(err: BaseException) -> str:
    """The one-line error of ``err`` in the manifest and the reports: its message on one line, after its type
    name unless it is a :class:`~regkit.errors.RegkitError` (whose messages name the problem)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if isinstance(err, RegkitError) else f"{type(err).__name__}: {text}"


def _register_job(job: Job, record: dict[str, Any]) -> str:
    """Read the job's inputs, register and write its output folder, with ``record`` and the device in the folder's
    job record; returns the device used."""
    from regkit.io import read_registration_inputs
    from regkit.registration import register
    from regkit.results import write_outputs

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
        overwrite=True,  # a rerun replaces the job's earlier output folder, never one holding other files or inputs
        inputs=job.inputs.values(),
        job={**record, "device": device_label(result.device)},
    )
    return result.device


def execute_job(job: Job) -> JobOutcome:
    """Register one job and write its output folder, in this process; its outcome: ``done``, or ``failed`` with the
    one-line error (any exception but KeyboardInterrupt, out-of-memory included), with the runtime, the device
    (:func:`device_label`) and this process (host:pid). Writes no manifest: the process running the batch records
    the outcome (:meth:`Manifest.finish`). The one job runner of every executor.

    The output folder's job record (:meth:`Job.recorded`) gets the job's stamp, its run (``job.run_id``), this
    process, the start time and the device. A job whose folder already carries its stamp and its run, a task that dask
    runs again after its worker died once the folder was in place, is not registered again: its recorded outcome."""
    worker, started, start = f"{socket.gethostname()}:{os.getpid()}", time.time(), time.perf_counter()
    if job.run_id is not None:
        record = job.recorded()
        if record is not None and record.get("run") == job.run_id:
            return _recorded(job, record)
    try:
        device = _register_job(job, {**job.stamp(), "run": job.run_id, "started": started, "worker": worker})
    except Exception as err:
        return JobOutcome(
            name=job.name,
            state="failed",
            error=one_line(err),
            seconds=time.perf_counter() - start,
            worker=worker,
            started=started,
        )
    return JobOutcome(
        name=job.name,
        state="done",
        seconds=time.perf_counter() - start,
        device=device_label(device),
        worker=worker,
        started=started,
    )


def recorded_outcome(job: Job) -> JobOutcome | None:
    """The outcome of ``job`` as its output folder records it, if that folder carries the job's current stamp
    (:meth:`Job.recorded`): ``done``, with the process, start time and device of the run that wrote it and the
    runtime up to the writing of the record; None otherwise."""
    record = job.recorded()
    return None if record is None else _recorded(job, record)


def _recorded(job: Job, record: dict[str, Any]) -> JobOutcome:
    """The ``done`` outcome that the job record ``record`` of ``job``'s output folder describes."""
    from regkit.results import OUTPUT_FILES

    written = (job.out_dir / OUTPUT_FILES["record"]).stat().st_mtime
    started, device, worker = record.get("started"), record.get("device"), record.get("worker")
    started = float(started) if isinstance(started, (int, float)) else None
    return JobOutcome(
        name=job.name,
        state="done",
        seconds=0.0 if started is None else max(0.0, written - started),
        device=device if isinstance(device, str) else None,
        worker=worker if isinstance(worker, str) else None,
        started=started,
    )


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

"""Running a batch (:func:`run_batch`): the output root's lock, the manifest, the jobs to run by the local or the
dask executor, and ``summary.csv`` and ``report.html`` at the end of every run."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from regkit.batch.dask import run_dask
from regkit.batch.jobs import JobOutcome, recorded_outcome, run_job
from regkit.batch.manifest import Manifest, lock_output_root
from regkit.batch.plan import Plan, plan_actions
from regkit.batch.report import write_report, write_summary

if TYPE_CHECKING:
    from distributed import Security


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
    security: Security | None = None,
    retry_failed: bool = False,
    force: bool = False,
    on_outcome: Callable[[JobOutcome], None] | None = None,
) -> BatchReport:
    """Run the jobs of ``plan`` that :func:`plan_actions` says to run, holding the output root's lock (which also
    refuses nested batches, :func:`lock_output_root`), and report each outcome (also to ``on_outcome`` as it arrives).
    A failing job is recorded and the others go on.

    Exactly once: first, what killed runs left beside the job folders is cleaned up
    (:func:`regkit.results.remove_leftovers`); a job whose output folder carries its current stamp but which the
    manifest does not say is done (``record done``: its run was killed after the folder's rename) is recorded done and
    reported skipped (previous state ``done``), not run again. Each job run gets this run's id in its folder's record,
    so that a task that dask runs again after its worker died once the folder was in place is not registered twice
    (:func:`regkit.batch.execute_job`)."""
    report = BatchReport()

    def record(outcome: JobOutcome) -> None:
        report.outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)

    from regkit.results.folder import remove_leftovers

    with lock_output_root(plan.root, [job.out_dir for job in plan.jobs]):
        remove_leftovers(job.out_dir for job in plan.jobs)  # before the plan: a folder moved aside may come back
        manifest = Manifest(plan.manifest)
        rows = manifest.rows()
        manifest.mark_pending(plan.jobs)
        run_id = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        todo, found, skipped = [], [], []
        for job, action in zip(plan.jobs, plan_actions(plan, rows, retry_failed, force), strict=True):
            outcome = recorded_outcome(job) if action == "record done" else None
            if outcome is not None:
                found.append((job, outcome))
                skipped.append(dataclasses.replace(outcome, state="skipped", previous="done"))
            elif action in ("run", "record done"):  # a record gone since the plan: run
                todo.append(dataclasses.replace(job, run_id=run_id))
            else:
                row = rows[job.name]
                skipped.append(
                    JobOutcome(
                        name=job.name,
                        state="skipped",
                        error=row["error"],
                        seconds=row["seconds"] or 0.0,
                        device=row["device"],
                        previous=row["state"],
                    )
                )
        manifest.record_done(found)
        for outcome in skipped:
            record(outcome)
        try:
            if executor == "local":
                for job in todo:
                    record(run_job(job, plan.manifest))
            else:
                run_dask(todo, plan.manifest, workers, scheduler, record, security)
        finally:
            rows = manifest.rows()
            write_summary(plan, rows)
            write_report(plan, rows)
    return report

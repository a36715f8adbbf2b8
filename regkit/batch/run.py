"""Running a batch (:func:`run_batch`): the output root's lock, the manifest, the jobs to run by the local or the
dask executor, and ``summary.csv`` and ``report.html`` at the end of every run."""

from __future__ import annotations

import glob as globlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from regkit.batch.dask import run_dask
from regkit.batch.jobs import JobOutcome, run_job
from regkit.batch.manifest import Manifest, lock_output_root
from regkit.batch.plan import Plan, plan_actions
from regkit.batch.report import write_report, write_summary


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
                    JobOutcome(
                        name=job.name,
                        state="skipped",
                        error=row["error"],
                        seconds=row["seconds"] or 0.0,
                        device=row["device"],
                        previous=row["state"],
                    )
                )
        for job in todo:  # partial outputs of runs killed while writing (write_outputs' temporary folders)
            for tmp in job.out_dir.parent.glob(f"{globlib.escape(job.out_dir.name)}.tmp-*"):
                shutil.rmtree(tmp, ignore_errors=True)
        try:
            if executor == "local":
                for job in todo:
                    record(run_job(job, plan.manifest))
            else:
                run_dask(todo, plan.manifest, workers, scheduler, record)
        finally:
            rows = manifest.rows()
            write_summary(plan, rows)
            write_report(plan, rows)
    return report

"""``regkit batch SPEC.yaml``: run the registrations of a batch spec (``regkit.batch``), resumable."""

from __future__ import annotations

import warnings
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer


class Executor(str, Enum):
    local = "local"
    dask = "dask"


def _plan_table(plan, actions: list[str]):
    from rich.table import Table

    table = Table(title=f"{len(plan.jobs)} jobs -> {plan.root}")
    for column in ("#", "fixed", "moving", "output", "config", "action"):
        table.add_column(column, overflow="fold")
    for i, (job, action) in enumerate(zip(plan.jobs, actions, strict=True)):
        table.add_row(
            str(i), job.inputs["fixed"].name, job.inputs["moving"].name, job.name, job.config_hash[:8], action
        )
    return table


def _warn_on_one_line(message, category, filename, lineno, file=None, line=None) -> None:
    """Print a warning as ``warning: MESSAGE`` on one line of stderr (``warnings.showwarning``'s signature)."""
    typer.echo(f"warning: {' '.join(str(message).split())}", err=True)


def batch(
    spec: Annotated[Path, typer.Argument(help="Batch spec (YAML): defaults, jobs/csv/glob, output, layout.")],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Validate, print the plan as a table and write nothing.")
    ] = False,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="Rerun jobs that failed before.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Rerun every job, even those done.")] = False,
    executor: Annotated[
        Executor, typer.Option(help="local: one job after another here; dask: a dask.distributed cluster.")
    ] = Executor.local,
    workers: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Worker processes of the local dask cluster (default: one per GPU, each pinned to its GPU; 2 without "
            "GPUs). More workers than GPUs share them.",
        ),
    ] = None,
    scheduler: Annotated[
        str | None,
        typer.Option(
            help="Address of a running dask scheduler (e.g. from dask-jobqueue) instead, tls://HOST:PORT with the "
            "--tls-* files (tcp:// is neither encrypted nor authenticated); jobs with device cuda run only on its "
            "workers that declare --resources GPU=1."
        ),
    ] = None,
    tls_ca_file: Annotated[
        Path | None,
        typer.Option(
            "--tls-ca-file",
            help="With --scheduler tls://...: the certificate (PEM) of the authority that signed the cluster's "
            "certificates (default: dask's distributed.comm.tls.ca-file).",
        ),
    ] = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option(
            "--tls-cert",
            help="With --scheduler tls://...: this client's certificate (PEM; default: dask's "
            "distributed.comm.tls.client.cert).",
        ),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option(
            "--tls-key",
            help="With --scheduler tls://...: the private key of --tls-cert, unless that file holds it (default: "
            "dask's distributed.comm.tls.client.key).",
        ),
    ] = None,
    manifest: Annotated[
        Path | None,
        typer.Option(
            help="The manifest file (default: the spec's `manifest`, else manifest.sqlite in the output root), e.g. on "
            "a local disk when the output root is on a network file system."
        ),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")] = False,
) -> None:
    """Register every pair of SPEC into its own output folder, skipping jobs already done.

    Everything is validated (schema, configurations, every input's header) before any work. The output root holds
    manifest.sqlite (each job's state, inputs' sizes/mtimes, config hash, error, timings; --manifest puts it
    elsewhere), .batch.lock (a second run on the same root is refused), and after every run summary.csv and
    report.html (sortable table, QC thumbnails, metric histograms). A failing job is recorded and the others go on;
    the exit code is 1 if any job failed (now or earlier and not retried).
    """
    from rich.console import Console

    from regkit.batch import Manifest, load_spec, local_workers_for, plan_actions, run_batch
    from regkit.batch.dask import scheduler_protocol, tls_security
    from regkit.errors import RegkitError

    tls_files = (tls_ca_file, tls_cert, tls_key)
    if scheduler is not None and executor is not Executor.dask:
        raise RegkitError("--scheduler goes with --executor dask")
    if scheduler is None and any(tls_files):
        raise RegkitError("--tls-ca-file, --tls-cert and --tls-key go with --scheduler tls://HOST:PORT")
    if scheduler is not None:
        scheduler_protocol(scheduler)  # a bad address is refused before the spec's checks
    plan = load_spec(spec, manifest)
    if dry_run:
        actions = plan_actions(plan, Manifest.read_only(plan.manifest), retry_failed, force)
        console = Console(width=160)
        console.print(_plan_table(plan, actions))
        if executor is Executor.dask and scheduler is None:
            todo = [job for job, action in zip(plan.jobs, actions, strict=True) if action == "run"]
            for worker in local_workers_for(todo or plan.jobs, workers):
                gpu = "no GPU" if worker.gpu is None else f"GPU {worker.gpu} (CUDA_VISIBLE_DEVICES={worker.gpu})"
                threads = f"{worker.threads} CPU thread{'s' if worker.threads > 1 else ''}"
                console.print(f"dask {worker.name}: {gpu}, {threads}", highlight=False)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("batch"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[counts]}"),
        console=Console(stderr=True),
        disable=quiet,
    )
    task = bar.add_task("batch", total=len(plan.jobs), counts="")
    counts = dict.fromkeys(("done", "skipped", "failed"), 0)

    def show(outcome) -> None:
        if not bar.live.is_started:  # only once the run holds the lock: an error before prints one line
            bar.start()
        counts[outcome.state] += 1
        bar.update(task, advance=1, counts=", ".join(f"{n} {state}" for state, n in counts.items() if n))
        if quiet:
            return
        if outcome.state == "skipped":
            status = f"skipped ({outcome.previous})"
        else:
            status = f"{outcome.state} in {outcome.seconds:.1f} s" + (f" on {outcome.device}" if outcome.device else "")
        error = f": {outcome.error}" if outcome.error else ""
        bar.console.print(f"{outcome.name}: {status}{error}", markup=False, highlight=False, soft_wrap=True)

    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warn_on_one_line  # e.g. that of a scheduler reached without TLS
            report = run_batch(
                plan,
                executor=executor.value,
                workers=workers,
                scheduler=scheduler,
                security=tls_security(*tls_files) if any(tls_files) else None,
                retry_failed=retry_failed,
                force=force,
                on_outcome=show,
            )
    finally:
        if bar.live.is_started:
            bar.stop()
    failed = report.failed
    if not quiet:
        states = [o.state for o in report.outcomes]
        typer.echo(
            f"{states.count('done')} done, {states.count('skipped')} skipped, {len(failed)} failed; "
            f"summary {plan.root / 'summary.csv'}, report {plan.root / 'report.html'}"
        )
    if failed:
        raise typer.Exit(1)

"""What a batch runs: its jobs (:class:`Job`, with the fingerprint of their inputs and the record of their output
folders), the validated batch (:class:`Plan`, made by :func:`regkit.batch.load_spec`) and what a run does with each job
(:func:`plan_actions`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from regkit.config import RegistrationConfig, config_hash

INPUT_KEYS = ("fixed", "moving", "fixed_labels", "moving_labels", "fixed_mask", "moving_mask")
"""The input files of a job, in the order they are listed and fingerprinted."""


@dataclass(frozen=True)
class Job:
    """One registration of a plan: absolute input paths (None where not given), its configuration, its folder."""

    name: str  # the output folder relative to the output root: the job's key in the manifest
    inputs: dict[str, Path | None]  # INPUT_KEYS -> path
    config: RegistrationConfig
    out_dir: Path
    run_id: str | None = None  # the batch run executing it (set by run_batch), recorded in its output folder

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

    def stamp(self) -> dict[str, str]:
        """What names the job's output in its folder's record (:func:`regkit.results.write_outputs`' ``job``) and in
        the manifest: its name, configuration hash and inputs' fingerprint."""
        return {"name": self.name, "config_hash": self.config_hash, "inputs": self.fingerprint()}

    def recorded(self) -> dict[str, Any] | None:
        """The job record of the output folder (:func:`regkit.results.read_job_record`: the folder is complete), if it
        carries this job's current :meth:`stamp`: the job's output is in place, whatever the manifest says (a run
        killed between the rename of the folder and the manifest's update); else None."""
        from regkit.results.folder import read_job_record

        record = read_job_record(self.out_dir)
        if record is None or any(record.get(key) != value for key, value in self.stamp().items()):
            return None
        return record


@dataclass(frozen=True)
class Plan:
    """A validated batch: the spec file, the output root, the jobs in order and the manifest file (by default
    :data:`regkit.batch.MANIFEST` in the output root)."""

    spec_path: Path
    root: Path
    jobs: list[Job]
    manifest: Path


def plan_actions(plan: Plan, rows: dict[str, dict[str, Any]], retry_failed: bool, force: bool) -> list[str]:
    """What a run does with each job of ``plan`` given the manifest ``rows``: ``skip (done)`` (done, and its output
    folder carries its current stamp: :meth:`Job.recorded`), ``record done`` (its output folder carries its current
    stamp but the manifest does not say done: the run that wrote it was killed before it could record it; the run
    records it done without running it), ``skip (failed)`` (failed with unchanged inputs and configuration, no
    ``retry_failed``) or ``run`` (everything else, and everything with ``force``)."""
    actions = []
    for job in plan.jobs:
        row = rows.get(job.name, {})
        unchanged = (row.get("inputs"), row.get("config_hash")) == (job.fingerprint(), job.config_hash)
        state = row["state"] if unchanged else None  # the manifest's state, if it is of these inputs and configuration
        if force:
            actions.append("run")
        elif job.recorded() is not None:
            actions.append("skip (done)" if state == "done" else "record done")
        elif state == "failed" and not retry_failed:
            actions.append("skip (failed)")
        else:
            actions.append("run")
    return actions

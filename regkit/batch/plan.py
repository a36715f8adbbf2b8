"""What a batch runs: its jobs (:class:`Job`, with the fingerprint of their inputs), the validated batch
(:class:`Plan`, made by :func:`regkit.batch.load_spec`) and what a run does with each job (:func:`plan_actions`)."""

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
    :data:`regkit.batch.MANIFEST` in the output root)."""

    spec_path: Path
    root: Path
    jobs: list[Job]
    manifest: Path


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

"""Exactly-once batches under kill -9: a batch killed in every window of a job (while writing its folder, before and
after the folder's rename, before and after the manifest's update; local and dask, the batch process and a dask
worker) and run again until it ends completes every job exactly once and leaves nothing behind.

Each batch run is a process forked from multiprocessing's forkserver, which imports regkit once
(tests/regkit/batch/fault_runner.py: the windows, the kill tokens, the log of every job folder's rename into place).
A chain of runs on one batch kills each run in the window at the first job not killed before, until a run ends
without a kill; then every job's folder must have been renamed into place exactly once over the whole chain, the
manifest and summary.csv say every job is done, and no temporary or moved-aside folder is left.
"""

from __future__ import annotations

import collections
import csv
import multiprocessing
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from regkit.batch import Manifest, load_spec
from tests.regkit.batch import fault_runner
from tests.regkit.batch.batch_cases import isolate_worker_settings, make_data, write_spec

LEFTOVER = re.compile(r".*\.(tmp|old|inputs)-.*")


@dataclass
class Chain:
    """What a chain of killed runs did: the kills (fired tokens), the runs' exit codes, the renames into place."""

    kills: int
    exit_codes: list[int | None]
    renames: collections.Counter[str]


def batch_of(folder: Path, jobs: int) -> Path:
    """A spec of ``jobs`` jobs, every image ``data/iN`` registered to ``data/fixed``, with the tiny configuration."""
    names = ("fixed", *(f"i{n:02d}" for n in range(jobs)))
    make_data(folder, names)
    lines = [f"  - {{fixed: data/fixed.nii.gz, moving: data/{name}.nii.gz}}" for name in names[1:]]
    return write_spec(folder, "defaults: tiny.yaml\noutput: out\njobs:\n" + "\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def forkserver():
    """A multiprocessing context whose processes are forked from a server that imported regkit once."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tests.regkit.batch.fault_runner"])
    return context


def run_chain(forkserver, spec: Path, executor: str, windows: list[str], per_run: int = 1) -> Chain:
    """Run the batch of ``spec`` once per window of ``windows``, with ``per_run`` kills armed in it, and then until a
    run ends without a kill (the last one is an ordinary rerun)."""
    folder = spec.parent
    arm, log = folder / "arm", folder / "renames.log"
    arm.mkdir()
    log.touch()
    exit_codes = []
    for run in range(len(windows) + 1):
        window = windows[run] if run < len(windows) else "none"
        fired = len(list(arm.glob("fired-*")))
        for token in range(per_run if run < len(windows) else 0):
            (arm / f"token-{run}-{token}").touch()
        process = forkserver.Process(
            target=fault_runner.run_batch_process,
            args=(spec, executor, window, arm, log, dict(os.environ)),
            daemon=False,
        )
        process.start()
        process.join(timeout=300)
        assert process.exitcode is not None, "a batch run did not end within 300 s"
        exit_codes.append(process.exitcode)
        for token in arm.glob("token-*"):  # not taken: this run had no job left to kill
            token.unlink()
        if len(list(arm.glob("fired-*"))) == fired:
            break
    return Chain(len(list(arm.glob("fired-*"))), exit_codes, collections.Counter(log.read_text().split()))


def check_exactly_once(spec: Path, chain: Chain) -> None:
    """Every job renamed into place once over the chain, done in the manifest and the summary, nothing left over."""
    plan = load_spec(spec)
    names = [job.name for job in plan.jobs]
    assert chain.exit_codes[-1] == 0  # the last run ended by itself
    assert chain.renames == collections.Counter(names), chain  # no job lost, none repeated
    rows = Manifest.read_only(plan.manifest)
    assert {name: rows[name]["state"] for name in names} == dict.fromkeys(names, "done")
    with open(plan.root / "summary.csv", newline="") as handle:
        assert {row["name"]: row["state"] for row in csv.DictReader(handle)} == dict.fromkeys(names, "done")
    assert all((job.out_dir / "transform.json").is_file() for job in plan.jobs)
    assert [p for p in plan.root.rglob("*") if LEFTOVER.fullmatch(p.name)] == []


LOCAL_WINDOWS = ["writing", "before-rename", "renamed", "finished"]


def test_a_kill_in_each_window_neither_loses_nor_repeats_a_job(tmp_path, forkserver):
    spec = batch_of(tmp_path, 4)
    chain = run_chain(forkserver, spec, "local", LOCAL_WINDOWS)  # run i kills job i in window i
    assert chain.kills == 4 and chain.exit_codes == [-signal.SIGKILL] * 4 + [0]
    check_exactly_once(spec, chain)


@pytest.mark.slow
@pytest.mark.parametrize("window", LOCAL_WINDOWS)
def test_twenty_kills_in_each_window_local(tmp_path, forkserver, window):
    spec = batch_of(tmp_path, 20)
    chain = run_chain(forkserver, spec, "local", [window] * 20)
    assert chain.kills == 20 and chain.exit_codes == [-signal.SIGKILL] * 20 + [0]
    check_exactly_once(spec, chain)
    print(f"local {window}: {chain.kills} kills, {len(chain.exit_codes)} runs, renames {dict(chain.renames)}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("window", "runs", "per_run"),
    [("writing", 1, 3), ("renamed", 1, 3), ("outcome", 3, 1), ("finished", 3, 1)],
    ids=["worker-writing", "worker-renamed", "batch-outcome", "batch-finished"],
)
def test_kills_with_dask_neither_lose_nor_repeat_a_job(tmp_path, monkeypatch, forkserver, window, runs, per_run):
    pytest.importorskip("dask.distributed")
    isolate_worker_settings(monkeypatch)
    spec = batch_of(tmp_path, 4)
    chain = run_chain(forkserver, spec, "dask", [window] * runs, per_run)
    assert chain.kills == 3
    check_exactly_once(spec, chain)
    print(f"dask {window}: {chain.kills} kills, exit codes {chain.exit_codes}, renames {dict(chain.renames)}")

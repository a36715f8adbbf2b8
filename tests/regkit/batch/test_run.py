"""``regkit.batch.run``: a run, a rerun that skips what is done, failure isolation, retry of failed jobs, force."""

from __future__ import annotations

import csv
import dataclasses
import json

from regkit.batch import Manifest, execute_job, load_spec, run_batch
from regkit.io import write_image
from regkit.results import OUTPUT_FILES
from tests.regkit.batch.batch_cases import LIST_SPEC, blob, corrupt, make_data, write_spec


def test_run_resume_failure_retry_force(tmp_path):
    make_data(tmp_path)
    spec = write_spec(tmp_path, LIST_SPEC)
    corrupt(tmp_path / "data" / "c.nii.gz")
    plan = load_spec(spec)  # the header still reads: the job fails only when it runs
    report = run_batch(plan)
    states = {o.name: o.state for o in report.outcomes}
    assert states == {"b_to_a": "done", "c_to_a": "failed"}
    assert [o.name for o in report.failed] == ["c_to_a"]
    rows = Manifest(plan.manifest).rows()
    assert rows["b_to_a"]["state"] == "done" and rows["b_to_a"]["device"] == "cpu"
    assert "\n" not in rows["c_to_a"]["error"] and "c.nii.gz" in rows["c_to_a"]["error"]
    assert (tmp_path / "out" / "b_to_a" / "transform.json").is_file()
    assert not (tmp_path / "out" / "c_to_a").exists()
    with open(tmp_path / "out" / "summary.csv", newline="") as handle:
        summary = list(csv.DictReader(handle))
    expected = [("b_to_a", "done", "cpu"), ("c_to_a", "failed", "")]
    assert [(r["name"], r["state"], r["device"]) for r in summary] == expected
    assert float(summary[0]["seconds"]) > 0 and summary[0]["jacobian_fraction_nonpositive"] != ""
    assert summary[1]["error"] == rows["c_to_a"]["error"]
    warnings = json.loads((tmp_path / "out" / "b_to_a" / "metrics.json").read_text())["warnings"]
    assert summary[0]["warnings"] == "; ".join(warnings)  # what metrics.json says, empty when nothing went wrong

    done_mtime = (tmp_path / "out" / "b_to_a" / "transform.json").stat().st_mtime_ns
    again = run_batch(load_spec(spec))
    assert [(o.state, o.previous) for o in again.outcomes] == [("skipped", "done"), ("skipped", "failed")]
    assert len(again.failed) == 1

    write_image(blob(2.0), tmp_path / "data" / "c.nii.gz")  # fixed input: changed inputs rerun without a flag
    fixed = run_batch(load_spec(spec))
    assert [o.state for o in fixed.outcomes] == ["skipped", "done"] and not fixed.failed
    assert (tmp_path / "out" / "b_to_a" / "transform.json").stat().st_mtime_ns == done_mtime

    corrupt(tmp_path / "data" / "c.nii.gz")
    assert [o.state for o in run_batch(load_spec(spec)).outcomes] == ["skipped", "failed"]
    assert [o.state for o in run_batch(load_spec(spec)).outcomes] == ["skipped", "skipped"]
    retried = run_batch(load_spec(spec), retry_failed=True)  # unchanged inputs: run again, fail again
    assert [o.state for o in retried.outcomes] == ["skipped", "failed"]

    write_image(blob(2.0), tmp_path / "data" / "c.nii.gz")
    forced = run_batch(load_spec(spec), force=True)
    assert [o.state for o in forced.outcomes] == ["done", "done"]
    assert (tmp_path / "out" / "b_to_a" / "transform.json").stat().st_mtime_ns != done_mtime


def test_a_job_whose_folder_is_in_place_is_recorded_done_not_run_again(tmp_path):
    make_data(tmp_path)
    plan = load_spec(write_spec(tmp_path, LIST_SPEC))
    first = {o.name: o for o in run_batch(plan).outcomes}
    mtimes = {job.name: (job.out_dir / "transform.json").stat().st_mtime_ns for job in plan.jobs}
    Manifest(plan.manifest).start(plan.jobs, "a run killed after the folders' renames")
    again = run_batch(load_spec(plan.spec_path))
    assert [(o.state, o.previous) for o in again.outcomes] == [("skipped", "done")] * 2
    rows = Manifest(plan.manifest).rows()
    for outcome in again.outcomes:  # what the folders' records say: the run that wrote them
        assert rows[outcome.name]["state"] == "done" and rows[outcome.name]["device"] == "cpu"
        assert outcome.started == first[outcome.name].started and outcome.worker == first[outcome.name].worker
        assert 0 < outcome.seconds and rows[outcome.name]["seconds"] == outcome.seconds
    assert {job.name: (job.out_dir / "transform.json").stat().st_mtime_ns for job in plan.jobs} == mtimes

    job = plan.jobs[0]
    run_id = json.loads((job.out_dir / OUTPUT_FILES["record"]).read_text())["job"]["run"]
    again = execute_job(dataclasses.replace(job, run_id=run_id))  # dask running the task again in the same run
    assert again.state == "done" and again.started == first[job.name].started
    assert (job.out_dir / "transform.json").stat().st_mtime_ns == mtimes[job.name]
    assert execute_job(dataclasses.replace(job, run_id="another run")).started != first[job.name].started

"""``regkit.batch.plan``: what a rerun does with each job when its configuration changed or its output is gone."""

from __future__ import annotations

from regkit.batch import Manifest, load_spec, plan_actions, run_batch
from tests.regkit.batch.batch_cases import LIST_SPEC, TINY_CONFIG, make_data, write_spec


def test_changed_config_or_missing_output_reruns(tmp_path):
    make_data(tmp_path)
    spec = write_spec(tmp_path, LIST_SPEC)
    run_batch(load_spec(spec))
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG.replace("steps: 5", "steps: 6"))
    plan = load_spec(spec)
    assert plan_actions(plan, Manifest(plan.manifest).rows(), False, False) == ["run", "run"]
    run_batch(plan)
    import shutil

    shutil.rmtree(tmp_path / "out" / "c_to_a")
    assert plan_actions(plan, Manifest(plan.manifest).rows(), False, False) == ["skip (done)", "run"]


def test_a_folder_that_carries_the_jobs_stamp_is_done_whatever_the_manifest_says(tmp_path):
    make_data(tmp_path)
    plan = load_spec(write_spec(tmp_path, LIST_SPEC))
    run_batch(plan)
    book = Manifest(plan.manifest)
    book.start(plan.jobs, "a run killed after the folders' renames")  # the rows say running
    assert plan_actions(plan, book.rows(), False, False) == ["record done", "record done"]
    assert plan_actions(plan, {}, False, False) == ["record done", "record done"]  # another manifest
    assert plan_actions(plan, book.rows(), False, True) == ["run", "run"]  # --force
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG.replace("steps: 5", "steps: 6"))
    changed = load_spec(write_spec(tmp_path, LIST_SPEC))
    assert changed.jobs[0].recorded() is None and plan.jobs[0].recorded() is not None
    assert plan_actions(changed, book.rows(), False, False) == ["run", "run"]  # the folders are of another config

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

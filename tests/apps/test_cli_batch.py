"""``regkit batch``: dry run, exit codes, one-line errors, lock refusal."""

from __future__ import annotations

from regkit.batch import lock_output_root
from tests.apps.cli import run_cli
from tests.core.test_batch import LIST_SPEC, corrupt, make_data, write_spec


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    make_data(tmp_path)
    spec = write_spec(tmp_path, LIST_SPEC)
    before = sorted(tmp_path.rglob("*"))
    assert run_cli(["batch", spec, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "2 jobs" in out and "b_to_a" in out and "c_to_a" in out and out.count("run") >= 2
    assert sorted(tmp_path.rglob("*")) == before


def test_failed_job_gives_exit_code_1_and_rerun_skips(tmp_path, capsys):
    make_data(tmp_path)
    spec = write_spec(tmp_path, LIST_SPEC)
    corrupt(tmp_path / "data" / "c.nii.gz")
    assert run_cli(["batch", spec]) == 1
    out = capsys.readouterr().out
    assert "b_to_a: done" in out and "c_to_a: failed" in out and "1 done, 0 skipped, 1 failed" in out
    assert run_cli(["batch", spec]) == 1  # the failure stays until retried
    assert "0 done, 2 skipped, 1 failed" in capsys.readouterr().out
    assert run_cli(["batch", spec, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "skip (done)" in out and "skip (failed)" in out


def test_invalid_spec_and_lock_are_one_line_errors(tmp_path, capsys):
    make_data(tmp_path)
    spec = write_spec(tmp_path, LIST_SPEC.replace("output:", "outptu:"))
    assert run_cli(["batch", spec]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{spec}:2: outptu: unknown key" in err
    spec = write_spec(tmp_path, LIST_SPEC)
    with lock_output_root(tmp_path / "out") as lock:
        assert run_cli(["batch", spec]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(lock) in err and "another regkit batch run" in err

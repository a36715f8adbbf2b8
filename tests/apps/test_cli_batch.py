"""``regkit batch``: dry run, exit codes, one-line errors, lock refusal, local and dask executors (2D and 3D jobs)."""

from __future__ import annotations

import json

import pytest
import torch

from regkit.batch import MANIFEST, Manifest, lock_output_root
from regkit.io import Image, read_image, write_image
from regkit.spatial.grid import Grid
from tests.apps.cli import run_cli
from tests.core.test_batch import LIST_SPEC, TINY_CONFIG, corrupt, make_data, write_spec


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys, monkeypatch):
    make_data(tmp_path)
    spec = write_spec(tmp_path, LIST_SPEC)
    before = sorted(tmp_path.rglob("*"))
    assert run_cli(["batch", spec, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "2 jobs" in out and "b_to_a" in out and "c_to_a" in out and out.count("run") >= 2
    assert sorted(tmp_path.rglob("*")) == before
    monkeypatch.setattr("regkit.batch._cpu_count", lambda: 2)
    assert run_cli(["batch", spec, "--dry-run", "--executor", "dask", "--workers", "3"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("dask ")]
    assert lines == [f"dask worker-{i}: no GPU, 1 CPU thread" for i in range(3)]  # the jobs' device is cpu
    assert sorted(tmp_path.rglob("*")) == before


def test_dry_run_shows_the_gpu_pinning(tmp_path, capsys, monkeypatch):
    make_data(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG.replace("device: cpu", "device: auto"))
    spec = write_spec(tmp_path, LIST_SPEC)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr("regkit.batch._cpu_count", lambda: 16)
    assert run_cli(["batch", spec, "--dry-run", "--executor", "dask"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("dask ")]
    assert lines == [
        "dask worker-0: GPU 0 (CUDA_VISIBLE_DEVICES=0), 8 CPU threads",
        "dask worker-1: GPU 1 (CUDA_VISIBLE_DEVICES=1), 8 CPU threads",
    ]


def test_failed_job_gives_exit_code_1_and_rerun_skips(tmp_path, capsys):
    make_data(tmp_path)
    spec = write_spec(tmp_path, LIST_SPEC)
    corrupt(tmp_path / "data" / "c.nii.gz")
    assert run_cli(["batch", spec]) == 1
    captured = capsys.readouterr()  # per-job lines with the progress bar on stderr, the summary on stdout
    assert "b_to_a: done" in captured.err and "c_to_a: failed" in captured.err and "c.nii.gz" in captured.err
    assert "1 done, 0 skipped, 1 failed" in captured.out and "report.html" in captured.out
    assert (tmp_path / "out" / "report.html").is_file() and (tmp_path / "out" / "summary.csv").is_file()
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


def blob3d(shift: float, size: int = 12) -> Image:
    """A 3D Gaussian blob, shifted by ``shift`` mm in x."""
    grid = Grid.create((size, size, size))
    p = grid.world_points(torch.float64)
    return Image(torch.exp(-((p - torch.tensor([5.0 + shift, 6.0, 6.0])) ** 2).sum(-1) / 8.0).float(), grid)


MIXED_SPEC = (
    LIST_SPEC
    + """\
  - {fixed: data/f.nii.gz, moving: data/g.nii.gz, config: {dim: 3}}
  - {fixed: data/f.nii.gz, moving: data/h.nii.gz, config: {dim: 3}}
"""
)


def test_local_and_dask_give_identical_outputs(tmp_path, capsys):
    pytest.importorskip("dask.distributed")
    make_data(tmp_path)
    for name, shift in (("f", 0.0), ("g", 1.0), ("h", -1.0)):
        write_image(blob3d(shift), tmp_path / "data" / f"{name}.nii.gz")
    spec = write_spec(tmp_path, MIXED_SPEC)
    dask_spec = write_spec(tmp_path, MIXED_SPEC.replace("output: out", "output: out_dask")).rename(tmp_path / "d.yaml")
    spec = write_spec(tmp_path, MIXED_SPEC)
    assert run_cli(["batch", spec]) == 0
    assert run_cli(["batch", dask_spec, "--executor", "dask", "--workers", "2"]) == 0
    assert "4 done, 0 skipped, 0 failed" in capsys.readouterr().out
    rows = Manifest(tmp_path / "out_dask" / MANIFEST).rows()
    assert {row["state"] for row in rows.values()} == {"done"}
    assert len({row["worker"] for row in rows.values()}) == 2  # both worker processes ran jobs
    for job in ("b_to_a", "c_to_a", "g_to_f", "h_to_f"):
        local = json.loads((tmp_path / "out" / job / "transform.json").read_text())
        remote = json.loads((tmp_path / "out_dask" / job / "transform.json").read_text())
        assert local == remote
        for name in ("warped.nii.gz", "jacobian.nii.gz"):
            a = read_image(tmp_path / "out" / job / name).data
            b = read_image(tmp_path / "out_dask" / job / name).data
            assert a.ndim == (3 if job.endswith("_f") else 2)
            assert torch.equal(a, b), f"{job}/{name}: max difference {float((a - b).abs().max())}"


def test_dask_scheduler_address(tmp_path, capsys):
    distributed = pytest.importorskip("dask.distributed")
    make_data(tmp_path)
    spec = write_spec(tmp_path, LIST_SPEC)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as c:
        assert run_cli(["batch", spec, "--executor", "dask", "--scheduler", c.scheduler_address]) == 0
    assert "2 done, 0 skipped, 0 failed" in capsys.readouterr().out
    assert {row["state"] for row in Manifest(tmp_path / "out" / MANIFEST).rows().values()} == {"done"}

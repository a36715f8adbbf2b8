"""``regkit batch``: dry run, exit codes, one-line errors, lock refusal, --manifest, a run killed and resumed, local
and dask executors (2D and 3D jobs), dask schedulers given by address (tcp:// with a warning, tls:// with the --tls-*
files, bad and unreachable addresses)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from regkit.batch import MANIFEST, Manifest, lock_output_root
from regkit.io import Image, read_image, write_image
from regkit.spatial.grid import Grid
from tests.helpers import assert_one_error_line, gaussian_blobs, run_cli
from tests.regkit.batch.batch_cases import (
    LIST_SPEC,
    TINY_CONFIG,
    corrupt,
    isolate_worker_settings,
    make_data,
    write_spec,
)


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys, monkeypatch):
    make_data(tmp_path)
    spec = write_spec(tmp_path, LIST_SPEC)
    before = sorted(tmp_path.rglob("*"))
    assert run_cli(["batch", spec, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "2 jobs" in out and "b_to_a" in out and "c_to_a" in out and out.count("run") >= 2
    assert sorted(tmp_path.rglob("*")) == before
    monkeypatch.setattr("regkit.batch.dask.cpu_count", lambda: 2)
    assert run_cli(["batch", spec, "--dry-run", "--executor", "dask", "--workers", "3"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("dask ")]
    assert lines == [f"dask worker-{i}: no GPU, 1 CPU thread" for i in range(3)]  # the jobs' device is cpu
    assert sorted(tmp_path.rglob("*")) == before


def test_dry_run_shows_the_gpu_pinning(tmp_path, capsys, monkeypatch):
    make_data(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG.replace("device: cpu", "device: auto"))
    spec = write_spec(tmp_path, LIST_SPEC)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr("regkit.batch.dask.cpu_count", lambda: 16)
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
    return gaussian_blobs(Grid.create((size, size, size)), [(5.0 + shift, 6.0, 6.0)], 8.0)


MIXED_SPEC = (
    LIST_SPEC
    + """\
  - {fixed: data/f.nii.gz, moving: data/g.nii.gz, config: {dim: 3}}
  - {fixed: data/f.nii.gz, moving: data/h.nii.gz, config: {dim: 3}}
"""
)


def test_local_and_dask_give_identical_outputs(tmp_path, capsys, monkeypatch):
    pytest.importorskip("dask.distributed")
    isolate_worker_settings(monkeypatch)
    monkeypatch.delenv("REGKIT_WORKER_THREADS")  # the local cluster sets each worker's
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


def test_dask_scheduler_address(tmp_path, capsys, monkeypatch):
    distributed = pytest.importorskip("dask.distributed")
    isolate_worker_settings(monkeypatch)  # in-process workers: RegkitWorkerPlugin's settings are made here
    make_data(tmp_path)
    spec = write_spec(tmp_path, LIST_SPEC)
    with distributed.LocalCluster(
        n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None, protocol="tcp"
    ) as c:
        assert run_cli(["batch", spec, "--executor", "dask", "--scheduler", c.scheduler_address]) == 0
    captured = capsys.readouterr()
    assert "2 done, 0 skipped, 0 failed" in captured.out
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and f"{c.scheduler_address} is reached over tcp://, neither encrypted" in warnings[0]
    assert {row["state"] for row in Manifest(tmp_path / "out" / MANIFEST).rows().values()} == {"done"}


def test_dask_scheduler_over_tls(tmp_path, capsys, monkeypatch):
    """A TLS cluster: the batch runs with the client's credentials as --tls-* files; with none, another client's, a
    missing file, or on tcp://, one line naming the address and exit code 1, and nothing runs."""
    distributed = pytest.importorskip("dask.distributed")
    pytest.importorskip("cryptography")
    isolate_worker_settings(monkeypatch)
    make_data(tmp_path)
    spec = write_spec(tmp_path, LIST_SPEC)
    security, stranger = distributed.Security.temporary(), distributed.Security.temporary()
    files = {"ca.pem": security.tls_ca_file, "cert.pem": security.tls_client_cert, "key.pem": security.tls_client_key}
    files |= {"other-cert.pem": stranger.tls_client_cert, "other-key.pem": stranger.tls_client_key}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    mine = [
        "--tls-ca-file",
        tmp_path / "ca.pem",
        "--tls-cert",
        tmp_path / "cert.pem",
        "--tls-key",
        tmp_path / "key.pem",
    ]
    other = ["--tls-ca-file", tmp_path / "ca.pem", "--tls-cert", tmp_path / "other-cert.pem"]
    other += ["--tls-key", tmp_path / "other-key.pem"]
    with distributed.LocalCluster(
        n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None, protocol="tls", security=security
    ) as cluster:
        address = cluster.scheduler_address
        assert address.startswith("tls://")
        batch = ["batch", spec, "--executor", "dask", "--scheduler"]
        for args, problem in (
            ([address], f"--scheduler {address}: a TLS scheduler needs this client's credentials: give --tls-ca-file"),
            ([address, *other], f"cannot connect to the dask scheduler at {address}: "),
            ([address, *mine[:2], "--tls-cert", tmp_path / "no.pem"], f"the TLS certificate {tmp_path / 'no.pem'}: no"),
            ([address.replace("tls://", "tcp://"), *mine], "TLS settings were given, but tcp:// has no TLS"),
        ):
            assert run_cli([*batch, *args]) == 1
            assert_one_error_line(capsys, problem)
        assert {row["state"] for row in Manifest(tmp_path / "out" / MANIFEST).rows().values()} == {"pending"}
        assert run_cli([*batch, address, *mine]) == 0
    captured = capsys.readouterr()
    assert "2 done, 0 skipped, 0 failed" in captured.out and "warning:" not in captured.err
    assert {row["state"] for row in Manifest(tmp_path / "out" / MANIFEST).rows().values()} == {"done"}


def test_bad_or_unreachable_scheduler_is_one_line(tmp_path, capsys, monkeypatch):
    """An address that is none, --scheduler or --tls-* without their options, a TLS scheduler where nothing listens
    (after the connect timeout, 0.5 s here): one line naming the address, exit code 1."""
    distributed = pytest.importorskip("dask.distributed")
    pytest.importorskip("cryptography")
    make_data(tmp_path)
    spec = write_spec(tmp_path, LIST_SPEC)
    for args, problem in (
        (["--executor", "dask", "--scheduler", "not-an-address"], "--scheduler 'not-an-address' is not a dask"),
        (["--executor", "dask", "--scheduler", "tls://host"], "--scheduler 'tls://host' is not a dask scheduler"),
        (["--scheduler", "tcp://127.0.0.1:8786"], "--scheduler goes with --executor dask"),
        (["--executor", "dask", "--tls-cert", tmp_path / "cert.pem"], "--tls-key go with --scheduler tls://HOST:PORT"),
    ):
        assert run_cli(["batch", spec, *args]) == 1
        assert_one_error_line(capsys, problem)
    assert not (tmp_path / "out").exists()  # refused before any work

    security = distributed.Security.temporary()
    for name, text in (("ca.pem", security.tls_ca_file), ("cert.pem", security.tls_client_cert)):
        (tmp_path / name).write_text(text + security.tls_client_key)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"tls://127.0.0.1:{closed.getsockname()[1]}"
    monkeypatch.setattr("regkit.batch.dask.CONNECT_TIMEOUT", 0.5)
    tls = ["--tls-ca-file", tmp_path / "ca.pem", "--tls-cert", tmp_path / "cert.pem"]  # the key in the cert's file
    assert run_cli(["batch", spec, "--executor", "dask", "--scheduler", address, *tls]) == 1
    assert_one_error_line(capsys, f"cannot connect to the dask scheduler at {address}: ")  # timeout or refusal


def test_manifest_option_puts_the_manifest_elsewhere(tmp_path, capsys):
    make_data(tmp_path)
    spec = write_spec(tmp_path, LIST_SPEC)
    local = tmp_path / "local" / "study.sqlite"
    assert run_cli(["batch", spec, "--manifest", local]) == 0
    assert local.is_file() and not (tmp_path / "out" / MANIFEST).exists()
    assert {row["state"] for row in Manifest.read_only(local).values()} == {"done"}
    capsys.readouterr()
    assert run_cli(["batch", spec, "--manifest", local, "--dry-run"]) == 0
    assert capsys.readouterr().out.count("skip (done)") == 2
    assert run_cli(["batch", spec, "--manifest", tmp_path / "local"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--manifest: the manifest" in err and "is a folder" in err


KILL_SPEC = """\
defaults: tiny.yaml
output: out
jobs:
  - {fixed: data/a.nii.gz, moving: data/b.nii.gz}
  - {fixed: data/a.nii.gz, moving: data/c.nii.gz}
  - {fixed: data/a.nii.gz, moving: data/d.nii.gz}
  - {fixed: data/a.nii.gz, moving: data/e.nii.gz}
"""


def test_killed_run_resumes(tmp_path, capsys):
    """``regkit batch`` killed with SIGKILL once a job is done (seen by polling the manifest read-only while it
    runs), then rerun: the done jobs are skipped, the others complete, and no folder under a final name is partial."""
    make_data(tmp_path, ("a", "b", "c", "d", "e"))
    spec = write_spec(tmp_path, KILL_SPEC)
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG.replace("iterations: 3", "iterations: 60"))  # jobs take a while
    out, manifest = tmp_path / "out", tmp_path / "out" / MANIFEST
    command = [sys.executable, "-m", "regkit_cli", "batch", str(spec), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if any(row["state"] == "done" for row in Manifest.read_only(manifest).values()):
                break
            time.sleep(0.02)
    finally:
        proc.kill()
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -9, stderr.decode()  # killed, not finished
    rows = Manifest.read_only(manifest)
    finished = {name for name, row in rows.items() if row["state"] == "done"}
    assert finished and len(finished) < 4  # killed mid-run
    folders = [p for p in out.iterdir() if p.is_dir()]
    final = [p for p in folders if ".tmp-" not in p.name]
    assert all((p / "transform.json").is_file() for p in final)  # a folder under its final name is complete
    assert finished <= {p.name for p in final}
    mtimes = {name: (out / name / "transform.json").stat().st_mtime_ns for name in finished}
    (out / f"e_to_a.tmp-{proc.pid}@{socket.gethostname()}-abcdefgh").mkdir()  # as the killed run would leave it

    assert run_cli(["batch", spec]) == 0
    captured = capsys.readouterr()
    assert f"{4 - len(finished)} done, {len(finished)} skipped, 0 failed" in captured.out
    assert all(f"{name}: skipped (done)" in captured.err for name in finished)
    assert not list(out.glob("*.tmp-*"))
    assert all((out / name / "transform.json").stat().st_mtime_ns == t for name, t in mtimes.items())
    assert {row["state"] for row in Manifest(manifest).rows().values()} == {"done"}

"""``regkit.batch``: spec validation with FILE:LINE, job sources, plan, manifest (rollback journal, older WAL
manifests, readers), resume, failure isolation, lock (and its fallback without flock), local dask workers."""

from __future__ import annotations

import base64
import csv
import errno
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from html.parser import HTMLParser
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch

from regkit.batch import (
    MANIFEST,
    BatchLockedError,
    Manifest,
    ManifestError,
    device_label,
    load_spec,
    lock_output_root,
    plan_actions,
    plan_local_workers,
    run_batch,
)
from regkit.errors import ConfigError, RegkitError
from regkit.io import Image, write_image
from regkit.spatial.grid import Grid

TINY_CONFIG = """\
dim: 2
device: cpu
outputs: {inverse_displacement: false, transform_h5: false, qc_png: false}
stages:
  - {type: moments}
  - type: cpab
    similarity: {name: ncc}
    pyramid: [{shrink: 1, smoothing: 0.0}]
    optimizer: {iterations: 3, learning_rate: 0.2}
    tessellation: [2]
    steps: 5
"""


def blob(shift: float, size: int = 24) -> Image:
    """A 2D image of two Gaussian blobs, the first one shifted by ``shift`` mm in x."""
    grid = Grid.create((size, size), (1.0, 1.0), (0.0, 0.0))
    p = grid.world_points(torch.float64)
    a = torch.exp(-((p - torch.tensor([10.0 + shift, 12.0])) ** 2).sum(-1) / 20.0)
    b = torch.exp(-((p - torch.tensor([16.0, 8.0])) ** 2).sum(-1) / 10.0)
    return Image((a + 0.6 * b).float(), grid)


def make_data(folder: Path, names: tuple[str, ...] = ("a", "b", "c")) -> dict[str, Path]:
    """Images ``data/NAME.nii.gz`` and the tiny config ``tiny.yaml`` in ``folder``."""
    (folder / "data").mkdir(parents=True, exist_ok=True)
    paths = {}
    for i, name in enumerate(names):
        paths[name] = folder / "data" / f"{name}.nii.gz"
        write_image(blob(float(i)), paths[name])
    (folder / "tiny.yaml").write_text(TINY_CONFIG)
    return paths


def corrupt(path: Path) -> None:
    """Cut a .nii.gz file after its header: the header reads, the voxels do not."""
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def write_spec(folder: Path, body: str) -> Path:
    spec = folder / "batch.yaml"
    spec.write_text(textwrap.dedent(body))
    return spec


LIST_SPEC = """\
defaults: tiny.yaml
output: out
jobs:
  - {fixed: data/a.nii.gz, moving: data/b.nii.gz}
  - {fixed: data/a.nii.gz, moving: data/c.nii.gz}
"""


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- validation ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "defaults: tiny.yaml\noutput: out\njobz: []\n",
            "batch.yaml:3: jobz: unknown key 'jobz'; did you mean 'jobs'?",
        ),
        ("defaults: tiny.yaml\noutput: out\n", "batch.yaml:1: top level: no jobs"),
        (
            "defaults: tiny.yaml\noutput: out\njobs:\n  - fixed: data/a.nii.gz\n    movin: data/b.nii.gz\n",
            "batch.yaml:5: jobs[0].movin: unknown key",
        ),
        (
            "defaults: tiny.yaml\noutput: out\njobs:\n  - {fixed: data/a.nii.gz, moving: data/nope.nii.gz}\n",
            "batch.yaml:4: jobs[0].moving: no such file",
        ),
        (
            "defaults: tiny.yaml\noutput: out\nglob: {pairing: atlas, atlas: data/a.nii.gz, images: 'x/*.nii.gz'}\n",
            "batch.yaml:3: glob.images: 'x/*.nii.gz' matches no file",
        ),
        (
            "defaults: tiny.yaml\noutput: out\nglob:\n  pairing: atlas\n  images: 'data/*.nii.gz'\n",
            "glob.atlas: pairing 'atlas' needs 'atlas'",
        ),
        ("defaults: tiny.yaml\noutput: out\nlayout: '{out}/{stem}'\njobs: []\n", "batch.yaml:3: layout: unknown field"),
        (
            "defaults: tiny.yaml\noutput: out\nlayout: '{out}/{fixed_stem}'\n" + LIST_SPEC.split("output: out\n")[1],
            "batch.yaml:6: jobs[1].moving: job 1 (a.nii.gz, c.nii.gz) has the same output folder",
        ),
        (
            "defaults:\n  base: tiny.yaml\n  seed: -1\noutput: out\n" + LIST_SPEC.split("output: out\n")[1],
            "batch.yaml:3: seed: must be >= 0",
        ),
        (
            LIST_SPEC.replace("c.nii.gz}", "c.nii.gz, config: {stages: [{type: rigd}]}}"),
            "batch.yaml:5: stages[0].type: unknown type 'rigd'",
        ),
        ("defaults: nopreset\noutput: out\n" + LIST_SPEC.split("output: out\n")[1], "batch.yaml:1: defaults: 'nopre"),
    ],
)
def test_invalid_spec_names_key_and_line(tmp_path, body, expected):
    make_data(tmp_path)
    spec = write_spec(tmp_path, body)
    with pytest.raises(ConfigError) as err:
        load_spec(spec)
    assert expected in str(err.value).replace(str(tmp_path) + "/", "")
    assert not (tmp_path / "out").exists()


def test_unreadable_header_fails_before_any_work(tmp_path):
    make_data(tmp_path)
    (tmp_path / "data" / "b.nii.gz").write_bytes(b"not an image")
    with pytest.raises(ConfigError, match=r"batch.yaml:4: jobs\[0\].moving: cannot read the image header"):
        load_spec(write_spec(tmp_path, LIST_SPEC))


def test_job_sources(tmp_path):
    paths = make_data(tmp_path, ("a", "b", "c"))
    (tmp_path / "sub").mkdir()
    write_image(blob(0.0), tmp_path / "sub" / "s1_t1.nii.gz")
    write_image(blob(1.0), tmp_path / "sub" / "s1_t2.nii.gz")
    write_image(blob(1.0), tmp_path / "sub" / "s9_t2.nii.gz")  # no partner: left out
    (tmp_path / "pairs.csv").write_text("fixed,moving,moving_labels\ndata/a.nii.gz,data/b.nii.gz,\n")
    spec = write_spec(
        tmp_path,
        """\
        defaults: tiny.yaml
        output: out
        layout: "{out}/{index}_{moving_stem}_to_{fixed_stem}"
        jobs:
          - {fixed: data/b.nii.gz, moving: data/c.nii.gz, config: {seed: 4}}
        csv: pairs.csv
        glob: {pairing: pattern, fixed: "sub/*_t1.nii.gz", moving: "sub/*_t2.nii.gz"}
        """,
    )
    plan = load_spec(spec)
    pairs = [(j.inputs["fixed"].name, j.inputs["moving"].name) for j in plan.jobs]
    assert pairs == [("b.nii.gz", "c.nii.gz"), ("a.nii.gz", "b.nii.gz"), ("s1_t1.nii.gz", "s1_t2.nii.gz")]
    assert [j.name for j in plan.jobs] == ["0_c_to_b", "1_b_to_a", "2_s1_t2_to_s1_t1"]
    assert plan.jobs[0].config.seed == 4 and plan.jobs[1].config.seed == 0
    assert plan.jobs[0].config.stages == plan.jobs[1].config.stages
    assert plan.jobs[1].inputs["fixed"] == paths["a"] and plan.jobs[1].inputs["moving_labels"] is None

    atlas = write_spec(
        tmp_path, "defaults: tiny.yaml\noutput: out\nglob: {pairing: atlas, atlas: data/a.nii.gz, images: 'sub/*'}\n"
    )
    assert [j.name for j in load_spec(atlas).jobs] == ["s1_t1_to_a", "s1_t2_to_a", "s9_t2_to_a"]
    within = write_spec(
        tmp_path, "defaults: tiny.yaml\noutput: out\nglob: {pairing: within_folder, images: 'data/*'}\n"
    )
    assert [j.name for j in load_spec(within).jobs] == ["b_to_a", "c_to_a", "c_to_b"]


# --- running ---------------------------------------------------------------------------------------------------------


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


def test_dimension_mismatch_fails_alone(tmp_path):
    make_data(tmp_path)
    write_image(Image(torch.rand(6, 7, 8), Grid.create((8, 7, 6))), tmp_path / "data" / "c.nii.gz")
    report = run_batch(load_spec(write_spec(tmp_path, LIST_SPEC)))
    assert [o.state for o in report.outcomes] == ["done", "failed"]
    assert "3D" in report.outcomes[1].error and "2D" in report.outcomes[1].error


def test_second_run_on_the_same_root_is_refused(tmp_path):
    make_data(tmp_path)
    plan = load_spec(write_spec(tmp_path, LIST_SPEC))
    with lock_output_root(plan.root) as lock:
        code = f"from regkit.batch import *; run_batch(load_spec({str(plan.spec_path)!r}))"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and "BatchLockedError" in done.stderr and str(lock) in done.stderr
        with pytest.raises(BatchLockedError, match=r"\.batch\.lock is held by pid"):
            with lock_output_root(plan.root):  # a second open file description in this process is refused too
                pass
    assert not Manifest.read_only(plan.manifest)


# --- manifest and lock -----------------------------------------------------------------------------------------------


def journal_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("manifest.sqlite-"))


def is_wal(path: Path) -> bool:
    """The file format versions of the SQLite header (bytes 18, 19): 2 in WAL mode, 1 with a rollback journal."""
    return path.read_bytes()[18:20] == b"\x02\x02"


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_manifest_has_a_rollback_journal_and_may_live_elsewhere(tmp_path):
    make_data(tmp_path)
    plan = load_spec(write_spec(tmp_path, LIST_SPEC))
    run_batch(plan)
    assert plan.manifest == tmp_path / "out" / MANIFEST and not is_wal(plan.manifest)
    assert journal_files(tmp_path / "out") == []  # no -wal, -shm or -journal left

    spec = write_spec(tmp_path, LIST_SPEC.replace("output: out", "output: out2\nmanifest: local/study.sqlite"))
    plan = load_spec(spec)
    assert plan.manifest == tmp_path / "local" / "study.sqlite"
    assert [o.state for o in run_batch(plan).outcomes] == ["done", "done"]
    assert sorted(Manifest.read_only(plan.manifest)) == ["b_to_a", "c_to_a"]
    assert not (tmp_path / "out2" / MANIFEST).exists() and (tmp_path / "out2" / "summary.csv").is_file()
    assert load_spec(spec, manifest=tmp_path / "other.sqlite").manifest == tmp_path / "other.sqlite"
    (tmp_path / "local" / "folder.sqlite").mkdir()
    with pytest.raises(ConfigError, match=r"batch.yaml:3: manifest: the manifest .*folder.sqlite is a folder"):
        load_spec(write_spec(tmp_path, LIST_SPEC.replace("output: out", "output: out\nmanifest: local/folder.sqlite")))


_OLDER_RUN = """
import os, sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("PRAGMA journal_mode=WAL")  # as regkit wrote its manifests before
con.execute("PRAGMA wal_autocheckpoint=0")
con.execute("UPDATE jobs SET worker = 'older run' WHERE name = 'b_to_a'")
os._exit(0)  # killed: the update lives in the -wal file only
"""


def test_manifest_of_an_older_run_in_wal_mode_opens(tmp_path):
    make_data(tmp_path)
    plan = load_spec(write_spec(tmp_path, LIST_SPEC))
    run_batch(plan)
    subprocess.run([sys.executable, "-c", _OLDER_RUN, str(plan.manifest)], check=True, timeout=60)
    assert is_wal(plan.manifest) and journal_files(tmp_path / "out") == ["manifest.sqlite-shm", "manifest.sqlite-wal"]
    before = listing(tmp_path)
    assert Manifest.read_only(plan.manifest)["b_to_a"]["worker"] == "older run"  # read from a copy
    assert listing(tmp_path) == before  # nothing written
    assert [o.state for o in run_batch(plan).outcomes] == ["skipped", "skipped"]  # converted by the run's writes
    assert not is_wal(plan.manifest) and journal_files(tmp_path / "out") == []
    assert Manifest.read_only(plan.manifest)["b_to_a"]["worker"] == "older run"


_KILLED_WRITE = """
import os, sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("PRAGMA cache_size=1")  # the pages spill into the file before the commit
con.execute("BEGIN IMMEDIATE")
con.execute("UPDATE jobs SET state = 'failed'")
con.executemany("INSERT INTO jobs (name, state, inputs, config_hash) VALUES (?, 'x', ?, '')",
                [(f"x{i}", "y" * 500) for i in range(2000)])
os._exit(0)  # killed in the middle of the transaction: a hot journal is left
"""


def test_read_only_reads_past_a_journal_left_by_a_killed_write(tmp_path):
    make_data(tmp_path)
    plan = load_spec(write_spec(tmp_path, LIST_SPEC))
    run_batch(plan)
    subprocess.run([sys.executable, "-c", _KILLED_WRITE, str(plan.manifest)], check=True, timeout=60)
    assert journal_files(tmp_path / "out") == ["manifest.sqlite-journal"]
    before = listing(tmp_path)
    rows = Manifest.read_only(plan.manifest)
    assert sorted(rows) == ["b_to_a", "c_to_a"] and {row["state"] for row in rows.values()} == {"done"}
    assert listing(tmp_path) == before  # the journal is still there for the next writer to roll back
    assert {row["state"] for row in Manifest(plan.manifest).rows().values()} == {"done"}
    assert journal_files(tmp_path / "out") == []


def test_a_file_that_is_not_a_manifest_is_a_one_line_error(tmp_path):
    make_data(tmp_path)
    plan = load_spec(write_spec(tmp_path, LIST_SPEC))
    plan.manifest.parent.mkdir()
    plan.manifest.write_bytes(b"this is not a SQLite database, " * 10)
    for read in (Manifest.read_only, lambda path: run_batch(plan)):
        with pytest.raises(ManifestError) as err:
            read(plan.manifest)
        assert str(err.value) == f"{plan.manifest}: not a regkit manifest (file is not a database)"


@pytest.mark.skipif(sys.platform == "win32", reason="flock is a POSIX call")
def test_lock_falls_back_to_a_lock_file_where_the_file_system_has_no_flock(tmp_path, monkeypatch):
    import fcntl

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")  # e.g. Lustre mounted without flock

    monkeypatch.setattr(fcntl, "flock", no_flock)
    holder = f"pid {os.getpid()} on {socket.gethostname()}"
    with lock_output_root(tmp_path) as lock:
        assert lock.read_text().split()[:2] == [str(os.getpid()), socket.gethostname()]  # the lock file's holder
        with pytest.raises(BatchLockedError) as err:
            with lock_output_root(tmp_path):
                pass
        assert str(err.value).startswith(f"{lock} is held by {holder} since ") and "\n" not in str(err.value)
    assert not lock.exists() and not (tmp_path / ".batch.holder").exists()  # removed on release

    lock.write_text("4321\nnode-17\n")  # left by a run on another host that was killed
    (tmp_path / ".batch.holder").write_text("pid 4321 on node-17 since Mon Jan  5 10:00:00 2026\n")
    with pytest.raises(BatchLockedError, match=r"held by pid 4321 on node-17 .*if that process is gone, delete"):
        with lock_output_root(tmp_path):
            pass
    lock.unlink()
    with lock_output_root(tmp_path):
        pass


def test_dask_executor_without_dask_is_a_clear_error(tmp_path, monkeypatch):
    make_data(tmp_path)
    plan = load_spec(write_spec(tmp_path, LIST_SPEC))
    monkeypatch.setitem(sys.modules, "dask.distributed", None)  # import fails as if dask were not installed
    with pytest.raises(RegkitError, match=r"pip install 'regkit\[dask\]'"):
        run_batch(plan, executor="dask")


def test_labels_and_masks_from_csv_reach_the_outputs(tmp_path):
    make_data(tmp_path, ("a", "b"))
    for name, shift in (("a", 0.0), ("b", 1.0)):
        image = blob(shift)
        write_image(Image((image.data > 0.4).to(torch.int16), image.grid), tmp_path / "data" / f"{name}_seg.nii.gz")
    (tmp_path / "pairs.csv").write_text(
        "fixed,moving,fixed_labels,moving_labels,fixed_mask\n"
        "data/a.nii.gz,data/b.nii.gz,data/a_seg.nii.gz,data/b_seg.nii.gz,data/a_seg.nii.gz\n"
    )
    report = run_batch(load_spec(write_spec(tmp_path, "defaults: tiny.yaml\noutput: out\ncsv: pairs.csv\n")))
    assert [o.state for o in report.outcomes] == ["done"]
    assert (tmp_path / "out" / "b_to_a" / "warped_labels.nii.gz").is_file()
    metrics = json.loads((tmp_path / "out" / "b_to_a" / "metrics.json").read_text())
    with open(tmp_path / "out" / "summary.csv", newline="") as handle:
        (summary,) = csv.DictReader(handle)
    assert float(summary["mean_dice_after"]) == pytest.approx(metrics["labels"]["mean_dice_after"])
    text = (tmp_path / "out" / "report.html").read_text()
    svgs = re.findall(r"<svg.*?</svg>", text, flags=re.S)
    assert len(svgs) == 4 and "no values" not in text  # Dice before and after, folds, runtime
    for svg in svgs:
        assert ElementTree.fromstring(svg).tag == "svg"  # well-formed


def test_unknown_extension_and_bad_csv_are_located(tmp_path):
    make_data(tmp_path)
    (tmp_path / "data" / "x.txt").write_text("hello")
    with pytest.raises(ConfigError, match=r"batch.yaml:4: jobs\[0\].moving: .*unknown image extension .txt"):
        load_spec(write_spec(tmp_path, LIST_SPEC.replace("b.nii.gz", "x.txt")))
    (tmp_path / "pairs.csv").write_text("fixed,moving,labels\ndata/a.nii.gz,data/b.nii.gz,\n")
    with pytest.raises(ConfigError, match=r"pairs.csv:1: unknown column 'labels'"):
        load_spec(write_spec(tmp_path, "defaults: tiny.yaml\noutput: out\ncsv: pairs.csv\n"))
    (tmp_path / "pairs.csv").write_text("fixed,moving\ndata/a.nii.gz,data/b.nii.gz\ndata/a.nii.gz,data/nope.nii.gz\n")
    with pytest.raises(ConfigError, match=r"pairs.csv:3: moving: no such file"):
        load_spec(write_spec(tmp_path, "defaults: tiny.yaml\noutput: out\ncsv: pairs.csv\n"))


# --- dask workers: GPU pinning and threads ---------------------------------------------------------------------------


def test_plan_local_workers_pins_one_worker_per_gpu():
    plan = plan_local_workers(None, gpus=2, cpus=16)
    assert [(w.gpu, w.threads) for w in plan] == [(0, 8), (1, 8)]
    assert plan[1].env == {"OMP_NUM_THREADS": "8", "REGKIT_WORKER_THREADS": "8", "CUDA_VISIBLE_DEVICES": "1"}
    assert plan[1].resources == {"GPU": 1}
    assert [w.gpu for w in plan_local_workers(5, gpus=2, cpus=16)] == [0, 1, 0, 1, 0]  # sharing, round-robin
    assert [w.gpu for w in plan_local_workers(1, gpus=4, cpus=16)] == [0]
    assert len({w.name for w in plan_local_workers(5, gpus=2, cpus=16)}) == 5
    cpu = plan_local_workers(None, gpus=0, cpus=2)
    assert [(w.gpu, w.threads) for w in cpu] == [(None, 1), (None, 1)]
    assert cpu[0].env == {"OMP_NUM_THREADS": "1", "REGKIT_WORKER_THREADS": "1"} and cpu[0].resources == {}
    assert [w.threads for w in plan_local_workers(3, gpus=0, cpus=2)] == [1, 1, 1]
    with pytest.raises(ValueError, match="at least 1"):
        plan_local_workers(0, gpus=0, cpus=2)


def test_local_cluster_workers_get_their_gpu_and_threads():
    distributed = pytest.importorskip("dask.distributed")
    from regkit.batch import _local_cluster

    def environment() -> tuple[str | None, str | None]:
        return os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("OMP_NUM_THREADS")

    with _local_cluster(plan_local_workers(None, gpus=2, cpus=6)) as cluster, distributed.Client(cluster) as client:
        seen = client.run(environment)
        resources = [w["resources"] for w in client.scheduler_info()["workers"].values()]
    assert sorted(seen.values()) == [("0", "3"), ("1", "3")]
    assert resources == [{"GPU": 1}, {"GPU": 1}]


def test_dask_executor_with_gpus_pins_and_checks_devices(tmp_path, monkeypatch):
    pytest.importorskip("dask.distributed")
    make_data(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG.replace("device: cpu", "device: cuda:1"))
    plan = load_spec(write_spec(tmp_path, LIST_SPEC))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RegkitError, match=r"job b_to_a: device 'cuda:1' with --executor dask: .*use device 'cuda'"):
        run_batch(plan, executor="dask")
    assert {row["state"] for row in Manifest(plan.manifest).rows().values()} == {"pending"}  # nothing ran


def test_device_label_names_the_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert device_label("cuda") == "cuda (CUDA_VISIBLE_DEVICES=3)"
    assert device_label("cpu") == "cpu"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert device_label("cuda:0") == "cuda:0"


# --- report.html -----------------------------------------------------------------------------------------------------


class _Page(HTMLParser):
    """The parts of report.html the tests look at: body rows, image sources, every URL-like attribute, SVGs."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self.images: list[str] = []
        self.links: list[str] = []
        self.svgs = 0
        self.headers: list[str] = []
        self._in_body = self._in_th = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self._in_body |= tag == "tbody"
        self._in_th = tag == "th"
        if tag == "tr" and self._in_body:
            self.rows.append([attrs.get("class", "")])
        if tag == "img":
            self.images.append(attrs["src"])
        self.links += [v for k, v in attrs.items() if k in ("href", "src") and v is not None]
        self.svgs += tag == "svg"

    def handle_endtag(self, tag):
        self._in_body &= tag != "tbody"
        self._in_th = False

    def handle_data(self, data):
        if self._in_th:
            self.headers.append(data)


def test_report_html_is_self_contained_with_a_row_per_job(tmp_path):
    make_data(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY_CONFIG.replace("qc_png: false", "qc_png: true"))
    spec = write_spec(tmp_path, LIST_SPEC + "  - {fixed: data/b.nii.gz, moving: data/c.nii.gz}\n")
    corrupt(tmp_path / "data" / "b.nii.gz")  # b_to_a and c_to_b fail
    run_batch(load_spec(spec))
    report = tmp_path / "out" / "report.html"
    for rerun in (False, True):  # a rerun (everything skipped) rewrites the report over all jobs
        if rerun:
            before = report.stat().st_mtime_ns
            time.sleep(0.01)
            assert {o.state for o in run_batch(load_spec(spec)).outcomes} == {"skipped"}
            assert report.stat().st_mtime_ns != before
        text = report.read_text()
        page = _Page()
        page.feed(text)
        page.close()
        assert [row[0] for row in page.rows] == ["failed", "done", "failed"]
        assert len(page.images) == 1 and page.images[0].startswith("data:image/png;base64,")
        thumbnail = base64.b64decode(page.images[0].split(",", 1)[1])
        assert thumbnail.startswith(b"\x89PNG\r\n\x1a\n")
        assert page.links == ["c_to_a/qc.png", page.images[0]]  # a relative link to the full picture
        assert "://" not in text and "url(" not in text and "@import" not in text  # nothing from the network
        assert page.svgs == 2 and text.count("no values") == 2  # folds and runtime; no labels: no Dice
        assert {"Dice after", "folds %", "runtime s", "device", "error"} <= set(page.headers)
        assert "<script>" in text and "<style>" in text
    assert not list((tmp_path / "out").glob("*.tmp-*"))

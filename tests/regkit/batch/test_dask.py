"""``regkit.batch.dask``: the dask executor without dask, the local workers (GPU pinning, threads, devices), the local
cluster's security (TLS only, no HTTP), the connection to a scheduler given by address (its checks, credentials and
timeout), and on dask clusters RegkitWorkerPlugin (version check, GPU pinning, threads, process settings and
node-local caches), GPU jobs only on workers that declare the GPU resource, and a batch through dask-jobqueue's own
local job cluster (the job-script machinery of SLURMCluster without SLURM)."""

from __future__ import annotations

import asyncio
import http.client
import operator
import os
import socket
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import regkit
from regkit.batch import (
    MANIFEST,
    NODE_CACHE,
    WORKER_THREADS,
    Manifest,
    job_resources,
    load_spec,
    local_workers_for,
    node_cache_dir,
    plan_local_workers,
    run_batch,
    worker_plugin,
    worker_threads,
)
from regkit.batch import dask as batch_dask
from regkit.errors import RegkitError
from regkit.process import cache_root
from tests.regkit.batch.batch_cases import LIST_SPEC, TINY_CONFIG, isolate_worker_settings, make_data, write_spec

# --- local dask workers: GPU pinning and threads ---------------------------------------------------------------------


def test_dask_executor_without_dask_is_a_clear_error(tmp_path, monkeypatch):
    make_data(tmp_path)
    plan = load_spec(write_spec(tmp_path, LIST_SPEC))
    monkeypatch.setitem(sys.modules, "dask.distributed", None)  # import fails as if dask were not installed
    with pytest.raises(RegkitError, match=r"pip install 'regkit\[dask\]'"):
        run_batch(plan, executor="dask")


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

    def environment() -> tuple[str | None, str | None]:
        return os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("OMP_NUM_THREADS")

    with (
        batch_dask.local_cluster(plan_local_workers(None, gpus=2, cpus=6)) as cluster,
        distributed.Client(cluster) as client,
    ):
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


# --- security: the local cluster, a scheduler given by address -----------------------------------------------------


def listening_ports(pid: int) -> set[int]:
    """The TCP ports on which process ``pid`` listens."""
    import psutil

    return {c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def test_local_cluster_is_tls_only_and_serves_no_http():
    """Every port that the local cluster's processes listen on (the scheduler and the nanny in this process, the
    worker in its own) is one of its dask TLS addresses: nothing answers HTTP there, and a client without the
    cluster's credentials (none, or others) cannot connect; the cluster's own client can."""
    distributed = pytest.importorskip("dask.distributed")
    pytest.importorskip("cryptography")
    pytest.importorskip("psutil")
    from distributed.comm import connect

    stranger = distributed.Security.temporary()

    async def refused(port: int) -> None:
        for address, args in (
            (f"tls://127.0.0.1:{port}", stranger.get_connection_args("client")),
            (f"tcp://127.0.0.1:{port}", {}),
        ):
            with pytest.raises(OSError):  # the TLS handshake fails, or the connection is closed
                await connect(address, timeout=2, **args)

    before = listening_ports(os.getpid())
    with (
        batch_dask.local_cluster(plan_local_workers(1, gpus=0, cpus=1)) as cluster,
        distributed.Client(cluster) as client,
    ):
        assert client.submit(operator.add, 1, 2).result() == 3
        workers = client.run(os.getpid)  # worker address -> process id
        addresses = [cluster.scheduler_address, *(nanny.address for nanny in cluster.workers.values()), *workers]
        ports = listening_ports(os.getpid()) - before
        for pid in workers.values():
            ports |= listening_ports(pid)
        info = client.scheduler_info()
        for port in ports:
            asyncio.run(refused(port))
            with pytest.raises((OSError, http.client.HTTPException)):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        with pytest.raises(
            RegkitError, match=r"tls://127\.0\.0\.1:\d+: a TLS scheduler needs this client's credentials"
        ):
            batch_dask.connect_scheduler(cluster.scheduler_address)
        with pytest.raises(RegkitError, match=r"cannot connect to the dask scheduler at tls://127"):
            batch_dask.connect_scheduler(cluster.scheduler_address, stranger)
        with batch_dask.connect_scheduler(cluster.scheduler_address, cluster.security) as own:
            assert own.submit(operator.add, 2, 3).result() == 5
    assert len(addresses) == 3 and all(address.startswith("tls://127.0.0.1:") for address in addresses)
    assert ports == {int(address.rsplit(":", 1)[1]) for address in addresses}  # no HTTP server, no dashboard
    assert info["services"] == {} and [w["services"] for w in info["workers"].values()] == [{}]


def test_scheduler_addresses_and_tls_settings(tmp_path):
    pytest.importorskip("dask.distributed")
    dask = pytest.importorskip("dask")
    assert batch_dask.scheduler_protocol("tls://10.0.0.5:8786") == "tls"
    assert batch_dask.scheduler_protocol("10.0.0.5:8786") == "tcp"  # dask's default protocol
    assert batch_dask.scheduler_protocol("tcp://[::1]:8786") == "tcp"
    for address, problem in (
        ("not-an-address", "missing port number"),
        ("tls://host", "missing port number"),
        ("foo://host:8786", "unknown protocol foo://"),
        ("tcp://host:port", "invalid literal"),
    ):
        with pytest.raises(RegkitError) as err:
            batch_dask.scheduler_protocol(address)
        assert f"--scheduler {address!r} is not a dask scheduler address ({problem}" in str(err.value)
    config = {"distributed.comm.tls.ca-file": "/etc/dask/ca.pem", "distributed.comm.tls.client.key": "/etc/k.pem"}
    with dask.config.set(config):
        security = batch_dask.tls_security(cert=tmp_path / "mine.pem")
    assert security.require_encryption
    assert security.get_tls_config_for_role("client") == {
        "ca_file": "/etc/dask/ca.pem",  # not given: dask's configuration
        "ciphers": None,
        "cert": str(tmp_path / "mine.pem"),
        "key": "/etc/k.pem",
    }
    with pytest.raises(RegkitError, match=r"tls://127.0.0.1:8786: the TLS CA certificate /etc/dask/ca.pem: no such"):
        batch_dask.connect_scheduler("tls://127.0.0.1:8786", security)
    with pytest.raises(RegkitError, match=r"TLS settings were given, but tcp:// has no TLS: use tls://"):
        batch_dask.connect_scheduler("tcp://127.0.0.1:8786", security)


def test_a_scheduler_that_does_not_answer_is_a_one_line_error(monkeypatch):
    """A port where nothing listens, and one that accepts connections and stays silent (dask's own connection would
    wait for its handshake without end): one line each, after :data:`CONNECT_TIMEOUT` seconds (here 0.5)."""
    pytest.importorskip("dask.distributed")
    monkeypatch.setattr(batch_dask, "CONNECT_TIMEOUT", 0.5)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        free = closed.getsockname()[1]
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        for address in (f"tcp://127.0.0.1:{free}", f"tcp://127.0.0.1:{silent.getsockname()[1]}"):
            with pytest.warns(UserWarning, match=r"reached over tcp://, neither encrypted nor authenticated"):
                with pytest.raises(RegkitError) as err:
                    batch_dask.connect_scheduler(address)
            message = str(err.value)
            assert address in message and "0.5 s" in message and "\n" not in message


# --- dask clusters: RegkitWorkerPlugin, GPU resources, dask-jobqueue ------------------------------------------------


def fake_worker(name: str, tmp_path: Path, gpu: bool, nthreads: int = 1) -> SimpleNamespace:
    """What RegkitWorkerPlugin.setup reads of a dask worker."""
    resources = {"GPU": 1.0} if gpu else {}
    state = SimpleNamespace(total_resources=resources, nthreads=nthreads)
    local = tmp_path / "dask-scratch-space" / f"worker-{name}"
    return SimpleNamespace(name=name, address="tcp://10.0.0.9:4000", state=state, local_directory=str(local))


def test_job_resources_ask_for_a_gpu_only_for_cuda(tmp_path, monkeypatch):
    make_data(tmp_path)
    jobs = {}
    for device in ("cpu", "auto", "cuda", "cuda:0"):
        (tmp_path / "tiny.yaml").write_text(TINY_CONFIG.replace("device: cpu", f"device: {device}"))
        jobs[device] = load_spec(write_spec(tmp_path, LIST_SPEC)).jobs
    assert {device: job_resources(js[0]) for device, js in jobs.items()} == {
        "cpu": {},
        "auto": {},  # the GPU of the worker that runs it if it has one: no requirement
        "cuda": {"GPU": 1},
        "cuda:0": {"GPU": 1},
    }
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert [w.resources for w in local_workers_for(jobs["auto"], 2)] == [{}, {}]  # no GPU: CPU workers
    with pytest.raises(RegkitError, match=r"job b_to_a: device 'cuda' with --executor dask, but this machine has no"):
        local_workers_for(jobs["cuda"], None)  # no worker would ever take it
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [w.resources for w in local_workers_for(jobs["cuda"], 3)] == [{"GPU": 1}] * 3


def test_worker_threads_and_node_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(batch_dask, "cpu_count", lambda: 16)
    for name in (WORKER_THREADS, "OMP_NUM_THREADS", NODE_CACHE):
        monkeypatch.delenv(name, raising=False)
    worker = fake_worker("w", tmp_path, gpu=False, nthreads=2)
    assert worker_threads(worker) == 8  # unset: the affinity's cores over the tasks at a time
    assert worker_threads(worker, sharing=4) == 2  # four workers of one job share them
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what dask's nanny sets: not a choice of the user
    assert worker_threads(worker) == 8
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # e.g. exported by the job script
    assert worker_threads(worker) == 3
    monkeypatch.setenv(WORKER_THREADS, "1")
    assert worker_threads(worker) == 1
    monkeypatch.setenv(WORKER_THREADS, "many")
    with pytest.raises(RegkitError, match=r"REGKIT_WORKER_THREADS='many' on dask worker w: give a positive integer"):
        worker_threads(worker)
    assert node_cache_dir(worker) == tmp_path / "dask-scratch-space" / "regkit-cache"  # beside the workers' folders
    monkeypatch.setenv(NODE_CACHE, str(tmp_path / "node"))
    assert node_cache_dir(worker) == tmp_path / "node"


def test_worker_plugin_setup_pins_a_gpu_and_makes_the_settings(tmp_path, monkeypatch):
    pytest.importorskip("dask.distributed")
    isolate_worker_settings(monkeypatch)
    monkeypatch.delenv(WORKER_THREADS)
    monkeypatch.setenv(NODE_CACHE, str(tmp_path / "node"))
    monkeypatch.setattr(batch_dask, "cpu_count", lambda: 16)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")  # a SLURM job with --gres=gpu:2 running 2 worker processes
    plugin = worker_plugin(regkit.__version__)
    plugin.setup(fake_worker("SLURMCluster-3-1", tmp_path, gpu=True))  # process 1 of `dask worker --nworkers 2`
    assert plugin.settings["gpu"] == os.environ["CUDA_VISIBLE_DEVICES"] == "5"
    assert plugin.settings["threads"] == 8 and os.environ["OMP_NUM_THREADS"] == "8"  # half the job's cores
    caches = {
        "NUMBA_CACHE_DIR": str(tmp_path / "node" / "numba"),
        "TRITON_CACHE_DIR": str(tmp_path / "node" / "triton"),
    }
    assert plugin.settings["caches"] == caches
    assert {k: os.environ[k] for k in caches} == caches

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")  # another worker process, as its nanny started it
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    plugin.setup(fake_worker("cpu-worker-1", tmp_path, gpu=False))  # no GPU resource: not pinned, all the cores
    assert plugin.settings["gpu"] == "4,5" and plugin.settings["threads"] == 16
    with pytest.raises(RegkitError) as err:
        worker_plugin("0.0.1").setup(fake_worker("w", tmp_path, gpu=False))
    expected = f"dask worker w (tcp://10.0.0.9:4000) runs regkit {regkit.__version__}, this client regkit 0.0.1"
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_version_mismatch_stops_the_run(tmp_path, monkeypatch):
    distributed = pytest.importorskip("dask.distributed")
    isolate_worker_settings(monkeypatch)
    make_data(tmp_path)
    plan = load_spec(write_spec(tmp_path, LIST_SPEC))
    installed = regkit.__version__
    with distributed.LocalCluster(
        n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None, host="127.0.0.1"
    ) as cluster:
        monkeypatch.setattr(regkit, "__version__", "9.9.9")  # the client's; the worker process has the installed one
        with pytest.raises(RegkitError) as err:
            run_batch(plan, executor="dask", scheduler=cluster.scheduler_address)
    message = str(err.value)
    assert "\n" not in message and f"runs regkit {installed}, this client regkit 9.9.9" in message
    assert {row["state"] for row in Manifest(plan.manifest).rows().values()} == {"pending"}  # nothing ran


def test_gpu_jobs_run_only_on_workers_with_the_gpu_resource(tmp_path, monkeypatch):
    """A cluster of one worker declaring ``GPU=1`` and one without: jobs that ask for the GPU resource run on the
    first only. There is no GPU here, so the jobs are configured for the CPU and :func:`job_resources` is made to ask
    for the GPU, as it does for device ``cuda``."""
    distributed = pytest.importorskip("dask.distributed")
    isolate_worker_settings(monkeypatch)
    make_data(tmp_path, ("a", "b", "c", "d", "e"))
    body = (
        LIST_SPEC
        + "  - {fixed: data/a.nii.gz, moving: data/d.nii.gz}\n  - {fixed: data/a.nii.gz, moving: data/e.nii.gz}\n"
    )
    plan = load_spec(write_spec(tmp_path, body))
    monkeypatch.setattr(batch_dask, "job_resources", lambda job: {"GPU": 1})

    def worker(resources: dict[str, float]) -> dict:
        return {"cls": distributed.Worker, "options": {"nthreads": 1, "resources": resources}}

    scheduler = {"cls": distributed.Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": None}}
    workers = {"gpu": worker({"GPU": 1}), "cpu": worker({})}
    with distributed.SpecCluster(scheduler=scheduler, workers=workers) as cluster:
        report = run_batch(plan, executor="dask", scheduler=cluster.scheduler_address)
    assert [o.state for o in report.outcomes] == ["done"] * 4
    rows = Manifest(plan.manifest).rows()
    assert all(row["worker"].startswith("gpu on ") for row in rows.values()), [r["worker"] for r in rows.values()]

    with distributed.SpecCluster(scheduler=scheduler, workers={"cpu": worker({})}) as cluster:
        with pytest.raises(RegkitError, match=r"none of the 1 workers at .* declares one: start GPU workers with"):
            run_batch(plan, executor="dask", scheduler=cluster.scheduler_address, force=True)


def test_batch_on_a_dask_jobqueue_cluster(tmp_path, monkeypatch, capsys):
    """dask-jobqueue's LocalCluster writes and runs the job script SLURMCluster would submit: one job of two worker
    processes (``processes=2``) that declare ``GPU=1`` and see two GPUs (``CUDA_VISIBLE_DEVICES=0,1``, as SLURM sets
    it for ``--gres=gpu:2``). RegkitWorkerPlugin pins each to one GPU, gives each half the job's cores, points the
    caches at ``REGKIT_NODE_CACHE`` and overrides dask's ``MALLOC_TRIM_THRESHOLD_``."""
    pytest.importorskip("dask.distributed")
    jobqueue = pytest.importorskip("dask_jobqueue.local")
    from distributed import Client

    from tests.helpers import run_cli

    isolate_worker_settings(monkeypatch)
    monkeypatch.delenv(WORKER_THREADS)  # as in a job script: dask's nanny sets OMP_NUM_THREADS=1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    make_data(tmp_path)
    spec = write_spec(tmp_path, LIST_SPEC)
    options = {"host": "127.0.0.1", "dashboard_address": None}
    with jobqueue.LocalCluster(
        cores=2,
        processes=2,
        memory="6GB",  # a ceiling per job (3 GB per worker), room for a worker that compiles kernels
        worker_extra_args=["--resources", "GPU=1"],
        scheduler_options=options,
        silence_logs="error",
    ) as cluster:
        cluster.scale(jobs=1)
        with Client(cluster) as client:
            client.wait_for_workers(2, timeout=60)
            assert run_cli(["batch", spec, "--executor", "dask", "--scheduler", cluster.scheduler_address]) == 0

            def plugin_settings(dask_worker) -> dict:
                return dask_worker.plugins["regkit"].settings

            settings = list(client.run(plugin_settings).values())
            resources = [w["resources"] for w in client.scheduler_info()["workers"].values()]
    assert "2 done, 0 skipped, 0 failed" in capsys.readouterr().out
    assert resources == [{"GPU": 1}, {"GPU": 1}]
    assert sorted(s["gpu"] for s in settings) == ["0", "1"]  # one GPU each
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    assert [s["threads"] for s in settings] == [max(1, cores // 2)] * 2
    assert all(s["caches"]["NUMBA_CACHE_DIR"] == str(cache_root() / "numba") for s in settings)
    if sys.platform.startswith("linux"):  # glibc's allocator: dask's MALLOC_TRIM_THRESHOLD_ overridden
        assert all("MALLOC_TRIM_THRESHOLD_" in s["allocator"] for s in settings)
    rows = Manifest(tmp_path / "out" / MANIFEST).rows()
    assert {row["state"] for row in rows.values()} == {"done"}
    assert all(row["worker"].startswith("LocalCluster-0-") for row in rows.values())

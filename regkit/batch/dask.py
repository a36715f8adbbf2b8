"""The dask executor (:func:`run_dask`, described in :mod:`regkit.batch`): the local cluster's worker processes
(:class:`LocalWorker`, :func:`plan_local_workers`, :func:`local_workers_for`, :func:`local_cluster`), the resources a
job asks for (:func:`job_resources`), and regkit's dask WorkerPlugin (:func:`worker_plugin`) with what it configures
in every worker (:func:`worker_threads`, :func:`node_cache_dir`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from regkit.batch.jobs import JobOutcome, execute_job, one_line
from regkit.batch.manifest import Manifest
from regkit.batch.plan import Job
from regkit.errors import RegkitError

NODE_CACHE = "REGKIT_NODE_CACHE"
"""Environment variable of a dask worker: the folder of its numba and Triton caches (:func:`node_cache_dir`)."""
WORKER_THREADS = "REGKIT_WORKER_THREADS"
"""Environment variable of a dask worker: the torch threads of its jobs (:func:`worker_threads`)."""
_PLUGIN = "regkit"  # the name of RegkitWorkerPlugin on a dask cluster


@dataclass(frozen=True)
class LocalWorker:
    """One worker process of the dask executor's LocalCluster."""

    name: str
    threads: int  # CPU threads of torch in the worker (OMP_NUM_THREADS, REGKIT_WORKER_THREADS)
    gpu: int | None  # the one GPU the worker sees (CUDA_VISIBLE_DEVICES); None without GPUs

    @property
    def env(self) -> dict[str, str]:
        """The worker process's environment variables: ``OMP_NUM_THREADS`` and :data:`WORKER_THREADS` (its torch
        threads) and, if pinned, ``CUDA_VISIBLE_DEVICES``."""
        env = {"OMP_NUM_THREADS": str(self.threads), WORKER_THREADS: str(self.threads)}
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
        return env

    @property
    def resources(self) -> dict[str, float]:
        """The dask resources the worker declares: ``GPU=1`` if pinned to a GPU, none otherwise."""
        return {} if self.gpu is None else {"GPU": 1}


def plan_local_workers(workers: int | None, gpus: int, cpus: int) -> list[LocalWorker]:
    """The worker processes of the dask executor's LocalCluster.

    With ``gpus`` > 0: ``workers`` (default: one per GPU) processes, worker ``i`` pinned to GPU ``i mod gpus`` (so more
    workers than GPUs share them evenly, fewer use the first ones). Without GPUs: ``workers`` (default 2) processes.
    The ``cpus`` cores are shared evenly: ``max(1, cpus // n)`` torch threads per worker.
    """
    n = workers if workers is not None else gpus or 2
    if n < 1:
        raise ValueError(f"workers must be at least 1, got {n}")
    threads = max(1, cpus // n)
    return [LocalWorker(f"worker-{i}", threads, i % gpus if gpus else None) for i in range(n)]


def cpu_count() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def job_resources(job: Job) -> dict[str, float]:
    """The dask resources the task of ``job`` asks for: ``GPU=1`` when its device is ``cuda`` or ``cuda:N``, so that
    it runs only on a worker that declares a GPU (the local cluster's pinned workers; remote workers started with
    ``--resources GPU=1``); none for ``cpu``, and none for ``auto``, which runs on whichever worker dask chooses: on
    its GPU if it sees one, else on its CPU."""
    return {"GPU": 1} if job.config.device.startswith("cuda") else {}


def _check_pinned_devices(jobs: list[Job]) -> None:
    """Pinned workers see one GPU each, as ``cuda:0``: a job configured for ``cuda:N`` (N > 0) could not run."""
    for job in jobs:
        if job.config.device.startswith("cuda:") and job.config.device != "cuda:0":
            raise RegkitError(
                f"job {job.name}: device {job.config.device!r} with --executor dask: each local worker is pinned to "
                "one GPU and sees it as 'cuda'; use device 'cuda' or 'auto'"
            )


def local_workers_for(jobs: list[Job], workers: int | None) -> list[LocalWorker]:
    """The worker processes the dask executor starts for ``jobs`` when no scheduler address is given:
    :func:`plan_local_workers` with this machine's CPU cores and its GPUs (``torch.cuda.device_count``), or no GPUs if
    every job runs on the CPU. Raises :class:`RegkitError` for a job that cannot run on them: with GPUs, one
    configured for ``cuda:N`` (N > 0: a pinned worker sees its one GPU as ``cuda``); without, one configured for
    ``cuda`` (no worker would ever take it)."""
    import torch

    gpus = 0 if all(job.config.device == "cpu" for job in jobs) else torch.cuda.device_count()
    if gpus:
        _check_pinned_devices(jobs)
    else:
        for job in jobs:
            if job_resources(job):
                raise RegkitError(
                    f"job {job.name}: device {job.config.device!r} with --executor dask, but this machine has no "
                    "CUDA GPU; use device 'auto' or 'cpu', or --scheduler with GPU workers"
                )
    return plan_local_workers(workers, gpus, cpu_count())


@contextlib.contextmanager
def local_cluster(workers: list[LocalWorker]) -> Iterator[Any]:
    """A ``dask.distributed`` cluster of one single-threaded worker process (Nanny) per :class:`LocalWorker`, each
    with its environment and resources, and a scheduler on 127.0.0.1 without dashboard; each worker may use ``1/n``
    of the memory (the nanny restarts a worker that exceeds it: its job fails)."""
    import logging

    from dask.distributed import Nanny, Scheduler, SpecCluster

    quiet = logging.WARNING
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard": False, "dashboard_address": None}}
    specs = {
        worker.name: {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                "env": worker.env,
                "resources": worker.resources,
                "host": "127.0.0.1",
                "memory_limit": 1 / len(workers),
                "silence_logs": quiet,
            },
        }
        for worker in workers
    }
    with SpecCluster(scheduler=scheduler, workers=specs, silence_logs=quiet) as cluster:
        yield cluster


# --- what RegkitWorkerPlugin does in each dask worker -----------------------------------------------------------------


def _version_problem(worker: Any, client_version: str) -> str | None:
    """The one-line error of a dask worker whose regkit version is not the client's, None where they are equal."""
    from regkit import __version__

    if __version__ == client_version:
        return None
    return (
        f"dask worker {worker.name} ({worker.address}) runs regkit {__version__}, this client regkit "
        f"{client_version}: install the client's version on every worker"
    )


def _pin_gpu(worker: Any) -> int:
    """Pin a dask worker that declares the GPU resource and sees several GPUs (``CUDA_VISIBLE_DEVICES`` lists more
    than one: a SLURM job with ``--gres=gpu:N`` running N worker processes) to one of them by ``CUDA_VISIBLE_DEVICES``:
    the i-th, i being its process number, the suffix ``-i`` that ``dask worker --nworkers N`` appends to the worker
    names. Returns the number of GPUs among which it chose (the workers that share its cores), 1 where it did not
    pin (one GPU or none, no GPU resource, or a name without a process number)."""
    visible = [gpu.strip() for gpu in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if gpu.strip()]
    number = re.fullmatch(r".*-(\d+)", str(worker.name))
    if not worker.state.total_resources.get("GPU") or len(visible) < 2 or number is None:
        return 1
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[int(number.group(1)) % len(visible)]
    return len(visible)


def worker_threads(worker: Any, sharing: int = 1) -> int:
    """The torch threads of a dask worker's jobs: :data:`WORKER_THREADS` where set (the local cluster sets each
    worker's share; a job script may too); else ``OMP_NUM_THREADS`` where more than 1 (e.g. exported by a job
    script); else, where it is 1 or unset (dask's nanny sets ``OMP_NUM_THREADS=1`` in its workers unless their
    environment sets it), the worker's share of the cores: the cores it may run on (its CPU affinity, on SLURM or PBS
    the job's cores) divided by its dask threads (the jobs it runs at a time) and by ``sharing``, the workers of one
    job that share them (one per GPU, :func:`_pin_gpu`).

    Raises :class:`RegkitError` naming the variable and the worker if :data:`WORKER_THREADS` is not a positive integer.
    """
    explicit = os.environ.get(WORKER_THREADS, "").strip()
    if explicit:
        if not explicit.isdigit() or int(explicit) < 1:
            raise RegkitError(f"{WORKER_THREADS}={explicit!r} on dask worker {worker.name}: give a positive integer")
        return int(explicit)
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 1:
        return int(omp)
    return max(1, cpu_count() // max(1, worker.state.nthreads) // sharing)


def node_cache_dir(worker: Any) -> Path:
    """The folder of a dask worker's numba and Triton caches: :data:`NODE_CACHE` where set in the worker's
    environment; else ``regkit-cache`` in the node's dask scratch folder, beside the workers' own folders (the parent
    of the worker's ``local_directory``: ``<local directory>/dask-scratch-space``, the local directory being
    ``--local-directory``, dask-jobqueue's ``local_directory`` or the temporary folder, ``$TMPDIR`` or ``/tmp``),
    shared by the workers of the node and kept after they end."""
    configured = os.environ.get(NODE_CACHE, "").strip()
    if configured:
        return Path(configured).expanduser()
    return Path(worker.local_directory).parent / "regkit-cache"


def _configure_worker(worker: Any) -> dict[str, Any]:
    """Make regkit's settings in a dask worker (``RegkitWorkerPlugin.setup``): the GPU pinning, the torch threads
    (``OMP_NUM_THREADS``, which :func:`_execute_in_worker` applies), the process settings of :mod:`regkit.process`
    (the allocator, overriding dask's ``MALLOC_TRIM_THRESHOLD_``, and the OpenMP wait policy where torch is not
    imported yet) and the cache folders; returns what it set."""
    from regkit import process

    threads = worker_threads(worker, _pin_gpu(worker))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return {
        "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "threads": threads,
        "allocator": process.tune_allocator(override_env=("MALLOC_TRIM_THRESHOLD_",)),
        "wait_policy": process.set_wait_policy(),
        "caches": process.configure_caches(node_cache_dir(worker)),
    }


@functools.cache
def _worker_plugin_class() -> type:
    """The class of :func:`worker_plugin`, defined on first use: its base class is dask.distributed's, optional and
    slow to import."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class RegkitWorkerPlugin(WorkerPlugin):
        name = _PLUGIN

        def __init__(self, version: str) -> None:
            self.version = version
            self.settings: dict[str, Any] = {}

        def __reduce__(self) -> tuple[Callable[[str], Any], tuple[str]]:
            return worker_plugin, (self.version,)  # pickled as the call that makes it: the class has no global name

        def setup(self, worker: Any) -> None:
            problem = _version_problem(worker, self.version)
            if problem is not None:
                raise RegkitError(problem)
            self.settings = _configure_worker(worker)

    return RegkitWorkerPlugin


def worker_plugin(version: str) -> Any:
    """regkit's dask WorkerPlugin (``RegkitWorkerPlugin``, needs dask.distributed) for a client of regkit ``version``:
    the client of a batch registers it on the cluster, and its setup runs on every worker, present or joining later.
    It raises :class:`RegkitError` on a worker whose regkit version is not ``version``; else it makes regkit's
    settings there (:func:`_configure_worker`) and keeps what it set in its ``settings`` (a dict)."""
    return _worker_plugin_class()(version)


def _execute_in_worker(job: Job, client_version: str) -> JobOutcome:
    """:func:`execute_job` in a dask worker whose regkit version is the client's (else the job fails with that line:
    a worker that joins after the run started and fails ``RegkitWorkerPlugin``'s setup still gets jobs), with
    ``OMP_NUM_THREADS`` torch threads (set here, in the thread that runs the job, as torch may have been imported
    before the plugin set the variable); the outcome names the worker."""
    import torch
    from distributed import get_worker

    worker = get_worker()
    label = f"{worker.name} on {socket.gethostname()}:{os.getpid()}"
    problem = _version_problem(worker, client_version)
    if problem is not None:
        return JobOutcome(name=job.name, state="failed", error=problem, worker=label, started=time.time())
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    return dataclasses.replace(execute_job(job), worker=label)


def _start_workers(client: Any, jobs: list[Job]) -> None:
    """Register ``RegkitWorkerPlugin`` with the client's regkit version on the cluster of ``client`` (its setup runs
    on every worker), and check that GPU jobs can be placed: if the cluster has workers and none declares the GPU
    resource, no job asking for it would ever start. Raises :class:`RegkitError` with one line on a problem."""
    from regkit import __version__

    try:
        client.register_plugin(worker_plugin(__version__), name=_PLUGIN)
    except RegkitError:
        raise
    except Exception as err:  # e.g. regkit missing on a worker, or a version without the plugin
        raise RegkitError(
            f"the dask workers of {client.scheduler.address} could not set up regkit ({one_line(err)}); install "
            f"regkit {__version__} on every worker"
        ) from None
    gpu_job = next((job for job in jobs if job_resources(job)), None)
    workers = client.scheduler_info()["workers"]
    if gpu_job is not None and workers and not any(w.get("resources", {}).get("GPU") for w in workers.values()):
        raise RegkitError(
            f"job {gpu_job.name}: device {gpu_job.config.device!r} needs a dask worker with a GPU, but none of the "
            f"{len(workers)} workers at {client.scheduler.address} declares one: start GPU workers with --resources "
            "GPU=1 (dask-jobqueue: worker_extra_args=['--resources', 'GPU=1'])"
        )


def run_dask(
    jobs: list[Job], manifest: Path, workers: int | None, scheduler: str | None, report: Callable[[JobOutcome], None]
) -> None:
    """Run ``jobs`` on a dask cluster (:mod:`regkit.batch`), recording each in ``manifest`` from this process and
    reporting each outcome as it arrives."""
    try:
        from dask.distributed import Client, as_completed
    except ImportError:
        raise RegkitError(
            "--executor dask needs dask.distributed: pip install 'regkit[dask]' (or 'dask[distributed]')"
        ) from None
    if not jobs:
        return
    from regkit import __version__

    with contextlib.ExitStack() as stack:
        if scheduler is None:
            cluster = stack.enter_context(local_cluster(local_workers_for(jobs, workers)))
            client = stack.enter_context(Client(cluster))
        else:
            client = stack.enter_context(Client(scheduler))
        _start_workers(client, jobs)
        book = Manifest(manifest)  # written by this process only: the workers return their outcomes
        book.start(jobs, f"dask scheduler {client.scheduler.address}")
        futures = {
            client.submit(_execute_in_worker, job, __version__, pure=False, resources=job_resources(job) or None): job
            for job in jobs
        }
        for future in as_completed(futures):
            job = futures[future]
            try:
                outcome = future.result()
            except Exception as err:  # the worker died (e.g. killed for memory) before the job could end
                outcome = JobOutcome(name=job.name, state="failed", error=one_line(err))
            book.finish(outcome)
            report(outcome)

"""The dask executor (:func:`run_dask`, described in :mod:`regkit.batch`): the local cluster (:class:`LocalWorker`,
:func:`plan_local_workers`, :func:`local_workers_for`, :func:`local_cluster`), a cluster given by address
(:func:`connect_scheduler`, :func:`tls_security`), the resources a job asks for (:func:`job_resources`), regkit's dask
WorkerPlugin (:func:`worker_plugin`) and what it sets in workers (:func:`worker_threads`, :func:`node_cache_dir`).

Over 500 lines because the cluster's security (TLS credentials of the local cluster, those given for a remote one)
belongs with the clusters it secures: split off, every executor change would touch two modules."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import re
import socket
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from regkit.batch.jobs import JobOutcome, execute_job, one_line
from regkit.batch.manifest import Manifest
from regkit.batch.plan import Job
from regkit.errors import RegkitError

if TYPE_CHECKING:
    from distributed import Client, Security

CONNECT_TIMEOUT = 5.0
"""Seconds a dask scheduler given by address has to accept the connection and send dask's handshake."""
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


def _require_distributed() -> None:
    """Raise :class:`RegkitError` saying how to install dask.distributed where it is missing."""
    try:
        import dask.distributed  # noqa: F401
    except ImportError:
        raise RegkitError("--executor dask needs dask.distributed: pip install 'regkit[dask]'") from None


@functools.cache
def _servers_without_http() -> tuple[type, ...]:
    """dask's Scheduler and Worker classes without the HTTP server that dask starts in each (metrics, health, state;
    the dashboard where asked for) whatever ``dashboard`` and ``dashboard_address`` say, on a port that nothing
    authenticates. Defined on first use: dask.distributed is optional and slow to import."""
    from distributed import Scheduler, Worker

    def start_no_http_server(self: Any, *args: Any, **kwargs: Any) -> None:
        """Start no HTTP server (where dask's ``ServerNode.start_http_server`` starts one)."""

    overrides = {"start_http_server": start_no_http_server}
    return tuple(type(f"{server.__name__}WithoutHttp", (server,), overrides) for server in (Scheduler, Worker))


def _worker_without_http(**options: Any) -> Any:
    """A dask Worker without HTTP server, the ``worker_class`` of the local cluster's nannies: a function of this
    module reaches their worker processes by name (a class made in a function could not be pickled)."""
    return _servers_without_http()[1](**options)


@contextlib.contextmanager
def local_cluster(workers: list[LocalWorker]) -> Iterator[Any]:
    """A ``dask.distributed`` cluster of one single-threaded worker process (Nanny) per :class:`LocalWorker`, each
    with its environment and resources, and a scheduler, on 127.0.0.1; each worker may use ``1/n`` of the memory (the
    nanny restarts a worker that exceeds it: its job fails). Every connection is TLS with credentials of this cluster
    alone (``Security.temporary()``: a certificate and key in memory, which ``Client(cluster)`` takes from
    ``cluster.security``), so a process without them (another user's) can neither connect nor run code in the workers;
    no process of the cluster serves HTTP. Raises :class:`RegkitError` without the ``cryptography`` package."""
    import logging

    from dask.distributed import Nanny, Security, SpecCluster

    try:
        security = Security.temporary()
    except ImportError:
        raise RegkitError(
            "--executor dask needs the cryptography package for the TLS credentials of its local cluster: pip "
            "install 'regkit[dask]' (or 'cryptography')"
        ) from None
    quiet = logging.WARNING
    options = {"host": "127.0.0.1", "dashboard": False, "security": security}
    scheduler = {"cls": _servers_without_http()[0], "options": options}
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
                "security": security,
                "worker_class": _worker_without_http,
            },
        }
        for worker in workers
    }
    with SpecCluster(scheduler=scheduler, workers=specs, security=security, silence_logs=quiet) as cluster:
        yield cluster


# --- a cluster given by address: the address, TLS, the connection --------------------------------------------------


def tls_security(ca_file: Path | None = None, cert: Path | None = None, key: Path | None = None) -> Security:
    """The dask ``Security`` of a client of a TLS scheduler, encryption required, of PEM files: ``ca_file``, the
    certificate of the authority that signed the cluster's; ``cert``, this client's; ``key``, its private key (None
    where ``cert`` holds it). Those not given, the ciphers and TLS versions come from dask's configuration
    (``distributed.comm.tls.ca-file``, ``.client.cert``, ``.client.key``); :func:`connect_scheduler` checks them."""
    _require_distributed()
    from dask.distributed import Security

    files = {"tls_ca_file": ca_file, "tls_client_cert": cert, "tls_client_key": key}
    return Security(require_encryption=True, **{field: str(path) for field, path in files.items() if path is not None})


def scheduler_protocol(address: str) -> str:
    """The protocol of a dask scheduler address (``tcp`` where it has none, dask's default) after checking that the
    address is ``PROTOCOL://HOST:PORT`` with a protocol that dask knows; raises :class:`RegkitError` otherwise."""
    _require_distributed()
    from distributed.comm import parse_address, parse_host_port
    from distributed.comm.registry import backends

    try:
        scheme, location = parse_address(address)
        if scheme not in backends:
            raise ValueError(f"unknown protocol {scheme}://, dask has {', '.join(f'{b}://' for b in backends)}")
        if scheme != "inproc":  # this process's own scheduler, no network
            parse_host_port(location)
    except ValueError as err:
        raise RegkitError(
            f"--scheduler {address!r} is not a dask scheduler address ({err}): give PROTOCOL://HOST:PORT, e.g. "
            "tls://10.0.0.5:8786"
        ) from None
    return scheme


def _check_tls_files(address: str, security: Security) -> None:
    """Check that ``security`` gives a client of the TLS scheduler at ``address`` what it needs: a CA certificate
    and a client certificate (and its key), each readable (a file, or PEM text held in memory as
    ``Security.temporary()`` does), that load; raises :class:`RegkitError` naming the file otherwise."""
    tls = security.get_tls_config_for_role("client")
    if not (tls["ca_file"] and tls["cert"]):
        raise RegkitError(
            f"--scheduler {address}: a TLS scheduler needs this client's credentials: give --tls-ca-file, --tls-cert "
            "and --tls-key (or dask's distributed.comm.tls.ca-file, .client.cert and .client.key)"
        )
    for role, value in (("CA certificate", tls["ca_file"]), ("certificate", tls["cert"]), ("key", tls["key"])):
        path = Path(value or ".")  # a file, or None, or PEM text held in memory
        if value and "\n" not in value and not (path.is_file() and os.access(path, os.R_OK)):
            problem = "not a readable file" if path.exists() else "no such file"
            raise RegkitError(f"--scheduler {address}: the TLS {role} {path}: {problem}")
    try:
        security.get_connection_args("client")
    except (OSError, ValueError) as err:
        raise RegkitError(f"--scheduler {address}: the TLS files do not load: {one_line(err)}") from None


def _handshake_within(address: str, connection_args: dict[str, Any], timeout: float) -> None:
    """Connect to the dask server at ``address`` and receive its handshake within ``timeout`` seconds (dask's own
    connection waits forever for that of a server that accepts and stays silent), in a thread with its own event loop
    (the caller may be in one, a notebook's); then close the connection."""
    from distributed.comm import connect

    async def handshake() -> None:
        comm = await asyncio.wait_for(connect(address, timeout=timeout, **connection_args), timeout)
        await comm.close()

    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, handshake()).result()


def connect_scheduler(address: str, security: Security | None = None) -> Client:
    """A dask ``Client`` of the scheduler at ``address`` (``PROTOCOL://HOST:PORT``, the protocol by default dask's
    ``tcp``) with ``security`` (None: dask's configuration, ``distributed.comm.tls.*``), which must give a CA
    certificate, a client certificate and its key for ``tls://`` and ``wss://`` (:func:`tls_security`). ``tcp://``,
    ``ws://`` and ``ucx://`` are neither encrypted nor authenticated (whoever reaches the scheduler can run code on its
    workers): a ``UserWarning``, and refused with ``security`` given, which would go unused (``inproc://``, this
    process's own scheduler: neither). Raises :class:`RegkitError`, one line naming the address, for an address that
    is none, missing or unusable credentials, and a scheduler that refuses the connection or does not answer within
    :data:`CONNECT_TIMEOUT` seconds."""
    from dask.distributed import Client, Security

    scheme = scheduler_protocol(address)
    given, security = security is not None, Security() if security is None else security
    if scheme in ("tls", "wss"):
        _check_tls_files(address, security)
    elif scheme != "inproc" and given:
        raise RegkitError(f"--scheduler {address}: TLS settings were given, but {scheme}:// has no TLS: use tls://")
    elif scheme != "inproc":
        warnings.warn(
            f"the dask scheduler {address} is reached over {scheme}://, neither encrypted nor authenticated: anyone "
            "who reaches it can run code on its workers; use tls:// with --tls-ca-file, --tls-cert, --tls-key",
            stacklevel=2,
        )
    try:
        _handshake_within(address, security.get_connection_args("client"), CONNECT_TIMEOUT)
        return Client(address, security=security, timeout=CONNECT_TIMEOUT)
    except Exception as err:  # refused, name unknown, TLS handshake failed, not a dask server, no answer
        timeout = isinstance(err, TimeoutError | asyncio.TimeoutError)
        reason = f"no answer within {CONNECT_TIMEOUT:g} s" if timeout else one_line(err)
        raise RegkitError(f"cannot connect to the dask scheduler at {address}: {reason}") from None


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
    jobs: list[Job],
    manifest: Path,
    workers: int | None,
    scheduler: str | None,
    report: Callable[[JobOutcome], None],
    security: Security | None = None,
) -> None:
    """Run ``jobs`` on a dask cluster (:mod:`regkit.batch`): a :func:`local_cluster` where ``scheduler`` is None, else
    the scheduler at that address with ``security`` (:func:`connect_scheduler`); record each in ``manifest`` from this
    process and report each outcome as it arrives."""
    _require_distributed()
    from dask.distributed import Client, as_completed

    if scheduler is None and security is not None:
        raise RegkitError(
            "TLS settings (--tls-ca-file, --tls-cert, --tls-key) are for a cluster given by --scheduler: the local "
            "cluster makes its own temporary credentials"
        )
    if not jobs:
        return
    from regkit import __version__

    with contextlib.ExitStack() as stack:
        if scheduler is None:
            cluster = stack.enter_context(local_cluster(local_workers_for(jobs, workers)))
            client = stack.enter_context(Client(cluster))
        else:
            client = stack.enter_context(connect_scheduler(scheduler, security))
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

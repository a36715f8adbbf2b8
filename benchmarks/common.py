"""What the benchmark commands share: the device option, the results file (its header: command, machine, date, tree),
memory readings, table rendering, device description, CUDA-graph timing, and the accuracy benchmark's pair sets and
MNI152 files (here, not in ``accuracy_pairs``, which imports torch, so that ``--help`` starts without torch)."""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from enum import Enum
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from typer.core import TyperGroup

MiB = 2**20
# The ITK examples' Data folder (Debian's insighttoolkit5-examples): the 2D slices of ``accuracy`` and ``features``.
ITK_DATA = Path("/usr/share/doc/insighttoolkit5-examples/examples/Data")
# The pair sets of ``accuracy`` (benchmarks.accuracy_pairs makes them).
PAIR_SETS = ("2mm", "1mm", "contrast", "contrast1mm", "itk2d", "multimodal2d", "nibabel", "mni2d", "sanity")
# nilearn's bundled MNI152 2009a files at 1 mm (the 1 mm pairs of ``registration`` and ``accuracy``).
MNI152_FILES = {
    "t1": "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz",
    "gm": "mni_icbm152_gm_tal_nlin_sym_09a_converted.nii.gz",
    "wm": "mni_icbm152_wm_tal_nlin_sym_09a_converted.nii.gz",
}
ROOT = Path(__file__).resolve().parents[1]  # the checkout's root
RESULTS = ROOT / "benchmarks" / "results"
# Where the tree's commit comes from when the checkout has no git metadata (a copy of the working tree on a GPU
# machine: benchmarks/scripts/h200.sh sets it from the commit recorded where git is).
COMMIT_VARIABLE = "REGKIT_BENCH_COMMIT"


class Device(str, Enum):
    """Where a benchmark runs (``--device``)."""

    cpu = "cpu"
    cuda = "cuda"


_argv: list[str] | None = None  # the arguments of the running ``python -m benchmarks`` command (CommandGroup)


class CommandGroup(TyperGroup):
    """The ``python -m benchmarks`` group: keeps the arguments it is given (the command and its options, as typed)
    for :func:`command_line`."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        global _argv
        _argv = list(args)
        return super().parse_args(ctx, args)


def command_line() -> str:
    """The command line that is running: ``python -m benchmarks`` and the arguments as given to the group (else
    ``python`` and ``sys.argv``, as for a script)."""
    if _argv is None:
        return shlex.join(["python", *sys.argv])
    return shlex.join(["python", "-m", "benchmarks", *_argv])


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def machine(device: str) -> str:
    """What runs a benchmark: the GPU (``device`` ``cuda``) or the CPU model, cores and torch's threads, and the
    versions of Python, torch, triton and numba."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = torch.get_num_threads()
    host = f"{_cpu_model()}, {cores} cores, torch on {threads} thread{'' if threads == 1 else 's'}"
    if device == "cuda":
        host = f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda}); host {host}"
    software = f"Python {platform.python_version()}, torch {torch.__version__}, triton {_version('triton')}"
    return f"{host}; {software}, numba {_version('numba')}"


def machine_slug(device: str) -> str:
    """``cpu``, or the GPU's name in lower case without the vendor (``h200`` for an NVIDIA H200): the machine part of
    a results file's name."""
    if device != "cuda":
        return "cpu"
    import torch

    name = re.sub(r"^nvidia\s+", "", torch.cuda.get_device_name(0).lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def tree_commit(root: Path = ROOT) -> str:
    """The git commit of the checkout, with ``+ changes`` when tracked or untracked files differ from it (the results
    tables aside: writing them does not change what is measured); ``REGKIT_BENCH_COMMIT`` when set (a copy of the tree
    made at that commit, as benchmarks/scripts/h200.sh carries it), else ``unknown`` where git is missing."""
    if os.environ.get(COMMIT_VARIABLE):
        return os.environ[COMMIT_VARIABLE]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", ".", ":(exclude)benchmarks/results"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout)"
    return commit + (" + changes" if status else "")


def header(device: str, command: str | None = None) -> str:
    """The first lines of every results file: the command line (default :func:`command_line`), the machine, the date
    (UTC) and the tree's commit."""
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = command or command_line()
    return "\n".join(
        [
            f"# `{command}`",
            "",
            f"- machine: {machine(device)}",
            f"- date: {date}",
            f"- tree: {tree_commit()}",
            "",
            "Written by the command above, run from the checkout's root; rerun it to regenerate this file.",
            "",
        ]
    )


def run_worker(module: str, spec: dict[str, Any], timeout: float, tree: Path | None = None) -> dict[str, Any]:
    """Run ``benchmarks.MODULE.worker()`` in a fresh Python process with ``spec`` as JSON in ``argv[1]``; return the
    JSON object it prints last, or ``{"failed": reason}``. ``tree``: a folder holding another ``regkit/`` and
    ``kernels/`` (an export of another commit), imported in place of this checkout's (the benchmarks stay these)."""
    import json

    env = os.environ.copy()
    tree = None if tree is None else tree.resolve()  # it becomes the working directory
    paths = [] if tree is None else [str(tree), str(tree / "kernels")]
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT), str(ROOT / "kernels"), env.get("PYTHONPATH", "")])
    code = f"from benchmarks.{module} import worker; worker()"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=tree or ROOT,  # "-c" puts the working directory first on sys.path
        )
    except subprocess.TimeoutExpired:
        return {"failed": f"over {timeout:.0f} s"}
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"]
        return {"failed": lines[-1][:120]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def default_output(command: str, device: str, quick: bool = False) -> Path:
    """``benchmarks/results/COMMAND-MACHINE.md`` (``-quick`` added for smoke runs, which do not replace a table)."""
    return RESULTS / f"{command}-{machine_slug(device)}{'-quick' if quick else ''}.md"


class Results:
    """A results file: the header, then the command's sections, the file rewritten after each one (a run stopped
    early leaves what it had measured)."""

    def __init__(self, path: Path, device: str, command: str | None = None) -> None:
        self.path = path
        self.head = header(device, command)
        self.sections: list[str] = []
        path.parent.mkdir(parents=True, exist_ok=True)
        self._write()

    def add(self, *sections: str) -> None:
        """Append sections (markdown, joined by newlines) and rewrite the file."""
        self.sections += sections
        self._write()

    def set(self, *sections: str) -> None:
        """Replace every section after the header and rewrite the file."""
        self.sections = list(sections)
        self._write()

    def _write(self) -> None:
        self.path.write_text("\n".join([self.head, *self.sections]))


def mni152_file(kind: str, folder: Path | None = None) -> Path:
    """One of nilearn's bundled MNI152 1 mm files (``kind`` ``t1``, ``gm`` or ``wm``: :data:`MNI152_FILES`), from
    ``folder`` or from the installed nilearn's data (found without importing nilearn)."""
    import importlib.util

    from regkit.errors import RegkitError

    if folder is None:
        spec = importlib.util.find_spec("nilearn")
        if spec is None or not spec.submodule_search_locations:
            raise RegkitError(
                "the 1 mm pairs need nilearn's bundled MNI152 files: pip install nilearn, or --mni-data DIR"
            )
        folder = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data"
    path = folder / MNI152_FILES[kind]
    if not path.is_file():
        raise RegkitError(f"{path} not found: --mni-data must hold nilearn's {', '.join(MNI152_FILES.values())}")
    return path


def rss_bytes(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` (current / peak resident set) of this process, in bytes (Linux ``/proc``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def mib(peak: int | None) -> str:
    """Bytes as MiB with one decimal, or ``n/a``."""
    return "n/a" if peak is None else f"{peak / MiB:,.1f}"


def render(title: str, header: list[str], rows: list[list[str]]) -> tuple[Any, str]:
    """A rich table and the same table as markdown."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for name in header:
        table.add_column(name, justify="left" if name in ("tessellation", "method") else "right")
    for row in rows:
        table.add_row(*row)
    lines = [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return table, "\n".join(lines) + "\n"


def device_name(device: str) -> str:
    """``"NVIDIA H200, torch 2.11"`` or ``"CPU x86_64 (2 threads), torch 2.13"``: what ran a benchmark."""
    import platform

    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    cpu, threads = platform.processor() or platform.machine(), torch.get_num_threads()
    return f"CPU {cpu} ({threads} thread{'' if threads == 1 else 's'}), torch {torch.__version__}"


def capture_graph(step: Any) -> Any:
    """``step`` (CUDA work) captured in a CUDA graph, after two warm-up calls on a side stream (allocator, lazy
    initialisation, compiles, cuDNN autotuning outside the graph); returns the ``torch.cuda.CUDAGraph``, whose
    ``replay()`` reruns the captured work on the graph's own buffers."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def graphed_seconds(step: Any, reps: int = 10) -> float:
    """Best time of ``step`` (CUDA work only, no host synchronisation) replayed from a CUDA graph: the GPU's own time,
    without Python, autograd and launch overhead."""
    import torch

    graph = capture_graph(step)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)

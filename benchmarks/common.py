"""What the benchmark commands share: the device option, memory readings, table rendering, device description,
CUDA-graph timing, and the accuracy benchmark's pair sets (here, not in ``accuracy_pairs``, which imports torch, so
that ``--help`` starts without torch)."""

from __future__ import annotations

import time
from enum import Enum
from pathlib import Path
from typing import Any

MiB = 2**20
# The ITK examples' Data folder (Debian's insighttoolkit5-examples): the 2D slices of ``accuracy`` and ``features``.
ITK_DATA = Path("/usr/share/doc/insighttoolkit5-examples/examples/Data")
# The pair sets of ``accuracy`` (benchmarks.accuracy_pairs makes them).
PAIR_SETS = ("2mm", "1mm", "contrast", "contrast1mm", "itk2d", "nibabel", "mni2d", "sanity")


class Device(str, Enum):
    """Where a benchmark runs (``--device``)."""

    cpu = "cpu"
    cuda = "cuda"


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

"""``python -m benchmarks wtconv``: the fused WTConv kernels beside the reference layer and a depthwise convolution.

Shapes: the WTConvNeXt-T stages at batch 64, kernel 5 ((64, 96, 56, 56) with 5 levels, (64, 192, 28, 28) with 4,
(64, 384, 14, 14) with 3, (64, 768, 7, 7) with 2) and two 3D shapes of the registration feature network with 3 levels.
Versions, all in this process: the fused kernels in float32 and bfloat16 (bfloat16 activations, float32 parameters),
the reference layer with ``torch.backends.cudnn.benchmark`` off (PyTorch's default) and on, the same layer computed
the way the authors' code computes it (2D only: "authors' layer", :func:`_authors_layer`), off and on, and a plain
depthwise k x k convolution with bias (cuDNN autotuning on).

* Times: CUDA events around each call after warm-up; the median of repeated runs. "forward" is the layer's call with
  gradients enabled (what a training step runs); "fwd+bwd" is that plus ``backward`` of a random output gradient.
  "graphed" is the same forward + backward captured once in a CUDA graph and replayed (every version, so the
  comparison stays like for like): the GPU's own time without Python and launch overhead, which is most of an eager
  step at the small stages.
* Peak memory: ``torch.cuda.max_memory_allocated`` over one forward + backward, counting everything allocated for it,
  the input x and output gradient included (x alone is given in each table's title). "peak, sum loss" is the same
  for a step whose loss is the output's sum (``layer(x).sum().backward()``): no output gradient is allocated up front,
  and the output is freed once summed, as in a training step whose next operation does not keep it.
* Interleaved: for each 2D shape, the eager fwd+bwd of the fused fp32 and bf16 layers and the reference layer timed
  round by round in one loop (a step of each per round, the order rotating), with the medians of the per-round
  ratios: a comparison that drifts in the GPU's or the host's speed cannot tilt, as they can between rows measured
  one after another.
* I/O model: the bytes a version must move through HBM if every kernel reads its inputs once and writes its outputs
  once. For the fused kernels it is counted from their launches; for the PyTorch versions every ATen operator of the
  forward and backward passes is traced on the meta device and its tensor arguments and results are summed (view
  operators move nothing; workspaces are not counted, so this is a lower bound). Achieved bandwidth = I/O bytes over
  the fwd+bwd time, also as a share of the measured device-to-device copy bandwidth.
* First use: seconds that the first forward + backward of a configuration takes beyond a warm one, in a fresh process
  with an empty Triton cache; one configuration at a time unless ``--first-use-jobs`` runs several processes at once
  (then each competes with the others for the CPU, so its figure is an upper bound).

``--quick`` runs tiny shapes on the CPU in seconds (the fused rows only under ``TRITON_INTERPRET=1``); its times mean
nothing.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from benchmarks.common import MiB, Results, capture_graph, default_output

if TYPE_CHECKING:
    import torch

_VERSIONS = (
    "fused fp32",
    "fused bf16",
    "reference",
    "reference (cudnn.benchmark)",
    "authors' layer",
    "authors' layer (cudnn.benchmark)",
    "depthwise conv",
)
# The versions timed round by round in one loop (see interleaved).
_INTERLEAVED = ("fused fp32", "fused bf16", "reference")
# Versions that run with cuDNN autotuning off (PyTorch's default); every other one runs with it on.
_CUDNN_DEFAULT = ("reference", "authors' layer")


@dataclass(frozen=True)
class Case:
    """One layer configuration: input shape ``(B, C, *spatial)``, wavelet levels and kernel size."""

    shape: tuple[int, ...]
    levels: int
    kernel: int

    @property
    def ndim(self) -> int:
        return len(self.shape) - 2

    @property
    def name(self) -> str:
        return f"{tuple(self.shape)} L{self.levels} k{self.kernel}"


FULL_CASES = (
    Case((64, 96, 56, 56), 5, 5),
    Case((64, 192, 28, 28), 4, 5),
    Case((64, 384, 14, 14), 3, 5),
    Case((64, 768, 7, 7), 2, 5),
    Case((2, 32, 96, 112, 96), 3, 5),
    Case((1, 16, 160, 192, 160), 3, 5),
)
QUICK_CASES = (Case((1, 2, 8, 6), 2, 3), Case((1, 1, 4, 4, 3), 1, 3))


# ---- the versions --------------------------------------------------------------------------------------------------


def _authors_layer(layer: Any) -> Any:
    """A 2D WTConv layer computed the way the authors' code computes it (the formulation behind the paper's timings),
    on the parameters of ``layer`` (a ``regkit.features.WTConv2d``), with the same result.

    The Haar analysis of a level is a stride-2 grouped convolution with the four fixed 2 x 2 filters per channel (the
    output channel ``4 c + b`` is sub-band ``b`` of channel ``c``), its synthesis the transposed convolution with the
    same filters (the orthonormal Haar matrix is symmetric); a level's four processed sub-bands are split into the
    low-pass and the three high-passes, and the synthesis cascade concatenates them back level by level. Only
    :func:`build_layer` uses it, for the "authors' layer" versions."""
    import torch
    import torch.nn.functional as F

    class _AuthorsLayer(torch.nn.Module):
        filters: torch.Tensor

        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner
            sign = torch.tensor([[1.0, 1.0], [1.0, -1.0]])  # low-pass, high-pass along one axis
            bands = [0.5 * torch.outer(sign[b & 1], sign[b >> 1]) for b in range(4)]  # bit 0: y, bit 1: x
            filters = torch.stack(bands)[:, None].repeat(inner.channels, 1, 1, 1)  # (4 C, 1, 2, 2)
            self.register_buffer("filters", filters)

        def forward(self, x: Any) -> Any:
            inner, channels = self.inner, self.inner.channels
            shapes, lows, highs = [], [], []
            low = x
            for conv, scale in zip(inner.wavelet_convs, inner.wavelet_scale, strict=True):
                shapes.append(low.shape[2:])
                if low.shape[2] % 2 or low.shape[3] % 2:
                    low = F.pad(low, (0, low.shape[3] % 2, 0, low.shape[2] % 2))
                bands = F.conv2d(low, self.filters, stride=2, groups=channels)
                low = bands.unflatten(1, (channels, 4))[:, :, 0]
                processed = (scale.weight * conv(bands)).unflatten(1, (channels, 4))
                lows.append(processed[:, :, 0])
                highs.append(processed[:, :, 1:])
            reconstruction: Any = 0
            for shape in reversed(shapes):
                bands = torch.cat(((lows.pop() + reconstruction).unsqueeze(2), highs.pop()), dim=2).flatten(1, 2)
                reconstruction = F.conv_transpose2d(bands, self.filters, stride=2, groups=channels)
                reconstruction = reconstruction[:, :, : shape[0], : shape[1]]
            return inner.base_scale.weight * inner.base_conv(x) + reconstruction

    return _AuthorsLayer(layer)


def build_layer(case: Case, version: str, device: str) -> tuple[Any, Any, Any]:
    """(module, x, output gradient) for one version, parameters drawn uniformly in [-1, 1] (seeded)."""
    import torch

    from regkit.features import WTConv

    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if version == "fused bf16" else torch.float32
    channels = case.shape[1]
    if version == "depthwise conv":
        conv = (torch.nn.Conv2d if case.ndim == 2 else torch.nn.Conv3d)(
            channels, channels, case.kernel, padding=case.kernel // 2, groups=channels
        )
        module: torch.nn.Module = conv
    else:
        backend = "triton" if version.startswith("fused") else "reference"
        module = WTConv[case.ndim](channels, case.kernel, case.levels, backend=backend)
        if version.startswith("authors'"):
            module = _authors_layer(module)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
    module = module.to(device)
    x = torch.randn(case.shape, generator=gen).to(device=device, dtype=dtype).requires_grad_(True)
    grad = torch.randn(case.shape, generator=gen).to(device=device, dtype=dtype)
    return module, x, grad


def _step(module: Any, x: Any, grad: Any) -> None:
    x.grad = None
    module.zero_grad(set_to_none=True)
    module(x).backward(grad)


def _graphed_step(module: Any, x: Any, grad: Any) -> Callable[[], Any]:
    """One forward + backward captured in a CUDA graph (after warm-up steps on a side stream, which compile and, with
    ``cudnn.benchmark``, autotune); returns its replay. The gradients are written into the graph's own buffers."""
    return capture_graph(lambda: _step(module, x, grad)).replay


# ---- measurements -------------------------------------------------------------------------------------------------


def _once(device: str, fn: Callable[[], Any]) -> float:
    """Milliseconds of one call of ``fn``: CUDA events around it on the GPU (so the time from the first launch to the
    end of the last kernel), the wall clock on the CPU."""
    import torch

    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - t0)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end)


def _timer(device: str, budget_s: float, max_runs: int, warm_up: bool = True) -> Callable[[Callable[[], Any]], float]:
    """A function that times ``fn`` after one warm-up call and returns the median in ms: runs while within
    ``budget_s`` seconds, at least 3 (1 if the warm-up alone took longer than the budget), at most ``max_runs``."""

    def time_it(fn: Callable[[], Any]) -> float:
        least = min(3, max_runs)
        if warm_up and _once(device, fn) > 1000 * budget_s:
            least = 1
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < max_runs and (len(times) < least or time.perf_counter() - start < budget_s):
            times.append(_once(device, fn))
        return statistics.median(times)

    return time_it


def _measure(case: Case, version: str, device: str, time_it: Callable[[Callable[[], Any]], float]) -> dict[str, Any]:
    import torch

    cuda = device == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = version not in _CUDNN_DEFAULT
        torch.cuda.synchronize()
    base = torch.cuda.memory_allocated() if cuda else 0
    module, x, grad = build_layer(case, version, device)
    result: dict[str, Any] = {
        "forward_ms": time_it(lambda: module(x)),
        "step_ms": time_it(lambda: _step(module, x, grad)),
    }
    if cuda:
        x.grad = None
        module.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _step(module, x, grad)
        torch.cuda.synchronize()
        result["peak_bytes"] = torch.cuda.max_memory_allocated() - base
        x.grad = None
        module.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        module(x).sum().backward()
        torch.cuda.synchronize()
        unused = grad.numel() * grad.element_size()  # the prepared output gradient, idle in this step
        result["peak_sum_bytes"] = torch.cuda.max_memory_allocated() - base - unused
        result["graph_ms"] = time_it(_graphed_step(module, x, grad))
    return result


def interleaved(case: Case, device: str, budget_s: float, max_rounds: int) -> dict[str, float]:
    """Eager forward + backward of the fused fp32 and bf16 layers and the reference layer (PyTorch's default cuDNN
    setting), interleaved: every round times one step of each, so that drifts in the GPU's or the host's speed during
    the measurement fall on all three alike (the per-version rows are measured one version after another). The order
    rotates from round to round: a step that follows another version's runs with the host's caches holding that
    version's code, which costs a host-bound step more than one that follows itself. Returns the median step of each
    (ms), the medians over rounds of the ratios bf16 / fp32 and reference / fp32, and the number of rounds (a multiple
    of 3, at least 3, then while within ``budget_s``)."""
    import torch

    if device == "cuda":
        torch.backends.cudnn.benchmark = False
    built = {version: build_layer(case, version, device) for version in _INTERLEAVED}
    steps = {version: (lambda b=b: _step(*b)) for version, b in built.items()}
    for step in steps.values():  # warm-up: compile and allocate
        step()
    times: dict[str, list[float]] = {version: [] for version in _INTERLEAVED}
    start, rounds = time.perf_counter(), 0
    while rounds < max_rounds and (rounds < 3 or rounds % 3 or time.perf_counter() - start < budget_s):
        for i in range(3):
            version = _INTERLEAVED[(rounds + i) % 3]
            times[version].append(_once(device, steps[version]))
        rounds += 1
    fp32, bf16, ref = (times[v] for v in _INTERLEAVED)
    return {
        **{version: statistics.median(t) for version, t in times.items()},
        "bf16 / fp32": statistics.median(b / f for b, f in zip(bf16, fp32, strict=True)),
        "reference / fp32": statistics.median(r / f for r, f in zip(ref, fp32, strict=True)),
        "rounds": len(fp32),
    }


def interleaved_line(case: Case, result: dict[str, float]) -> str:
    return (
        f"{case.name}: interleaved eager fwd+bwd, {result['rounds']:.0f} rounds: fused fp32 "
        f"{_fmt(result['fused fp32'])}, fused bf16 {_fmt(result['fused bf16'])}, reference "
        f"{_fmt(result['reference'])} ms; per round bf16 / fp32 {result['bf16 / fp32']:.3f}, reference / fused fp32 "
        f"{result['reference / fp32']:.2f} (medians)."
    )


def _copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), the median of 20 copies of 1 GiB."""
    import torch

    src = torch.empty(2**28, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = _timer("cuda", 1.0, 20)(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms / 1000)


def _traced_bytes(case: Case, version: str) -> int:
    """Bytes moved by the ATen operators of one forward + backward on the meta device (see the module docstring)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    total = 0

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal total
            out = func(*args, **(kwargs or {}))
            if not func.is_view and func.overloadpacket not in _NO_TRAFFIC:
                tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
                total += sum(t.numel() * t.element_size() for t in tensors)
            return out

    _NO_TRAFFIC = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided}
    module, x, grad = build_layer(case, version, "meta")
    with _Count():
        _step(module, x, grad)
    return total


def fused_bytes(case: Case, itemsize: int) -> int:
    """Bytes the fused kernels move in one forward + backward (weights aside): the launches of
    ``regkit_kernels.wtconv``, each reading its inputs once and writing its outputs once; coarse tensors are float32."""
    nb, f32 = 2**case.ndim, 4
    planes = case.shape[0] * case.shape[1]
    grid = [planes * math.prod(-(-s // 2**j) for s in case.shape[2:]) for j in range(case.levels + 1)]
    lowpass = sum((itemsize if j == 1 else f32) * grid[j - 1] + f32 * grid[j] for j in range(1, case.levels))
    coarse = sum(f32 * nb * grid[j] for j in range(2, case.levels + 1))
    lows = sum(f32 * grid[j - 1] for j in range(2, case.levels + 1))
    forward = lowpass + lows + coarse + coarse + 2 * itemsize * grid[0]
    backward = lowpass + 2 * lows + coarse + coarse + 3 * itemsize * grid[0]
    return forward + backward


def first_use_worker() -> None:
    """Subprocess entry: seconds of the first forward + backward beyond a warm one, for the case in argv[1]."""
    import torch

    spec = json.loads(sys.argv[1])
    case = Case(tuple(spec["shape"]), spec["levels"], spec["kernel"])
    module, x, grad = build_layer(case, spec["version"], "cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _step(module, x, grad)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    _step(module, x, grad)
    torch.cuda.synchronize()
    print(json.dumps({"first_use_s": (t1 - t0) - (time.perf_counter() - t1)}))


def _first_use(cases: tuple[Case, ...], cache: Path, jobs: int) -> dict[tuple[Case, str], float | str]:
    """First-use seconds of every fused configuration, each in a fresh process with an empty Triton cache, ``jobs``
    processes at a time; their compiled kernels are then merged into ``cache`` so that this process finds them."""
    pending = [(case, version) for case in cases for version in ("fused fp32", "fused bf16")]
    results: dict[tuple[Case, str], float | str] = {}
    while pending:
        running = []
        for case, version in pending[:jobs]:
            private = Path(tempfile.mkdtemp(prefix="regkit-triton-"))
            env = {**os.environ, "TRITON_CACHE_DIR": str(private)}
            spec = json.dumps({**asdict(case), "version": version})
            code = "from benchmarks.wtconv import first_use_worker; first_use_worker()"
            proc = subprocess.Popen(
                [sys.executable, "-c", code, spec], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            running.append((case, version, private, proc))
        del pending[:jobs]
        for case, version, private, proc in running:
            out, err = proc.communicate(timeout=900)
            if proc.returncode == 0:
                results[(case, version)] = json.loads(out.strip().splitlines()[-1])["first_use_s"]
                shutil.copytree(private, cache, dirs_exist_ok=True)
            else:
                results[(case, version)] = "failed: " + (err.strip().splitlines() or ["?"])[-1][:80]
            shutil.rmtree(private, ignore_errors=True)
    return results


# ---- tables -------------------------------------------------------------------------------------------------------


def _fmt(value: float, digits: int = 3) -> str:
    return f"{value:.{digits}g}" if value < 1000 else f"{value:,.0f}"


def _row(version: str, result: dict[str, Any], io_bytes: int | None, copy_bw: float | None, first: Any) -> list[str]:
    if "skipped" in result:
        return [version, result["skipped"], "", "", "", "", "", "", "", ""]
    peak, graph = result.get("peak_bytes"), result.get("graph_ms")
    cells = [version, _fmt(result["forward_ms"]), _fmt(result["step_ms"]), "n/a" if graph is None else _fmt(graph)]
    cells += ["n/a" if b is None else _fmt(b / MiB) for b in (peak, result.get("peak_sum_bytes"))]
    if io_bytes is None:
        cells += ["", "", ""]
    else:
        bandwidth = io_bytes / (result["step_ms"] / 1000)
        share = "" if copy_bw is None else f"{100 * bandwidth / copy_bw:.0f}%"
        cells += [_fmt(io_bytes / 1e6), _fmt(bandwidth / 1e9), share]
    cells.append("" if first is None else (first if isinstance(first, str) else f"{first:.1f}"))
    return cells


def _render(title: str, rows: list[list[str]]) -> tuple[Any, str]:
    from rich.table import Table

    header = [
        "version",
        "forward ms",
        "fwd+bwd ms",
        "graphed ms",
        "peak MiB",
        "peak, sum loss",
        "I/O MB",
        "GB/s",
        "of copy",
        "first use s",
    ]
    table = Table(title=title, title_justify="left")
    for name in header:
        table.add_column(name, justify="left" if name == "version" else "right")
    for row in rows:
        table.add_row(*row)
    lines = [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    return table, "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _summary(results: dict[tuple[Case, str], dict[str, Any]], cases: tuple[Case, ...]) -> list[str]:
    """The summary lines: fused fp32 times and every version's time ratios to them (geometric means over the 2D
    stages), and for each 3D shape the reference / fused time and fused / reference memory."""

    def geomean(values: list[float]) -> float:
        return math.exp(sum(math.log(v) for v in values) / len(values))

    lines = []
    stages = [c for c in cases if c.ndim == 2]
    for key, label in (("step_ms", "fwd+bwd"), ("graph_ms", "graphed fwd+bwd")):
        fused = [t for c in stages if (t := results.get((c, "fused fp32"), {}).get(key))]
        if not stages or len(fused) != len(stages):
            continue
        listed = " / ".join(f"{t:.3g}" for t in fused)
        lines.append(f"2D fused fp32 {label}: {listed} ms, geometric mean {geomean(fused):.3g} ms.")
        for version in _VERSIONS[1:]:
            other = [t for c in stages if (t := results.get((c, version), {}).get(key))]
            if len(other) == len(stages):
                ratios = [o / f for o, f in zip(other, fused, strict=True)]
                listed = ", ".join(f"{r:.2f}" for r in ratios)
                lines.append(f"{label} time, {version} / fused fp32: {listed} (geomean {geomean(ratios):.2f}).")
    for case in (c for c in cases if c.ndim == 3):
        f, ref = results.get((case, "fused fp32"), {}), results.get((case, "reference (cudnn.benchmark)"), {})
        if "step_ms" in f and "step_ms" in ref:
            ratio = ref["step_ms"] / f["step_ms"]
            line = f"3D {case.name}: fwd+bwd time, reference (cudnn.benchmark) / fused fp32 = {ratio:.2f}"
            if "graph_ms" in f and "graph_ms" in ref:
                line += f" (graphed {ref['graph_ms'] / f['graph_ms']:.2f})"
            if "peak_bytes" in f and "peak_bytes" in ref:
                line += f", peak memory fused / reference = {f['peak_bytes'] / ref['peak_bytes']:.2f}"
            lines.append(line + ".")
    return lines


def wtconv(
    quick: Annotated[bool, typer.Option("--quick", help="Tiny shapes on the CPU: a smoke test in seconds.")] = False,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Markdown file of the tables (default: benchmarks/results/wtconv-GPU.md; --quick: "
            "wtconv-cpu-quick.md).",
        ),
    ] = None,
    first_use: Annotated[
        bool, typer.Option("--first-use/--no-first-use", help="Measure first-use (compile) time per configuration.")
    ] = True,
    first_use_jobs: Annotated[
        int, typer.Option("--first-use-jobs", min=1, help="First-use processes at a time (1: one configuration alone).")
    ] = 1,
    ndim: Annotated[
        int | None,
        typer.Option(
            "--ndim", min=2, max=3, help="Only the 2D (WTConvNeXt stages) or only the 3D shapes (default both)."
        ),
    ] = None,
) -> None:
    """Time forward and forward + backward, peak memory, I/O bytes and bandwidth of the fused WTConv kernels beside
    the reference layer (cuDNN autotuning off and on) and a plain depthwise convolution, WTConvNeXt-T stages and 3D."""
    if not quick:  # a private Triton cache, so that first use is measured from scratch (set before triton loads)
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="regkit-triton-")
    import torch
    from rich.console import Console

    from regkit_kernels.launch import interpreter_on

    device = "cpu" if quick else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter("CUDA is not available here (use --quick for a CPU smoke test)", param_hint="--quick")
    cases = tuple(c for c in (QUICK_CASES if quick else FULL_CASES) if ndim is None or c.ndim == ndim)
    console = Console()
    fused_ok = device == "cuda" or interpreter_on()
    if device == "cuda":
        name = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
        copy_bw = _copy_bandwidth()
        name += f"; device-to-device copy {copy_bw / 1e9:,.0f} GB/s (read + write)"
    else:
        name, copy_bw = f"CPU, torch {torch.__version__} (timings meaningless)", None
    console.print(name)
    output = output or default_output("wtconv", device, quick)
    report = Results(output, device)
    report.add(name, "")
    first = {}
    if device == "cuda" and first_use:
        first = _first_use(cases, Path(os.environ["TRITON_CACHE_DIR"]), first_use_jobs)
    time_it = _timer(device, 0.5, 100) if not quick else _timer(device, 0.0, 1, warm_up=False)
    results: dict[tuple[Case, str], dict[str, Any]] = {}
    for case in cases:
        rows = []
        x_mib = math.prod(case.shape) * 4 / MiB
        for version in (v for v in _VERSIONS if case.ndim == 2 or not v.startswith("authors'")):
            if version.startswith("fused") and not fused_ok:
                result: dict[str, Any] = {"skipped": "needs CUDA or TRITON_INTERPRET=1"}
            else:
                result = _measure(case, version, device, time_it)
            results[(case, version)] = result
            if version.startswith("fused"):
                io = fused_bytes(case, 2 if version == "fused bf16" else 4)
            else:
                io = _traced_bytes(case, version)
            rows.append(_row(version, result, io, copy_bw, first.get((case, version))))
            console.print("  " + "  ".join(rows[-1]).rstrip(), style="dim")
        table, md = _render(f"{case.name}, x = {x_mib:,.1f} MiB in float32", rows)
        console.print(table)
        report.add(md)
    summary = _summary(results, cases)
    if fused_ok:
        budget = 0.0 if quick else 2.0
        summary += [interleaved_line(c, interleaved(c, device, budget, 300)) for c in cases if c.ndim == 2]
    for line in summary:
        console.print(line)
    report.add(*summary, "")
    console.print(f"wrote {output}")

"""``python -m benchmarks cpab``: time and peak memory of CPAB integration and its gradient, factorized vs baselines.

Ways to get ``dL/dtheta`` for ``L = sum(w * phi_theta(x))`` (random ``w``), all through the same expm-step
scheme (``regkit.cpab.integrate``; ``zero`` boundary, float32, checkpoints every ``DEFAULT_CHECKPOINT_EVERY`` steps):

* fused (CUDA only): ``integrate(..., backend="triton")``, the factorized adjoint in Triton kernels
  (``regkit_kernels.cpab``); its first call, which compiles the kernels, is reported apart;
* compiled (CPU only): ``integrate(..., backend="numba")``, the factorized adjoint compiled for the CPU
  (``regkit_kernels.numba.cpab``), what registrations on the CPU run;
* fused, no checkpoints (CUDA only): the same with ``checkpoint_every = steps``: the forward stores no positions and
  the backward recomputes its checkpoints in registers (one more pass of the scheme, memory flat in ``N``);
* factorized: ``integrate(..., backend="torch")``, whose backward recomputes segments, accumulates per-cell moments
  and projects once (``O(T N)`` time, memory flat in ``d``);
* unrolled autograd: ``integrate_reference``, autograd through every step (memory ``O(T N)``);
* forward sensitivity: ``forward_sensitivity_gradient``, ``d`` sensitivities per point (``O(d T N)`` time,
  ``O(d N)`` memory), the gradient of earlier CPAB libraries.

Tables: 2D and 3D over tessellation sizes, every method; on CUDA the 6.9M-point registration grid (fused and
factorized); a head-to-head of the gradients against forward sensitivity (2D 30x30, batch 2 on CUDA: time and memory
ratios); the N and T sweep. ``--methods`` picks the methods (the comparison always adds forward sensitivity).
The "G pt-steps/s" column is ``B N T`` scheme steps per second of the forward pass; "graphed" (fused methods, CUDA)
is the forward + backward replayed from a CUDA graph, as the registration engine runs its iterations.

Timing: the best of a few runs, synchronised on CUDA. "gradient" is the backward pass for the adjoint methods and the
whole sensitivity integration for forward sensitivity (its forward column is the plain no-grad forward). Peak memory,
above what the inputs already hold: on CUDA ``torch.cuda.max_memory_allocated``; on the CPU the process's peak resident
set (``VmHWM``, reset through ``/proc/self/clear_refs`` just before the measured run) minus its resident set then,
measured in a fresh subprocess per configuration so that heap kept from an earlier run cannot hide memory (``--quick``
measures in-process: rougher). Baselines predicted to exceed the time or memory cap are reported as
``skipped (cap)``: forward sensitivity's memory is estimated before it runs (``d B N n`` floats plus the step-matrix
derivatives) and its time extrapolated from the previous configuration (the part beyond the plain forward, linearly in
``d B N T``).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from benchmarks.common import (
    Device,
    Results,
    default_output,
    device_name,
    graphed_seconds,
    mib,
    render,
    rss_bytes,
    run_worker,
)

if TYPE_CHECKING:
    import torch

METHODS = ("fused", "fused_lean", "compiled", "factorized", "unrolled", "sensitivity")
METHOD_TITLES = {
    "fused": "fused (Triton)",
    "fused_lean": "fused, no checkpoints",
    "compiled": "compiled (numba)",
    "factorized": "factorized (PyTorch)",
    "unrolled": "unrolled autograd",
    "sensitivity": "forward sensitivity",
}
_BACKENDS = {
    "fused": "triton",
    "fused_lean": "triton",
    "compiled": "numba",
    "factorized": "torch",
    "unrolled": "reference",
}
_FUSED = ("fused", "fused_lean")
REGISTRATION_GRID = (160, 192, 224)  # a registration-sized case: one transformation of a dense 3D grid


@dataclass(frozen=True)
class Case:
    """One measurement: a tessellation of ``cells`` per axis, ``batch`` transformations of ``points`` points."""

    ndim: int
    cells: int
    batch: int
    points: int
    steps: int
    method: str
    device: str
    grid: bool = False  # the points are a dense grid of REGISTRATION_GRID voxels (``points`` is ignored)


@dataclass(frozen=True)
class Plan:
    """What one run of the benchmark measures, and its caps."""

    title: str
    sizes: dict[int, tuple[int, int, tuple[int, ...]]]  # ndim -> (batch, points, cells per axis of each tessellation)
    steps: int
    sweep_cells: int  # 2D tessellation of the N and T sweep (factorized only)
    sweep: tuple[tuple[int, int], ...]  # (points, steps)
    time_cap_s: float
    memory_cap_bytes: int
    isolate: bool  # one subprocess per measurement (CPU peak memory)
    budget_s: float  # timing runs per measurement stop after this long (at least one, at most _MAX_RUNS)
    registration: tuple[int, ...] = ()  # cells per axis of the registration-grid cases (CUDA)
    versus: tuple[int, int, int] | None = None  # (cells per axis, batch, points): 2D, each method against sensitivity


_MAX_RUNS = 5


def _available_memory() -> int:
    """MemAvailable of this machine in bytes (8 GiB where /proc/meminfo is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def _plan(device: str, quick: bool) -> Plan:
    if quick:
        return Plan(
            title="quick (tiny sizes; timings meaningless)",
            sizes={2: (2, 500, (2, 4)), 3: (2, 500, (2,))},
            steps=10,
            sweep_cells=4,
            sweep=((250, 10), (500, 10), (500, 20)),
            time_cap_s=30.0,
            memory_cap_bytes=2**30,
            isolate=False,
            budget_s=0.0,
            versus=(4, 2, 500),
        )
    if device == "cuda":
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        return Plan(
            title="full sizes",
            sizes={2: (16, 125_000, (4, 8, 12, 16, 24, 32)), 3: (8, 125_000, (2, 4, 8, 12, 16))},
            steps=50,
            sweep_cells=8,
            sweep=((31_250, 50), (62_500, 50), (125_000, 50), (125_000, 25), (125_000, 100)),
            time_cap_s=30.0,
            memory_cap_bytes=int(0.6 * total),
            isolate=False,
            budget_s=2.0,
            registration=(8, 16),
            versus=(30, 2, 125_000),
        )
    return Plan(
        title="CPU: fewer points and a smaller batch than the GPU's 125,000 points x 16 (2D) / x 8 (3D)",
        sizes={2: (4, 20_000, (4, 8, 16, 32)), 3: (2, 20_000, (2, 4, 8, 16))},
        steps=50,
        sweep_cells=8,
        sweep=((5_000, 50), (10_000, 50), (20_000, 50), (20_000, 25), (20_000, 100)),
        time_cap_s=120.0,
        memory_cap_bytes=int(0.5 * _available_memory()),
        isolate=True,
        budget_s=6.0,
    )


# ---- one measurement ----------------------------------------------------------------------------------------------


def _measure(case: Case, budget_s: float) -> dict[str, Any]:
    """Run one case: ``{"d", "forward_s", "gradient_s", "peak_bytes"}`` (peak ``None`` where it cannot be read)."""
    import torch

    from regkit.cpab.basis import cpa_basis
    from regkit.cpab.integrate import DEFAULT_CHECKPOINT_EVERY, integrate
    from regkit.cpab.tessellation import Tessellation

    device = torch.device(case.device)
    cuda = device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    tess = Tessellation((case.cells,) * case.ndim)
    basis = cpa_basis(tess, "zero")
    theta = torch.randn(case.batch, basis.d, generator=gen).to(device)
    if case.grid:
        axes = [(torch.arange(s) + 0.5) / s for s in REGISTRATION_GRID]
        points = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3).to(device)
    else:
        points = torch.rand(case.points, case.ndim, generator=gen).to(device)
    weights = torch.randn(case.batch, *points.shape, generator=gen).to(device)
    backend = _BACKENDS.get(case.method, "torch")
    every = case.steps if case.method == "fused_lean" else DEFAULT_CHECKPOINT_EVERY

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def run(points: torch.Tensor, weights: torch.Tensor) -> tuple[float, float]:
        t0 = time.perf_counter()
        if case.method == "sensitivity":
            from regkit.cpab.baselines import forward_sensitivity_gradient

            with torch.no_grad():
                integrate(points, basis.to_A(theta), tess, steps=case.steps)
            sync()
            t1 = time.perf_counter()
            forward_sensitivity_gradient(points, theta, basis, weights, steps=case.steps)
        else:
            th = theta.clone().requires_grad_(True)
            out = integrate(points, basis.to_A(th), tess, steps=case.steps, backend=backend, checkpoint_every=every)
            sync()
            t1 = time.perf_counter()
            (out * weights).sum().backward()
        sync()
        return t1 - t0, time.perf_counter() - t1

    start = time.perf_counter()
    run(points[:64], weights[:, :64])  # warm-up: lazy imports, initialisation, kernel compilation
    first_s = time.perf_counter() - start
    peak: int | None = None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        timings = [run(points, weights)]
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        try:
            base = rss_bytes("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
            timings = [run(points, weights)]
            peak = rss_bytes("VmHWM") - base
        except OSError:
            timings = [run(points, weights)]
    start = time.perf_counter()
    while len(timings) < _MAX_RUNS and time.perf_counter() - start < budget_s:
        timings.append(run(points, weights))
    graphed_s = None
    if cuda and case.method in _FUSED:  # the engine replays its iterations from CUDA graphs: time that too

        def step() -> None:
            th = theta.clone().requires_grad_(True)
            out = integrate(points, basis.to_A(th), tess, steps=case.steps, backend=backend, checkpoint_every=every)
            (out * weights).sum().backward()

        graphed_s = graphed_seconds(step)
    return {
        "d": basis.d,
        "crossings": _crossings_per_point(points, basis.to_A(theta), tess, case.steps),
        "forward_s": min(t[0] for t in timings),
        "gradient_s": min(t[1] for t in timings),
        "graphed_s": graphed_s,
        "peak_bytes": peak,
        "first_s": first_s,
    }


def _crossings_per_point(points: torch.Tensor, A: torch.Tensor, tess: Any, steps: int) -> float | None:
    """Facets crossed per point and transformation (None for a tree whose scheme does not follow crossings)."""
    try:
        from regkit.cpab import count_crossings
    except ImportError:
        return None
    sample = points[:: max(1, points.shape[0] // 20_000)]  # spread over the points (a grid's first rows are a corner)
    return count_crossings(sample, A, tess, steps=steps) / (A.shape[0] * sample.shape[0])


def worker() -> None:
    """Subprocess entry: measure the case given as JSON in argv[1], print the result as one JSON line."""
    import torch

    spec = json.loads(sys.argv[1])
    torch.set_num_threads(spec["threads"])
    result = _measure(Case(**spec["case"]), spec["budget_s"])
    print(json.dumps(result))


def _run_case(case: Case, plan: Plan, tree: Path | None = None) -> dict[str, Any]:
    """Measure ``case`` in this process, or in a fresh one (``plan.isolate``, or another ``tree``)."""
    if not plan.isolate and tree is None:
        return _measure(case, plan.budget_s)
    import torch

    spec = {"case": asdict(case), "budget_s": plan.budget_s, "threads": torch.get_num_threads()}
    result = run_worker("cpab", spec, 60.0 + (_MAX_RUNS + 1) * plan.time_cap_s, tree)
    if "failed" in result:
        return {"skipped": "skipped (cap)" if result["failed"].startswith("over ") else result["failed"][:60]}
    return result


# ---- caps ----------------------------------------------------------------------------------------------------------


def _dimension(ndim: int, cells: int) -> int:
    """``d`` of the ``zero``-boundary basis (regkit.cpab.basis): 2D ``2 [(N - 1)^2 + N^2]``, 3D ``3 (N - 1)^3``."""
    return 2 * ((cells - 1) ** 2 + cells**2) if ndim == 2 else 3 * (cells - 1) ** 3


def _memory_estimate(case: Case) -> int:
    """Bytes a baseline needs (float32), from its buffers; 0 for the factorized path."""
    n, B, N, T = case.ndim, case.batch, case.points, case.steps
    n_cells = (4 if n == 2 else 5) * case.cells**n
    if case.method == "sensitivity":
        d = _dimension(n, case.cells)
        return 4 * d * B * (N * n + n_cells * n * (n + 1)) + 2**29  # + its chunked temporaries (~512 MiB)
    if case.method == "unrolled":  # per step: gathered step matrices, points, cell ids, and as much again in backward
        return 2 * T * B * N * (4 * (n * (n + 1) + n) + 8)
    return 0


class _Caps:
    """Skips a baseline whose predicted memory or time (from the previous case of its kind) exceeds the caps."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.rate: dict[tuple[str, int], float] = {}  # (method, ndim) -> gradient seconds per unit of work

    @staticmethod
    def _work(case: Case) -> float:
        scale = _dimension(case.ndim, case.cells) if case.method == "sensitivity" else 1
        return float(scale * case.batch * case.points * case.steps)

    def skip(self, case: Case) -> bool:
        if case.method == "factorized":
            return False
        if _memory_estimate(case) > self.plan.memory_cap_bytes:
            return True
        rate = self.rate.get((case.method, case.ndim))
        return rate is not None and rate * self._work(case) > self.plan.time_cap_s

    def record(self, case: Case, result: dict[str, Any]) -> None:
        if "gradient_s" in result:  # forward sensitivity: the part beyond integrating the points grows with d
            fixed = result["forward_s"] if case.method == "sensitivity" else 0.0
            self.rate[(case.method, case.ndim)] = max(result["gradient_s"] - fixed, 0.0) / self._work(case)


# ---- tables ----------------------------------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    ms = 1000 * seconds
    return f"{ms:.3g}" if ms < 1000 else f"{ms:,.0f}"


def _cells(result: dict[str, Any], case: Case) -> list[str]:
    if "skipped" in result:
        return [result["skipped"], "", "", "", "", "", ""]
    total = result["forward_s"] + result["gradient_s"]
    points = prod(REGISTRATION_GRID) if case.grid else case.points
    rate = case.batch * points * case.steps / result["forward_s"] / 1e9
    graphed = result.get("graphed_s")
    return [
        _ms(result["forward_s"]),
        _ms(result["gradient_s"]),
        _ms(total),
        "" if graphed is None else _ms(graphed),
        mib(result["peak_bytes"]),
        f"{rate:.3g}",
        f"{result['first_s']:.1f}",
    ]


def _scheme_table(plan: Plan, device: str, baseline: Path, console: Any) -> str:
    """This tree's scheme against ``baseline``'s with the backend registrations run (fused on CUDA, compiled on the
    CPU), forward + backward, each case in a fresh process per tree; returns the markdown table."""
    method = "fused" if device == "cuda" else "compiled"
    if device == "cuda":
        cases = [(2, 30, 16, 125_000, False), (3, 8, 8, 125_000, False), (3, 16, 1, 0, True)]
    else:
        cases = [(2, 30, 4, 20_000, False), (3, 8, 2, 20_000, False)]
    rows = []
    for ndim, cells, batch, points, grid in cases:
        for steps in (plan.steps, 5):
            case = Case(ndim, cells, batch, points, steps, method, device, grid=grid)
            mine, theirs = _run_case(case, plan, None), _run_case(case, plan, baseline)
            size = f"grid {'x'.join(map(str, REGISTRATION_GRID))}" if grid else f"B {batch}, {points:,} points"
            row = [f"{ndim}D {cells}^{ndim}", size, str(steps)]
            if "skipped" in mine or "skipped" in theirs:
                row += [mine.get("skipped", ""), theirs.get("skipped", ""), "", ""]
            else:
                total, old = (r["forward_s"] + r["gradient_s"] for r in (mine, theirs))
                row += [f"{mine['crossings']:.2f}", _ms(total), _ms(old), f"{total / old:.2f}"]
            rows.append(row)
            console.print("  " + "  ".join(rows[-1]).rstrip(), style="dim")
    header = ["tessellation", "points", "T", "crossings / point", "this ms", "baseline ms", "this / baseline"]
    table, md = render(f"{METHOD_TITLES[method]}: this tree's scheme against the baseline tree's", header, rows)
    console.print(table)
    return md


def cpab(
    device: Annotated[Device, typer.Option("--device", help="Where to run: cpu or cuda.")] = Device.cpu,
    quick: Annotated[bool, typer.Option("--quick", help="Tiny sizes, in-process: a smoke test in seconds.")] = False,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", help="Markdown file of the tables (default: benchmarks/results/cpab-MACHINE[-quick].md)."
        ),
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option("--threads", min=1, help="CPU threads for torch (default: torch's); 1 is steadier on busy CPUs."),
    ] = None,
    methods: Annotated[
        str | None,
        typer.Option("--methods", help=f"Comma-separated subset of {', '.join(METHODS)} (default: all that can run)."),
    ] = None,
    baseline: Annotated[
        Path | None,
        typer.Option(
            "--baseline",
            help="A folder holding another tree's regkit/ and kernels/ (an export of an earlier commit): its scheme is "
            "timed beside this one's on the issue's sizes.",
        ),
    ] = None,
    only_scheme: Annotated[
        bool, typer.Option("--only-scheme", help="With --baseline: only the table of the two trees' schemes.")
    ] = False,
) -> None:
    """Time forward and gradient passes and peak memory of CPAB integration: the factorized adjoint beside
    unrolled autograd and forward sensitivities, over 2D and 3D tessellations, plus a sweep over points and steps."""
    import torch
    from rich.console import Console

    from regkit.cpab.integrate import DEFAULT_CHECKPOINT_EVERY

    if device is Device.cuda and not torch.cuda.is_available():
        raise typer.BadParameter("CUDA is not available here", param_hint="--device")
    if threads is not None:
        torch.set_num_threads(threads)
    chosen = METHODS if methods is None else tuple(m.strip() for m in methods.split(","))
    if not chosen or any(m not in METHODS for m in chosen):
        raise typer.BadParameter(f"choose from {', '.join(METHODS)}", param_hint="--methods")
    plan = _plan(device.value, quick)
    console = Console()
    caps = _Caps(plan)
    if device is Device.cuda:
        memory = "torch.cuda.max_memory_allocated"
    elif plan.isolate:
        memory = "peak resident set, a fresh subprocess per case"
    else:
        memory = "peak resident set, in-process: rough"
    settings = (
        f"{device_name(device.value)}; float32, zero boundary, T = {plan.steps} steps (sweep aside), checkpoints "
        f"every {DEFAULT_CHECKPOINT_EVERY} steps; sizes: {plan.title}. Times in ms, the best of up to {_MAX_RUNS} "
        f"runs; peak memory in MiB above the inputs ({memory}); gradient = the backward pass, or for forward "
        "sensitivity the whole sensitivity integration; first s = the first (warm-up) call on 64 points, which "
        "includes compiling the fused kernels when Triton's cache is cold; skipped (cap) = predicted over the time or "
        "memory cap; graphed = forward + backward (with to_A, the loss and its backward) replayed from a CUDA graph, "
        "as the registration engine runs its iterations: the GPU's own time (fused methods); G pt-steps/s = B N T "
        "scheme steps per second of the forward column. The fused methods run on CUDA only; 'fused, no checkpoints' "
        "stores none (checkpoint_every = T)."
    )
    runnable = [
        m
        for m in METHODS
        if m in chosen and (m not in _FUSED or device is Device.cuda) and (m != "compiled" or device is Device.cpu)
    ]
    if not runnable:
        raise typer.BadParameter(f"none of {', '.join(chosen)} runs on {device.value}", param_hint="--methods")
    console.print(settings)
    output = output or default_output("cpab", device.value, quick)
    report = Results(output, device.value)
    report.add(settings, "")
    header = ["tessellation", "d", "method", "forward ms", "gradient ms", "total ms", "graphed ms", "peak MiB"]
    header.append("G pt-steps/s")
    header.append("first s")
    if only_scheme:
        if baseline is None:
            raise typer.BadParameter("needs --baseline", param_hint="--only-scheme")
        report.add(_scheme_table(plan, device.value, baseline, console))
        console.print(f"wrote {output}")
        return
    for ndim, (batch, points, cell_counts) in plan.sizes.items():
        rows = []
        for cells in cell_counts:
            name = "x".join([str(cells)] * ndim)
            for method in runnable:
                case = Case(ndim, cells, batch, points, plan.steps, method, device.value)
                result = {"skipped": "skipped (cap)"} if caps.skip(case) else _run_case(case, plan)
                caps.record(case, result)
                rows.append([name, f"{_dimension(ndim, cells):,}", METHOD_TITLES[method], *_cells(result, case)])
                console.print("  " + "  ".join(rows[-1]).rstrip(), style="dim")
        table, md = render(f"{ndim}D, batch {batch}, {points:,} points, T = {plan.steps}", header, rows)
        console.print(table)
        report.add(md)

    if plan.registration:
        rows = []
        for cells in plan.registration:
            for method in [m for m in runnable if m in (*_FUSED, "factorized")]:
                case = Case(3, cells, 1, 0, plan.steps, method, device.value, grid=True)
                rows.append([f"{cells}x{cells}x{cells}", f"{_dimension(3, cells):,}", METHOD_TITLES[method]])
                rows[-1] += _cells(_run_case(case, plan), case)
                console.print("  " + "  ".join(rows[-1]).rstrip(), style="dim")
        grid = "x".join(map(str, REGISTRATION_GRID))
        table, md = render(
            f"registration grid {grid} ({prod(REGISTRATION_GRID):,} points), one transformation", header, rows
        )
        console.print(table)
        report.add(md)

    if plan.versus is not None:
        cells, batch, points = plan.versus
        results: dict[str, tuple[Case, dict[str, Any]]] = {}
        for method in [*[m for m in runnable if m in (*_FUSED, "factorized")], "sensitivity"]:
            case = Case(2, cells, batch, points, plan.steps, method, device.value)
            results[method] = case, {"skipped": "skipped (cap)"} if caps.skip(case) else _run_case(case, plan)
        base = results["sensitivity"][1]
        rows = []
        for method, (case, result) in results.items():
            ratio = ["", ""]
            if "skipped" not in result and "skipped" not in base and method != "sensitivity":
                ratio = [f"{base['gradient_s'] / result['gradient_s']:,.0f}x"]
                peak, base_peak = result["peak_bytes"], base["peak_bytes"]
                ratio.append(f"{base_peak / peak:,.0f}x" if peak and base_peak else "")
            rows.append([METHOD_TITLES[method], *_cells(result, case), *ratio])
        title = f"gradient against forward sensitivity: 2D {cells}x{cells}, batch {batch}, {points:,} points"
        table, md = render(title, ["method", *header[3:], "sensitivity / this, time", "memory"], rows)
        console.print(table)
        report.add(md)

    if baseline is not None:
        md = _scheme_table(plan, device.value, baseline, console)
        report.add(md)

    batch, _, _ = plan.sizes[2]
    rows = []
    sweep_method = runnable[0]
    for points, steps in plan.sweep:
        case = Case(2, plan.sweep_cells, batch, points, steps, sweep_method, device.value)
        rows.append([f"{points:,}", str(steps), *_cells(_run_case(case, plan), case)])
    title = f"{METHOD_TITLES[sweep_method]}, 2D {plan.sweep_cells}^2, batch {batch}: time grows with N and T"
    table, md = render(title, ["N", "T", *header[3:]], rows)
    console.print(table)
    report.add(md)
    console.print(f"wrote {output}")

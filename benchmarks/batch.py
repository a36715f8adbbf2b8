"""``python -m benchmarks batch``: throughput of ``regkit batch`` (pairs per minute), local executor and dask workers.

Pairs: the bundled MNI152 2009a T1 (2 mm) resampled (linear) onto ``size`` isotropic voxels per axis over its box
(3D), or the axial slice through its centre (2D), with the AAL labels (nearest); each moving image is a known smooth
deformation of it with another contrast (:func:`regkit.demo.make_pair`, seeds 1..N), with its labels. All pairs share
the fixed image and the shape, as in an atlas study. They are written as NIfTI files with a ``pairs.csv``, and every
setting runs the same batch spec (``defaults: {base: CONFIG, dim, device}``, all outputs, qc.png included) into its own
output root.

Settings: ``local`` (one job after another in one process, torch's default threads) and ``dask`` with each of the
given worker counts (:func:`regkit.batch.plan_local_workers`: the CPU cores shared evenly; on CUDA every worker pinned
to a GPU, workers beyond the number of GPUs sharing them). Each setting runs in a fresh process; its time is
``run_batch`` from start to end: reading, registering, writing every output, the manifest, summary.csv and
report.html, and for dask starting and stopping the cluster (worker processes that import torch). On CUDA one pair is
first registered, untimed, in a process of its own so that Triton's kernel cache is filled for every setting alike.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks.common import Device, Results, default_output, device_name, render

_TIMEOUT_S = 3600.0


def make_pairs(folder: Path, pairs: int, dim: int, size: int) -> Path:
    """Write the benchmark's pairs (module docstring) into ``folder`` and return their ``pairs.csv``.

    Files: ``fixed.nii.gz``, ``fixed_labels.nii.gz`` and ``moving_I.nii.gz``, ``moving_I_labels.nii.gz`` for I in
    1..pairs; the CSV lists them with the columns fixed, moving, fixed_labels, moving_labels. The fixed grid has
    ``size`` voxels per axis, isotropic spacing (the template box's longest side / size), the template's direction and
    centre; in 2D its first two axes in the axial plane through the template's centre.
    """
    import numpy as np
    import torch

    from regkit.demo import aal_labels, load_template, make_pair
    from regkit.io import Image, write_image
    from regkit.spatial.grid import Grid
    from regkit.spatial.sampling import sample_image

    template = load_template()
    box = np.asarray(template.grid.size) * np.asarray(template.grid.spacing)
    spacing = float(box.max()) / size
    direction = np.asarray(template.grid.direction)
    centre = template.grid.index_to_world(torch.tensor((np.asarray(template.grid.size) - 1) / 2)).numpy()
    shape = (size, size, size if dim == 3 else 1)
    origin = centre - direction @ (spacing * (np.asarray(shape) - 1) / 2)
    grid3 = Grid.create(shape, (spacing,) * 3, origin.tolist(), direction)
    data = sample_image(template.data, template.grid, grid3.world_points(torch.float64))
    labels = aal_labels(grid3)
    if dim == 2:
        if np.abs(direction[2, :2]).max() > 0 or np.abs(direction[:2, 2]).max() > 0:
            raise ValueError("the template's third axis is not the world z axis: no axial 2D slice")
        grid = Grid.create(shape[:2], (spacing,) * 2, origin[:2].tolist(), direction[:2, :2])
        fixed, fixed_labels = Image(data[0], grid), Image(labels.data[0], grid)
    else:
        fixed, fixed_labels = Image(data, grid3), labels
    folder.mkdir(parents=True, exist_ok=True)
    write_image(fixed, folder / "fixed.nii.gz")
    write_image(fixed_labels, folder / "fixed_labels.nii.gz")
    lines = ["fixed,moving,fixed_labels,moving_labels"]
    for i in range(1, pairs + 1):
        pair = make_pair(fixed, fixed_labels, seed=i)
        write_image(pair.moving, folder / f"moving_{i}.nii.gz")
        write_image(pair.moving_labels, folder / f"moving_{i}_labels.nii.gz")
        lines.append(f"fixed.nii.gz,moving_{i}.nii.gz,fixed_labels.nii.gz,moving_{i}_labels.nii.gz")
    csv_path = folder / "pairs.csv"
    csv_path.write_text("\n".join(lines) + "\n")
    return csv_path


def write_spec(path: Path, pairs_csv: Path, output: Path, config: str, dim: int, device: str) -> Path:
    """A batch spec at ``path``: the pairs of ``pairs_csv`` into ``output``, configuration ``config`` (a preset name
    or a YAML file) with ``dim`` and ``device`` set."""
    import yaml

    base = config if Path(config).suffix not in (".yaml", ".yml") else str(Path(config).absolute())
    spec = {
        "defaults": {"base": base, "dim": dim, "device": device},
        "output": str(output.absolute()),
        "csv": str(pairs_csv.absolute()),
    }
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def worker() -> None:
    """Subprocess entry: run the batch spec argv[1] with the executor and workers of argv[2] (JSON), print its
    measurements as one JSON line."""
    import time

    from regkit.batch import Manifest, load_spec, run_batch, summary_rows

    setting = json.loads(sys.argv[2])
    plan = load_spec(sys.argv[1])
    start = time.perf_counter()
    report = run_batch(plan, executor=setting["executor"], workers=setting["workers"])
    seconds = time.perf_counter() - start
    rows = summary_rows(plan, Manifest(plan.manifest).rows())
    done = [row for row in rows if row["state"] == "done"]
    dice = [row["mean_dice_after"] for row in done if row["mean_dice_after"] is not None]
    print(
        json.dumps(
            {
                "seconds": seconds,
                "done": len(done),
                "failed": len(report.failed),
                "first_error": next((o.error for o in report.failed), None),
                "job_seconds": sum(row["seconds"] for row in done) / max(1, len(done)),
                "dice_after": sum(dice) / len(dice) if dice else None,
                "devices": sorted({row["device"] for row in done}),
            }
        )
    )


def _run_setting(spec: Path, executor: str, workers: int | None) -> dict[str, Any]:
    code = "from benchmarks.batch import worker; worker()"
    setting = json.dumps({"executor": executor, "workers": workers})
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(spec), setting], capture_output=True, text=True, timeout=_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return {"failed_run": f"over {_TIMEOUT_S:.0f} s"}
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"]
        return {"failed_run": lines[-1][:120]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _counts(value: str) -> list[int]:
    try:
        counts = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise typer.BadParameter(f"give worker counts >= 1, comma-separated (got {value!r})")
    return counts


def batch(
    pairs: Annotated[int, typer.Option("--pairs", min=1, help="Number of pairs in the batch.")] = 8,
    dim: Annotated[int, typer.Option("--dim", min=2, max=3, help="2: axial slices; 3: volumes.")] = 3,
    size: Annotated[int, typer.Option("--size", min=8, help="Voxels per axis of the fixed grid (isotropic).")] = 64,
    config: Annotated[
        str, typer.Option("--config", "-c", help="Registration preset or YAML file (default: demo in 3D, quick-2d).")
    ] = "",
    device: Annotated[Device, typer.Option("--device", help="Where the jobs run: cpu or cuda.")] = Device.cpu,
    workers: Annotated[
        str, typer.Option("--workers", help="Comma-separated worker counts of the dask settings, e.g. 1,2.")
    ] = "1,2",
    local: Annotated[bool, typer.Option("--local/--no-local", help="Also time the local executor.")] = True,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", help="Markdown file of the table (default: benchmarks/results/batch-MACHINE.md)."
        ),
    ] = None,
    keep: Annotated[
        Path | None,
        typer.Option(
            "--keep", help="Write the pairs and outputs into this folder and keep them (default: a temp dir)."
        ),
    ] = None,
) -> None:
    """Pairs per minute of `regkit batch` over N synthetic pairs (MNI152 T1 deformed by known smooth warps) with the
    local executor and with dask LocalClusters of the given worker counts, each setting in a fresh process."""
    import torch
    from rich.console import Console

    from regkit.config import load_config

    counts = _counts(workers)
    if device is Device.cuda and not torch.cuda.is_available():
        raise typer.BadParameter("CUDA is not available here", param_hint="--device")
    config = config or ("demo" if dim == 3 else "quick-2d")
    load_config(config)  # a bad configuration fails here, not in every setting
    settings: list[tuple[str, str, int | None]] = [("local", "local", None)] if local else []
    settings += [(f"dask, {n} worker{'s' if n > 1 else ''}", "dask", n) for n in counts]
    console = Console()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    folder = keep if keep is not None else Path(tempfile.mkdtemp(prefix="regkit-bench-batch-"))
    try:
        shape = "x".join([str(size)] * dim)
        console.print(f"generating {pairs} {dim}D pairs of {shape} voxels in {folder} ...", style="dim")
        pairs_csv = make_pairs(folder / "data", pairs, dim, size)
        if device is Device.cuda:  # fill Triton's kernel cache for every setting alike
            warm_csv = pairs_csv.with_name("warmup.csv")
            warm_csv.write_text("\n".join(pairs_csv.read_text().splitlines()[:2]) + "\n")
            spec = write_spec(folder / "warmup.yaml", warm_csv, folder / "out_warmup", config, dim, device.value)
            console.print("  warm-up (one pair, untimed) ...", style="dim")
            _run_setting(spec, "local", None)
        rows = []
        for index, (label, executor, n) in enumerate(settings):
            spec = write_spec(
                folder / f"batch_{index}.yaml", pairs_csv, folder / f"out_{index}", config, dim, device.value
            )
            console.print(f"  {label} ...", style="dim")
            result = _run_setting(spec, executor, n)
            if "failed_run" in result:
                rows.append([label, f"failed: {result['failed_run']}", "", "", "", "", ""])
            else:
                failed = f"{result['failed']}" + (f" ({result['first_error'][:60]})" if result["failed"] else "")
                rows.append(
                    [
                        label,
                        f"{result['seconds']:.1f}",
                        f"{60 * result['done'] / result['seconds']:.2f}",
                        f"{result['job_seconds']:.1f}",
                        "" if result["dice_after"] is None else f"{result['dice_after']:.3f}",
                        ", ".join(result["devices"]),
                        failed,
                    ]
                )
            console.print("  " + "  ".join(rows[-1]), style="dim")
    finally:
        if keep is None:
            shutil.rmtree(folder, ignore_errors=True)
    header = ["setting", "wall s", "pairs/min", "mean job s", "mean Dice after", "device", "failed"]
    title = f"regkit batch throughput, {pairs} {dim}D pairs of {shape}, {device.value}"
    table, markdown = render(title, header, rows)
    console.print(table)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    notes = (
        f"{device_name(device.value)}, {cpus} CPU cores; configuration `{config}`; pairs: the MNI152 T1 resampled to "
        f"{shape} voxels ({dim}D) against known smooth deformations of itself. Wall s: `run_batch` from start to end "
        "(reading, registering, writing all outputs, summary.csv and report.html; for dask also starting the cluster); "
        "pairs/min: done pairs / wall time; mean job s: one job's registration and writing, as the manifest records "
        "it; dask workers share the CPU cores evenly (and are pinned to GPUs round-robin on CUDA)."
    )
    if load is not None:
        notes += f" Load average (1 min) at the start: {load:.1f}; at the end: {os.getloadavg()[0]:.1f}."
    console.print(notes)
    output = output or default_output("batch", device.value)
    Results(output, device.value).add(notes, "", markdown)
    console.print(f"wrote {output}")

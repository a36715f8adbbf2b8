"""``python -m benchmarks diffeomorphism``: what the transformations guarantee, measured on registrations with every
shipped preset and the accuracy configurations, beside another tree's run the same way (``--baseline``, e.g. an
export of an earlier commit's ``regkit``, ``kernels`` and ``configs``).

Pairs (``benchmarks.accuracy_pairs``, first pair of each set, seed 0): ``2d`` (an axial MNI152 slice, deformed),
``2mm`` and ``1mm`` (MNI152 T1 templates under a known smooth deformation, other contrast). Each (pair,
configuration, tree) runs in a fresh subprocess: one registration, timed (on CUDA after an untimed warm-up), then on
its transformation ``T`` (fixed world -> moving world, LPS mm, as regkit computes it, in the flows' dtype):

* **jump**: 200 segments of 2 mm from random fixed foreground voxels in random directions, sampled every 1 um; the
  largest second difference ``|T(x_{i+1}) - 2 T(x_i) + T(x_{i-1})|`` (mm). A jump of size ``j`` between two samples
  shows as about ``j``; a continuous map whose derivative is continuous too (the CPA flow's is, across facets) as
  rounding (~1e-5 mm in float32). Also the count of first differences over 20 um, and around the largest second
  difference (21 samples) the same map computed independently in float64 (``integrate_accurate``: bisection on cell
  membership, 256 steps): its own largest second difference there (``ref jump``; as large as ``jump`` where the exact
  flow itself bends sharply, e.g. a trajectory grazing a facet) and the largest distance between the two maps
  (``ref dev``).
* **inverse**: ``|T^-1(T(x)) - x|`` over the fixed foreground voxels (``T^-1`` as regkit computes it): max, p99.
* **folds on a 2x grid**: the fraction of non-positive central-difference Jacobian determinants of ``T`` on a grid of
  half the fixed spacing (twice the voxels per axis), in slabs.
* **crossings**: facets crossed per fixed voxel by the CPAB flows' trajectories (trees that count them);
* registration seconds, Dice and EPE (``benchmarks.accuracy.evaluate``).

Foreground: fixed intensities above 10 % of their robust range (``regkit.intensity.rescale_intensities`` > 0.1).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks.common import ROOT, Device, Results, default_output, device_name, render, run_worker

PAIRS = ("2d", "2mm", "1mm")
_SETS = {"2d": "mni2d", "2mm": "2mm", "1mm": "1mm"}
_ACCURACY = ROOT / "benchmarks" / "configs"
_SEGMENTS, _SEGMENT_MM, _SAMPLE_MM = 200, 2.0, 0.001
_REF_HALF_WINDOW = 10  # samples either side of the largest second difference computed by the float64 reference
_TIMEOUT_S = 3600.0


def _foreground(image: Any) -> Any:
    from regkit.intensity import rescale_intensities

    return rescale_intensities(image.data) > 0.1


def _jumps(transform: Any, pair: Any, device: str) -> dict[str, float]:
    import torch

    grid = pair.fixed.grid
    gen = torch.Generator().manual_seed(0)
    voxels = _foreground(pair.fixed).nonzero().double()  # (V, n) in [z, y, x] tensor order
    picked = voxels[torch.randint(len(voxels), (_SEGMENTS,), generator=gen)].flip(-1)  # (x, y[, z]) index order
    starts = grid.index_to_world(picked)
    directions = torch.randn(_SEGMENTS, grid.ndim, generator=gen, dtype=torch.float64)
    directions /= directions.norm(dim=-1, keepdim=True)
    samples = round(_SEGMENT_MM / _SAMPLE_MM) + 1
    s = torch.arange(samples, dtype=torch.float64) * _SAMPLE_MM
    points = starts[:, None] + s[None, :, None] * directions[:, None]  # (S, samples, n)
    images = transform.transform_world(points.to(device)).cpu()
    first = (images[:, 1:] - images[:, :-1]).norm(dim=-1)
    second = (images[:, 2:] - 2 * images[:, 1:-1] + images[:, :-2]).norm(dim=-1)
    segment, at = divmod(int(second.argmax()), second.shape[1])
    window = slice(max(at + 1 - _REF_HALF_WINDOW, 0), at + 2 + _REF_HALF_WINDOW)
    reference = reference_world(transform, points[segment, window])
    ref_second = (reference[2:] - 2 * reference[1:-1] + reference[:-2]).norm(dim=-1)
    return {
        "jump_mm": float(second.max()),
        "over_20um": int((first > 0.02).sum()),
        "ref_jump_mm": float(ref_second.max()),
        "ref_dev_mm": float((images[segment, window].double() - reference).norm(dim=-1).max()),
    }


def reference_world(transform: Any, world: Any) -> Any:
    """``transform`` at world points ``(P, n)`` in float64 on the CPU, every CPAB flow integrated by
    ``integrate_accurate`` with 256 steps (an independent scheme), then the affine map."""
    import copy

    import torch

    from regkit.cpab import integrate_accurate  # exported there by the baseline trees too

    y = world.double().cpu()
    for flow in transform.cpab:
        exact = copy.deepcopy(flow).double().cpu()
        with torch.no_grad():
            moved = integrate_accurate(exact.world_to_domain(y), exact.cell_matrices(), exact.tess, steps=256)
        y = exact.domain_to_world(moved)
    matrix = torch.as_tensor(transform.matrix, dtype=torch.float64)
    n = y.shape[-1]
    return y @ matrix[:n, :n].T + matrix[:n, n]


def _inverse(transform: Any, pair: Any, device: str) -> dict[str, float]:
    import torch

    world = pair.fixed.grid.world_points(torch.float64, device)[_foreground(pair.fixed).to(device)]
    error = (transform.inverse_world(transform.transform_world(world)) - world).norm(dim=-1)
    return {"inverse_max_mm": float(error.max()), "inverse_p99_mm": float(torch.quantile(error.float(), 0.99))}


def _fine_folds(transform: Any, pair: Any, device: str, slab: int = 24) -> float:
    """Fraction of non-positive central-difference determinants on the 2x grid, in slabs of ``slab`` planes along the
    slowest axis (each computed with one plane of overlap on both sides)."""
    import torch

    from regkit.spatial.grid import Grid
    from regkit.spatial.metrics import jacobian_determinant

    grid = pair.fixed.grid
    n = grid.ndim
    fine = Grid.create(
        [2 * s for s in grid.size], [h / 2 for h in grid.spacing], grid.index_to_world(
            torch.full((n,), -0.25, dtype=torch.float64)
        ).tolist(), grid.direction,
    )  # fmt: skip
    planes = fine.size[-1]
    bad = total = 0
    for start in range(0, planes, slab):
        lo, hi = max(start - 1, 0), min(start + slab + 1, planes)
        offset = [0.0] * (n - 1) + [float(lo)]
        origin = fine.index_to_world(torch.tensor(offset, dtype=torch.float64)).tolist()
        part = Grid.create([*fine.size[:-1], hi - lo], fine.spacing, origin, fine.direction)
        world = part.world_points(torch.float64, device)
        det = jacobian_determinant((transform.transform_world(world) - world).float(), part).cpu()
        keep = det[start - lo : start - lo + min(slab, planes - start)]
        bad += int((keep <= 0).sum())
        total += keep.numel()
    return bad / total


def _crossings(transform: Any, pair: Any, device: str) -> float | None:
    import torch

    try:
        from regkit.cpab import count_crossings
    except ImportError:  # a tree whose scheme does not cross facets
        return None
    world = pair.fixed.grid.world_points(torch.float64, device).reshape(-1, pair.fixed.ndim)
    total = 0
    y = world
    for flow in transform.cpab:
        points = flow.world_to_domain(y.to(flow.theta.dtype))
        A = flow.cell_matrices().detach()
        total += count_crossings(points, A, flow.tess, steps=flow.steps)
        y = flow.domain_to_world(flow.transform_points(points)).to(world.dtype)
    return total / world.shape[0]


def _measure(pair_name: str, config: str, device: str, mni_data: Path | None) -> dict[str, Any]:
    import torch

    from benchmarks.accuracy import evaluate
    from benchmarks.accuracy_pairs import make_pairs
    from regkit.config import load_config
    from regkit.registration import register

    pair = make_pairs(_SETS[pair_name], count=1, seed=0, mni_data=mni_data)[0]
    cfg = load_config(config)
    if device == "cuda":
        register(pair.fixed, pair.moving, cfg, device=device)  # warm-up
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = register(pair.fixed, pair.moving, cfg, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    transform = result.transform
    with torch.no_grad():
        scores = evaluate(pair, transform.displacement(device=device).cpu())
        out = {"seconds": seconds, "dice": scores["dice"], "epe_mm": scores.get("epe_mm")}
        out.update(_jumps(transform, pair, device))
        out.update(_inverse(transform, pair, device))
        out["fine_folds"] = _fine_folds(transform, pair, device)
        out["crossings"] = _crossings(transform, pair, device)
    return out


def worker() -> None:
    """Subprocess entry: measure the case given as JSON in argv[1], print the result as one JSON line."""
    import torch

    spec = json.loads(sys.argv[1])
    torch.set_num_threads(spec["threads"])
    mni_data = None if spec["mni_data"] is None else Path(spec["mni_data"])
    print(json.dumps(_measure(spec["pair"], spec["config"], spec["device"], mni_data)))


_NEWER_KEYS = ("multimodal", "modality_threshold")
"""CPAB stage settings that baseline trees may predate; they choose another similarity for multi-modal pairs only,
and the benchmark's pairs are of one modality (those stages keep their similarity), so a baseline runs the
configuration without them."""


def _without_newer_keys(config: str, folder: Path) -> str:
    """A copy of the configuration file ``config`` in ``folder`` without :data:`_NEWER_KEYS` in its stages (a preset
    name or a file without them is returned as it is)."""
    import yaml

    if not config.endswith((".yaml", ".yml")):
        return config
    data = yaml.safe_load(Path(config).read_text(encoding="utf-8"))
    stages = data.get("stages", [])
    if not any(key in stage for stage in stages for key in _NEWER_KEYS):
        return config
    data["stages"] = [{k: v for k, v in stage.items() if k not in _NEWER_KEYS} for stage in stages]
    copy = folder / Path(config).name
    copy.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return str(copy)


def _run_case(pair: str, config: str, device: str, mni_data: Path | None, tree: Path | None) -> dict[str, Any]:
    import tempfile

    import torch

    folder = None if mni_data is None else str(mni_data.resolve())
    with tempfile.TemporaryDirectory() as scratch:
        if tree is not None:
            config = _without_newer_keys(config, Path(scratch))
        threads = torch.get_num_threads()
        spec = {"pair": pair, "config": config, "device": device, "mni_data": folder, "threads": threads}
        return run_worker("diffeomorphism", spec, _TIMEOUT_S, tree)


def _configs(pair: str, chosen: str | None) -> list[str]:
    """The configurations run on ``pair``: the given ones, or every shipped preset and accuracy configuration of the
    pair's dimension, as files of this checkout."""
    from regkit.config import list_presets, load_config

    ndim = 2 if pair == "2d" else 3
    if chosen:  # files as absolute paths (a baseline tree runs in its own folder), those of the pair's dimension
        names = [c.strip() for c in chosen.split(",") if c.strip()]
        paths = [str(Path(c).resolve()) if c.endswith((".yaml", ".yml")) else c for c in names]
        return [c for c in paths if load_config(c).dim == ndim]
    presets = ROOT / "configs" / "presets"  # by path: a baseline tree runs this tree's presets, not its own
    shipped = [str(presets / f"{name}.yaml") for name in list_presets() if name.endswith("-2d") == (ndim == 2)]
    accuracy = [str(path) for path in sorted(_ACCURACY.glob(f"accuracy-{ndim}d-*.yaml"))]
    return shipped + accuracy


def _fmt(value: Any, spec: str) -> str:
    return "" if value is None else format(value, spec)


def diffeomorphism(
    device: Annotated[Device, typer.Option("--device", help="Where to run: cpu or cuda.")] = Device.cpu,
    pairs: Annotated[str, typer.Option("--pairs", help="Comma-separated pairs: 2d, 2mm, 1mm.")] = "2d,2mm",
    configs: Annotated[
        str | None,
        typer.Option(
            "--configs",
            help="Comma-separated presets or YAML files (default: every shipped preset and "
            "accuracy configuration of the pair's dimension).",
        ),
    ] = None,
    baseline: Annotated[
        Path | None,
        typer.Option("--baseline", help="A tree with regkit/, kernels/ and configs/ run beside this one."),
    ] = None,
    mni_data: Annotated[
        Path | None, typer.Option("--mni-data", help="Folder holding nilearn's MNI152 1 mm files (for 1mm).")
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Markdown file (default: benchmarks/results/diffeomorphism-MACHINE.md)."),
    ] = None,
) -> None:
    """Jumps, inverse consistency, folds on a 2x grid, crossings, time, Dice and EPE of registrations with every
    preset, each case in a fresh process; with --baseline, the other tree's figures beside them."""
    from rich.console import Console

    chosen = [p.strip() for p in pairs.split(",") if p.strip()]
    if not chosen or any(p not in PAIRS for p in chosen):
        raise typer.BadParameter(f"give pairs from {', '.join(PAIRS)}, comma-separated (got {pairs!r})")
    console = Console()
    settings = (
        f"{device_name(device.value)}; jump: largest second difference of T along 200 segments of 2 mm sampled "
        "every 1 um (mm), and the count of 1 um steps whose images lie over 20 um apart; ref jump / ref dev: around "
        "the largest, the same map in float64 by an independent scheme (integrate_accurate, 256 steps): its own "
        "largest second difference there and its largest distance from T (mm); inverse: |T^-1(T(x)) - x| "
        "over the fixed foreground (mm); folds 2x: non-positive central-difference Jacobian determinants on a grid "
        "of half the spacing; crossings: facets crossed per voxel; seconds: register() alone"
        f"{' after a warm-up' if device is Device.cuda else ''}."
    )
    console.print(settings)
    report = Results(output or default_output("diffeomorphism", device.value), device.value)
    report.add(settings, "")
    header = ["pair", "configuration", "tree", "seconds", "Dice", "EPE mm", "jump mm", "over 20 um", "ref jump mm",
              "ref dev mm", "inverse max mm", "inverse p99 mm", "folds 2x", "crossings"]  # fmt: skip
    rows: list[list[str]] = []
    trees: list[tuple[str, Path | None]] = [("this", None)] + ([] if baseline is None else [("baseline", baseline)])
    for pair in chosen:
        for config in _configs(pair, configs):
            for label, tree in trees:
                console.print(f"  {pair} {Path(config).stem} ({label}) ...", style="dim")
                r = _run_case(pair, config, device.value, mni_data, tree)
                name = Path(config).stem
                if "failed" in r:
                    rows.append([pair, name, label, f"failed: {r['failed']}", *[""] * 10])
                else:
                    rows.append([
                        pair, name, label, f"{r['seconds']:.2f}", f"{r['dice']:.3f}", _fmt(r["epe_mm"], ".2f"),
                        f"{r['jump_mm']:.2g}", str(r["over_20um"]), f"{r['ref_jump_mm']:.2g}",
                        f"{r['ref_dev_mm']:.2g}", f"{r['inverse_max_mm']:.2g}",
                        f"{r['inverse_p99_mm']:.2g}", f"{r['fine_folds']:.2g}", _fmt(r["crossings"], ".2f"),
                    ])  # fmt: skip
                table, markdown = render("guarantees per configuration", header, rows)
                report.set(settings, "", markdown)
    console.print(table)
    console.print(f"written: {report.path}")

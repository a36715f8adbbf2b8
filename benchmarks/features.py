"""``python -m benchmarks features``: the learned ``features`` similarity beside ``mi``, ``lncc`` and ``ncc``, and the
feature network's training throughput with the fused and the reference WTConv layers. All cases run in this one process.

Parts (``--part``, repeatable):

* ``2d``: the ITK example slices (BrainWeb, 1 mm, 181 x 217), T1 as the fixed image against proton density deformed
  by a known random smooth map (``regkit.demo.synthetic_map``: a small affine map and the exponential of a smoothed
  random velocity field; one map per case seed). Every registration starts with the same affine stage (mutual
  information), then runs a CPAB stage with the similarity under test (:func:`registration_config`; "affine only"
  stops before it); the score is the endpoint error ``|psi(T(x)) - x|`` (mm) over the head (T1 above 5 % of its
  maximum), with ``T`` the registration (fixed -> moving) and ``psi`` the known map (moving -> fixed).
* ``3d``: on 2 mm brains with AAL labels, the mean Dice over the AAL labels after registration (same schedule in 3D):
  ``same``: the ``regkit demo`` pair (the MNI152 T1 against a deformed copy with a monotone intensity change);
  ``inverted``: the same pair with the moving intensities inverted; ``synth``: two images synthesised from the
  feature training's label volume (``regkit.features.training.synth``) with contrast draws of their own (seeds far
  from any training step's), the moving one deformed by a known map.
* ``throughput``: training steps of the shipped configurations ``features-2d`` / ``features-3d`` (synthesis included)
  with the fused and with the reference WTConv layers: samples per second, the network's forward + backward time per
  batch alone, and the peak of ``torch.cuda.max_memory_allocated``. CUDA only (``--quick`` runs a tiny CPU version).

``--quick`` shrinks every part to seconds-long smoke runs (images halved, few iterations, one case).
"""

from __future__ import annotations

import time
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from benchmarks.common import ITK_DATA, Device, Results, default_output, device_name, mib, render

if TYPE_CHECKING:
    import torch

    from regkit.config import RegistrationConfig
    from regkit.io import Image

CLASSICAL_2D = ("mi", "lncc", "ncc")  # the similarities the features are compared with
CLASSICAL_3D = ("mi", "lncc")
_SEED_BASE = 7000  # case seeds: far from the demo's and from any training step's generators


class Part(str, Enum):
    two_d = "2d"
    three_d = "3d"
    throughput = "throughput"


def similarity_spec(name: str, weights: Path | None, mode: str) -> dict[str, Any]:
    if name == "features":
        return {"name": "features", "mode": mode, "weights": None if weights is None else str(weights)}
    classical: dict[str, dict[str, Any]] = {
        "mi": {"name": "mi", "bins": 32},
        "lncc": {"name": "lncc", "window": 9},
        "ncc": {"name": "ncc"},
    }
    return classical[name]


def _columns(
    dim: int, weights: Path | None, mode: str, lncc_weights: list[float], distances: list[str]
) -> list[tuple[str, dict[str, Any] | None]]:
    """A part's columns: header and CPAB similarity (None: the affine stage alone); per feature distance of
    ``distances``, the features similarity and one ``features + W lncc`` column (with the images' local NCC at
    ``lncc_weight`` W) per W of ``lncc_weights``; then the classical similarities."""
    columns: list[tuple[str, dict[str, Any] | None]] = [("affine only", None)]
    for distance in distances:
        features = {**similarity_spec("features", weights, mode), "distance": distance}
        name = "features" if distance == "cosine" else f"features ({distance} distance)"
        columns.append((f"{name} ({mode})" if distance == "cosine" else name, features))
        columns += [(f"{name} + {w:g} lncc", {**features, "lncc_weight": w}) for w in lncc_weights]
    return columns + [
        (name, similarity_spec(name, weights, mode)) for name in (CLASSICAL_2D if dim == 2 else CLASSICAL_3D)
    ]


def registration_config(dim: int, similarity: dict[str, Any] | None, quick: bool) -> RegistrationConfig:
    """From the identity (the pairs share their grid): an affine stage with mutual information, the same for every
    similarity under test, then a CPAB stage with ``similarity`` (none: the affine stage alone). 2D (1 mm slices):
    affine at shrink 4, 2, CPAB 4 -> 8 -> 12 cells at shrink 4, 2, 1; 3D (2 mm brains): affine at shrink 2, 1, CPAB
    4 -> 8 cells at shrink 2, 1 (voxels of 1 to 4 mm, the sizes the feature network was trained on); ``quick``: one
    level each, few iterations."""
    from regkit.config import RegistrationConfig

    levels = {s: {"shrink": s, "smoothing": s / 2 if s > 1 else 0.0} for s in (4, 2, 1)}
    if quick:
        affine, cpab, cells, iterations = [levels[2]], [levels[2]], [4], [5]
    elif dim == 2:
        affine, cpab, cells, iterations = [levels[4], levels[2]], list(levels.values()), [4, 8, 12], [80, 60, 40]
    else:
        affine, cpab, cells, iterations = [levels[2], levels[1]], [levels[2], levels[1]], [4, 8], [80, 60]
    optimizer = {"learning_rate": 0.5, "iterations": [5] if quick else [60, 30], "patience": 10}
    stages: list[dict[str, Any]] = [
        {"type": "affine", "similarity": similarity_spec("mi", None, ""), "pyramid": affine, "optimizer": optimizer}
    ]
    if similarity is not None:
        stages.append(
            {
                "type": "cpab",
                "similarity": similarity,
                "pyramid": cpab,
                "optimizer": {"learning_rate": 0.05, "iterations": iterations, "patience": 10},
                "tessellation": cells,
                "steps": 20,
            }
        )
    return RegistrationConfig.model_validate({"dim": dim, "stages": stages})


# ---- 2D: endpoint error on the ITK slices --------------------------------------------------------------------------


def _itk_slices(quick: bool, folder: Path = ITK_DATA) -> tuple[Image, Image]:
    """The ITK example T1 and proton-density slices (aligned) from ``folder``, halved with ``quick``."""
    from regkit.errors import RegkitError
    from regkit.io import Image, read_image
    from regkit.spatial.pyramid import build_pyramid

    images = []
    for name in ("BrainT1Slice.png", "BrainProtonDensitySlice.png"):
        if not (folder / name).is_file():
            raise RegkitError(f"{folder / name}: missing; install Debian's insighttoolkit5-examples")
        image = read_image(folder / name)
        if quick:
            data, grid = build_pyramid(image.data.float()[None, None], image.grid, [(2, 1.0)])[0]
            image = Image(data[0, 0], grid)
        images.append(Image(image.data.float(), image.grid))
    return images[0], images[1]


def _endpoint_error(displacement: torch.Tensor, psi: torch.Tensor, grid: Any, mask: torch.Tensor) -> float:
    """Mean ``|psi(x + u(x)) - x|`` (mm) over ``mask``: ``u`` the registration's displacement on the fixed grid,
    ``psi`` the known map at the moving (= fixed) grid's voxel centres."""
    import torch

    from regkit.spatial.sampling import sample_image

    points = grid.world_points(torch.float64)
    moved = points + displacement.double().cpu()
    back = moved + sample_image((psi - points).movedim(-1, 0), grid, moved).movedim(0, -1)
    return float((back - points).norm(dim=-1)[mask].mean())


def _run_2d(
    cases: int, device: str, columns: list[tuple[str, dict[str, Any] | None]], quick: bool, itk_data: Path, say
) -> list[list[str]]:
    import torch

    from regkit.demo import SyntheticChange, synthetic_map
    from regkit.io import Image
    from regkit.registration import register
    from regkit.spatial.sampling import sample_image

    t1, pd = _itk_slices(quick, itk_data)
    grid = t1.grid
    head = t1.data > 0.05 * t1.data.max()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in columns}
    before = []
    for case in range(cases):
        psi = synthetic_map(grid, SyntheticChange(), torch.Generator().manual_seed(_SEED_BASE + case))
        moving = Image(sample_image(pd.data.double(), grid, psi).float(), grid)
        before.append(_endpoint_error(torch.zeros(*grid.shape, 2), psi, grid, head))
        for name, similarity in columns:
            start = time.perf_counter()
            result = register(t1, moving, registration_config(2, similarity, quick), device=device)
            error = _endpoint_error(result.transform.displacement(device=device), psi, grid, head)
            results[name].append((error, time.perf_counter() - start))
            say(f"  2d case {case}: {name:<8} endpoint error {error:.2f} mm ({results[name][-1][1]:.0f} s)")
    rows = [["none (before)", f"{sum(before) / len(before):.2f}", ", ".join(f"{e:.2f}" for e in before), ""]]
    for name, values in results.items():
        errors = [e for e, _ in values]
        seconds = sum(s for _, s in values) / len(values)
        rows.append([name, f"{sum(errors) / len(errors):.2f}", ", ".join(f"{e:.2f}" for e in errors), f"{seconds:.1f}"])
    return rows


# ---- 3D: Dice over AAL labels --------------------------------------------------------------------------------------


def pairs_3d(cases: int, quick: bool, labels: Path | None) -> list[tuple[str, Any, Any, Any, Any]]:
    """``(name, fixed, moving, fixed_labels, moving_labels)`` of the 3D cases (module docstring)."""
    import torch

    from regkit.demo import SyntheticChange, aal_labels, load_template, make_pair, synthetic_map
    from regkit.features.training.recipe import SynthesisConfig
    from regkit.features.training.synth import (
        AAL_LABELS,
        brain_label_volume,
        draw_shells,
        label_intensities,
        render_labels,
        sample_labels,
    )
    from regkit.io import Image
    from regkit.spatial.pyramid import build_pyramid

    template = load_template()
    if quick:
        data, grid = build_pyramid(template.data[None, None], template.grid, [(2, 1.0)])[0]
        template = Image(data[0, 0], grid)
    aal = aal_labels(template.grid)
    volume = brain_label_volume(4.0 if quick else 2.0, labels)
    cfg = SynthesisConfig()
    pairs = []
    for case in range(cases):
        seed = _SEED_BASE + case
        pair = make_pair(template, aal, seed=seed)
        pairs.append(("same", pair.fixed, pair.moving, pair.fixed_labels, pair.moving_labels))
        inverted = Image(pair.moving.data.max() - pair.moving.data, pair.moving.grid)
        pairs.append(("inverted", pair.fixed, inverted, pair.fixed_labels, pair.moving_labels))
        generator = torch.Generator().manual_seed(seed)
        grid = volume.grid
        psi = synthetic_map(grid, SyntheticChange(), generator)
        shells = draw_shells(generator)
        fixed_labels = sample_labels(volume, grid.world_points(), shells)
        moving_labels = sample_labels(volume, psi, shells)
        images = []
        for view in (fixed_labels, moving_labels):
            means = label_intensities(volume, cfg, generator)
            images.append(Image(render_labels(view, means, cfg, generator, generator)[0, 0], grid))
        keep = [lab.masked_fill(lab > AAL_LABELS, 0) for lab in (fixed_labels, moving_labels)]  # Dice over AAL alone
        pairs.append(("synth", images[0], images[1], Image(keep[0], grid), Image(keep[1], grid)))
    return pairs


def _run_3d(
    cases: int,
    device: str,
    columns: list[tuple[str, dict[str, Any] | None]],
    quick: bool,
    labels: Path | None,
    say,
) -> list[list[str]]:
    from regkit.registration import register
    from regkit.spatial.metrics import mean_dice

    scores: dict[tuple[str, str], list[float]] = {}
    before: dict[str, list[float]] = {}
    for name, fixed, moving, fixed_labels, moving_labels in pairs_3d(cases, quick, labels):
        before.setdefault(name, []).append(mean_dice(fixed_labels.data, moving_labels.data))
        for sim, similarity in columns:
            start = time.perf_counter()
            result = register(fixed, moving, registration_config(3, similarity, quick), device=device)
            dice = mean_dice(fixed_labels.data, result.warp(moving_labels, mode="nearest").data)
            scores.setdefault((name, sim), []).append(dice)
            say(f"  3d {name:<8} {sim:<8} Dice {dice:.3f} ({time.perf_counter() - start:.0f} s)")
    rows = []
    for name, values in before.items():
        row = [name, f"{sum(values) / len(values):.3f}"]
        row += [f"{sum(v) / len(v):.3f}" for v in (scores[(name, sim)] for sim, _ in columns)]
        rows.append(row)
    return rows


# ---- training throughput -------------------------------------------------------------------------------------------


def _throughput(device: str, steps: int, quick: bool, labels: Path | None, say) -> list[list[str]]:
    import torch

    from regkit.features.training.recipe import load_training_config
    from regkit.features.training.synth import brain_label_volume
    from regkit.features.training.train import Trainer

    rows = []
    for dim in (2, 3):
        cfg = load_training_config(f"features-{dim}d")
        if quick:
            synthesis = cfg.synthesis.model_copy(update={"crop": 32 if dim == 2 else 16})
            cfg = cfg.model_copy(update={"batch_size": 2, "synthesis": synthesis})
        volume = brain_label_volume(cfg.synthesis.source_spacing, labels)
        for backend in ("triton", "reference"):
            if backend == "triton" and device != "cuda":
                continue
            trainer = Trainer(cfg, volume, device=device, backend=backend)
            for _ in range(2):  # warm-up: kernel compilation, allocator
                trainer.step()
            cuda = device == "cuda"
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            for _ in range(steps):
                trainer.step()
            rate = steps * cfg.batch_size / (time.perf_counter() - start)
            pair, generator = trainer.batch(0)
            network_ms = _network_ms(trainer, pair, generator, cuda)
            peak = torch.cuda.max_memory_allocated() if cuda else None
            label = "fused" if backend == "triton" else "reference"
            rows.append([f"{dim}D", label, f"{cfg.batch_size} x {cfg.synthesis.crop}^{dim}", f"{rate:.1f}"])
            rows[-1] += [f"{network_ms:.1f}", mib(peak)]
            say("  " + "  ".join(rows[-1]))
    return rows


def _network_ms(trainer: Any, pair: Any, generator: Any, cuda: bool) -> float:
    """Median time (ms) of the network's forward + backward (with the loss) on one batch, 5 runs."""
    import statistics

    import torch

    times = []
    for _ in range(5):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        full, half = trainer.loss(pair, generator)
        (full + half).backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    trainer.optimizer.zero_grad(set_to_none=True)
    return statistics.median(times)


# ---- the command ---------------------------------------------------------------------------------------------------


def features(
    part: Annotated[
        list[Part] | None, typer.Option("--part", help="Parts to run (repeatable): 2d, 3d, throughput; default: all.")
    ] = None,
    device: Annotated[Device, typer.Option("--device", help="Where to run: cpu or cuda.")] = Device.cpu,
    cases: Annotated[int, typer.Option("--cases", min=1, help="Known deformations (case seeds) per pair kind.")] = 3,
    mode: Annotated[
        str, typer.Option("--mode", help="The features similarity's mode: warp_image or warp_features.")
    ] = "warp_image",
    weights_2d: Annotated[
        Path | None, typer.Option("--weights-2d", help="2D feature-network weights; default: the shipped ones.")
    ] = None,
    weights_3d: Annotated[
        Path | None, typer.Option("--weights-3d", help="3D feature-network weights; default: the shipped ones.")
    ] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Timed training steps per throughput row.")] = 20,
    itk_data: Annotated[
        Path, typer.Option("--itk-data", help="Folder holding BrainT1Slice.png and BrainProtonDensitySlice.png.")
    ] = ITK_DATA,
    labels: Annotated[
        Path | None,
        typer.Option(
            "--labels",
            help="Brain label map for the synthetic cases (regkit.features.training.synth.brain_labels); default: "
            "built.",
        ),
    ] = None,
    features_lncc: Annotated[
        list[float] | None,
        typer.Option(
            "--features-lncc",
            min=0.0,
            help="Repeatable: also run features with the images' local NCC at this weight (lncc_weight).",
        ),
    ] = None,
    distance: Annotated[
        list[str] | None,
        typer.Option(
            "--distance",
            help="Repeatable: the features similarity's distance, cosine or lncc (columns for each); default cosine.",
        ),
    ] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Smoke run: small images, few iterations.")] = False,
    threads: Annotated[int | None, typer.Option("--threads", min=1, help="CPU threads for torch.")] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Markdown file of the tables (default: benchmarks/results/features-MACHINE[-quick].md).",
        ),
    ] = None,
) -> None:
    """The `features` similarity against mi, lncc and ncc: endpoint error on the 2D ITK T1 / proton-density slices,
    Dice over AAL labels on 3D brains (same contrast, inverted contrast, synthetic contrasts); and the feature
    network's training throughput and peak memory with fused and reference WTConv layers (CUDA)."""
    import torch
    from rich.console import Console

    from regkit.similarity import FEATURE_DISTANCES, FEATURE_MODES

    if device is Device.cuda and not torch.cuda.is_available():
        raise typer.BadParameter("CUDA is not available here", param_hint="--device")
    if mode not in FEATURE_MODES:
        raise typer.BadParameter(f"choose {' or '.join(FEATURE_MODES)}", param_hint="--mode")
    distances = distance or [FEATURE_DISTANCES[0]]
    if any(d not in FEATURE_DISTANCES for d in distances):
        raise typer.BadParameter(f"choose {' or '.join(FEATURE_DISTANCES)}", param_hint="--distance")
    if threads is not None:
        torch.set_num_threads(threads)
    parts = part or list(Part)
    console = Console()

    def say(text: str) -> None:
        console.print(text, style="dim")

    header = f"{device_name(device.value)}; {cases} case(s) per kind{'; --quick' if quick else ''}"
    console.print(header)
    output = output or default_output("features", device.value, quick)
    report = Results(output, device.value)
    report.add(header, "")
    if Part.two_d in parts:
        columns = _columns(2, weights_2d, mode, features_lncc or [], distances)
        rows = _run_2d(cases if not quick else 1, device.value, columns, quick, itk_data, say)
        table, md = render(
            "2D T1 -> proton density (ITK slices): endpoint error (mm) over the head; affine stage with mi, CPAB stage "
            "with each similarity",
            ["similarity", "mean EPE mm", "per case", "s per registration"],
            rows,
        )
        console.print(table)
        report.add(md)
    if Part.three_d in parts:
        columns = _columns(3, weights_3d, mode, features_lncc or [], distances)
        rows = _run_3d(cases if not quick else 1, device.value, columns, quick, labels, say)
        table, md = render(
            "3D brains (2 mm): mean Dice over AAL labels; affine stage with mi, CPAB stage with each similarity",
            ["pair", "before", *(header for header, _ in columns)],
            rows,
        )
        console.print(table)
        report.add(md)
    if Part.throughput in parts:
        if device is Device.cpu and not quick:
            say("  throughput: CUDA only (or --quick); skipped")
        else:
            rows = _throughput(device.value, 2 if quick else steps, quick, labels, say)
            table, md = render(
                "feature-network training (synthesis included), fused vs reference WTConv",
                ["network", "WTConv", "batch", "samples/s", "network fwd+bwd ms", "peak MiB"],
                rows,
            )
            console.print(table)
            report.add(md)
    console.print(f"wrote {output}")

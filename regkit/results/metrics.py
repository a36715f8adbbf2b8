"""The contents of ``metrics.json``, the numbers that judge a registration (every value a plain number; NaN written as
null):

* ``similarity``: for ``ncc``, ``mse`` and the similarity of the last optimized stage, ``{"before", "after"}``: the loss
  as regkit minimizes it (``ncc``: 1 - NCC, ``lncc``: 1 - mean local cc^2, ``mi``: -MI in nats, ``mse``), lower is
  better, on the full-resolution fixed image against the moving image resampled onto the fixed grid with the identity
  (``before``) and with the transformation (``after``), both rescaled to [0, 1] between their 0.5th and 99.5th
  percentiles, no masks;
* ``labels`` (both label maps given): per label and mean Dice before and after, and HD95 (mm) after, over the labels
  present in both maps (Learn2Reg's rule; 0 is background);
* ``jacobian``: Learn2Reg's ``fraction_nonpositive`` and ``sdlogj`` from central differences of
  ``displacement.nii.gz`` (:mod:`regkit.spatial.metrics`), and the analytic determinant's ``analytic_min`` and
  ``analytic_max``;
* ``invertibility``: the guarantees measured on this result, over the fixed mask (or, without one, the fixed
  image's foreground: rescaled intensity above ``FOREGROUND``), at most ``PROBE_POINTS`` voxels of it:
  ``inverse_consistency_mm`` (``max`` and ``p99`` of ``|T^-1(T(x)) - x|``, the inverse computed as regkit inverts)
  and ``largest_jump_mm``, the largest distance between the images of two points ``probe_mm`` = 0.001 mm apart
  (about ``0.001 mm`` times the local stretch for a continuous map; a jump across a facet would show in full);
* ``warnings``: what went wrong, in sentences (a stage's result discarded, a similarity worse than no registration,
  folds, extreme local volume changes); empty when nothing did;
* ``failed_checks``: the warnings that mean the result is wrong, not merely doubtful: a transformation that folds
  (analytic Jacobian determinant at most 0) or whose determinant is not finite, and, for a registration without a
  fixed mask (whose similarity is measured on the whole image, as here), a similarity worse than no registration;
  ``regkit register`` exits with code 3 when there are any (its outputs are kept for inspection);
* ``field_of_view_overlap``: the fraction of the fixed grid that lies inside the moving image's box (identity map);
* ``runtime``: seconds per stage (with the levels' iterations and similarities) and in total; ``peak_memory``: bytes
  and how they were measured (CUDA ``max_memory_allocated``, else the process's peak resident set size);
* ``device``, ``seed``, ``versions``; ``images``: the fixed and moving grids (``regkit invert`` and ``regkit export``
  read the moving grid from here).

Grids are recorded as ``size``, ``spacing`` (x, y[, z] order), ``origin`` (LPS mm) and ``direction`` (rows of the
matrix whose columns are the index axes' directions).
"""

from __future__ import annotations

import math
import platform
import sys
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from regkit import __version__
from regkit.intensity import rescale_intensities
from regkit.io.image import Image
from regkit.results.resampling import sample_world
from regkit.similarity import build_similarity
from regkit.spatial.grid import Grid
from regkit.spatial.metrics import dice_per_label, fraction_nonpositive, hd95_per_label, sdlogj

if TYPE_CHECKING:
    from regkit.registration import RegistrationResult

__all__ = [
    "failed_checks",
    "field_of_view_overlap",
    "label_scores",
    "measure_peak_memory",
    "metrics_record",
    "metrics_warnings",
]


def metrics_record(
    result: RegistrationResult,
    world: torch.Tensor,
    mapped: torch.Tensor,
    labels: dict[str, Any] | None,
    det_fd: torch.Tensor,
    det_analytic: torch.Tensor,
    peak_memory: dict[str, Any],
) -> dict[str, Any]:
    """The content of ``metrics.json`` (module docstring) but ``runtime.write_seconds``, which the writer adds last.

    ``world``: the fixed voxel centres, ``mapped``: their images under the transformation (moving world space);
    ``labels``: :func:`label_scores` or None; ``det_fd`` and ``det_analytic``: the central-difference and analytic
    Jacobian determinants on the fixed grid; ``peak_memory``: :func:`measure_peak_memory` of the registration.
    """
    runtime: dict[str, Any] = {
        "total_seconds": result.seconds,
        "stages": [stage.to_dict() for stage in result.stages],
    }
    similarity = _similarities(result, world, mapped)
    jacobian = _jacobian_metrics(det_fd, det_analytic)
    invertibility = invertibility_metrics(result, world, mapped)
    return {
        "similarity": similarity,
        **({"labels": labels} if labels is not None else {}),
        "jacobian": jacobian,
        "invertibility": invertibility,
        "warnings": metrics_warnings(result, similarity, jacobian, invertibility),
        "failed_checks": failed_checks(result, similarity, jacobian),
        "field_of_view_overlap": field_of_view_overlap(result.fixed.grid, result.moving.grid),
        "runtime": runtime,
        "peak_memory": peak_memory,
        "device": result.device,
        "seed": result.config.seed,
        "versions": {
            "regkit": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "images": {"fixed": _grid_dict(result.fixed.grid), "moving": _grid_dict(result.moving.grid)},
    }


def field_of_view_overlap(fixed: Grid, moving: Grid, samples: int = 24) -> float:
    """Fraction of the fixed grid's voxel-centre box that lies inside the moving grid's box (half a voxel beyond its
    outer voxel centres) under the identity map of world space; estimated on a ``samples``-per-axis lattice."""
    index = torch.stack(
        torch.meshgrid(
            *[torch.linspace(0, s - 1, min(s, samples), dtype=torch.float64) for s in fixed.size], indexing="ij"
        ),
        dim=-1,
    ).reshape(-1, fixed.ndim)
    inside_index = moving.world_to_index(fixed.index_to_world(index))
    size = torch.tensor(moving.size, dtype=torch.float64)
    inside = ((inside_index >= -0.5) & (inside_index <= size - 0.5)).all(dim=-1)
    return float(inside.double().mean())


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _last_similarity(result: RegistrationResult) -> Any:
    """The similarity options the last optimized stage used (None with no such stage): the measure the registration
    is judged by (a CPAB stage's ``multimodal`` one where it chose that)."""
    chosen = None
    for stage, report in zip(result.config.stages, result.stages, strict=True):
        if hasattr(stage, "similarity"):
            multimodal = getattr(stage, "multimodal", None)
            used_multimodal = multimodal is not None and report.similarity == multimodal.name
            chosen = multimodal if used_multimodal else stage.similarity
    return chosen


def _similarities(result: RegistrationResult, world: torch.Tensor, mapped: torch.Tensor) -> dict[str, dict]:
    """``{name: {"before", "after"}}`` for ncc, mse and the last optimized stage's similarity (module docstring);
    ``world``: the fixed voxel centres, ``mapped``: their images under the transformation (moving world space)."""
    measures: dict[str, dict[str, Any]] = {"ncc": {}, "mse": {}}
    last = _last_similarity(result)
    if last is not None and last.name in ("lncc", "mi"):
        measures[last.name] = last.model_dump(exclude={"name"})
    fixed = rescale_intensities(result.fixed.data)[None, None]
    moving = Image(rescale_intensities(result.moving.data), result.moving.grid)
    images = {"before": sample_world(moving, world)[None, None], "after": sample_world(moving, mapped)[None, None]}
    out = {}
    with torch.no_grad():
        for name, params in measures.items():
            sim = build_similarity(name, **params)
            out[name] = {key: _finite(float(sim(fixed, image))) for key, image in images.items()}
    return out


def label_scores(
    fixed_labels: Image, moving_labels: Image, before: torch.Tensor, after: torch.Tensor, spacing
) -> dict[str, Any]:
    """Dice before/after and HD95 after, over the labels present in both maps (Learn2Reg's rule)."""
    present = set(torch.unique(fixed_labels.data).tolist()) & set(torch.unique(moving_labels.data).tolist())
    labels = sorted(int(v) for v in present if v != 0)
    dice_before = dice_per_label(fixed_labels.data, before, labels)
    dice_after = dice_per_label(fixed_labels.data, after, labels)
    hd95 = hd95_per_label(fixed_labels.data, after, spacing, labels)

    def mean(values: dict[int, float]) -> float | None:
        finite = [v for v in values.values() if math.isfinite(v)]
        return float(np.mean(finite)) if finite else None

    return {
        "labels": labels,
        "dice_before": {str(k): _finite(v) for k, v in dice_before.items()},
        "dice_after": {str(k): _finite(v) for k, v in dice_after.items()},
        "hd95_after_mm": {str(k): _finite(v) for k, v in hd95.items()},
        "mean_dice_before": mean(dice_before),
        "mean_dice_after": mean(dice_after),
        "mean_hd95_after_mm": mean(hd95),
    }


def measure_peak_memory(result: RegistrationResult) -> dict[str, Any]:
    if result.peak_memory_bytes is not None:
        return {"bytes": int(result.peak_memory_bytes), "measure": "cuda_max_memory_allocated"}
    try:
        import resource
    except ImportError:  # Windows
        return {"bytes": None, "measure": "unavailable"}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"bytes": int(peak if sys.platform == "darwin" else peak * 1024), "measure": "process_peak_rss"}


FOREGROUND = 0.1
"""Fixed-image foreground for the invertibility checks: rescaled intensity (``rescale_intensities``) above this."""
PROBE_POINTS = 2**18
"""At most this many voxels (an even stride through the mask or foreground) carry the invertibility checks."""
PROBE_MM = 0.001
"""Distance between the two points of each continuity probe."""


def invertibility_metrics(result: RegistrationResult, world: torch.Tensor, mapped: torch.Tensor) -> dict[str, Any]:
    """``invertibility`` of ``metrics.json`` (module docstring), for fixed voxel centres ``world (*shape, n)`` and their
    images ``mapped`` (moving world space, LPS mm)."""
    n = world.shape[-1]
    if result.fixed_mask is not None:
        region = result.fixed_mask.data != 0
    else:
        region = rescale_intensities(result.fixed.data) > FOREGROUND
    region = region.to(world.device)
    if not bool(region.any()):
        region = torch.ones_like(region)
    points, images = world[region], mapped[region]
    stride = -(-points.shape[0] // PROBE_POINTS)
    points, images = points[::stride], images[::stride]
    back = result.transform.inverse_world(images)
    error = (back - points).norm(dim=-1)
    direction = torch.arange(1, n + 1, dtype=points.dtype, device=points.device)
    direction = direction / direction.norm()  # one fixed oblique direction
    jump = (result.transform.transform_world(points + PROBE_MM * direction) - images).norm(dim=-1)
    return {
        "points": int(points.shape[0]),
        "inverse_consistency_mm": {
            "max": _finite(float(error.max())),
            "p99": _finite(float(torch.quantile(error.float(), 0.99))),
        },
        "probe_mm": PROBE_MM,
        "largest_jump_mm": _finite(float(jump.max())),
    }


INVERSE_LIMIT_MM = 0.01
"""An inverse-consistency error or a probe jump beyond this is reported: the scheme computes the exact flow."""


def _jacobian_metrics(det_fd: torch.Tensor, det_analytic: torch.Tensor) -> dict[str, Any]:
    interior = min(det_fd.shape) > 4  # Learn2Reg drops 2 voxels on each side
    return {
        "fraction_nonpositive": fraction_nonpositive(det_fd) if interior else None,
        "sdlogj": _finite(sdlogj(det_fd)) if interior else None,
        "analytic_min": _finite(float(det_analytic.min())),
        "analytic_max": _finite(float(det_analytic.max())),
    }


VOLUME_CHANGE_LIMITS = (0.1, 10.0)
"""A local volume change (analytic Jacobian determinant) outside this range is reported as extreme."""


def metrics_warnings(
    result: RegistrationResult,
    similarity: dict[str, dict],
    jacobian: dict[str, Any],
    invertibility: dict[str, Any],
) -> list[str]:
    """The ``warnings`` of ``metrics.json`` (module docstring)."""
    found = list(result.stage_warnings)
    worse = _worse_than_none(result, similarity)
    if worse is not None:
        found.append(worse)
    low, high = jacobian["analytic_min"], jacobian["analytic_max"]
    broken = _broken_jacobian(jacobian)
    if broken is not None:
        found.append(broken)
    elif low is not None and high is not None and (low < VOLUME_CHANGE_LIMITS[0] or high > VOLUME_CHANGE_LIMITS[1]):
        found.append(
            f"extreme local volume change: analytic Jacobian determinant in [{low:.3g}, {high:.3g}]; a larger "
            "prior weight or a coarser tessellation regularizes more"
        )
    if jacobian["fraction_nonpositive"]:
        found.append(
            f"{jacobian['fraction_nonpositive']:.2g} of the voxels have a non-positive finite-difference Jacobian"
        )
    inverse = invertibility["inverse_consistency_mm"]["max"]
    if inverse is not None and inverse > INVERSE_LIMIT_MM:
        found.append(f"the inverse transformation maps points back to within {inverse:.3g} mm only")
    jump = invertibility["largest_jump_mm"]
    if jump is not None and jump > INVERSE_LIMIT_MM:
        found.append(
            f"points {invertibility['probe_mm']:g} mm apart map up to {jump:.3g} mm apart: the map is discontinuous "
            "or stretches extremely"
        )
    return found


def failed_checks(result: RegistrationResult, similarity: dict[str, dict], jacobian: dict[str, Any]) -> list[str]:
    """The ``failed_checks`` of ``metrics.json`` (module docstring): sentences, as in ``warnings``."""
    found = [] if result.fixed_mask is not None else [_worse_than_none(result, similarity)]
    found.append(_broken_jacobian(jacobian))
    return [sentence for sentence in found if sentence is not None]


def _worse_than_none(result: RegistrationResult, similarity: dict[str, dict]) -> str | None:
    """The warning that the registration ended with a worse similarity (the last optimized stage's, else ncc) than no
    registration, or None."""
    last = _last_similarity(result)
    name = last.name if last is not None and last.name in similarity else "ncc"
    before, after = similarity[name]["before"], similarity[name]["after"]
    if before is not None and after is not None and after > before:
        return f"the registration made the similarity {name} worse than no registration ({before:.4g} -> {after:.4g})"
    return None


def _broken_jacobian(jacobian: dict[str, Any]) -> str | None:
    """The warning that the analytic Jacobian determinant is not positive or not finite somewhere, or None."""
    low, high = jacobian["analytic_min"], jacobian["analytic_max"]
    if low is None or high is None:
        return "the transformation's Jacobian determinant is not finite"
    if low <= 0:
        return f"the transformation folds: analytic Jacobian determinant down to {low:.3g}"
    return None


def _grid_dict(grid: Grid) -> dict[str, list]:
    return {
        "size": list(grid.size),
        "spacing": list(grid.spacing),
        "origin": list(grid.origin),
        "direction": [list(row) for row in grid.direction],
    }

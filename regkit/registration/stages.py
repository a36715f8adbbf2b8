"""The optimized stages: :func:`run_linear` (rigid or affine) and :func:`run_cpab` (one or more CPAB flows).

* ``rigid`` / ``affine``: ``M <- M @ P`` with ``P`` a centred rigid / affine map optimized over the pyramid (a stage
  whose map ends non-finite, reflecting or singular, or with a worse similarity on its finest level than it started
  with, is discarded, with a warning in its report);
* ``cpab``: a CPAB flow on the fixed grid's box (``CPAB.for_grid``), optimized over the pyramid with the tessellation
  schedule (a stage that ends with a worse similarity at full resolution than it started with is discarded, with a
  warning in its report; with ``multimodal`` set, the stage first measures how linearly the pair's intensities relate
  after the earlier stages, :mod:`regkit.registration.modality`, and uses ``multimodal`` for a multi-modal pair);
  the solution at one level is carried to the next level's finer tessellation by interpolating its velocity at the new
  vertices (exact when the tessellations nest, e.g. 4 -> 8). ``chain = K`` runs the schedule K times, each time
  composing a new flow after the earlier ones. CPAB parameters are optimized in the prior's whitened
  coordinates: ``theta = theta_0 + L z`` with ``Sigma_theta = L L^T`` and ``theta_0`` the level's starting field (the
  coarser level's solution), a ``torch.nn.utils.parametrize`` of ``theta`` (:class:`Unwhiten`); ``z`` starts at zero on
  every level. The prior is :class:`~regkit.cpab.prior.VertexPrior` (a squared-exponential process on the vertex
  velocities, whose whitening is Kronecker-factored in 3D, so fine tessellations cost little), or the cell-map
  :class:`~regkit.cpab.prior.CPABPrior` with volume preservation. Gradient steps are smooth fields. Adam's learning rate
  is in prior standard deviations of a coherent step: it is divided by the prior's :func:`coherence` and multiplied by
  ``shrink / first shrink`` of the level, so that steps shrink with the pyramid's voxels and mean the same on every
  tessellation.

Each level minimizes ``similarity(fixed, moving o transform) + weight * |z|^2 / (2 d)`` (the prior only for CPAB: the
prior energy of the level's change; ``d`` = number of CPAB parameters, so that the weight means the same on every
tessellation).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch.nn.utils import parametrize

from regkit.config import AffineStage, CpabStage, RigidStage
from regkit.cpab.module import CPAB
from regkit.cpab.prior import CPABPrior, VertexPrior
from regkit.errors import RegkitError
from regkit.registration.levels import Level, RunContext, loss_on_level, optimize_level
from regkit.registration.modality import mapped_linearity
from regkit.registration.result import StageReport
from regkit.similarity import build_similarity
from regkit.similarity.base import Similarity
from regkit.similarity.options import SimilarityOptions
from regkit.spatial.affine import AffineTransform, RigidTransform, grid_centre
from regkit.spatial.grid import Grid

__all__ = ["VOXELS_PER_CELL", "Prior", "Unwhiten", "coherence", "linear_map_problem", "run_cpab", "run_linear"]

Prior = CPABPrior | VertexPrior

VOXELS_PER_CELL = 4
"""The finest tessellation a CPAB stage uses has one cell per this many voxels of the fixed image along each axis."""


def _linear_points(matrix: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    n = points.shape[-1]
    return points @ matrix[:n, :n].T + matrix[:n, n]


def run_linear(
    ctx: RunContext, index: int, stage: RigidStage | AffineStage, matrix: np.ndarray, flows: list[CPAB]
) -> tuple[np.ndarray, StageReport]:
    """Optimize a rigid or affine stage (``index`` in the configuration) starting from the homogeneous ``matrix``;
    returns the new homogeneous matrix and the stage report. ``flows``: the CPAB flows so far (there may be none)."""
    if flows:
        raise RegkitError(f"stage {index} ({stage.type}) comes after a CPAB stage; put linear stages first")
    grid = ctx.fixed.grid
    extent = np.asarray(grid.spacing) * np.asarray(grid.size)
    model_cls = RigidTransform if isinstance(stage, RigidStage) else AffineTransform
    model = model_cls(grid_centre(grid), radius=float(extent.max() / 2), initial=matrix, dtype=ctx.dtype)
    model = model.to(ctx.device)
    similarity = build_similarity(stage.similarity.name, **stage.similarity.model_dump(exclude={"name"}))
    report = StageReport(stage.type, similarity=stage.similarity.name)
    start = time.perf_counter()
    levels = ctx.levels(stage)
    for li, level in enumerate(levels):

        def objective(level: Level = level) -> tuple[torch.Tensor, torch.Tensor]:
            sim = loss_on_level(level, similarity, model.transform_points(level.fixed_world))
            return sim, sim

        report.levels.append(optimize_level(ctx, index, stage, li, len(levels), list(model.parameters()), objective))
        ctx.level_done(model.matrix().detach().double().cpu().numpy(), [])
    report.seconds = round(time.perf_counter() - start, 3)
    result = model.matrix().detach().double().cpu().numpy()
    problem = linear_map_problem(result)
    if problem is None:
        before, after = (
            _finest_similarity(levels[-1], similarity, torch.as_tensor(m, dtype=ctx.dtype, device=ctx.device), [])
            for m in (matrix, result)
        )
        if not after < before:
            problem = f"made its similarity worse ({before:.4g} -> {after:.4g} on its finest level)"
    if problem is not None:
        report.warning = f"the {stage.type} stage {problem}; the result of the earlier stages is kept"
        return matrix, report
    return result, report


def linear_map_problem(matrix: np.ndarray) -> str | None:
    """What makes the homogeneous ``matrix`` unusable as the linear part of a registration, or None: a non-finite
    entry, or a linear part that is singular or reflects (determinant at most 0; a registration's map keeps
    orientation)."""
    if not np.isfinite(matrix).all():
        return "ended with a non-finite map"
    n = matrix.shape[0] - 1
    det = float(np.linalg.det(matrix[:n, :n]))
    if det <= 0:
        return f"ended with a map that reflects or collapses space (determinant {det:.3g})"
    return None


def _refined(previous: CPAB | None, grid: Grid, cells: tuple[int, ...], stage: CpabStage, ctx: RunContext) -> CPAB:
    """A CPAB on ``grid``'s box with ``cells``, continuing ``previous`` (same box) when given."""
    if previous is not None and previous.tess.shape == cells:
        return previous
    flow = CPAB.for_grid(
        grid,
        cells,
        boundary=stage.boundary,
        volume_preserving=stage.volume_preserving,
        steps=stage.steps,
        length_scale=stage.prior.length_scale,
        variance=stage.prior.variance,
        backend=ctx.config.backend,
    ).to(device=ctx.device, dtype=ctx.dtype)
    if flow.basis.d == 0:
        raise RegkitError(
            f"the CPAB stage with {cells} cells, boundary '{stage.boundary}' and volume preservation has no free "
            "parameters; use a finer tessellation or another boundary mode"
        )
    if previous is not None:
        vertices = flow.tess.vertices().to(ctx.device, ctx.dtype)
        with torch.no_grad():
            velocity = previous.velocity(vertices)
            flow.theta.copy_(flow.basis.fit_vertex_velocities(velocity))
    return flow


def _supported_cells(cells: tuple[int, ...], grid: Grid) -> tuple[int, ...]:
    """The stage's cells per axis ((x, y[, z]) order), capped at one cell per :data:`VOXELS_PER_CELL` voxels of the
    fixed image along each axis. A finer tessellation has more parameters than the image can inform, and its
    compressions fall between voxels, where a finite-difference Jacobian of the sampled field reads them as folds (the
    positive analytic determinant notwithstanding): the accuracy benchmark's nibabel pair, 24^3 cells on 33 x 41 x 25
    voxels, had 0.4-1.5 % such folds (with 3 voxels per cell 0.1-0.5 %, with 4 none for mi, 0.03 % for lncc)."""
    return tuple(max(1, min(c, size // VOXELS_PER_CELL)) for c, size in zip(cells, grid.size, strict=True))


def _stage_prior(flow: CPAB, stage: CpabStage) -> Prior:
    """The prior the CPAB stage optimizes under: the vertex prior (``VertexPrior``, Kronecker-factored in 3D, so fine
    tessellations cost little) for nodal bases; the cell-map prior (``flow.prior``) with volume preservation."""
    if flow.basis.reduction is not None:
        return flow.prior
    return VertexPrior(flow.basis, stage.prior.length_scale, stage.prior.variance)


def coherence(prior: Prior) -> float:
    """How far a step of +1 in every whitened coordinate moves theta, in prior standard deviations (RMS over the
    coordinates): ``rms(L 1 / sigma)``; 1 for independent coordinates, larger the more coordinates one prior length
    scale spans. Adam's steps are about ``lr`` in every coordinate, so along a smooth gradient they move the field by
    ``lr`` times this; the CPAB stage divides Adam's learning rate by it, so that the learning rate means the same on
    every tessellation."""
    ones = torch.ones(prior.basis.d, dtype=torch.float64)
    return max(1.0, float((prior.unwhiten(ones) / prior.marginal_std()).square().mean().sqrt()))


class Unwhiten(torch.nn.Module):
    """``theta = theta_0 + prior.unwhiten(z)``, registered as a parametrization of ``CPAB.theta`` while a level is
    optimized: ``theta_0`` is the flow's parameters when the level starts (the coarser level's solution), so ``z``
    starts at zero and measures the level's change in prior standard deviations."""

    start: torch.Tensor

    def __init__(self, flow: CPAB, prior: Prior) -> None:
        super().__init__()
        self.prior = prior
        self.register_buffer("start", flow.theta.detach().clone())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.start + self.prior.unwhiten(z)

    def right_inverse(self, theta: torch.Tensor) -> torch.Tensor:
        return self.prior.whiten(theta - self.start)


def run_cpab(
    ctx: RunContext, index: int, stage: CpabStage, matrix: np.ndarray, flows: list[CPAB]
) -> tuple[list[CPAB], StageReport]:
    """Optimize a CPAB stage (``index`` in the configuration; ``chain`` flows) after the homogeneous ``matrix`` and
    the earlier ``flows``; returns the new flows and the stage report."""
    m = torch.as_tensor(matrix, dtype=ctx.dtype, device=ctx.device)
    report = StageReport(stage.type)
    start = time.perf_counter()
    levels = ctx.levels(stage)
    options = _chosen_similarity(stage, levels[-1], m, flows, report)
    similarity = build_similarity(options.name, **options.model_dump(exclude={"name"}))
    schedule = [_supported_cells(cells, ctx.fixed.grid) for cells in stage.level_cells(ctx.fixed.ndim)]
    new_flows: list[CPAB] = []
    for _ in range(stage.chain):
        flow: CPAB | None = None
        for li, (level, cells) in enumerate(zip(levels, schedule, strict=True)):
            flow = _refined(flow, ctx.fixed.grid, cells, stage, ctx)
            with torch.no_grad():  # earlier flows are fixed: move the level's points through them once
                start_points = level.fixed_world
                for earlier in [*flows, *new_flows]:
                    start_points = earlier.transform_world(start_points)
                # once per level: the points in the flow's domain, and one matrix from there to the moving world
                start_points = flow.world_to_domain(start_points)
                to_moving = m @ flow.domain_to_world_matrix(m)

            prior = _stage_prior(flow, stage)
            parametrize.register_parametrization(flow, "theta", Unwhiten(flow, prior))
            z = flow.get_parameter("parametrizations.theta.original")

            def objective(
                level: Level = level,
                flow: CPAB = flow,
                start_points: torch.Tensor = start_points,
                to_moving: torch.Tensor = to_moving,
                z=z,
            ) -> tuple[torch.Tensor, torch.Tensor]:
                moved = _linear_points(to_moving, flow.transform_points(start_points))
                sim = loss_on_level(level, similarity, moved)
                if stage.prior.weight == 0:
                    return sim, sim
                return sim + stage.prior.weight * 0.5 * z.pow(2).sum() / z.numel(), sim

            adam_scale = stage.pyramid[li].shrink / (stage.pyramid[0].shrink * coherence(prior))
            report.levels.append(optimize_level(ctx, index, stage, li, len(levels), [z], objective, cells, adam_scale))
            parametrize.remove_parametrizations(flow, "theta", leave_parametrized=True)
            ctx.level_done(matrix, [*flows, *new_flows, flow])
        assert flow is not None
        flow.requires_grad_(False)
        new_flows.append(flow)
    before, after = (_finest_similarity(levels[-1], similarity, m, f) for f in (flows, [*flows, *new_flows]))
    report.seconds = round(time.perf_counter() - start, 3)
    if not after < before:
        report.warning = (
            f"the deformable stage made its similarity worse ({before:.4g} -> {after:.4g} at full resolution); "
            "the result of the earlier stages is kept"
        )
        return [], report
    return new_flows, report


def _chosen_similarity(
    stage: CpabStage, level: Level, matrix: torch.Tensor, flows: list[CPAB], report: StageReport
) -> SimilarityOptions:
    """The stage's ``similarity``, or its ``multimodal`` one when the pair's intensities, mapped through ``matrix``
    after ``flows`` on ``level``, relate less linearly than ``modality_threshold``
    (:func:`~regkit.registration.modality.mapped_linearity`); the choice and its reason go into ``report.note``."""
    report.similarity = stage.similarity.name
    if stage.multimodal is None:
        return stage.similarity
    with torch.no_grad():
        points = level.fixed_world
        for flow in flows:
            points = flow.transform_world(points)
        score = mapped_linearity(level.fixed[0, 0], level.moving[0], level.moving_grid, _linear_points(matrix, points))
    threshold = stage.modality_threshold
    if score < threshold:
        report.similarity = stage.multimodal.name
        report.note = (
            f"multi-modal pair detected: r^2/eta^2 = {score:.2f} after the earlier stages (below {threshold:g}); "
            f"the stage uses {stage.multimodal.name} instead of {stage.similarity.name}"
        )
        return stage.multimodal
    report.note = (
        f"same-contrast pair: r^2/eta^2 = {score:.2f} after the earlier stages (at least {threshold:g}); the stage "
        f"uses {stage.similarity.name}"
    )
    return stage.similarity


def _finest_similarity(level: Level, similarity: Similarity, matrix: torch.Tensor, flows: list[CPAB]) -> float:
    """The similarity loss on ``level`` of the transformation ``matrix`` after ``flows`` (fixed world -> moving
    world), without the prior: what a CPAB stage is judged by."""
    with torch.no_grad():
        points = level.fixed_world
        for flow in flows:
            points = flow.transform_world(points)
        return float(loss_on_level(level, similarity, _linear_points(matrix, points)))

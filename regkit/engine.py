"""``register(fixed, moving, config)``: the registration engine.

Both images live in world space (LPS millimetres) with their own grids; nothing is resampled to a common grid first.
The result is a :class:`~regkit.transform.Transformation` in the pull-back direction: it maps a fixed world point to
the moving world point where the moving image is sampled, ``y = M phi_K(...phi_1(x))``.

Stages run in the configured order, each starting where the previous one ended:

* ``moments``: ``M`` from the images' centres of mass (and principal axes);
* ``rigid`` / ``affine``: ``M <- M @ P`` with ``P`` a centred rigid / affine map optimized over the pyramid;
* ``cpab``: a CPAB flow on the fixed grid's box (``CPAB.for_grid``), optimized over the pyramid with the tessellation
  schedule; the solution at one level is carried to the next level's finer tessellation by interpolating its velocity
  at the new vertices (exact when the tessellations nest, e.g. 4 -> 8). ``chain = K`` runs the schedule K times, each
  time composing a new flow after the earlier ones. CPAB parameters are optimized in the prior's whitened
  coordinates: ``theta = theta_0 + L z`` with ``Sigma_theta = L L^T`` and ``theta_0`` the level's starting field (the
  coarser level's solution), a ``torch.nn.utils.parametrize`` of ``theta``; ``z`` starts at zero on every level. The
  prior is :class:`~regkit.cpab.prior.VertexPrior` (a squared-exponential process on the vertex velocities, whose
  whitening is Kronecker-factored in 3D, so fine tessellations cost little), or the cell-map
  :class:`~regkit.cpab.prior.CPABPrior` with volume preservation. Gradient steps are smooth fields. Adam's
  learning rate is in prior standard deviations of a coherent step: it is divided by the prior's coherence
  (``rms(L 1 / sigma)``, how far a step of +1 in every whitened coordinate moves each one, which grows with the
  number of vertices a prior length scale spans) and multiplied by ``shrink / first shrink`` of the level, so that
  steps shrink with the pyramid's voxels and mean the same on every tessellation.

Each level minimizes ``similarity(fixed, moving o transform) + weight * |z|^2 / (2 d)`` (the prior only for CPAB: the
prior energy of the level's change; ``d`` = number of CPAB parameters, so that the weight means the same on every
tessellation) with Adam or L-BFGS,
stopping at the iteration cap or when the relative change of the loss stays below ``tolerance`` for ``patience``
iterations. Intensities are rescaled to [0, 1] between each image's 0.5th and 99.5th percentiles
before registration (the similarity measures see these, not the raw values).

On CUDA, Adam iterations after the third of each level are replayed from a CUDA graph (``regkit._steps``;
``cuda_graphs`` in the configuration): the host, not the GPU, bounds an eager iteration. Every objective must
therefore stay capture-safe: no host synchronisation, no host-to-device copy (tests/core/test_engine_graphs.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn.utils import parametrize

from regkit import process
from regkit._steps import Adam, GraphedSteps, Optimizer, eager_step
from regkit.config import AffineStage, CpabStage, MomentsStage, RegistrationConfig, RigidStage
from regkit.cpab.module import CPAB
from regkit.cpab.prior import CPABPrior, VertexPrior
from regkit.errors import ImageDimensionError, ImageValueError, RegkitError
from regkit.intensity import rescale_intensities
from regkit.io import Image
from regkit.similarity import build_similarity
from regkit.similarity.base import Similarity
from regkit.spatial.affine import AffineTransform, RigidTransform, grid_centre, moments_init
from regkit.spatial.grid import Grid
from regkit.spatial.pyramid import build_pyramid
from regkit.spatial.sampling import sample_image
from regkit.transform import Transformation

__all__ = [
    "Cancelled",
    "Progress",
    "RegistrationResult",
    "StageReport",
    "register",
    "resolve_device",
]


class Cancelled(RegkitError):
    """The registration was stopped by its ``should_stop`` callback (e.g. a Cancel button or Ctrl-C)."""


@dataclass(frozen=True)
class Progress:
    """One optimizer iteration, reported to the ``progress`` callback."""

    stage: int  # 0-based index into config.stages
    n_stages: int
    kind: str  # stage type: rigid, affine, cpab
    level: int  # 0-based pyramid level (coarse to fine)
    n_levels: int
    iteration: int  # 1-based
    max_iterations: int
    loss: float  # similarity + prior
    similarity: float
    elapsed: float  # seconds since the registration started
    cells: tuple[int, ...] | None = None  # CPAB tessellation at this level


@dataclass
class StageReport:
    """What one stage did: per level the iterations run, the final similarity and the seconds spent."""

    kind: str
    levels: list[dict] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class RegistrationResult:
    """The outcome of :func:`register`: the transformation plus what is needed to write and judge it."""

    transform: Transformation
    fixed: Image
    moving: Image
    config: RegistrationConfig
    stages: list[StageReport]
    device: str
    seconds: float
    peak_memory_bytes: int | None  # CUDA: max_memory_allocated; None on the CPU

    def warp(self, image: Image, mode: str = "linear") -> Image:
        """Resample ``image`` (in the moving image's world space, any grid) onto the fixed grid."""
        data = image.data.to(self.device)
        warped = self.transform.warp(data, image.grid, mode=mode).cpu()
        return Image(warped, self.fixed.grid)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else the CPU; ``cuda`` without a GPU is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RegkitError(f"device '{name}' requested but no CUDA device is available; use --device cpu")
    return device


def _normalised(image: Image, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    data = image.data.to(device=device, dtype=dtype)
    if not torch.isfinite(data).all():
        raise ImageValueError(f"{name} image has {int((~torch.isfinite(data)).sum())} NaN/Inf voxels")
    return rescale_intensities(data)


def _mask(mask: Image | None, image: Image, name: str, device: torch.device, dtype: torch.dtype):
    if mask is None:
        return None
    if mask.grid.shape != image.grid.shape:
        raise ImageDimensionError(f"{name} mask has shape {mask.grid.shape} but its image has {image.grid.shape}")
    m = (mask.data != 0).to(device=device, dtype=dtype)
    if not m.any():
        raise ImageValueError(f"{name} mask is empty (no non-zero voxel)")
    return m


@dataclass
class _Level:
    """One pyramid level of both images (and masks) on the device."""

    fixed: torch.Tensor  # (1, 1, *fixed_grid.shape)
    fixed_grid: Grid
    moving: torch.Tensor  # (1, *moving_grid.shape): one channel, as sample_image takes it
    moving_grid: Grid
    fixed_mask: torch.Tensor | None  # (1, 1, *fixed_grid.shape)
    moving_mask: torch.Tensor | None  # (1, *moving_grid.shape)
    fixed_world: torch.Tensor  # (*fixed_grid.shape, n) world points of the fixed voxels


class _Context:
    """Images, masks, device and reporting shared by all stages of one registration."""

    def __init__(
        self,
        fixed: Image,
        moving: Image,
        config: RegistrationConfig,
        fixed_mask: Image | None,
        moving_mask: Image | None,
        device: torch.device,
        progress: Callable[[Progress], None] | None,
        should_stop: Callable[[], bool] | None,
        on_level: Callable[[Transformation], None] | None,
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = getattr(torch, config.dtype)
        self.fixed, self.moving = fixed, moving
        self.fixed_t = _normalised(fixed, "fixed", device, self.dtype)
        self.moving_t = _normalised(moving, "moving", device, self.dtype)
        self.fixed_mask = _mask(fixed_mask, fixed, "fixed", device, self.dtype)
        self.moving_mask = _mask(moving_mask, moving, "moving", device, self.dtype)
        self.progress = progress
        self.should_stop = should_stop
        self.on_level = on_level
        self.start = time.perf_counter()
        self._levels: dict[tuple, list[_Level]] = {}

    def levels(self, stage: RigidStage | AffineStage | CpabStage) -> list[_Level]:
        """The stage's pyramid, coarse to fine; masks use the stage's mask flags. Built once per pyramid and mask
        flags (stages with the same pyramid share it: smoothing a 3D image takes seconds on the CPU)."""
        spec = [(level.shrink, level.smoothing) for level in stage.pyramid]
        key = (tuple(spec), stage.mask.fixed, stage.mask.moving)
        if key not in self._levels:
            self._levels[key] = self._build_levels(stage, spec)
        return self._levels[key]

    def _build_levels(self, stage: RigidStage | AffineStage | CpabStage, spec: list[tuple[int, float]]) -> list[_Level]:
        fixed = build_pyramid(self.fixed_t[None, None], self.fixed.grid, spec)
        moving = build_pyramid(self.moving_t[None, None], self.moving.grid, spec)
        no_smoothing = [(shrink, 0.0) for shrink, _ in spec]
        fmask = mmask = None
        if self.fixed_mask is not None and stage.mask.fixed:
            fmask = build_pyramid(self.fixed_mask[None, None], self.fixed.grid, no_smoothing)
        if self.moving_mask is not None and stage.mask.moving:
            mmask = build_pyramid(self.moving_mask[None, None], self.moving.grid, no_smoothing)
        return [
            _Level(
                fixed=f,
                fixed_grid=fg,
                moving=m[0],
                moving_grid=mg,
                fixed_mask=None if fmask is None else fmask[i][0],
                moving_mask=None if mmask is None else mmask[i][0][0],
                fixed_world=fg.world_points(self.dtype, self.device),
            )
            for i, ((f, fg), (m, mg)) in enumerate(zip(fixed, moving, strict=True))
        ]

    def check_stop(self) -> None:
        if self.should_stop is not None and self.should_stop():
            raise Cancelled("registration cancelled")

    def level_done(self, matrix: np.ndarray, flows: list[CPAB]) -> None:
        """Report the transformation reached after a pyramid level to ``on_level`` (a snapshot: its flows are copies
        that later levels do not change)."""
        if self.on_level is None:
            return
        snapshots = [flow._with_theta(flow.theta.detach()).requires_grad_(False) for flow in flows]
        self.on_level(Transformation(self.fixed.grid, np.asarray(matrix, dtype=np.float64), snapshots))


def _loss_on_level(level: _Level, similarity: Similarity, moving_points: torch.Tensor) -> torch.Tensor:
    """Similarity between the fixed image and the moving image sampled at ``moving_points`` (world, fixed grid);
    the similarity does the sampling (``Similarity.loss_at_points``: the features similarity may warp features)."""
    mask = level.fixed_mask
    if level.moving_mask is not None:
        moved_mask = sample_image(level.moving_mask, level.moving_grid, moving_points.detach())[None]
        mask = moved_mask if mask is None else mask * moved_mask
    return similarity.loss_at_points(level.fixed, level.moving, level.moving_grid, moving_points, mask)


def _optimize(
    ctx: _Context,
    stage_index: int,
    stage: RigidStage | AffineStage | CpabStage,
    level_index: int,
    n_levels: int,
    parameters: list[torch.nn.Parameter],
    objective: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    cells: tuple[int, ...] | None = None,
    adam_scale: float = 1.0,
) -> dict:
    """Run the stage's optimizer on one level; ``objective() -> (loss, similarity)``. Returns the level's report.
    Adam's learning rate is the configured one times ``adam_scale``."""
    opt_cfg = stage.optimizer
    max_iter = stage.level_iterations()[level_index]
    scale = 1.0  # the loss the optimizer sees is scale * loss (reports give the loss itself)
    graphed = opt_cfg.name == "adam" and ctx.device.type == "cuda" and ctx.config.cuda_graphs
    if opt_cfg.name == "adam":
        optimizer: Optimizer = Adam(parameters, lr=opt_cfg.learning_rate * adam_scale)
    else:
        # L-BFGS is invariant to the loss's scale except for its first step, lr * g / max(1, |g|_1): image
        # similarities have tiny gradients in millimetre units, so that step would be far below the gradient's noise
        # and corrupt the curvature pairs. Scaling the loss so that |g|_1 = 1 at the level's start makes the first
        # step lr long. One L-BFGS iteration (with its line search) per step; torch's own stopping tests are off,
        # the stage's tolerance/patience rule stops a level.
        loss0, _ = objective()
        grads = torch.autograd.grad(loss0, parameters, allow_unused=True)
        norm = sum(float(g.abs().sum()) for g in grads if g is not None)
        scale = 1.0 / norm if norm > 0 else 1.0
        optimizer = torch.optim.LBFGS(
            parameters,
            lr=opt_cfg.learning_rate,
            max_iter=1,
            history_size=10,
            tolerance_grad=0.0,
            tolerance_change=0.0,
            line_search_fn="strong_wolfe",
        )
    start = time.perf_counter()
    graph = GraphedSteps(optimizer, objective) if graphed and isinstance(optimizer, Adam) else None
    previous, calm, iteration, loss, similarity = None, 0, 0, math.nan, math.nan
    for iteration in range(1, max_iter + 1):
        ctx.check_stop()
        loss, similarity = graph() if graph is not None else eager_step(optimizer, objective, scale)
        if not np.isfinite(loss):
            raise RegkitError(
                f"stage {stage_index} ({stage.type}) diverged at level {level_index}, iteration {iteration}: "
                "the loss is not finite; lower the learning rate"
            )
        if ctx.progress is not None:
            ctx.progress(
                Progress(
                    stage=stage_index,
                    n_stages=len(ctx.config.stages),
                    kind=stage.type,
                    level=level_index,
                    n_levels=n_levels,
                    iteration=iteration,
                    max_iterations=max_iter,
                    loss=loss,
                    similarity=similarity,
                    elapsed=time.perf_counter() - ctx.start,
                    cells=cells,
                )
            )
        if previous is not None and opt_cfg.tolerance > 0:
            change = abs(loss - previous) / max(abs(previous), 1e-12)
            calm = calm + 1 if change < opt_cfg.tolerance else 0
            if calm >= opt_cfg.patience:
                break
        previous = loss
    return {
        "level": level_index,
        "iterations": iteration,
        "similarity": similarity,
        "loss": loss,
        "seconds": round(time.perf_counter() - start, 3),
        "cuda_graph": graph is not None and graph.captured,
        **({"cells": list(cells)} if cells is not None else {}),
    }


def _linear_points(matrix: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    n = points.shape[-1]
    return points @ matrix[:n, :n].T + matrix[:n, n]


def _run_linear(ctx: _Context, index: int, stage: RigidStage | AffineStage, matrix: np.ndarray, flows: list[CPAB]):
    """Optimize a rigid or affine stage; returns the new homogeneous matrix and the stage report."""
    if flows:
        raise RegkitError(f"stage {index} ({stage.type}) comes after a CPAB stage; put linear stages first")
    grid = ctx.fixed.grid
    extent = np.asarray(grid.spacing) * np.asarray(grid.size)
    model_cls = RigidTransform if isinstance(stage, RigidStage) else AffineTransform
    model = model_cls(grid_centre(grid), radius=float(extent.max() / 2), initial=matrix, dtype=ctx.dtype)
    model = model.to(ctx.device)
    similarity = build_similarity(stage.similarity.name, **stage.similarity.model_dump(exclude={"name"}))
    report = StageReport(stage.type)
    start = time.perf_counter()
    levels = ctx.levels(stage)
    for li, level in enumerate(levels):

        def objective(level: _Level = level) -> tuple[torch.Tensor, torch.Tensor]:
            sim = _loss_on_level(level, similarity, model.transform_points(level.fixed_world))
            return sim, sim

        report.levels.append(_optimize(ctx, index, stage, li, len(levels), list(model.parameters()), objective))
        ctx.level_done(model.matrix().detach().double().cpu().numpy(), [])
    report.seconds = round(time.perf_counter() - start, 3)
    return model.matrix().detach().double().cpu().numpy(), report


def _refined(previous: CPAB | None, grid: Grid, cells: tuple[int, ...], stage: CpabStage, ctx: _Context) -> CPAB:
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


Prior = CPABPrior | VertexPrior

VOXELS_PER_CELL = 4
"""The finest tessellation a CPAB stage uses has one cell per this many voxels of the fixed image along each axis."""


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


def _coherence(prior: Prior) -> float:
    """How far a step of +1 in every whitened coordinate moves theta, in prior standard deviations (RMS over the
    coordinates): ``rms(L 1 / sigma)``; 1 for independent coordinates, larger the more coordinates one prior length
    scale spans. Adam's steps are about ``lr`` in every coordinate, so along a smooth gradient they move the field by
    ``lr`` times this; the engine divides Adam's learning rate by it, so that the learning rate means the same on
    every tessellation."""
    ones = torch.ones(prior.basis.d, dtype=torch.float64)
    return max(1.0, float((prior.unwhiten(ones) / prior.marginal_std()).square().mean().sqrt()))


class _Unwhiten(torch.nn.Module):
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


def _run_cpab(ctx: _Context, index: int, stage: CpabStage, matrix: np.ndarray, flows: list[CPAB]):
    """Optimize a CPAB stage (``chain`` flows); returns the new flows and the stage report."""
    similarity = build_similarity(stage.similarity.name, **stage.similarity.model_dump(exclude={"name"}))
    m = torch.as_tensor(matrix, dtype=ctx.dtype, device=ctx.device)
    report = StageReport(stage.type)
    start = time.perf_counter()
    levels = ctx.levels(stage)
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
            parametrize.register_parametrization(flow, "theta", _Unwhiten(flow, prior))
            z = flow.get_parameter("parametrizations.theta.original")

            def objective(
                level: _Level = level,
                flow: CPAB = flow,
                start_points: torch.Tensor = start_points,
                to_moving: torch.Tensor = to_moving,
                z=z,
            ) -> tuple[torch.Tensor, torch.Tensor]:
                moved = _linear_points(to_moving, flow.transform_points(start_points))
                sim = _loss_on_level(level, similarity, moved)
                if stage.prior.weight == 0:
                    return sim, sim
                return sim + stage.prior.weight * 0.5 * z.pow(2).sum() / z.numel(), sim

            adam_scale = stage.pyramid[li].shrink / (stage.pyramid[0].shrink * _coherence(prior))
            report.levels.append(_optimize(ctx, index, stage, li, len(levels), [z], objective, cells, adam_scale))
            parametrize.remove_parametrizations(flow, "theta", leave_parametrized=True)
            ctx.level_done(matrix, [*flows, *new_flows, flow])
        assert flow is not None
        flow.requires_grad_(False)
        new_flows.append(flow)
    report.seconds = round(time.perf_counter() - start, 3)
    return new_flows, report


def register(
    fixed: Image,
    moving: Image,
    config: RegistrationConfig,
    *,
    fixed_mask: Image | None = None,
    moving_mask: Image | None = None,
    device: str | torch.device | None = None,
    progress: Callable[[Progress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_level: Callable[[Transformation], None] | None = None,
) -> RegistrationResult:
    """Register ``moving`` to ``fixed`` (2D or 3D, any grids) with the stages of ``config``.

    Args:
        fixed, moving: the images, in world space (LPS mm); they may differ in grid, spacing and orientation.
        config: the registration configuration (``regkit.config.load_config``).
        fixed_mask, moving_mask: optional masks on the images' grids; non-zero voxels count in the similarity.
        device: overrides ``config.device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"auto"``).
        progress: called after every optimizer iteration with a :class:`Progress`.
        should_stop: polled before every iteration; returning True raises :class:`Cancelled`.
        on_level: called after every pyramid level of every rigid, affine and CPAB stage with the whole
            transformation reached so far (earlier stages included; fixed world -> moving world), e.g. to preview the
            warped image. Its CPAB flows are copies on the computation device; later levels do not change them.

    Returns:
        A :class:`RegistrationResult` whose ``transform`` maps fixed world points to moving world points.

    The first call tunes the process's allocator as the ``regkit`` commands do (``regkit.process``; opt out with
    ``REGKIT_PROCESS_SETTINGS=0``).
    """
    process.tune_allocator()
    if fixed.ndim != moving.ndim:
        raise ImageDimensionError(f"the fixed image is {fixed.ndim}D but the moving image is {moving.ndim}D")
    if config.dim is not None and config.dim != fixed.ndim:
        raise ImageDimensionError(f"the configuration is for {config.dim}D images but the images are {fixed.ndim}D")
    dev = resolve_device(str(device) if device is not None else config.device)
    torch.manual_seed(config.seed)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    ctx = _Context(fixed, moving, config, fixed_mask, moving_mask, dev, progress, should_stop, on_level)
    n = fixed.ndim
    matrix = np.eye(n + 1)
    flows: list[CPAB] = []
    reports: list[StageReport] = []
    for index, stage in enumerate(config.stages):
        if isinstance(stage, MomentsStage):
            begin = time.perf_counter()
            matrix = moments_init(ctx.fixed_t, fixed.grid, ctx.moving_t, moving.grid, mode=stage.mode).cpu().numpy()
            reports.append(StageReport(stage.type, seconds=round(time.perf_counter() - begin, 3)))
        elif isinstance(stage, CpabStage):
            new_flows, report = _run_cpab(ctx, index, stage, matrix, flows)
            flows.extend(new_flows)
            reports.append(report)
        else:
            matrix, report = _run_linear(ctx, index, stage, matrix, flows)
            reports.append(report)
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    return RegistrationResult(
        transform=Transformation(fixed.grid, np.asarray(matrix, dtype=np.float64), flows),
        fixed=fixed,
        moving=moving,
        config=config,
        stages=reports,
        device=str(dev),
        seconds=round(time.perf_counter() - ctx.start, 3),
        peak_memory_bytes=peak,
    )

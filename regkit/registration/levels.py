"""The pyramid levels of a stage and their optimization: :class:`Level` (both images and masks at one resolution),
:class:`RunContext` (what all stages of one registration share: the rescaled images, masks, device, callbacks and the
pyramids), :func:`loss_on_level` and :func:`optimize_level` (the optimizer loop of one level).

Intensities are rescaled to [0, 1] between each image's 0.5th and 99.5th percentiles before registration (the
similarity measures see these, not the raw values). A level stops at its iteration cap or when the relative change of
the loss stays below the stage's ``tolerance`` for ``patience`` iterations.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from regkit.config import AffineStage, CpabStage, RegistrationConfig, RigidStage
from regkit.cpab.module import CPAB
from regkit.errors import ImageDimensionError, ImageValueError, RegkitError
from regkit.intensity import rescale_intensities
from regkit.io import Image
from regkit.registration.progress import Cancelled, Progress
from regkit.registration.result import LevelReport
from regkit.registration.steps import Adam, GraphedSteps, Objective, Optimizer, eager_step
from regkit.similarity.base import Similarity
from regkit.spatial.grid import Grid
from regkit.spatial.pyramid import build_pyramid
from regkit.spatial.sampling import sample_image
from regkit.transform import Transformation

__all__ = ["Level", "RunContext", "loss_on_level", "optimize_level"]

OptimizedStage = RigidStage | AffineStage | CpabStage


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
class Level:
    """One pyramid level of both images (and masks) on the device."""

    fixed: torch.Tensor  # (1, 1, *fixed_grid.shape)
    fixed_grid: Grid
    moving: torch.Tensor  # (1, *moving_grid.shape): one channel, as sample_image takes it
    moving_grid: Grid
    fixed_mask: torch.Tensor | None  # (1, 1, *fixed_grid.shape)
    moving_mask: torch.Tensor | None  # (1, *moving_grid.shape)
    fixed_world: torch.Tensor  # (*fixed_grid.shape, n) world points of the fixed voxels


class RunContext:
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
        self._levels: dict[tuple, list[Level]] = {}

    def levels(self, stage: OptimizedStage) -> list[Level]:
        """The stage's pyramid, coarse to fine; masks use the stage's mask flags. Built once per pyramid and mask
        flags (stages with the same pyramid share it: smoothing a 3D image takes seconds on the CPU)."""
        spec = [(level.shrink, level.smoothing) for level in stage.pyramid]
        key = (tuple(spec), stage.mask.fixed, stage.mask.moving)
        if key not in self._levels:
            self._levels[key] = self._build_levels(stage, spec)
        return self._levels[key]

    def _build_levels(self, stage: OptimizedStage, spec: list[tuple[int, float]]) -> list[Level]:
        fixed = build_pyramid(self.fixed_t[None, None], self.fixed.grid, spec)
        moving = build_pyramid(self.moving_t[None, None], self.moving.grid, spec)
        no_smoothing = [(shrink, 0.0) for shrink, _ in spec]
        fmask = mmask = None
        if self.fixed_mask is not None and stage.mask.fixed:
            fmask = build_pyramid(self.fixed_mask[None, None], self.fixed.grid, no_smoothing)
        if self.moving_mask is not None and stage.mask.moving:
            mmask = build_pyramid(self.moving_mask[None, None], self.moving.grid, no_smoothing)
        return [
            Level(
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
        snapshots = [flow.with_theta(flow.theta.detach()).requires_grad_(False) for flow in flows]
        self.on_level(Transformation(self.fixed.grid, np.asarray(matrix, dtype=np.float64), snapshots))


def loss_on_level(level: Level, similarity: Similarity, moving_points: torch.Tensor) -> torch.Tensor:
    """Similarity between the fixed image and the moving image sampled at ``moving_points`` (world, fixed grid);
    the similarity does the sampling (``Similarity.loss_at_points``: the features similarity may warp features)."""
    mask = level.fixed_mask
    if level.moving_mask is not None:
        moved_mask = sample_image(level.moving_mask, level.moving_grid, moving_points.detach())[None]
        mask = moved_mask if mask is None else mask * moved_mask
    return similarity.loss_at_points(level.fixed, level.moving, level.moving_grid, moving_points, mask)


def _divergence_cause(ctx: RunContext, stage_index: int, iteration: int) -> str:
    """What a non-finite loss most likely means: at a level's first iteration the objective itself cannot be evaluated
    (no step has been taken yet); later, the steps were too large."""
    if iteration == 1:
        masks = ctx.fixed_mask is not None or ctx.moving_mask is not None
        where = "the masks leave no voxel where both images overlap, or " if masks else ""
        hint = "; try dtype: float64" if ctx.dtype != torch.float64 else ""
        return f"the loss is not finite before any step: {where}the similarity is undefined on these images{hint}"
    return f"the loss became not finite; lower stages[{stage_index}].optimizer.learning_rate"


def optimize_level(
    ctx: RunContext,
    stage_index: int,
    stage: OptimizedStage,
    level_index: int,
    n_levels: int,
    parameters: list[torch.nn.Parameter],
    objective: Objective,
    cells: tuple[int, ...] | None = None,
    adam_scale: float = 1.0,
) -> LevelReport:
    """Run the stage's optimizer on one level; ``objective() -> (loss, similarity)``. Returns the level's report.
    Adam's learning rate is the configured one times ``adam_scale``; on CUDA (``cuda_graphs`` in the configuration)
    its iterations after :data:`~regkit.registration.steps.WARMUP` are replayed from a CUDA graph."""
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
                + _divergence_cause(ctx, stage_index, iteration)
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
    return LevelReport(
        level=level_index,
        iterations=iteration,
        similarity=similarity,
        loss=loss,
        seconds=round(time.perf_counter() - start, 3),
        cuda_graph=graph is not None and graph.captured,
        cells=cells,
    )

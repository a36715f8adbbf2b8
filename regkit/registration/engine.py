"""``register(fixed, moving, config)``: the loop over a configuration's stages.

Both images live in world space (LPS millimetres) with their own grids; nothing is resampled to a common grid first.
The result is a :class:`~regkit.transform.Transformation` in the pull-back direction: it maps a fixed world point to
the moving world point where the moving image is sampled, ``y = M phi_K(...phi_1(x))``.

Stages run in the configured order, each starting where the previous one ended:

* ``moments``: ``M`` from the images' centres of mass (and principal axes);
* ``rigid`` / ``affine``: ``M <- M @ P`` with ``P`` a centred rigid / affine map optimized over the pyramid
  (:func:`~regkit.registration.stages.run_linear`);
* ``cpab``: CPAB flows on the fixed grid's box, optimized over the pyramid with the tessellation schedule, composed
  after the earlier flows (:func:`~regkit.registration.stages.run_cpab`, whose module says how).

Each level is optimized with Adam or L-BFGS (:func:`~regkit.registration.levels.optimize_level`) on the images
rescaled to [0, 1] between their 0.5th and 99.5th percentiles.

On CUDA, Adam iterations after the third of each level are replayed from a CUDA graph (:mod:`regkit.registration.steps`;
``cuda_graphs`` in the configuration): the host, not the GPU, bounds an eager iteration. Every objective must
therefore stay capture-safe: no host synchronisation, no host-to-device copy (tests/regkit/registration/test_steps.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from regkit import process
from regkit.config import CpabStage, MomentsStage, RegistrationConfig, default_config
from regkit.cpab.module import CPAB
from regkit.errors import ImageDimensionError, RegkitError
from regkit.io import Image
from regkit.registration.levels import RunContext
from regkit.registration.progress import Progress
from regkit.registration.result import RegistrationResult, StageReport
from regkit.registration.stages import linear_map_problem, run_cpab, run_linear
from regkit.spatial.affine import moments_init
from regkit.transform import Transformation

__all__ = ["MIN_VOXELS", "check_image_size", "register", "resolve_device"]

MIN_VOXELS = 4
"""The fewest voxels along any axis of an image that :func:`register` accepts (a smaller image has too little
structure to fix an affine map, and no central difference inside)."""


def check_image_size(image: Image, name: str) -> None:
    """Raise ImageDimensionError naming the image (``name``: its file, or which image it is) if it has fewer than
    :data:`MIN_VOXELS` voxels along an axis."""
    if min(image.grid.size) < MIN_VOXELS:
        size = " x ".join(map(str, image.grid.size))
        raise ImageDimensionError(
            f"{name} has {size} voxels; registration needs at least {MIN_VOXELS} along every axis"
        )


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else the CPU; ``cuda`` without a GPU is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RegkitError(f"device '{name}' requested but no CUDA device is available; use --device cpu")
    return device


def register(
    fixed: Image,
    moving: Image,
    config: RegistrationConfig | None = None,
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
        config: the registration configuration (``regkit.config.load_config``); None: the default one for the images'
            dimension (``regkit.config.default_config``), as ``regkit register`` runs it without ``--config``.
        fixed_mask, moving_mask: optional masks on the images' grids; non-zero voxels count in the similarity.
        device: overrides ``config.device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"auto"``).
        progress: called after every optimizer iteration with a :class:`~regkit.registration.progress.Progress`.
        should_stop: polled before every iteration; returning True raises
            :class:`~regkit.registration.progress.Cancelled`.
        on_level: called after every pyramid level of every rigid, affine and CPAB stage with the whole
            transformation reached so far (earlier stages included; fixed world -> moving world), e.g. to preview the
            warped image. Its CPAB flows are copies on the computation device; later levels do not change them.

    Returns:
        A :class:`~regkit.registration.result.RegistrationResult` whose ``transform`` maps fixed world points to
        moving world points.

    Raises:
        ImageDimensionError: the images differ in dimension, or one has fewer than :data:`MIN_VOXELS` voxels along
            an axis, or the configuration is for another dimension.

    The first call tunes the process's allocator as the ``regkit`` commands do (``regkit.process``; opt out with
    ``REGKIT_PROCESS_SETTINGS=0``).
    """
    process.tune_allocator()
    if fixed.ndim != moving.ndim:
        raise ImageDimensionError(f"the fixed image is {fixed.ndim}D but the moving image is {moving.ndim}D")
    if config is None:
        config = default_config(fixed.ndim)
    if config.dim is not None and config.dim != fixed.ndim:
        raise ImageDimensionError(f"the configuration is for {config.dim}D images but the images are {fixed.ndim}D")
    check_image_size(fixed, "the fixed image")
    check_image_size(moving, "the moving image")
    dev = resolve_device(str(device) if device is not None else config.device)
    torch.manual_seed(config.seed)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    ctx = RunContext(fixed, moving, config, fixed_mask, moving_mask, dev, progress, should_stop, on_level)
    n = fixed.ndim
    matrix = np.eye(n + 1)
    flows: list[CPAB] = []
    reports: list[StageReport] = []
    for index, stage in enumerate(config.stages):
        if isinstance(stage, MomentsStage):
            begin = time.perf_counter()
            found = moments_init(ctx.fixed_t, fixed.grid, ctx.moving_t, moving.grid, mode=stage.mode).cpu().numpy()
            report = StageReport(stage.type, seconds=round(time.perf_counter() - begin, 3))
            problem = linear_map_problem(found)
            if problem is None:
                matrix = found
            else:
                report.warning = f"the moments stage {problem}; the result of the earlier stages is kept"
            reports.append(report)
        elif isinstance(stage, CpabStage):
            new_flows, report = run_cpab(ctx, index, stage, matrix, flows)
            flows.extend(new_flows)
            reports.append(report)
        else:
            matrix, report = run_linear(ctx, index, stage, matrix, flows)
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
        fixed_mask=fixed_mask,
    )

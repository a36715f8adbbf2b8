"""The ``regkit`` command line. Heavy imports (torch, SimpleITK, ...) happen inside the commands so --help is instant.

Every command runs through :func:`main`, which turns a :class:`regkit.errors.RegkitError` (and a few OS errors) into one
line on stderr and exit code 1; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from regkit.process import configure_process

configure_process()  # before torch is imported, which the commands do lazily

if TYPE_CHECKING:
    from rich.progress import TaskID

    from regkit.engine import Progress as RegistrationProgress

app = typer.Typer(
    name="regkit",
    help="Fast, fold-free registration of 2D images and 3D medical volumes with CPAB transformations.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_state = {"debug": False}


def _version_callback(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"regkit {version('regkit')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version and exit.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show the full traceback on errors.")] = False,
) -> None:
    _state["debug"] = debug


@app.command()
def info(
    image: Annotated[
        Path, typer.Argument(help="Image file (.nii, .nii.gz, .mha, .mhd, .nrrd, .nhdr, .png) or DICOM folder.")
    ],
):
    """Print an image's size, spacing, origin, direction, orientation code, dtype and value range."""
    from regkit.io import describe_image, read_image

    img = read_image(image, check_finite=False)
    for key, value in describe_image(img).items():
        typer.echo(f"{key:<12} {value}")


@app.command("check-config")
def check_config(
    config: Annotated[str, typer.Argument(help="A YAML file or the name of a preset (e.g. brain-mri-3d).")],
    show: Annotated[bool, typer.Option("--show", help="Print the resolved configuration as YAML.")] = False,
):
    """Validate a registration configuration (file or preset); print the resolved configuration with --show."""
    from regkit.config import dump_config, load_config

    cfg = load_config(config)
    if show:
        typer.echo(dump_config(cfg), nl=False)
    else:
        typer.echo(f"{config}: valid")


class Interpolation(str, Enum):
    """Resampling interpolation: linear for intensities, nearest for label maps."""

    linear = "linear"
    nearest = "nearest"


class ExportFormat(str, Enum):
    """Displacement-field conventions that ``regkit export`` writes."""

    learn2reg = "learn2reg"


class _RichProgress:
    """Per-iteration progress of a registration on stderr: one bar per stage and pyramid level."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("similarity {task.fields[similarity]:.5f}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
        )
        self.task: TaskID | None = None
        self.key: tuple[int, int] | None = None

    def __enter__(self) -> _RichProgress:
        self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._finish()
        self.bars.stop()

    def _finish(self) -> None:
        if self.task is not None:  # a level that stopped early: show it complete
            self.bars.update(self.task, total=self.bars.tasks[-1].completed)

    def __call__(self, p: RegistrationProgress) -> None:
        if self.task is None or self.key != (p.stage, p.level):
            self._finish()
            cells = f" {'x'.join(map(str, p.cells))} cells" if p.cells else ""
            description = f"stage {p.stage + 1}/{p.n_stages} {p.kind:<6} level {p.level + 1}/{p.n_levels}{cells}"
            self.task = self.bars.add_task(description, total=p.max_iterations, similarity=p.similarity)
            self.key = (p.stage, p.level)
        self.bars.update(self.task, completed=p.iteration, similarity=p.similarity)


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _summary(out: Path, metrics: dict) -> list[str]:
    """The key metrics of ``metrics.json`` as short lines for the terminal."""
    lines = [f"outputs: {out}"]
    for name, values in metrics["similarity"].items():
        before, after = _num(values["before"], ".4g"), _num(values["after"], ".4g")
        lines.append(f"similarity {name} (loss, lower is better): {before} -> {after}")
    labels = metrics.get("labels")
    if labels and labels["mean_dice_after"] is not None:
        hd95 = labels["mean_hd95_after_mm"]
        lines.append(
            f"Dice (mean of {len(labels['labels'])} labels): {_num(labels['mean_dice_before'], '.3f')} -> "
            f"{labels['mean_dice_after']:.3f}; HD95 {_num(hd95, '.2f')} mm"
        )
    jac = metrics["jacobian"]
    if jac["fraction_nonpositive"] is not None:
        lines.append(
            f"Jacobian: {jac['fraction_nonpositive']:.2g} non-positive, SDlogJ {_num(jac['sdlogj'], '.3f')}, "
            f"analytic det in [{_num(jac['analytic_min'], '.3f')}, {_num(jac['analytic_max'], '.3f')}]"
        )
    runtime = metrics["runtime"]
    stages = ", ".join(f"{s['kind']} {s['seconds']:.1f} s" for s in runtime["stages"])
    memory = metrics["peak_memory"]["bytes"]
    peak = f"; peak memory {memory / 2**20:.0f} MiB" if memory else ""
    lines.append(f"runtime: {runtime['total_seconds']:.1f} s ({stages}) on {metrics['device']}{peak}")
    return lines


@app.command()
def register(
    fixed: Annotated[Path, typer.Argument(help="Fixed image: the grid and world space of the outputs.")],
    moving: Annotated[Path, typer.Argument(help="Moving image: registered to the fixed image.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output folder; must not exist unless --overwrite.")],
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            "-c",
            help="A preset name or a YAML file; default: brain-mri-3d for 3D images, histology-2d for 2D images.",
        ),
    ] = None,
    moving_labels: Annotated[
        Path | None, typer.Option(help="Label map of the moving image (integers); warped into warped_labels.nii.gz.")
    ] = None,
    fixed_labels: Annotated[
        Path | None,
        typer.Option(help="Label map of the fixed image; with --moving-labels, Dice and HD95 are reported."),
    ] = None,
    fixed_mask: Annotated[
        Path | None, typer.Option(help="Mask on the fixed grid; only its non-zero voxels count in the similarity.")
    ] = None,
    moving_mask: Annotated[
        Path | None, typer.Option(help="Mask on the moving grid; only its non-zero voxels count in the similarity.")
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(help="cpu, cuda, cuda:N or auto (a GPU if there is one); default: the configuration's."),
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Random seed; default: the configuration's.")] = None,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Replace an existing output folder (an empty one, or an earlier output)."),
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors (for scripts).")] = False,
):
    """Register MOVING to FIXED and write the outputs into the folder OUTPUT (fixed file names):

    warped.nii.gz, warped_labels.nii.gz (with --moving-labels): on the fixed grid;
    displacement.nii.gz (fixed grid), inverse_displacement.nii.gz (moving grid): ITK fields, LPS mm;
    affine.mat, transform.h5 (ITK composite), transform.json (exact, for apply/invert/export);
    jacobian.nii.gz, metrics.json, config.yaml, qc.png.
    The folder appears only when complete: an error or Ctrl-C leaves none.
    """
    import json

    import torch

    from regkit._backend import announce_compiles
    from regkit.config import DEFAULT_PRESETS, load_config
    from regkit.engine import register as run_registration
    from regkit.errors import RegkitError
    from regkit.io import read_registration_inputs
    from regkit.results import OUTPUT_FILES, check_output_dir, field_of_view_overlap, write_outputs

    check_output_dir(output, overwrite)
    inputs = read_registration_inputs(
        fixed,
        moving,
        fixed_labels=fixed_labels,
        moving_labels=moving_labels,
        fixed_mask=fixed_mask,
        moving_mask=moving_mask,
    )
    fixed_image, moving_image = inputs.fixed, inputs.moving
    overrides = {key: value for key, value in (("device", device), ("seed", seed)) if value is not None}
    cfg = load_config(config or DEFAULT_PRESETS[fixed_image.ndim], overrides=overrides)
    if field_of_view_overlap(fixed_image.grid, moving_image.grid) == 0:
        typer.echo(
            f"warning: {fixed} and {moving} do not overlap in world space (LPS mm); the registration relies on its "
            "initialisation (a moments stage) to bring them together",
            err=True,
        )
    try:
        if quiet:
            result = run_registration(
                fixed_image, moving_image, cfg, fixed_mask=inputs.fixed_mask, moving_mask=inputs.moving_mask
            )
        else:
            with _RichProgress() as progress, announce_compiles(progress.bars.console.print):
                result = run_registration(
                    fixed_image,
                    moving_image,
                    cfg,
                    fixed_mask=inputs.fixed_mask,
                    moving_mask=inputs.moving_mask,
                    progress=progress,
                )
        write_outputs(
            result,
            output,
            moving_labels=inputs.moving_labels,
            fixed_labels=inputs.fixed_labels,
            overwrite=overwrite,
        )
    except KeyboardInterrupt:
        typer.echo(f"interrupted: nothing was written to {output}", err=True)
        raise typer.Exit(130) from None
    except torch.cuda.OutOfMemoryError as err:
        raise RegkitError(
            f"out of GPU memory on {cfg.device}: use a smaller tessellation or fewer full-resolution pyramid levels "
            "in the configuration, or run on the CPU with --device cpu"
        ) from err
    if not quiet:
        metrics = json.loads((output / OUTPUT_FILES["metrics"]).read_text())
        for line in _summary(output, metrics):
            typer.echo(line)


def _load_transform(source: Path):
    """The transformation in ``source``: a result folder (its transform.json) or a transform.json file."""
    from regkit.transform import Transformation

    return Transformation.load(source / "transform.json" if source.is_dir() else source)


def _moving_grid(source: Path, reference: Path | None):
    """The moving grid: ``reference``'s, else the one recorded beside the transformation (metrics.json)."""
    from regkit.io import read_image
    from regkit.results import read_moving_grid

    if reference is not None:
        return read_image(reference).grid
    return read_moving_grid(source if source.is_dir() else source.parent)


@app.command()
def apply(
    transform: Annotated[
        Path, typer.Argument(help="transform.json (regkit) or an ITK transform file such as transform.h5.")
    ],
    image: Annotated[Path, typer.Argument(help="Image or label map in the moving image's world space.")],
    reference: Annotated[Path, typer.Option("--reference", "-r", help="Image whose grid the output takes.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output image file (.nii.gz, .mha, .nrrd, ...).")],
    interp: Annotated[
        Interpolation, typer.Option(help="linear for intensities (float output), nearest for label maps (type kept).")
    ] = Interpolation.linear,
):
    """Resample IMAGE onto REFERENCE's grid through a saved transformation (pull-back: out(x) = image(T(x)))."""
    from regkit.io import apply_itk_transform, read_image, write_image
    from regkit.results import resample

    source = read_image(image)
    grid = read_image(reference).grid
    if transform.suffix == ".json":
        result = resample(_load_transform(transform), source, grid, mode=interp.value)
    else:
        result = apply_itk_transform(transform, source, grid, mode=interp.value)
    write_image(result, output)


@app.command()
def invert(
    source: Annotated[Path, typer.Argument(help="A result folder of `regkit register`, or its transform.json.")],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Output displacement file (.nii.gz: ITK vector NIfTI).")
    ],
    reference: Annotated[
        Path | None,
        typer.Option(
            "--reference", "-r", help="Image whose grid the inverse is evaluated on; default: the recorded moving grid."
        ),
    ] = None,
):
    """Write the inverse transformation as an ITK displacement field on the moving grid (moving -> fixed, LPS mm)."""
    from regkit.io import write_displacement

    grid = _moving_grid(source, reference)
    write_displacement(_load_transform(source).inverse_displacement(grid), grid, output)


@app.command()
def jacobian(
    source: Annotated[Path, typer.Argument(help="A result folder of `regkit register`, or its transform.json.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output image file (float32 determinant).")],
):
    """Write the analytic Jacobian determinant of the transformation on the fixed grid."""
    from regkit.io import Image, write_image

    transform = _load_transform(source)
    write_image(Image(transform.jacobian_determinant(), transform.fixed_grid), output)


def _case_id(value: str) -> str:
    return value.zfill(4) if value.isdigit() else value


@app.command()
def export(
    source: Annotated[Path, typer.Argument(help="A result folder of `regkit register`, or its transform.json.")],
    output: Annotated[
        Path,
        typer.Option(
            "--output",
            "-o",
            help="A .nii.gz file, or a folder that receives disp_FIXED_MOVING.nii.gz (needs --fixed-id, --moving-id).",
        ),
    ],
    fmt: Annotated[ExportFormat, typer.Option("--format", help="The convention to write.")] = ExportFormat.learn2reg,
    fixed_id: Annotated[
        str | None, typer.Option(help="Case id of the fixed image in the file name (digits padded to 4).")
    ] = None,
    moving_id: Annotated[
        str | None, typer.Option(help="Case id of the moving image in the file name (digits padded to 4).")
    ] = None,
    reference: Annotated[
        Path | None,
        typer.Option("--reference", "-r", help="The moving image (its grid); default: the recorded moving grid."),
    ] = None,
):
    """Export the transformation in another tool's convention.

    learn2reg: NIfTI X x Y x Z x 3, voxel units: fixed voxel (i, j, k) -> moving voxel (i, j, k) + disp;
    named disp_FIXED_MOVING.nii.gz with 4-digit case ids, as Learn2Reg's evaluation reads them.
    """
    from regkit.errors import RegkitError
    from regkit.io import write_learn2reg

    path = output
    if not output.name.endswith((".nii.gz", ".nii")):
        if fixed_id is None or moving_id is None:
            raise RegkitError(f"{output} is a folder: give --fixed-id and --moving-id, or an output file name .nii.gz")
        output.mkdir(parents=True, exist_ok=True)
        path = output / f"disp_{_case_id(fixed_id)}_{_case_id(moving_id)}.nii.gz"
    write_learn2reg(_load_transform(source), _moving_grid(source, reference), path)
    typer.echo(str(path))


# `regkit demo` (apps/regkit_cli/demo.py) is registered here, after the registration commands:
from regkit_cli.demo import demo as _demo  # noqa: E402

app.command("demo")(_demo)

from regkit_cli.batch import batch as _batch  # noqa: E402

app.command("batch")(_batch)

from regkit_cli.train import train_features as _train_features  # noqa: E402

app.command("train-features")(_train_features)


def _error_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script: run the typer app, printing user errors on one line (exit code 1)."""
    from regkit.errors import RegkitError

    try:
        code = app(args=argv, standalone_mode=False)  # a typer.Exit raised in a command comes back as its code
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("Aborted.", err=True)
        sys.exit(130)
    except typer.TyperException as exc:  # usage errors (typer >= 0.29 bundles click; its exceptions subclass this)
        exc.show()  # type: ignore[attr-defined]
        sys.exit(exc.exit_code)
    except Exception as exc:  # RegkitError, OS errors
        if _state["debug"] or not isinstance(exc, RegkitError | OSError | MemoryError):
            raise
        typer.echo(f"error: {_error_line(exc)}", err=True)
        sys.exit(1)
    if isinstance(code, int) and code != 0:
        sys.exit(code)


if __name__ == "__main__":
    main()

"""``regkit register FIXED MOVING -o OUTPUT``: register a pair and write the result folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

FAILED_CHECKS = 3
"""The exit code of a registration that finished but whose result failed the checks of ``metrics.json``
(``failed_checks``: folds, a non-finite Jacobian, a similarity worse than no registration)."""


def register(
    fixed: Annotated[Path, typer.Argument(help="Fixed image: the grid and world space of the outputs.")],
    moving: Annotated[Path, typer.Argument(help="Moving image: registered to the fixed image.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output folder; must not exist unless --overwrite.")],
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            "-c",
            help="A preset name or a YAML file; default: brain-mri-3d for 3D images, image-2d for 2D images (both "
            "detect multi-modal pairs).",
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
) -> None:
    """Register MOVING to FIXED and write the outputs into the folder OUTPUT (fixed file names):

    warped.nii.gz, warped_labels.nii.gz (with --moving-labels): on the fixed grid;
    displacement.nii.gz (fixed grid), inverse_displacement.nii.gz (moving grid): ITK fields, LPS mm;
    affine.mat, transform.h5 (ITK composite), transform.json (exact, for apply/invert/export);
    jacobian.nii.gz, metrics.json, config.yaml, qc.png.
    The folder appears only when complete: an error or Ctrl-C leaves none. Exit code 3: the result was written but
    failed its checks (metrics.json's failed_checks).
    """
    import json

    import torch

    from regkit.config import DEFAULT_PRESETS, load_config
    from regkit.errors import RegkitError
    from regkit.io import read_registration_inputs
    from regkit.process import announce_compiles
    from regkit.registration import check_image_size
    from regkit.registration import register as run_registration
    from regkit.results import OUTPUT_FILES, check_output_dir, field_of_view_overlap, write_outputs
    from regkit_cli.terminal import RegistrationBar, summary_lines

    given = (fixed, moving, fixed_labels, moving_labels, fixed_mask, moving_mask)  # never written over
    check_output_dir(output, overwrite, inputs=given)
    inputs = read_registration_inputs(
        fixed,
        moving,
        fixed_labels=fixed_labels,
        moving_labels=moving_labels,
        fixed_mask=fixed_mask,
        moving_mask=moving_mask,
    )
    fixed_image, moving_image = inputs.fixed, inputs.moving
    check_image_size(fixed_image, str(fixed))
    check_image_size(moving_image, str(moving))
    overrides = {key: value for key, value in (("device", device), ("seed", seed)) if value is not None}
    source = config or DEFAULT_PRESETS[fixed_image.ndim]
    cfg = load_config(source, overrides=overrides)
    if not quiet:
        why = "" if config else f" (the default for {fixed_image.ndim}D images; --config chooses another)"
        typer.echo(f"configuration: {source}{why}")
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
            with RegistrationBar() as progress, announce_compiles(progress.bars.console.print):
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
            inputs=given,
        )
    except torch.cuda.OutOfMemoryError as err:
        raise RegkitError(
            f"out of GPU memory on {cfg.device}: use a smaller tessellation or fewer full-resolution pyramid levels "
            "in the configuration, or run on the CPU with --device cpu"
        ) from err
    metrics = json.loads((output / OUTPUT_FILES["metrics"]).read_text())
    if not quiet:
        for line in summary_lines(output, metrics):
            typer.echo(line)
    if metrics["failed_checks"]:
        typer.echo(
            f"error: the result failed its checks ({'; '.join(metrics['failed_checks'])}); its files in {output} are "
            "kept for inspection",
            err=True,
        )
        raise typer.Exit(FAILED_CHECKS)

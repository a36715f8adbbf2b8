"""``regkit apply TRANSFORM IMAGE -r REFERENCE -o OUTPUT``: resample an image through a saved transformation."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from regkit_cli.options import Overwrite


class Interpolation(str, Enum):
    """Resampling interpolation: linear for intensities, nearest for label maps."""

    linear = "linear"
    nearest = "nearest"


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
    overwrite: Overwrite = False,
) -> None:
    """Resample IMAGE onto REFERENCE's grid through a saved transformation (pull-back: out(x) = image(T(x)))."""
    from regkit.io import apply_itk_transform, read_image, write_image
    from regkit.results import check_output_file, resample
    from regkit_cli.transforms import check_dimension, load_transform

    check_output_file(output, overwrite, inputs=[transform, image, reference])
    source = read_image(image)
    grid = read_image(reference).grid
    if transform.suffix == ".json":
        saved = load_transform(transform)
        check_dimension(saved, transform, image, source.ndim)
        check_dimension(saved, transform, reference, grid.ndim)
        result = resample(saved, source, grid, mode=interp.value)
    else:
        result = apply_itk_transform(transform, source, grid, mode=interp.value)
    write_image(result, output)

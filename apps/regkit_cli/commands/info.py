"""``regkit info IMAGE``: an image's geometry, orientation code, dtype and value range."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def info(
    image: Annotated[
        Path, typer.Argument(help="Image file (.nii, .nii.gz, .mha, .mhd, .nrrd, .nhdr, .png) or DICOM folder.")
    ],
) -> None:
    """Print an image's size, spacing, origin, direction, orientation code, dtype and value range."""
    from regkit.io import describe_image, read_image

    img = read_image(image, check_finite=False)
    for key, value in describe_image(img).items():
        typer.echo(f"{key:<12} {value}")

"""``regkit invert SOURCE -o OUTPUT``: the inverse transformation as an ITK displacement field."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from regkit_cli.options import Overwrite


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
    overwrite: Overwrite = False,
) -> None:
    """Write the inverse transformation as an ITK displacement field on the moving grid (moving -> fixed, LPS mm)."""
    from regkit.io import write_displacement
    from regkit.results import check_output_file
    from regkit_cli.transforms import load_transform, moving_grid, source_files

    check_output_file(output, overwrite, inputs=source_files(source, reference))
    transform = load_transform(source)
    grid = moving_grid(source, reference, transform)
    write_displacement(transform.inverse_displacement(grid), grid, output)

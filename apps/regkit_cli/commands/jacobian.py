"""``regkit jacobian SOURCE -o OUTPUT``: the analytic Jacobian determinant of a saved transformation."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from regkit_cli.options import Overwrite


def jacobian(
    source: Annotated[Path, typer.Argument(help="A result folder of `regkit register`, or its transform.json.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output image file (float32 determinant).")],
    overwrite: Overwrite = False,
) -> None:
    """Write the analytic Jacobian determinant of the transformation on the fixed grid."""
    from regkit.io import Image, write_image
    from regkit.results import check_output_file
    from regkit_cli.transforms import load_transform, source_files

    check_output_file(output, overwrite, inputs=source_files(source))
    transform = load_transform(source)
    write_image(Image(transform.jacobian_determinant(), transform.fixed_grid), output)

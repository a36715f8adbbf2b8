"""``regkit jacobian SOURCE -o OUTPUT``: the analytic Jacobian determinant of a saved transformation."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def jacobian(
    source: Annotated[Path, typer.Argument(help="A result folder of `regkit register`, or its transform.json.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output image file (float32 determinant).")],
) -> None:
    """Write the analytic Jacobian determinant of the transformation on the fixed grid."""
    from regkit.io import Image, write_image
    from regkit_cli.transforms import load_transform

    transform = load_transform(source)
    write_image(Image(transform.jacobian_determinant(), transform.fixed_grid), output)

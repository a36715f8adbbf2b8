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


def moving_grid(source: Path, reference: Path | None, transform: Transformation) -> Grid:
    """The moving grid of ``transform`` (loaded from ``source``): ``reference``'s, else the one recorded beside the
    transformation (metrics.json); of the transformation's dimension (:func:`check_dimension`)."""
    from regkit.io import read_image
    from regkit.results import read_moving_grid

    if reference is not None:
        grid = read_image(reference).grid
        check_dimension(transform, source, reference, grid.ndim)
        return grid
    return read_moving_grid(source if source.is_dir() else source.parent)


def check_dimension(transform: Transformation, source: Path, path: Path, ndim: int) -> None:
    """Raise ImageDimensionError naming ``path`` if its image (``ndim``-D) is not of the dimension of ``transform``
    (loaded from ``source``)."""
    from regkit.errors import ImageDimensionError

    if ndim != transform.fixed_grid.ndim:
        raise ImageDimensionError(
            f"{path}: the image is {ndim}D but the transformation in {source} is {transform.fixed_grid.ndim}D"
        )

"""The images of one registration, read and checked together: fixed, moving, and optional label maps and masks.

All images keep their own grids (LPS millimetres, ``[z, y, x]`` tensors); the checks are that every image has the
fixed image's dimension and that label maps hold integer labels.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from regkit.errors import ImageDimensionError, ImageValueError
from regkit.io.files import read_image
from regkit.io.image import Image

__all__ = ["RegistrationInputs", "as_label_map", "read_registration_inputs"]


def as_label_map(image: Image, name: str) -> Image:
    """``image`` as an integer label map: integer types unchanged, floats holding only integer values converted to
    int64 (label maps are often stored as float NIfTI); other floats raise :class:`ImageValueError` naming ``name``."""
    data = image.data
    if not data.is_floating_point():
        return image
    bad = ~torch.isfinite(data) | (data != data.round())
    if bool(bad.any()):
        example = float(data[bad][0])
        raise ImageValueError(
            f"{name} holds non-integer values (e.g. {example:g} at {int(bad.sum())} voxels); a label map must hold "
            "integer labels"
        )
    return Image(data.to(torch.int64), image.grid)


@dataclasses.dataclass(frozen=True)
class RegistrationInputs:
    """The images of one registration, read and checked by :func:`read_registration_inputs`."""

    fixed: Image
    moving: Image
    fixed_labels: Image | None = None
    moving_labels: Image | None = None
    fixed_mask: Image | None = None
    moving_mask: Image | None = None


def read_registration_inputs(
    fixed: str | os.PathLike,
    moving: str | os.PathLike,
    *,
    fixed_labels: str | os.PathLike | None = None,
    moving_labels: str | os.PathLike | None = None,
    fixed_mask: str | os.PathLike | None = None,
    moving_mask: str | os.PathLike | None = None,
) -> RegistrationInputs:
    """Read the images of one registration (the CLI's ``register`` and every batch job): all must have the fixed
    image's dimension and masks their image's size (:class:`ImageDimensionError` naming the files), and label maps
    must hold integer labels (:func:`as_label_map`)."""
    fixed_image, moving_image = read_image(fixed), read_image(moving)
    if fixed_image.ndim != moving_image.ndim:
        raise ImageDimensionError(f"{fixed} is {fixed_image.ndim}D but {moving} is {moving_image.ndim}D")
    optional: dict[str, Image | None] = {}
    for key, path in (
        ("fixed_labels", fixed_labels),
        ("moving_labels", moving_labels),
        ("fixed_mask", fixed_mask),
        ("moving_mask", moving_mask),
    ):
        image = None if path is None else read_image(path)
        if image is not None and image.ndim != fixed_image.ndim:
            raise ImageDimensionError(f"{path} is {image.ndim}D but the images are {fixed_image.ndim}D")
        if image is not None and key.endswith("_mask"):
            owner, owner_path = (fixed_image, fixed) if key == "fixed_mask" else (moving_image, moving)
            if image.grid.size != owner.grid.size:
                sizes = [" x ".join(map(str, grid.size)) for grid in (image.grid, owner.grid)]
                raise ImageDimensionError(
                    f"{path}: the mask has {sizes[0]} voxels but {owner_path} has {sizes[1]}; a mask is on its "
                    "image's grid"
                )
        optional[key] = as_label_map(image, str(path)) if image is not None and key.endswith("_labels") else image
    return RegistrationInputs(fixed_image, moving_image, **optional)

"""The plugin's reader, writers and sample data (npe2 commands, see ``napari.yaml``), and napari layers as regkit
images (:func:`layer_image`, :func:`registration_inputs`), built on :mod:`regkit.io`.

Layers are placed in the napari world of :mod:`napari_regkit._logic`: LPS millimetres in (z, y, x) order, with the
``affine`` of :func:`~napari_regkit._logic.napari_affine` mapping the data coordinates ``(k, j, i)`` to it, so oblique
and flipped (LAS, RAS, ...) images keep their physical position and overlay correctly. napari is not imported here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import SimpleITK as sitk
import torch

from napari_regkit._logic import grid_from_napari_affine, napari_affine
from regkit.errors import ImageDimensionError, ImageValueError
from regkit.io import SUPPORTED_EXTENSIONS, Image, RegistrationInputs, as_label_map, read_image, write_image

if TYPE_CHECKING:
    from napari.types import LayerData

    from regkit.demo import DemoPair

__all__ = [
    "demo_pair_layers",
    "image_layer",
    "layer_image",
    "layer_name",
    "napari_get_reader",
    "pair_layers",
    "read_layers",
    "registration_inputs",
    "write_image_layer",
]

# Integer images with at most this many distinct values open as Labels layers.
MAX_LABELS = 1000
_READER_EXTENSIONS = tuple(ext for ext in SUPPORTED_EXTENSIONS if ext != ".png")


def _is_dicom_folder(path: Path) -> bool:
    return path.is_dir() and bool(sitk.ImageSeriesReader.GetGDCMSeriesIDs(str(path)))


def napari_get_reader(path: str | Sequence[str]) -> Callable[[str | Sequence[str]], list[LayerData]] | None:
    """The reader for ``path`` (a NIfTI, MetaImage or NRRD file, a DICOM folder, or a list of them), or None when
    regkit cannot read it, so that napari asks another plugin."""
    paths = [path] if isinstance(path, str | os.PathLike) else list(path)
    for item in map(Path, paths):
        if not (item.name.lower().endswith(_READER_EXTENSIONS) or _is_dicom_folder(item)):
            return None
    return read_layers


def layer_name(path: Path) -> str:
    """A layer's name for the file ``path``: its name without the image extension (``scan.nii.gz`` -> ``scan``)."""
    name = path.name
    for ext in SUPPORTED_EXTENSIONS:
        if name.lower().endswith(ext):
            return name[: -len(ext)]
    return name


def image_layer(image: Image, name: str, labels: bool | None = None) -> LayerData:
    """``(data, {"affine", "name"}, layer type)`` for ``image``: data the ``[z, y, x]`` numpy array, affine from
    :func:`~napari_regkit._logic.napari_affine`. The type is ``"labels"`` if ``labels`` is True, ``"image"`` if
    False; None guesses: integer images with at most ``MAX_LABELS`` distinct values are labels."""
    if labels is None:
        labels = not image.data.is_floating_point() and image.data.unique().numel() <= MAX_LABELS
    return image.data.numpy(), {"affine": napari_affine(image.grid), "name": name}, "labels" if labels else "image"


def read_layers(path: str | Sequence[str]) -> list[LayerData]:
    """Read each file or DICOM folder with :func:`regkit.io.read_image` into one layer (see :func:`image_layer`),
    named after the file without its extension."""
    paths = [path] if isinstance(path, str | os.PathLike) else list(path)
    return [image_layer(read_image(item), layer_name(Path(item))) for item in paths]


def _data_to_world(meta: dict[str, Any], ndim: int) -> np.ndarray:
    """napari's full data-to-world matrix of a layer: ``affine @ translate @ rotate @ shear @ scale``."""

    def homogeneous(linear: np.ndarray | None = None, shift: np.ndarray | None = None) -> np.ndarray:
        m = np.eye(ndim + 1)
        if linear is not None:
            m[:ndim, :ndim] = linear
        if shift is not None:
            m[:ndim, ndim] = shift
        return m

    affine = np.asarray(meta.get("affine", np.eye(ndim + 1)), dtype=np.float64)
    if affine.shape == (ndim, ndim):
        affine = homogeneous(affine)
    shear = np.eye(ndim)
    shear[np.triu_indices(ndim, 1)] = meta.get("shear", np.zeros(ndim * (ndim - 1) // 2))
    return (
        affine
        @ homogeneous(shift=np.asarray(meta.get("translate", np.zeros(ndim)), dtype=np.float64))
        @ homogeneous(np.asarray(meta.get("rotate", np.eye(ndim)), dtype=np.float64))
        @ homogeneous(shear)
        @ homogeneous(np.diag(np.asarray(meta.get("scale", np.ones(ndim)), dtype=np.float64)))
    )


def layer_image(data: Any, meta: dict[str, Any]) -> Image:
    """The :class:`~regkit.io.Image` of an image or labels layer given as napari gives it to writers (``data``, and
    ``meta`` as in ``layer.as_layer_data_tuple()``).

    The geometry is the layer's data-to-world transform (its ``affine`` composed with ``scale``, ``translate``,
    ``rotate`` and ``shear``), read in the napari world of this plugin (LPS (z, y, x)); shear raises
    ``regkit.errors.GeometryError``. Unsigned voxel types torch lacks are widened (uint16 -> int32, uint32/uint64 ->
    int64), booleans become uint8. Multiscale, RGB, empty and other than 2D/3D layers raise
    :class:`~regkit.errors.ImageValueError` or :class:`~regkit.errors.ImageDimensionError` naming the layer.
    """
    name = meta.get("name", "layer")
    if meta.get("multiscale"):
        raise ImageValueError(f"layer '{name}' is multiscale; regkit takes single-scale images")
    if meta.get("rgb"):
        raise ImageValueError(f"layer '{name}' is RGB; regkit takes scalar images")
    array = np.asarray(data)
    if array.ndim not in (2, 3):
        raise ImageDimensionError(f"layer '{name}' is {array.ndim}D; regkit takes 2D and 3D images")
    if array.size == 0:
        raise ImageValueError(f"layer '{name}' is empty (shape {array.shape})")
    if array.dtype == np.bool_:
        array = array.astype(np.uint8)
    elif array.dtype.kind == "u" and array.dtype.itemsize > 1:
        array = array.astype(np.int32 if array.dtype.itemsize == 2 else np.int64)
    grid = grid_from_napari_affine(_data_to_world(meta, array.ndim), array.shape)
    return Image(torch.from_numpy(np.ascontiguousarray(array)), grid)


def write_image_layer(path: str, data: Any, meta: dict[str, Any]) -> list[str]:
    """Write an image or labels layer with :func:`regkit.io.write_image` (geometry and voxel types as
    :func:`layer_image`); the format follows the extension. Returns ``[path]``."""
    return [str(write_image(layer_image(data, meta), path))]


def registration_inputs(
    fixed: LayerData,
    moving: LayerData,
    *,
    moving_labels: LayerData | None = None,
    fixed_mask: LayerData | None = None,
    moving_mask: LayerData | None = None,
) -> RegistrationInputs:
    """The images of a registration from napari layers given as ``layer.as_layer_data_tuple()``
    (:func:`layer_image`), checked: all must have the fixed image's dimension
    (:class:`~regkit.errors.ImageDimensionError`), the images must not be constant and the label and mask layers not
    all zero (:class:`~regkit.errors.ImageValueError`), label maps must hold integer labels
    (:func:`regkit.io.as_label_map`). Messages name the layers."""
    images: dict[str, Image | None] = {}
    for key, layer in (
        ("fixed", fixed),
        ("moving", moving),
        ("moving_labels", moving_labels),
        ("fixed_mask", fixed_mask),
        ("moving_mask", moving_mask),
    ):
        if layer is None:
            images[key] = None
            continue
        data, meta = layer[0], layer[1]
        name = meta.get("name", key)
        image = layer_image(data, meta)
        reference = images.get("fixed")
        if reference is not None and image.ndim != reference.ndim:
            raise ImageDimensionError(
                f"layer '{name}' is {image.ndim}D but the fixed layer '{fixed[1].get('name')}' is {reference.ndim}D"
            )
        if key in ("fixed", "moving"):
            low, high = torch.aminmax(image.data)
            if low == high:
                raise ImageValueError(f"layer '{name}' is empty: every voxel is {float(low):g}")
        elif not bool(image.data.any()):
            raise ImageValueError(f"layer '{name}' is empty: no non-zero voxel")
        images[key] = as_label_map(image, f"layer '{name}'") if key == "moving_labels" else image
    assert images["fixed"] is not None and images["moving"] is not None
    return RegistrationInputs(
        images["fixed"],
        images["moving"],
        moving_labels=images["moving_labels"],
        fixed_mask=images["fixed_mask"],
        moving_mask=images["moving_mask"],
    )


def pair_layers(pair: DemoPair) -> list[LayerData]:
    """The four layers of a demo pair: fixed and moving images, then their label maps (Labels layers)."""
    return [
        image_layer(pair.fixed, "fixed", labels=False),
        image_layer(pair.moving, "moving", labels=False),
        image_layer(pair.fixed_labels, "fixed labels", labels=True),
        image_layer(pair.moving_labels, "moving labels", labels=True),
    ]


def demo_pair_layers() -> list[LayerData]:
    """Sample data: regkit's demo pair (the MNI152 T1 and its deformed copy with new contrast, and their AAL labels),
    see :func:`regkit.demo.demo_pair`."""
    from regkit.demo import demo_pair

    return pair_layers(demo_pair())

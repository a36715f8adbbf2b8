"""napari layers as regkit images: geometry, voxel types and the checks of a registration's inputs (no viewer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from napari_regkit._io import image_layer, layer_image, registration_inputs
from napari_regkit._logic import napari_affine
from regkit.errors import ImageDimensionError, ImageValueError
from regkit.io import Image
from regkit.spatial.grid import Grid


def _layer(data: np.ndarray, name: str, grid: Grid | None = None, kind: str = "image"):
    grid = grid or Grid.create(data.shape[::-1], (1.5,) * data.ndim)
    return data, {"name": name, "affine": napari_affine(grid)}, kind


def test_layer_image_inverts_image_layer() -> None:
    grid = Grid.create((5, 4, 3), (0.5, 1.0, 2.0), (1.0, 2.0, 3.0), np.diag([-1.0, 1.0, -1.0]))
    image = Image(torch.arange(60, dtype=torch.float32).reshape(grid.shape), grid)
    back = layer_image(*image_layer(image, "scan")[:2])
    assert torch.equal(back.data, image.data)
    np.testing.assert_allclose(back.grid.affine(), grid.affine(), atol=1e-12)


def test_layer_image_voxel_types() -> None:
    assert layer_image(np.ones((3, 4), np.uint16), {}).data.dtype == torch.int32
    assert layer_image(np.ones((3, 4), np.uint32), {}).data.dtype == torch.int64
    assert layer_image(np.ones((3, 4), bool), {}).data.dtype == torch.uint8
    assert layer_image(np.ones((3, 4), np.float64), {}).data.dtype == torch.float64


@pytest.mark.parametrize(
    ("data", "meta", "error", "message"),
    [
        (np.zeros((2, 3, 4, 5)), {"name": "movie"}, ImageDimensionError, "layer 'movie' is 4D"),
        (np.zeros((0, 4)), {"name": "none"}, ImageValueError, "layer 'none' is empty"),
        (np.zeros((4, 4, 3)), {"name": "photo", "rgb": True}, ImageValueError, "layer 'photo' is RGB"),
        ([np.zeros((4, 4))], {"name": "pyramid", "multiscale": True}, ImageValueError, "'pyramid' is multiscale"),
    ],
)
def test_layer_image_refuses(data, meta, error, message) -> None:
    with pytest.raises(error, match=message):
        layer_image(data, meta)


def test_registration_inputs_from_layers() -> None:
    fixed = np.random.default_rng(0).random((6, 7)).astype(np.float32)
    labels = np.zeros((6, 7), np.float32)
    labels[2:4, 2:5] = 3
    mask = np.ones((6, 7), np.uint8)
    inputs = registration_inputs(
        _layer(fixed, "f"),
        _layer(fixed * 2, "m"),
        moving_labels=_layer(labels, "l", kind="labels"),
        fixed_mask=_layer(mask, "fm"),
    )
    assert torch.equal(inputs.fixed.data, torch.from_numpy(fixed))
    assert inputs.moving_labels is not None and inputs.moving_labels.data.dtype == torch.int64  # integer-valued float
    assert inputs.fixed_mask is not None and inputs.moving_mask is None and inputs.fixed_labels is None


def test_registration_inputs_refuse_mismatched_and_empty_layers() -> None:
    image = np.random.default_rng(0).random((6, 7))
    with pytest.raises(ImageDimensionError, match="layer 'v' is 3D but the fixed layer 'f' is 2D"):
        registration_inputs(_layer(image, "f"), _layer(np.ones((2, 6, 7)), "v"))
    with pytest.raises(ImageDimensionError, match="layer 'mask' is 3D"):
        registration_inputs(_layer(image, "f"), _layer(image, "m"), moving_mask=_layer(np.ones((2, 6, 7)), "mask"))
    with pytest.raises(ImageValueError, match="layer 'm' is empty: every voxel is 0"):
        registration_inputs(_layer(image, "f"), _layer(np.zeros((6, 7)), "m"))
    with pytest.raises(ImageValueError, match="layer 'mask' is empty: no non-zero voxel"):
        registration_inputs(_layer(image, "f"), _layer(image, "m"), fixed_mask=_layer(np.zeros((6, 7)), "mask"))
    with pytest.raises(ImageValueError, match="layer 'l' holds non-integer values"):
        registration_inputs(_layer(image, "f"), _layer(image, "m"), moving_labels=_layer(image, "l"))

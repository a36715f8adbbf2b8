"""napari_regkit._io, called directly (no viewer, napari not needed): the reader, writers, sample data and manifest,
and napari layers as regkit images (geometry, voxel types and the checks of a registration's inputs)."""

from __future__ import annotations

import importlib
import importlib.util
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import SimpleITK as sitk
import torch
import yaml

from napari_regkit._io import (
    MAX_LABELS,
    image_layer,
    layer_image,
    napari_get_reader,
    pair_layers,
    read_layers,
    registration_inputs,
    write_image_layer,
)
from napari_regkit._logic import napari_affine, to_napari
from regkit.demo import make_pair
from regkit.errors import GeometryError, ImageDimensionError, ImageValueError
from regkit.io import Image, orientation_code, read_image, write_image
from regkit.spatial.grid import Grid
from tests.helpers import write_dicom_series

# ----------------------------------------------------------------------------------------------------------------------
# The reader, the writers, the sample data and the manifest

FORMATS = (".nii.gz", ".mha", ".nrrd")


def _oblique_grid() -> Grid:
    a, b = 0.4, -0.25
    rz = np.array([[np.cos(a), -np.sin(a), 0.0], [np.sin(a), np.cos(a), 0.0], [0.0, 0.0, 1.0]])
    rx = np.array([[1.0, 0.0, 0.0], [0.0, np.cos(b), -np.sin(b)], [0.0, np.sin(b), np.cos(b)]])
    return Grid.create((6, 5, 4), (0.5, 1.25, 2.0), (-90.25, 12.5, 3.0), rz @ rx)


def _las_grid() -> Grid:
    return Grid.create((6, 5, 4), (1.0, 0.5, 2.0), (4.0, 8.0, -16.0), np.diag([1.0, -1.0, 1.0]))


def _assert_places_voxels_like(affine: np.ndarray, grid: Grid) -> None:
    """The napari affine maps data coordinates (k, j, i) to the grid's world point of index (i, j, k), reversed."""
    index = torch.tensor([[0, 0, 0], [5, 0, 0], [0, 4, 0], [0, 0, 3], [5, 4, 3], [2, 1, 3]], dtype=torch.float64)
    data = np.concatenate([index.numpy()[:, ::-1], np.ones((len(index), 1))], axis=1)
    np.testing.assert_allclose((data @ affine.T)[:, :3], to_napari(grid.index_to_world(index)), atol=1e-4)


@pytest.mark.parametrize("ext", FORMATS)
@pytest.mark.parametrize("make_grid", [_oblique_grid, _las_grid])
def test_reader_places_voxels_at_their_world_position(tmp_path: Path, ext: str, make_grid) -> None:
    grid = make_grid()
    values = torch.arange(120, dtype=torch.float32).reshape(grid.shape) / 7
    path = write_image(Image(values, grid), tmp_path / f"scan{ext}")
    reader = napari_get_reader(str(path))
    assert reader is not None
    [(data, meta, kind)] = reader(str(path))
    assert kind == "image" and meta["name"] == "scan"
    np.testing.assert_array_equal(data, values.numpy())
    _assert_places_voxels_like(meta["affine"], grid)


def test_las_file_is_las() -> None:
    assert orientation_code(_las_grid()) == "LAS"


def test_integer_images_with_few_values_open_as_labels(tmp_path: Path) -> None:
    grid = Grid.create((40, 30))
    few = torch.zeros(grid.shape, dtype=torch.int16)
    few[5:10, 5:20] = 3
    many = torch.arange(1200, dtype=torch.int32).reshape(grid.shape)
    paths = [write_image(Image(few, grid), tmp_path / "seg.nrrd"), write_image(Image(many, grid), tmp_path / "ct.mha")]
    kinds = [kind for _, _, kind in read_layers([str(p) for p in paths])]
    assert kinds == ["labels", "image"]
    assert many.unique().numel() > MAX_LABELS


def test_reader_declines_what_regkit_cannot_read(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert napari_get_reader(str(tmp_path / "photo.png")) is None
    assert napari_get_reader(str(tmp_path / "notes.txt")) is None
    assert napari_get_reader(str(tmp_path / "empty")) is None
    assert napari_get_reader([str(tmp_path / "a.nii"), str(tmp_path / "b.tif")]) is None
    assert napari_get_reader([str(tmp_path / "a.nii"), str(tmp_path / "b.nhdr")]) is read_layers


@pytest.mark.parametrize("ext", FORMATS)
def test_writer_round_trips_the_reader(tmp_path: Path, ext: str) -> None:
    grid = _oblique_grid()
    labels = torch.randint(0, 5, grid.shape, dtype=torch.int16, generator=torch.Generator().manual_seed(1))
    [(data, meta, kind)] = read_layers(str(write_image(Image(labels, grid), tmp_path / f"in{ext}")))
    assert kind == "labels"
    [written] = write_image_layer(str(tmp_path / f"out{ext}"), data, meta)
    back = read_image(written)
    assert torch.equal(back.data, labels)
    assert back.grid.size == grid.size
    np.testing.assert_allclose(back.grid.affine(), grid.affine(), atol=1e-4)


def test_writer_composes_scale_translate_and_affine(tmp_path: Path) -> None:
    data = np.arange(12, dtype=np.uint16).reshape(3, 4)  # [y, x]; uint16 is written as int32
    affine = np.array([[-1.0, 0.0, 7.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])  # napari world (y, x): y flipped
    meta = {"affine": affine, "scale": [2.0, 0.5], "translate": [1.0, -3.0]}
    back = read_image(write_image_layer(str(tmp_path / "slice.nrrd"), data, meta)[0])
    np.testing.assert_array_equal(back.data.numpy(), data)
    assert back.data.dtype == torch.int32
    np.testing.assert_allclose(back.grid.spacing, [0.5, 2.0])
    np.testing.assert_allclose(back.grid.origin, [-3.0, 7.0 - 1.0])
    np.testing.assert_allclose(back.grid.direction, [[1.0, 0.0], [0.0, -1.0]])


def test_writer_refuses_shear(tmp_path: Path) -> None:
    with pytest.raises(GeometryError):
        write_image_layer(str(tmp_path / "x.mha"), np.zeros((3, 4)), {"shear": [0.5]})
    assert not (tmp_path / "x.mha").exists()


def test_pair_layers_of_a_small_demo_pair() -> None:
    grid = Grid.create((12, 10, 8), (2.0, 2.0, 2.0), (-10.0, 5.0, 0.0))
    fixed = Image(torch.rand(grid.shape, generator=torch.Generator().manual_seed(0)), grid)
    labels = Image((fixed.data > 0.5).to(torch.uint8), grid)
    layers = pair_layers(make_pair(fixed, labels, seed=3))
    assert [(meta["name"], kind) for _, meta, kind in layers] == [
        ("fixed", "image"),
        ("moving", "image"),
        ("fixed labels", "labels"),
        ("moving labels", "labels"),
    ]
    for data, meta, _ in layers:
        assert data.shape == grid.shape
        _assert_places_voxels_like(meta["affine"], grid)


def _manifest() -> dict:
    return yaml.safe_load((resources.files("napari_regkit") / "napari.yaml").read_text())


def test_manifest_commands_resolve_without_napari() -> None:
    manifest = _manifest()
    commands = manifest["contributions"]["commands"]
    has_napari = importlib.util.find_spec("napari") is not None
    for command in commands:
        assert command["id"].startswith(manifest["name"] + ".")
        module, _, name = command["python_name"].partition(":")
        if module.startswith("napari_regkit._qt") and not has_napari:
            continue  # the widgets need napari (test_widgets.py)
        assert callable(getattr(importlib.import_module(module), name))
    ids = {c["id"] for c in commands}
    contributions = manifest["contributions"]
    used = [item["command"] for key in ("readers", "writers", "sample_data", "widgets") for item in contributions[key]]
    assert set(used) == ids
    assert [w["display_name"] for w in contributions["widgets"]] == ["Registration", "Inspect"]
    assert {w_type for w in contributions["writers"] for w_type in w["layer_types"]} == {"image", "labels"}
    patterns = contributions["readers"][0]["filename_patterns"]
    assert patterns == ["*.nii", "*.nii.gz", "*.mha", "*.mhd", "*.nrrd", "*.nhdr"]


def test_manifest_validates_and_matches_with_npe2(tmp_path: Path) -> None:
    npe2 = pytest.importorskip("npe2")
    manifest = npe2.PluginManifest.from_file(str(resources.files("napari_regkit") / "napari.yaml"))
    assert manifest.name == "regkit"
    plugins = npe2.PluginManager()
    plugins.register(manifest)
    for path in ("scan.nii.gz", "scan.mhd", "scan.nhdr", str(tmp_path)):
        assert [r.command for r in plugins.iter_compatible_readers([path])] == ["regkit.get_reader"]
    assert not list(plugins.iter_compatible_readers(["photo.png"]))
    for layer_type in ("image", "labels"):
        writer, _ = plugins.get_writer("out.nii.gz", [layer_type])
        assert writer is not None and writer.command == "regkit.write_image"


def test_reader_opens_a_dicom_folder(tmp_path: Path) -> None:
    grid = _oblique_grid()
    voxels = (np.arange(120).reshape(grid.shape) * 3 - 40).astype(np.int16)
    itk = sitk.GetImageFromArray(voxels)
    itk.SetSpacing(grid.spacing)
    itk.SetOrigin(grid.origin)
    itk.SetDirection(np.asarray(grid.direction).ravel().tolist())
    write_dicom_series(tmp_path / "series", itk, "1.2.826.0.1.3680043.2.1125.7.201")
    reader = napari_get_reader(str(tmp_path / "series"))
    assert reader is read_layers
    [(data, meta, kind)] = reader(str(tmp_path / "series"))
    assert kind == "labels" and meta["name"] == "series"  # integer, 120 distinct values <= MAX_LABELS
    np.testing.assert_array_equal(data, voxels)
    _assert_places_voxels_like(meta["affine"], grid)


# ----------------------------------------------------------------------------------------------------------------------
# napari layers as regkit images


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

"""The registration and inspect widgets in a real viewer (under Xvfb: pytest-xvfb; napari's make_napari_viewer).

Images are tiny and settings quick, so that a registration takes about a second on a 2-core CPU. The widgets are found
through the plugin manifest by plugin and widget name, as napari's Plugins menu finds them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

napari = pytest.importorskip("napari")
pytest.importorskip("pytestqt")

# A Qt application without a display aborts the whole process, so these tests need one: pytest-xvfb starts Xvfb where
# it is installed (CI installs it), else they skip, unless REGKIT_TEST_DISPLAY=required (CI) makes that an error.
if sys.platform.startswith("linux") and not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
    reason = "no display: the napari widget tests need Xvfb (apt-get install xvfb libgl1 libegl1 libxkbcommon-x11-0)"
    if os.environ.get("REGKIT_TEST_DISPLAY") == "required":
        raise RuntimeError(reason)
    pytest.skip(reason, allow_module_level=True)

from napari_regkit._logic import deformed_grid_lines, grid_step, napari_affine  # noqa: E402
from regkit.config import load_config  # noqa: E402
from regkit.io import Image, read_image, write_image  # noqa: E402
from regkit.registration import register  # noqa: E402
from regkit.results import resample, write_outputs  # noqa: E402
from regkit.spatial.grid import Grid  # noqa: E402
from regkit.transform import Transformation  # noqa: E402
from tests.helpers import gaussian_blobs, rotation  # noqa: E402

TIMEOUT_MS = 60_000
QUICK_CPAB = """\
dim: {dim}
device: cpu
stages:
  - type: affine
    similarity: {{name: ncc}}
    pyramid: [{{shrink: 2, smoothing: 1.0}}, {{shrink: 1, smoothing: 0.0}}]
    optimizer: {{learning_rate: 0.5, iterations: {iterations}, tolerance: 0}}
  - type: cpab
    similarity: {{name: ncc}}
    pyramid: [{{shrink: 2, smoothing: 1.0}}, {{shrink: 1, smoothing: 0.0}}]
    optimizer: {{learning_rate: 0.05, iterations: {iterations}, tolerance: 0}}
    tessellation: [2, 4]
    steps: 5
"""


def _pair(ndim: int) -> tuple[Image, Image, Image]:
    """Fixed and moving images on different grids (the 3D fixed grid oblique), and the moving labels."""
    if ndim == 2:
        fixed_grid = Grid.create((40, 32), (1.5, 1.0), (-20.0, 10.0))
        moving_grid = Grid.create((36, 34), (1.5, 1.0), (-18.0, 11.0))
        centres = [(0.0, 20.0), (12.0, 28.0), (20.0, 18.0)]
        shift = (2.0, -1.5)
    else:
        fixed_grid = Grid.create((18, 16, 14), (2.0, 2.5, 3.0), (-12.0, -10.0, -18.0), rotation(0.3, 3))
        moving_grid = Grid.create((20, 18, 16), (2.0, 2.0, 2.5), (-18.0, -16.0, -20.0))
        centres = [(0.0, 8.0, 0.0), (10.0, 18.0, 6.0), (-6.0, 20.0, -4.0)]
        shift = (2.0, -1.5, 1.0)
    fixed = gaussian_blobs(fixed_grid, centres, 32.0, dtype=torch.float32)  # sigma 4 mm
    shifted = [tuple(c + s for c, s in zip(centre, shift, strict=True)) for centre in centres]
    moving = gaussian_blobs(moving_grid, shifted, 32.0, dtype=torch.float32)
    labels = Image((moving.data > 0.5).to(torch.uint8), moving_grid)
    return fixed, moving, labels


def _viewer_with_pair(make_napari_viewer, ndim: int):
    viewer = make_napari_viewer(show=True)
    fixed, moving, labels = _pair(ndim)
    viewer.add_image(fixed.data.numpy(), affine=napari_affine(fixed.grid), name="fixed")
    viewer.add_image(moving.data.numpy(), affine=napari_affine(moving.grid), name="moving")
    viewer.add_labels(labels.data.numpy(), affine=napari_affine(labels.grid), name="moving labels")
    return viewer, fixed, moving


def _registration_widget(viewer, **values):
    _, widget = viewer.window.add_plugin_dock_widget("regkit", "Registration")
    widget.fixed.value = viewer.layers["fixed"]
    widget.moving.value = viewer.layers["moving"]
    for key, value in values.items():
        getattr(widget, key).value = value
    return widget


def _run(qtbot, widget) -> None:
    widget.start()
    assert widget.worker is not None, widget.status.value
    qtbot.waitUntil(lambda: widget.worker is None, timeout=TIMEOUT_MS)


@pytest.mark.parametrize("ndim", [2, 3])
def test_registration_widget_adds_the_result_layers(make_napari_viewer, qtbot, tmp_path: Path, ndim: int) -> None:
    viewer, fixed, _ = _viewer_with_pair(make_napari_viewer, ndim)
    config = tmp_path / "quick.yaml"
    config.write_text(QUICK_CPAB.format(dim=ndim, iterations=3))
    widget = _registration_widget(viewer, moving_labels=viewer.layers["moving labels"], config_file=config)
    inserted: list[str] = []
    viewer.layers.events.inserted.connect(lambda event: inserted.append(event.value.name))
    _run(qtbot, widget)
    assert widget.status.value.startswith("done"), widget.status.value
    assert widget.progress.value == widget.progress.max

    # a preview after each of the 4 pyramid levels (2 affine, 2 CPAB), then the final layer
    assert inserted.count("moving warped") == 5
    names = [layer.name for layer in viewer.layers]
    expected = [
        "moving warped",
        "moving labels warped",
        "deformed grid",
        "Jacobian determinant",
        "folding (det <= 0)",
        "tessellation",
        "velocity",
    ]
    assert names == ["fixed", "moving", "moving labels", *expected]
    fixed_layer = viewer.layers["fixed"]
    for name in ("moving warped", "moving labels warped", "Jacobian determinant", "folding (det <= 0)"):
        layer = viewer.layers[name]
        assert layer.data.shape == fixed.grid.shape, name
        np.testing.assert_allclose(layer.affine.affine_matrix, napari_affine(fixed.grid), atol=1e-12)
        np.testing.assert_allclose(layer.scale, 1.0)
        np.testing.assert_allclose(layer.extent.world, fixed_layer.extent.world, atol=1e-9)
    assert viewer.layers["moving labels warped"].data.dtype == np.uint8
    assert set(np.unique(viewer.layers["moving labels warped"].data)) <= {0, 1}
    jacobian = viewer.layers["Jacobian determinant"]
    assert (jacobian.data > 0).all() and jacobian.colormap.name == "PiYG"
    assert not viewer.layers["folding (det <= 0)"].data.any()

    step = grid_step(fixed.grid, widget.grid_lines.value)
    grid = viewer.layers["deformed grid"]
    transform = widget.last_run.result.transform
    assert grid.ndim == ndim and set(grid.shape_type) == {"path"}
    expected_lines = deformed_grid_lines(transform, fixed.grid, step)
    assert grid.nshapes == len(expected_lines)
    np.testing.assert_allclose(grid.data[0], expected_lines[0], atol=1e-9)
    for name in ("tessellation", "velocity"):
        vectors = viewer.layers[name].data
        assert vectors.ndim == 3 and vectors.shape[1:] == (2, ndim), name
    # the tessellation covers the fixed image's box (voxel edges) in world space
    ends = viewer.layers["tessellation"].data
    corners = np.concatenate([ends[:, 0], ends[:, 0] + ends[:, 1]])
    box = fixed_layer.extent.world
    assert np.all(corners >= box[0] - 0.5 * np.max(fixed.grid.spacing) - 1e-6)
    assert np.all(corners <= box[1] + 0.5 * np.max(fixed.grid.spacing) + 1e-6)

    # the comparison toggle
    widget.compare.value = "checkerboard"
    assert viewer.layers["comparison"].data.shape == fixed.grid.shape
    widget.compare.value = "difference"
    assert viewer.layers["comparison"].data.min() >= -1.0
    widget.compare.value = "off"
    assert "comparison" not in viewer.layers

    # Save writes the result folder the inspect widget reads
    widget.save_folder.value = tmp_path / "result"
    widget.save()
    qtbot.waitUntil(lambda: widget.status.value.startswith("saved"), timeout=TIMEOUT_MS)
    saved = Transformation.load(tmp_path / "result" / "transform.json")
    np.testing.assert_allclose(saved.matrix, transform.matrix)
    assert (tmp_path / "result" / "warped_labels.nii.gz").exists()


def test_screenshot_after_a_registration_shows_the_grid(make_napari_viewer, qtbot, tmp_path: Path) -> None:
    viewer, _, _ = _viewer_with_pair(make_napari_viewer, 2)
    widget = _registration_widget(viewer, preset="quick-2d", iterations=2)
    _run(qtbot, widget)
    for layer in viewer.layers:
        layer.visible = layer.name in ("moving", "deformed grid")
    viewer.reset_view()
    with_grid = viewer.screenshot(canvas_only=True, flash=False)
    viewer.layers["deformed grid"].visible = False
    without_grid = viewer.screenshot(canvas_only=True, flash=False)

    from PIL import Image as PILImage

    PILImage.fromarray(with_grid).save(tmp_path / "screenshot.png")
    rgb = with_grid[..., :3].astype(int)
    assert rgb.std() > 10  # not blank
    yellow = (rgb[..., 0] > 180) & (rgb[..., 1] > 180) & (rgb[..., 2] < 90)
    assert yellow.mean() > 0.01  # the grid's lines
    rgb_without = without_grid[..., :3].astype(int)
    assert not ((rgb_without[..., 0] > 180) & (rgb_without[..., 1] > 180) & (rgb_without[..., 2] < 90)).any()


def test_cancel_stops_a_running_registration(make_napari_viewer, qtbot, tmp_path: Path) -> None:
    viewer, _, _ = _viewer_with_pair(make_napari_viewer, 2)
    config = tmp_path / "long.yaml"
    config.write_text(QUICK_CPAB.format(dim=2, iterations=100_000))
    widget = _registration_widget(viewer, config_file=config)
    widget.start()
    qtbot.waitUntil(lambda: widget.status.value.startswith("stage"), timeout=TIMEOUT_MS)
    assert widget.cancel_button.enabled and not widget.register_button.enabled
    widget.cancel_button.clicked.emit()
    qtbot.waitUntil(lambda: widget.worker is None, timeout=TIMEOUT_MS)
    assert widget.status.value == "cancelled"
    assert widget.progress.value < widget.progress.max
    assert "deformed grid" not in viewer.layers and widget.last_run is None
    assert widget.register_button.enabled and not widget.cancel_button.enabled

    # the worker's quit() (the cancel button of napari's activity dock) stops it too
    widget.start()
    qtbot.waitUntil(lambda: widget.status.value.startswith("stage"), timeout=TIMEOUT_MS)
    widget.worker.quit()
    qtbot.waitUntil(lambda: widget.worker is None, timeout=TIMEOUT_MS)
    assert widget.status.value == "cancelled" and widget.last_run is None


def test_errors_are_notifications(make_napari_viewer, qtbot, monkeypatch, tmp_path: Path) -> None:
    import napari_regkit._qt._registration as module

    errors: list[str] = []
    monkeypatch.setattr(module, "show_error", errors.append)
    viewer, _, _ = _viewer_with_pair(make_napari_viewer, 2)
    viewer.add_image(np.zeros((6, 8, 9), np.float32), name="volume")
    viewer.add_image(np.zeros((30, 30), np.float32), name="blank")
    widget = _registration_widget(viewer, preset="quick-2d")

    widget.moving.value = viewer.layers["volume"]
    widget.start()
    assert widget.worker is None and "layer 'volume' is 3D but the fixed layer 'fixed' is 2D" in errors[-1]
    widget.moving.value = viewer.layers["blank"]
    widget.start()
    assert widget.worker is None and "layer 'blank' is empty" in errors[-1]
    widget.moving.value = viewer.layers["moving"]
    widget.tessellation.value = "4, x"
    widget.start()
    assert widget.worker is None and "tessellation '4, x'" in errors[-1]

    # an error raised by the engine in the worker: a 3D configuration for 2D images
    widget.tessellation.value = ""
    widget.preset.value = "demo"
    _run(qtbot, widget)
    assert "the configuration is for 3D images but the images are 2D" in errors[-1]
    assert widget.status.value == "failed" and widget.last_run is None


@pytest.fixture
def saved_result(tmp_path: Path) -> tuple[Path, Image, Path]:
    """A registration of the 2D pair written with regkit.results (as ``regkit register`` writes it), and the moving
    image and its file."""
    fixed, moving, _ = _pair(2)
    config = tmp_path / "quick.yaml"
    config.write_text(QUICK_CPAB.format(dim=2, iterations=5))
    result = register(fixed, moving, load_config(config))
    write_outputs(result, tmp_path / "result")
    return tmp_path / "result", moving, write_image(moving, tmp_path / "moving.mha")


def test_inspect_widget_time_slider_play_and_export(make_napari_viewer, qtbot, saved_result, tmp_path: Path) -> None:
    folder, moving, moving_file = saved_result
    viewer = make_napari_viewer(show=True)
    _, widget = viewer.window.add_plugin_dock_widget("regkit", "Inspect")
    widget.result_folder.value = folder
    widget.moving_file.value = moving_file  # opens it as a layer in world space and chooses it
    assert widget.moving.value is viewer.layers["moving"]
    np.testing.assert_allclose(viewer.layers["moving"].affine.affine_matrix, napari_affine(moving.grid), atol=1e-9)
    widget.frames.value = 5
    widget.load()
    qtbot.waitUntil(lambda: widget.worker is None, timeout=TIMEOUT_MS)
    assert len(widget.frames_ready) == 5 and widget.play_button.enabled

    transform = Transformation.load(folder / "transform.json")
    grid = transform.fixed_grid
    step = grid_step(grid, widget.grid_lines.value)
    image, lines = viewer.layers["moving at t"], viewer.layers["flow grid"]
    np.testing.assert_allclose(image.affine.affine_matrix, napari_affine(grid), atol=1e-12)

    widget.t.value = 0.0  # the identity: the moving image where it lies, and the straight lattice
    identity = Transformation(grid, np.eye(3))
    np.testing.assert_allclose(image.data, resample(identity, moving).data.numpy(), atol=1e-6)
    for line, straight in zip(lines.data, deformed_grid_lines(identity, grid, step), strict=True):
        np.testing.assert_allclose(line, straight, atol=1e-4)

    widget.t.value = 1.0  # the saved result
    np.testing.assert_allclose(image.data, read_image(folder / "warped.nii.gz").data.numpy(), atol=1e-4)
    for line, carried in zip(lines.data, deformed_grid_lines(transform, grid, step, inverse=True), strict=True):
        np.testing.assert_allclose(line, carried, atol=1e-4)

    widget.t.value = 0.5
    middle = image.data.copy()
    assert not np.allclose(middle, read_image(folder / "warped.nii.gz").data.numpy(), atol=1e-3)

    widget.fps.value = 50
    widget.play()
    qtbot.waitUntil(lambda: widget.t.value != 0.5, timeout=5_000)
    widget.play()  # stop
    assert widget.play_button.text == "Play"
    widget.t.value = 0.5

    widget.export_path.value = tmp_path / "flow.gif"
    widget.export()
    from PIL import Image as PILImage

    with PILImage.open(tmp_path / "flow.gif") as gif:
        assert gif.n_frames == 5
        pictures = []
        for index in range(gif.n_frames):
            gif.seek(index)
            pictures.append(np.asarray(gif.convert("RGB"), dtype=int))
    assert len({picture.shape for picture in pictures}) == 1 and min(pictures[0].shape[:2]) > 50
    assert np.abs(pictures[0] - pictures[-1]).mean() > 1  # the image and the grid moved between t = 0 and 1
    assert widget.t.value == 0.5  # the slider is back where it was


def test_inspect_widget_errors_are_notifications(make_napari_viewer, monkeypatch, tmp_path: Path) -> None:
    import napari_regkit._qt._inspect as module

    errors: list[str] = []
    monkeypatch.setattr(module, "show_error", errors.append)
    viewer = make_napari_viewer()
    viewer.add_image(np.ones((5, 6), np.float32), name="moving")
    _, widget = viewer.window.add_plugin_dock_widget("regkit", "Inspect")
    widget.result_folder.value = tmp_path
    widget.moving.value = viewer.layers["moving"]
    widget.load()
    assert widget.worker is None and "transform.json: no such file" in errors[-1]


def test_stage_warnings_are_notifications(make_napari_viewer, qtbot, monkeypatch, tmp_path: Path) -> None:
    """What the engine reports going wrong (a discarded CPAB stage, say) becomes a napari warning after the run."""
    import napari_regkit._qt._registration as module
    from regkit.registration import RegistrationResult

    warnings: list[str] = []
    monkeypatch.setattr(module, "show_warning", warnings.append)
    monkeypatch.setattr(RegistrationResult, "stage_warnings", property(lambda self: ["stage 1 (cpab): made it worse"]))
    viewer, _, _ = _viewer_with_pair(make_napari_viewer, 2)
    config = tmp_path / "quick.yaml"
    config.write_text(QUICK_CPAB.format(dim=2, iterations=2))
    widget = _registration_widget(viewer, config_file=config)
    _run(qtbot, widget)
    assert widget.last_run is not None and warnings == ["regkit: stage 1 (cpab): made it worse"]

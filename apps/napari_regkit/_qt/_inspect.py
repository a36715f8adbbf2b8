"""The inspect widget: a saved result's flow phi(x, t) for t in [0, 1], played and exported as an animation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from magicgui.types import FileDialogMode
from magicgui.widgets import ComboBox, Container, FileEdit, FloatSlider, Label, ProgressBar, PushButton, SpinBox
from napari.layers import Image as ImageLayer
from napari.qt.threading import GeneratorWorker, create_worker
from napari.utils.notifications import show_error, show_info
from qtpy.QtCore import QTimer
from qtpy.QtWidgets import QApplication

from napari_regkit._io import image_layer, layer_image, layer_name
from napari_regkit._logic import FlowFrame, flow_frame, grid_step, napari_affine, save_animation
from napari_regkit._qt._layers import layer_choices, path_or_none, show_layer
from regkit.errors import ImageDimensionError, RegkitError
from regkit.io import read_image
from regkit.results import OUTPUT_FILES
from regkit.transform import Transformation

if TYPE_CHECKING:
    from collections.abc import Iterator

    import napari

    from regkit.io import Image

GRID_LAYER = "flow grid"


def _frames(transform: Transformation, moving: Image, count: int, spacing: int) -> Iterator[tuple[int, FlowFrame]]:
    """The frames worker's body: ``(index, frame)`` at ``t = index / (count - 1)``, from t = 0 to 1."""
    for index in range(count):
        yield index, flow_frame(transform, moving, index / (count - 1), spacing)


class InspectWidget(Container):
    """Watch a saved registration happen: the flow phi(x, t) of its transformation for t in [0, 1].

    Load reads ``transform.json`` from a result folder (written by ``regkit register``, the batch runner or the
    registration widget's Save) and computes, in a worker thread, the frames of
    :func:`~napari_regkit._logic.flow_frame` for the chosen moving image layer (or the image file opened with "or open
    it", placed in world space by its header): the moving image resampled through the flow at time t, on the fixed
    grid, and a lattice painted on it that moves with it. The slider t shows a frame (t = 0: the moving image where
    it lies; t = 1: the registration's warped image), Play loops through them, and Export writes the animation
    (``.gif``, or ``.mp4`` with imageio-ffmpeg) from screenshots of the viewer's canvas.
    """

    def __init__(self, napari_viewer: napari.viewer.Viewer) -> None:
        super().__init__(labels=True)
        self._viewer = napari_viewer
        self.extend(
            [
                FileEdit(name="result_folder", label="result folder", mode=FileDialogMode.EXISTING_DIRECTORY),
                ComboBox(name="moving", label="moving image", choices=layer_choices(napari_viewer, ImageLayer)),
                FileEdit(name="moving_file", label="or open it", mode=FileDialogMode.EXISTING_FILE),
                SpinBox(name="frames", label="frames", min=2, max=500, value=21),
                SpinBox(name="grid_lines", label="grid lines", min=2, max=200, value=16),
                PushButton(name="load_button", text="Load"),
                ProgressBar(name="progress", label="frames ready", min=0, max=1, value=0),
                FloatSlider(name="t", label="t", min=0.0, max=1.0, step=0.05, value=0.0),
                SpinBox(name="fps", label="frames per second", min=1, max=60, value=10),
                PushButton(name="play_button", text="Play", enabled=False),
                FileEdit(
                    name="export_path", label="export to", mode=FileDialogMode.OPTIONAL_FILE, filter="*.gif *.mp4"
                ),
                PushButton(name="export_button", text="Export animation", enabled=False),
                Label(name="status", label="status", value="choose a result folder and the moving image"),
            ]
        )
        self.transform: Transformation | None = None  # the loaded transformation
        self.frames_ready: dict[int, FlowFrame] = {}
        self.frame_count = 2
        self.worker: GeneratorWorker | None = None  # the frames worker, while it runs
        self._moving_name = ""
        self._timer = QTimer()
        self._timer.timeout.connect(self._next_frame)
        self.moving_file.changed.connect(self.open_moving)
        self.load_button.changed.connect(self.load)
        self.t.changed.connect(self.show_time)
        self.play_button.changed.connect(self.play)
        self.export_button.changed.connect(self.export)
        for event in (napari_viewer.layers.events.inserted, napari_viewer.layers.events.removed):
            event.connect(self.reset_choices)
        self.reset_choices()
        # napari does not stop workers when it closes: stop ours when the widget is deleted or the application quits
        self.native.destroyed.connect(self._shut_down)
        app = QApplication.instance()
        assert app is not None  # napari made it
        app.aboutToQuit.connect(self._shut_down)

    def _index(self, t: float) -> int:
        return round(t * (self.frame_count - 1))

    # ---- loading -----------------------------------------------------------------------------------------------------

    def open_moving(self) -> None:
        """Open the chosen file as an image layer in world space (:func:`~napari_regkit._io.image_layer`) and choose
        it as the moving image."""
        path = path_or_none(self.moving_file.value)
        if path is None:
            return
        try:
            layer_data = image_layer(read_image(path), layer_name(path), labels=False)
        except RegkitError as err:
            show_error(f"regkit: {err}")
            return
        self.moving.value = show_layer(self._viewer, layer_data)

    def load(self) -> None:
        """Read the result folder's transformation and start computing the frames (errors: a notification)."""
        self.stop()
        self._drop_worker()
        folder, layer = path_or_none(self.result_folder.value), self.moving.value
        if folder is None or layer is None:
            show_error("regkit: choose a result folder and the moving image layer")
            return
        try:
            transform = Transformation.load(folder / OUTPUT_FILES["transform"])
            moving = layer_image(*layer.as_layer_data_tuple()[:2])
            if moving.ndim != transform.ndim:
                raise ImageDimensionError(
                    f"layer '{layer.name}' is {moving.ndim}D but the transformation in {folder} is {transform.ndim}D"
                )
        except RegkitError as err:
            show_error(f"regkit: {err}")
            return
        count = self.frames.value
        self.transform, self.frames_ready, self.frame_count = transform, {}, count
        self._moving_name = layer.name
        self.t.step = 1 / (count - 1)
        self.progress.max, self.progress.value = count, 0
        self.play_button.enabled = self.export_button.enabled = False
        self.status.value = "computing frames"
        spacing = grid_step(transform.fixed_grid, self.grid_lines.value)
        worker = create_worker(_frames, transform, moving, count, spacing, _start_thread=False)
        worker.yielded.connect(self._frame_ready)
        worker.finished.connect(self._frames_done)
        self.worker = worker
        worker.start()

    def _frame_ready(self, item: tuple[int, FlowFrame]) -> None:
        index, frame = item
        self.frames_ready[index] = frame
        self.progress.value = len(self.frames_ready)
        if index == self._index(self.t.value):
            self.show_time()

    def _frames_done(self) -> None:
        self.worker = None
        if len(self.frames_ready) == self.frame_count:
            self.play_button.enabled = self.export_button.enabled = True
            self.status.value = f"{self.frame_count} frames of '{self._moving_name}'"

    @property
    def image_layer_name(self) -> str:
        """Name of the layer that shows the moving image at time t."""
        return f"{self._moving_name} at t"

    # ---- showing -----------------------------------------------------------------------------------------------------

    def show_time(self) -> None:
        """Show the frame nearest to the slider's t (if it is computed): update the image and grid layers."""
        frame = self.frames_ready.get(self._index(self.t.value))
        if frame is None:
            return
        layers = self._viewer.layers
        assert self.transform is not None
        grid = self.transform.fixed_grid
        if self.image_layer_name in layers and layers[self.image_layer_name].data.shape == frame.image.shape:
            layers[self.image_layer_name].data = frame.image
        else:
            meta: dict[str, Any] = {"name": self.image_layer_name, "affine": napari_affine(grid)}
            show_layer(self._viewer, (frame.image, meta, "image"))
        if GRID_LAYER in layers and len(layers[GRID_LAYER].data) == len(frame.grid_lines):
            layers[GRID_LAYER].data = frame.grid_lines
        else:
            style = {"shape_type": "path", "edge_color": "yellow", "edge_width": 0.5 * min(grid.spacing)}
            show_layer(self._viewer, (frame.grid_lines, {"name": GRID_LAYER, **style}, "shapes"))

    def _drop_worker(self) -> None:
        """Stop computing frames, ignoring those still to come."""
        if self.worker is not None:
            self.worker.yielded.disconnect(self._frame_ready)
            self.worker.finished.disconnect(self._frames_done)
            self.worker.quit()
            self.worker = None

    def _shut_down(self, *_: object) -> None:
        self._timer.stop()
        self._drop_worker()

    def play(self) -> None:
        """Start or stop looping through the frames at the chosen frames per second."""
        if self._timer.isActive():
            self.stop()
        else:
            self._timer.start(round(1000 / self.fps.value))
            self.play_button.text = "Stop"

    def stop(self) -> None:
        """Stop playing."""
        self._timer.stop()
        self.play_button.text = "Play"

    def _next_frame(self) -> None:
        index = (self._index(self.t.value) + 1) % self.frame_count
        self.t.value = index / (self.frame_count - 1)

    def export(self) -> None:
        """Write the animation to the chosen file: one screenshot of the canvas per frame, t from 0 to 1."""
        path = path_or_none(self.export_path.value)
        if path is None or len(self.frames_ready) < self.frame_count:
            show_error("regkit: load a result, then choose the file to export to (.gif or .mp4)")
            return
        self.stop()
        start = self.t.value
        pictures = []
        for index in range(self.frame_count):
            self.t.value = index / (self.frame_count - 1)
            self.show_time()
            pictures.append(self._viewer.screenshot(canvas_only=True, flash=False))
        self.t.value = start
        try:
            written = save_animation(pictures, path, fps=self.fps.value)
        except RegkitError as err:
            show_error(f"regkit: {err}")
            return
        self.status.value = f"exported {written.name}"
        show_info(f"regkit: animation written to {written}")

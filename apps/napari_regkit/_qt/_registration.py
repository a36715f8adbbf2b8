"""The registration dock widget: choose layers and settings, register in a worker thread, show the result."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from magicgui.types import FileDialogMode
from magicgui.widgets import ComboBox, Container, FileEdit, Label, LineEdit, ProgressBar, PushButton, SpinBox
from napari.layers import Image as ImageLayer
from napari.layers import Labels as LabelsLayer
from napari.qt.threading import FunctionWorker, create_worker
from napari.utils.notifications import show_error, show_info, show_warning
from qtpy.QtWidgets import QApplication
from superqt.utils import ensure_main_thread

from napari_regkit._io import registration_inputs
from napari_regkit._logic import (
    COMPARISONS,
    RegistrationRun,
    RunSettings,
    build_config,
    comparison_layer,
    parse_schedule,
    progress_fraction,
    progress_text,
    run_registration,
)
from napari_regkit._qt._layers import layer_choices, path_or_none, show_layer
from regkit.config import SIMILARITIES, list_presets
from regkit.errors import RegkitError
from regkit.registration import Cancelled, Progress
from regkit.results import write_outputs

if TYPE_CHECKING:
    import napari
    from napari.types import LayerData

    from regkit.config import RegistrationConfig
    from regkit.io import RegistrationInputs

DEFAULT_PRESET = "default for the image dimension"
FROM_CONFIG = "from the configuration"
_PROGRESS_STEPS = 1000


def _devices() -> list[str]:
    cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return [FROM_CONFIG, "auto", "cpu", *cuda]


class RegistrationWidget(Container):
    """Register a moving image layer to a fixed image layer with regkit (``regkit.registration.register``).

    Settings: a preset or YAML configuration, and overrides of its tessellation schedule, similarity, iterations and
    device (:class:`~napari_regkit._logic.RunSettings`). The registration runs in a napari ``thread_worker``: the
    progress bar shows stage, level, iteration and similarity, the warped image is updated after every pyramid level,
    and Cancel stops the run at the next iteration. When it ends, the layers of
    :func:`~napari_regkit._logic.result_layers` are added (replacing those of an earlier run); the comparison chooser
    shows a checkerboard or a difference of the fixed and warped images, and Save writes the result folder
    (:func:`regkit.results.write_outputs`) that the inspect widget reads. Errors are napari notifications.
    """

    def __init__(self, napari_viewer: napari.viewer.Viewer) -> None:
        super().__init__(labels=True)
        self._viewer = napari_viewer
        images, labels = layer_choices(napari_viewer, ImageLayer), layer_choices(napari_viewer, LabelsLayer)
        self.extend(
            [
                ComboBox(name="fixed", label="fixed image", choices=images),
                ComboBox(name="moving", label="moving image", choices=images),
                ComboBox(name="moving_labels", label="moving labels", choices=labels, nullable=True, value=None),
                ComboBox(name="fixed_mask", label="fixed mask", choices=labels, nullable=True, value=None),
                ComboBox(name="moving_mask", label="moving mask", choices=labels, nullable=True, value=None),
                ComboBox(name="preset", label="preset", choices=[DEFAULT_PRESET, *list_presets()]),
                FileEdit(
                    name="config_file", label="or YAML file", mode=FileDialogMode.EXISTING_FILE, filter="*.yaml *.yml"
                ),
                LineEdit(
                    name="tessellation",
                    label="tessellation",
                    tooltip="CPAB cells per axis at each pyramid level, coarse to fine, e.g. '4, 8' "
                    "(empty: from the configuration)",
                ),
                ComboBox(name="similarity", label="similarity", choices=[FROM_CONFIG, *SIMILARITIES]),
                SpinBox(
                    name="iterations",
                    label="iterations",
                    min=0,
                    max=100_000,
                    value=0,
                    tooltip="Iteration cap at every pyramid level (0: from the configuration)",
                ),
                ComboBox(name="device", label="device", choices=_devices()),
                SpinBox(
                    name="grid_lines",
                    label="grid lines",
                    min=2,
                    max=200,
                    value=16,
                    tooltip="Deformed-grid lines (and velocity vectors) along the longest axis",
                ),
                PushButton(name="register_button", text="Register"),
                PushButton(name="cancel_button", text="Cancel", enabled=False),
                ProgressBar(name="progress", label="progress", min=0, max=_PROGRESS_STEPS, value=0),
                Label(name="status", label="status", value="ready"),
                ComboBox(name="compare", label="compare", choices=["off", *COMPARISONS]),
                FileEdit(name="save_folder", label="result folder", mode=FileDialogMode.EXISTING_DIRECTORY),
                PushButton(name="save_button", text="Save result", enabled=False),
            ]
        )
        self._stop = threading.Event()
        self._closed = False
        self.worker: FunctionWorker | None = None  # the running registration's worker, if any
        self.last_run: RegistrationRun | None = None
        # napari does not stop workers when it closes: stop ours when the widget is deleted or the application quits
        self.native.destroyed.connect(self._shut_down)
        app = QApplication.instance()
        assert app is not None  # napari made it
        app.aboutToQuit.connect(self._shut_down)
        self.register_button.changed.connect(self.start)
        self.cancel_button.changed.connect(self.cancel)
        self.compare.changed.connect(self._show_comparison)
        self.save_button.changed.connect(self.save)
        for event in (napari_viewer.layers.events.inserted, napari_viewer.layers.events.removed):
            event.connect(self.reset_choices)
        self.reset_choices()

    # ---- settings --------------------------------------------------------------------------------------------------

    def settings(self) -> RunSettings:
        """The :class:`~napari_regkit._logic.RunSettings` the controls describe (ConfigError for a bad schedule)."""
        config: str | Path | None = path_or_none(self.config_file.value)
        if config is None and self.preset.value != DEFAULT_PRESET:
            config = self.preset.value
        return RunSettings(
            config=config,
            tessellation=parse_schedule(self.tessellation.value),
            similarity=None if self.similarity.value == FROM_CONFIG else self.similarity.value,
            iterations=self.iterations.value or None,
            device=None if self.device.value == FROM_CONFIG else self.device.value,
        )

    # ---- running -----------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Check the inputs and settings, then start the registration worker (errors: a notification)."""
        if self.worker is not None:
            return
        fixed, moving = self.fixed.value, self.moving.value
        if fixed is None or moving is None:
            show_error("regkit: choose the fixed and the moving image layers")
            return
        optional = {key: getattr(self, key).value for key in ("moving_labels", "fixed_mask", "moving_mask")}
        try:
            inputs = registration_inputs(
                fixed.as_layer_data_tuple(),
                moving.as_layer_data_tuple(),
                **{key: None if layer is None else layer.as_layer_data_tuple() for key, layer in optional.items()},
            )
            config = build_config(self.settings(), inputs.fixed.ndim)
        except RegkitError as err:
            show_error(f"regkit: {err}")
            return
        labels = optional["moving_labels"]
        self._stop.clear()
        worker = create_worker(
            _register,
            inputs,
            config,
            moving_name=moving.name,
            labels_name=labels.name if labels is not None else "labels",
            grid_lines=self.grid_lines.value,
            progress=self._show_progress,
            preview=self._show_preview,
            should_stop=self._should_stop,
            _start_thread=False,
        )
        worker.returned.connect(self._finish)
        worker.finished.connect(self._finished)
        self.register_button.enabled, self.cancel_button.enabled = False, True
        self.progress.value = 0
        self.status.value = "starting"
        self.worker = worker
        worker.start()

    def cancel(self) -> None:
        """Ask the running registration to stop at its next iteration."""
        if self.worker is not None:
            self._stop.set()
            self.status.value = "cancelling"

    def _should_stop(self) -> bool:
        """Polled by the engine in the worker thread: Cancel, the worker's ``quit()`` (napari's activity dock), or
        the widget's destruction stop the registration."""
        worker = self.worker
        return self._stop.is_set() or (worker is not None and worker.abort_requested)

    def _shut_down(self, *_: object) -> None:
        self._closed = True
        self._stop.set()

    @ensure_main_thread
    def _show_progress(self, p: Progress) -> None:
        if self.worker is None or self._closed:
            return
        self.progress.value = round(progress_fraction(p) * _PROGRESS_STEPS)
        self.status.value = progress_text(p)

    @ensure_main_thread
    def _show_preview(self, layer_data: LayerData) -> None:
        if self.worker is not None and not self._should_stop():
            show_layer(self._viewer, layer_data)

    def _finish(self, outcome: RegistrationRun | _Failure) -> None:
        if self._closed:
            return
        if isinstance(outcome, _Failure):
            cancelled = isinstance(outcome.error, Cancelled)
            self.status.value = "cancelled" if cancelled else "failed"
            (show_info if cancelled else show_error)(f"regkit: {outcome.error}")
        else:
            self.last_run = outcome
            for layer_data in outcome.layers:
                show_layer(self._viewer, layer_data)
            self.progress.value = _PROGRESS_STEPS
            self.status.value = f"done in {outcome.result.seconds:.1f} s on {outcome.result.device}"
            self.save_button.enabled = True
            self._show_comparison()
            for warning in outcome.result.stage_warnings:
                show_warning(f"regkit: {warning}")

    def _finished(self) -> None:
        if self._closed:
            return
        if self.worker is not None and self.worker.abort_requested:  # quit(): the worker returns nothing
            self.status.value = "cancelled"
        self.worker = None
        self.register_button.enabled, self.cancel_button.enabled = True, False

    # ---- after a run -------------------------------------------------------------------------------------------------

    def _show_comparison(self) -> None:
        if self.last_run is None:
            return
        if self.compare.value == "off":
            if "comparison" in self._viewer.layers:
                self._viewer.layers.remove("comparison")
            return
        result = self.last_run.result
        warped = self.last_run.layers[0][0]
        show_layer(self._viewer, comparison_layer(result.fixed, warped, self.compare.value))

    def save(self) -> None:
        """Write the last result (and warped labels) into the chosen folder, replacing an earlier result there."""
        folder = path_or_none(self.save_folder.value)
        if self.last_run is None or folder is None:
            show_error("regkit: register first, then choose the result folder")
            return
        run = self.last_run
        worker = create_worker(_save, run, folder, _start_thread=False)
        worker.returned.connect(self._saved)
        self.save_button.enabled = False
        worker.start()

    def _saved(self, outcome: Path | _Failure) -> None:
        if self._closed:
            return
        self.save_button.enabled = True
        if isinstance(outcome, _Failure):
            show_error(f"regkit: {outcome.error}")
        else:
            self.status.value = f"saved to {outcome}"
            show_info(f"regkit: result saved to {outcome}")


@dataclass(frozen=True)
class _Failure:
    """A user error (or cancellation) that ended a worker: returned, not raised, so that it becomes a notification
    rather than napari's traceback report (which the workers give any raised exception)."""

    error: RegkitError


def _register(inputs: RegistrationInputs, config: RegistrationConfig, **kwargs: Any) -> RegistrationRun | _Failure:
    """The registration worker's body: :func:`~napari_regkit._logic.run_registration`."""
    try:
        return run_registration(inputs, config, **kwargs)
    except RegkitError as err:
        return _Failure(err)


def _save(run: RegistrationRun, folder: Path) -> Path | _Failure:
    """The save worker's body: :func:`regkit.results.write_outputs` into ``folder``."""
    try:
        write_outputs(run.result, folder, moving_labels=run.moving_labels, overwrite=True)
    except RegkitError as err:
        return _Failure(err)
    return folder
